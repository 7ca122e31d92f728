#include "placement/files.h"

#include <algorithm>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "placement/placement_format.h"
#include "util/error.h"
#include "util/file.h"
#include "util/json.h"
#include "util/npy.h"

namespace tandem::placement {
namespace {

namespace fs = std::filesystem;

bool is_npy(const fs::path& p) {
  return p.extension() == ".npy";
}

// Snapshot order: `--expert-load-dump` names files expert_load_%08llu.npy by step, and steps
// past 99999999 have more digits, so by name step 100000000 would come before 99999998. A step
// compares by its digits without leading zeros, shorter first; other names follow by name.
bool before_in_steps(const fs::path& a, const fs::path& b) {
  const auto step = [](const fs::path& p) -> std::optional<std::string> {
    static const std::string prefix = "expert_load_";
    const std::string stem = p.stem().string();
    if (stem.size() <= prefix.size() || stem.compare(0, prefix.size(), prefix) != 0) return {};
    std::string digits = stem.substr(prefix.size());
    if (digits.find_first_not_of("0123456789") != std::string::npos) return {};
    digits.erase(0, std::min(digits.find_first_not_of('0'), digits.size() - 1));
    return digits;
  };
  const auto sa = step(a), sb = step(b);
  if (sa && sb && *sa != *sb) return sa->size() != sb->size() ? sa->size() < sb->size() : *sa < *sb;
  if (sa.has_value() != sb.has_value()) return sa.has_value();
  return a < b;
}

// 0/1 only, every expert held in every layer (placement_from_omni_pattern's checks).
bool reads_as_servable_pattern(const NpyArray& a) {
  try {
    placement_from_omni_pattern(a, "");
    return true;
  } catch (const Error&) {
    return false;
  }
}

}  // namespace

// Load snapshots from a 2-D .npy, a 3-D .npy [snapshots, layers, experts], an /expert_load JSON,
// or a folder of --expert-load-dump snapshots (the cumulative one left out).
std::vector<ExpertLoads> read_load_snapshots(const fs::path& path) {
  std::vector<ExpertLoads> out;
  if (fs::is_directory(path)) {
    std::vector<fs::path> files;
    for (const auto& entry : fs::directory_iterator(path))
      if (is_npy(entry.path()) && entry.path().stem() != "expert_load_cumulative")
        files.push_back(entry.path());
    std::sort(files.begin(), files.end(), before_in_steps);
    if (files.empty()) throw Error(path.string() + ": no .npy load snapshots in this folder");
    for (const auto& f : files) {
      out.push_back(loads_from_npy(read_npy(f), f.string()));
      // Every user of the snapshots compares or sums them layer by layer, expert by expert.
      if (out.back().layers != out[0].layers || out.back().experts != out[0].experts)
        throw Error(f.string() + ": a load snapshot of " + std::to_string(out.back().layers) +
                    " layers x " + std::to_string(out.back().experts) + " experts, but " +
                    files[0].string() + " has " + std::to_string(out[0].layers) + " x " +
                    std::to_string(out[0].experts));
    }
    return out;
  }
  if (!is_npy(path)) {
    out.push_back(loads_from_json(read_file(path), path.string()));
    return out;
  }
  const NpyArray a = read_npy(path);
  if (a.shape.size() != 3) {
    out.push_back(loads_from_npy(a, path.string()));
    return out;
  }
  // An Omni placement pattern (`plan --omni-out`) is a 3-D int32 array of 0/1 too: read as loads
  // it would plan for one token per expert held, silently. Int32 0/1 loads are real too (vLLM's
  // EPLB expert_load_window at concurrency 1, or an idle one): only an array that also reads as a
  // servable pattern (every expert held in every layer) is refused.
  if (a.dtype == "<i4" && reads_as_servable_pattern(a))
    throw Error(path.string() + ": an int32 array of 0/1 [" + std::to_string(a.shape[0]) + ", " +
                std::to_string(a.shape[1]) + ", " + std::to_string(a.shape[2]) +
                "], an Omni placement pattern ([ranks, layers, experts], as --omni-out writes), "
                "not loads: expected routed tokens, a .npy [layers, experts] (as "
                "--expert-load-dump writes) or [snapshots, layers, experts] (give a placement "
                "as --current); if these are routed-token counts, save them as int64");
  const int64_t layers = a.shape[1], experts = a.shape[2], per = layers * experts;
  for (int64_t t = 0; t < a.shape[0]; ++t) {
    NpyArray one{{layers, experts},
                 std::vector<int64_t>(a.values.begin() + t * per, a.values.begin() + (t + 1) * per),
                 a.dtype};
    out.push_back(loads_from_npy(one, path.string() + " [" + std::to_string(t) + "]"));
  }
  return out;
}

ExpertLoads read_loads(const fs::path& path) {
  const std::vector<ExpertLoads> all = read_load_snapshots(path);
  if (all.empty()) throw Error(path.string() + ": holds no load snapshot");
  if (all.size() == 1) return all[0];
  // Several snapshots: plan for their sum.
  ExpertLoads sum = all[0];
  for (size_t i = 1; i < all.size(); ++i) {
    if (all[i].layers != sum.layers || all[i].experts != sum.experts)  // read_load_snapshots
      throw Error(path.string() + ": snapshot " + std::to_string(i) + " has another shape");
    for (size_t k = 0; k < sum.values.size(); ++k) sum.values[k] += all[i].values[k];
  }
  validate(sum, path.string() + " (its snapshots summed)");
  return sum;
}

Placement read_placement(const fs::path& path) {
  if (is_npy(path)) return placement_from_omni_pattern(read_npy(path), path.string());
  const std::string text = read_file(path);
  // An engine's GET /admin/expert_placement wraps its placement in "placement", beside the
  // ranks' work and the remap status: the placement is read from there.
  const nlohmann::json j = parse_json_document(text, path.string());
  if (j.is_object() && !j.contains("phy2log") && j.contains("placement") &&
      j["placement"].is_object())
    return placement_from_json(j["placement"].dump(), path.string() + " (its \"placement\")");
  return placement_from_json(text, path.string());
}

}  // namespace tandem::placement
