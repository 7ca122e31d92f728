#include "placement/expert_loads.h"

#include <cmath>

#include <nlohmann/json.hpp>

#include "util/error.h"
#include "util/json.h"

namespace tandem::placement {

void validate(const ExpertLoads& loads, const std::string& source) {
  if (loads.layers <= 0 || loads.experts <= 0)
    throw Error(source + ": expert loads need at least one layer and one expert (got [" +
                std::to_string(loads.layers) + ", " + std::to_string(loads.experts) + "])");
  if (int64_t(loads.values.size()) != loads.layers * loads.experts)
    throw Error(source + ": expert loads hold " + std::to_string(loads.values.size()) +
                " values, [layers, experts] needs " + std::to_string(loads.layers * loads.experts));
  // The planners add loads up (per rank, per layer, over layers): finite values whose sum is not
  // would turn every comparison of those sums into inf against inf.
  double total = 0;
  for (int64_t l = 0; l < loads.layers; ++l) {
    for (int64_t e = 0; e < loads.experts; ++e) {
      const double v = loads.at(l, e);
      if (!std::isfinite(v) || v < 0)
        throw Error(source + ": load of layer " + std::to_string(l) + ", expert " +
                    std::to_string(e) + " is " + std::to_string(v) +
                    " (want a non-negative token count)");
      total += v;
    }
    if (!std::isfinite(total))
      throw Error(source + ": expert loads up to layer " + std::to_string(l) +
                  " sum past the largest double (want token counts)");
  }
}

ExpertLoads loads_from_npy(const NpyArray& array, const std::string& source) {
  if (array.shape.size() != 2)
    throw Error(source + ": expert loads must be a 2-D array [layers, experts], got " +
                std::to_string(array.shape.size()) + " dimensions");
  ExpertLoads loads{array.shape[0], array.shape[1], {}};
  loads.values.assign(array.values.begin(), array.values.end());
  validate(loads, source);
  return loads;
}

ExpertLoads loads_from_json(const std::string& text, const std::string& source) {
  const nlohmann::json j = parse_json_document(text, source);
  const nlohmann::json* rows = &j;
  if (j.is_object()) {
    // /expert_load and the window dumps hold both arrays and are planned from the window; the
    // cumulative dump (expert_load_cumulative.json) says "kind": "cumulative".
    std::string key = j.contains("window") ? "window" : "cumulative";
    if (j.contains("kind")) {
      const nlohmann::json& kind = j["kind"];
      if (!kind.is_string() || (kind != "window" && kind != "cumulative"))
        throw Error(source + ": \"kind\" is " + kind.dump() +
                    ", want \"window\" or \"cumulative\"");
      key = kind.get<std::string>();
    }
    if (!j.contains(key)) throw Error(source + ": expert load JSON needs a \"" + key + "\" array");
    rows = &j[key];
  }
  if (!rows->is_array() || rows->empty() || !(*rows)[0].is_array())
    throw Error(source + ": expert loads must be an array of per-layer arrays");
  ExpertLoads loads{int64_t(rows->size()), int64_t((*rows)[0].size()), {}};
  for (size_t l = 0; l < rows->size(); ++l) {
    const nlohmann::json& row = (*rows)[l];
    if (!row.is_array() || int64_t(row.size()) != loads.experts)
      throw Error(source + ": layer " + std::to_string(l) + " of the expert loads has " +
                  std::to_string(row.is_array() ? row.size() : 0) + " experts, layer 0 has " +
                  std::to_string(loads.experts));
    for (size_t e = 0; e < row.size(); ++e) {
      if (!row[e].is_number())
        throw Error(source + ": load of layer " + std::to_string(l) + ", expert " +
                    std::to_string(e) + " is not a number");
      loads.values.push_back(row[e].get<double>());
    }
  }
  validate(loads, source);
  return loads;
}

}  // namespace tandem::placement
