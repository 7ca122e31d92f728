#include "text/normalizer.h"

#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/ustring.h>
#include <unicode/utf16.h>

#include "util/error.h"
#include "util/json_fields.h"
#include "util/utf8.h"

namespace tandem::text {

struct Normalizer::Step {
  virtual ~Step() = default;
  virtual void apply(std::string& text) const = 0;
};

namespace {

bool is_ascii(std::string_view s) {
  for (unsigned char c : s)
    if (c >= 0x80) return false;
  return true;
}

class UnicodeForm : public Normalizer::Step {
 public:
  UnicodeForm(const std::string& type, const std::string& where) {
    UErrorCode ec = U_ZERO_ERROR;
    if (type == "NFC") norm_ = icu::Normalizer2::getNFCInstance(ec);
    if (type == "NFD") norm_ = icu::Normalizer2::getNFDInstance(ec);
    if (type == "NFKC") norm_ = icu::Normalizer2::getNFKCInstance(ec);
    if (type == "NFKD") norm_ = icu::Normalizer2::getNFKDInstance(ec);
    if (U_FAILURE(ec) || !norm_) throw Error(where + ": ICU has no " + type + " normalizer");
  }
  void apply(std::string& text) const override {
    if (is_ascii(text)) return;  // ASCII is invariant under all four forms
    UErrorCode ec = U_ZERO_ERROR;
    if (norm_->isNormalizedUTF8(text, ec) && U_SUCCESS(ec)) return;
    ec = U_ZERO_ERROR;
    std::string out;
    icu::StringByteSink<std::string> sink(&out);
    norm_->normalizeUTF8(0, text, sink, nullptr, ec);
    if (U_FAILURE(ec)) throw Error(std::string("normalization failed: ") + u_errorName(ec));
    text = std::move(out);
  }

 private:
  const icu::Normalizer2* norm_ = nullptr;
};

// Each character's full lowercase mapping on its own, as HF's Lowercase does with Rust's
// char::to_lowercase: no context, so a final capital sigma becomes σ, not the ς that ICU's
// string lowercasing writes at the end of a word.
class Lowercase : public Normalizer::Step {
 public:
  void apply(std::string& text) const override {
    std::string out;
    out.reserve(text.size());
    for (size_t i = 0; i < text.size();) {
      const auto b = static_cast<unsigned char>(text[i]);
      const size_t len = b < 0x80 ? 1 : utf8::valid_sequence_length(text, i);
      if (b < 0x80 || len == 0) {  // the tokenizer checks UTF-8 before normalizing
        out += b >= 'A' && b <= 'Z' ? static_cast<char>(b + 32) : text[i];
        ++i;
        continue;
      }
      UChar one[2], lower[8];
      int32_t n = 0;
      U16_APPEND_UNSAFE(one, n, static_cast<UChar32>(utf8::decode_at(text, i, len)));
      UErrorCode ec = U_ZERO_ERROR;
      const int32_t m = u_strToLower(lower, 8, one, n, "", &ec);
      if (U_FAILURE(ec)) {
        out.append(text, i, len);
      } else {
        for (int32_t k = 0; k < m;) {
          UChar32 c;
          U16_NEXT(lower, k, m, c);
          utf8::append(out, static_cast<char32_t>(c));
        }
      }
      i += len;
    }
    text = std::move(out);
  }
};

class ReplaceLiteral : public Normalizer::Step {
 public:
  ReplaceLiteral(std::string from, std::string to) : from_(std::move(from)), to_(std::move(to)) {}
  void apply(std::string& text) const override {
    if (from_.empty()) return;
    std::string out;
    size_t pos = 0;
    for (size_t hit; (hit = text.find(from_, pos)) != std::string::npos; pos = hit + from_.size())
      out.append(text, pos, hit - pos).append(to_);
    out.append(text, pos);
    text = std::move(out);
  }

 private:
  std::string from_, to_;
};

class Prepend : public Normalizer::Step {
 public:
  explicit Prepend(std::string prefix) : prefix_(std::move(prefix)) {}
  void apply(std::string& text) const override {
    if (!text.empty()) text.insert(0, prefix_);
  }

 private:
  std::string prefix_;
};

// The steps of the normalizer at `path` in `origin` (tokenizer.json).
void add_steps(const nlohmann::json& cfg, const std::string& origin, const std::string& path,
               std::vector<std::unique_ptr<Normalizer::Step>>& steps) {
  if (cfg.is_null()) return;
  const std::string where = origin + ": " + path;
  if (!cfg.is_object() || !cfg.contains("type"))
    throw Error(where + ": expected an object with a 'type'");
  // tokenizers reads these with serde: null is a value of the wrong type.
  constexpr auto kNull = Fields::Null::kWrongType;
  auto f = Fields::lenient(cfg, origin, path);
  const auto type = f.string("type", kNull);
  if (type == "Sequence") {
    const auto& list = f.list("normalizers", kNull);
    for (size_t i = 0; i < list.size(); ++i)
      add_steps(list[i], origin, f.path_of("normalizers") + "[" + std::to_string(i) + "]", steps);
  } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    steps.push_back(std::make_unique<UnicodeForm>(type, where));
  } else if (type == "Lowercase") {
    steps.push_back(std::make_unique<Lowercase>());
  } else if (type == "Replace") {
    const auto& pat = f.object("pattern", kNull);
    auto pattern = Fields::lenient(pat, origin, f.path_of("pattern"));
    if (!pat.contains("String"))
      throw Error(where + ": Replace with a regex pattern is not supported");
    steps.push_back(std::make_unique<ReplaceLiteral>(pattern.string("String", kNull),
                                                     f.string("content", kNull)));
  } else if (type == "Prepend") {
    steps.push_back(std::make_unique<Prepend>(f.string("prepend", kNull)));
  } else {
    throw Error(where + ": normalizer type '" + type + "' is not supported");
  }
}

}  // namespace

Normalizer::Normalizer(const nlohmann::json& config, const std::string& origin) {
  add_steps(config, origin, "normalizer", steps_);
}

Normalizer::~Normalizer() = default;

std::string Normalizer::apply(std::string_view text) const {
  std::string out(text);
  for (const auto& step : steps_) step->apply(out);
  return out;
}

}  // namespace tandem::text
