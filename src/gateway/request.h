#pragma once
// A client request as the gateway carries it, and the legs (engine calls) that serve it. Who
// writes what is stated per field group: the io thread that received it fills the first group and
// then only reads it; the scheduling thread owns the second; the third is shared under `mutex`
// (the relay writes it on the client's io threads as the engines answer).
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "api/prefill_work.h"
#include "gateway/lifecycle.h"
#include "gateway/routing_quality.h"
#include "gateway/seams.h"
#include "gateway/tokens_in.h"
#include "net/http.h"
#include "net/sse.h"

namespace tandem::gateway {

// Which leg a request waits for: its first (prefill, or the one aggregated leg), or, in sequential
// mode after the prefill answered, the decode leg.
enum class Stage { kFirst, kDecode };

// Where a request is in the scheduler's books.
enum class Booking {
  kOutside,  // not yet submitted, or finished (or answered before it reached the scheduler)
  kQueued,   // waiting for engines
  kRunning,  // its legs run
};

// What the client has got.
enum class ClientState {
  kNothingSent,  // a retry is still possible
  kAnswering,    // a response or a stream's head went out
  kEnded,        // its response is complete or failed (or the client left): nothing more starts
};

// How a request ended, for the client's status, the metrics and the access log.
struct Outcome {
  int status = 200;
  std::string error;  // empty when it succeeded
};

enum class LegState {
  kNew,       // built, its call not yet started
  kRunning,   // its call runs
  kRelaying,  // (relay legs) its first event reached the client: the client's stream is its
  kFinished,  // its call ended (on_done ran)
};

struct Leg {
  int endpoint = -1;
  Executor::Clock::time_point started{};  // scheduling clock, when it was sent
  int attempt = 0;
  bool prefill = false;
  Upstream::CallId call = 0;
  LegState state = LegState::kNew;  // under the request's mutex
  std::string cancel_reason;  // why the gateway cancelled it (a timeout), for the error message
  // Cancelled for a reason that is not the engine's fault (the client left, the other leg
  // failed): not counted against the engine's health.
  std::atomic<bool> gateway_cancelled{false};
  bool engine_error = false;  // an error event, or a prefill answer without kv_transfer_params
  // A parallel prefill leg failed because its decode leg abandoned the bootstrap room
  // (api::kRoomAbandonedCode): the decode leg's failure, not the prefill engine's.
  bool room_abandoned = false;
  // A P/D decode leg failed because it could not take the prompt's KV from the prefill engine
  // (api::kKvTransferFailedCode): the prefill engine's failure, not the decode engine's.
  bool kv_transfer_failed = false;
  // A sequential decode leg failed because its prefill engine no longer held the prompt's KV
  // (api::kKvTransferExpiredCode): neither engine's failure; the prompt is prefilled again.
  bool kv_expired = false;
  // A sequential decode leg failed because its prefill engine refused the pull for now, its KV
  // transfer connections all in use (api::kKvTransferBusyCode): neither engine's failure; the KV
  // is still held there, for a decode leg sent again after a backoff (Topology::retry_backoff).
  bool kv_transfer_busy = false;
  // The answer outgrew what the relay holds (Topology::max_answer_bytes): the gateway's refusal,
  // not the engine's fault.
  bool answer_too_large = false;
  // Its engine's Retry-After on a refusal (429, 503: its queue is full), for the client's answer
  // once retries are spent; empty when it sent none (or one that is no short line of text).
  std::string retry_after;
  // A non-streaming answering leg cut at first_token_ms, which bounds its whole answer (under the
  // request's mutex): not retried, since another engine would take as long (unless it never
  // connected: then retried, as one that could not connect).
  bool whole_answer_timed_out = false;
  // Its completion ended the request: the request's accounting runs in the same scheduler task
  // as the leg's, one post per request end instead of two.
  bool ended_request = false;
  // What it counts for on its endpoint until it finishes (set before it starts).
  int64_t prompt_tokens = 0;
  api::PrefillWork uncached;   // prefill work there: the prefill leg, or the aggregated one
  Executor::TimerId deadline;  // scheduling thread only: cancelled when the leg ends
  // The relay's view of the answer (the io thread running its call).
  int status = 0;
  // Its call failed without connecting (net::CallFailure::kNotConnected): the engine never saw it.
  bool never_connected = false;
  // A sequential decode leg that ended leaving its prompt's KV on the prefill engine, taken by no
  // decode engine: it never connected, its engine's HTTP server refused it unread (401, 413,
  // 431: no application read it, so none let go of the KV), or its engine could not pull the KV
  // (kv_transfer_failed). Set with its kFinished state, under the request's mutex.
  bool left_kv_untaken = false;
  bool streaming = false;  // an SSE answer
  // Neither Content-Length nor chunked: the body ends when the connection does, so an answer cut
  // short arrives as if whole, and only its own syntax can tell.
  bool until_close = false;
  std::string body;  // a non-streaming answer, or a stream's first event when it is an error
  net::SseParser parser;
  bool stream_done = false;  // the stream's [DONE] arrived: the client has the whole answer
  // The engine's error event (after the client's stream began) was written to the client: the
  // request ended as that error says, however the stream is then cut.
  bool error_event_sent = false;
  // A verbatim relay (no translation): the stream's bytes before its first event completed,
  // held back until that event shows it is no error.
  std::string held;
  // Every relay: how many bytes came before the stream's first event completed (at most
  // Topology::max_answer_bytes).
  size_t bytes_before_first_event = 0;
  // The prompt tokens the engine reports it reused (usage.prompt_tokens_details.cached_tokens),
  // -1 until an answer or usage chunk says.
  int64_t cached_tokens = -1;

