#include "text/tokenizer.h"

#include <algorithm>
#include <charconv>
#include <deque>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <nlohmann/json.hpp>

#include "text/added_vocabulary.h"
#include "text/bpe.h"
#include "text/byte_level.h"
#include "text/normalizer.h"
#include "text/pretokenizer.h"
#include "util/error.h"
#include "util/file.h"
#include "util/json.h"
#include "util/json_fields.h"
#include "util/utf8.h"

namespace tandem::text {
namespace {

using json = nlohmann::json;
// tokenizer.json is read by tokenizers with serde: an Option takes null, a bool or a String does
// not.
constexpr auto kNull = Fields::Null::kWrongType;

// Special tokens a post-processor puts around a single sequence.
struct Framing {
  std::vector<TokenId> prefix, suffix;
};

// A framing id outside the vocabulary would be added to every prompt and then refused by the
// engine as if the client had sent it, so it is an error of the file, found when it loads.
TokenId framing_id(const json& v, const std::string& field, const std::vector<std::string>& vocab) {
  if (!v.is_number_integer()) throw Error(field + ": expected a token id, got " + v.dump());
  const auto id = v.get<int64_t>();
  if (id < 0 || static_cast<uint64_t>(id) >= vocab.size() || vocab[id].empty())
    throw Error(field + " is token id " + std::to_string(id) +
                ", which is not in the vocabulary (" + std::to_string(vocab.size()) + " ids)");
  return static_cast<TokenId>(id);
}

// The post-processor `key` of `parent` (tokenizer.json's, or a Sequence's list).
void add_post_processor(const json& cfg, const Fields& parent, const std::string& key,
                        Framing& framing, const std::vector<std::string>& vocab) {
  if (cfg.is_null()) return;
  if (!cfg.is_object()) parent.fail(key, "must be an object, got " + json_excerpt(cfg));
  auto f = Fields::lenient(cfg, parent.origin(), parent.path_of(key));
  const std::string where = f.where();
  const auto type = f.string_or("type", "", kNull);
  if (type == "ByteLevel") return;  // only adjusts offsets, which Tandem does not track
  if (type == "Sequence") {
    const auto& list = f.list("processors", kNull);
    for (size_t i = 0; i < list.size(); ++i)
      add_post_processor(list[i], f, "processors[" + std::to_string(i) + "]", framing, vocab);
    return;
  }
  if (type == "TemplateProcessing") {
    const auto& specials = f.object("special_tokens", kNull);
    const auto& single = f.list("single", kNull);
    bool seen_a = false;
    for (size_t i = 0; i < single.size(); ++i) {
      const json& item = single[i];
      auto item_fields =
          Fields::lenient(item, f.origin(), f.path_of("single") + "[" + std::to_string(i) + "]");
      if (item.contains("Sequence")) {
        if (item_fields.nested("Sequence", kNull).string("id", kNull) != "A" || seen_a)
          throw Error(where + ": single-sequence template must use $A exactly once");
        seen_a = true;
      } else if (item.contains("SpecialToken")) {
        auto name = item_fields.nested("SpecialToken", kNull).string("id", kNull);
        if (!specials.contains(name))
          throw Error(where + ": template token '" + name + "' is not in special_tokens");
        auto& dst = seen_a ? framing.suffix : framing.prefix;
        const auto& ids = f.nested("special_tokens", kNull).nested(name, kNull).list("ids", kNull);
        for (size_t j = 0; j < ids.size(); ++j)
          dst.push_back(framing_id(
              ids[j], where + ": special_tokens['" + name + "'].ids[" + std::to_string(j) + "]",
              vocab));
      } else {
        throw Error(where + ": unknown template item " + json_excerpt(item));
      }
    }
    if (!seen_a) throw Error(where + ": single-sequence template has no $A");
    return;
  }
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    auto id_of = [&](const char* key) {
      const auto& pair = f.list(key, kNull);
      if (pair.size() != 2)
        f.fail(key, "must be [token, id], got a list of " + std::to_string(pair.size()));
      return framing_id(pair[1], where + ": " + key + "[1]", vocab);
    };
    framing.prefix.push_back(id_of("cls"));
    framing.suffix.push_back(id_of("sep"));
    return;
  }
  throw Error(where + ": post-processor type '" + type + "' is not supported");
}

// The decoder `key` of `parent` (tokenizer.json's, or a Sequence's list).
void check_decoder(const json& cfg, const Fields& parent, const std::string& key) {
  auto f = Fields::lenient(cfg, parent.origin(), parent.path_of(key));
  const std::string where = f.where();
  if (cfg.is_null()) throw Error(where + ": missing; byte-level BPE needs a ByteLevel decoder");
  if (!cfg.is_object()) parent.fail(key, "must be an object, got " + json_excerpt(cfg));
  const auto type = f.string_or("type", "", kNull);
  if (type == "ByteLevel") return;
  if (type == "Sequence" && cfg.contains("decoders") && f.list("decoders", kNull).size() == 1)
    return check_decoder(cfg["decoders"][0], f, "decoders[0]");
  throw Error(where + ": decoder type '" + type + "' is not supported (only ByteLevel is)");
}

// An added token as tokenizer.json's "added_tokens" and tokenizer_config.json's
// "added_tokens_decoder" write it, the field `key` of `parent`; `normalized` defaults to the
// opposite of `special`, as in HF.
AddedToken parse_added_token(const json& t, TokenId id, const Fields& parent,
                             const std::string& key) {
  if (!t.is_object())
    parent.fail(key, "must be an object with a \"content\" string, got " + json_excerpt(t));
  auto f = Fields::lenient(t, parent.origin(), parent.path_of(key));
  AddedToken a;
  a.content = f.string("content", kNull);
  a.id = id;
  a.special = f.boolean_or("special", false, kNull);
  a.lstrip = f.boolean_or("lstrip", false, kNull);
  a.rstrip = f.boolean_or("rstrip", false, kNull);
  a.single_word = f.boolean_or("single_word", false, kNull);
  a.normalized = f.boolean_or("normalized", !a.special, kNull);
  return a;
}

// tokenizer_config.json writes tokens as strings or as {"content": ...} objects; null or absent
// is no token.
std::string token_content(Fields& config, const char* key) {
  const json* v = config.get(key);
  if (!v) return {};
  if (v->is_string()) return v->get<std::string>();
  if (!v->is_object())
    config.fail(key, "must be a string or {\"content\": string}, got " + json_excerpt(*v));
  return config.nested(key).string("content", kNull);
}

// add_bos_token and add_eos_token: transformers passes the value to the class as it is, whose
// post-processor tests it for truth, so null adds no token; the class's default applies only
// when the key is absent.
bool add_token_flag(Fields& config, const char* key, bool fallback) {
  const json* v = config.get(key, Fields::Null::kWrongType);
  if (!v) return fallback;
  if (v->is_null()) return false;
  if (!v->is_boolean()) config.fail(key, "must be true, false or null, got " + json_excerpt(*v));
  return v->get<bool>();
}

// transformers' Llama-style fast tokenizers rebuild the post-processor from add_bos_token /
// add_eos_token when they load, overriding tokenizer.json's (update_post_processor).
bool class_rebuilds_post_processor(const std::string& cls) {
  return cls == "LlamaTokenizerFast" || cls == "LlamaTokenizer" ||
         cls == "CodeLlamaTokenizerFast" || cls == "GemmaTokenizerFast";
}

// The `chat_template` field of tokenizer_config.json or chat_template.json: one template, or a
// list of {"name", "template"} (transformers makes it a dict by name, a later entry winning).
std::vector<NamedChatTemplate> chat_templates_of(const json& doc, const std::string& origin) {
  std::vector<NamedChatTemplate> out;
  auto f = Fields::lenient(doc, origin);
  const json* templates = f.get("chat_template");
  if (!templates) return out;
  if (templates->is_string()) {
    out.push_back({"default", templates->get<std::string>()});
    return out;
  }
  if (!templates->is_array())
    f.fail("chat_template", "must be a string or a list of {\"name\", \"template\"}, got " +
                                json_excerpt(*templates));
  for (size_t i = 0; i < templates->size(); ++i) {
    const json& t = (*templates)[i];
    if (!t.is_object() || !t.contains("name") || !t["name"].is_string() ||
        !t.contains("template") || !t["template"].is_string())
      f.fail("chat_template[" + std::to_string(i) + "]",
             "must be {\"name\": string, \"template\": string}, got " + json_excerpt(t));
    const auto name = t["name"].get<std::string>();
    std::erase_if(out, [&](const NamedChatTemplate& n) { return n.name == name; });
    out.push_back({name, t["template"].get<std::string>()});
  }
  return out;
}

}  // namespace

