#pragma once
// The sampling parameters of the OpenAI and vLLM APIs (and SGLang's sampling_params), as a
// request carries them from the client through the gateway to the engine's sampler.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "structured/output_spec.h"
#include "util/error.h"

namespace tandem::api {

struct SamplingParams {
  double temperature = 1.0;
  int64_t top_k = 0;  // 0 or -1: off
  double top_p = 1.0;
  double min_p = 0.0;
  double repetition_penalty = 1.0;
  double presence_penalty = 0.0;
  double frequency_penalty = 0.0;
  std::optional<uint64_t> seed;
  int64_t max_tokens = 16;
  // No end: EOS and stop_token_ids are not sampled, and stop strings not matched, before this
  // many tokens were generated (vLLM's min_tokens).
  int64_t min_tokens = 0;
  std::vector<int32_t> stop_token_ids;
  // Bounded for the same reason as stop strings: every id is masked before min_tokens and each
  // sampled token is looked up among them (vLLM's GPU sampler takes 128; lists of a model's
  // special tokens stay well within this).
  static constexpr size_t kMaxStopTokenIds = 1024;
  std::vector<std::string> stop;  // stop strings: output ends before the first occurrence
  // Every generated token is checked against every stop string: bounded, so a request cannot
  // make each step of the engine's loop slow for everyone (OpenAI allows 4 strings).
  static constexpr size_t kMaxStopStrings = 64;
  static constexpr size_t kMaxStopStringBytes = 256;
  bool ignore_eos = false;
  // vLLM's: a stop string (or stop token's text) ends the answer with it rather than before it.
  bool include_stop_str_in_output = false;
  // vLLM's: special tokens (EOS, chat markup) add no text; with false their text is shown.
  bool skip_special_tokens = true;
  // Added to the logits of these token ids before penalties and sampling (greedy included),
  // as OpenAI's logit_bias: (token id, bias in [-100, 100]), ascending ids, each once.
  std::vector<std::pair<int32_t, float>> logit_bias;
  // vLLM's allowed_token_ids: when not empty, every other id is masked (-inf) on the raw logits,
  // first of all, so the answer holds only these ids (classification, constrained answers).
  // Ascending, each once.
  std::vector<int32_t> allowed_token_ids;
  // vLLM's bad_words as token sequences (the request's words tokenized, with and without a
  // leading space: api/request.cpp): the last id of a sequence is masked whenever the output ends
  // in the ids before it, so no sequence appears whole in the answer. Bounded as vLLM's, since
  // every step compares each sequence with the output's tail.
  std::vector<std::vector<int32_t>> bad_words_token_ids;
  static constexpr size_t kMaxBadWords = 128;              // sequences, after tokenization
  static constexpr size_t kMaxBadWordsTotalTokens = 1024;  // their ids together
  // What the answer must be (JSON of a schema, a regex, a choice, forced tool calls): decoded
  // under a token mask (structured/token_constraint.h). Compiled when the request is parsed, so
  // a spec that does not compile is a 400 naming its field (and carried: OutputSpec::compiled).
  std::optional<structured::OutputSpec> structured_output;
  // Set for a structured output with a reasoning parser (vLLM's --reasoning-parser) when the
  // prompt left the reasoning open: the id that ends it (</think>). The grammar then holds only
  // for the tokens after that id, which is unconstrained itself, as vLLM applies it once the
  // reasoning ended: the model thinks freely, then answers as constrained.
  std::optional<int32_t> reasoning_end_token;

  // Throws InvalidSamplingParam when a value is out of range. `max_tokens_name` is what the
  // request called max_tokens (max_completion_tokens, max_new_tokens): the error names the field
  // the client sent.
  // Errors name max_tokens and min_tokens as the request's dialect does (SGLang's
  // max_new_tokens and min_new_tokens).
  void validate(const std::string& max_tokens_name = "max_tokens",
                const std::string& min_tokens_name = "min_tokens") const;

  // A P/D prefill leg computes the prompt and its first token only: max_tokens 1, and a
  // min_tokens past one (SGLang's min_new_tokens too) left to the decode leg, which honours it
  // (kept, it would fail the check that it is at most max_tokens).
  void limit_to_prefill_leg() {
    max_tokens = 1;
    min_tokens = std::min<int64_t>(min_tokens, 1);
  }
};

// What a request that omits a sampling field gets: vLLM's neutral values, unless the model's
// generation config (or the engine's --override-generation-config) sets others, as vLLM's
// --generation-config auto does for its OpenAI endpoints (SGLang's native /generate keeps its
// own). `max_tokens` (the config's max_new_tokens) is what a chat that omits max_tokens gets at
// most, as vLLM's fallback; `max_tokens_cap` caps every request's, asked for or not, as vLLM's
// override_max_tokens (the override's max_new_tokens, or a --generation-config folder's). 0: none.
struct SamplingDefaults {
  double temperature = 1.0;
  int64_t top_k = 0;
  double top_p = 1.0;
  double min_p = 0.0;
  double repetition_penalty = 1.0;
  int64_t max_tokens = 0;
  int64_t max_tokens_cap = 0;
};

// A parameter out of range: `param` names it as the request did, and the message says why.
class InvalidSamplingParam : public Error {
 public:
  InvalidSamplingParam(std::string param, const std::string& message)
      : Error(message), param(std::move(param)) {}
  std::string param;
};

}  // namespace tandem::api
