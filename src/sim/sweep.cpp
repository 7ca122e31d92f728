#include "sim/sweep.h"

#include <cstdint>
#include <set>
#include <sstream>

#include "util/error.h"

namespace tandem::sim {
namespace {

constexpr size_t kMaxPoints = 1000;

int count_of(const std::string& text, const std::string& spec) {
  size_t used = 0;
  int v = 0;
  try {
    v = std::stoi(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || text.empty() || v < 0)
    throw Error("--sweep " + spec + ": '" + text + "' is not a count of engines");
  return v;
}

// A list's values, each of them there: an empty one ("1,2," or "1,,2") is refused wherever it
// is (std::getline dropped a trailing one, so "decode=1,2," passed as 1,2 while ",1,2" failed).
std::vector<std::string> values_of(const std::string& list, const std::string& spec) {
  std::vector<std::string> out;
  for (size_t from = 0;;) {
    const size_t comma = list.find(',', from);
    out.push_back(list.substr(from, comma == std::string::npos ? std::string::npos : comma - from));
    if (out.back().empty())
      throw Error("--sweep " + spec + ": an empty value in the list (a comma too many?)");
    if (comma == std::string::npos) return out;
    from = comma + 1;
  }
}

std::vector<int> counts(const std::string& values, const std::string& spec) {
  std::vector<int> out;
  const auto dots = values.find("..");
  if (dots == std::string::npos) {
    for (const auto& v : values_of(values, spec)) out.push_back(count_of(v, spec));
  } else {
    const int from = count_of(values.substr(0, dots), spec);
    std::string rest = values.substr(dots + 2);
    int step = 0;  // 0: doubling
    if (const auto slash = rest.find('/'); slash != std::string::npos) {
      step = count_of(rest.substr(slash + 1), spec);
      if (step < 1) throw Error("--sweep " + spec + ": the step must be at least 1");
      rest = rest.substr(0, slash);
    }
    const int to = count_of(rest, spec);
    if (to < from) throw Error("--sweep " + spec + ": the range descends");
    if (step == 0 && from < 1) throw Error("--sweep " + spec + ": a doubling range starts at 1");
    // int64_t: near INT_MAX, v + step or v * 2 would overflow an int (and loop forever).
    for (int64_t v = from; v <= to && out.size() <= kMaxPoints; v = step ? v + step : v * 2)
      out.push_back(static_cast<int>(v));
  }
  if (out.empty()) throw Error("--sweep " + spec + ": no values");
  return out;
}

// A value listed twice would run its points twice: refused, not deduplicated, since a repeated
// value is more likely a typo for another one than meant.
template <typename T>
void refuse_repeats(const std::vector<T>& values, const std::string& spec) {
  for (size_t i = 0; i < values.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      if (values[i] == values[j]) {
        std::ostringstream v;
        v << values[i];
        throw Error("--sweep " + spec + ": " + v.str() + " is listed twice");
      }
}

}  // namespace

std::vector<SweepPoint> sweep_points(const std::vector<std::string>& specs,
                                     const SweepPoint& base) {
  std::vector<int> prefill = {base.prefill}, decode = {base.decode};
  std::vector<std::string> policy = {base.policy};
  std::set<std::string> seen;
  for (const auto& spec : specs) {
    const auto eq = spec.find('=');
    const std::string key = spec.substr(0, eq);
    if (eq == std::string::npos || eq + 1 == spec.size())
      throw Error("--sweep " + spec + ": expected KEY=VALUES (prefill, decode or policy)");
    if (!seen.insert(key).second) throw Error("--sweep " + spec + ": " + key + " is swept twice");
    const std::string values = spec.substr(eq + 1);
    if (key == "prefill")
      refuse_repeats(prefill = counts(values, spec), spec);
    else if (key == "decode")
      refuse_repeats(decode = counts(values, spec), spec);
    else if (key == "policy")
      refuse_repeats(policy = values_of(values, spec), spec);
    else
      throw Error("--sweep " + spec + ": unknown key '" + key + "' (prefill, decode or policy)");
  }
  if (prefill.size() * decode.size() * policy.size() > kMaxPoints)
    throw Error("--sweep: more than " + std::to_string(kMaxPoints) + " points");
  std::vector<SweepPoint> out;
  for (int p : prefill)
    for (int d : decode)
      for (const auto& name : policy) out.push_back({p, d, name});
  return out;
}

}  // namespace tandem::sim
