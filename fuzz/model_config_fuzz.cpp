// Fuzzes a model's config.json as ModelConfig::load reads it (model/config.h): nlohmann's parser,
// then ModelConfig::parse, then the derived values the engine computes from it and the
// round trip through to_json. The documented errors: tandem::Error (a bad field) and, from the
// parser, nlohmann::json::exception (load turns it into a tandem::Error); anything else escaping
// is a finding.
#include <cstddef>
#include <cstdint>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(data, data + size);
  } catch (const nlohmann::json::exception&) {
    return 0;  // parse_error, or out_of_range for a number too large (load catches both)
  }
  try {
    const auto config = tandem::model::ModelConfig::parse(doc, "config.json");
    (void)config.softmax_scale();
    for (int64_t layer = 0; layer < config.num_hidden_layers && layer < 64; ++layer)
      (void)config.is_moe_layer(layer);
    const auto again = tandem::model::ModelConfig::parse(config.to_json(), "config.json");
    if (!(again == config)) __builtin_trap();  // the documented round trip
  } catch (const tandem::Error&) {
  }
  return 0;
}
