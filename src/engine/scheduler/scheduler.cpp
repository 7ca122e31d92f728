#include "engine/scheduler/scheduler.h"

#include <algorithm>

#include "util/error.h"

namespace tandem::engine {
namespace {

// The order of sequences when scheduling by priority: lower priority values first, then arrival.
std::pair<int64_t, uint64_t> priority_order(const Sequence* s) {
  return {s->request.priority, s->arrival_order};
}

}  // namespace

Scheduler::Scheduler(const SchedulerConfig& config, KvCacheManager& kv) : config_(config), kv_(kv) {
  if (config.max_num_seqs < 1) throw Error("max_num_seqs must be at least 1");
  if (config.max_num_batched_tokens < 1) throw Error("max_num_batched_tokens must be at least 1");
}

void Scheduler::insert_waiting(Sequence* seq, bool front) {
  seq->status = SequenceStatus::kWaiting;
  if (config_.priority) {
    // Ordered by (priority, arrival): a preempted sequence keeps its place by arrival.
    auto it = std::upper_bound(
        waiting_.begin(), waiting_.end(), seq,
        [](const Sequence* a, const Sequence* b) { return priority_order(a) < priority_order(b); });
    waiting_.insert(it, seq);
  } else if (front) {
    waiting_.push_front(seq);
  } else {
    waiting_.push_back(seq);
  }
}

void Scheduler::add(Sequence* seq) {
  insert_waiting(seq, false);
}

Sequence* Scheduler::preemption_victim() const {
  if (running_.empty()) return nullptr;
  if (!config_.priority) return running_.back();
  // The lowest priority (highest value), the latest arrival among equals.
  return *std::max_element(
      running_.begin(), running_.end(),
      [](const Sequence* a, const Sequence* b) { return priority_order(a) < priority_order(b); });
}

void Scheduler::preempt(Sequence* seq) {
  kv_.free(seq->request.id);
  seq->num_computed = 0;
  seq->drafts.clear();
  seq->draft_probs.clear();
  ++seq->num_preemptions;
  std::erase(running_, seq);
  insert_waiting(seq, true);
}

SchedulerOutput Scheduler::schedule() {
  SchedulerOutput out;
  int64_t budget = config_.max_num_batched_tokens;
  // Prompt tokens scored in this step (prompt logprobs), over every sequence: each is a row of
  // logits.
  int64_t scored_budget = config_.max_scored_tokens;
  auto schedule_one = [&](Sequence* seq, int64_t n, int64_t drafts) {
    const bool last = seq->num_computed + n - drafts == static_cast<int64_t>(seq->tokens.size());
    out.scheduled.push_back({seq, n, last, drafts});
    out.num_tokens += n;
    budget -= n;
    if (seq->scoring_prompt()) scored_budget -= n;
  };
  // A sampled sequence's room for the executor's draft passes, when the cache has it (never at
  // anyone's expense: without it the executor proposes fewer drafts).
  auto reserve_lookahead = [&](Sequence* seq, int64_t n) {
    if (config_.speculative_lookahead > 0 &&
        seq->num_computed + n >= static_cast<int64_t>(seq->tokens.size()))
      kv_.allocate(seq->request.id, seq->num_computed + n + config_.speculative_lookahead);
  };

  // What the sequences scheduled so far took for speculation (their drafts, the draft passes'
  // room) goes back; true when a block did. It was taken only because the cache had room, so a
  // sequence served later that needs a block gets it before anyone is preempted.
  auto reclaim_speculation = [&] {
    const int64_t free_before = kv_.num_free_blocks();
    for (ScheduledSequence& s : out.scheduled) {
      Sequence* other = s.seq;
      if (s.num_drafts > 0) {
        out.num_tokens -= s.num_drafts;
        budget += s.num_drafts;
        s.num_new_tokens -= s.num_drafts;
        s.num_drafts = 0;
        other->drafts.clear();
        other->draft_probs.clear();
      }
      kv_.truncate(other->request.id, other->num_computed + s.num_new_tokens);
    }
    return kv_.num_free_blocks() > free_before;
  };

  // A running sequence's next tokens; false when it was preempted (itself) for lack of blocks.
  // New tokens for a sequence with `computed` of them in the cache, within the budget.
  auto chunk = [&](const Sequence* seq, int64_t computed) {
    const int64_t n =
        std::min<int64_t>(static_cast<int64_t>(seq->tokens.size()) - computed, budget);
    return seq->scoring_prompt() ? std::min(n, scored_budget) : n;
  };
  auto run = [&](Sequence* seq) {
    int64_t n = chunk(seq, seq->num_computed);
    // Drafts ride along with a decode token while the budget and the cache allow (no one is
    // preempted for them); the request never needs more than max_tokens.
    int64_t drafts = 0;
    if (n == 1 && !seq->drafts.empty()) {
      drafts = std::min<int64_t>({static_cast<int64_t>(seq->drafts.size()), budget - 1,
                                  seq->request.sampling.max_tokens - seq->num_generated() - 1});
      if (drafts > 0 && !kv_.allocate(seq->request.id, seq->num_computed + 1 + drafts)) drafts = 0;
      drafts = std::max<int64_t>(drafts, 0);
      if (!seq->draft_probs.empty())
        seq->draft_probs.resize(seq->draft_probs.size() / seq->drafts.size() * size_t(drafts));
      seq->drafts.resize(size_t(drafts));
      n += drafts;
    }
    bool ok = n <= 0 || kv_.allocate(seq->request.id, seq->num_computed + n);
    if (!ok && reclaim_speculation()) ok = kv_.allocate(seq->request.id, seq->num_computed + n);
    while (!ok) {
      Sequence* victim = preemption_victim();
      // A victim already scheduled in this step keeps its slot in `out`: drop that too.
      std::erase_if(out.scheduled, [&](const ScheduledSequence& s) {
        if (s.seq != victim) return false;
        out.num_tokens -= s.num_new_tokens;
        budget += s.num_new_tokens;
        return true;
      });
      preempt(victim);
      out.preempted.push_back(victim);
      if (victim == seq) return false;
      ok = kv_.allocate(seq->request.id, seq->num_computed + n);
    }
    if (n > 0) {
      reserve_lookahead(seq, n);
      schedule_one(seq, n, drafts);
    }
    return true;
  };

  // The blocks reclaim_speculation() would give back: those past each scheduled sequence's
  // tokens (all its own: a prefix hit never reaches past its computed tokens).
  auto speculation_blocks = [&] {
    const int64_t bs = kv_.block_size();
    int64_t n = 0;
    for (const ScheduledSequence& s : out.scheduled) {
      const int64_t keep = (s.seq->num_computed + s.num_new_tokens - s.num_drafts + bs - 1) / bs;
      n += std::max<int64_t>(
          0, static_cast<int64_t>(kv_.block_table(s.seq->request.id).size()) - keep);
    }
    return n;
  };

  // Waiting sequences are admitted in their order while nothing had to be preempted in this step
  // (vLLM's rule: memory is short, do not admit more), up to the first that does not fit. One
  // that holds its blocks (a decode leg whose KV arrived) waits its turn as any other, as vLLM's
  // waiting pass takes a request whose remote KV arrived: admitted past the others, it grows as
  // it decodes, and the newest (or least urgent) running is the next to give way, its received
  // KV thrown away and its prompt computed here. Except when nothing runs: what the head waits
  // for may then be the blocks such sequences hold, which only their running frees. A decode leg
  // awaiting blocks gets those of its whole prompt by the same rules, and stays waiting for its
  // KV; one receiving it is passed over (vLLM skips it too). The speculation space of the
  // sequences scheduled so far gives way to an admission that it lets fit. `i` moves past a
  // sequence that stays waiting. `after_preemption`: the rule is off (see the end of schedule()).
  bool head_blocked = false, after_preemption = false;
  auto can_admit = [&] {
    return budget > 0 && static_cast<int64_t>(running_.size()) < config_.max_num_seqs;
  };
  auto admit = [&](size_t& i) {
    Sequence* seq = waiting_[i];
    if (seq->fetching()) {
      ++i;
      return;
    }
    // Its blocks are taken now and its KV received into them (the engine starts the transfer):
    // the admission that computes nothing in this step, blocks for the whole prompt (so that
    // admitting it once its KV is here never needs a new block).
    const bool fetch = seq->kv_state == KvTransferState::kAwaitingBlocks;
    const bool has_blocks = kv_.has_request(seq->request.id);  // KV received from elsewhere
    if (fetch && has_blocks) {  // given them earlier in this step: listed for its fetch once
      ++i;
      return;
    }
    const bool memory_short = !out.preempted.empty() && !after_preemption;
    if ((head_blocked || memory_short) && !(has_blocks && running_.empty())) {
      ++i;
      return;
    }
    // A prompt still to be scored is computed whole: cached positions have no logits. Its
    // blocks are cached under its salt all the same.
    PrefixHit hit = has_blocks || seq->scoring_prompt()
                        ? PrefixHit::none(seq->request.cache_salt)
                        : kv_.find_cached_prefix(seq->tokens, seq->request.cache_salt);
    // A preempted sequence finds its own blocks again: not a lookup for the hit-rate statistics.
    if (seq->num_preemptions > 0) hit.num_query_tokens = 0;
    const int64_t computed = has_blocks ? seq->num_computed : hit.num_tokens;
    const int64_t n = fetch ? 0 : chunk(seq, computed);
    if (n <= 0 && !fetch) {  // the step scores all the prompt tokens it may: the next step takes it
      ++i;
      return;
    }
    const int64_t tokens = fetch ? seq->num_prompt : computed + n;
    const int64_t needs = kv_.num_blocks_to_allocate(seq->request.id, tokens, hit);
    bool ok = !(memory_short && needs > 0);
    if (ok && needs > kv_.num_free_blocks()) {
      ok = needs <= kv_.num_free_blocks() + speculation_blocks();
      if (ok) reclaim_speculation();
    }
    if (!ok || !kv_.allocate(seq->request.id, tokens, hit)) {
      head_blocked = true;
      ++i;
      return;
    }
    if (fetch) {
      seq->num_cached = hit.num_tokens;  // the transfer moves the rest
      out.fetches.push_back(seq);
      ++i;
      return;
    }
    waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(i));
    seq->num_computed = computed;
    if (!seq->admitted_once && !has_blocks) seq->num_cached = computed;
    seq->status = SequenceStatus::kRunning;
    running_.push_back(seq);
    reserve_lookahead(seq, n);
    schedule_one(seq, n, 0);
  };
  auto prefilling = [](const Sequence* s) {
    return static_cast<int64_t>(s->tokens.size()) - s->num_computed > 1;
  };

