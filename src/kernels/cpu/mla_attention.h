#pragma once
// Absorbed MLA attention over a paged latent cache, for decode steps (one query token per
// sequence, or a few: a token and its speculative drafts). With W_UK folded into the query and
// W_UV applied afterwards by the caller, every head attends to the same cached rows
// [c_kv (latent) | k_pe (rope)]: keys are whole rows, values their latent part. The kernel reads
// each cached row once for all heads and query tokens of its sequence, in tiles with an online
// (flash-style) softmax, and splits long contexts across threads (split-K) with a merge at the end.
//
// Two ways to rescale the running sums when a tile raises a row's maximum:
//  - kMultiply: acc *= exp(m_old - m_new), the conventional FlashAttention update.
//  - kAmla: AMLA's (Omni-Infer), where the running maximum only ever moves by whole powers of two
//    in the exp2 domain, so the rescale is an integer added to the exponent bits of the float32
//    accumulator (exact, no multiply); the fractional remainder ends up in the probabilities of
//    the tile (they are computed against the rounded-up maximum). Accumulator values whose exponent
//    would underflow become zero (the underflow guard), where a multiply would give a subnormal.
#include <cstdint>
#include <span>

namespace tandem::kernels {

enum class MlaRescale { kMultiply, kAmla };

// The element type of the cached rows.
enum class LatentType { kF32, kBF16 };

struct MlaShape {
  int64_t heads = 0;
  int64_t latent = 0;      // kv_lora_rank: the value width
  int64_t rope = 0;        // qk_rope_head_dim: keys are latent + rope wide
  int64_t block_size = 0;  // cached positions per page
  float scale = 1.0f;      // softmax scale of the scores
  LatentType type = LatentType::kF32;
  int64_t entry() const { return latent + rope; }
};

struct MlaSequence {
  // Absorbed queries [s_q, heads, latent + rope]: W_UK^T q_nope, then q_pe after RoPE.
  const float* q = nullptr;
  int64_t s_q = 1;
  // Cached positions, the queries' own included: query i sees positions < context - s_q + i + 1.
  int64_t context = 0;
  // Per page of block_size positions, the page's rows of this layer ([block_size, entry], of
  // MlaShape::type); ceil(context / block_size) of them.
  const void* const* pages = nullptr;
  // [s_q, heads, latent]: the softmax-weighted sum of the visible latents.
  float* out = nullptr;
};

struct MlaOptions {
  MlaRescale rescale = MlaRescale::kMultiply;
  // The AVX2 microkernels where the CPU has them; false runs the portable loops (tests).
  bool simd = true;
  // BF16 caches on CPUs with AVX-512 BF16: BF16 products (mla_tiles_avx512.h) with queries and
  // probabilities rounded to BF16 and float32 sums, twice the float32 rate; false widens the
  // cached rows to float32 and keeps every product in float32 (tests compare the two).
  bool bf16_dot = true;
  // Split a sequence's context into chunks at fixed positions (not into one chunk per thread
  // over its length), so a query's sums take the same path whatever the step's context and
  // query count are (batch-invariant numerics; ops.h).
  bool fixed_chunks = false;
};

void mla_decode(const MlaShape& shape, std::span<const MlaSequence> sequences,
                const MlaOptions& options = {});

// FLOPs of mla_decode for one sequence (scores and weighted sum; what benchmarks report).
double mla_decode_flops(const MlaShape& shape, int64_t s_q, int64_t context);

}  // namespace tandem::kernels
