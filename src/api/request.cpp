#include "api/request.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <span>
#include <type_traits>

#include "api/body_fields.h"
#include "api/chat_messages.h"
#include "structured/ordered_json.h"
#include "structured/tool_call_grammar.h"
#include "text/jinja/value.h"
#include "text/token_text.h"
#include "util/error.h"
#include "util/utf8.h"

namespace tandem::api {
namespace {

using nlohmann::json;

// The request's max_tokens (under `name`, which differs between the dialects) within the operator's
// limits; `dialect_default` when it is omitted and the operator set no default. `room`, what the
// context leaves after the prompt where the dialect's default is that room (a chat's; 0: not
// known), caps the operator's default too, as vLLM's get_max_tokens takes the least of the room
// and its default_sampling_params' max_tokens: a default never turns a chat that fits into a 400.
int64_t max_tokens_of(const json& body, const char* name, int64_t dialect_default,
                      const ModelLimits& limits, int64_t room = 0) {
  const int64_t limit = limits.max_tokens_limit;
  // --override-generation-config's max_new_tokens, which vLLM applies silently to every request.
  const int64_t cap = limits.sampling.max_tokens_cap;
  auto capped = [&](int64_t n) { return cap > 0 ? std::min(n, cap) : n; };
  if (!field(body, name)) {
    int64_t d = limits.default_max_tokens > 0 ? limits.default_max_tokens : dialect_default;
    if (room > 0) d = std::min(d, room);
    return capped(limit > 0 ? std::min(d, limit) : d);
  }
  const int64_t asked = integer(body, name, 0);
  if (limit > 0 && asked > limit)
    fail(name, std::string("'") + name + "' is " + std::to_string(asked) +
                   ", above this server's limit of " + std::to_string(limit) + " tokens");
  return capped(asked);
}

// Prompt ids as echo shows them. As vLLM, a prompt may hold any id below the model's vocabulary
// size, the rows a padded vocabulary adds past the tokenizer's ids included; those read as
// nothing (text/token_text.h).
std::string text_of_prompt_ids(const text::Tokenizer& tokenizer, std::span<const int32_t> ids) {
  return tokenizer.decode(text::ids_with_text(tokenizer, ids), false);
}

// Fields that change what an answer must look like, which Tandem does not do yet. Accepting them
// would answer 200 with free text a client takes for what it asked; each gets a 400 naming it.
// A field is refused when `refused` says so of its (non-null) value.
struct Unsupported {
  const char* name;
  bool (*refused)(const json& value, const json& body);
  const char* why;
};
bool always(const json&, const json&) {
  return true;
}
constexpr Unsupported kUnsupported[] = {
    {"functions", always, "'functions' (deprecated by OpenAI) is not supported: use 'tools'"},
    {"function_call", [](const json& v, const json&) { return v != "none"; },
     "'function_call' (deprecated by OpenAI) is not supported: use 'tool_choice'"},
    {"guided_grammar", always,
     "'guided_grammar' (EBNF) is not supported: use guided_json, guided_regex or guided_choice"},
    // As vLLM without --trust-request-chat-template: a template is code the server runs.
    {"chat_template", always,
     "'chat_template' from a request is not accepted: the model's own template is used"},
    {"suffix", always, "'suffix' is not supported"},
    {"guided_whitespace_pattern", always,
     "'guided_whitespace_pattern' is not supported: answers may hold JSON white space between "
     "tokens"},
    // vLLM's extensions that Tandem does not implement.
    {"use_beam_search", [](const json& v, const json&) { return v != false; },
     "'use_beam_search' is not supported: beam search is not implemented"},
};

void refuse_unsupported(const json& body) {
  for (const Unsupported& u : kUnsupported)
    if (const json* v = field(body, u.name); v && u.refused(*v, body)) fail(u.name, u.why);
}

// OpenAI's logit_bias: {"token id": bias}. As vLLM: biases are clamped to [-100, 100], and ids
// outside the vocabulary are an error listing them.
std::vector<std::pair<int32_t, float>> logit_bias_from(const json& b, int64_t vocab_size) {
  if (b.is_null()) return {};
  if (!b.is_object())
    fail("logit_bias", "'logit_bias' must be an object mapping token ids to biases");
  std::vector<std::pair<int32_t, float>> out;
  std::vector<std::string> outside;
  for (auto it = b.begin(); it != b.end(); ++it) {
    const std::string& key = it.key();
    int64_t id = -1;
    const bool digits =
        !key.empty() && key.size() <= 10 &&
        std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (digits) id = std::stoll(key);
    if (!digits || id > INT32_MAX)
      fail("logit_bias", "'logit_bias' keys must be token ids, got \"" + key.substr(0, 40) + "\"");
    if (!it.value().is_number() || !std::isfinite(it.value().get<double>()))
      fail("logit_bias", "'logit_bias' values must be numbers, got " +
                             it.value().dump().substr(0, 40) + " for token " + key);
    if (vocab_size > 0 && id >= vocab_size) {
      if (outside.size() < 10) outside.push_back(key);
      continue;
    }
    out.emplace_back(static_cast<int32_t>(id),
                     static_cast<float>(std::clamp(it.value().get<double>(), -100.0, 100.0)));
  }
  if (!outside.empty()) {
    std::string list;
    for (const auto& k : outside) list += (list.empty() ? "" : ", ") + k;
    fail("logit_bias", "token id(s) " + list + " in 'logit_bias' are outside the vocabulary of " +
                           std::to_string(vocab_size) + " tokens");
  }
  std::sort(out.begin(), out.end());
  for (size_t i = 1; i < out.size(); ++i)
    if (out[i].first == out[i - 1].first)  // "7" and "07"
      fail("logit_bias", "'logit_bias' names token " + std::to_string(out[i].first) + " twice");
  return out;
}

// vLLM's allowed_token_ids: a non-empty list of ids in the vocabulary (an empty one would leave
// nothing to sample). Sorted and deduplicated: a mask, so order and repetition mean nothing.
std::vector<int32_t> allowed_token_ids_from(const json& v, int64_t vocab_size) {
  if (v.is_null()) return {};
  if (!v.is_array()) fail("allowed_token_ids", "'allowed_token_ids' must be a list of token ids");
  if (v.empty()) fail("allowed_token_ids", "'allowed_token_ids' must not be empty");
  std::vector<int32_t> ids;
  ids.reserve(v.size());
  for (const auto& e : v) {
    if (!e.is_number_integer())
      fail("allowed_token_ids", "'allowed_token_ids' must hold integer token ids");
    const bool outside = e.is_number_unsigned()
                             ? e.get<uint64_t>() > uint64_t(INT32_MAX)
                             : (e.get<int64_t>() < 0 || e.get<int64_t>() > INT32_MAX);
    if (outside || (vocab_size > 0 && e.get<int64_t>() >= vocab_size))
      fail("allowed_token_ids", "token id " + e.dump().substr(0, 40) +
                                    " in 'allowed_token_ids' is outside the vocabulary" +
                                    (vocab_size > 0 ? " of " + std::to_string(vocab_size) : "") +
                                    " tokens");
    ids.push_back(e.get<int32_t>());
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

// vLLM's bad_words, tokenized as vLLM's SamplingParams.update_from_tokenizer does: each word
// without its leading white space, and again after one space (a word inside a sentence is
// usually a different token, " word"), without special tokens. The spaced form is kept only
// when it starts with another token than the bare form and has as many tokens (vLLM's rule).
// A word that tokenizes to nothing is an error, as there.
std::vector<std::vector<int32_t>> bad_words_from(const json& v, const text::Tokenizer& tokenizer,
                                                 int64_t vocab_size) {
  if (v.is_null()) return {};
  if (!v.is_array()) fail("bad_words", "'bad_words' must be a list of strings");
  std::vector<std::vector<int32_t>> out;
  for (const auto& e : v) {
    if (!e.is_string()) fail("bad_words", "'bad_words' must be a list of strings");
    // Counted before each is tokenized: the list may be long.
    if (out.size() >= SamplingParams::kMaxBadWords)
      fail("bad_words", "'bad_words': too many bad words after tokenization, at most " +
                            std::to_string(SamplingParams::kMaxBadWords));
    std::string word = e.get<std::string>();
    word.erase(0, std::min(word.size(), word.find_first_not_of(" \t\n\r\f\v")));
    std::vector<int32_t> bare = tokenizer.encode(word, false);
    if (bare.empty())
      fail("bad_words", "'bad_words' entries must tokenize to at least one token, got \"" +
                            e.get<std::string>().substr(0, 40) + "\"");
    std::vector<int32_t> spaced = tokenizer.encode(" " + word, false);
    out.push_back(std::move(bare));
    if (!spaced.empty() && spaced[0] != out.back()[0] && spaced.size() == out.back().size())
      out.push_back(std::move(spaced));
  }
  for (const auto& word : out)
    for (int32_t id : word)
      if (vocab_size > 0 && id >= vocab_size)
        fail("bad_words", "'bad_words' tokenize to id " + std::to_string(id) +
                              ", outside the model's vocabulary of " + std::to_string(vocab_size) +
                              " tokens");
  return out;
}

// The body's members in the client's key order (nlohmann::json sorts keys), for what must keep
// it: a schema's properties are generated in their listed order, and tools are shown to the
// model as given. Parsed from the body's text on first use (in linear time, whatever the body
// holds besides: structured/ordered_json.h); without the text (or for a member it does not
// hold), the sorted document stands in.
class OrderedBody {
 public:
  explicit OrderedBody(std::string_view raw) : raw_(raw) {}

  nlohmann::ordered_json get(std::initializer_list<std::string_view> path, const json& sorted) {
    if (!parsed_ && !raw_.empty()) {
      parsed_ = true;
      try {
        doc_ = structured::parse_ordered(raw_);
      } catch (const Error&) {
        doc_ = nullptr;  // the caller's reader accepted it: the sorted document stands in
      }
    }
    const nlohmann::ordered_json* at = doc_.is_null() ? nullptr : &doc_;
    for (std::string_view key : path) {
      if (!at || !at->is_object()) return convert(sorted);
      const auto it = at->find(key);
      at = it == at->end() ? nullptr : &*it;
    }
    return at ? *at : convert(sorted);
  }

 private:
  static nlohmann::ordered_json convert(const json& v) {
    return structured::parse_ordered(v.dump());
  }
  std::string_view raw_;
  bool parsed_ = false;
  nlohmann::ordered_json doc_;
};

// Structured outputs, in each dialect's fields: OpenAI's response_format, vLLM's guided_* and
// structured_outputs, SGLang's sampling_params json_schema and regex. At most one.
std::optional<structured::OutputSpec> structured_output_of(const json& body, OrderedBody* ordered) {
  const bool sglang = ordered == nullptr;
  using Kind = structured::OutputSpec::Kind;
  std::optional<structured::OutputSpec> spec;
  auto set = [&](Kind kind, std::string text, const std::string& name) {
    if (spec)
      fail(name,
           "'" + name + "' and '" + spec->field + "' both constrain the answer: send one of them");
    spec = structured::OutputSpec{kind, std::move(text), name};
  };
  // A schema given as an object or as JSON text.
  auto schema_text = [&](const json& v, const std::string& name,
                         std::initializer_list<std::string_view> path) {
    if (v.is_object() || v.is_boolean()) return ordered ? ordered->get(path, v).dump() : v.dump();
    if (v.is_string()) return v.get<std::string>();
    fail(name, "'" + name + "' must be a JSON Schema (an object or its JSON text)");
  };
  auto text_of = [](const json& v, const std::string& name) {
    if (!v.is_string()) fail(name, "'" + name + "' must be a string");
    return v.get<std::string>();
  };
  auto choices_of = [](const json& v, const std::string& name) {
    if (!v.is_array()) fail(name, "'" + name + "' must be a list of strings");
    return v.dump();
  };
  if (sglang) {
    if (const json* v = field(body, "json_schema"))
      set(Kind::kJsonSchema, schema_text(*v, "json_schema", {}), "json_schema");
    if (const json* v = field(body, "regex")) set(Kind::kRegex, text_of(*v, "regex"), "regex");
    if (field(body, "ebnf"))
      fail("ebnf", "'ebnf' grammars are not supported: use json_schema or regex");
  } else {
    if (const json* rf = field(body, "response_format")) {
      if (!rf->is_object() || !rf->contains("type") || !(*rf)["type"].is_string())
        fail("response_format", "'response_format' must be an object with a 'type'");
      const std::string type = (*rf)["type"].get<std::string>();
      if (type == "json_object") {
        set(Kind::kJsonObject, "", "response_format");
      } else if (type == "json_schema") {
        const json* js = field(*rf, "json_schema");
        const json* schema = js && js->is_object() ? field(*js, "schema") : nullptr;
        if (!schema)
          fail("response_format", "'response_format' of type json_schema needs json_schema.schema");
        set(Kind::kJsonSchema,
            schema_text(*schema, "response_format", {"response_format", "json_schema", "schema"}),
            "response_format");
      } else if (type != "text") {
        fail("response_format",
             "'response_format' type must be text, json_object or json_schema, "
             "got '" +
                 type.substr(0, 40) + "'");
      }
    }
    if (const json* v = field(body, "guided_json"))
      set(Kind::kJsonSchema, schema_text(*v, "guided_json", {"guided_json"}), "guided_json");
    if (const json* v = field(body, "guided_regex"))
      set(Kind::kRegex, text_of(*v, "guided_regex"), "guided_regex");
    if (const json* v = field(body, "guided_choice"))
      set(Kind::kChoice, choices_of(*v, "guided_choice"), "guided_choice");
    if (const json* so = field(body, "structured_outputs")) {
      if (!so->is_object()) fail("structured_outputs", "'structured_outputs' must be an object");
      for (auto it = so->begin(); it != so->end(); ++it) {
        const std::string& k = it.key();
        const json& v = it.value();
        if (v.is_null()) continue;
        const std::string name = "structured_outputs." + k;
        if (k == "json")
          set(Kind::kJsonSchema, schema_text(v, name, {"structured_outputs", "json"}), name);
        else if (k == "regex")
          set(Kind::kRegex, text_of(v, name), name);
        else if (k == "choice")
          set(Kind::kChoice, choices_of(v, name), name);
        else if (k == "json_object") {
          if (v == true) set(Kind::kJsonObject, "", name);
        } else if (k == "grammar" || k == "structural_tag")
          fail(name, "'" + name + "' is not supported: use json, regex or choice");
        else if (k == "whitespace_pattern" || (k == "disable_any_whitespace" && v != false))
          // The grammars allow JSON's white space, at most kMaxWhitespace bytes at a time.
          fail(name,
               "'" + name + "' is not supported: answers may hold JSON white space between tokens");
        else if (k == "disable_additional_properties" && !v.is_boolean())
          fail(name, "'" + name + "' must be a boolean");
        else if (k != "disable_fallback" && k != "disable_any_whitespace" &&
                 k != "disable_additional_properties")
          fail(name, "'" + name + "' is not a structured output Tandem knows");
      }
      // vLLM's: closes the JSON schema's objects (structured/json_schema.h); regexes, choices and
      // json_object have no schema to close, there as here.
      if (const json* d = field(*so, "disable_additional_properties");
          d && d->is_boolean() && spec && spec->kind == Kind::kJsonSchema)
        spec->disable_additional_properties = d->get<bool>();
    }
  }
  if (spec) {
    try {
      spec->compiled = structured::compile(*spec);  // here, not on the engine's thread
    } catch (const Error& e) {
      fail(spec->field, "'" + spec->field + "': " + e.what());
    }
  }
  return spec;
}

// Sampling fields shared by the OpenAI endpoints (with vLLM's extensions) and SGLang's
// sampling_params; max_tokens from max_tokens_of, read from the field `max_name`, and min_tokens
// from `min_name`. `ordered`: the OpenAI body's text (null for SGLang's sampling_params).
// `tokenizer`: reads vLLM's allowed_token_ids and bad_words (null for SGLang's, which has
// neither).
SamplingParams sampling_from(const json& body, int64_t max_tokens, const char* max_name,
                             const char* min_name, const ModelLimits& limits, OrderedBody* ordered,
                             const text::Tokenizer* tokenizer) {
  SamplingParams p;
  p.structured_output = structured_output_of(body, ordered);
  const SamplingDefaults& d = limits.sampling;  // for the fields the body leaves out
  const int64_t vocab_size = limits.vocab_size;
  p.temperature = number(body, "temperature", d.temperature);
  p.top_p = number(body, "top_p", d.top_p);
  p.top_k = integer(body, "top_k", d.top_k);
  p.min_p = number(body, "min_p", d.min_p);
  p.repetition_penalty = number(body, "repetition_penalty", d.repetition_penalty);
  p.presence_penalty = number(body, "presence_penalty", 0.0);
  p.frequency_penalty = number(body, "frequency_penalty", 0.0);
  p.max_tokens = max_tokens;
  p.min_tokens = integer(body, min_name, 0);
  p.ignore_eos = boolean(body, "ignore_eos", false);
  p.include_stop_str_in_output = boolean(body, "include_stop_str_in_output", false);
  p.skip_special_tokens = boolean(body, "skip_special_tokens", true);
  // vLLM's int64 (ge=_INT64_MIN, le=_INT64_MAX); a negative one seeds the unsigned number of the
  // same bits.
  if (const json* s = field(body, "seed")) p.seed = static_cast<uint64_t>(whole_number(*s, "seed"));
  if (const json* s = field(body, "stop")) {
    if (s->is_string()) {
      p.stop.push_back(s->get<std::string>());
    } else if (s->is_array()) {
      for (const auto& e : *s) {
        if (!e.is_string()) fail("stop", "'stop' must be a string or a list of strings");
        p.stop.push_back(e.get<std::string>());
      }
    } else {
      fail("stop", "'stop' must be a string or a list of strings");
    }
  }
  if (const json* s = field(body, "stop_token_ids")) {
    if (!s->is_array()) fail("stop_token_ids", "'stop_token_ids' must be a list of token ids");
    // Counted before anything is copied: a body may hold millions of ids.
    if (s->size() > SamplingParams::kMaxStopTokenIds)
      fail("stop_token_ids", "at most " + std::to_string(SamplingParams::kMaxStopTokenIds) +
                                 " stop_token_ids are accepted, got " + std::to_string(s->size()));
    for (const auto& e : *s) {
      if (!e.is_number_integer()) fail("stop_token_ids", "'stop_token_ids' must hold integers");
      if (e.is_number_unsigned() ? e.get<uint64_t>() > INT32_MAX
                                 : (e.get<int64_t>() < 0 || e.get<int64_t>() > INT32_MAX))
        fail("stop_token_ids",
             "'stop_token_ids' must hold token ids (0 to 2147483647), got " + e.dump());
      p.stop_token_ids.push_back(e.get<int32_t>());
    }
  }
  if (const json* b = field(body, "logit_bias")) p.logit_bias = logit_bias_from(*b, vocab_size);
  if (tokenizer) {
    // As vLLM, against the tokenizer's ids (len(tokenizer)): the model's rows past them have no
    // text, are never sampled, and allowing only those would fail mid-answer.
    const auto tokenizer_ids = static_cast<int64_t>(tokenizer->vocab_size());
    if (const json* a = field(body, "allowed_token_ids"))
      p.allowed_token_ids = allowed_token_ids_from(
          *a, vocab_size > 0 ? std::min(vocab_size, tokenizer_ids) : tokenizer_ids);
    if (const json* b = field(body, "bad_words"))
      p.bad_words_token_ids = bad_words_from(*b, *tokenizer, vocab_size);
  }
  // Speculation is a property of the engine (its MTP module, its cache layout in P/D), not of a
  // request: asking for it per request would otherwise be silently ignored.
  for (const char* name :
       {"speculative_config", "num_speculative_tokens", "speculative_tokens", "speculative_model"})
    if (field(body, name))
      fail(name, std::string("'") + name +
                     "' is not supported per request: speculative decoding is set per engine "
                     "(tandem engine --speculative-tokens)");
  try {
    p.validate(max_name, min_name);
  } catch (const InvalidSamplingParam& e) {
    fail(e.param, e.what());
  }
  return p;
}

// A prompt with the tokens asked for must fit the context. The error names the max tokens field
// under the client's name (`max_name`) when the request sent it, else the prompt's field: a
// default max_tokens is not the client's to reduce.
void check_length(const ApiRequest& r, const ModelLimits& limits, const json& body,
                  const char* max_name, const char* prompt_name) {
  for (const auto& ids : r.prompts) {
    if (ids.empty()) fail(prompt_name, "the prompt is empty");
    // Compared without adding: max_tokens near 2^63 made the sum wrap negative and pass.
    const auto prompt = static_cast<int64_t>(ids.size());
    if (limits.max_model_len > 0 && r.sampling.max_tokens > limits.max_model_len - prompt)
      fail(field(body, max_name) ? max_name : prompt_name,
           "This model's maximum context length is " + std::to_string(limits.max_model_len) +
               " tokens. However, you requested " +
               std::to_string(uint64_t(prompt) + uint64_t(r.sampling.max_tokens)) + " tokens (" +
               std::to_string(ids.size()) + " in the prompt, " +
               std::to_string(r.sampling.max_tokens) +
               " in the completion). Please reduce the prompt or " + max_name + ".");
  }
}

// n > 1: n choices of each prompt, prompt-major (choice k answers prompt k / n, as OpenAI and vLLM
// order them), sharing the prompt (ApiRequest::choice_prompt), each with its own seed when one
// was given. best_of (completions): more candidates than n, of which the best are returned, is not
// supported; best_of equal to n asks for nothing more and is accepted.
void read_n(ApiRequest& r, int64_t n, const json& body) {
  if (n < 1 || n > 128) fail("n", "'n' must be between 1 and 128, got " + std::to_string(n));
  if (field(body, "best_of")) {
    const int64_t best_of = integer(body, "best_of", 1);
    if (best_of < n)
      fail("best_of", "'best_of' must be at least 'n' (" + std::to_string(n) + "), got " +
                          std::to_string(best_of));
    if (best_of > n)
      fail("best_of", "'best_of' greater than 'n' is not supported (got best_of " +
                          std::to_string(best_of) + ", n " + std::to_string(n) + ")");
  }
  r.n = n;
  if (n == 1) return;
  const auto times = static_cast<size_t>(n);
  // Each choice is an engine request with its own sequence: the choices are bounded as the
  // prompts of a list are.
  if (r.prompts.size() * times > kMaxPromptsPerRequest)
    fail("n", "'n' (" + std::to_string(n) + ") times the " + std::to_string(r.prompts.size()) +
                  " prompts is more than the " + std::to_string(kMaxPromptsPerRequest) +
                  " choices one request may ask for");
}

}  // namespace

std::string model_name(const json& body, const ModelLimits& limits) {
  const json* m = field(body, "model");
  if (!m) return limits.model_name;
  if (!m->is_string()) fail("model", "'model' must be a string");
  auto name = m->get<std::string>();
  if (name != limits.model_name) throw model_not_found(name);
  return name;
}

namespace {

// Reads the disaggregation fields; a decode leg's prompt_token_ids (sent by our prefill engine)
// replace the prompt, so the decode engine need not template or tokenize again.
void read_disaggregation(const json& body, ApiRequest& r, const ModelLimits& limits) {
  DisaggregationParams& d = r.disagg;
  d = parse_disaggregation(body, limits.vocab_size);
  if (!d.prompt_token_ids.empty()) {
    if (r.choice_count() != 1)
      fail("kv_transfer_params", "kv_transfer_params needs a request with one prompt");
    r.prompts[0] = d.prompt_token_ids;
  }
  if ((d.remote_decode || d.remote_prefill || d.has_bootstrap) && r.choice_count() != 1)
    fail(d.has_bootstrap ? "bootstrap_room" : "kv_transfer_params",
         "disaggregated requests carry one prompt and n = 1: send one request per prompt");
}

// The tools a forced call may be of (every one, or only tools[only]), as the grammar of
// the model's markup needs them: a name the markup carries back to the answer's parser, and
// arguments that are a JSON object (parameters of "type": "object", {}, or properties without a
// type: arguments_schema).
void check_forced(ToolCallFormat format, const nlohmann::ordered_json& tools,
                  std::optional<size_t> only = std::nullopt) {
  for (size_t i = 0; i < tools.size(); ++i) {
    if (only && *only != i) continue;
    const nlohmann::ordered_json& f = tools[i]["function"];
    const std::string name = f["name"].get<std::string>();
    const std::string at = "tools[" + std::to_string(i) + "].function";
    if (const auto why = markup_cannot_carry(format, name))
      fail(at + ".name",
           "the function \"" + utf8::clip(name) + "\" cannot be forced by 'tool_choice': " + *why);
    const auto p = f.find("parameters");
    if (p != f.end() && !p->is_null() && !structured::is_object_schema(arguments_schema(*p)))
      fail(at + ".parameters",
           "a forced call's 'parameters' must be a JSON Schema of \"type\": \"object\" (or {}, "
           "or 'properties' without a type), got " +
               utf8::clip(
                   p->dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace)));
  }
}

}  // namespace

ToolUse read_tools(const json& body, const text::Tokenizer& tokenizer,
                   nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools_in_order,
                   text::ContentFormat format) {
  const json* tools = field(body, "tools");
  const bool have_tools = tools && !tools->empty();
  json choice = have_tools ? json("auto") : json("none");
  if (const json* c = field(body, "tool_choice")) choice = *c;
  if (choice == "none") return {};
  if (!have_tools) fail("tool_choice", "'tool_choice' other than \"none\" needs 'tools'");
  ToolUse use;
  use.format = tool_call_markup(tokenizer);
  use.parallel = boolean(body, "parallel_tool_calls", true);
  if (choice == "required") {
    check_forced(use.format, tools_in_order);
    use.forced =
        forced_tool_calls(use.format, tools_in_order, 1, use.parallel ? -1 : 1, "tool_choice");
  } else if (choice.is_object()) {
    const json* f =
        choice.value("type", json()) == "function" ? field(choice, "function") : nullptr;
    const json* name = f && f->is_object() ? field(*f, "name") : nullptr;
    if (!name || !name->is_string())
      fail("tool_choice",
           "'tool_choice' must be \"none\", \"auto\", \"required\" or "
           "{\"type\": \"function\", \"function\": {\"name\": ...}}");
    // As vLLM's {name: function} of the tools: a name listed twice is its last definition.
    std::optional<size_t> chosen;
    for (size_t i = 0; i < tools_in_order.size(); ++i)
      if (tools_in_order[i]["function"]["name"] == *name) chosen = i;
    if (!chosen)
      fail("tool_choice",
           "'tool_choice' names the function " + name->dump() + ", which 'tools' does not list");
    check_forced(use.format, tools_in_order, chosen);
    use.forced = forced_tool_calls(
        use.format, nlohmann::ordered_json::array({tools_in_order[*chosen]}), 1, 1, "tool_choice");
    use.named = true;
  } else if (choice != "auto") {
    fail("tool_choice", "'tool_choice' must be \"none\", \"auto\", \"required\" or a function");
  }
  if (use.forced) {
    try {
      use.forced->compiled = structured::compile(*use.forced);  // not on the engine's thread
    } catch (const Error& e) {
      fail("tools", std::string("'tools': ") + e.what());
    }
  }
  add_tool_description(messages, tools_in_order, tokenizer, use.format, format);
  return use;
}

namespace {

// stream_options as vLLM reads it: an object (its StreamOptions model), given only with stream
// true. vLLM tests the object's truth, so an empty one passes without stream.
void read_stream_options(const json& body, ApiRequest& r) {
  const json* so = field(body, "stream_options");
  if (!so) return;
  if (!so->is_object())
    fail("stream_options", "'stream_options' must be an object, got " + utf8::clip(so->dump()));
  if (!so->empty() && !r.stream)
    fail("stream_options", "Stream options can only be defined when `stream=True`.");
  r.include_usage = boolean(*so, "include_usage", false);
  r.continuous_usage = boolean(*so, "continuous_usage_stats", false);
}

// vLLM's cache_salt: a non-empty string when given.
std::optional<std::string> cache_salt_of(const json& body) {
  const json* salt = field(body, "cache_salt");
  if (!salt || salt->is_null()) return std::nullopt;
  if (!salt->is_string() || salt->get<std::string>().empty())
    fail("cache_salt", "'cache_salt' must be a non-empty string if provided");
  return salt->get<std::string>();
}

// vLLM's truncate_prompt_tokens: how many tokens each prompt keeps, its last (-1: as many as the
// context holds); none when absent, or -1 with the context not known here (the engine judges).
std::optional<int64_t> truncation_of(const json& body, const ModelLimits& limits) {
  if (!field(body, "truncate_prompt_tokens")) return std::nullopt;
  int64_t keep = integer(body, "truncate_prompt_tokens", 0);
  if (keep == -1 && limits.max_model_len > 0) keep = limits.max_model_len;
  if (keep == -1) return std::nullopt;
  if (keep < 1)
    fail("truncate_prompt_tokens",
         "'truncate_prompt_tokens' must be -1 or at least 1, got " + std::to_string(keep));
  if (limits.max_model_len > 0 && keep > limits.max_model_len)
    fail("truncate_prompt_tokens",
         "'truncate_prompt_tokens' (" + std::to_string(keep) + ") is greater than max_model_len (" +
             std::to_string(limits.max_model_len) + "): select a smaller truncation size");
  return keep;
}

// Ids given as ids keep their last `keep`.
void keep_last(std::vector<int32_t>& ids, std::optional<int64_t> keep) {
  if (keep && static_cast<int64_t>(ids.size()) > *keep) ids.erase(ids.begin(), ids.end() - *keep);
}

// A text encoded as vLLM does with truncation (the tokenizer called with truncation=True and
// max_length=k, truncating on the left): the special tokens the tokenizer adds (BOS) stay, and
// the text keeps its last k minus their count tokens.
// `cut` (if given) says whether the text lost tokens.
std::vector<int32_t> encode_keeping_last(const text::Tokenizer& tokenizer, const std::string& text,
                                         bool add_special, std::optional<int64_t> keep,
                                         bool* cut = nullptr) {
  std::vector<int32_t> ids = tokenizer.encode(text, add_special);
  if (cut) *cut = keep && static_cast<int64_t>(ids.size()) > *keep;
  if (!keep || static_cast<int64_t>(ids.size()) <= *keep) return ids;
  if (!add_special) {
    keep_last(ids, keep);
    return ids;
  }
  const std::vector<int32_t> plain = tokenizer.encode(text, false);
  if (ids.size() < plain.size()) {  // no tokenizer does this; the plain last k if one did
    keep_last(ids, keep);
    return ids;
  }
  const size_t specials = ids.size() - plain.size();
  if (*keep < static_cast<int64_t>(specials))
    fail("truncate_prompt_tokens", "'truncate_prompt_tokens' (" + std::to_string(*keep) +
                                       ") is less than the " + std::to_string(specials) +
                                       " special tokens the tokenizer adds to a prompt");
  // Where the text's own ids sit among the special tokens (BOS before them, EOS after).
  size_t front = 0;
  while (front < specials && !std::equal(plain.begin(), plain.end(), ids.begin() + front)) ++front;
  if (front == specials && !std::equal(plain.begin(), plain.end(), ids.begin() + front)) front = 0;
  const size_t text_keep = static_cast<size_t>(*keep) - specials;
  std::vector<int32_t> out(ids.begin(), ids.begin() + front);
  out.insert(out.end(), plain.end() - text_keep, plain.end());
  out.insert(out.end(), ids.begin() + front + plain.size(), ids.end());
  return out;
}

// vLLM's continue_final_message, as transformers' apply_chat_template does it: the chat rendered
// without a generation prompt is cut after the final message's content as the template saw it
// (text parts joined; given as parts, its last text part), so the model continues that message.
// Python's str.strip() white space throughout.
std::string continue_final(std::string rendered, const nlohmann::ordered_json& final_message,
                           size_t& continued_at) {
  const nlohmann::ordered_json* content =
      final_message.contains("content") ? &final_message["content"] : nullptr;
  if (content && content->is_array() && !content->empty() && content->back().contains("text"))
    content = &content->back()["text"];
  if (!content || !content->is_string())
    fail("continue_final_message", "'continue_final_message' needs a final message with content");
  const std::string text = content->get<std::string>();
  const std::u32string cps = text::jinja::to_u32(text);
  size_t begin = 0, end = cps.size();
  while (begin < end && text::jinja::py_isspace(cps[begin])) ++begin;
  while (end > begin && text::jinja::py_isspace(cps[end - 1])) --end;
  const std::string stripped = text::jinja::from_u32(cps.substr(begin, end - begin));
  const size_t lstripped = text::jinja::from_u32(cps.substr(begin)).size();
  const size_t at = rendered.rfind(stripped);
  if (at == std::string::npos)
    fail("continue_final_message",
         "continue_final_message is set but the final message does not appear in the chat after "
         "applying the chat template");
  continued_at = at;
  if (rendered.compare(at, lstripped, text) == 0 && lstripped == text.size())
    rendered.resize(at + lstripped);  // the template kept the message's trailing space
  else
    rendered.resize(at + stripped.size());
  return rendered;
}

// vLLM's chat echo (serving_chat.py): the last message's text when it has the answer's role
// (ApiRequest::response_role); else "". Text parts are joined by "\n" whatever shape the template
// reads (vLLM joins a list of parts so).
std::string chat_echo_of(const nlohmann::ordered_json& last, const ApiRequest& r) {
  if (last["role"] != r.response_role) return "";
  // Only the content is read: the arguments stay text, so the echo refuses nothing the rendering
  // took (a template that concatenates them never had them parsed).
  const nlohmann::ordered_json joined =
      template_messages(nlohmann::ordered_json::array({last}), text::ContentFormat::kString,
                        NullContent::kNoText, ToolArguments::kText);
  return joined[0]["content"].get<std::string>();
}

// A list of prompts: at most kMaxPromptsPerRequest, checked before any is tokenized.
// vLLM's prompt_logprobs: null, or the alternatives per prompt token (0..20). As vLLM, only a
// whole body carries them (no stream chunk has the field): a stream that asks for alternatives is
// refused, and 0, which vLLM lets pass with a stream, is none.
int32_t prompt_logprobs_of(const json& body, bool stream) {
  const json* v = field(body, "prompt_logprobs");
  if (!v) return -1;
  if (!is_whole_number(*v) || v->get<double>() < 0 || v->get<double>() > 20)
    fail("prompt_logprobs", "'prompt_logprobs' must be an integer between 0 and 20");
  const auto asked = static_cast<int32_t>(v->get<double>());
  if (stream && asked > 0)
    fail("prompt_logprobs", "'prompt_logprobs' are not available when 'stream' is true");
  return stream ? -1 : asked;
}

void check_prompt_count(const json& list, const char* name) {
  if (list.size() > kMaxPromptsPerRequest)
    fail(name, "at most " + std::to_string(kMaxPromptsPerRequest) +
                   " prompts in one request, got " + std::to_string(list.size()));
}

}  // namespace

ApiRequest parse_completion(const json& body, const text::Tokenizer& tokenizer,
                            const ModelLimits& limits, std::string_view raw_body) {
  OrderedBody ordered(raw_body);
  if (!body.is_object()) fail("", "the request body must be a JSON object");
  ApiRequest r;
  r.kind = ApiKind::kCompletion;
  r.model = model_name(body, limits);
  refuse_unsupported(body);
  const json* prompt = field(body, "prompt");
  if (!prompt) fail("prompt", "'prompt' is required");
  r.echo = boolean(body, "echo", false);
  // vLLM's: whether a text prompt gets the tokenizer's special tokens (BOS); ids are taken as
  // given.
  const bool add_special = boolean(body, "add_special_tokens", true);
  const std::optional<int64_t> keep = truncation_of(body, limits);
  // prompt_texts stays aligned with prompts: the text as given, or the ids decoded (for echo:
  // the prompt the model saw, so a truncated text is its ids decoded too).
  auto add_text = [&](const std::string& s) {
    bool cut = false;
    r.prompts.push_back(encode_keeping_last(tokenizer, s, add_special, keep, &cut));
    r.prompt_texts.push_back(cut && r.echo ? tokenizer.decode(r.prompts.back(), false) : s);
  };
  auto add_ids = [&](const json& ids) {
    r.prompts.push_back(token_list(ids, "prompt", limits.vocab_size));
    keep_last(r.prompts.back(), keep);
    r.prompt_texts.push_back(r.echo ? text_of_prompt_ids(tokenizer, r.prompts.back())
                                    : std::string());
  };
  const char* kPromptForms =
      "'prompt' must be a string, a list of strings, a list of token ids or a list of lists of "
      "token ids";
  if (prompt->is_string()) {
    add_text(prompt->get<std::string>());
  } else if (is_token_list(*prompt)) {
    add_ids(*prompt);
  } else if (prompt->is_array() && !prompt->empty()) {
    check_prompt_count(*prompt, "prompt");
    for (const auto& p : *prompt) {
      if (p.is_string())
        add_text(p.get<std::string>());
      else if (is_token_list(p))
        add_ids(p);
      else
        fail("prompt", kPromptForms);
    }
  } else {
    fail("prompt", kPromptForms);
  }
  if (const json* s = field(body, "suffix"); s) fail("suffix", "'suffix' is not supported");
  const int64_t max_tokens = max_tokens_of(body, "max_tokens", 16, limits);
  // As vLLM: max_tokens 0 with echo answers the prompt alone (the engine runs one token, left
  // out); without echo it is refused as any max_tokens below 1.
  r.echo_only = r.echo && max_tokens == 0;
  r.sampling = sampling_from(body, r.echo_only ? 1 : max_tokens, "max_tokens", "min_tokens", limits,
                             &ordered, &tokenizer);
  r.stream = boolean(body, "stream", false);
  read_stream_options(body, r);
  if (const json* lp = field(body, "logprobs")) {
    if (!is_whole_number(*lp) || lp->get<double>() < 0 || lp->get<double>() > 20)
      fail("logprobs", "'logprobs' must be an integer between 0 and 20");
    r.logprobs = static_cast<int32_t>(lp->get<double>());
  }
  r.prompt_logprobs = prompt_logprobs_of(body, r.stream);
  r.tokens_as_ids = boolean(body, "return_tokens_as_token_ids", false);
  r.priority = integer(body, "priority", 0);
  r.cache_salt = cache_salt_of(body);
  read_n(r, integer(body, "n", 1), body);
  read_disaggregation(body, r, limits);
  check_length(r, limits, body, "max_tokens", "prompt");
  return r;
}

ApiRequest parse_chat(const json& body, const text::Tokenizer& tokenizer,
                      const text::ChatTemplate* chat_template, const ModelLimits& limits,
                      std::string_view raw_body, ChatUse use) {
  if (!body.is_object()) fail("", "the request body must be a JSON object");
  ApiRequest r;
  r.kind = ApiKind::kChat;
  r.model = model_name(body, limits);
  refuse_unsupported(body);
  const json* messages = field(body, "messages");
  if (!messages || !messages->is_array() || messages->empty())
    fail("messages", "'messages' must be a non-empty list");
  if (!chat_template) fail("messages", "the model has no chat template; use /v1/completions");
  const json* tools_field = field(body, "tools");
  // A generation refuses it whatever the tool_choice, as vLLM (PR #39780) and OpenAI (code
  // empty_array) refuse it: a template given an empty list may still print its tool-use preamble
  // (llama-3.1's does). vLLM's TokenizeChatRequest takes it and renders the template with it.
  if (use == ChatUse::kGenerate && tools_field && tools_field->is_array() && tools_field->empty())
    fail("tools",
         "`tools` must not be an empty array. Either provide at least one tool or omit the field "
         "entirely.");
  // The shape of content the template that renders this request reads (the tool-use template,
  // when the request has tools and the model one).
  const text::ContentFormat format = chat_template->content_format(tools_field != nullptr);
  OrderedBody ordered(raw_body);
  const nlohmann::ordered_json client_messages = ordered.get({"messages"}, *messages);
  nlohmann::ordered_json msgs =
      template_messages(client_messages, *chat_template, tools_field != nullptr);
  const bool add_generation_prompt = boolean(body, "add_generation_prompt", true);
  const bool continue_final_message = boolean(body, "continue_final_message", false);
  if (continue_final_message && add_generation_prompt)
    fail("continue_final_message",
         "Cannot set both `continue_final_message` and `add_generation_prompt` to True: send "
         "\"add_generation_prompt\": false");
  // What continue_final_message continues: the client's final message, which the tool description
  // read_tools adds after the client's system messages may follow (a chat of system messages).
  const nlohmann::ordered_json final_message =
      continue_final_message ? msgs.back() : nlohmann::ordered_json();
  const nlohmann::ordered_json tools_in_order =
      tools_field ? template_tools(ordered.get({"tools"}, *tools_field)) : nlohmann::ordered_json();
  const ToolUse tools = read_tools(body, tokenizer, msgs, tools_in_order, format);
  r.tool_calls = tools.format;
  r.tool_choice_named = tools.named;
  r.parallel_tool_calls = tools.parallel;
  if (!add_generation_prompt)
    r.response_role = client_messages.back()["role"].get<std::string>();  // checked a string
  if (boolean(body, "echo", false)) r.chat_echo = chat_echo_of(client_messages.back(), r);
  nlohmann::ordered_json ctx = {{"messages", msgs},
                                {"add_generation_prompt", add_generation_prompt},
                                {"bos_token", tokenizer.bos_token()},
                                {"eos_token", tokenizer.eos_token()}};
  if (tools_field) ctx["tools"] = tools_in_order;
  if (const json* kw = field(body, "chat_template_kwargs")) {
    if (!kw->is_object()) fail("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    // These are the validated request (messages, tools) and the tokenizer's own tokens: a kwarg
    // would replace them unchecked (tools then neither parsed nor forced as the request says).
    for (const char* reserved :
         {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
      if (kw->contains(reserved))
        fail("chat_template_kwargs",
             std::string("'chat_template_kwargs' cannot set '") + reserved +
                 "': it is the request's own (send it as the request's field)");
    // Each is set by name in the context, an ordered object (a linear search per key).
    if (kw->size() > structured::kMaxObjectKeys)
      fail("chat_template_kwargs", "'chat_template_kwargs' has " + std::to_string(kw->size()) +
                                       " keys (at most " +
                                       std::to_string(structured::kMaxObjectKeys) + ")");
    for (auto it = kw->begin(); it != kw->end(); ++it)
      ctx[it.key()] = structured::parse_ordered(it.value().dump());
  }
  std::string rendered;
  try {
    rendered = chat_template->render(ctx);
  } catch (const Error& e) {
    fail("messages", e.what());
  }
  size_t continued_at = std::string::npos;
  if (continue_final_message)
    rendered = continue_final(std::move(rendered), final_message, continued_at);
  r.reasoning = limits.reasoning;
  // Whether the answer is read as content from its start: the prompt closed the reasoning already
  // (it ends with </think>, or a continued final message closed it), as vLLM's structured outputs
  // decide from the prompt's ids, or qwen3's switch below.
  if (r.reasoning != ReasoningFormat::kNone) {
    const bool prompt_closed = prompt_ends_reasoning(rendered, continued_at);
    // The split of the answer also follows vLLM's qwen3 parser, which reads an answer with
    // enable_thinking false as content when no </think> comes (a template without think markers,
    // as Qwen3-Instruct-2507's, never closes the reasoning in the prompt), but still splits at a
    // </think> the answer writes: so a prompt that opens a think block anyway (QwQ's,
    // Qwen3-Thinking-2507's) keeps the split.
    const json* kw = field(body, "chat_template_kwargs");
    const bool thinking_off = r.reasoning == ReasoningFormat::kQwen3 && kw &&
                              kw->value("enable_thinking", json(true)) == json(false);
    r.reasoning_all_content =
        prompt_closed || (thinking_off && !prompt_opens_reasoning(rendered, continued_at));
  }
  // The template writes the special tokens it wants; vLLM's add_special_tokens adds the
  // tokenizer's (BOS) on top.
  r.prompts.push_back(encode_keeping_last(tokenizer, rendered,
                                          boolean(body, "add_special_tokens", false),
                                          truncation_of(body, limits)));
  const int64_t prompt_len = static_cast<int64_t>(r.prompts[0].size());
  const int64_t room = std::max<int64_t>(1, limits.max_model_len - prompt_len);
  const char* max_name =
      field(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  // As vLLM: without max_tokens, the generation config's max_new_tokens if the room is larger.
  const int64_t fallback = limits.sampling.max_tokens;
  const int64_t chat_default = fallback > 0 ? std::min(room, fallback) : room;
  r.sampling = sampling_from(
      body,
      max_tokens_of(body, max_name, chat_default, limits, limits.max_model_len > 0 ? room : 0),
      max_name, "min_tokens", limits, &ordered, &tokenizer);
  if (tools.forced) {
    if (r.sampling.structured_output)
      fail("tool_choice", "'tool_choice' forces a call and '" +
                              r.sampling.structured_output->field +
                              "' constrains the answer too: send one of them");
    r.sampling.structured_output = tools.forced;
  }
  r.stream = boolean(body, "stream", false);
  read_stream_options(body, r);
  // top_logprobs is checked whether or not logprobs is set: as OpenAI and vLLM, alternatives
  // asked for without logprobs are an error, not an answer without them.
  const int64_t top = integer(body, "top_logprobs", 0);
  if (top < 0 || top > 20) fail("top_logprobs", "'top_logprobs' must be between 0 and 20");
  if (boolean(body, "logprobs", false))
    r.logprobs = static_cast<int32_t>(top);
  else if (top > 0)
    fail("top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true");
  r.prompt_logprobs = prompt_logprobs_of(body, r.stream);
  r.tokens_as_ids = boolean(body, "return_tokens_as_token_ids", false);
  r.priority = integer(body, "priority", 0);
  r.cache_salt = cache_salt_of(body);
  if (field(body, "best_of")) fail("best_of", "'best_of' is not a chat completion parameter");
  read_n(r, integer(body, "n", 1), body);
  read_disaggregation(body, r, limits);
  // A constrained answer (forced tool calls, structured outputs) of a reasoning model thinks
  // first: the grammar holds after the </think> token, as vLLM's structured outputs with a
  // reasoning parser apply it once is_reasoning_end sees that token. With the reasoning closed by
  // the prompt, or no </think> token to wait for, the grammar holds from the first token and the
  // answer is all content. The grammar waits exactly when the answer is read as reasoning first:
  // qwen3 with enable_thinking false and a prompt without think markers is read as content, so it
  // is constrained from its first token (vLLM's grammar waits there for a </think> a model that
  // does not think never writes, and leaves the whole answer unconstrained).
  if (r.sampling.structured_output) {
    if (r.reasoning != ReasoningFormat::kNone && !r.reasoning_all_content)
      r.sampling.reasoning_end_token = tokenizer.token_to_id(kReasoningEnd);
    if (!r.sampling.reasoning_end_token) r.reasoning_all_content = true;
    // A grammar reads the answer from its first generated token, so it cannot take up answer
    // text that a continued final message already wrote. vLLM's starts over after that text (the
    // message then holds it and a second, whole answer); a grammar fed it would leave the content
    // a tail that alone does not parse, and a forced call's markup outside the parsed answer.
    // Neither is surely what the client meant, so it is told to choose.
    const std::string_view written = answer_written(rendered, continued_at, r.reasoning);
    const std::string& constraint = r.sampling.structured_output->field;
    if (use == ChatUse::kGenerate && !r.sampling.reasoning_end_token &&
        written.find_first_not_of(" \t\r\n") != std::string_view::npos)
      // Without a reasoning parser every word of the message is answer, a think block too.
      fail("continue_final_message",
           "'continue_final_message' continues a final message that already wrote part of the "
           "answer, which '" +
               constraint + "' constrains from its start: send the final message without its " +
               (r.reasoning != ReasoningFormat::kNone ? "answer text (its reasoning may stay)"
                                                      : "text") +
               ", or only one of the two fields");
  }
  check_length(r, limits, body, max_name, "messages");
  return r;
}

ApiRequest parse_generate(const json& body, const text::Tokenizer& tokenizer,
                          const ModelLimits& limits) {
  if (!body.is_object()) fail("", "the request body must be a JSON object");
  ApiRequest r;
  r.kind = ApiKind::kGenerate;
  r.model = limits.model_name;
  const json* ids = field(body, "input_ids");
  const json* text = field(body, "text");
  if ((ids != nullptr) == (text != nullptr))
    fail("input_ids", "exactly one of 'input_ids' and 'text' is required");
  if (ids) {
    if (is_token_list(*ids)) {
      r.prompts.push_back(token_list(*ids, "input_ids", limits.vocab_size));
    } else if (ids->is_array() && !ids->empty() &&
               std::all_of(ids->begin(), ids->end(),
                           [](const json& p) { return is_token_list(p); })) {
      check_prompt_count(*ids, "input_ids");
      for (const auto& p : *ids) r.prompts.push_back(token_list(p, "input_ids", limits.vocab_size));
    } else {
      fail("input_ids", "'input_ids' must be a non-empty list of token ids or of such lists");
    }
  } else if (text->is_string()) {
    r.prompts.push_back(tokenizer.encode(text->get<std::string>(), true));
  } else if (text->is_array() && !text->empty()) {
    check_prompt_count(*text, "text");
    for (const auto& t : *text) {
      if (!t.is_string()) fail("text", "'text' must be a string or a list of strings");
      r.prompts.push_back(tokenizer.encode(t.get<std::string>(), true));
    }
  } else {
    fail("text", "'text' must be a string or a list of strings");
  }
  const json* sp = field(body, "sampling_params");
  if (sp && !sp->is_object()) fail("sampling_params", "'sampling_params' must be an object");
  static const json empty = json::object();
  // SGLang's default for max_new_tokens is 128.
  const json& params = sp ? *sp : empty;
  // SGLang's SamplingParams has no min_tokens (its name is min_new_tokens) and refuses the
  // keyword; read as vLLM's, it would be honoured here and ignored by an SGLang engine.
  if (field(params, "min_tokens"))
    fail("min_tokens", "'min_tokens' is not an SGLang sampling parameter; use 'min_new_tokens'");
  // SGLang applies a model's generation config in its OpenAI adapters, not to native requests.
  ModelLimits native = limits;
  native.sampling = {};
  r.sampling = sampling_from(params, max_tokens_of(params, "max_new_tokens", 128, native),
                             "max_new_tokens", "min_new_tokens", native, nullptr, nullptr);
  r.stream = boolean(body, "stream", false);
  if (boolean(body, "return_logprob", false)) {
    const int64_t top = integer(body, "top_logprobs_num", 0);
    if (top < 0 || top > 20)
      fail("top_logprobs_num",
           "'top_logprobs_num' must be between 0 and 20, got " + std::to_string(top));
    r.logprobs = static_cast<int32_t>(top);
    // SGLang's default, -1, asks for the output's logprobs alone.
    r.logprob_start_len = integer(body, "logprob_start_len", -1);
    if (r.logprob_start_len < -1)
      fail("logprob_start_len",
           "'logprob_start_len' must be -1 (output logprobs only) or a "
           "prompt position, got " +
               std::to_string(r.logprob_start_len));
    for (const auto& p : r.prompts)
      if (r.logprob_start_len >= static_cast<int64_t>(p.size()))
        fail("logprob_start_len", "'logprob_start_len' " + std::to_string(r.logprob_start_len) +
                                      " is not a position of the " + std::to_string(p.size()) +
                                      "-token prompt");
  }
  if (const json* rid = field(body, "rid")) {
    if (!rid->is_string()) fail("rid", "'rid' must be a string");
    r.request_id = rid->get<std::string>();
  }
  read_disaggregation(body, r, limits);
  check_length(r, limits, params, "max_new_tokens", ids ? "input_ids" : "text");
  return r;
}

}  // namespace tandem::api
