#include "bench/workload.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <memory>
#include <sstream>

#include <nlohmann/json.hpp>

#include "bench/rng.h"
#include "text/token_text.h"
#include "util/error.h"
#include "util/file.h"
#include "util/hash.h"

namespace tandem::bench {
namespace {

using nlohmann::json;

bool is_ascii_letter(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}

void require(bool ok, const std::string& message) {
  if (!ok) throw Error(message);
}

// Appends `count` tokens drawn uniformly from the vocabulary.
void append_random(const TokenVocab& vocab, Rng& rng, int64_t count, std::vector<int32_t>& out) {
  for (int64_t i = 0; i < count; ++i) out.push_back(vocab.id(rng.below(vocab.size())));
}

BenchRequest make_request(const TokenVocab& vocab, std::vector<int32_t> ids, int64_t output_len) {
  BenchRequest r;
  r.prompt_text = vocab.render(ids);
  r.prompt_ids = std::move(ids);
  r.output_len = output_len;
  return r;
}

// Independent streams for independent parts of a workload (one per request, per hash block),
// so a request's content does not depend on which other requests the window holds.
uint64_t stream_seed(uint64_t seed, uint64_t kind, uint64_t index) {
  return hash_u64(hash_u64(seed ^ (kind * 0x9e3779b97f4a7c15ULL)) + index);
}

constexpr uint64_t kStreamMooncakeBlock = 1;
constexpr uint64_t kStreamAzureRequest = 2;

// A token count in 1..kMaxRequestTokens; an error quotes the number as written (a value past
// int64, read back as one, said "got -1").
int64_t get_length(const json& object, const char* field, const std::string& where) {
  const auto it = object.find(field);
  require(it != object.end() && it->is_number_integer(),
          where + ": field \"" + field + "\" must be an integer");
  const bool fits = it->is_number_unsigned()
                        ? it->get<uint64_t>() <= static_cast<uint64_t>(kMaxRequestTokens) &&
                              it->get<uint64_t>() >= 1
                        : it->get<int64_t>() >= 1 && it->get<int64_t>() <= kMaxRequestTokens;
  require(fits, where + ": " + field + " must be in 1.." + std::to_string(kMaxRequestTokens) +
                    ", got " + it->dump());
  return it->get<int64_t>();
}

// A number as the user wrote it, near enough: no trailing zeros, no fixed six decimals.
std::string number(double v) {
  std::ostringstream out;
  out.precision(15);
  out << v;
  return out.str();
}

// A record `offset_s` after the window's first, replayed at the window's time scale, must be
// sent within kMaxArrivalSeconds: the clocks that schedule it count int64 nanoseconds.
void check_arrival(const std::string& at, double offset_s, const TraceWindow& w) {
  require(offset_s * w.time_scale <= kMaxArrivalSeconds,
          at + ": this record would be sent " + number(offset_s * w.time_scale) +
              " s after the window's first (time scale " + number(w.time_scale) +
              "); expected at most " + number(kMaxArrivalSeconds) + " s");
}

// A trace window made whole holds every prompt at once: refused at the record whose prompt takes
// the window past `max_tokens`, naming its line, before anything is made.
template <typename Record, typename Tokens>
void check_window_tokens(const std::string& what, const std::vector<Record>& records,
                         Tokens tokens_of, int64_t max_tokens) {
  int64_t total = 0;
  for (size_t i = 0; i < records.size(); ++i) {
    total += tokens_of(records[i]);  // each at most kMaxRequestTokens: no overflow
    require(total <= max_tokens,
            what + ":" + std::to_string(records[i].line) + ": the window's first " +
                std::to_string(i + 1) + " records, up to this one, hold " + std::to_string(total) +
                " prompt tokens; a workload made whole (ids and text in memory) holds at most " +
                std::to_string(max_tokens) + ": replay a shorter window");
  }
}

void validate_window(const TraceWindow& w, const std::string& what) {
  require(w.start >= 0, what + ": window start must be >= 0, got " + std::to_string(w.start));
  require(w.limit >= 0, what + ": window limit must be >= 0, got " + std::to_string(w.limit));
  require(std::isfinite(w.time_scale) && w.time_scale >= 0,
          what + ": time scale must be a finite number >= 0");
}

// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's days_from_civil).
int64_t days_from_civil(int64_t y, int64_t m, int64_t d) {
  y -= m <= 2;
  const int64_t era = (y >= 0 ? y : y - 399) / 400;
  const int64_t yoe = y - era * 400;
  const int64_t doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
  const int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
  return era * 146097 + doe - 719468;
}

bool is_leap(int64_t y) {
  return (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
}

int64_t days_in_month(int64_t y, int64_t m) {
  static constexpr int kDays[] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
  return m == 2 && is_leap(y) ? 29 : kDays[m - 1];
}

// The value of the `width` decimal digits at s[pos] (no sign, no space), or -1.
int64_t digits_at(const std::string& s, size_t pos, size_t width) {
  if (pos + width > s.size()) return -1;
  int64_t v = 0;
  for (size_t i = pos; i < pos + width; ++i) {
    if (s[i] < '0' || s[i] > '9') return -1;
    v = v * 10 + (s[i] - '0');
  }
  return v;
}

// "YYYY-MM-DD HH:MM:SS[.fffffff]" -> whole seconds since the epoch and the fraction, kept apart
// so that offsets keep sub-microsecond precision. Every field has exactly its digits (sscanf's
// %2d would take "-9" or " 9") and the date must exist.
bool parse_timestamp(const std::string& s, int64_t& seconds, double& fraction) {
  if (s.size() < 19 || s[4] != '-' || s[7] != '-' || s[10] != ' ' || s[13] != ':' || s[16] != ':')
    return false;
  const int64_t y = digits_at(s, 0, 4), mo = digits_at(s, 5, 2), d = digits_at(s, 8, 2),
                h = digits_at(s, 11, 2), mi = digits_at(s, 14, 2), sec = digits_at(s, 17, 2);
  if (y < 0 || mo < 1 || mo > 12 || d < 1 || d > days_in_month(y, mo) || h < 0 || h > 23 ||
      mi < 0 || mi > 59 || sec < 0 || sec > 60)  // 60: a leap second
    return false;
  seconds = days_from_civil(y, mo, d) * 86400 + h * 3600 + mi * 60 + sec;
  fraction = 0;
  if (s.size() > 19) {
    if (s[19] != '.' || s.size() == 20) return false;
    double scale = 0.1;
    for (size_t i = 20; i < s.size(); ++i) {
      if (s[i] < '0' || s[i] > '9') return false;
      fraction += (s[i] - '0') * scale;
      scale /= 10;
    }
  }
  return true;
}

// A CSV header's columns at most: a line of 64 MiB could hold 60 million empty ones, each a
// string when split (3 GB), where the Azure traces have three.
constexpr size_t kMaxCsvColumns = 1024;

size_t csv_field_count(const std::string& line) {
  return static_cast<size_t>(std::count(line.begin(), line.end(), ',')) + 1;
}

// The cells of a line whose field count was checked (bounded): the Azure traces hold plain
// numbers and timestamps, no quoting to handle.
std::vector<std::string> split_csv_line(const std::string& line) {
  std::vector<std::string> cells;
  size_t from = 0;
  for (size_t comma; (comma = line.find(',', from)) != std::string::npos; from = comma + 1)
    cells.push_back(line.substr(from, comma - from));
  cells.push_back(line.substr(from));
  return cells;
}

bool parse_int(const std::string& s, int64_t& value) {
  if (s.empty()) return false;
  size_t pos = 0;
  try {
    value = std::stoll(s, &pos);
  } catch (const std::exception&) {
    return false;
  }
  return pos == s.size();
}

}  // namespace

std::string excerpt(std::string_view text) {
  constexpr size_t kBytes = 40;
  if (text.size() <= kBytes) return "\"" + std::string(text) + "\"";
  size_t cut = kBytes;
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  return "\"" + std::string(text.substr(0, cut)) + "...\"";
}

std::string json_error_text(const std::exception& error) {
  // nlohmann: "... parse error at line L, column C: syntax error while parsing value - <what>;
  // last read: '<token>'", maybe followed by "; expected <a token type>".
  const std::string what = error.what();
  constexpr std::string_view kRead = "; last read: '";
  const size_t read = what.find(kRead);
  if (read == std::string::npos) return what.size() <= 400 ? what : what.substr(0, 400) + "...";
  const size_t token = read + kRead.size();
  size_t end = what.rfind("'; expected ");
  if (end == std::string::npos || end < token || what.size() - end > 64) end = what.size() - 1;
  return what.substr(0, read) +
         "; last read: " + excerpt(std::string_view(what).substr(token, end - token)) +
         what.substr(end + 1);
}

void check_input_file(const std::filesystem::path& path, const std::string& what) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (!std::filesystem::exists(status))
    throw Error(what + ": no such file" + (ec ? " (" + ec.message() + ")" : std::string()));
  if (std::filesystem::is_directory(status)) throw Error(what + ": is a directory, not a file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(what + ": cannot open the file");
}

bool read_line(std::istream& in, std::string& line, const std::string& what, int64_t line_no) {
  line.clear();
  std::streambuf* buf = in.rdbuf();
  bool any = false;
  for (;;) {
    int c = 0;
    try {
      c = buf->sbumpc();
    } catch (const std::exception& e) {
      // A stream buffer reports a failed read (EISDIR, EIO) by throwing, with the library's words.
      throw Error(what + ":" + std::to_string(line_no) + ": cannot read the file (" + e.what() +
                  ")");
    }
    if (c == std::char_traits<char>::eof()) {
      in.setstate(std::ios::eofbit);
      break;
    }
    any = true;
    if (c == '\n') break;
    // std::getline would grow the string until memory runs out on a file without newlines.
    if (line.size() >= kMaxLineBytes)
      throw Error(what + ":" + std::to_string(line_no) + ": line longer than " +
                  std::to_string(kMaxLineBytes >> 20) + " MiB (a file of records, one per line?)");
    line.push_back(static_cast<char>(c));
  }
  if (!line.empty() && line.back() == '\r') line.pop_back();
  return any;
}

// --- TokenVocab ----------------------------------------------------------------------------

TokenVocab TokenVocab::build(const text::Tokenizer& tokenizer) {
  TokenVocab v;
  const size_t n = tokenizer.vocab_size();
  v.text_by_id_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const auto id = static_cast<int32_t>(i);
    if (tokenizer.is_special(id) || !text::has_text(tokenizer, id)) continue;
    std::string bytes = tokenizer.token_bytes(id);
    if (bytes.size() < 2 || bytes[0] != ' ') continue;
    bool letters = true;
    for (size_t k = 1; k < bytes.size() && letters; ++k) letters = is_ascii_letter(bytes[k]);
    if (!letters) continue;
    const auto ids = tokenizer.encode(bytes, false);
    if (ids.size() != 1 || ids[0] != id) continue;
    v.ids_.push_back(id);
    v.text_by_id_[i] = std::move(bytes);
  }
  require(v.ids_.size() >= 1000,
          "bench: the tokenizer has only " + std::to_string(v.ids_.size()) +
              " text-safe tokens (a space and ASCII letters that encode back to one id); "
              "expected at least 1000");
  return v;
}

bool TokenVocab::contains(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < text_by_id_.size() && !text_by_id_[id].empty();
}

std::string TokenVocab::render(std::span<const int32_t> ids) const {
  std::string out;
  out.reserve(ids.size() * 6);
  for (int32_t id : ids) {
    require(contains(id), "bench: token id " + std::to_string(id) + " is not text-safe");
    out += text_by_id_[id];
  }
  return out;
}

// --- random --------------------------------------------------------------------------------

std::vector<BenchRequest> random_workload(const TokenVocab& vocab, const RandomOptions& o) {
  require(o.num_requests >= 0 && o.num_requests <= kMaxRequests,
          "random workload: num_requests must be in 0.." + std::to_string(kMaxRequests) + ", got " +
              std::to_string(o.num_requests));
  require(o.range_ratio >= 0.0 && o.range_ratio < 1.0,
          "random workload: range_ratio must be in [0, 1), got " + std::to_string(o.range_ratio));
  require(o.input_len >= 0 && o.input_len <= kMaxRequestTokens,
          "random workload: input_len must be in 1.." + std::to_string(kMaxRequestTokens) +
              ", got " + std::to_string(o.input_len));
  require(o.output_len >= 0 && o.output_len <= kMaxRequestTokens,
          "random workload: output_len must be in 0.." + std::to_string(kMaxRequestTokens) +
              ", got " + std::to_string(o.output_len));
  require(o.num_special_tokens >= 0, "random workload: num_special_tokens must be >= 0");
  const double input =
      static_cast<double>(std::max<int64_t>(0, o.input_len - o.num_special_tokens));
  const double output = static_cast<double>(o.output_len);
  const auto in_low = static_cast<int64_t>(std::floor(input * (1 - o.range_ratio)));
  const auto in_high = static_cast<int64_t>(std::ceil(input * (1 + o.range_ratio)));
  const auto out_low =
      std::max<int64_t>(1, static_cast<int64_t>(std::floor(output * (1 - o.range_ratio))));
  const auto out_high =
      std::max<int64_t>(1, static_cast<int64_t>(std::ceil(output * (1 + o.range_ratio))));
  require(in_low >= 1, "random workload: input_len " + std::to_string(o.input_len) +
                           " leaves prompts of " + std::to_string(in_low) +
                           " tokens; expected at least 1");
  require(in_high <= kMaxRequestTokens && out_high <= kMaxRequestTokens,
          "random workload: with range_ratio " + std::to_string(o.range_ratio) +
              " a request may have " + std::to_string(std::max(in_high, out_high)) +
              " tokens; expected at most " + std::to_string(kMaxRequestTokens));

  Rng rng(o.seed);
  std::vector<BenchRequest> out;
  out.reserve(o.num_requests);
  for (int64_t i = 0; i < o.num_requests; ++i) {
    const int64_t in_len = rng.between(in_low, in_high);
    const int64_t out_len = rng.between(out_low, out_high);
    std::vector<int32_t> ids;
    ids.reserve(in_len);
    append_random(vocab, rng, in_len, ids);
    out.push_back(make_request(vocab, std::move(ids), out_len));
  }
  return out;
}

// --- prefix_repetition ---------------------------------------------------------------------

std::vector<BenchRequest> prefix_repetition_workload(const TokenVocab& vocab,
                                                     const PrefixRepetitionOptions& o) {
  require(o.num_prefixes >= 1, "prefix_repetition workload: num_prefixes must be >= 1");
  require(
      o.num_requests <= kMaxRequests,
      "prefix_repetition workload: num_requests must be at most " + std::to_string(kMaxRequests));
  require(o.prefix_len >= 0 && o.suffix_len >= 0 && o.prefix_len <= kMaxRequestTokens &&
              o.suffix_len <= kMaxRequestTokens && o.prefix_len + o.suffix_len >= 1 &&
              o.prefix_len + o.suffix_len <= kMaxRequestTokens,
          "prefix_repetition workload: prefix_len and suffix_len must be >= 0, with a sum in 1.." +
              std::to_string(kMaxRequestTokens));
  require(
      o.output_len >= 1 && o.output_len <= kMaxRequestTokens,
      "prefix_repetition workload: output_len must be in 1.." + std::to_string(kMaxRequestTokens));
  const int64_t per_prefix = o.num_requests / o.num_prefixes;
  require(per_prefix >= 1, "prefix_repetition workload: num_requests (" +
                               std::to_string(o.num_requests) + ") must be >= num_prefixes (" +
                               std::to_string(o.num_prefixes) + ")");
  Rng rng(o.seed);
  std::vector<BenchRequest> out;
  out.reserve(per_prefix * o.num_prefixes);
  for (int64_t p = 0; p < o.num_prefixes; ++p) {
    std::vector<int32_t> prefix;
    append_random(vocab, rng, o.prefix_len, prefix);
    for (int64_t k = 0; k < per_prefix; ++k) {
      std::vector<int32_t> ids = prefix;
      append_random(vocab, rng, o.suffix_len, ids);
      out.push_back(make_request(vocab, std::move(ids), o.output_len));
    }
  }
  if (o.shuffle) rng.shuffle(out);
  return out;
}

// --- sharegpt ------------------------------------------------------------------------------

std::vector<BenchRequest> sharegpt_workload(const text::Tokenizer& tokenizer,
                                            const ShareGptOptions& o) {
  const std::string where = "sharegpt dataset " + o.path.string();
  require(o.num_requests >= 0 && o.num_requests <= kMaxRequests,
          where + ": num_requests must be in 0.." + std::to_string(kMaxRequests));
  require(!o.output_len || (*o.output_len >= 0 && *o.output_len <= kMaxRequestTokens),
          where + ": output_len must be in 0.." + std::to_string(kMaxRequestTokens));
  check_input_file(o.path, where);
  json data;
  try {
    data = json::parse(read_file(o.path));
  } catch (const json::exception& e) {
    throw Error(where + ": malformed JSON: " + json_error_text(e));
  }
  require(data.is_array(), where + ": expected a JSON list of conversations");

  struct Entry {
    std::string prompt, completion;
  };
  std::vector<Entry> entries;
  for (size_t i = 0; i < data.size(); ++i) {
    const json& e = data[i];
    if (!e.is_object()) continue;
    const auto conv = e.find("conversations");
    if (conv == e.end() || !conv->is_array() || conv->size() < 2) continue;
    const json& t0 = (*conv)[0];
    const json& t1 = (*conv)[1];
    const std::string at = where + ": entry " + std::to_string(i);
    require(t0.is_object() && t0.contains("value") && t0["value"].is_string(),
            at + ": conversations[0].value must be a string");
    require(t1.is_object() && t1.contains("value") && t1["value"].is_string(),
            at + ": conversations[1].value must be a string");
    entries.push_back({t0["value"].get<std::string>(), t1["value"].get<std::string>()});
  }
  Rng rng(o.seed);
  if (o.shuffle) rng.shuffle(entries);

  // Prompt tokens in all: the workload is made whole, ids and text.
  int64_t total = 0;
  const std::string asked = o.num_requests_name + " " + std::to_string(o.num_requests);
  const std::string too_many = "at most " + std::to_string(o.max_prompt_tokens) +
                               " prompt tokens in all (the workload is made whole, text "
                               "included): ask for fewer requests";
  const auto conversations = [](size_t n) {
    return std::to_string(n) + (n == 1 ? " usable conversation" : " usable conversations");
  };
  std::vector<BenchRequest> out;
  for (const Entry& e : entries) {
    if (static_cast<int64_t>(out.size()) >= o.num_requests) break;
    // Lengths as vLLM counts them (tokenizer(text).input_ids: special tokens added).
    const auto prompt_len = static_cast<int64_t>(tokenizer.encode(e.prompt, true).size());
    const int64_t output_len =
        o.output_len ? *o.output_len
                     : static_cast<int64_t>(tokenizer.encode(e.completion, true).size());
    const bool too_short = prompt_len < o.min_len || (!o.output_len && output_len < o.min_len);
    const bool too_long =
        prompt_len > o.max_prompt_len || prompt_len + output_len > o.max_total_len;
    if (too_short || too_long) continue;
    BenchRequest r;
    r.prompt_text = e.prompt;
    r.prompt_ids = tokenizer.encode(e.prompt, false);
    r.output_len = output_len;
    total += static_cast<int64_t>(r.prompt_ids.size());
    require(total <= o.max_prompt_tokens,
            where + ": " + asked + ": its first " + conversations(out.size() + 1) + " hold " +
                std::to_string(total) + " prompt tokens; " + too_many);
    out.push_back(std::move(r));
  }
  const size_t kept = out.size();
  if (!o.oversample || kept == 0 || static_cast<int64_t>(kept) >= o.num_requests) return out;
  // The repeats are counted before any is made, with the draws that will make them: a count
  // the flags allow (10^7 requests) could otherwise fill the memory with copies.
  Rng draws = rng;
  for (int64_t i = static_cast<int64_t>(kept); i < o.num_requests; ++i) {
    total += static_cast<int64_t>(out[draws.below(kept)].prompt_ids.size());
    require(total <= o.max_prompt_tokens,
            where + ": " + asked + ": its " + conversations(kept) + ", repeated to make " +
                std::to_string(o.num_requests) + " requests (vLLM's oversampling), hold " +
                std::to_string(total) + " prompt tokens by request " + std::to_string(i + 1) +
                "; " + too_many);
  }
  out.reserve(o.num_requests);
  while (static_cast<int64_t>(out.size()) < o.num_requests) out.push_back(out[rng.below(kept)]);
  return out;
}

// --- Mooncake ------------------------------------------------------------------------------

std::vector<MooncakeRecord> read_mooncake_trace(const std::filesystem::path& path,
                                                const TraceWindow& window, int64_t block_size,
                                                int64_t* records_read) {
  const std::string what = "mooncake trace " + path.string();
  require(block_size >= 1 && block_size <= kMaxRequestTokens,
          what + ": block size must be in 1.." + std::to_string(kMaxRequestTokens));
  validate_window(window, what);
  check_input_file(path, what);
  std::ifstream in(path, std::ios::binary);
  require(in.good(), what + ": cannot open the file");
  // Only the window is parsed; lines before it are counted.
  std::vector<MooncakeRecord> out;
  std::string line;
  int64_t record = 0;
  int64_t line_no = 0;
  int64_t previous_line = 0;
  // The first timestamp after the window later than its last, for --trace-spread's last gap.
  // Only a record that reads cleanly gives one: the window is valid whatever follows it.
  const auto look_past_window = [&]() -> std::optional<double> {
    if (out.empty()) return std::nullopt;
    const double last = out.back().timestamp_ms;
    try {
      do {
        if (line.find_first_not_of(" \t") == std::string::npos) continue;
        const json j = json::parse(line);
        const auto ts = j.find("timestamp");
        if (ts == j.end() || !ts->is_number()) return std::nullopt;
        const double t = ts->get<double>();
        if (t == last) continue;
        if (!(t > last) || !std::isfinite(t)) return std::nullopt;
        check_arrival(what, (t - out.front().timestamp_ms) / 1000.0, window);
        return t;
      } while (read_line(in, line, what, ++line_no));
    } catch (const std::exception&) {
    }
    return std::nullopt;
  };
  std::optional<double> past_window;
  while (read_line(in, line, what, ++line_no)) {
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    const int64_t index = record++;
    if (index < window.start) continue;
    if (window.limit > 0 && index - window.start >= window.limit) {
      past_window = look_past_window();
      break;
    }
    const std::string at = what + ":" + std::to_string(line_no);
    json j;
    try {
      j = json::parse(line);
    } catch (const json::exception& e) {
      throw Error(at + ": malformed JSON: " + json_error_text(e));
    }
    require(j.is_object(), at + ": expected a JSON object");
    MooncakeRecord r;
    r.line = line_no;
    const auto ts = j.find("timestamp");
    require(ts != j.end() && ts->is_number(), at + ": field \"timestamp\" must be a number (ms)");
    r.timestamp_ms = ts->get<double>();
    require(std::isfinite(r.timestamp_ms), at + ": timestamp must be a finite number (ms)");
    if (!out.empty()) {
      const MooncakeRecord& prev = out.back();
      // Requests are sent in file order: one earlier than the record before it could only be
      // sent late, so a file out of order is refused rather than replayed with other gaps.
      require(r.timestamp_ms >= prev.timestamp_ms,
              at + ": timestamp " + number(r.timestamp_ms) + " ms is before line " +
                  std::to_string(previous_line) + "'s " + number(prev.timestamp_ms) +
                  " ms; a trace must be in time order (sort it by timestamp)");
      check_arrival(at, (r.timestamp_ms - out.front().timestamp_ms) / 1000.0, window);
    }
    // At least 1 each: a request of no prompt or no output fails on every server.
    r.input_length = get_length(j, "input_length", at);
    r.output_length = get_length(j, "output_length", at);
    const auto h = j.find("hash_ids");
    require(h != j.end() && h->is_array(), at + ": field \"hash_ids\" must be a list");
    for (const json& id : *h) {
      require(id.is_number_integer(), at + ": hash_ids must hold integers");
      r.hash_ids.push_back(id.get<int64_t>());
    }
    const int64_t blocks = (r.input_length + block_size - 1) / block_size;
    require(static_cast<int64_t>(r.hash_ids.size()) == blocks,
            at + ": " + std::to_string(r.hash_ids.size()) + " hash_ids for input_length " +
                std::to_string(r.input_length) + "; expected ceil(input_length / " +
                std::to_string(block_size) + ") = " + std::to_string(blocks));
    out.push_back(std::move(r));
    previous_line = line_no;
  }
  std::optional<double> next = past_window;
  for (size_t i = out.size(); i-- > 0;) {
    out[i].next_timestamp_ms = next;
    if (i > 0 && out[i].timestamp_ms > out[i - 1].timestamp_ms) next = out[i].timestamp_ms;
  }
  if (records_read) *records_read = record;
  return out;
}

std::vector<int32_t> mooncake_block(const TokenVocab& vocab, int64_t hash_id, int64_t block_size,
                                    uint64_t seed) {
  Rng rng(stream_seed(seed, kStreamMooncakeBlock, static_cast<uint64_t>(hash_id)));
  std::vector<int32_t> block;
  block.reserve(block_size);
  append_random(vocab, rng, block_size, block);
  return block;
}

BenchRequest mooncake_request(const TokenVocab& vocab, const MooncakeRecord& record,
                              int64_t block_size, uint64_t seed) {
  return make_request(vocab, mooncake_prompt(vocab, record, block_size, seed),
                      record.output_length);
}

std::vector<int32_t> mooncake_prompt(const TokenVocab& vocab, const MooncakeRecord& record,
                                     int64_t block_size, uint64_t seed) {
  std::vector<int32_t> ids;
  ids.reserve(record.input_length);
  for (int64_t id : record.hash_ids) {
    const auto block = mooncake_block(vocab, id, block_size, seed);
    const auto take = std::min<int64_t>(block_size, record.input_length - ids.size());
    if (take <= 0) break;
    ids.insert(ids.end(), block.begin(), block.begin() + take);
  }
  return ids;
}

std::vector<BenchRequest> mooncake_workload(const TokenVocab& vocab, const MooncakeOptions& o) {
  const auto records = read_mooncake_trace(o.path, o.window, o.block_size);
  check_window_tokens(
      "mooncake trace " + o.path.string(), records,
      [](const MooncakeRecord& r) { return r.input_length; }, o.max_prompt_tokens);
  std::vector<BenchRequest> out;
  out.reserve(records.size());
  const std::vector<double> arrivals =
      mooncake_arrivals(records, o.window.time_scale, o.spread, o.seed);
  for (size_t i = 0; i < records.size(); ++i) {
    BenchRequest req = mooncake_request(vocab, records[i], o.block_size, o.seed);
    req.arrival_s = arrivals[i];
    out.push_back(std::move(req));
  }
  return out;
}

std::vector<double> mooncake_arrivals(const std::vector<MooncakeRecord>& records, double time_scale,
                                      bool spread, uint64_t seed) {
  std::vector<double> out;
  out.reserve(records.size());
  for (const MooncakeRecord& r : records)
    out.push_back((r.timestamp_ms - records.front().timestamp_ms) / 1000.0 * time_scale);
  if (!spread) return out;
  Rng rng(seed ^ 0x6d6f6f6e63616b65ULL);  // its own stream: the prompts draw from the seed too
  std::optional<double> gap;              // the last run's, without a later record: the one before
  for (size_t begin = 0; begin < out.size();) {
    size_t end = begin + 1;
    while (end < out.size() && out[end] == out[begin]) ++end;
    if (end < out.size()) {
      gap = out[end] - out[begin];
    } else if (const MooncakeRecord& last = records[end - 1]; last.next_timestamp_ms) {
      gap = (*last.next_timestamp_ms - records.front().timestamp_ms) / 1000.0 * time_scale -
            out[begin];
    }
    // Sending them at once would look like a spread replay and measure the burst it was asked
    // to remove.
    require(gap.has_value(),
            "mooncake trace: --trace-spread: every record of the window (line " +
                std::to_string(records[begin].line) + " on) has timestamp " +
                number(records[begin].timestamp_ms) +
                " ms and no later record follows in the file: there is no gap to spread them over");
    std::vector<double> offsets(end - begin);
    for (double& x : offsets) x = *gap * rng.uniform();
    std::sort(offsets.begin(), offsets.end());
    for (size_t i = begin; i < end; ++i) out[i] += offsets[i - begin];
    begin = end;
  }
  return out;
}

LazyWorkload lazy(std::vector<BenchRequest> requests) {
  LazyWorkload w;
  for (const BenchRequest& r : requests) w.arrival_s.push_back(r.arrival_s);
  auto all = std::make_shared<const std::vector<BenchRequest>>(std::move(requests));
  w.make = [all](size_t i) { return all->at(i); };
  return w;
}

// --- Azure ---------------------------------------------------------------------------------

std::vector<AzureRecord> read_azure_trace(const std::filesystem::path& path,
                                          const TraceWindow& window, int64_t* records_read) {
  const std::string what = "azure trace " + path.string();
  validate_window(window, what);
  check_input_file(path, what);
  std::ifstream in(path, std::ios::binary);
  require(in.good(), what + ": cannot open the file");
  std::string line;
  require(read_line(in, line, what, 1), what + ": empty file (expected a header)");
  // A UTF-8 byte order mark (a CSV saved by Excel) is not part of the first column's name;
  // pandas drops it too.
  if (line.starts_with("\xEF\xBB\xBF")) line.erase(0, 3);
  const size_t columns = csv_field_count(line);
  require(columns <= kMaxCsvColumns, what + ":1: a header of " + std::to_string(columns) +
                                         " columns; expected at most " +
                                         std::to_string(kMaxCsvColumns));
  const auto header = split_csv_line(line);
  int col_ts = -1, col_ctx = -1, col_gen = -1;
  for (size_t i = 0; i < header.size(); ++i) {
    if (header[i] == "TIMESTAMP") col_ts = static_cast<int>(i);
    if (header[i] == "ContextTokens") col_ctx = static_cast<int>(i);
    if (header[i] == "GeneratedTokens") col_gen = static_cast<int>(i);
  }
  require(col_ts >= 0 && col_ctx >= 0 && col_gen >= 0,
          what + ": header must name the columns TIMESTAMP, ContextTokens and GeneratedTokens");

  std::vector<AzureRecord> out;
  bool have_first = false;
  int64_t first_s = 0;
  double first_frac = 0;
  int64_t previous_s = 0;  // the row before, for the order check
  double previous_frac = 0;
  int64_t previous_line = 0;
  std::string previous_text;
  int64_t record = 0;
  int64_t line_no = 1;
  while (read_line(in, line, what, ++line_no)) {
    if (line.empty()) continue;
    const std::string at = what + ":" + std::to_string(line_no);
    // Counted before anything is split: a row of millions of commas is refused as it is.
    const size_t fields = csv_field_count(line);
    require(fields == columns, at + ": expected " + std::to_string(columns) +
                                   " comma-separated fields, as the header has, got " +
                                   std::to_string(fields));
    const auto cells = split_csv_line(line);
    int64_t s = 0;
    double frac = 0;
    require(parse_timestamp(cells[col_ts], s, frac),
            at + ": TIMESTAMP " + excerpt(cells[col_ts]) +
                " is not a date and time of the form YYYY-MM-DD HH:MM:SS[.fraction]");
    if (!have_first) {
      have_first = true;
      first_s = s;
      first_frac = frac;
    } else {
      // Requests are sent in file order: a row earlier than the one before it could only be
      // sent late, so a file out of order is refused rather than replayed with other gaps.
      require(s > previous_s || (s == previous_s && frac >= previous_frac),
              at + ": TIMESTAMP " + excerpt(cells[col_ts]) + " is before line " +
                  std::to_string(previous_line) + "'s " + excerpt(previous_text) +
                  "; a trace must be in time order (sort it by TIMESTAMP)");
    }
    previous_s = s;
    previous_frac = frac;
    previous_line = line_no;
    previous_text = cells[col_ts];
    const int64_t index = record++;
    if (index < window.start) continue;
    if (window.limit > 0 && index - window.start >= window.limit) break;
    AzureRecord r;
    r.line = line_no;
    r.index = index;
    r.offset_s = static_cast<double>(s - first_s) + (frac - first_frac);
    if (!out.empty()) check_arrival(at, r.offset_s - out.front().offset_s, window);
    // At least 1 each: a request of no prompt or no output fails on every server.
    require(parse_int(cells[col_ctx], r.context_tokens) && r.context_tokens >= 1 &&
                r.context_tokens <= kMaxRequestTokens,
            at + ": ContextTokens must be an integer in 1.." + std::to_string(kMaxRequestTokens) +
                ", got " + excerpt(cells[col_ctx]));
    require(parse_int(cells[col_gen], r.generated_tokens) && r.generated_tokens >= 1 &&
                r.generated_tokens <= kMaxRequestTokens,
            at + ": GeneratedTokens must be an integer in 1.." + std::to_string(kMaxRequestTokens) +
                ", got " + excerpt(cells[col_gen]));
    out.push_back(r);
  }
  if (records_read) *records_read = record;
  return out;
}

std::vector<int32_t> azure_prompt(const TokenVocab& vocab, const AzureRecord& record,
                                  uint64_t seed) {
  // Seeded by the record's position in the file, so a window does not change its content.
  Rng rng(stream_seed(seed, kStreamAzureRequest, static_cast<uint64_t>(record.index)));
  std::vector<int32_t> ids;
  ids.reserve(record.context_tokens);
  append_random(vocab, rng, record.context_tokens, ids);
  return ids;
}

std::vector<double> azure_arrivals(const std::vector<AzureRecord>& records, double time_scale) {
  std::vector<double> out;
  out.reserve(records.size());
  for (const AzureRecord& r : records)
    out.push_back((r.offset_s - records.front().offset_s) * time_scale);
  return out;
}

std::vector<BenchRequest> azure_workload(const TokenVocab& vocab, const AzureOptions& o) {
  const auto records = read_azure_trace(o.path, o.window);
  check_window_tokens(
      "azure trace " + o.path.string(), records,
      [](const AzureRecord& r) { return r.context_tokens; }, o.max_prompt_tokens);
  const std::vector<double> arrivals = azure_arrivals(records, o.window.time_scale);
  std::vector<BenchRequest> out;
  out.reserve(records.size());
  for (size_t i = 0; i < records.size(); ++i) {
    BenchRequest req =
        make_request(vocab, azure_prompt(vocab, records[i], o.seed), records[i].generated_tokens);
    req.arrival_s = arrivals[i];
    out.push_back(std::move(req));
  }
  return out;
}

}  // namespace tandem::bench
