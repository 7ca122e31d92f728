#pragma once
// The prefill/decode disaggregation fields of a request, in both dialects, owned here for the
// gateway that writes them and the engine that reads them:
//   - vLLM's sequential (pull) flow: the prefill leg carries `kv_transfer_params` with
//     do_remote_decode; the prefill engine answers with the params a decode engine needs to pull
//     the prompt's KV (NixlConnector's fields plus the prompt's ids); the decode leg carries them.
//   - SGLang's parallel (bootstrap room) flow: both legs carry the same `bootstrap_host`,
//     `bootstrap_port` and `bootstrap_room`; each engine's role says which leg it serves.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/output.h"

namespace tandem::api {

struct DisaggregationParams {
  bool remote_decode = false;   // do_remote_decode: this is the prefill leg
  bool remote_prefill = false;  // do_remote_prefill: this is the decode leg
  std::string remote_host, remote_engine_id, remote_request_id;
  int64_t remote_port = 0;
  std::vector<int32_t> remote_block_ids;
  std::vector<int32_t> prompt_token_ids;  // decode leg: the prompt the prefill computed; or empty
  // Decode leg: the prompt's logprobs the prefill computed (when its request asked for them).
  std::vector<TokenLogprob> prompt_logprobs;
  bool has_bootstrap = false;
  std::string bootstrap_host;
  int64_t bootstrap_port = 0;  // 0 when null or absent
  uint64_t bootstrap_room = 0;
};

// Reads a request body's disaggregation fields. Throws ApiError (400) naming the field; token ids
// must lie in [0, vocab_size).
DisaggregationParams parse_disaggregation(const nlohmann::json& body, int64_t vocab_size);

// Where a decode engine pulls a prompt's KV from: a prefill engine's answer to a prefill leg.
struct PulledKv {
  std::string engine_id, host;
  int64_t port = 0;
  std::string transfer_id;
  std::vector<int32_t> blocks;
  std::vector<int32_t> prompt_ids;  // so the decode engine need not template and tokenize again
  // The prompt's logprobs, when the request asked for them: only the prefill engine has the
  // prompt's logits. Written as "prompt_logprobs": [[token, logprob, rank, [[id, logprob], ...]],
  // ...], positions 1.. of the prompt (Tandem's field; other engines ignore it).
  // (At most kMaxCarriedPromptLogprobsBytes of JSON; larger ones are left out, and the decode
  // engine computes them again.)
  std::vector<TokenLogprob> prompt_logprobs;
};
inline constexpr size_t kMaxCarriedPromptLogprobsBytes = size_t{4} << 20;
// The answer's `kv_transfer_params` object.
nlohmann::json kv_transfer_params(const PulledKv& kv);

// The gateway's prefill leg of a sequential request: the client's body asking for a remote
// decode, answered whole (not streamed) after one token.
nlohmann::json prefill_leg_body(nlohmann::json client_body);

// The `"kv_transfer_params":{...}` member of a prefill engine's answer, as text to splice into the
// decode leg's body. Throws tandem::Error when the answer has none.
std::string kv_transfer_params_member(std::string_view prefill_answer);

// The parallel flow's bootstrap fields as members to splice into both legs' bodies (no braces).
std::string bootstrap_members(std::string_view host, int64_t port, uint64_t room);

// Removes every disaggregation field from a client's body: the gateway sets its own.
void strip_disaggregation_fields(nlohmann::json& body);

}  // namespace tandem::api
