#include "model/config_json.h"

#include <cmath>

#include "util/error.h"
#include "util/file.h"
#include "util/json.h"
#include "util/utf8.h"

namespace tandem::model {

using json = nlohmann::json;

json read_config_json(const std::filesystem::path& dir) {
  const std::filesystem::path path = dir / "config.json";
  // Our reader, not nlohmann's: its depth limit keeps a hostile config.json from exhausting the
  // stack in a recursive walk (nlohmann's dump() or comparison) later.
  return parse_json_document(read_regular_file(path, kMaxModelConfigBytes), path.string());
}

std::string one_of(const std::string& got, std::initializer_list<const char*> allowed) {
  std::string s = "must be one of";
  bool first = true;
  for (const char* a : allowed) {
    s += first ? " \"" : ", \"";
    s += a;
    s += "\"";
    first = false;
  }
  return s + "; got \"" + utf8::clip(got) + "\"";
}

void check_shared_fields(const Fields& f, const SharedFields& s) {
  // JSON has no NaN or infinity, so "> 0" is the whole check of a number.
  if (!(s.rms_norm_eps > 0)) f.fail("rms_norm_eps", "must be positive");
  if (!(s.rope_theta > 0)) f.fail("rope_theta", "must be positive");
  if (s.yarn && !(s.rope_theta > 1))
    f.fail("rope_theta",
           "must exceed 1 with YaRN scaling (its correction range divides by "
           "ln(rope_theta)), got " +
               json(s.rope_theta).dump());
  f.positive_at_most("max_position_embeddings", s.max_position_embeddings, kMaxPositions);
  const auto check_id = [&](const std::string& key, int64_t id) {
    if (id < 0 || id >= s.vocab_size)
      f.fail(key, "must be a token id below vocab_size " + std::to_string(s.vocab_size) + ", got " +
                      std::to_string(id));
  };
  if (s.bos_token_id) check_id("bos_token_id", *s.bos_token_id);
  for (size_t i = 0; i < s.eos_token_ids.size(); ++i)
    check_id(
        s.eos_token_ids.size() == 1 ? "eos_token_id" : "eos_token_id[" + std::to_string(i) + "]",
        s.eos_token_ids[i]);
}

void check_rope_numbers(const Fields& f, const Rope& rope, double softmax_scale,
                        const std::string& yarn_field) {
  const std::string field = yarn_field.empty() ? "rope_theta" : yarn_field;
  for (double v : rope.inv_freq())
    if (!std::isfinite(v) || v < 0) f.fail(field, "gives RoPE frequencies that are not finite");
  // Magnitude and softmax scale differ from their plain values only under YaRN.
  const double m = rope.magnitude();
  if (!std::isfinite(m) || !(m > 0))
    f.fail(field, "gives a RoPE magnitude that is not a positive finite number");
  const float scale = static_cast<float>(softmax_scale);
  if (!std::isfinite(scale) || !(scale > 0))
    f.fail(field, "gives an attention softmax scale that is not a positive finite number");
}

namespace {

// YaRN parameters of `rope_scaling` or `rope_parameters` (which also carries rope_theta). Returns
// false when the object selects plain RoPE.
bool parse_rope(Fields& config, const std::string& field, int64_t original_context,
                YarnScaling& yarn, std::optional<double>& theta) {
  auto f = config.nested(field);
  std::string type;
  if (f.present("type")) type = f.string("type");
  if (f.present("rope_type")) {
    const std::string t = f.string("rope_type");
    if (!type.empty() && t != type) f.fail("rope_type", "contradicts type \"" + type + "\"");
    type = t;
  }
  if (field == "rope_parameters" && f.present("rope_theta")) theta = f.number("rope_theta");
  if (type.empty()) f.fail("type", "is required (\"yarn\")");
  if (type == "default") {
    f.reject_unknown();
    return false;
  }
  if (type != "yarn")
    f.fail("type",
           "must be \"yarn\" (the only RoPE scaling of this model family); got \"" + type + "\"");
  yarn.factor = f.number("factor");
  if (!(yarn.factor >= 1.0)) f.fail("factor", "must be >= 1");
  yarn.original_max_position_embeddings =
      f.integer_or("original_max_position_embeddings", original_context);
  f.positive_at_most("original_max_position_embeddings", yarn.original_max_position_embeddings,
                     kMaxPositions);
  yarn.beta_fast = f.number_or("beta_fast", 32.0);
  yarn.beta_slow = f.number_or("beta_slow", 1.0);
  if (!(yarn.beta_fast > yarn.beta_slow) || !(yarn.beta_slow > 0))
    f.fail("beta_fast", "must exceed beta_slow, and both be positive");
  if (f.get("mscale")) yarn.mscale = f.number("mscale");
  yarn.mscale_all_dim = f.number_or("mscale_all_dim", 0.0);
  for (const auto& [key, v] : {std::pair<const char*, double>{"mscale", yarn.mscale.value_or(1.0)},
                               {"mscale_all_dim", yarn.mscale_all_dim}})
    if (!(v >= 0 && v <= kMaxYarnMscale))
      f.fail(key,
             "must be between 0 and " + json(kMaxYarnMscale).dump() + ", got " + json(v).dump());
  if (f.get("attention_factor")) {
    yarn.attention_factor = f.number("attention_factor");
    // It multiplies cos and sin, so q.k by its square: zero would erase positions, a huge one
    // overflow the scores.
    if (!(*yarn.attention_factor > 0 && *yarn.attention_factor <= kMaxYarnMscale))
      f.fail("attention_factor", "must be above 0 and at most " + json(kMaxYarnMscale).dump() +
                                     ", got " + json(*yarn.attention_factor).dump());
  }
  yarn.truncate = f.boolean_or("truncate", true);
  f.reject_unknown();
  return true;
}

}  // namespace

RopeFields read_rope_fields(Fields& f, int64_t original_context) {
  RopeFields r;
  if (f.present("rope_theta")) r.theta = f.number("rope_theta");
  f.ignore("rope_theta");
  YarnScaling yarn;
  if (f.get("rope_scaling")) {
    if (parse_rope(f, "rope_scaling", original_context, yarn, r.theta)) {
      r.yarn = yarn;
      r.yarn_field = "rope_scaling";
    }
  }
  if (f.get("rope_parameters")) {
    if (f.present("rope_scaling"))
      f.fail("rope_parameters", "and 'rope_scaling' must not both be given");
    std::optional<double> inner;
    if (parse_rope(f, "rope_parameters", original_context, yarn, inner)) {
      r.yarn = yarn;
      r.yarn_field = "rope_parameters";
    }
    if (inner && r.theta && *inner != *r.theta)
      f.fail("rope_parameters", "rope_theta contradicts the top-level rope_theta");
    if (inner) r.theta = inner;
  }
  return r;
}

std::string read_dtype_field(Fields& f, const std::string& fallback) {
  std::string dtype = fallback;
  for (const char* key : {"torch_dtype", "dtype"}) {
    if (!f.present(key)) {
      f.ignore(key);
      continue;
    }
    dtype = f.string(key);
    if (dtype != "bfloat16" && dtype != "float16" && dtype != "float32")
      f.fail(key, one_of(dtype, {"bfloat16", "float16", "float32"}));
  }
  return dtype;
}

}  // namespace tandem::model
