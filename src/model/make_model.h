#pragma once
// Deterministic random-weight checkpoints in the exact Hugging Face layout, for tests, demos and
// benchmarks (no real weights can be downloaded here): config.json, generation_config.json, the
// tokenizer files, and safetensors shards with their index.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/dtype.h"
#include "model/qwen3_moe_config.h"

namespace tandem::model {

// "tiny-v3", "tiny-v2-lite", "bench" (DeepSeek), "tiny-qwen3-moe", "bench-qwen3-moe".
std::vector<std::string> model_presets();

// A DeepSeek preset's architecture (BF16, no token ids yet). Throws naming the presets for an
// unknown name.
ModelConfig preset_config(const std::string& name);

// The Qwen3-MoE presets: tiny-qwen3-moe (hidden 64, GQA 4/2 heads, 8 experts top-2, layer 0
// dense) and bench-qwen3-moe (Qwen3-30B-A3B's widths with 2 layers, ~3.7 GB in BF16).
bool is_qwen3_moe_preset(const std::string& name);
Qwen3MoeConfig qwen3_moe_preset_config(const std::string& name);

struct MakeModelOptions {
  std::string preset;
  std::filesystem::path out;
  // Holds tokenizer.json and optionally tokenizer_config.json and chat templates (all copied:
  // model_folder.h); the config's vocabulary must cover its ids, and its BOS/EOS become the
  // config's token ids.
  std::filesystem::path tokenizer_dir;
  uint64_t seed = 0;
  // F32, BF16, F16, F8_E4M3 (128x128 block scales) or I8 (per-output-channel scales).
  DType dtype = DType::kBF16;
  size_t max_shard_bytes = 0;  // 0: the preset's (4 MB for tiny presets, 2 GB for bench)
  // > 0: this many decoder layers instead of the preset's (the dense ones first, as the preset's
  // first_k_dense_replace says; fewer than that: all dense). E.g. the bench preset with 8 layers
  // is DeepSeek-V2-Lite's widths at the depth where a token's weights outweigh the LM head.
  int64_t layers = 0;
};

// Writes the model folder and returns its config. The same options give byte-identical files:
// every tensor comes from a counter-based generator keyed by (seed, tensor name), so values do
// not depend on the order tensors are written in. `progress` gets bytes written and the total.
ModelConfig make_model(const MakeModelOptions& options,
                       const std::function<void(size_t, size_t)>& progress = {});
// The same for a Qwen3-MoE preset (f32, bf16 or f16 weights).
Qwen3MoeConfig make_qwen3_moe_model(const MakeModelOptions& options,
                                    const std::function<void(size_t, size_t)>& progress = {});

}  // namespace tandem::model