  // Running sequences first, in admission order; by priority, those still prefilling compete with
  // the waiting ones instead (below). A snapshot, since preemption removes from running_.
  step_running_.assign(running_.begin(), running_.end());
  std::vector<Sequence*>& later = step_prefilling_;  // by priority: the running ones prefilling
  later.clear();
  for (Sequence* seq : step_running_) {
    if (budget <= 0) break;
    if (seq->status != SequenceStatus::kRunning) continue;  // preempted in this step
    if (config_.priority && prefilling(seq))
      later.push_back(seq);
    else
      run(seq);
  }

  // Then waiting sequences in their order; by priority, merged with the running prefills in
  // (priority, arrival) order, so that a more urgent prompt takes the chunk budget from a less
  // urgent one that is part-way through its prefill (it keeps its blocks and resumes later).
  std::stable_sort(later.begin(), later.end(), [](const Sequence* a, const Sequence* b) {
    return priority_order(a) < priority_order(b);
  });
  size_t r = 0, i = 0;
  while (budget > 0) {
    while (r < later.size() && later[r]->status != SequenceStatus::kRunning) ++r;
    const bool waiting_next = can_admit() && i < waiting_.size();
    if (r < later.size() &&
        (!waiting_next || priority_order(later[r]) <= priority_order(waiting_[i])))
      run(later[r++]);
    else if (waiting_next)
      admit(i);
    else
      break;
  }
  // Every running sequence was preempted and nothing runs: memory is no longer short (nothing
  // runs to need it), so the waiting sequences are admitted now, as the next step would admit
  // them, rather than returning a step that runs nothing while there is work that could: the
  // engine would wait for an outside event before it scheduled again.
  if (out.scheduled.empty() && !out.preempted.empty()) {
    after_preemption = true;
    head_blocked = false;
    for (i = 0; can_admit() && i < waiting_.size();) admit(i);
  }
  return out;
}

