#include "engine/expert_parallel/rank_process.h"

#include <omp.h>
#include <unistd.h>

#include <cstdio>

#include "engine/expert_parallel/ep_rank.h"
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
  auto loaded = std::make_shared<model::DeepSeekModel>(
      model::DeepSeekModel::load(o.model_dir, {}, model::WeightLoadOptions{false}));
  loaded->set_mla_rescale(static_cast<kernels::MlaRescale>(o.mla_rescale));
  EpRank rank(segment, o.rank, loaded);
  auto gone = [&] {
    return getppid() != o.parent || header.abort.load(std::memory_order_acquire) != 0;
  };
  rank.set_poll([&] {
    if (gone()) throw Abandoned{};
  });
  rank.load_placement();

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
      rank.run_step();
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