  bool running() const { return state == LegState::kRunning || state == LegState::kRelaying; }
};

struct Request {
  // Set on the io thread before it reaches the scheduler, then read-only.
  std::string id, method, path, target, model;
  bool stream = false;
  std::shared_ptr<ClientReply> reply;
  net::Headers headers;             // for the engines
  std::string body;                 // aggregated or decode leg (parallel: without bootstrap fields)
  std::string prefill_body;         // sequential prefill leg
  bool prefill_asks_usage = false;  // parallel: the prefill leg adds stream_options.include_usage
  int64_t prompt_tokens = 0;
  bool tokens_known = false;
  std::vector<int32_t> prompt_ids;     // when the gateway tokenized it
  std::vector<uint64_t> block_hashes;  // of the prompt's ids, when the gateway tokenized it
  std::optional<uint64_t> cache_salt;  // TokensIn::cache_salt: folded into block_hashes
  std::unique_ptr<ResponseTranslator> translator;  // tokens-in: the engine's answer -> client's
  int64_t received_unix_ms = 0;
  // The client's IP address (net::HttpRequest::remote_address), and the response body bytes its
  // reply was given, counted by the reply as it is answered on any thread (set_client, in
  // request_record.h); null when its reply counts none. For the access log.
  std::string client_address;
  std::shared_ptr<const std::atomic<uint64_t>> body_bytes_sent;
  int priority_class = 0;  // its index in the topology's priority classes (0 without classes)
  PhaseTimes times;

