#pragma once
// The executor that runs the real model on the CPU (model/deepseek.h) over a paged latent cache
// sized from a memory budget.
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/executor/executor.h"
#include "engine/speculative/mtp_drafter.h"
#include "model/deepseek.h"
#include "text/tokenizer.h"

namespace tandem::engine {

struct CpuExecutorOptions {
  int64_t block_size = 16;
  double kv_cache_bytes = 1ull << 30;  // budget for the latent cache
  int64_t num_blocks = 0;              // overrides the budget when > 0
  // Element type of the latent cache; unset: the model's default (BF16 unless float32 weights).
  std::optional<model::LatentType> kv_cache_type;
  // Speculative decoding: draft tokens per step from the model's MTP module (0: off).
  int64_t speculative_tokens = 0;
};

// KV blocks of the options' budget (or their explicit count) for a cache of this shape (block
// size and type taken from the options). Throws, naming --kv-cache-gb or --num-kv-blocks, when
// no block fits the budget, when the count exceeds 2^31-1 (block ids are int32) or when the
// cache's bytes exceed kv_cache_memory_limit().
int64_t kv_blocks_for(const model::LatentCacheShape& shape, const CpuExecutorOptions& options);
int64_t kv_blocks_for(const model::DeepSeekModel& model, const CpuExecutorOptions& options);
// The most memory a KV cache may take: the machine's physical memory, or the memory limit of
// the process's cgroup when one is set and lower; 0 when neither can be read (no check).
int64_t kv_cache_memory_limit();
// The files that hold the memory limits binding this process, from /proc/self/cgroup's text:
// for cgroup v2 ("0::/a/b") memory.max of /sys/fs/cgroup/a/b and of each folder above; for v1 (a
// line naming "memory") memory.limit_in_bytes likewise under /sys/fs/cgroup/memory.
std::vector<std::string> cgroup_memory_limit_files(std::string_view proc_self_cgroup);

class CpuExecutor : public Executor {
 public:
  CpuExecutor(std::shared_ptr<const model::DeepSeekModel> model, const text::Tokenizer& tokenizer,
              std::string model_name, const CpuExecutorOptions& options);
  const ExecutorInfo& info() const override { return info_; }
  ExecResult execute(std::span<const ExecItem> batch, const LayerHook& on_layer = {}) override;
  const std::byte* kv_bytes(int32_t block, int64_t layer) const override;
  void write_kv(int32_t block, int64_t layer, std::span<const std::byte> bytes) override;
  std::byte* kv_bytes_mutable(int32_t block, int64_t layer) override;
  SharedView kv_shared_memory() const override { return cache_.shared(); }

 private:
  std::shared_ptr<const model::DeepSeekModel> model_;
  ExecutorInfo info_;
  model::LatentCache cache_;
  std::vector<int32_t> no_text_;  // LM-head rows without a token (padded vocabularies)
  std::optional<MtpDrafter> drafter_;
  // The model's route counts after the previous step, [moe layers, experts]. Assumes no other
  // executor runs steps on the same model object concurrently.
  std::vector<uint64_t> seen_;
};

}  // namespace tandem::engine
