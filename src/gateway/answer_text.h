#pragma once
// What the gateway reads from, and adds to, the text of bodies and answers it relays without
// parsing them: a full JSON parse per request would cost more than the rest of the relay, so these
// look at the few bytes that matter. Pure functions of the text; and the client's text kept in
// the bodies the gateway does rewrite (dump_in_client_order).
#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace tandem::gateway {

// `object_text` (a serialized JSON object) with `members` (serialized "key":value pairs) added
// before its closing brace; text without one is returned as it is.
std::string splice_fields(const std::string& object_text, const std::string& members);

// `body` (parsed from the client's `client_text`, then changed at will) serialized with the
// client's text for each member it holds as the client sent it: the objects in those keep the
// client's key order. An engine reads that order (it shows tools to the model, and generates a
// schema's properties, in the order they are listed), and nlohmann::json, which the gateway
// parses into, sorts keys. Members the gateway added or changed are written from `body`; so is
// a value without objects (a prompt's ids: nothing to keep, and no second parse).
std::string dump_in_client_order(const nlohmann::json& body, std::string_view client_text);

// Whether the text starts with '{' and ends with '}' (surrounding white space aside).
bool looks_like_json_object(std::string_view body);
// Whether the text is one whole JSON object (a full parse, without building it): for answers
// whose end nothing but the connection's close marked, where a cut one can still end in '}'.
bool is_json_object(std::string_view body);

// usage.completion_tokens of a completion answer (its last "completion_tokens"), or -1.
int64_t usage_completion_tokens(std::string_view body);
// usage.prompt_tokens_details.cached_tokens of an answer, a stream's usage chunk or a whole
// stream's text (its last "cached_tokens"), or -1 when it reports none (vLLM leaves
// prompt_tokens_details null unless started with --enable-prompt-tokens-details).
int64_t usage_cached_tokens(std::string_view text);
// `text` with the number usage_cached_tokens reads replaced by `cached` (a P/D answer or usage
// chunk given the prefill engine's reuse); text that reports none is returned as it is.
std::string with_usage_cached_tokens(std::string text, int64_t cached);

// What an engine's error answer (status >= 400) says: an OpenAI error, which is relayed as it is
// (`relay`), or else the text to quote in the gateway's own OpenAI error (white space and control
// bytes folded to single spaces, clipped). Relaying anything else labelled it application/json: a
// proxy's HTML 502 page reached clients as JSON.
struct EngineError {
  bool relay = false;
  std::string text;
};
EngineError read_engine_error(std::string_view body);

// Of one streamed event's data: an OpenAI error object (checked on a stream's first event, which
// decides whether the request can still be retried elsewhere).
bool is_error_event(std::string_view data);
// Of a stream's error event (is_error_event): the status of the answer it stands for when that is
// no failure of the engine's, or 0 when it reports the engine's failure. A client's error is one
// an engine finds only once generation starts (masks that leave no token), and which it can only
// send in its stream: the type "invalid_request_error" (Tandem's engines: 400). A rate limit
// (code 429, or OpenAI's "rate_limit_exceeded"; vLLM and SGLang send it only as a status, but an
// engine behind a proxy may stream it) is a refusal, as a 429 answer is: 429. So is SGLang's
// scheduler abort (a full queue, a priority eviction), whose stream sends code 503: 503 (either
// code may come as a string through a proxy). vLLM's and SGLang's
// streams say {"type": "BadRequestError", "code": 400} for their own failures too, so that is the
// engine's.
int error_event_status(std::string_view error_event);
// Of one streamed event's data: a chunk that carries tokens (for TTFT and ITL), not [DONE], the
// usage chunk ("choices":[]) or an error event.
bool carries_tokens(std::string_view data);

}  // namespace tandem::gateway
