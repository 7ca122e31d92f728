#pragma once
// Reading load snapshots and placements from files (the planners themselves do no I/O).
#include <filesystem>
#include <vector>

#include "placement/expert_loads.h"
#include "placement/placement.h"

namespace tandem::placement {

// Load snapshots from a 2-D .npy [layers, experts], a 3-D .npy [snapshots, layers, experts], an
// /expert_load JSON, or a folder of `tandem engine --expert-load-dump` snapshots (in step order,
// expert_load_<step>.npy by the step's number; the cumulative one left out). Every snapshot has the
// first one's shape. Errors name the file.
std::vector<ExpertLoads> read_load_snapshots(const std::filesystem::path& path);
// One set of loads: the snapshots of `path` summed (they must share a shape).
ExpertLoads read_loads(const std::filesystem::path& path);
// A placement from Tandem's JSON or an Omni .npy pattern.
Placement read_placement(const std::filesystem::path& path);

}  // namespace tandem::placement
