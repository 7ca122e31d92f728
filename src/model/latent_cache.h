#pragma once
// The paged cache of MLA latents: for every cached token and layer, the normalised compressed
// KV latent (kv_lora_rank values) followed by the RoPE'd decoupled key (qk_rope_head_dim values),
// the [c_kv | k_pe] order FlashMLA and vLLM use. Storage is split into fixed-size blocks, each
// holding `block_size` tokens for all layers; a sequence reaches its tokens through a block
// table. This one type is shared by the attention kernels, the prefix cache and KV transfer.
//
// Values are float32 or BF16 (rounded to nearest even when stored): BF16 halves the bytes every
// decode step reads and every KV transfer sends; it is the default for BF16 and quantised
// checkpoints, as DeepSeek's reference keeps its cache in the model's BF16 dtype.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/cpu/mla_attention.h"
#include "util/shared_memory.h"

namespace tandem::model {

using kernels::LatentType;

struct LatentCacheShape {
  int64_t layers = 0;      // main layers plus MTP layers
  int64_t block_size = 0;  // tokens per block
  int64_t latent_dim = 0;  // kv_lora_rank
  int64_t rope_dim = 0;    // qk_rope_head_dim
  LatentType type = LatentType::kF32;
  int64_t entry() const { return latent_dim + rope_dim; }
  int64_t value_bytes() const { return type == LatentType::kBF16 ? 2 : 4; }
  int64_t entry_bytes() const { return entry() * value_bytes(); }
  int64_t block_bytes() const { return layers * block_size * entry_bytes(); }
};

// "float32" or "bfloat16".
const char* latent_type_name(LatentType type);

class LatentCache {
 public:
  // Zero-filled blocks in a shared-memory segment of their own (pages allocated as first
  // written), so that a decode engine on this host can read a prompt's KV straight from a
  // prefill engine's cache; private memory where the system has no memfd.
  LatentCache(const LatentCacheShape& shape, int64_t num_blocks);
  // A view of `num_blocks` blocks in memory the caller owns and keeps alive (expert parallelism:
  // a shared-memory segment every rank maps), float-aligned, shape.block_bytes() * num_blocks.
  LatentCache(const LatentCacheShape& shape, int64_t num_blocks, std::byte* memory);
  LatentCache(LatentCache&&) = default;
  LatentCache& operator=(LatentCache&&) = default;

  const LatentCacheShape& shape() const { return shape_; }
  int64_t num_blocks() const { return num_blocks_; }
  // The segment holding the blocks; empty for a view or private memory.
  SharedView shared() const { return memory_.shared(); }

  // The block_size x entry() values of one block and layer, of shape().type.
  std::byte* block_layer(int64_t block, int64_t layer) { return data_ + offset(block, layer); }
  const std::byte* block_layer(int64_t block, int64_t layer) const {
    return data_ + offset(block, layer);
  }

  // Stores entry() values at token `slot` of a block and layer (rounding them for BF16).
  void store(int64_t block, int64_t layer, int64_t slot, const float* values);
  // Reads `count` values from `first` on of token `slot` of a block and layer, as float32.
  void load(int64_t block, int64_t layer, int64_t slot, int64_t first, int64_t count,
            float* out) const;

 private:
  LatentCacheShape shape_;
  int64_t num_blocks_;
  int64_t offset(int64_t block, int64_t layer) const {
    return (block * shape_.layers + layer) * shape_.block_size * shape_.entry_bytes();
  }

  SharableBuffer memory_;      // the blocks' bytes (empty for a view)
  std::byte* data_ = nullptr;  // memory_'s or the caller's bytes
};

}  // namespace tandem::model
