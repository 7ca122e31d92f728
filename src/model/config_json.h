#pragma once
// What every model family's config.json shares: this engine's limits on it, the checks of the
// fields all families have, the RoPE block (`rope_scaling` or `rope_parameters`) and the dtype,
// each read through util/json_fields.h's strict Fields.
#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/rope.h"
#include "util/json_fields.h"

namespace tandem::model {

// This engine's limits on what a config.json may declare. Each is far above any released model
// (DeepSeek-V3: 61 layers, 256 experts, vocabulary 129,280; Qwen3-235B-A22B: 94 layers, 128
// experts; context lengths up to 10M), yet low enough that the per-layer and per-expert work a
// config implies (validating a checkpoint builds the list of every tensor it must hold) stays
// bounded and that products of sizes fit in 64 bits. README.md lists them.
inline constexpr int64_t kMaxLayers = 4096;                 // num_hidden_layers (+ MTP layers)
inline constexpr int64_t kMaxExperts = 65536;               // routed experts per layer
inline constexpr int64_t kMaxExpertMlps = 1 << 20;          // routed experts summed over the layers
inline constexpr int64_t kMaxDimension = int64_t{1} << 24;  // vocab, hidden, head, MLP sizes
inline constexpr int64_t kMaxPositions = int64_t{1} << 30;  // max_position_embeddings
// YaRN's mscale and mscale_all_dim (published models: 0.707 and 1). Its attention temperature
// 0.1 * mscale * ln(factor) + 1 divides the RoPE magnitude and is squared into DeepSeek's softmax
// scale: a negative mscale can make it zero, a huge one infinite.
inline constexpr double kMaxYarnMscale = 10.0;

// The checks every family makes on the fields they share: rms_norm_eps and rope_theta positive
// (a negative epsilon makes RMSNorm NaN, a zero base makes RoPE's frequencies infinite), and
// above 1 with YaRN (its correction range divides by ln(rope_theta)), max_position_embeddings in
// [1, kMaxPositions], and bos/eos token ids below vocab_size.
struct SharedFields {
  int64_t vocab_size;
  double rms_norm_eps, rope_theta;
  bool yarn;
  int64_t max_position_embeddings;
  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;
};
void check_shared_fields(const Fields& f, const SharedFields& s);

// What the RoPE and attention settings compute, as the model will: frequencies and magnitude of
// `rope`, and the softmax scale (as the float the kernels take), must be finite, or every logit
// is NaN and generation ends silently. The field checks above keep published configs far from
// the edge; this catches the combinations they let through (a rope_theta so small its powers
// overflow, YaRN betas so small their correction range is infinite). `yarn_field` names the
// YaRN block when there is one ("rope_scaling" or "rope_parameters"), else is empty.
void check_rope_numbers(const Fields& f, const Rope& rope, double softmax_scale,
                        const std::string& yarn_field);

// DIR/config.json parsed; a malformed file is an error naming it.
nlohmann::json read_config_json(const std::filesystem::path& dir);

// "must be one of "a", "b"; got "x"".
std::string one_of(const std::string& got, std::initializer_list<const char*> allowed);

// A config's RoPE as transformers writes it: rope_theta beside a `rope_scaling` object (v4), or a
// `rope_parameters` object that also carries rope_theta (>= 4.56 / v5). Both objects at once, an
// inner rope_theta contradicting a top-level one, or scaling other than YaRN is an error.
struct RopeFields {
  std::optional<double> theta;  // none given: the family's default applies, or it is required
  std::optional<YarnScaling> yarn;
  std::string yarn_field;  // the object YaRN came from ("rope_scaling" or "rope_parameters")
};
// `original_context`: YaRN's original_max_position_embeddings where the config gives none.
RopeFields read_rope_fields(Fields& f, int64_t original_context);

// The weights' dtype, `torch_dtype` (transformers v4) or `dtype` (its name from 4.56 / v5):
// "bfloat16", "float16" or "float32"; `fallback` when neither is given (`dtype` wins where both
// are).
std::string read_dtype_field(Fields& f, const std::string& fallback);

}  // namespace tandem::model