struct Tokenizer::Impl {
  std::string origin;
  std::unique_ptr<Normalizer> normalizer;
  std::unique_ptr<PreTokenizer> pre_tokenizer;
  std::unique_ptr<Bpe> bpe;
  AddedTokenMatcher raw_matcher;         // added tokens matched before normalization
  AddedTokenMatcher normalized_matcher;  // added tokens matched in normalized text
  Framing framing;

  std::vector<std::string> id_to_token;  // vocabulary and added tokens, by id
  std::vector<std::string> id_to_bytes;  // what each id decodes to
  std::vector<uint8_t> special;          // 1 for special added tokens
  std::unordered_map<std::string, TokenId> token_to_id;

  std::string bos_token, eos_token;
  bool clean_up_tokenization_spaces = false;
  std::vector<NamedChatTemplate> chat_templates;
  std::optional<TokenId> bos_id, eos_id;

  void encode_plain(std::string_view text, std::vector<TokenId>& out) const {
    thread_local std::vector<std::string_view> pieces;
    std::deque<std::string> arena;
    pieces.clear();
    pre_tokenizer->split(text, pieces, arena);
    for (auto piece : pieces) bpe->encode_piece(piece, out);
  }
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

namespace {
// What from_dir reads, and files() lists.
constexpr std::string_view kTokenizerFile = "tokenizer.json", kConfigFile = "tokenizer_config.json",
                           kTemplateFile = "chat_template.jinja",
                           kTemplateFolder = "additional_chat_templates",
                           kProcessorTemplateFile = "chat_template.json";
constexpr std::string_view kFiles[] = {kTokenizerFile, kConfigFile, kTemplateFile, kTemplateFolder,
                                       kProcessorTemplateFile};
}  // namespace

std::span<const std::string_view> Tokenizer::files() {
  return kFiles;
}

Tokenizer Tokenizer::from_dir(const std::filesystem::path& dir) {
  auto tok_path = dir / kTokenizerFile;
  if (!std::filesystem::exists(tok_path))
    throw Error("no tokenizer.json in " + dir.string() + " (expected a Hugging Face model folder)");
  auto cfg_path = dir / kConfigFile;
  // Regular files only: a FIFO blocked the load in open() until some writer came.
  std::string cfg = std::filesystem::exists(cfg_path)
                        ? read_regular_file(cfg_path, kMaxModelConfigBytes)
                        : std::string();
  Tokenizer tok =
      from_json(read_regular_file(tok_path, kMaxTokenizerBytes), cfg, tok_path.string());
  // transformers' PreTrainedTokenizerBase._from_pretrained: template files win over the config's
  // field, all of it (save_pretrained has written only chat_template.jinja since 4.47).
  std::vector<NamedChatTemplate> files;
  if (const auto path = dir / kTemplateFile; std::filesystem::exists(path))
    files.push_back({"default", read_regular_file(path, kMaxModelConfigBytes)});
  if (const auto extra = dir / kTemplateFolder; std::filesystem::is_directory(extra)) {
    std::vector<std::filesystem::path> paths;
    for (const auto& entry : std::filesystem::directory_iterator(extra))
      if (entry.path().extension() == ".jinja") paths.push_back(entry.path());
    std::sort(paths.begin(), paths.end());
    for (const auto& path : paths) {
      const std::string name = path.stem().string();
      // An additional default.jinja replaces chat_template.jinja, as in transformers.
      std::erase_if(files, [&](const NamedChatTemplate& t) { return t.name == name; });
      files.push_back({name, read_regular_file(path, kMaxModelConfigBytes)});
    }
  }
  if (!files.empty()) {
    tok.impl_->chat_templates = std::move(files);
  } else if (const auto path = dir / kProcessorTemplateFile;
             tok.impl_->chat_templates.empty() && std::filesystem::exists(path)) {
    // A processor's file (multimodal models saved before 4.47); vLLM renders with it too.
    json doc;
    try {
      doc = parse_untrusted_json(read_regular_file(path, kMaxModelConfigBytes), 16);
    } catch (const Error& e) {
      throw Error(path.string() + ": " + e.what());
    }
    if (!doc.is_object()) throw Error(path.string() + ": expected a JSON object");
    tok.impl_->chat_templates = chat_templates_of(doc, path.string());
  }
  return tok;
}

Tokenizer Tokenizer::from_json(std::string_view tokenizer_json, std::string_view config_json,
                               const std::string& origin) {
  auto impl = std::make_unique<Impl>();
  impl->origin = origin;
  json doc;
  try {
    doc = parse_untrusted_json(tokenizer_json, 256);
  } catch (const Error& e) {
    throw Error(origin + ": " + e.what());
  }
  json cfg = json::object();
  const std::string cfg_origin = "tokenizer_config.json beside " + origin;
  if (!config_json.empty()) {
    try {
      cfg = parse_untrusted_json(config_json, 256);
    } catch (const Error& e) {
      throw Error(cfg_origin + ": " + e.what());
    }
    if (!cfg.is_object()) throw Error(cfg_origin + ": expected a JSON object");
  }
  if (!doc.is_object() || !doc.contains("model"))
    throw Error(origin + ": expected a JSON object with a 'model' (a Hugging Face tokenizer.json)");
  auto document = Fields::lenient(doc, origin);
  // tokenizer_config.json is read by transformers, where null is None: the key left out.
  auto config = Fields::lenient(cfg, cfg_origin);

  try {
    impl->normalizer = std::make_unique<Normalizer>(doc.value("normalizer", json()), origin);
    impl->pre_tokenizer =
        std::make_unique<PreTokenizer>(doc.value("pre_tokenizer", json()), origin);
    size_t listed_added = 0;
    if (const auto it = doc.find("added_tokens"); it != doc.end() && it->is_array())
      listed_added += it->size();
    if (const auto it = cfg.find("added_tokens_decoder"); it != cfg.end() && it->is_object())
      listed_added += it->size();
    impl->bpe = std::make_unique<Bpe>(doc["model"], origin, listed_added);
    check_decoder(doc.value("decoder", json()), document, "decoder");

    // Vocabulary first, then added tokens (which may reuse or extend ids).
    impl->id_to_token = impl->bpe->tokens();
    std::vector<AddedToken> added;
    const json& added_tokens = doc.value("added_tokens", json::array());
    if (!added_tokens.is_array() && !added_tokens.is_null())
      document.fail("added_tokens", "must be a list, got " + json_excerpt(added_tokens));
    for (size_t i = 0; i < added_tokens.size(); ++i) {
      const json& t = added_tokens[i];
      AddedToken a = parse_added_token(t, 0, document, "added_tokens[" + std::to_string(i) + "]");
      const auto id = t.find("id");
      if (id == t.end() || !id->is_number_integer() || id->get<int64_t>() < 0 ||
          id->get<int64_t>() >= (1 << 24))
        throw Error(origin + ": added token '" + a.content + "' has an invalid id");
      a.id = id->get<TokenId>();
      added.push_back(std::move(a));
    }
    // transformers also registers tokens listed only in tokenizer_config.json.
    if (const auto decoder = cfg.find("added_tokens_decoder");
        decoder != cfg.end() && !decoder->is_null()) {
      if (!decoder->is_object())
        config.fail("added_tokens_decoder",
                    "must be an object of token ids to tokens, got " + json_excerpt(*decoder));
      const auto entries = config.nested("added_tokens_decoder");
      // A set, not a scan of `added` per entry: files list tens of thousands of added tokens.
      std::unordered_set<TokenId> listed;
      for (const auto& a : added) listed.insert(a.id);
      for (const auto& [id_str, t] : decoder->items()) {
        TokenId id = 0;
        auto [end, ec] = std::from_chars(id_str.data(), id_str.data() + id_str.size(), id);
        if (ec != std::errc() || end != id_str.data() + id_str.size() || id < 0 || id >= (1 << 24))
          throw Error(cfg_origin + ": added_tokens_decoder key '" + id_str + "' is not a token id");
        if (!listed.insert(id).second) continue;
        added.push_back(parse_added_token(t, id, entries, id_str));
      }
    }

    // Ids of added tokens are assigned the way HF's AddedVocabulary does when it loads a file
    // (the ids written in the file are only checked there, with a warning): text that is already
    // a vocabulary entry or an earlier added token keeps that id; anything else takes the next
    // id after the vocabulary and the added tokens so far.
    {
      std::unordered_map<std::string, TokenId> known;
      for (size_t id = 0; id < impl->id_to_token.size(); ++id)
        if (!impl->id_to_token[id].empty()) known.emplace(impl->id_to_token[id], id);
      const auto model_size = static_cast<TokenId>(known.size());
      std::optional<TokenId> max_added;
      for (auto& a : added) {
        if (auto it = known.find(a.content); it != known.end()) {
          a.id = it->second;
        } else {
          a.id = max_added && *max_added >= model_size ? *max_added + 1 : model_size;
          known.emplace(a.content, a.id);
        }
        max_added = max_added ? std::max(*max_added, a.id) : a.id;
      }
    }
    std::vector<AddedToken> raw, normalized;
    for (const auto& a : added) {
      if (static_cast<size_t>(a.id) >= impl->id_to_token.size()) impl->id_to_token.resize(a.id + 1);
      impl->id_to_token[a.id] = a.content;
      // HF matches the tokens that are not normalized first, in the text as it came, then the
      // normalized ones in the normalized pieces left between, even when normalizing changes
      // nothing: with `ab<｜` normalized and `<｜end▁of▁sentence｜>` not, "ab<｜end▁of▁sentence｜>"
      // is "ab" and the special token, not `ab<｜` and the rest.
      if (a.normalized) {
        AddedToken n = a;
        if (!impl->normalizer->is_identity()) n.content = impl->normalizer->apply(a.content);
        normalized.push_back(std::move(n));
      } else {
        raw.push_back(a);
      }
    }
    impl->special.assign(impl->id_to_token.size(), 0);
    for (const auto& a : added)
      if (a.special) impl->special[a.id] = 1;
    // transformers sets the fast tokenizer's encode_special_tokens from split_special_tokens:
    // special tokens in the text are then encoded as the text they are.
    const bool skip_special = config.boolean_or("split_special_tokens", false);
    impl->raw_matcher = AddedTokenMatcher(std::move(raw), skip_special);
    impl->normalized_matcher = AddedTokenMatcher(std::move(normalized), skip_special);

    impl->id_to_bytes.resize(impl->id_to_token.size());
    for (size_t id = 0; id < impl->id_to_token.size(); ++id) {
      const auto& tok = impl->id_to_token[id];
      if (tok.empty()) continue;
      // The ByteLevel decoder maps a token through the byte alphabet when every character is in
      // it, and keeps the token's own UTF-8 otherwise (added tokens such as "<|im_end|>").
      auto bytes = byte_level::to_bytes(tok);
      impl->id_to_bytes[id] = bytes ? *bytes : tok;
      impl->token_to_id.emplace(tok, static_cast<TokenId>(id));
    }
    for (const auto& a : added) impl->token_to_id[a.content] = a.id;

    impl->clean_up_tokenization_spaces = config.boolean_or("clean_up_tokenization_spaces", false);
    impl->bos_token = token_content(config, "bos_token");
    impl->eos_token = token_content(config, "eos_token");
    auto lookup = [&](const std::string& t) -> std::optional<TokenId> {
      if (t.empty()) return std::nullopt;
      auto it = impl->token_to_id.find(t);
      if (it == impl->token_to_id.end())
        throw Error(cfg_origin + ": token '" + t + "' is not in the vocabulary");
      return it->second;
    };
    impl->bos_id = lookup(impl->bos_token);
    impl->eos_id = lookup(impl->eos_token);

    const std::string cls = config.string_or("tokenizer_class", "");  // null is no class
    if (class_rebuilds_post_processor(cls)) {
      const bool add_bos = add_token_flag(config, "add_bos_token", true),
                 add_eos = add_token_flag(config, "add_eos_token", false);
      if (add_bos && !impl->bos_id)
        throw Error(cfg_origin + ": add_bos_token is set but bos_token is not");
      if (add_eos && !impl->eos_id)
        throw Error(cfg_origin + ": add_eos_token is set but eos_token is not");
      if (add_bos) impl->framing.prefix.push_back(*impl->bos_id);
      if (add_eos) impl->framing.suffix.push_back(*impl->eos_id);
    } else {
      add_post_processor(doc.value("post_processor", json()), document, "post_processor",
                         impl->framing, impl->id_to_token);
    }

    impl->chat_templates = chat_templates_of(cfg, cfg_origin);
  } catch (const json::exception& e) {
    throw Error(origin + ": unexpected structure: " + e.what());
  }
  return Tokenizer(std::move(impl));
}

std::vector<TokenId> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  const Impl& m = *impl_;
  for (size_t i = 0; i < text.size();) {
    if (static_cast<unsigned char>(text[i]) < 0x80) {
      ++i;
      continue;
    }
    size_t len = utf8::valid_sequence_length(text, i);
    if (!len) throw Error("text is not valid UTF-8 (at byte " + std::to_string(i) + ")");
    i += len;
  }
  std::vector<TokenId> out;
  out.reserve(text.size() / 3 + 4);
  if (add_special_tokens) out = m.framing.prefix;
  thread_local std::vector<AddedTokenMatcher::Segment> raw_segments;
  std::vector<AddedTokenMatcher::Segment> norm_segments;
  raw_segments.clear();
  m.raw_matcher.split(text, raw_segments);
  for (const auto& seg : raw_segments) {
    if (seg.id >= 0) {
      out.push_back(seg.id);
      continue;
    }
    if (m.normalized_matcher.empty() && m.normalizer->is_identity()) {
      m.encode_plain(seg.text, out);
      continue;
    }
    std::string normalized;
    std::string_view text = seg.text;
    if (!m.normalizer->is_identity()) text = normalized = m.normalizer->apply(seg.text);
    norm_segments.clear();
    m.normalized_matcher.split(text, norm_segments);
    for (const auto& n : norm_segments) {
      if (n.id >= 0) {
        out.push_back(n.id);
      } else {
        m.encode_plain(n.text, out);
      }
    }
  }
  if (add_special_tokens) out.insert(out.end(), m.framing.suffix.begin(), m.framing.suffix.end());
  return out;
}

