#pragma once
// The body of `tandem ep-rank`: a rank 1..N-1 of an expert-parallel engine, started by the
// engine's EpExecutor with the segment's descriptor. It loads the model without routed experts,
// then the experts of its slots, prints "ready" on stdout, and runs each step the front posts
// until told to stop. It gives up when the engine process is gone or the segment says abort.
#include <filesystem>
#include <string>

namespace tandem::engine::ep {

struct RankProcessOptions {
  int fd = -1;
  int rank = 0;
  std::filesystem::path model_dir;
  int mla_rescale = 0;  // kernels::MlaRescale
  int threads = 1;
  int parent = 0;                // the engine's pid
  bool batch_invariant = false;  // kernels::set_batch_invariant
};

// Returns the process exit status: 0 when the front asked it to stop, 3 when the step was
// abandoned (the front died or another rank failed), 1 when this rank failed.
int serve_rank(const RankProcessOptions& options);

}  // namespace tandem::engine::ep
