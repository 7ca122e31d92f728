#pragma once
// The engine's side of prefill/decode disaggregation, on the engine thread: the one owner of a
// sequence's KvTransferState (sequence.h). It decides, at each point of the engine step where
// P/D matters, what happens to the sequence and its KV blocks:
//
//   admission   a parallel-mode prefill claims its bootstrap room (refused: the room is taken);
//               a decode leg joins the scheduler awaiting blocks for its prompt's KV;
//   fetches     decode legs the scheduler gave blocks start their fetch (pull or room); a
//               fetched prompt is admitted by the scheduler with its KV in place;
//   a step      prefills completing a room's prompt stream each layer as it is written;
//   final token a pull prefill's blocks are held for the decode engine (the answer carries
//               their whereabouts); a room prefill's answer waits for the room's transfer;
//   ending      blocks a transfer still reads or writes outlive the sequence (parked, or a
//               cancelled fetch that still runs).
//
// The engine is reached through PdHost; the transfers through KvTransfers (kv_transfers.h).
#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/executor/executor.h"
#include "engine/kv/kv_cache_manager.h"
#include "engine/scheduler/scheduler.h"
#include "engine/scheduler/sequence.h"
#include "engine/transfer/kv_transfer.h"

namespace tandem::engine {

// What the coordinator needs of the engine (engine thread).
class PdHost {
 public:
  virtual ~PdHost() = default;
  virtual Sequence* find_sequence(const std::string& id) = 0;
  // Ends the sequence with an error its client sees (`status`: the HTTP status to answer;
  // `code`: its OpenAI error code, or empty).
  virtual void fail(Sequence* seq, const std::string& error, int status,
                    const std::string& code) = 0;
  // The sequence is gone for good (its cancelled fetch ended): forget it.
  virtual void drop(const std::string& id) = 0;
  // A finished sequence's parked blocks were freed (pulled, released, expired, or its room
  // ended): nothing refers to its id any more, so a new request may take it.
  virtual void release_id(const std::string& id) = 0;
};

class PdCoordinator {
 public:
  // `timeout_s`: how long a decode leg may wait for blocks to receive its KV into.
  PdCoordinator(KvTransfers& agent, KvCacheManager& kv, PdHost& host, double timeout_s);

  enum class Admission {
    kSchedule,  // the sequence joins the scheduler as any other
    kAwaitKv,   // a decode leg: it joins the scheduler, which gives it blocks for its KV
    kRefused,   // refused, and already failed through the host
  };
  Admission admit(Sequence* seq);

  // Starts the fetches of decode legs the scheduler gave their prompt's blocks
  // (SchedulerOutput::fetches).
  void start_fetches(std::span<Sequence* const> legs);
  // Fails the decode legs that waited for blocks longer than the timeout; returns how many.
  size_t fail_overdue(double now);
  // When fail_overdue() would first fail a leg (the engine sleeps until then if nothing else
  // happens); +infinity when none waits for blocks.
  double next_overdue() const {
    double first = std::numeric_limits<double>::infinity();
    for (const Sequence* seq : awaiting_kv_)
      if (seq->kv_state == KvTransferState::kAwaitingBlocks)
        first = std::min(first, seq->arrival_time + timeout_s_);
    return first;
  }
  size_t waiting_for_kv() const { return awaiting_kv_.size(); }

  // Around the forward pass of a step: the hook that streams the layers of prefills completing a
  // room's prompt in it (empty when none does), and the end of the pass (every layer is done).
  LayerHook begin_step(const SchedulerOutput& out);
  void end_step(int64_t layers);

  // A sequence's final output: true when the output is deferred (a room's answer waits for its
  // transfer; the engine then ends the sequence without notifying). A pull prefill's output
  // gains kv_blocks and kv_transfer_id and goes out now.
  bool defer_final_output(Sequence* seq, RequestOutput& output);

  // The engine ends a sequence: true when its blocks must stay allocated (a transfer reads or
  // writes them; they are freed when it reports back). `why` tells an open room's peer.
  bool ending(Sequence* seq, const std::string& why);
  // After the engine ended it: true when the sequence must live on until its fetch reports back.
  bool outlives_end(Sequence* seq);
  // An abort of a request the engine has already ended (it has no sequence any more): a room's
  // prefill whose answer waits for the room's transfer gives the room up, so that its blocks are
  // freed and it is answered "abort" now, not when a decode engine comes or the timeout passes.
  void abort_parked(const std::string& id);

  // The transfers were stopped (the agent is gone): nothing runs any more, and nothing may call
  // the agent: legs waiting for KV are no longer tracked (their prefill engines let go at their
  // own timeout). Deferred outputs are answered "abort".
  void transfers_ended(std::unordered_map<std::string, std::unique_ptr<Sequence>>& sequences);

 private:
  void on_fetch_done(const std::string& id, const KvFetchResult& result);
  void on_room_done(const std::string& id, bool ok, const std::string& error, bool abandoned);

  KvTransfers& agent_;
  KvCacheManager& kv_;
  PdHost& host_;
  const double timeout_s_;
  std::vector<Sequence*> awaiting_kv_;  // decode legs waiting for their prompt's KV
  // Finished requests whose blocks a transfer still uses: freed when it ends; for a bootstrap
  // room, the final output is sent then (SGLang answers the prefill leg after the transfer).
  struct Parked {
    OutputCallback on_output;
    std::optional<RequestOutput> deferred;
    // The room a deferred answer waits for; claim 0 once the room was told to fail.
    uint64_t room = 0, claim = 0;
    bool aborted = false;  // abort_parked gave the room up: the answer is "abort"
  };
  std::unordered_map<std::string, Parked> parked_;
  std::vector<std::pair<uint64_t, uint64_t>> step_rooms_;  // (room, claim) of the running step
};

}  // namespace tandem::engine
