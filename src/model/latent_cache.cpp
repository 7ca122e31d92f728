#include "model/latent_cache.h"

#include <algorithm>
#include <cstring>

#include "kernels/cpu/bf16.h"
#include "kernels/cpu/ops.h"
#include "util/error.h"

namespace tandem::model {

const char* latent_type_name(LatentType type) {
  return type == LatentType::kBF16 ? "bfloat16" : "float32";
}

LatentCache::LatentCache(const LatentCacheShape& shape, int64_t num_blocks)
    : shape_(shape), num_blocks_(num_blocks) {
  if (shape.layers <= 0 || shape.block_size <= 0 || shape.entry() <= 0 || num_blocks <= 0)
    throw Error("latent cache: layers, block size, entry size and block count must be positive");
  int64_t bytes = 0;
  if (__builtin_mul_overflow(shape.block_bytes(), num_blocks, &bytes))
    throw Error("latent cache: " + std::to_string(num_blocks) + " blocks of " +
                std::to_string(shape.block_bytes()) + " bytes overflow a 64-bit size");
  memory_ = SharableBuffer(static_cast<size_t>(bytes), "tandem-kv-cache");
  data_ = memory_.data();
}

LatentCache::LatentCache(const LatentCacheShape& shape, int64_t num_blocks, std::byte* memory)
    : shape_(shape), num_blocks_(num_blocks), data_(memory) {
  if (shape.layers <= 0 || shape.block_size <= 0 || shape.entry() <= 0 || num_blocks <= 0)
    throw Error("latent cache: layers, block size, entry size and block count must be positive");
  if (!memory || reinterpret_cast<uintptr_t>(memory) % alignof(float) != 0)
    throw Error("latent cache: the memory of a cache view must be float-aligned");
}

void LatentCache::store(int64_t block, int64_t layer, int64_t slot, const float* values) {
  std::byte* row = block_layer(block, layer) + slot * shape_.entry_bytes();
  if (shape_.type == LatentType::kBF16)
    kernels::to_bf16(values, shape_.entry(), reinterpret_cast<uint16_t*>(row));
  else
    std::memcpy(row, values, shape_.entry_bytes());
}

void LatentCache::load(int64_t block, int64_t layer, int64_t slot, int64_t first, int64_t count,
                       float* out) const {
  const std::byte* row = block_layer(block, layer) + slot * shape_.entry_bytes();
  if (shape_.type == LatentType::kBF16) {
    const auto* v = reinterpret_cast<const uint16_t*>(row) + first;
    for (int64_t i = 0; i < count; ++i) out[i] = kernels::bf16_to_f32(v[i]);
  } else {
    std::memcpy(out, reinterpret_cast<const float*>(row) + first, count * sizeof(float));
  }
}

}  // namespace tandem::model
