#pragma once
// Strict reading of Hugging Face config.json objects, shared by every model family's config:
// each field read is remembered, whatever is left is an unknown field, and every message names
// the file and the field's path. Also the `rope_scaling` YaRN block the families share.
#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/rope.h"
#include "util/error.h"
#include "util/json.h"

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

// Reads the fields of one JSON object, remembering which were read so that whatever is left is
// reported as unknown. Every message names the origin and the field's path.
class Fields {
 public:
  using json = nlohmann::json;
  Fields(const json& obj, std::string origin, std::string prefix = "")
      : obj_(obj), origin_(std::move(origin)), prefix_(std::move(prefix)) {}

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    throw Error(origin_ + ": field '" + prefix_ + key + "' " + what);
  }

  // The value, or null when absent or JSON null.
  const json* get(const std::string& key) {
    seen_.insert(key);
    auto it = obj_.find(key);
    return it == obj_.end() || it->is_null() ? nullptr : &*it;
  }
  bool present(const std::string& key) const {
    auto it = obj_.find(key);
    return it != obj_.end() && !it->is_null();
  }
  const json& need(const std::string& key) {
    const json* v = get(key);
    if (!v) fail(key, "is required");
    return *v;
  }

  int64_t integer(const std::string& key, const json& v) const {
    if (!v.is_number_integer()) fail(key, "must be an integer, got " + json_excerpt(v));
    // get<int64_t>() would wrap 2^64 - 1 to -1, and the message would name a value never given.
    if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t{INT64_MAX})
      fail(key, "is " + std::to_string(v.get<uint64_t>()) + ", above the limit of " +
                    std::to_string(INT64_MAX));
    return v.get<int64_t>();
  }
  int64_t integer(const std::string& key) { return integer(key, need(key)); }
  int64_t integer_or(const std::string& key, int64_t fallback) {
    const json* v = get(key);
    return v ? integer(key, *v) : fallback;
  }
  // An integer or a list of them (transformers' Union[int, List[int]], as eos_token_id); empty
  // when absent or null. An element's error names it: 'eos_token_id[1]'.
  std::vector<int64_t> integers(const std::string& key) {
    const json* v = get(key);
    if (!v) return {};
    if (!v->is_array()) {
      if (!v->is_number_integer())
        fail(key, "must be an integer or a list of integers, got " + json_excerpt(*v));
      return {integer(key, *v)};
    }
    std::vector<int64_t> out;
    for (size_t i = 0; i < v->size(); ++i)
      out.push_back(integer(key + "[" + std::to_string(i) + "]", (*v)[i]));
    return out;
  }
  std::optional<int64_t> optional_integer(const std::string& key) {
    const json* v = get(key);
    return v ? std::optional<int64_t>(integer(key, *v)) : std::nullopt;
  }
  double number(const std::string& key, const json& v) const {
    if (!v.is_number()) fail(key, "must be a number, got " + json_excerpt(v));
    return v.get<double>();
  }
  double number(const std::string& key) { return number(key, need(key)); }
  double number_or(const std::string& key, double fallback) {
    const json* v = get(key);
    return v ? number(key, *v) : fallback;
  }
  bool boolean(const std::string& key, const json& v) const {
    if (!v.is_boolean()) fail(key, "must be true or false, got " + json_excerpt(v));
    return v.get<bool>();
  }
  bool boolean(const std::string& key) { return boolean(key, need(key)); }
  bool boolean_or(const std::string& key, bool fallback) {
    const json* v = get(key);
    return v ? boolean(key, *v) : fallback;
  }
  std::string string(const std::string& key, const json& v) const {
    if (!v.is_string()) fail(key, "must be a string, got " + json_excerpt(v));
    return v.get<std::string>();
  }
  std::string string(const std::string& key) { return string(key, need(key)); }
  std::string string_or(const std::string& key, const std::string& fallback) {
    const json* v = get(key);
    return v ? string(key, *v) : fallback;
  }

  // An integer field's value against this engine's limit (one of the kMax constants above).
  void at_most(const std::string& key, int64_t v, int64_t limit) const {
    if (v > limit)
      fail(key,
           "is " + std::to_string(v) + ", above this engine's limit of " + std::to_string(limit));
  }
  // An integer field that must lie in [1, limit].
  void positive_at_most(const std::string& key, int64_t v, int64_t limit) const {
    if (v <= 0) fail(key, "must be positive, got " + std::to_string(v));
    at_most(key, v, limit);
  }

  // Accepted without effect on the model (training settings, bookkeeping).
  void ignore(const std::string& key) { seen_.insert(key); }

  void reject_unknown() const {
    for (const auto& [key, value] : obj_.items())
      if (!seen_.count(key)) fail(key, "is not a known field of this configuration");
  }

 private:
  const json& obj_;
  std::string origin_, prefix_;
  std::set<std::string> seen_;
};

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
RopeFields read_rope_fields(Fields& f, const std::string& origin, int64_t original_context);

// The weights' dtype, `torch_dtype` (transformers v4) or `dtype` (its name from 4.56 / v5):
// "bfloat16", "float16" or "float32"; `fallback` when neither is given (`dtype` wins where both
// are).
std::string read_dtype_field(Fields& f, const std::string& fallback);

}  // namespace tandem::model
