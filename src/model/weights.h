#pragma once
// The weights of a DeepSeek-V2/V3-family model in the form the CPU forward pass uses. Float32,
// BF16 and INT8 matrices are used in place from the mapped checkpoint; F16 is widened to float32
// and FP8 (128x128 block scales) is dequantised to BF16 when loading.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "kernels/cpu/ops.h"
#include "model/config.h"
#include "model/safetensors.h"
#include "model/tensor_binder.h"

namespace tandem::model {

using kernels::Matrix;

struct MoeWeights {
  Matrix router;                       // [n_routed_experts, hidden]
  std::vector<float> correction_bias;  // empty unless topk_method == noaux_tc
  std::vector<MlpWeights> experts;     // by physical slot
  // Logical expert -> physical slot. Identity when loaded; expert placement rewrites it (and
  // moves the weights) without any change to the forward pass.
  std::vector<int32_t> slot_of_expert;
  MlpWeights shared;  // all shared experts as one MLP (HF stores them so)
  bool has_shared = false;
};

struct AttentionWeights {
  Matrix q_a, q_b;  // with q-LoRA
  std::vector<float> q_a_norm;
  Matrix q;     // without q-LoRA
  Matrix kv_a;  // [kv_lora_rank + rope_dim, hidden]
  std::vector<float> kv_a_norm;
  Matrix kv_b;  // [heads * (nope + v), kv_lora_rank]
  Matrix o;     // [hidden, heads * v]
  // W_UK (kv_b's key rows) transposed per head, [heads * kv_lora_rank, nope] with head h's rows
  // from h * kv_lora_rank, packed only: absorbed attention folds it into a decode query with the
  // row-block kernels, which stream it at the bandwidth, where a transposed product over kv_b's
  // rows read half of each row per pass (~0.3 ms a layer for its 2 MB). BF16 also for an INT8
  // kv_b (dequantised: on the 8-layer V2-Lite-width checkpoint, attention took 2.3 ms a token
  // with W_UK products over the INT8 rows, 1.6 ms with this copy). Empty where kv_b is F32 or
  // cannot be packed.
  Matrix k_up_t;
};

struct LayerWeights {
  std::vector<float> input_norm, post_attention_norm;
  AttentionWeights attn;
  bool is_moe = false;
  MlpWeights dense;
  MoeWeights moe;
};

struct MtpWeights {
  Matrix embed;  // the MTP module's own copy of the embedding
  std::vector<float> enorm, hnorm;
  Matrix eh_proj;  // [hidden, 2 * hidden]: [embedding ; hidden state]
  LayerWeights layer;
  std::vector<float> final_norm;
  Matrix head;
};

struct WeightLoadOptions {
  // False: MoE layers get no routed experts (an expert-parallel rank loads its own slots with
  // load_expert); the router, shared experts and everything else load as usual.
  bool routed_experts = true;
  // The LM head (and the MTP heads) quantized to INT8 at load, W8A8 like the checkpoint's INT8
  // linears (per-row scales, activations per token): half the bytes a decode token reads there.
  // W8A8 checkpoints keep the head in BF16 (its `ignore: ["lm_head"]`); llama.cpp's Q8_0 files
  // quantize it. The head's BF16 rows are released; an embedding tied to it keeps its rows.
  bool int8_lm_head = false;
  // False: the MTP modules stay in the file (an engine that does not speculate never runs them;
  // on a DeepSeek-V3 checkpoint they are 11.5 GB). Weights::mtp is then empty.
  bool mtp = true;
};

struct Weights {
  Checkpoint checkpoint;  // keeps the mapped tensors alive
  Matrix embed;
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;
  Matrix lm_head;  // the embedding when tied
  std::vector<MtpWeights> mtp;
  size_t packed_bytes = 0;  // of the packed copies made at load (what decode streams)

  // Checks every tensor's presence, shape and dtype against the config, then binds them.
  // `progress` (optional) receives tensors done / total.
  static Weights load(Checkpoint checkpoint, const ModelConfig& config,
                      const std::function<void(size_t, size_t)>& progress = {},
                      const WeightLoadOptions& options = {});
};

// Routed expert `expert` of model layer `layer`, bound from the checkpoint (mapped, so only the
// pages of experts a process loads become resident) and packed as Weights::load packs it.
MlpWeights load_expert(const Checkpoint& checkpoint, const ModelConfig& config, int64_t layer,
                       int64_t expert);

}  // namespace tandem::model