std::string Tokenizer::token_bytes(TokenId id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->id_to_bytes.size() ||
      impl_->id_to_token[id].empty())
    throw Error("token id " + std::to_string(id) + " is not in the vocabulary (size " +
                std::to_string(vocab_size()) + ")");
  return impl_->id_to_bytes[id];
}

std::string Tokenizer::decode(std::span<const TokenId> ids, bool skip_special_tokens) const {
  std::string bytes;
  for (TokenId id : ids) {
    std::string b = token_bytes(id);  // validates the id
    if (skip_special_tokens && impl_->special[id]) continue;
    bytes += b;
  }
  return utf8::to_valid_lossy(bytes);
}

std::string Tokenizer::decode_as_transformers(std::span<const TokenId> ids,
                                              bool skip_special_tokens) const {
  std::string text = decode(ids, skip_special_tokens);
  return impl_->clean_up_tokenization_spaces ? clean_up_tokenization(text) : text;
}

bool Tokenizer::clean_up_tokenization_spaces() const {
  return impl_->clean_up_tokenization_spaces;
}

std::string clean_up_tokenization(std::string_view text) {
  static constexpr std::pair<std::string_view, std::string_view> kReplacements[] = {
      {" .", "."},     {" ?", "?"},   {" !", "!"},   {" ,", ","},     {" ' ", "'"},
      {" n't", "n't"}, {" 'm", "'m"}, {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"}};
  std::string out(text);
  for (const auto& [from, to] : kReplacements) {
    if (out.find(from) == std::string::npos) continue;
    std::string replaced;
    replaced.reserve(out.size());
    size_t start = 0;
    for (size_t at; (at = out.find(from, start)) != std::string::npos; start = at + from.size())
      replaced.append(out, start, at - start).append(to);
    replaced.append(out, start);
    out = std::move(replaced);
  }
  return out;
}

std::optional<TokenId> Tokenizer::token_to_id(std::string_view token) const {
  auto it = impl_->token_to_id.find(std::string(token));
  if (it == impl_->token_to_id.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string> Tokenizer::id_to_token(TokenId id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->id_to_token.size() ||
      impl_->id_to_token[id].empty())
    return std::nullopt;
  return impl_->id_to_token[id];
}

bool Tokenizer::is_special(TokenId id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->special.size() && impl_->special[id];
}

size_t Tokenizer::vocab_size() const {
  return impl_->id_to_token.size();
}
const std::string& Tokenizer::bos_token() const {
  return impl_->bos_token;
}
const std::string& Tokenizer::eos_token() const {
  return impl_->eos_token;
}
std::optional<TokenId> Tokenizer::bos_id() const {
  return impl_->bos_id;
}
std::optional<TokenId> Tokenizer::eos_id() const {
  return impl_->eos_id;
}
const std::vector<NamedChatTemplate>& Tokenizer::chat_templates() const {
  return impl_->chat_templates;
}
const std::string& Tokenizer::chat_template(bool with_tools) const {
  static const std::string none;
  const NamedChatTemplate* t = pick_chat_template(impl_->chat_templates, with_tools);
  return t ? t->source : none;
}

}  // namespace tandem::text
