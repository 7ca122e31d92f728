#include "engine/expert_parallel/ep_rank.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "kernels/cpu/ops.h"
#include "util/error.h"

namespace tandem::engine::ep {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

model::LatentCacheShape cache_shape_of(const model::DeepSeekModel& m, const EpShape& s) {
  return m.cache_shape(s.block_size, static_cast<model::LatentType>(s.cache_type));
}

}  // namespace

std::vector<std::vector<int32_t>> slots_for_entries(
    std::span<const std::vector<int32_t>> experts_sent,
    const std::vector<std::vector<int32_t>>& copies, std::vector<int64_t>& dispatched) {
  std::vector<int64_t> total(copies.size(), 0);
  for (const auto& sent : experts_sent)
    for (int32_t e : sent) ++total[size_t(e)];
  // Per expert, the run its next token falls in: c contiguous runs, the first t mod c of them one
  // token longer, on consecutive copies.
  struct Run {
    int64_t copy = 0;  // index in copies[e]
    int64_t left = 0;  // tokens the run still takes
    int64_t next = 0;  // the next run's index
    int64_t base = 0, longer = 0;
  };
  std::vector<Run> runs(copies.size());
  for (size_t e = 0; e < copies.size(); ++e) {
    const int64_t t = total[e];
    if (t == 0) continue;
    const auto c = int64_t(copies[e].size());
    // The first run starts on the copy after the previous step's last run ends: over steps each
    // copy gets an equal share however few tokens a step brings (single-sequence decode brings
    // one). Adding e starts lone tokens of different experts on different ranks.
    runs[e] = {(dispatched[e] + int64_t(e)) % c, t / c + (t % c > 0 ? 1 : 0), 1, t / c, t % c};
    dispatched[e] += t;
  }
  std::vector<std::vector<int32_t>> out(experts_sent.size());
  for (size_t q = 0; q < experts_sent.size(); ++q) {
    out[q].reserve(experts_sent[q].size());
    for (int32_t e : experts_sent[q]) {
      const auto& slots = copies[size_t(e)];
      Run& run = runs[size_t(e)];
      out[q].push_back(slots[size_t(run.copy)]);
      if (--run.left ==
          0) {  // the next run, on the next copy (empty ones come after the last token)
        run.left = run.base + (run.next < run.longer ? 1 : 0);
        ++run.next;
        if (++run.copy == int64_t(slots.size())) run.copy = 0;
      }
    }
  }
  return out;
}

EpRank::EpRank(const EpSegment& segment, int rank,
               std::shared_ptr<const model::DeepSeekModel> model)
    : segment_(segment),
      rank_(rank),
      model_(std::move(model)),
      cache_(cache_shape_of(*model_, segment.shape()), segment.shape().cache_blocks,
             segment.cache()) {
  const auto& c = model_->config();
  const EpShape& s = segment_.shape();
  if (cache_.shape().block_bytes() != s.cache_block_bytes)
    throw Error("expert parallelism: rank " + std::to_string(rank) + " computes KV blocks of " +
                std::to_string(cache_.shape().block_bytes()) +
                " bytes, the segment holds blocks of " + std::to_string(s.cache_block_bytes));
  if (c.hidden_size != s.hidden || c.n_routed_experts != s.experts ||
      c.num_experts_per_tok != s.top_k || c.vocab_size != s.vocab)
    throw Error("expert parallelism: rank " + std::to_string(rank) +
                " loaded a model of another shape than the engine's");
  moe_index_.assign(c.num_hidden_layers, -1);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    if (c.is_moe_layer(l)) {
      moe_index_[l] = int64_t(moe_layers_.size());
      moe_layers_.push_back(l);
    }
  if (int64_t(moe_layers_.size()) != s.moe_layers)
    throw Error("expert parallelism: rank " + std::to_string(rank) + " sees " +
                std::to_string(moe_layers_.size()) + " MoE layers, the segment " +
                std::to_string(s.moe_layers));
  layers_.resize(moe_layers_.size());
  for (int64_t layer : moe_layers_)
    for (int64_t e = 0; e < s.experts; ++e) seen_.push_back(model_->expert_counts()[layer][e]);
}