bool Scheduler::has_schedulable() const {
  return !running_.empty() || std::any_of(waiting_.begin(), waiting_.end(),
                                          [](const Sequence* s) { return !s->fetching(); });
}

std::vector<SequenceUpdate> Scheduler::update_from_output(const SchedulerOutput& out,
                                                          std::span<const StepTokens> sampled,
                                                          double now) {
  std::vector<SequenceUpdate> updates;
  for (size_t i = 0; i < out.scheduled.size(); ++i) {
    const auto& s = out.scheduled[i];
    Sequence* seq = s.seq;
    if (i < sampled.size()) take_prompt_logprobs(*seq, sampled[i]);
    if (!s.sample) {
      seq->num_computed += s.num_new_tokens;
      continue;
    }
    const StepTokens& step = sampled[i];
    if (step.tokens.empty() || static_cast<int64_t>(step.tokens.size()) > s.num_drafts + 1)
      throw Error("scheduler: sequence '" + seq->request.id + "' got " +
                  std::to_string(step.tokens.size()) + " tokens for " +
                  std::to_string(s.num_drafts) + " drafts");
    // The KV of its new tokens and of the drafts it accepted (their inputs were those tokens).
    const int64_t accepted = static_cast<int64_t>(step.tokens.size()) - 1;
    seq->num_computed += s.num_new_tokens - (s.num_drafts - accepted);
    SequenceUpdate u;
    u.seq = seq;
    u.first_token = seq->num_generated() == 0;
    if (!u.first_token && seq->last_token_time >= 0)
      u.since_last_token_s = now - seq->last_token_time;
    if (u.first_token) seq->first_token_time = now;
    seq->last_token_time = now;
    RequestOutput& o = u.output;
    for (const TokenLogprob& token : step.tokens) {
      seq->tokens.push_back(token.token);
      o.tokens.push_back(token.token);
      if (seq->request.logprobs >= 0) o.logprobs.push_back(token);
      if (seq->output) {
        OutputDelta delta = seq->output->push(token.token);
        o.text += delta.text;
        o.finished = delta.finished;
        o.finish_reason = std::move(delta.finish_reason);
        o.stop_string = std::move(delta.stop_string);
        o.stop_token = delta.stop_token;
        o.stop_at_eos = delta.stop_at_eos;
      } else if (seq->num_generated() >= seq->request.sampling.max_tokens) {
        o.finished = true;
        o.finish_reason = "length";
      }
      if (o.finished) break;  // what follows a finish is not part of the answer
    }
    seq->drafts = o.finished ? std::vector<int32_t>() : step.drafts;
    seq->draft_probs = o.finished ? std::vector<float>() : step.draft_probs;
    if (u.first_token && seq->request.prompt_logprobs >= 0)
      o.prompt_logprobs = seq->prompt_logprobs;
    o.prompt_tokens = seq->num_prompt;
    o.completion_tokens = seq->num_generated();
    o.cached_tokens = seq->num_cached;
    updates.push_back(std::move(u));
  }
  for (const auto& s : out.scheduled) {
    Sequence* seq = s.seq;
    const auto verified = std::min<int64_t>(seq->num_computed, int64_t(seq->tokens.size()));
    kv_.cache_full_blocks(seq->request.id,
                          std::span<const int32_t>(seq->tokens).first(size_t(verified)));
    // Blocks that held only rejected drafts or draft-pass scratch go back.
    if (s.sample && (s.num_drafts > 0 || config_.speculative_lookahead > 0))
      kv_.truncate(seq->request.id, int64_t(seq->tokens.size()));
  }
  return updates;
}

void Scheduler::take_prompt_logprobs(Sequence& seq, const StepTokens& step) {
  // Positions scored before (a prompt recomputed after preemption) are kept as they were.
  for (size_t k = 0; k < step.prompt.size(); ++k)
    if (step.prompt_at + int64_t(k) == int64_t(seq.prompt_logprobs.size()) + 1)
      seq.prompt_logprobs.push_back(step.prompt[k]);
}

void Scheduler::remove(Sequence* seq, bool keep_blocks) {
  if (!keep_blocks) kv_.free(seq->request.id);
  std::erase(running_, seq);
  std::erase(waiting_, seq);
  seq->status = SequenceStatus::kFinished;
}

}  // namespace tandem::engine
