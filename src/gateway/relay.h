#pragma once
// The engines' answers on their way to the client, on the io threads that run the legs' calls:
// a prefill leg's answer is collected (sequential: its kv_transfer_params feed the decode leg; both
// P/D modes: the prompt tokens the engine reused, from its usage); the answering leg's head is held
// back until its first event (or its whole answer) arrived, so a failure before any token can still
// be retried elsewhere; then streams stay streams (bytes passed verbatim, or translated back to
// chat when the gateway sent token ids), and token timings are recorded. Failures and ends go back
// to the dispatcher.
#include <memory>
#include <string>

#include "gateway/request.h"
#include "gateway/seams.h"
#include "gateway/topology.h"

namespace tandem::gateway {

class Dispatcher;

class Relay {
 public:
  Relay(const Topology& topology, Executor& executor, Dispatcher& dispatcher)
      : topo_(topology),
        exec_(executor),
        dispatcher_(dispatcher),
        computes_prompt_(topology.mode == PdMode::kAggregated),
        reports_prefill_reuse_(!computes_prompt_) {}

  // The handlers of a leg's call. `leg` is filled in before the call starts (the call's
  // callbacks find the leg through it and stop when it is gone); `where` names the engine.
  using LegRef = std::shared_ptr<std::weak_ptr<Leg>>;
  net::AsyncHttpHandlers prefill_handlers(const RequestPtr& r, LegRef leg, int attempt,
                                          int endpoint_id, std::string where);
  net::AsyncHttpHandlers answer_handlers(const RequestPtr& r, LegRef leg, int attempt,
                                         int endpoint_id, std::string where);

 private:
  void prefill_done(const RequestPtr& r, Leg& leg, int attempt, const std::string& where,
                    int endpoint_id, const std::string& error);
  bool relay_piece(const RequestPtr& r, Leg& leg, std::string_view piece);
  // What the engine that computed the prompt said it reused (Request::cached_tokens_reported).
  static int64_t prefill_reuse(Request& r);
  void relay_done(const RequestPtr& r, Leg& leg, int attempt, const std::string& where,
                  int endpoint_id, const std::string& error);

  const Topology& topo_;
  Executor& exec_;
  Dispatcher& dispatcher_;
  // The answering leg's engine computed the prompt (aggregated): its usage reports the reuse.
  const bool computes_prompt_;
  // P/D modes: the client's usage says what the prefill engine reused, as llm-d has it (the
  // decode engine took the KV, and reports its own reuse, often none).
  const bool reports_prefill_reuse_;
};

}  // namespace tandem::gateway