void EpRank::load_placement() {
  const uint32_t table = segment_.header().table.load(std::memory_order_acquire);
  prepare_placement(table);
  switch_placement(table);
}

void EpRank::prepare_placement(uint32_t which) {
  const EpShape& s = segment_.shape();
  const PlacementTable table = segment_.table(which);
  const auto& checkpoint = model_->weights().checkpoint;
  prepared_.assign(layers_.size(), {});
  for (size_t li = 0; li < layers_.size(); ++li) {
    const LayerSlots& now = layers_[li];
    for (int32_t slot = 0; slot < table.slot_count[li]; ++slot) {
      if (table.slot_rank[li * s.max_slots + slot] != rank_) continue;
      const int32_t e = table.slot_expert[li * s.max_slots + slot];
      // A second copy on this rank shares the first's weights (switch_placement): loaded once.
      if (std::find(now.held_expert.begin(), now.held_expert.end(), e) != now.held_expert.end() ||
          std::any_of(prepared_[li].begin(), prepared_[li].end(),
                      [&](const auto& p) { return p.first == e; }))
        continue;
      prepared_[li].emplace_back(
          e, model::load_expert(checkpoint, model_->config(), moe_layers_[li], e));
    }
  }
}

void EpRank::switch_placement(uint32_t which) {
  const EpShape& s = segment_.shape();
  const PlacementTable table = segment_.table(which);
  if (prepared_.size() != layers_.size()) prepared_.assign(layers_.size(), {});
  for (size_t li = 0; li < layers_.size(); ++li) {
    LayerSlots next;
    const int32_t slots = table.slot_count[li];
    next.slot_rank.assign(table.slot_rank + li * s.max_slots,
                          table.slot_rank + li * s.max_slots + slots);
    next.copies.resize(size_t(s.experts));
    next.dispatched.assign(size_t(s.experts), 0);
    next.local.assign(size_t(slots), -1);
    LayerSlots& old = layers_[li];
    auto& ready = prepared_[li];
    for (int32_t slot = 0; slot < slots; ++slot) {
      const int32_t e = table.slot_expert[li * s.max_slots + slot];
      next.copies[size_t(e)].push_back(slot);
      if (next.slot_rank[size_t(slot)] != rank_) continue;
      // A second copy of an expert on this rank (EPLB packs copies by load alone and may put
      // two on one rank) is the same expert: it shares the first copy's weights, and the rows
      // sent to either run together, as they would with one copy. slots_for_entries still gives
      // each slot its share, so this rank runs two shares, as EPLB's balance assumes.
      if (const auto same = std::find(next.held_expert.begin(), next.held_expert.end(), e);
          same != next.held_expert.end()) {
        next.local[size_t(slot)] = int32_t(same - next.held_expert.begin());
        continue;
      }
      next.local[size_t(slot)] = int32_t(next.held.size());
      next.held.push_back(slot);
      next.held_expert.push_back(e);
      // Weights move (no copy): from the experts in use, else from the prepared ones.
      const auto was = std::find(old.held_expert.begin(), old.held_expert.end(), e);
      if (was != old.held_expert.end()) {
        const auto i = size_t(was - old.held_expert.begin());
        next.weights.push_back(std::move(old.weights[i]));
        old.held_expert[i] = -1;  // taken
        continue;
      }
      const auto got =
          std::find_if(ready.begin(), ready.end(), [&](const auto& p) { return p.first == e; });
      if (got == ready.end())
        throw Error("expert placement: rank " + std::to_string(rank_) +
                    " was not prepared for expert " + std::to_string(e) + " of MoE layer " +
                    std::to_string(li));
      next.weights.push_back(std::move(got->second));
      got->first = -1;  // taken
    }
    layers_[li] = std::move(next);  // frees the experts this rank no longer holds
    ready.clear();
  }
}

void EpRank::switch_placement_with_all(uint32_t table) {
  switch_placement(table);
  barrier();
}

void EpRank::barrier() {
  segment_.rank(rank_).arrivals->fetch_add(1, std::memory_order_release);
  segment_.header().barrier.arrive_and_wait(uint32_t(segment_.shape().ranks), poll_);
}

