#include "api/load_report.h"

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "util/error.h"
#include "util/json.h"

namespace tandem::api {
namespace {

using nlohmann::json;

int64_t count_field(const json& j, const char* key, int64_t fallback) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_number_integer() || it->get<int64_t>() < 0)
    throw Error(std::string("/load: ") + key + ": expected a non-negative integer, got " +
                it->dump());
  return it->get<int64_t>();
}

// A finite number >= 0 (0 when absent or null); `expected` words the error.
double non_negative_field(const json& j, const char* key, const char* expected) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return 0;
  if (!it->is_number() || !std::isfinite(it->get<double>()) || it->get<double>() < 0)
    throw Error(std::string("/load: ") + key + ": expected " + expected + ", got " + it->dump());
  return it->get<double>();
}

}  // namespace

bool describes_an_engine(const LoadReport& r) {
  return r.total_blocks > 0 && r.block_size > 0;
}

std::string load_target(uint64_t since_step) {
  return since_step == 0 ? "/load" : "/load?since_step=" + std::to_string(since_step);
}

uint64_t load_since_step(std::string_view target) {
  constexpr std::string_view kKey = "since_step=";
  const auto query = target.find('?');
  if (query == std::string_view::npos) return 0;
  for (size_t at = query + 1; at < target.size();) {
    const size_t end = std::min(target.find('&', at), target.size());
    const std::string_view pair = target.substr(at, end - at);
    if (pair.starts_with(kKey)) {
      uint64_t n = 0;
      const std::string_view digits = pair.substr(kKey.size());
      if (digits.empty() || digits.size() > 19) return 0;
      for (char c : digits) {
        if (c < '0' || c > '9') return 0;
        n = n * 10 + uint64_t(c - '0');
      }
      return n;
    }
    at = end + 1;
  }
  return 0;
}

std::string to_json(const LoadReport& r, uint64_t since_step) {
  json j = {{"running", r.running},
            {"waiting", r.waiting},
            {"free_blocks", r.free_blocks},
            {"total_blocks", r.total_blocks},
            {"block_size", r.block_size},
            {"tokens_in_flight", r.tokens_in_flight},
            {"kv_usage", r.kv_usage},
            {"cached_blocks", r.cached_blocks},
            {"steps", r.steps},
            {"prefill_tokens", r.prefill_tokens},
            {"max_batch_tokens", r.max_batch_tokens}};
  if (r.prefill_pairs >= 0) j["prefill_pairs"] = r.prefill_pairs;
  if (r.step_seqs > 0) {
    j["step"] = {
        {"seqs", r.step_seqs}, {"tokens", r.step_tokens}, {"running_for_s", r.step_running_for_s}};
    if (r.step_prefill_pairs >= 0) j["step"]["prefill_pairs"] = r.step_prefill_pairs;
  } else {
    j["step"] = nullptr;
  }
  json steps = json::array();
  // Past the newest step: the asker knew an earlier life of this engine, and gets every step.
  if (!r.recent_steps.empty() && since_step > r.recent_steps.back().index) since_step = 0;
  for (const auto& s : r.recent_steps) {
    if (s.index <= since_step) continue;
    json row = {s.index, s.seqs, s.tokens, s.seconds};
    if (s.prefill_pairs >= 0) row.push_back(s.prefill_pairs);
    steps.push_back(std::move(row));
  }
  j["recent_steps"] = std::move(steps);
  return j.dump();
}

LoadReport parse_load_report(std::string_view body) {
  json j;
  try {
    j = parse_untrusted_json(body);
  } catch (const Error& e) {
    throw Error(std::string("/load: expected a JSON object (") + e.what() + ")");
  }
  if (!j.is_object()) throw Error("/load: expected a JSON object");
  LoadReport r;
  r.running = count_field(j, "running", 0);
  r.waiting = count_field(j, "waiting", 0);
  r.free_blocks = count_field(j, "free_blocks", 0);
  r.total_blocks = count_field(j, "total_blocks", 0);
  r.block_size = count_field(j, "block_size", 0);
  r.tokens_in_flight = count_field(j, "tokens_in_flight", 0);
  r.kv_usage = non_negative_field(j, "kv_usage", "a non-negative number");
  r.cached_blocks = count_field(j, "cached_blocks", 0);
  r.steps = static_cast<uint64_t>(count_field(j, "steps", 0));
  r.prefill_tokens = count_field(j, "prefill_tokens", 0);
  r.prefill_pairs = count_field(j, "prefill_pairs", -1);
  r.max_batch_tokens = count_field(j, "max_batch_tokens", 0);
  if (const auto step = j.find("step"); step != j.end() && !step->is_null()) {
    if (!step->is_object()) throw Error("/load: step: expected an object or null");
    r.step_seqs = count_field(*step, "seqs", 0);
    r.step_tokens = count_field(*step, "tokens", 0);
    r.step_prefill_pairs = count_field(*step, "prefill_pairs", -1);
    r.step_running_for_s = non_negative_field(*step, "running_for_s", "non-negative seconds");
  }
  if (const auto steps = j.find("recent_steps"); steps != j.end()) {
    if (!steps->is_array()) throw Error("/load: recent_steps: expected an array");
    for (size_t i = 0; i < steps->size(); ++i) {
      const json& s = (*steps)[i];
      if (!s.is_array() || (s.size() != 4 && s.size() != 5) || !s[0].is_number_unsigned() ||
          !s[1].is_number_unsigned() || !s[2].is_number_unsigned() || !s[3].is_number() ||
          !std::isfinite(s[3].get<double>()) || s[3].get<double>() < 0 ||
          (s.size() == 5 && !s[4].is_number_unsigned()))
        throw Error("/load: recent_steps[" + std::to_string(i) +
                    "]: expected [index, seqs, tokens, seconds] or [index, seqs, tokens, "
                    "seconds, prefill_pairs], got " +
                    s.dump());
      r.recent_steps.push_back({s[0].get<uint64_t>(), s[1].get<int64_t>(), s[2].get<int64_t>(),
                                s[3].get<double>(), s.size() == 5 ? s[4].get<int64_t>() : -1});
    }
  }
  return r;
}

}  // namespace tandem::api
