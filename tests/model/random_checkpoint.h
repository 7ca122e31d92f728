#pragma once
// A checkpoint of any architecture the config describes, with small random BF16 weights from a
// counter-based generator: for tests about loading and kernels, where the weights need not be
// meaningful and no tokenizer is needed (make-model needs one and fixes the widths per preset).
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

// Writes config.json and BF16 safetensors shards of at most 64 MB; returns the tensors' bytes.
inline int64_t write_random_checkpoint(const std::filesystem::path& dir,
                                       const model::ModelConfig& config) {
  const std::vector<model::TensorSpec> specs =
      model::checkpoint_layout(config, model::DType::kBF16);
  auto fill = [](const model::TensorSpec& spec, std::span<std::byte> out) {
    uint64_t state = std::hash<std::string>{}(spec.name) | 1;
    auto* v = reinterpret_cast<uint16_t*>(out.data());
    for (size_t i = 0; i < out.size() / 2; ++i) {
      state = state * 6364136223846793005ULL + 1442695040888963407ULL;
      const float x = (static_cast<float>(state >> 40) / (1 << 24) - 0.5f) * 0.05f;
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
