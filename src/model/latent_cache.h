#pragma once
// The paged cache of MLA latents: for every cached token and layer, the normalised compressed
// KV latent (kv_lora_rank values) followed by the RoPE'd decoupled key (qk_rope_head_dim values),
// the [c_kv | k_pe] order FlashMLA and vLLM use. Storage is split into fixed-size blocks, each
// holding `block_size` tokens for all layers; a sequence reaches its tokens through a block
// table. This one type is shared by the attention kernels, the prefix cache and KV transfer.
#include <cstdint>
#include <vector>

namespace tandem::model {

struct LatentCacheShape {
  int64_t layers = 0;      // main layers plus MTP layers
  int64_t block_size = 0;  // tokens per block
  int64_t latent_dim = 0;  // kv_lora_rank
  int64_t rope_dim = 0;    // qk_rope_head_dim
  int64_t entry() const { return latent_dim + rope_dim; }
  int64_t block_floats() const { return layers * block_size * entry(); }
};

class LatentCache {
 public:
  LatentCache(const LatentCacheShape& shape, int64_t num_blocks);

  const LatentCacheShape& shape() const { return shape_; }
  int64_t num_blocks() const { return num_blocks_; }

  // The `block_size` x entry() floats of one block and layer.
  float* block_layer(int64_t block, int64_t layer) {
    return data_.data() + (block * shape_.layers + layer) * shape_.block_size * shape_.entry();
  }
  const float* block_layer(int64_t block, int64_t layer) const {
    return data_.data() + (block * shape_.layers + layer) * shape_.block_size * shape_.entry();
  }

 private:
  LatentCacheShape shape_;
  int64_t num_blocks_;
  std::vector<float> data_;
};

}  // namespace tandem::model