  // Scheduling thread only.
  Stage stage = Stage::kFirst;
  Booking booking = Booking::kOutside;
  int attempt = 0;  // current attempt; legs of older attempts are ignored
  // The requests submitted with it, itself included (Dispatcher::submit of several: the choices or
  // prompts of one client request, n > 1 or a prompt list), or null when it came alone. A full
  // queue sheds them whole or not at all: one shed fails the others (ChoiceMerger), running or not.
  std::shared_ptr<const std::vector<std::weak_ptr<Request>>> submitted_with;
  // Of those attempts, the ones that followed a decode leg whose prefill engine refused the pull
  // for now (Dispatcher::Blame::kNoEngineKvBusy): they spend none of prefill_retries, and each
  // waits longer (Topology::retry_backoff).
  int busy_retries = 0;
  std::vector<int> excluded;
  // Of those, the engines that refused it (429, 503: full for now), as opposed to failed it.
  std::vector<int> refused_by;
  // Of its retries, those that followed an engine's refusal (429, 503) with no engine left that had
  // not refused or failed it: each waited the topology's retry_backoff, longer each time.
  int refusal_backoffs = 0;
  // The attempt whose prefill engine's failure was counted (by its leg, or by a decode leg that
  // could not take its KV): one failure counts once, whichever leg tells of it first.
  int prefill_blamed_attempt = -1;
  // Why each earlier attempt failed (access log); kv_transfer_busy retries only the first time.
  std::vector<std::string> retried_after;
  int prefill_endpoint = -1, decode_endpoint = -1, prefill_group = 0;
  // Sequential mode: the group whose decode room it holds while it is prefilled or waits to
  // decode (Dispatcher::reserve_decode); -1: none.
  int decode_reserved_group = -1;
  api::PrefillWork uncached;  // the prompt work the engine chosen to prefill it lacks in cache
  // The prompt's deadline there (Policy::prefill_deadline, as Unix ms), sent as the `priority` of
  // the leg that computes the prompt; none: the body goes as it is.
  std::optional<int64_t> prefill_priority;
  // Routing quality at the decision that chose the engine computing its prompt (available and
  // chosen; `delivered` is the shared `cached_tokens_reported` below).
  PrefixReuse reuse;
  std::string prefill_name, decode_name;
  Executor::TimerId queue_timer;  // cancelled when it leaves the queue
  bool record_pending = false;    // ended; its record waits for its prefill leg (parallel mode)
  Executor::Clock::time_point queued_at;
  // What it adds to the queue's bytes of bodies while it waits (Dispatcher::enqueue), given back
  // as it leaves: a decode stage holds its decode body too.
  size_t queued_bytes = 0;
  // Sequential mode: when the prefill answered, from which its engine holds the prompt's KV for
  // the decode stage (only so long: Timeouts::decode_queue).
  Executor::Clock::time_point kv_held_since;
  // Sequential mode: the kv_transfer_params member (`"kv_transfer_params":{...}`) the prefill
  // engine `held_kv_endpoint` answered attempt `held_kv_attempt` with, kept while that KV is the
  // gateway's to free: until a decode leg reaches a decode engine, which then pulls it or lets it
  // go. A request that ends, or starts again from its prefill, with no decode leg having taken
  // it (Leg::left_kv_untaken) has the gateway tell the prefill engine to let go
  // (Dispatcher::release_unclaimed_kv), instead of its KV staying held until that engine's
  // --kv-transfer-timeout. Empty: none.
  std::string held_kv;
  int held_kv_endpoint = -1, held_kv_attempt = -1;
  // Seconds it waited in the queue over all its dispatches (a sequential request's two stages,
  // each retry), observed once when it is recorded; -1: never dispatched.
  double queued_s = -1;

  // Shared by the io, client and scheduling threads, under `mutex`.
  std::mutex mutex;
  std::vector<std::shared_ptr<Leg>> legs;
  std::string decode_body;  // sequential: body plus the prefill's kv_transfer_params
  ClientState client = ClientState::kNothingSent;
  bool streamed = false;  // the client's answer went out as an event stream
  Outcome outcome;        // what the client got, once it ended
  int64_t output_events = 0, first_token_ns = 0, last_token_ns = 0;
  int64_t completion_tokens = -1;       // from a usage object, when one was seen
  int64_t cached_tokens_reported = -1;  // by the engine that computed the prompt, when it said
  int cached_tokens_attempt = 0;  // the attempt that report is for (reset with it, under the mutex)
  std::vector<double> itl;        // inter-token gaps, seconds
  // Parallel mode: the attempt one of whose legs ended with the client's error or the engine's
  // refusal (a 4xx, or a 503: Dispatcher::leg_failed), or -1, and that leg's engine (the first to
  // tell, but a client error over a refusal: retrying a request the other engine found invalid
  // only brings the client a 503 until the refusing engine has room). That answer decides the
  // attempt: its other leg's failure (likely its consequence: a decode engine waits for a room
  // its prefill engine refused to fill) is neither reported nor counted against its engine,
  // whichever leg told first.
  int decided_attempt = -1;
  int decided_by = -1;
  bool decided_by_client_error = false;
  // The attempt whose failure or refusal Dispatcher::attempt_failed acted on (retried, or
  // answered), or that Dispatcher::answer_refused answered, or -1: decided, whatever its other
  // leg, cut by that, reports after (an answer that crossed the cut), the client's error included.
  int handled_attempt = -1;

  bool ended() {
    std::lock_guard lock(mutex);
    return client == ClientState::kEnded;
  }
};

using RequestPtr = std::shared_ptr<Request>;

// The one way legs are cancelled: under the request's lock (held by the caller) its running legs
// are marked as cancelled by the gateway (not the engine's fault) and their calls returned, to be
// cancelled after the lock is released (a cancel may report back at once).
std::vector<Upstream::CallId> mark_legs_cancelled(Request& r);

}  // namespace tandem::gateway
