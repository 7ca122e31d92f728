#include "engine/expert_parallel/ep_executor.h"

#include <fcntl.h>
#include <omp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "engine/executor/model_executor.h"
#include "engine/expert_parallel/rank_start.h"
#include "kernels/cpu/ops.h"
#include "placement/eplb.h"
#include "util/error.h"

namespace tandem::engine::ep {
namespace {

int default_threads(int ranks) {
  const auto cores = static_cast<int>(std::thread::hardware_concurrency());
  return std::max(1, cores / ranks);
}

}  // namespace

int64_t segment_slots(const placement::Placement& start, int64_t experts, int ranks,
                      int64_t max_slots) {
  // Room for every expert on every rank, the most `tandem place plan` writes into a layer, so a
  // live remap takes any plan the engine would take at start. Two tables of 4 bytes x layers x
  // (1 + 2 x slots): DeepSeek-V3 (58 MoE layers, 256 experts) on 64 ranks is 15 MB of address
  // space, and only the slots a placement uses are ever written (the segment's pages are
  // allocated as written).
  int64_t slots = std::max(max_slots, experts * ranks);
  for (int64_t l = 0; l < start.num_layers(); ++l) slots = std::max(slots, start.slots(l));
  return slots;
}

EpExecutor::EpExecutor(const EpExecutorOptions& o, const text::Tokenizer& tokenizer)
    : stall_(o.stall_timeout) {
  const auto load_started = std::chrono::steady_clock::now();
  if (o.ranks < 2)
    throw Error("--expert-parallel: needs at least 2 ranks, got " + std::to_string(o.ranks));
  auto loaded = std::make_shared<model::DeepSeekModel>(model::DeepSeekModel::load(
      o.model_dir, {}, model::WeightLoadOptions{.routed_experts = false, .mtp = false}));
  loaded->set_mla_rescale(o.mla_rescale);
  model_ = loaded;
  // Each rank loads the same model, all of them at once on the same cores and disks: they get as
  // long as the front took, once per rank, plus the stall timeout (at least a minute of it, as a
  // stall timeout of seconds is meant for steps).
  const auto load_time = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - load_started);
  const auto& c = model_->config();
  int64_t moe_layers = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) moe_layers += c.is_moe_layer(l) ? 1 : 0;
  if (moe_layers == 0) throw Error("--expert-parallel: the model has no MoE layers");
  if (c.n_routed_experts < o.ranks)
    throw Error("--expert-parallel " + std::to_string(o.ranks) + ": the model has only " +
                std::to_string(c.n_routed_experts) + " routed experts per layer");
  placement::Placement placement =
      o.placement ? *o.placement
                  : placement::no_redundancy(moe_layers, c.n_routed_experts, o.ranks);
  // A placement that does not fit the model is found only now, the model loaded: its errors
  // name the file it came from.
  const auto naming_source = [&](const std::function<void()>& check) {
    try {
      check();
    } catch (const Error& e) {
      if (o.placement_source.empty()) throw;
      throw Error(o.placement_source + ": " + e.what());
    }
  };
  naming_source([&] { placement::validate(placement, placement::kServable); });

  const auto cache_shape = model_->cache_shape(o.cache.block_size, o.cache.kv_cache_type);
  const int64_t blocks = kv_blocks_for(*model_, o.cache);
  EpShape shape;
  shape.ranks = o.ranks;
  shape.cache_type = static_cast<int32_t>(cache_shape.type);
  shape.hidden = c.hidden_size;
  shape.top_k = c.num_experts_per_tok;
  shape.experts = c.n_routed_experts;
  shape.moe_layers = moe_layers;
  shape.max_tokens = o.max_tokens;
  shape.max_items = o.max_items;
  const int64_t table_max =
      (c.max_position_embeddings + o.cache.block_size - 1) / o.cache.block_size;
  shape.max_block_refs = o.max_items * std::min(blocks, table_max);
  shape.vocab = c.vocab_size;
  shape.max_slots = segment_slots(placement, c.n_routed_experts, o.ranks, o.max_slots);
  shape.block_size = o.cache.block_size;
  shape.cache_blocks = blocks;
  shape.cache_block_bytes = cache_shape.block_bytes();
  memory_ = SharedSegment::create(EpSegment::bytes(shape), "tandem-ep");
  segment_ = EpSegment::format(memory_, shape);
  naming_source([&] { write_placement(segment_->table(0), shape, placement); });

  const int threads = o.threads_per_rank > 0 ? o.threads_per_rank : default_threads(o.ranks);
  threads_ = threads;
  omp_set_num_threads(threads);
  rank0_ = std::make_unique<EpRank>(*segment_, 0, model_);
  rank0_->set_poll([this](uint32_t waiting_at) { poll(waiting_at); });
  rank0_->load_placement();

  // This process's own program even when an upgrade has replaced the file it was started from
  // (its path then reads "... (deleted)"), as serve starts its engines.
  const std::string program =
      o.rank_program.empty() ? std::string("/proc/self/exe") : o.rank_program.string();
  const int fd = memory_.fd();
  const pid_t parent = getpid();
  for (int r = 1; r < o.ranks; ++r) {
    const std::vector<std::string> argv = {
        program, "ep-rank", "--fd", std::to_string(fd), "--rank", std::to_string(r), "--model",
        o.model_dir.string(), "--mla-rescale", std::to_string(static_cast<int>(o.mla_rescale)),
        "--threads", std::to_string(threads), "--parent", std::to_string(parent),
        // The numerics mode is per process: ranks follow the engine's.
        "--batch-invariant", kernels::batch_invariant() ? "1" : "0"};
    children_.push_back(std::make_unique<ChildProcess>(program, argv, [fd] {
      // Between fork and exec: only async-signal-safe calls.
      fcntl(fd, F_SETFD, 0);             // the rank inherits the segment
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // and dies with the engine, however it ends
      signal(SIGINT, SIG_IGN);           // Ctrl-C stops the engine, which stops its ranks
    }));
  }
  await_ranks_ready(children_, o.stall_timeout.count() > 0
                                   ? std::max<std::chrono::milliseconds>(o.stall_timeout,
                                                                         std::chrono::minutes(1)) +
                                         load_time * o.ranks
                                   : o.stall_timeout);
  rank_work_.assign(size_t(o.ranks), RankWork{});
  info_ = model_executor_info(*model_, o.model_name, cache_shape, blocks);
  // Rank 0 writes one row of logits per item into the shared segment: the last new token's.
  info_.scores_prompts = false;
  no_text_ = ids_without_text(tokenizer, c.vocab_size);
}

