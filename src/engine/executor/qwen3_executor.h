#pragma once
// The executor that runs a Qwen3-MoE model on the CPU (model/qwen3_moe.h) over a paged K/V cache
// sized from a memory budget: what CpuExecutor is for the DeepSeek family.
#include <memory>
#include <string>
#include <vector>

#include "engine/executor/cpu_executor.h"
#include "engine/executor/executor.h"
#include "model/qwen3_moe.h"
#include "text/tokenizer.h"

namespace tandem::engine {

class Qwen3Executor : public Executor {
 public:
  // Options as CpuExecutor's; speculative decoding needs an MTP module, which Qwen3 has not.
  Qwen3Executor(std::shared_ptr<const model::Qwen3MoeModel> model, const text::Tokenizer& tokenizer,
                std::string model_name, const CpuExecutorOptions& options);
  const ExecutorInfo& info() const override { return info_; }
  ExecResult execute(std::span<const ExecItem> batch, const LayerHook& on_layer = {}) override;
  const std::byte* kv_bytes(int32_t block, int64_t layer) const override;
  void write_kv(int32_t block, int64_t layer, std::span<const std::byte> bytes) override;
  std::byte* kv_bytes_mutable(int32_t block, int64_t layer) override;
  SharedView kv_shared_memory() const override { return cache_.shared(); }

 private:
  std::shared_ptr<const model::Qwen3MoeModel> model_;
  ExecutorInfo info_;
  model::LatentCache cache_;
  std::vector<int32_t> no_text_;
  std::vector<uint64_t> seen_;  // route counts after the previous step [moe layers, experts]
};

}  // namespace tandem::engine
