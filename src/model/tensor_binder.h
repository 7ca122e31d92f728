#pragma once
// Binds a checkpoint's tensors to the forms the CPU forward passes use, for every model family:
// vectors widened to float32; matrices used in place when they are F32, BF16 or INT8 (W8A8, with
// their row scales; F32 and BF16 copied first where the file misaligns them), F16 widened, FP8
// dequantised to BF16, the mapped pages of a copied or converted matrix given back (nothing reads
// them again: a tied INT8 head is quantized from the embedding's converted rows); matrices packed
// for the GEMM kernels with the plain rows given back when nothing reads them again (mapped pages
// dropped, converted rows freed: one copy of every packed matrix stays). Shapes are checked as each
// tensor is taken; `progress` counts them.
#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "kernels/cpu/ops.h"
#include "model/config.h"
#include "model/safetensors.h"

namespace tandem::model {

struct MlpWeights {  // SwiGLU: down(silu(gate x) * up x)
  kernels::Matrix gate, up, down;
};

// Whether a tensor is the LM head's, which the checkpoint of a model with tie_word_embeddings may
// still hold (some exporters write both, e.g. Qwen1.5-0.5B-Chat's first release): transformers'
// tie_weights makes the output embedding the input one after loading and vLLM skips lm_head.*, so
// such a tensor is never read, whatever it holds.
inline bool is_tied_away_head(const std::string& tensor) {
  return tensor.starts_with("lm_head.");
}

// The LM head of a model with tie_word_embeddings: the embedding as bound, shared rather than
// bound again, so that an embedding the binder copied (misaligned in its file) or converted (F16
// widened) is held once, not once more for the head. The head reads `embedding`'s memory: the two
// live side by side in a model's weights (moving a Matrix keeps its storage where it is).
kernels::Matrix tied_head(const kernels::Matrix& embedding);

// Whether a tensor is a rotary embedding's inverse frequencies, which checkpoints exported while
// transformers kept them as a persistent buffer hold
// (model.layers.N.self_attn.rotary_emb.inv_freq). The forward passes compute them from the config,
// and vLLM's loaders skip every name containing "rotary_emb.inv_freq" (DeepSeek-V2/V3's
// load_weights, Qwen3-MoE's AutoWeightsLoader), so such a tensor is never read, whatever it holds.
inline bool is_unused_rotary_buffer(const std::string& tensor) {
  return tensor.find("rotary_emb.inv_freq") != std::string::npos;
}

// How much of a tensor name from a file an error message shows, quoted escaped (released names
// are under 100 bytes; a file's may be megabytes, or hold control bytes).
inline constexpr size_t kShownTensorNameBytes = 256;

class TensorBinder {
 public:
  // `fp8`: the block shape of an FP8 checkpoint's scales.
  TensorBinder(const Checkpoint& checkpoint, std::optional<Fp8Quantization> fp8,
               const std::function<void(size_t, size_t)>& progress);

  std::vector<float> vector(const std::string& name, int64_t n);
  // NAME.weight [rows, cols] (and its scales).
  kernels::Matrix matrix(const std::string& name, int64_t rows, int64_t cols);

  // Whether the plain rows in the mapping may be given back after packing: not for matrices
  // something still reads row by row (absorbed attention's kv_b; batch-invariant numerics).
  enum class PlainRows { kRelease, kKeep };
  kernels::Matrix packed_matrix(const std::string& name, int64_t rows, int64_t cols,
                                PlainRows plain = PlainRows::kRelease);
  // NAME.weight quantized to INT8 with one scale per row (model/quantize.h's W8A8 rule), in
  // chunks of rows so no float32 copy of a whole matrix is ever made. BF16, F16 or F32 only. Its
  // mapped pages are given back: nothing reads them again.
  kernels::Matrix int8_matrix(const std::string& name, int64_t rows, int64_t cols);
  // The same of a tied embedding NAME.weight, quantized from `embedding` (what matrix() made of
  // it: its rows in the mapping, a copy of them, or F16 widened exactly to F32), so no page of
  // the file is read twice; those the embedding looks its rows up in stay.
  kernels::Matrix int8_matrix_of_embedding(const std::string& name,
                                           const kernels::Matrix& embedding);
  // PREFIX.{gate,up,down}_proj, packed.
  MlpWeights mlp(const std::string& prefix, int64_t hidden, int64_t inter);
  // A router [experts, hidden] in float32 (its top-k must not flip on rounding; float32 weights
  // also let a prompt's routing logits come from the float32 GEMM).
  kernels::Matrix router(const std::string& name, int64_t experts, int64_t hidden);
  // Leaves every tensor whose name starts with `prefix` unread (a part of the model this process
  // does not run); progress then counts up to what is read. Unused rotary buffers are never
  // counted.
  void skip(const std::string& prefix);
  // Whether a tensor of the checkpoint was bound (a model checks that every one was).
  bool taken(const std::string& tensor) const { return taken_.count(tensor) > 0; }
  // Where packed copies are carved (matrices a model derives at load are packed here too); the
  // binder's destruction, at the end of a load, collapses them onto huge pages.
  util::HugePageArena& arena() { return arena_; }

 private:
  const TensorInfo& take(const std::string& name, const std::vector<int64_t>& shape);
  void pack(kernels::Matrix& m, PlainRows plain);
  // NAME.weight, checked to be a dtype int8_matrix quantizes.
  const TensorInfo& take_quantizable(const std::string& name, int64_t rows, int64_t cols);
  // `rows` x `cols` of `dtype` (BF16, F16 or F32) at `data`, quantized and packed.
  kernels::Matrix quantized_int8(const std::string& name, DType dtype, const std::byte* data,
                                 int64_t rows, int64_t cols);
  void dequantize_fp8(const std::string& name, const TensorInfo& t, kernels::Matrix& m);

  const Checkpoint& checkpoint_;
  std::optional<Fp8Quantization> fp8_;
  const std::function<void(size_t, size_t)>& progress_;
  size_t done_ = 0, total_;
  std::set<std::string> taken_;
  util::HugePageArena arena_;
};

}  // namespace tandem::model
