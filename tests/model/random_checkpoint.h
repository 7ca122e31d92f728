#pragma once
// A checkpoint of any architecture the config describes, with small random BF16 (or FP8) weights
// from a counter-based generator: for tests about loading and kernels, where the weights need not
// be meaningful and no tokenizer is needed (make-model needs one and fixes the widths per preset).
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/layout.h"
#include "model/safetensors.h"

namespace tandem::test {

// Writes config.json and safetensors shards of at most 64 MB; returns the tensors' bytes. With
// `weight_dtype` F8_E4M3 the config gets FP8 quantization (128x128 blocks) and the linears are
// FP8 with F32 scales (model/layout.h); every other tensor is BF16 (F32 where the layout says).
inline int64_t write_random_checkpoint(const std::filesystem::path& dir, model::ModelConfig config,
                                       model::DType weight_dtype = model::DType::kBF16) {
  if (weight_dtype == model::DType::kF8E4M3) config.fp8 = model::Fp8Quantization{};
  const std::vector<model::TensorSpec> specs = model::checkpoint_layout(config, weight_dtype);
  auto fill = [](const model::TensorSpec& spec, std::span<std::byte> out) {
    uint64_t state = std::hash<std::string>{}(spec.name) | 1;
    auto next = [&state] {
      state = state * 6364136223846793005ULL + 1442695040888963407ULL;
      return state;
    };
    if (spec.dtype == model::DType::kF8E4M3) {
      // Sign, exponents below the bias, any mantissa: |w| < 1, never NaN; times a scale of 1/64.
      for (std::byte& b : out) b = static_cast<std::byte>((next() >> 56) & 0xb7);
      return;
    }
    if (spec.name.ends_with(".weight_scale_inv")) {
      const float v = 1.f / 64;
      for (size_t i = 0; i + 4 <= out.size(); i += 4) std::memcpy(out.data() + i, &v, 4);
      return;
    }
    auto* v = reinterpret_cast<uint16_t*>(out.data());
    for (size_t i = 0; i < out.size() / 2; ++i) {
      const float x = (static_cast<float>(next() >> 40) / (1 << 24) - 0.5f) * 0.05f;
      uint32_t bits;
      std::memcpy(&bits, &x, 4);
      v[i] = static_cast<uint16_t>(bits >> 16);
    }
  };
  model::write_checkpoint(dir, specs, fill, size_t{64} << 20);
  std::ofstream(dir / "config.json") << config.to_json().dump(2);
  int64_t bytes = 0;
  for (const auto& s : specs) bytes += static_cast<int64_t>(s.nbytes());
  return bytes;
}

}  // namespace tandem::test
