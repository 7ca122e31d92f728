#include "engine/expert_parallel/rank_process.h"

#include <omp.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <thread>

#include "engine/expert_parallel/ep_rank.h"
#include "kernels/cpu/ops.h"
#include "util/error.h"

namespace tandem::engine::ep {
namespace {

struct Abandoned {};  // thrown by the poll when the step cannot complete

}  // namespace

int serve_rank(const RankProcessOptions& o) {
  if (getppid() != o.parent) return 3;  // the engine died before this rank started
  SharedSegment memory = SharedSegment::attach(o.fd);
  const EpSegment segment = EpSegment::open(memory);
  Header& header = segment.header();
  omp_set_num_threads(std::max(1, o.threads));
  kernels::set_batch_invariant(o.batch_invariant);
  auto loaded = std::make_shared<model::DeepSeekModel>(model::DeepSeekModel::load(
      o.model_dir, {}, model::WeightLoadOptions{.routed_experts = false, .mtp = false}));
  loaded->set_mla_rescale(static_cast<kernels::MlaRescale>(o.mla_rescale));
  EpRank rank(segment, o.rank, loaded);
  auto gone = [&] {
    return getppid() != o.parent || header.abort.load(std::memory_order_acquire) != 0;
  };
  rank.set_poll([&](uint32_t) {
    if (gone()) throw Abandoned{};
  });
  rank.load_placement();

  // The loader: new expert copies of a staged placement load beside the steps. The front posts a
  // switch only after every rank counted itself prepared, but that order passes through the
  // front process; the mutex states it inside this one (it is never contended at a switch).
  std::atomic<bool> stopping{false};
  std::mutex placement_mutex;
  // Read before "ready": the front stages nothing before it, so no change is missed.
  const uint32_t staged_at_start = header.staged.load(std::memory_order_acquire);
  std::thread loader([&, staged_at_start] {
    uint32_t staged = staged_at_start;
    while (!stopping.load()) {
      wait_while_equal(header.staged, staged, 100);
      const uint32_t now = header.staged.load(std::memory_order_acquire);
      if (now == staged) continue;
      staged = now;
      try {
        std::lock_guard lock(placement_mutex);
        rank.prepare_placement(header.table.load(std::memory_order_acquire) ^ 1u);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "tandem ep-rank %d: loading experts: %s\n", o.rank, e.what());
        header.abort.store(1, std::memory_order_release);
        wake_all(header.barrier.generation);
        return;
      }
      header.prepared.fetch_add(1, std::memory_order_acq_rel);
      wake_all(header.prepared);
    }
  });
  struct JoinLoader {
    std::atomic<bool>& stopping;
    std::thread& loader;
    ~JoinLoader() {
      stopping = true;
      loader.join();
    }
  } join_loader{stopping, loader};

  uint32_t seen = header.posted.load(std::memory_order_acquire);
  std::printf("ready\n");
  std::fflush(stdout);
  for (;;) {
    while (header.posted.load(std::memory_order_acquire) == seen) {
      wait_while_equal(header.posted, seen, 100);
      if (gone()) return 3;
    }
    seen = header.posted.load(std::memory_order_acquire);
    const auto command = static_cast<Command>(header.command.load(std::memory_order_relaxed));
    if (command == Command::kShutdown) return 0;
    try {
      if (command == Command::kSwitchPlacement) {
        std::lock_guard lock(placement_mutex);
        rank.switch_placement_with_all(header.table.load(std::memory_order_acquire) ^ 1u);
      } else {
        rank.run_step();
      }
    } catch (const Abandoned&) {
      return 3;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "tandem ep-rank %d: %s\n", o.rank, e.what());
      header.abort.store(1, std::memory_order_release);
      wake_all(header.barrier.generation);
      return 1;
    }
  }
}

}  // namespace tandem::engine::ep
