#pragma once
// What an engine produces for one request, update by update: the ids and text generated since the
// previous update, their log-probabilities, and how it ended. The response builders
// (api/response.h) render these as the bodies and stream chunks of each API.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace tandem::api {

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;  // the most likely tokens at that position
  // The token's rank among all at that position: 1 + how many were more likely (vLLM's); 0 when
  // not computed.
  int32_t rank = 0;
};

// A log-probability as OpenAI sends it: -inf (a token the constraints ruled out) is -9999, which
// JSON can carry.
inline double wire_logprob(float v) {
  return std::max(static_cast<double>(v), -9999.0);
}

struct RequestOutput {
  std::vector<int32_t> tokens;         // ids generated since the previous update
  std::vector<TokenLogprob> logprobs;  // one per id when logprobs were requested
  // Prompt logprobs, when requested, in the update with the first generated id: one per prompt
  // token after the first (the first has no context to be predicted from).
  std::vector<TokenLogprob> prompt_logprobs;
  std::string text;  // text that became final since the previous update
  bool finished = false;
  std::string finish_reason;  // "stop", "length", "abort" or "error"
  // What ended a "stop": the stop string it matched, or the id it stopped on (a stop_token_ids
  // entry, or the EOS: `stop_at_eos`). vLLM's stop_reason is the string or the id, null for the
  // EOS; SGLang's matched names the id either way.
  std::optional<std::string> stop_string;
  std::optional<int32_t> stop_token;
  bool stop_at_eos = false;
  std::string error;  // for "error"
  int64_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
  int error_status = 500;  // the HTTP status an "error" maps to
  std::string error_code;  // its OpenAI error code, when it has one (api/error.h)
  // A prefill for a remote decode (the pull flow), in its final output: where the decode engine
  // pulls the prompt's KV from (api/disaggregation.h, PulledKv).
  std::string kv_transfer_id;
  std::vector<int32_t> kv_blocks;
};

}  // namespace tandem::api
