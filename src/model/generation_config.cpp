#include "model/generation_config.h"

#include <algorithm>
#include <iterator>

#include "model/config_json.h"
#include "util/error.h"
#include "util/file.h"
#include "util/json.h"

namespace tandem::model {
namespace {

using json = nlohmann::json;

std::optional<int64_t> as_integer(std::optional<double> v) {
  return v ? std::optional<int64_t>(static_cast<int64_t>(*v)) : std::nullopt;
}

// The sampling keys, each with transformers' default (none: it has none), which vLLM's reading
// drops, and where it goes (none: the key is unset).
struct SamplingKey {
  const char* name;
  bool integer;
  std::optional<double> transformers_default;
  void (*set)(GenerationConfig&, std::optional<double>);
};
constexpr SamplingKey kSamplingKeys[] = {
    {"repetition_penalty", false, 1.0,
     [](GenerationConfig& c, std::optional<double> v) { c.repetition_penalty = v; }},
    {"temperature", false, 1.0,
     [](GenerationConfig& c, std::optional<double> v) { c.temperature = v; }},
    {"top_k", true, 50.0,
     [](GenerationConfig& c, std::optional<double> v) { c.top_k = as_integer(v); }},
    {"top_p", false, 1.0, [](GenerationConfig& c, std::optional<double> v) { c.top_p = v; }},
    {"min_p", false, std::nullopt,
     [](GenerationConfig& c, std::optional<double> v) { c.min_p = v; }},
    {"max_new_tokens", true, std::nullopt,
     [](GenerationConfig& c, std::optional<double> v) { c.max_new_tokens = as_integer(v); }},
};

// The key's value, or none when absent or null. `from_file`: transformers' defaults are dropped.
std::optional<double> sampling_value(Fields& f, const SamplingKey& k, bool from_file) {
  const json* v = f.get(k.name);
  if (!v) return std::nullopt;
  const double value =
      k.integer ? static_cast<double>(f.as_integer(k.name, *v)) : f.as_number(k.name, *v);
  if (k.integer) f.at_most(k.name, static_cast<int64_t>(value), int64_t{1} << 40);
  if (from_file && k.transformers_default && value == *k.transformers_default) return std::nullopt;
  return value;
}

std::vector<int32_t> eos_ids_of(Fields& f) {
  const json* v = f.get("eos_token_id");
  std::vector<int32_t> ids;
  if (!v) return ids;
  auto add = [&](const json& e) {
    const int64_t id = f.as_integer("eos_token_id", e);
    if (id < 0) f.fail("eos_token_id", "must hold token ids >= 0, got " + std::to_string(id));
    f.at_most("eos_token_id", id, kMaxDimension);
    ids.push_back(static_cast<int32_t>(id));
  };
  if (v->is_array()) {
    if (v->size() > 1024) f.fail("eos_token_id", "lists more than 1024 ids");
    for (const json& e : *v) add(e);
  } else {
    add(*v);
  }
  return ids;
}

}  // namespace

GenerationConfig read_generation_config(const std::filesystem::path& dir) {
  GenerationConfig c;
  std::filesystem::path path = dir / "generation_config.json";
  if (!std::filesystem::exists(path)) path = dir / "config.json";
  if (!std::filesystem::exists(path)) return c;
  const json doc =
      parse_json_document(read_regular_file(path, kMaxModelConfigBytes), path.string());
  c.origin = path.string();
  if (!doc.is_object()) throw Error(c.origin + ": expected a JSON object");
  auto f = Fields::lenient(doc, c.origin);
  for (const SamplingKey& k : kSamplingKeys)
    if (auto v = sampling_value(f, k, true)) k.set(c, v);
  c.eos_token_ids = eos_ids_of(f);
  return c;  // other fields (bos_token_id, do_sample, a model's config) are not ours to judge
}

void override_generation_config(GenerationConfig& config, const json& overrides,
                                const std::string& origin) {
  if (!overrides.is_object()) throw Error(origin + ": expected a JSON object");
  auto f = Fields::lenient(overrides, origin);
  for (const SamplingKey& k : kSamplingKeys)
    // As vLLM, which updates the config with the overrides and keeps what is not None: a null
    // unsets the key.
    if (overrides.contains(k.name)) k.set(config, sampling_value(f, k, false));
  for (const auto& [key, value] : overrides.items())
    if (std::none_of(std::begin(kSamplingKeys), std::end(kSamplingKeys),
                     [&](const SamplingKey& k) { return key == k.name; }))
      f.fail(key,
             "is not a generation setting Tandem applies (repetition_penalty, temperature, "
             "top_k, top_p, min_p, max_new_tokens)");
}

}  // namespace tandem::model
