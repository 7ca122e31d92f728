#include "engine/transfer/pd_coordinator.h"

#include <algorithm>
#include <utility>

#include "api/error.h"

namespace tandem::engine {

PdCoordinator::PdCoordinator(KvTransfers& agent, KvCacheManager& kv, PdHost& host, double timeout_s)
    : agent_(agent), kv_(kv), host_(host), timeout_s_(timeout_s) {}

PdCoordinator::Admission PdCoordinator::admit(Sequence* seq) {
  const KvTransferSpec& kt = seq->request.kv_transfer;
  if (kt.decode()) {
    seq->kv_state = KvTransferState::kAwaitingBlocks;
    awaiting_kv_.push_back(seq);
    return Admission::kAwaitKv;
  }
  if (kt.mode != KvTransferSpec::Mode::kPrefillForRoom) return Admission::kSchedule;
  // Claimed here, on the engine thread, so that the room's outcome (posted to this thread)
  // always finds the sequence.
  int status = 0;
  std::string error, code;
  try {
    const std::string id = seq->request.id;
    seq->room_claim = agent_.open_room(kt.room, kv_prompt_hash(seq->prompt()), seq->num_prompt,
                                       [this, id](bool ok, const std::string& e, bool abandoned) {
                                         on_room_done(id, ok, e, abandoned);
                                       });
    if (seq->room_claim != 0) {
      seq->kv_state = KvTransferState::kRoomOpen;
      return Admission::kSchedule;
    }
    status = 400;
    error = "bootstrap_room " + std::to_string(kt.room) +
            " is already in use by another prefill request on this engine";
  } catch (const KvTransferError& e) {
    status = 502;
    error = e.what();
    if (e.room_abandoned) code = api::kRoomAbandonedCode;
  }
  seq->kv_state = KvTransferState::kRoomClosed;
  host_.fail(seq, error, status, code);
  return Admission::kRefused;
}

size_t PdCoordinator::fail_overdue(double now) {
  size_t failed = 0;
  for (size_t i = 0; i < awaiting_kv_.size();) {
    Sequence* seq = awaiting_kv_[i];
    if (seq->kv_state != KvTransferState::kAwaitingBlocks ||
        now - seq->arrival_time <= timeout_s_) {
      ++i;
      continue;
    }
    // Failing it takes it out of awaiting_kv_ (ending()): the next one is at i now.
    host_.fail(
        seq,
        "no free KV blocks for the prompt's transfer within " + std::to_string(timeout_s_) + " s",
        503, {});
    ++failed;
  }
  return failed;
}

void PdCoordinator::start_fetches(std::span<Sequence* const> legs) {
  for (Sequence* seq : legs) {
    const std::string& id = seq->request.id;
    // The scheduler took the blocks of the whole prompt, reusing the cached prefix of
    // seq->num_cached tokens; the decode recomputes the prompt's last token (for its logits), so
    // the transfer moves the rest up to it. Even with nothing to move (a one-token prompt, or all
    // of it cached here) the transfer runs, empty: it tells the prefill engine to let go of its
    // blocks. A leg that computes its prompt again (to score it) shares no block.
    const KvTransferSpec& kt = seq->request.kv_transfer;
    KvFetch f;
    f.request_id = id;
    f.pull = kt.mode == KvTransferSpec::Mode::kDecodeByPull;
    f.host = kt.host;
    f.port = kt.port;
    f.engine_id = kt.engine_id;
    f.transfer_id = kt.transfer_id;
    f.remote_blocks = kt.remote_blocks;
    f.room = kt.room;
    f.prompt_hash = kv_prompt_hash(seq->prompt());
    f.prompt_tokens = seq->num_prompt;
    f.first_token = seq->num_cached;
    f.num_tokens = seq->num_prompt - 1;
    const auto& table = kv_.block_table(id);
    f.local_blocks.assign(table.begin() + seq->num_cached / kv_.block_size(), table.end());
    seq->kv_state = KvTransferState::kFetching;
    agent_.fetch(std::move(f), [this, id](const KvFetchResult& r) { on_fetch_done(id, r); });
  }
}

void PdCoordinator::on_fetch_done(const std::string& id, const KvFetchResult& result) {
  Sequence* seq = host_.find_sequence(id);
  if (!seq) return;
  const bool cancelled = seq->kv_state == KvTransferState::kFetchCancelled;
  seq->kv_state = KvTransferState::kNone;
  if (cancelled) {
    // A pull cancelled before the prefill engine accepted it leaves the hold there: release it.
    // (One it had accepted ends with the broken pull, and this release then finds nothing.)
    // A room fetch cancelled before its registration reached the prefill engine leaves the room's
    // prefill leg waiting for it: abandon the room, as ending() does for a leg that never
    // fetched. (One that registered closed its connection, which fails the room already; the
    // prefill engine ignores an abandonment of a registered room.)
    const KvTransferSpec& kt = seq->request.kv_transfer;
    if (!result.ok && kt.mode == KvTransferSpec::Mode::kDecodeByPull)
      agent_.release_remote(kt.host, kt.port, kt.engine_id, kt.transfer_id, kt.remote_blocks);
    if (!result.ok && kt.mode == KvTransferSpec::Mode::kDecodeByRoom)
      agent_.abandon_room(kt.host, kt.port, kt.room, kv_prompt_hash(seq->prompt()), seq->num_prompt,
                          "the decode request of bootstrap_room " + std::to_string(kt.room) +
                              " was cancelled before it received the KV");
    kv_.free(id);
    host_.drop(id);
    return;
  }
  if (!result.ok) {
    // Out of awaiting_kv_ first, so that ending() does not release the hold: below decides.
    std::erase(awaiting_kv_, seq);
    // A prefill engine that died, hung or broke the protocol: the code says so, since a gateway
    // that counted it against this engine got every decode engine whose legs waited on a hung
    // prefill engine ejected. A transfer the prefill engine no longer holds says the KV is gone
    // (the gateway prefills the prompt again). One whose transfer connections were all in use
    // is full for now (503) and still holds the KV: the gateway sends the leg again with the
    // same kv_transfer_params after a short wait. Other failures (this engine's own, or an
    // answered refusal) name no engine at fault.
    const KvTransferSpec& kt = seq->request.kv_transfer;
    if (result.prefill_busy && kt.mode == KvTransferSpec::Mode::kDecodeByPull) {
      host_.fail(seq, result.error, 503, std::string(api::kKvTransferBusyCode));
      return;
    }
    // A room's registration refused for now leaves the room's prefill leg waiting for one until
    // the room's timeout: nothing registers it again (a gateway retries the pair, with another
    // room). Abandoned, that leg ends at once. The leg fails as any refusal's, without the busy
    // code: a gateway sends a leg again with the same KV only in sequential mode, and in parallel
    // mode would read a 503 as this engine full. (Best effort: the abandonment needs a connection
    // of the same busy engine; refused as busy too, it is sent again after 100 ms, then twice as
    // long each time, 5 tries in all, and then dropped and counted in
    // tandem:kv_transfer_releases_dropped_total: the prefill leg waits out its timeout.)
    if (result.prefill_busy && kt.mode == KvTransferSpec::Mode::kDecodeByRoom)
      agent_.abandon_room(kt.host, kt.port, kt.room, kv_prompt_hash(seq->prompt()), seq->num_prompt,
                          "the decode request of bootstrap_room " + std::to_string(kt.room) +
                              " was refused for now: " + result.error);
    const std::string_view code = result.prefill_fault   ? api::kKvTransferFailedCode
                                  : result.transfer_gone ? api::kKvTransferExpiredCode
                                                         : std::string_view();
    // After a code-less failure the gateway prefills the prompt again, and nothing pulls this
    // hold any more; nor does anything else let it go (the gateway releases the KV of a leg that
    // blamed its prefill engine, a transfer gone is no hold, and a busy engine's is pulled
    // again): a refused pull (blocks or prompt that do not match, another pull under way, a
    // layout or secret that differs) or this engine's own failure left it held until
    // --kv-transfer-timeout. (A release, a pull of nothing, is not held to the blocks or the
    // layout that got the pull refused; one refused for another reason, such as a secret that
    // differs, changes nothing: the hold expires as before.)
    if (code.empty() && kt.mode == KvTransferSpec::Mode::kDecodeByPull)
      agent_.release_remote(kt.host, kt.port, kt.engine_id, kt.transfer_id, kt.remote_blocks);
    host_.fail(seq, result.error, 502, std::string(code));
    return;
  }
  std::erase(awaiting_kv_, seq);
  // A leg that asks for prompt logprobs and was not handed them (the parallel flow, or a prefill
  // engine that did not compute them) computes its prompt again over the received KV: only the
  // engine that runs the prompt through the model has its logits. It waits in the scheduler,
  // which admits it holding its blocks.
  seq->num_computed = seq->scoring_prompt() ? 0 : seq->num_prompt - 1;
  kv_.cache_full_blocks(id, std::span<const int32_t>(seq->tokens).first(size_t(seq->num_computed)));
}

LayerHook PdCoordinator::begin_step(const SchedulerOutput& out) {
  step_rooms_.clear();
  for (const auto& s : out.scheduled) {
    if (s.seq->request.kv_transfer.mode != KvTransferSpec::Mode::kPrefillForRoom ||
        s.seq->num_generated() != 0 || s.seq->kv_state != KvTransferState::kRoomOpen)
      continue;
    if (!s.sample) {
      // A chunk before the last: the prompt progresses, its KV comes with the last chunk.
      agent_.room_progress(s.seq->request.kv_transfer.room, s.seq->room_claim,
                           s.seq->num_computed + s.num_new_tokens);
      continue;
    }
    step_rooms_.emplace_back(s.seq->request.kv_transfer.room, s.seq->room_claim);
    agent_.room_blocks(step_rooms_.back().first, step_rooms_.back().second,
                       kv_.block_table(s.seq->request.id));
  }
  if (step_rooms_.empty()) return {};
  return [this](int64_t layers) {
    for (auto [room, claim] : step_rooms_) agent_.room_layers_done(room, claim, layers);
  };
}

void PdCoordinator::end_step(int64_t layers) {
  for (auto [room, claim] : step_rooms_) agent_.room_layers_done(room, claim, layers);
  step_rooms_.clear();
}

bool PdCoordinator::defer_final_output(Sequence* seq, RequestOutput& o) {
  if (seq->request.kv_transfer.mode == KvTransferSpec::Mode::kPrefillForPull) {
    // The prompt's blocks wait for the decode engine's pull (vLLM's request_finished).
    o.kv_blocks = kv_.block_table(seq->request.id);
    const std::string id = seq->request.id;
    o.kv_transfer_id =
        agent_.hold(o.kv_blocks, kv_prompt_hash(seq->prompt()), seq->num_prompt, [this, id] {
          kv_.free(id);
          host_.release_id(id);
        });
    seq->kv_state = KvTransferState::kParked;
    return false;
  }
  if (seq->kv_state != KvTransferState::kRoomOpen) return false;
  // Answered once the decode engine has the KV (or the room failed).
  parked_[seq->request.id] = {seq->request.on_output, std::move(o), seq->request.kv_transfer.room,
                              seq->room_claim};
  seq->kv_state = KvTransferState::kParked;
  return true;
}

bool PdCoordinator::ending(Sequence* seq, const std::string& why) {
  if (seq->kv_state == KvTransferState::kRoomOpen) {
    // The room's transfer may be reading these blocks: keep them until it reports back.
    agent_.room_failed(seq->request.kv_transfer.room, seq->room_claim,
                       "the prefill request ended: " + why);
    parked_[seq->request.id] = {};
    seq->kv_state = KvTransferState::kParked;
  }
  if (const auto waiting = std::find(awaiting_kv_.begin(), awaiting_kv_.end(), seq);
      waiting != awaiting_kv_.end()) {
    // A pull that never ran, or a room never registered (no room for the prompt here, the
    // client left, a refusal at admission): only this engine can tell the prefill engine to let
    // go of the blocks it holds for the leg, which would otherwise stay until its timeout (and a
    // room's prefill leg would answer only then).
    const KvTransferSpec& kt = seq->request.kv_transfer;
    if (!seq->fetching() && kt.mode == KvTransferSpec::Mode::kDecodeByPull)
      agent_.release_remote(kt.host, kt.port, kt.engine_id, kt.transfer_id, kt.remote_blocks);
    if (!seq->fetching() && kt.mode == KvTransferSpec::Mode::kDecodeByRoom)
      agent_.abandon_room(kt.host, kt.port, kt.room, kv_prompt_hash(seq->prompt()), seq->num_prompt,
                          "the decode request of bootstrap_room " + std::to_string(kt.room) +
                              " ended before it registered: " + why);
    awaiting_kv_.erase(waiting);
  }
  return seq->kv_state == KvTransferState::kParked || seq->fetching();
}

void PdCoordinator::abort_parked(const std::string& id) {
  auto it = parked_.find(id);
  if (it == parked_.end() || it->second.claim == 0) return;  // not waiting, or told already
  Parked& p = it->second;
  p.aborted = true;
  // The room ends as a failed prefill's does: at once when no decode engine registered, else
  // once the connection serving it told the decode engine; on_room_done frees the blocks then.
  agent_.room_failed(p.room, std::exchange(p.claim, 0), "the prefill request was cancelled");
}

bool PdCoordinator::outlives_end(Sequence* seq) {
  if (!seq->fetching()) return false;
  // The transfer writes into its blocks until it ends; on_fetch_done drops the sequence.
  seq->kv_state = KvTransferState::kFetchCancelled;
  agent_.cancel_fetch(seq->request.id);
  return true;
}

void PdCoordinator::on_room_done(const std::string& id, bool ok, const std::string& error,
                                 bool abandoned) {
  const std::string code = abandoned ? std::string(api::kRoomAbandonedCode) : std::string();
  if (Sequence* seq = host_.find_sequence(id)) {
    // The room failed while the prefill still runs (e.g. the decode side gave up).
    seq->kv_state = KvTransferState::kRoomClosed;
    host_.fail(seq, error, 502, code);
    return;
  }
  auto it = parked_.find(id);
  if (it == parked_.end()) return;
  Parked p = std::move(it->second);
  parked_.erase(it);
  kv_.free(id);
  host_.release_id(id);
  if (!p.deferred || !p.on_output) return;
  if (ok) {
    p.on_output(*p.deferred);
    return;
  }
  RequestOutput out = *p.deferred;
  out.tokens.clear();
  out.logprobs.clear();
  out.text.clear();
  if (p.aborted) {
    out.finish_reason = "abort";  // as any aborted request: its client asked for it
  } else {
    out.finish_reason = "error";
    out.error = error;
    out.error_status = 502;
    out.error_code = code;
  }
  p.on_output(out);
}

void PdCoordinator::transfers_ended(
    std::unordered_map<std::string, std::unique_ptr<Sequence>>& sequences) {
  for (auto& [id, seq] : sequences) {
    if (seq->kv_state == KvTransferState::kFetching) seq->kv_state = KvTransferState::kNone;
    if (seq->kv_state == KvTransferState::kRoomOpen) seq->kv_state = KvTransferState::kRoomClosed;
  }
  // Ending a leg that waits for KV asks the transfers to let the prefill engine's blocks go:
  // there are none to ask any more (the prefill engine lets go at its own timeout).
  awaiting_kv_.clear();
  step_rooms_.clear();
  for (auto& [id, p] : parked_) {
    if (!p.deferred || !p.on_output) continue;
    RequestOutput out;
    out.finished = true;
    out.finish_reason = "abort";
    p.on_output(out);
  }
  parked_.clear();
}

}  // namespace tandem::engine