void EpRank::routed_experts(int64_t layer, const float* xn, int64_t n,
                            std::span<const model::Routing> routes, float* out) {
  const EpShape& s = segment_.shape();
  const int64_t h = s.hidden;
  const int64_t li = moe_index_.at(size_t(layer));
  if (li < 0) throw Error("expert exchange: layer " + std::to_string(layer) + " is not MoE");
  LayerSlots& L = layers_[size_t(li)];
  const RankArea me = segment_.rank(rank_);

  // Dispatch.
  auto t0 = Clock::now();
  if (n > s.max_tokens)
    throw Error("expert exchange: " + std::to_string(n) + " tokens, the segment holds " +
                std::to_string(s.max_tokens));
  if (n > 0) std::memcpy(me.rows, xn, sizeof(float) * size_t(n * h));
  std::vector<int64_t> first_entry(static_cast<size_t>(n) + 1, 0);
  int64_t j = 0;
  for (int64_t t = 0; t < n; ++t) {
    const model::Routing& r = routes[size_t(t)];
    first_entry[size_t(t)] = j;
    for (size_t k = 0; k < r.experts.size(); ++k)
      me.entries[j++] = {int32_t(t), r.experts[k], r.weights[k]};
  }
  first_entry[size_t(n)] = j;
  me.entry_count->store(j, std::memory_order_release);
  work_.copy_seconds += since(t0);
  work_.exchange_bytes += int64_t(sizeof(float)) * n * h;

  t0 = Clock::now();
  barrier();
  work_.wait_seconds += since(t0);
  // Every rank's attention of this layer is done: layers [0, layer] are in the cache.
  if (on_layer_ && *on_layer_ && layer + 1 > layers_reported_) {
    layers_reported_ = layer + 1;
    (*on_layer_)(layers_reported_);
  }

  // Experts: per expert held, the rows every rank sent to its slots, in rank order.
  t0 = Clock::now();
  struct Ref {
    int32_t rank;
    int64_t entry;
  };
  // Every rank derives the same copy for every rank's entries from what they all dispatched.
  std::vector<RankArea> areas;
  std::vector<std::vector<int32_t>> experts_sent(size_t(s.ranks));
  for (int q = 0; q < s.ranks; ++q) {
    areas.push_back(segment_.rank(q));
    const int64_t count = areas.back().entry_count->load(std::memory_order_acquire);
    const Entry* entries = areas.back().entries;
    experts_sent[size_t(q)].reserve(size_t(count));
    for (int64_t e = 0; e < count; ++e) experts_sent[size_t(q)].push_back(entries[e].expert);
  }
  const std::vector<std::vector<int32_t>> slot_of =
      slots_for_entries(experts_sent, L.copies, L.dispatched);
  std::vector<int64_t> rows_of(L.held.size(), 0);
  for (const auto& slots : slot_of)
    for (int32_t slot : slots)
      if (const int32_t local = L.local[size_t(slot)]; local >= 0) ++rows_of[size_t(local)];
  std::vector<std::vector<Ref>> work(L.held.size());
  for (size_t i = 0; i < work.size(); ++i) work[i].reserve(size_t(rows_of[i]));
  for (int q = 0; q < s.ranks; ++q)
    for (size_t e = 0; e < slot_of[size_t(q)].size(); ++e) {
      const int32_t local = L.local[size_t(slot_of[size_t(q)][e])];
      if (local >= 0) work[size_t(local)].push_back({q, int64_t(e)});
    }
  std::vector<int64_t> first_row(work.size() + 1, 0);
  for (size_t i = 0; i < work.size(); ++i)
    first_row[i + 1] = first_row[i] + int64_t(work[i].size());
  std::vector<size_t> order(work.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return work[a].size() > work[b].size(); });
  const RankArea* ap = areas.data();
