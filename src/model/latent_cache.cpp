#include "model/latent_cache.h"

#include "util/error.h"

namespace tandem::model {

LatentCache::LatentCache(const LatentCacheShape& shape, int64_t num_blocks)
    : shape_(shape), num_blocks_(num_blocks) {
  if (shape.layers <= 0 || shape.block_size <= 0 || shape.entry() <= 0 || num_blocks <= 0)
    throw Error("latent cache: layers, block size, entry size and block count must be positive");
  data_.assign(static_cast<size_t>(shape.block_floats() * num_blocks), 0.0f);
}

}  // namespace tandem::model