void EpExecutor::stop_background() {
  stopping_ = true;
  if (loader_.joinable()) loader_.join();
}

EpExecutor::~EpExecutor() {
  stop_background();
  if (failure().empty()) post(Command::kShutdown);
  std::lock_guard lock(mutex_);
  for (auto& child : children_) {
    for (int i = 0; i < 1000 && !child->exited(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    child->stop();
  }
}

void EpExecutor::post(Command command) {
  Header& h = segment_->header();
  h.command.store(static_cast<uint32_t>(command), std::memory_order_relaxed);
  h.posted.fetch_add(1, std::memory_order_acq_rel);
  wake_all(h.posted);
}

void EpExecutor::abort_waits() const {
  Header& h = segment_->header();
  h.abort.store(1, std::memory_order_release);
  wake_all(h.barrier.generation);
  wake_all(h.posted);
}

void EpExecutor::collective(Command command, const std::function<void()>& rank0_part) {
  post(command);
  try {
    rank0_part();
  } catch (const std::exception& e) {
    fail(e.what());
    throw Error(failure());
  }
}

void EpExecutor::fail(const std::string& why) {
  std::lock_guard lock(mutex_);
  if (failure_.empty()) failure_ = why;
  abort_waits();
  for (auto& child : children_) {
    child->signal(SIGKILL);
    child->stop();
  }
}

void EpExecutor::poll(uint32_t waiting_at) {
  std::string why;
  {
    std::lock_guard lock(mutex_);
    for (size_t i = 0; i < children_.size() && why.empty(); ++i)
      if (auto status = children_[i]->exited())
        why = "expert-parallel rank " + std::to_string(i + 1) + " exited (status " +
              std::to_string(*status) + ")";
    if (why.empty() && segment_->header().abort.load(std::memory_order_acquire))
      why = failure_.empty() ? "expert parallelism: a rank failed its step" : failure_;
  }
  if (why.empty()) why = stalled_ranks(waiting_at);
  if (why.empty()) return;
  fail(why);
  throw Error(failure());
}

std::string EpExecutor::stalled_ranks(uint32_t waiting_at) {
  // The generation the wait is for, not the barrier's live one: a wait whose barrier completed
  // just before this poll would start timing the next step's wait, and after an idle spell of the
  // timeout that wait's first poll would find it "stalled".
  if (!stall_.stalled(waiting_at, StallWatch::Clock::now())) return {};
  std::vector<uint32_t> arrivals;
  for (int r = 0; r < ranks(); ++r)
    arrivals.push_back(segment_->rank(r).arrivals->load(std::memory_order_acquire));
  const std::vector<int> behind = ranks_behind(arrivals, 0);
  std::string names;
  for (int r : behind) names += (names.empty() ? "" : ", ") + std::to_string(r);
  const auto seconds = std::chrono::duration<double>(stall_.timeout()).count();
  char limit[32];
  std::snprintf(limit, sizeof limit, "%g s", seconds);
  return "expert-parallel rank" + std::string(behind.size() > 1 ? "s " : " ") +
         (names.empty() ? "?" : names) + " stalled: not at the step's exchange after " + limit +
         " (alive but stopped, frozen or deadlocked; --expert-parallel-stall-timeout)";
}

std::string EpExecutor::failure() const {
  std::lock_guard lock(mutex_);
  // A rank may die between steps: health checks notice it then, not only the next step.
  for (size_t i = 0; i < children_.size() && failure_.empty(); ++i)
    if (auto status = children_[i]->exited()) {
      failure_ = "expert-parallel rank " + std::to_string(i + 1) + " exited (status " +
                 std::to_string(*status) + ")";
      abort_waits();
    }
  return failure_;
}

std::optional<placement::Placement> EpExecutor::expert_placement() const {
  std::lock_guard lock(remap_mutex_);
  const Header& h = segment_->header();
  return read_placement(segment_->table(h.table.load(std::memory_order_acquire)),
                        segment_->shape());
}

void EpExecutor::stage_expert_placement(const placement::Placement& next,
                                        std::function<void()> loaded) {
  if (auto why = failure(); !why.empty()) throw Error(why);
  std::lock_guard lock(remap_mutex_);
  if (stopping_) throw Error("the engine is stopping");
  if (remap_ != Remap::kNone) throw Error("a placement change is already underway");
  const EpShape& s = segment_->shape();
  Header& h = segment_->header();
  const uint32_t active = h.table.load(std::memory_order_acquire), staged = active ^ 1u;
  // The same checks, in the same words, as a placement given at start.
  if (next.ranks != s.ranks)
    throw Error("placement: \"ranks\" is " + std::to_string(next.ranks) + ", the engine has " +
                std::to_string(s.ranks) + " ranks");
  placement::validate(next, placement::kServable);
  write_placement(segment_->table(staged), s, next);
  if (loader_.joinable()) loader_.join();
  staged_ = {};
  staged_.moves = placement::count_moves(read_placement(segment_->table(active), s), next);
  remap_ = Remap::kLoading;
  h.prepared.store(0, std::memory_order_release);
  h.staged.fetch_add(1, std::memory_order_acq_rel);
  wake_all(h.staged);
  loader_ = std::thread([this, staged, loaded = std::move(loaded)] {
    const auto t0 = std::chrono::steady_clock::now();
    Header& hd = segment_->header();
    try {
      rank0_->prepare_placement(staged);
    } catch (const std::exception& e) {
      fail(std::string("expert placement: loading experts: ") + e.what());
      return;
    }
    hd.prepared.fetch_add(1, std::memory_order_acq_rel);
    for (uint32_t n; (n = hd.prepared.load(std::memory_order_acquire)) < uint32_t(ranks());) {
      if (stopping_ || !failure().empty() || hd.abort.load()) return;
      wait_while_equal(hd.prepared, n, 50);
    }
    {
      std::lock_guard lock(remap_mutex_);
      staged_.load_seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      remap_ = Remap::kLoaded;
    }
    if (loaded) loaded();
  });
}

PlacementSwitch EpExecutor::switch_expert_placement() {
  if (auto why = failure(); !why.empty()) throw Error(why);
  std::lock_guard lock(remap_mutex_);
  if (remap_ != Remap::kLoaded) throw Error("no staged expert placement is loaded yet");
  Header& h = segment_->header();
  const uint32_t next = h.table.load(std::memory_order_acquire) ^ 1u;
  const auto t0 = std::chrono::steady_clock::now();
  collective(Command::kSwitchPlacement, [&] { rank0_->switch_placement_with_all(next); });
  h.table.store(next, std::memory_order_release);
  staged_.pause_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  remap_ = Remap::kNone;
  return staged_;
}

void EpExecutor::check_batch(std::span<const ExecItem> batch) const {
  const EpShape& s = segment_->shape();
  int64_t tokens = 0, refs = 0;
  for (const auto& item : batch) {
    tokens += int64_t(item.tokens.size());
    refs += int64_t(item.blocks.size());
    if (item.tokens.empty()) throw Error("expert parallelism: a sequence with no new tokens");
    if (!item.drafts.empty())
      throw Error("expert parallelism: speculative decoding is not supported yet");
    for (auto t : item.tokens)
      if (t < 0 || t >= s.vocab)
        throw Error("forward: token id " + std::to_string(t) + " is outside the vocabulary");
    const int64_t end = item.start + int64_t(item.tokens.size());
    if (item.start < 0 || int64_t(item.blocks.size()) * s.block_size < end)
      throw Error("forward: a block table covers fewer positions than its sequence needs");
    for (auto b : item.blocks)
      if (b < 0 || b >= s.cache_blocks)
        throw Error("forward: block " + std::to_string(b) + " is outside the cache");
  }
  if (int64_t(batch.size()) > s.max_items || tokens > s.max_tokens || refs > s.max_block_refs)
    throw Error("expert parallelism: a step of " + std::to_string(batch.size()) +
                " sequences and " + std::to_string(tokens) + " tokens exceeds the " +
                std::to_string(s.max_items) + " and " + std::to_string(s.max_tokens) +
                " the engine was started with");
}

ExecResult EpExecutor::execute(std::span<const ExecItem> batch, const LayerHook& on_layer) {
  if (auto why = failure(); !why.empty()) throw Error(why);
  check_batch(batch);
  // OpenMP's thread count is per calling thread: steps run on the engine's thread.
  omp_set_num_threads(threads_);
  const EpShape& s = segment_->shape();
  int64_t total = 0;
  for (const auto& item : batch) total += int64_t(item.tokens.size());
  // Contiguous runs of sequences of about equal new tokens: rank order is batch order.
  int64_t before = 0, token_at = 0, block_at = 0;
  segment_->item_count() = int64_t(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    const ExecItem& item = batch[i];
    ItemDesc& d = segment_->items()[i];
    d.rank =
        int32_t(std::min<int64_t>(s.ranks - 1, before * s.ranks / std::max<int64_t>(total, 1)));
    d.sample = item.sample ? 1 : 0;
    d.start = item.start;
    d.first_token = token_at;
    d.tokens = int64_t(item.tokens.size());
    d.first_block = block_at;
    d.blocks = int64_t(item.blocks.size());
    std::memcpy(segment_->tokens() + token_at, item.tokens.data(), item.tokens.size_bytes());
    std::memcpy(segment_->blocks() + block_at, item.blocks.data(), item.blocks.size_bytes());
    token_at += d.tokens;
    block_at += d.blocks;
    before += d.tokens;
  }
  collective(Command::kStep, [&] { rank0_->run_step(on_layer); });
  ExecResult result;
  sample_items(
      batch, [&](size_t i, size_t) { return segment_->logits(int64_t(i)); }, s.vocab, no_text_,
      result.sampled);
  result.expert_tokens.assign(size_t(s.moe_layers * s.experts), 0);
  std::vector<RankWork> work;
  for (int r = 0; r < s.ranks; ++r) {
    const RankArea area = segment_->rank(r);
    for (size_t k = 0; k < result.expert_tokens.size(); ++k)
      result.expert_tokens[k] += area.routed[k];
    work.push_back(*area.work);
  }
  {
    std::lock_guard lock(mutex_);
    rank_work_ = std::move(work);
  }
  return result;
}

std::vector<RankWork> EpExecutor::rank_work() const {
  std::lock_guard lock(mutex_);
  return rank_work_;
}

const std::byte* EpExecutor::kv_bytes(int32_t block, int64_t layer) const {
  return rank0_->cache().block_layer(block, layer);
}

std::byte* EpExecutor::kv_bytes_mutable(int32_t block, int64_t layer) {
  return kv_block_or_null(rank0_->cache(), info_, block, layer);
}

void EpExecutor::write_kv(int32_t block, int64_t layer, std::span<const std::byte> bytes) {
  write_kv_block(rank0_->cache(), info_, block, layer, bytes);
}

}  // namespace tandem::engine::ep