#pragma omp parallel for schedule(dynamic, 1) if (order.size() > 1)
  for (size_t o = 0; o < order.size(); ++o) {
    const size_t i = order[o];
    const auto& refs = work[i];
    if (refs.empty()) continue;
    const auto m = int64_t(refs.size());
    thread_local std::vector<float> in;
    in.resize(size_t(m * h));
    for (int64_t k = 0; k < m; ++k) {
      const RankArea& from = ap[refs[size_t(k)].rank];
      std::memcpy(in.data() + k * h,
                  from.rows + int64_t(from.entries[refs[size_t(k)].entry].token) * h,
                  sizeof(float) * size_t(h));
      from.result_row[refs[size_t(k)].entry] = first_row[i] + k;
    }
    model_->expert_forward(L.weights[i], in.data(), m, me.results + first_row[i] * h);
  }
  work_.expert_rows += first_row.back();
  work_.expert_seconds += since(t0);

  t0 = Clock::now();
  barrier();
  work_.wait_seconds += since(t0);

  // Combine, in the single process's order: per column chunk, each token's experts ascending.
  t0 = Clock::now();
  struct Part {
    int32_t expert;
    float weight;
    const float* result;
  };
  std::vector<std::vector<Part>> parts(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) {
    auto& p = parts[size_t(t)];
    for (int64_t e = first_entry[size_t(t)]; e < first_entry[size_t(t) + 1]; ++e) {
      const Entry& en = me.entries[e];
      const RankArea& owner = ap[L.slot_rank[size_t(slot_of[size_t(rank_)][size_t(e)])]];
      p.push_back({en.expert, en.weight, owner.results + me.result_row[e] * h});
    }
    std::sort(p.begin(), p.end(), [](const Part& a, const Part& b) { return a.expert < b.expert; });
  }
  constexpr int64_t kColumns = model::kRoutedSumColumns;
  const auto* pp = parts.data();
#pragma omp parallel for schedule(static) if (n > 16)
  for (int64_t c0 = 0; c0 < h; c0 += kColumns) {
    const int64_t width = std::min(kColumns, h - c0);
    for (int64_t t = 0; t < n; ++t)
      for (const Part& part : pp[t])
        kernels::axpy(part.weight, part.result + c0, out + t * h + c0, width);
  }
  work_.exchange_bytes += int64_t(sizeof(float)) * j * h;
  work_.copy_seconds += since(t0);
  ++work_.moe_layers;
}

void EpRank::run_step(const LayerHook& on_layer) {
  const EpShape& s = segment_.shape();
  const int64_t count = segment_.item_count();
  std::vector<model::SequenceStep> steps;
  std::vector<int64_t> mine;  // item indices
  for (int64_t i = 0; i < count; ++i) {
    const ItemDesc& d = segment_.items()[i];
    if (d.rank != rank_) continue;
    mine.push_back(i);
    steps.push_back(
        {std::span<const int32_t>(segment_.tokens() + d.first_token, size_t(d.tokens)), d.start,
         std::span<const int32_t>(segment_.blocks() + d.first_block, size_t(d.blocks))});
  }
  on_layer_ = &on_layer;
  layers_reported_ = 0;
  struct Reset {
    const LayerHook** hook;
    ~Reset() { *hook = nullptr; }
  } reset{&on_layer_};
  if (steps.empty()) {
    // No sequences here this step: still a party to every exchange.
    for (int64_t layer : moe_layers_) routed_experts(layer, nullptr, 0, {}, nullptr);
  } else {
    const model::StepOutput out = model_->forward(steps, cache_, {}, this);
    for (size_t k = 0; k < mine.size(); ++k)
      if (segment_.items()[mine[k]].sample)
        std::memcpy(segment_.logits(mine[k]), out.logits.data() + out.first_row[k] * s.vocab,
                    sizeof(float) * size_t(s.vocab));
  }
  // The step's routes: the model counts since it was loaded, a step's are the difference.
  const RankArea me = segment_.rank(rank_);
  const auto& counts = model_->expert_counts();
  for (size_t li = 0; li < moe_layers_.size(); ++li)
    for (int64_t e = 0; e < s.experts; ++e) {
      const uint64_t now = counts[size_t(moe_layers_[li])][size_t(e)];
      uint64_t& seen = seen_[li * size_t(s.experts) + size_t(e)];
      me.routed[li * size_t(s.experts) + size_t(e)] = int64_t(now - seen);
      seen = now;
    }
  *me.work = work_;
  barrier();
}

}  // namespace tandem::engine::ep
