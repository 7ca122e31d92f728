#include "engine/scheduler/scheduler.h"

#include <algorithm>

#include "util/error.h"

namespace tandem::engine {

Scheduler::Scheduler(const SchedulerConfig& config, KvCacheManager& kv) : config_(config), kv_(kv) {
  if (config.max_num_seqs < 1) throw Error("max_num_seqs must be at least 1");
  if (config.max_num_batched_tokens < 1) throw Error("max_num_batched_tokens must be at least 1");
}

void Scheduler::insert_waiting(Sequence* seq, bool front) {
  seq->status = SequenceStatus::kWaiting;
  if (config_.priority) {
    // Ordered by (priority, arrival): a preempted sequence keeps its place by arrival.
    auto key = [](const Sequence* s) { return std::pair(s->request.priority, s->arrival_order); };
    auto it =
        std::upper_bound(waiting_.begin(), waiting_.end(), seq,
                         [&](const Sequence* a, const Sequence* b) { return key(a) < key(b); });
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
  return *std::max_element(running_.begin(), running_.end(),
                           [](const Sequence* a, const Sequence* b) {
                             return std::pair(a->request.priority, a->arrival_order) <
                                    std::pair(b->request.priority, b->arrival_order);
                           });
}

void Scheduler::preempt(Sequence* seq) {
  kv_.free(seq->request.id);
  seq->num_computed = 0;
  ++seq->num_preemptions;
  std::erase(running_, seq);
  insert_waiting(seq, true);
}

SchedulerOutput Scheduler::schedule() {
  SchedulerOutput out;
  int64_t budget = config_.max_num_batched_tokens;
  auto schedule_one = [&](Sequence* seq, int64_t n) {
    const bool last = seq->num_computed + n == static_cast<int64_t>(seq->tokens.size());
    out.scheduled.push_back({seq, n, last});
    out.num_tokens += n;
    budget -= n;
  };

  // Running sequences first, in admission order.
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Sequence* seq = running_[i];
    const int64_t n =
        std::min<int64_t>(static_cast<int64_t>(seq->tokens.size()) - seq->num_computed, budget);
    bool ok = n <= 0 || kv_.allocate(seq->request.id, seq->num_computed + n);
    while (!ok) {
      Sequence* victim = preemption_victim();
      // A victim already scheduled in this step keeps its slot in `out`: drop that too.
      std::erase_if(out.scheduled, [&](const ScheduledSequence& s) {
        if (s.seq != victim) return false;
        out.num_tokens -= s.num_new_tokens;
        budget += s.num_new_tokens;
        return true;
      });
      const bool self = victim == seq;
      const size_t victim_index =
          std::find(running_.begin(), running_.end(), victim) - running_.begin();
      preempt(victim);
      out.preempted.push_back(victim);
      if (victim_index < i) --i;
      if (self) break;
      ok = kv_.allocate(seq->request.id, seq->num_computed + n);
    }
    if (!ok) continue;  // `seq` itself was preempted; running_[i] is now the next one
    if (n > 0) schedule_one(seq, n);
    ++i;
  }

  // Then waiting sequences, in order, while nothing had to be preempted in this step (vLLM's
  // rule: memory is short, do not admit more).
  // Sequences that hold blocks already (KV received from a prefill engine) need none to be
  // admitted: they pass a head that does not fit, or they would wait for blocks they hold.
  bool head_blocked = false;
  for (size_t i = 0; out.preempted.empty() && budget > 0 && i < waiting_.size() &&
                     static_cast<int64_t>(running_.size()) < config_.max_num_seqs;) {
    Sequence* seq = waiting_[i];
    const bool has_blocks = kv_.has_request(seq->request.id);  // KV received from elsewhere
    if (head_blocked && !has_blocks) {
      ++i;
      continue;
    }
    const PrefixHit hit = has_blocks ? PrefixHit{} : kv_.find_cached_prefix(seq->tokens);
    const int64_t computed = has_blocks ? seq->num_computed : hit.num_tokens;
    const int64_t n =
        std::min<int64_t>(static_cast<int64_t>(seq->tokens.size()) - computed, budget);
    if (!kv_.allocate(seq->request.id, computed + n, hit)) {
      head_blocked = true;
      ++i;
      continue;
    }
    waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(i));
    seq->num_computed = computed;
    if (!seq->admitted_once && !has_blocks) seq->num_cached = computed;
    seq->status = SequenceStatus::kRunning;
    running_.push_back(seq);
    schedule_one(seq, n);
  }
  return out;
}

std::vector<SequenceUpdate> Scheduler::update_from_output(const SchedulerOutput& out,
                                                          std::span<const TokenLogprob> sampled,
                                                          double now) {
  for (const auto& s : out.scheduled) {
    Sequence* seq = s.seq;
    seq->num_computed += s.num_new_tokens;
    kv_.cache_full_blocks(seq->request.id,
                          std::span<const int32_t>(seq->tokens).first(size_t(seq->num_computed)));
  }
  std::vector<SequenceUpdate> updates;
  for (size_t i = 0; i < out.scheduled.size(); ++i) {
    const auto& s = out.scheduled[i];
    if (!s.sample) continue;
    Sequence* seq = s.seq;
    const TokenLogprob& token = sampled[i];
    SequenceUpdate u;
    u.seq = seq;
    u.first_token = seq->num_generated() == 0;
    if (!u.first_token && seq->last_token_time >= 0)
      u.since_last_token_s = now - seq->last_token_time;
    seq->tokens.push_back(token.token);
    if (u.first_token) seq->first_token_time = now;
    seq->last_token_time = now;
    RequestOutput& o = u.output;
    o.tokens.push_back(token.token);
    if (seq->request.logprobs >= 0) o.logprobs.push_back(token);
    if (seq->output) {
      OutputDelta delta = seq->output->push(token.token);
      o.text = std::move(delta.text);
      o.finished = delta.finished;
      o.finish_reason = std::move(delta.finish_reason);
    } else if (seq->num_generated() >= seq->request.sampling.max_tokens) {
      o.finished = true;
      o.finish_reason = "length";
    }
    o.prompt_tokens = seq->num_prompt;
    o.completion_tokens = seq->num_generated();
    o.cached_tokens = seq->num_cached;
    updates.push_back(std::move(u));
  }
  return updates;
}

void Scheduler::remove(Sequence* seq, bool keep_blocks) {
  if (!keep_blocks) kv_.free(seq->request.id);
  std::erase(running_, seq);
  std::erase(waiting_, seq);
  seq->status = SequenceStatus::kFinished;
}

}  // namespace tandem::engine
