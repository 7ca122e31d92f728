#pragma once
// Continuous batching with chunked prefill, in the manner of vLLM v1: every step, running
// sequences get their next tokens first (one for decode, plus its draft tokens when speculating,
// the rest of the prompt up to the token budget for prefill), then waiting sequences are admitted
// while the token budget, the running limit and the KV cache allow, reusing cached prefix blocks.
// When a running sequence needs a block and none is free, the newest running sequence (or the
// lowest-priority one) is preempted: its blocks are freed and it is recomputed later from its
// tokens so far. Nothing is dropped. Scheduling by priority, the prompts still being prefilled,
// running or waiting, share the budget left after decoding in (priority, arrival) order: a more
// urgent prompt overtakes a long one at its next chunk (which keeps its blocks and resumes).
//
// A decode leg (KvTransferState::kAwaitingBlocks) waits in the same queue for the blocks to
// receive its prompt's KV into from a prefill engine, and gets them by the same rules as any
// admission (vLLM v1 allocates a remote-KV request in its waiting pass): in queue order, after the
// running sequences got theirs, not in a step that preempted, not past a head that does not fit.
// It is listed in the step's `fetches` and stays waiting while its KV arrives (passed over, as
// vLLM skips a request waiting for remote KV), then is admitted in its turn by the same rules,
// holding its blocks, num_computed set, without a prefix lookup, and continues from there (as
// any sequence added with its blocks allocated). Only when nothing runs does such a sequence pass
// a head that does not fit: the head may be waiting for the very blocks it holds.
//
// Pure policy over the KV-cache manager: no threads, sockets or clocks. The engine thread owns it.
#include <cstdint>
#include <deque>
#include <span>
#include <vector>

#include "engine/executor/executor.h"
#include "engine/kv/kv_cache_manager.h"
#include "engine/scheduler/sequence.h"

namespace tandem::engine {

struct SchedulerConfig {
  int64_t max_num_seqs = 64;              // running sequences at most
  int64_t max_num_batched_tokens = 2048;  // new tokens per step (the chunked-prefill budget)
  bool priority = false;  // order prefills, waiting or running, by (priority, arrival)
  // Speculative decoding: a sampled sequence's block table also covers this many positions past
  // its new tokens and drafts when the cache allows (the executor's later draft passes write
  // there; ExecutorInfo::speculative_lookahead()).
  int64_t speculative_lookahead = 0;
  // Prompt tokens scored per step (prompt logprobs), over all sequences: each needs a row of
  // logits, vocab floats (0.5 MB for DeepSeek-V3's). At least 1.
  int64_t max_scored_tokens = 256;
};

struct ScheduledSequence {
  Sequence* seq = nullptr;
  int64_t num_new_tokens = 0;  // its drafts included
  bool sample = false;         // the step reaches the sequence's last token: sample the next one
  int64_t num_drafts = 0;      // the sequence's first drafts, verified in this step
};

struct SchedulerOutput {
  std::vector<ScheduledSequence> scheduled;
  std::vector<Sequence*> preempted;  // moved back to waiting in this step
  // Decode legs given the blocks of their whole prompt in this step: their KV transfers start.
  std::vector<Sequence*> fetches;
  int64_t num_tokens = 0;
  bool empty() const { return scheduled.empty(); }
};

// What one sampled sequence produced in a step: the update for whoever submitted it (its new
// token, the text that became final, whether and why it finished) and what the engine's metrics
// need.
struct SequenceUpdate {
  Sequence* seq = nullptr;
  RequestOutput output;
  bool first_token = false;        // its first generated token
  double since_last_token_s = -1;  // seconds since its previous token; -1: none
};

class Scheduler {
 public:
  Scheduler(const SchedulerConfig& config, KvCacheManager& kv);

  void add(Sequence* seq);
  SchedulerOutput schedule();
  // After the executor ran `out`: applies the step's tokens (`sampled[i]` for out.scheduled[i]
  // where it samples: accepted drafts, then one sampled token): each is appended to its sequence
  // and goes through its output processor (text, stop ids and strings, max_tokens; without one,
  // max_tokens alone ends it; tokens after a finish are dropped) and the next drafts replace the
  // old. Advances the computed tokens (rejected drafts' KV is not computed: the blocks that held
  // only such positions are released), and registers newly filled blocks with the prefix cache.
  // Returns one update per sampled sequence, in order. Finished sequences stay in the
  // queues: the engine decides what happens to their blocks (remove()). `now`: seconds, the
  // engine's clock, for the token times.
  std::vector<SequenceUpdate> update_from_output(const SchedulerOutput& out,
                                                 std::span<const StepTokens> sampled, double now);
  // A finished or aborted sequence leaves the queues and gives back its blocks (unless
  // `keep_blocks`: KV transfer still needs them; the engine frees them later).
  void remove(Sequence* seq, bool keep_blocks = false);

  // Whether schedule() may do anything: a sequence runs, or one waits that is not receiving its
  // KV (that one waits for its transfer, not for a step).
  bool has_schedulable() const;

  const std::vector<Sequence*>& running() const { return running_; }
  const std::deque<Sequence*>& waiting() const { return waiting_; }
  const SchedulerConfig& config() const { return config_; }

 private:
  void preempt(Sequence* seq);
  Sequence* preemption_victim() const;
  // Appends the prompt positions `step` scored that follow the sequence's own.
  static void take_prompt_logprobs(Sequence& seq, const StepTokens& step);
  void insert_waiting(Sequence* seq, bool front);

  SchedulerConfig config_;
  KvCacheManager& kv_;
  std::vector<Sequence*> running_;  // in admission order
  std::deque<Sequence*> waiting_;
  // schedule()'s working lists, kept so that a step does not allocate: the running sequences
  // when it began, and (by priority) those of them still prefilling.
  std::vector<Sequence*> step_running_, step_prefilling_;
};

}  // namespace tandem::engine
