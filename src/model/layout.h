#pragma once
// The one list of the tensors a Hugging Face checkpoint of a DeepSeek-V2/V3-family config holds:
// names, shapes and dtypes as the real releases store them. make-model writes it, the loader
// checks against it.
#include <vector>

#include "model/config.h"
#include "model/safetensors.h"

namespace tandem::model {

// Every tensor, in Hugging Face's order: model.embed_tokens; per layer the two norms,
// self_attn.* (q_a_proj / q_a_layernorm / q_b_proj, or q_proj without q-LoRA;
// kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj) and mlp.* (dense gate/up/down_proj, or
// the router mlp.gate.weight, e_score_correction_bias for noaux_tc, experts.E.* and
// shared_experts.*); model.norm; lm_head (absent when tied); then the MTP layers
// model.layers.{L+k}: embed_tokens, enorm, hnorm, eh_proj, a full decoder layer, shared_head.norm
// and shared_head.head.
//
// `weight_dtype` is the dtype of the linear layers' weights. F32, BF16 or F16: every tensor has
// it, except e_score_correction_bias, which is F32 as in the releases. F8_E4M3 (config.fp8) or
// I8 (config.int8): the attention and MLP linears are quantized, each weight followed by its F32
// scale (weight_scale_inv [ceil(out/128), ceil(in/128)], or weight_scale [out, 1]); embeddings,
// norms, the router, eh_proj and the heads stay BF16 and the correction bias F32. A weight dtype
// that contradicts the config's quantization is an error.
std::vector<TensorSpec> checkpoint_layout(const ModelConfig& config, DType weight_dtype);

// The weight dtype of a checkpoint: F8_E4M3 or I8 per the config's quantization, else the dtype
// of model.embed_tokens.weight.
DType checkpoint_weight_dtype(const Checkpoint& checkpoint, const ModelConfig& config);

// Checks that the checkpoint holds exactly the layout's tensors. Throws tandem::Error naming the
// first missing, extra, mis-shaped or mistyped tensor with the expected dtype and shape, and how
// many other problems there are. Quantized weights must have exactly the expected dtype; every
// other tensor (scales included) may be any of F32/BF16/F16, which the loader converts.
void validate_checkpoint(const Checkpoint& checkpoint, const ModelConfig& config);

// Derived DeepSeek-V3/R1 checkpoints strip the MTP layers' tensors and keep the config's
// num_nextn_predict_layers (vLLM loads them, without MTP). When the config has MTP layers and the
// checkpoint holds no tensor of any of them, sets config.num_nextn_predict_layers to 0, so the
// checkpoint validates and loads without MTP, and returns a warning naming the field and the
// missing layers (the caller says what it does without them); otherwise
// returns "" and changes nothing (some present: validate_checkpoint names the missing ones).
std::string drop_absent_mtp_layers(const Checkpoint& checkpoint, ModelConfig& config);

}  // namespace tandem::model
