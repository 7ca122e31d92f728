#pragma once
// Several choices in the P/D modes. A disaggregated leg carries one sequence (one bootstrap room,
// one KV transfer), so a request for n > 1 choices, or a completions request with a list of
// prompts (and n choices of each), becomes one request per choice, each scheduled on its own
// (they may go to different engines), and their answers are merged into the one the client asked
// for: the choices in order with their indexes (prompt-major: choice k answers prompt k / n), one
// id (the request's: the choices' requests are named <id>-<k>), the usage summed (a repeated
// prompt counted once, as an engine counts it). Choice k of a request with a seed gets
// seed + k % n (each prompt of a list starts from the request's seed, as in vLLM), as an engine
// seeds its choices, so the answer is the one an aggregated engine gives.
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "net/reply.h"
#include "net/sse.h"

namespace tandem::gateway {

// Whether `body` may ask for several choices, so is worth parsing to find out: cheap, and never
// false for a body that does.
bool may_ask_several_choices(std::string_view body);

// The most choices one request may fan out to (OpenAI's n goes to 128).
inline constexpr size_t kMaxFanOut = 128;
// The most bytes the choices' bodies may take together (each carries the client's whole body).
inline constexpr size_t kMaxFanOutBytes = size_t{64} << 20;

struct ChoiceRequests {
  std::vector<std::string> bodies;  // one per choice, in the choices' order
  // n: how many bodies in a row carry the same prompt (bodies k and j share one when
  // k / repeats == j / repeats), which usage counts once.
  size_t repeats = 1;
};

// The requests, one per choice, that answer `body` (of the route `path`, parsed from `text`)
// together, each keeping the client's key order (dump_in_client_order); no bodies when it asks
// for one choice or is not a request this can split (an invalid n, best_of other than n, a chat's
// best_of): the engine then answers it, and names the field. Throws api::ApiError (400) for more
// than kMaxFanOut choices.
ChoiceRequests split_choices(std::string_view path, const nlohmann::json& body,
                             std::string_view text);

// Merges the answers of the requests of one split into the client's reply. Thread-safe: each
// choice's reply may be called from any thread.
class ChoiceMerger : public std::enable_shared_from_this<ChoiceMerger> {
 public:
  static std::shared_ptr<ChoiceMerger> create(std::shared_ptr<net::Reply> client, size_t choices,
                                              size_t repeats);
  // The reply that choice i's request answers through.
  std::shared_ptr<net::Reply> reply(size_t i);
  // The client has its answer, or an error, or is gone: requests not started yet need not be.
  bool ended() const;
  // Why the unfinished choices were let go, when a choice failed: the status the client got
  // for it (for a stream that failed after its 200: its error event's, as the relay reads it
  // (error_event_status: the client's 400, a refusal's 429), else 502). None while open, once
  // complete, or when the client left.
  struct Failure {
    int status = 0;
    size_t choice = 0;
  };
  std::optional<Failure> failure() const;

 private:
  class Part;
  enum class PartState {
    kWaiting,    // nothing from its request yet
    kStreaming,  // its stream runs
    kDone,       // answered whole, or its stream ended with [DONE]
    kFailed,     // refused, or its stream failed (its error event) or was cut
  };
  enum class Outcome {
    kOpen,       // choices still to come
    kComplete,   // every choice done: the client has the merged answer
    kAbandoned,  // a choice failed or the client left: the unfinished choices are let go
  };
  struct PartData {
    PartState state = PartState::kWaiting;
    std::string body;  // a whole answer's
    net::SseParser parser;
    bool saw_done = false;
    std::vector<std::function<void()>> on_close;  // every one registered, as a server's reply
  };

  ChoiceMerger(std::shared_ptr<net::Reply> client, size_t choices, size_t repeats);

  // `headers`: a refusal's extra fields (an engine's Retry-After), which the client gets when this
  // answer is its answer (a failure before any stream); a merged answer has none.
  bool respond(size_t i, int status, std::string body, std::string content_type,
               net::Headers headers = {});
  bool start_stream(size_t i, int status, std::string content_type);
  bool write(size_t i, std::string_view chunk);
  bool end(size_t i);
  void abort(size_t i);
  void on_close(size_t i, std::function<void()> callback);
  void client_gone();

  // The answer failed because of choice i (the client got `status`).
  void abandon(size_t i, int status);
  // Ends the client's stream as a failing engine ends its own (vLLM's, ours): the OpenAI error
  // event `error`, then [DONE] (a choice's own [DONE] after its error event is not relayed).
  void end_with_error(const std::string& error);
  // Ends the client's answer with choice i's failure and lets go of the other choices' requests
  // (their close callbacks, returned for running after the lock).
  std::vector<std::function<void()>> fail(size_t i, int status, std::string body,
                                          std::string content_type, net::Headers headers = {});
  std::vector<std::function<void()>> take_callbacks(size_t except);
  bool all_done() const;
  // Every close callback, not to run (the answer is complete), for dropping after the lock: each
  // holds its request, which holds its reply, which holds this.
  std::vector<std::function<void()>> drop_callbacks();
  // One event of choice i's stream, rewritten for the client (or kept back: usage, [DONE]).
  void forward_event(size_t i, std::string_view data, std::vector<std::function<void()>>& later);
  void add_usage(const nlohmann::json& usage);
  nlohmann::json merged_usage() const;
  std::string merged_body();

  mutable std::mutex mutex_;
  std::shared_ptr<net::Reply> client_;
  std::vector<PartData> parts_;
  size_t repeats_;
  bool started_ = false;  // the client's stream
  Outcome outcome_ = Outcome::kOpen;
  std::optional<Failure> failure_;  // set with kAbandoned, unless the client left
  std::string id_;                  // the first chunk's id, which every chunk then carries
  nlohmann::json chunk_template_;   // that chunk, the frame of the merged usage chunk
  bool usage_seen_ = false;
  nlohmann::json usage_ = nlohmann::json::object();  // the choices' usage, summed field by field
};

}  // namespace tandem::gateway
