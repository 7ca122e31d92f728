#include "placement/placement_format.h"

#include <algorithm>

#include "util/error.h"
#include "util/json.h"

namespace tandem::placement {

nlohmann::json placement_to_json(const Placement& p) {
  nlohmann::json j = {{"format", "tandem-placement-v1"},
                      {"ranks", p.ranks},
                      {"experts", p.experts},
                      {"layers", p.num_layers()}};
  auto& rank_slots = j["rank_slots"] = nlohmann::json::array();
  auto& phy2log = j["phy2log"] = nlohmann::json::array();
  auto& log2phy = j["log2phy"] = nlohmann::json::array();
  auto& logcnt = j["logcnt"] = nlohmann::json::array();
  // One width over layers, as EPLB's log2phy tensor; phy2log stays ragged under uneven
  // redundancy (each layer lists its own slots).
  const int32_t width = p.max_copies();
  for (int64_t l = 0; l < p.num_layers(); ++l) {
    nlohmann::json slots = nlohmann::json::array();
    for (const auto& r : p.layers[l]) slots.push_back(r.size());
    rank_slots.push_back(std::move(slots));
    phy2log.push_back(p.phy2log(l));
    log2phy.push_back(p.log2phy(l, width));
    logcnt.push_back(p.logcnt(l));
  }
  return j;
}

namespace {
constexpr int64_t kMaxRanks = 1 << 16, kMaxExperts = 1 << 16;
constexpr uint64_t kMaxRankLayers = uint64_t(1) << 22;
// EPLB's log2phy pads every expert of every layer to the most copies of any expert: a file of a
// few MB whose phy2log gives one expert millions of copies would ask for hundreds of GB there
// (and in placement_to_json). DeepSeek-V3 with a copy of every expert on each of 256 ranks
// needs 58 x 256 x 256 (~3.8M) entries.
constexpr uint64_t kMaxLog2phyEntries = uint64_t(1) << 24;

// Throws unless the padded log2phy fits kMaxLog2phyEntries, naming the layer and expert whose
// copies set its width.
void check_log2phy_size(const Placement& p, const std::string& source) {
  int64_t widest_layer = 0, widest_expert = 0;
  int32_t width = 0;
  for (int64_t l = 0; l < p.num_layers(); ++l) {
    const std::vector<int32_t> count = p.logcnt(l);
    for (int64_t e = 0; e < p.experts; ++e)
      if (count[e] > width) {
        width = count[e];
        widest_layer = l;
        widest_expert = e;
      }
  }
  const uint64_t entries = uint64_t(p.num_layers()) * uint64_t(p.experts) * uint64_t(width);
  if (entries > kMaxLog2phyEntries)
    throw Error(source + ": layer " + std::to_string(widest_layer) + " of \"phy2log\" holds " +
                std::to_string(width) + " copies of expert " + std::to_string(widest_expert) +
                ": \"log2phy\", that many slots for each of " + std::to_string(p.experts) +
                " experts in " + std::to_string(p.num_layers()) + " layers, would hold " +
                std::to_string(entries) + " entries, more than the " +
                std::to_string(kMaxLog2phyEntries) + " a placement may hold");
}

// "layers", "logcnt" and "log2phy" say again what phy2log says; a tool that reads one of them
// (EPLB's own code reads log2phy and logcnt) must not find another placement than ours. EPLB pads
// log2phy with -1 to its own width and may list an expert's slots in another order. Each layer is
// checked in time linear in its slots and experts: no padded table is built.
void check_against_phy2log(const nlohmann::json& j, const Placement& p, const std::string& source) {
  if (j.contains("layers") &&
      (!j["layers"].is_number_integer() || j["layers"].get<int64_t>() != p.num_layers()))
    throw Error(source + ": \"layers\" is " + j["layers"].dump() + " but \"phy2log\" has " +
                std::to_string(p.num_layers()) + " layers");
  for (const char* key : {"logcnt", "log2phy"})
    if (j.contains(key) && (!j[key].is_array() || j[key].size() != size_t(p.num_layers())))
      throw Error(source + ": \"" + key + "\" must have one entry per layer of \"phy2log\"");
  for (int64_t l = 0; l < p.num_layers(); ++l) {
    const std::string where = source + ": layer " + std::to_string(l);
    const std::vector<int32_t> count = p.logcnt(l);
    if (j.contains("logcnt")) {
      const nlohmann::json want = count;
      if (j["logcnt"][l] != want)
        throw Error(where + " of \"logcnt\" is not the copies \"phy2log\" holds per expert (" +
                    want.dump() + ")");
    }
    if (!j.contains("log2phy")) continue;
    const nlohmann::json& rows = j["log2phy"][l];
    if (!rows.is_array() || rows.size() != size_t(p.experts))
      throw Error(where + " of \"log2phy\" needs one list of slots per expert (" +
                  std::to_string(p.experts) + ")");
    // Every expert's slots in slot order, one after another: expert e's from first[e].
    std::vector<int64_t> first(size_t(p.experts) + 1, 0);
    for (int64_t e = 0; e < p.experts; ++e) first[e + 1] = first[e] + count[e];
    std::vector<int64_t> by_expert(size_t(first.back()));
    std::vector<int64_t> next(first.begin(), first.end() - 1);
    const std::vector<int32_t> phy2log = p.phy2log(l);
    for (size_t s = 0; s < phy2log.size(); ++s) by_expert[next[phy2log[s]]++] = int64_t(s);
    for (int64_t e = 0; e < p.experts; ++e) {
      const std::vector<int64_t> slots(by_expert.begin() + first[e],
                                       by_expert.begin() + first[e + 1]);
      std::vector<int64_t> got;
      bool ok = rows[e].is_array();
      for (size_t k = 0; ok && k < rows[e].size(); ++k) {
        ok = rows[e][k].is_number_integer();
        if (ok && rows[e][k].get<int64_t>() != -1) got.push_back(rows[e][k].get<int64_t>());
      }
      std::sort(got.begin(), got.end());
      if (!ok || got != slots)
        throw Error(where + " of \"log2phy\", expert " + std::to_string(e) + ": lists " +
                    rows[e].dump() + ", but \"phy2log\" holds its copies in slots " +
                    nlohmann::json(slots).dump());
    }
  }
}
}  // namespace

Placement placement_from_json(const std::string& text, const std::string& source) {
  const nlohmann::json j = parse_json_document(text, source);
  const auto need = [&](const char* key) -> const nlohmann::json& {
    if (!j.is_object() || !j.contains(key))
      throw Error(source + ": placement has no \"" + key + "\"");
    return j[key];
  };
  const nlohmann::json& ranks = need("ranks");
  const nlohmann::json& experts = need("experts");
  const nlohmann::json& phy2log = need("phy2log");
  // Bounds far above any deployment (DeepSeek-V3: 58 layers, 256 experts, hundreds of ranks)
  // keep a hostile file from asking for gigabytes of empty rank lists.
  if (!ranks.is_number_integer() || ranks.get<int64_t>() <= 0 || ranks.get<int64_t>() > kMaxRanks)
    throw Error(source + ": \"ranks\" must be an integer in [1, " + std::to_string(kMaxRanks) +
                "]");
  if (!experts.is_number_integer() || experts.get<int64_t>() <= 0 ||
      experts.get<int64_t>() > kMaxExperts)
    throw Error(source + ": \"experts\" must be an integer in [1, " + std::to_string(kMaxExperts) +
                "]");
  if (!phy2log.is_array() || phy2log.empty())
    throw Error(source + ": \"phy2log\" must be a non-empty array of per-layer arrays");
  if (phy2log.size() * ranks.get<uint64_t>() > kMaxRankLayers)
    throw Error(source + ": " + std::to_string(phy2log.size()) + " layers of " +
                std::to_string(ranks.get<int64_t>()) + " ranks is more than a placement may hold");
  Placement p{ranks.get<int>(), experts.get<int64_t>(), {}};
  const nlohmann::json* rank_slots = j.contains("rank_slots") ? &j["rank_slots"] : nullptr;
  if (rank_slots && (!rank_slots->is_array() || rank_slots->size() != phy2log.size()))
    throw Error(source + ": \"rank_slots\" must have one entry per layer of \"phy2log\"");
  for (size_t l = 0; l < phy2log.size(); ++l) {
    const std::string where = source + ": layer " + std::to_string(l);
    const nlohmann::json& row = phy2log[l];
    if (!row.is_array()) throw Error(where + " of \"phy2log\" is not an array");
    if (row.size() < size_t(p.experts))
      throw Error(where + " has " + std::to_string(row.size()) + " slots for " +
                  std::to_string(p.experts) + " experts (every expert needs one)");
    std::vector<int64_t> slots;
    if (rank_slots) {
      const nlohmann::json& s = (*rank_slots)[l];
      if (!s.is_array() || int64_t(s.size()) != p.ranks)
        throw Error(where + " of \"rank_slots\" needs " + std::to_string(p.ranks) + " counts");
      for (const auto& v : s) {
        if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<uint64_t>() > row.size())
          throw Error(where + " of \"rank_slots\" holds a count that is not an integer in [0, " +
                      std::to_string(row.size()) + "]");
        slots.push_back(v.get<int64_t>());
      }
    } else {
      if (row.size() % size_t(p.ranks) != 0)
        throw Error(where + ": " + std::to_string(row.size()) + " slots do not divide over " +
                    std::to_string(p.ranks) + " ranks and no \"rank_slots\" say how they split");
      slots.assign(p.ranks, int64_t(row.size()) / p.ranks);
    }
    int64_t total = 0;
    for (int64_t s : slots) total += s;
    if (total != int64_t(row.size()))
      throw Error(where + ": \"rank_slots\" add up to " + std::to_string(total) +
                  " but \"phy2log\" has " + std::to_string(row.size()) + " slots");
    std::vector<std::vector<int32_t>> layer(p.ranks);
    size_t i = 0;
    for (int r = 0; r < p.ranks; ++r)
      for (int64_t k = 0; k < slots[r]; ++k, ++i) {
        if (!row[i].is_number_integer())
          throw Error(where + ", slot " + std::to_string(i) +
                      " of \"phy2log\" is not an expert id");
        const int64_t e = row[i].get<int64_t>();
        if (e < 0 || e >= p.experts)
          throw Error(where + ", slot " + std::to_string(i) + ": expert id " + std::to_string(e) +
                      " is outside [0, " + std::to_string(p.experts) + ")");
        layer[r].push_back(int32_t(e));
      }
    p.layers.push_back(std::move(layer));
  }
  try {
    validate(p, kServable);
  } catch (const Error& e) {
    throw Error(source + ": " + e.what());
  }
  check_log2phy_size(p, source);
  check_against_phy2log(j, p, source);
  return p;
}

