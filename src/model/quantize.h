#pragma once
// Weight quantization, as the loader reads it: one rule for make-model's quantized checkpoints and
// for `tandem quantize`, which turns any BF16/F16/F32 checkpoint into the FP8 (E4M3, block
// scales) or INT8 (W8A8, per-output-channel scales) format.
#include <cstddef>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/dtype.h"

namespace tandem::model {

// Quantizes one weight [rows, cols] (row-major) as `config` says: FP8 E4M3 with one scale per
// block (scale = amax / 448, DeepSeek's weight_scale_inv, 1 for an all-zero block), or INT8 with
// one scale per output row (scale = amax / 127, round half to even, clamp to +-127, as meituan's
// converter); a scale is at least FLT_MIN (weights that small come back as nearly zero). Writes
// the quantized bytes to `q` when non-null and the scales to `scales`. Throws tandem::Error when
// the config has no quantization, or for an infinite or NaN weight, naming it: "`name` [ROW, COL]
// is inf: cannot quantize", ROW counted from `first_row` (`w` may be rows of a larger tensor).
void quantize_weight(const ModelConfig& config, std::span<const float> w, int64_t rows,
                     int64_t cols, std::byte* q, std::vector<float>& scales,
                     const std::string& name = "weight", int64_t first_row = 0);

// Whether `name` is a quantized weight's scale tensor (X.weight_scale_inv for FP8, X.weight_scale
// for INT8; model/layout.h); its weight is the name up to the last '.' plus ".weight".
bool is_weight_scale(const std::string& name);

struct QuantizeOptions {
  std::filesystem::path in, out;  // checkpoint folders; `out` is created, must differ from `in`
  DType dtype = DType::kI8;       // I8 or F8_E4M3
  size_t max_shard_bytes = size_t{2} << 30;
};

// Writes `in`'s checkpoint to `out` quantized: the attention and MLP linears in `dtype` with their
// scales (model/layout.h says which), every other tensor in BF16 (the correction bias stays F32);
// config.json gains the quantization_config, torch_dtype becomes bfloat16; the tokenizer (every
// file and folder of it, chat templates included) and generation config are copied, and those a
// model written to `out` before had but `in` lacks are removed. The same rules as make-model: an
// F32 checkpoint made by make-model quantizes to the bytes make-model writes for that dtype.
// Tensors are converted one at a time. Returns the written config. Throws tandem::Error naming the
// file or tensor for a source that is missing, incomplete or already quantized.
ModelConfig quantize_checkpoint(const QuantizeOptions& options,
                                const std::function<void(size_t, size_t)>& progress = {});

}  // namespace tandem::model
