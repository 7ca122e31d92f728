#pragma once
// The two files a placement is exchanged as: Tandem's JSON (EPLB's phy2log/log2phy/logcnt per
// layer plus each rank's slot count) and Omni-Infer's pattern, a 0/1 array [ranks, layers,
// experts] (1 = the expert is deployed on that rank). Conversions only; callers do the I/O.
#include <string>

#include <nlohmann/json.hpp>

#include "placement/placement.h"
#include "util/npy.h"

namespace tandem::placement {

nlohmann::json placement_to_json(const Placement& placement);
// Throws tandem::Error naming `source` and the field at fault; the result is validated, and
// "layers", "logcnt" and "log2phy", where present, must say what "phy2log" says. Copies are
// bounded: log2phy, padded to the most copies of any expert, may hold at most 2^24 entries.
Placement placement_from_json(const std::string& text, const std::string& source);

// Shape {ranks, layers, experts}, values 0/1. A rank holding two copies of one expert cannot be
// expressed and throws.
NpyArray placement_to_omni_pattern(const Placement& placement);
Placement placement_from_omni_pattern(const NpyArray& array, const std::string& source);

}  // namespace tandem::placement