NpyArray placement_to_omni_pattern(const Placement& p) {
  const int64_t layers = p.num_layers();
  NpyArray a{{p.ranks, layers, p.experts},
             std::vector<int64_t>(size_t(p.ranks) * layers * p.experts, 0),
             "<i4"};
  for (int64_t l = 0; l < layers; ++l)
    for (int r = 0; r < p.ranks; ++r)
      for (int32_t e : p.layers[l][r]) {
        int64_t& cell = a.values[(size_t(r) * layers + l) * p.experts + e];
        if (cell)
          throw Error("placement layer " + std::to_string(l) + ", rank " + std::to_string(r) +
                      " holds two copies of expert " + std::to_string(e) +
                      ", which an Omni pattern cannot express");
        cell = 1;
      }
  return a;
}

Placement placement_from_omni_pattern(const NpyArray& a, const std::string& source) {
  if (a.shape.size() != 3)
    throw Error(source +
                ": an Omni placement pattern is a 3-D array [ranks, layers, experts], got " +
                std::to_string(a.shape.size()) + " dimensions");
  const int64_t ranks = a.shape[0], layers = a.shape[1], experts = a.shape[2];
  if (ranks <= 0 || layers <= 0 || experts <= 0)
    throw Error(source + ": an Omni placement pattern needs ranks, layers and experts");
  if (ranks > kMaxRanks || experts > kMaxExperts || uint64_t(ranks * layers) > kMaxRankLayers)
    throw Error(source + ": a pattern of " + std::to_string(ranks) + " ranks, " +
                std::to_string(layers) + " layers and " + std::to_string(experts) +
                " experts is more than a placement may hold");
  Placement p{int(ranks), experts,
              std::vector<std::vector<std::vector<int32_t>>>(
                  layers, std::vector<std::vector<int32_t>>(ranks))};
  for (int64_t r = 0; r < ranks; ++r)
    for (int64_t l = 0; l < layers; ++l)
      for (int64_t e = 0; e < experts; ++e) {
        const int64_t v = a.values[(r * layers + l) * experts + e];
        if (v != 0 && v != 1)
          throw Error(source + ": rank " + std::to_string(r) + ", layer " + std::to_string(l) +
                      ", expert " + std::to_string(e) + " holds " + std::to_string(v) +
                      " (an Omni pattern holds 0 or 1)");
        if (v) p.layers[l][r].push_back(int32_t(e));
      }
  try {
    validate(p, Constraints{.distinct_on_rank = true, .equal_rank_memory = false});
  } catch (const Error& e) {
    throw Error(source + ": " + e.what());
  }
  return p;
}

}  // namespace tandem::placement
