#include "api/load_report.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <random>

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

const std::string& this_process_instance() {
  static const std::string instance = [] {
    // Drawn, not derived from the clock or the pid: engines started together on several hosts
    // (or in containers, where each has pid 1) must not share one.
    std::random_device device;
    const uint64_t n = (uint64_t(device()) << 32) ^ uint64_t(device());
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(n));
    return std::string(hex);
  }();
  return instance;
}

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

namespace {

// The /load body is written directly: an engine answers a poll every 100 ms per gateway, and a
// cluster simulator answers 48 engines' (a document of maps and strings cost more than the rest
// of the answer).
class ReportWriter {
 public:
  ReportWriter() { out_.reserve(512); }
  void raw(std::string_view s) { out_ += s; }
  void key(std::string_view k) {
    out_ += '"';
    out_ += k;
    out_ += "\":";
  }
  template <class Int>
  void integer(Int v) {
    char buf[24];
    out_.append(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);
  }
  void number(double v) {
    if (!std::isfinite(v)) {
      out_ += "null";  // as nlohmann writes it; the reader refuses it where a number is needed
      return;
    }
    char buf[32];
    out_.append(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);
  }
  template <class Int>
  void field(std::string_view k, Int v) {
    key(k);
    integer(v);
    out_ += ',';
  }
  void string(const std::string& s) { out_ += json(s).dump(); }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

}  // namespace

std::string to_json(const LoadReport& r, uint64_t since_step) {
  ReportWriter w;
  w.raw("{");
  if (!r.instance.empty()) {
    w.key("instance");
    w.string(r.instance);
    w.raw(",");
  }
  w.field("running", r.running);
  w.field("waiting", r.waiting);
  w.field("free_blocks", r.free_blocks);
  w.field("total_blocks", r.total_blocks);
  w.field("block_size", r.block_size);
  w.field("tokens_in_flight", r.tokens_in_flight);
  w.key("kv_usage");
  w.number(r.kv_usage);
  w.raw(",");
  w.field("cached_blocks", r.cached_blocks);
  w.field("steps", r.steps);
  w.field("prefill_tokens", r.prefill_tokens);
  w.field("max_batch_tokens", r.max_batch_tokens);
  if (r.schedules_by_priority) w.raw("\"scheduling_policy\":\"priority\",");
  if (r.prefill_pairs >= 0) w.field("prefill_pairs", r.prefill_pairs);
  w.key("step");
  if (r.step_seqs > 0) {
    w.raw("{");
    w.field("seqs", r.step_seqs);
    w.field("tokens", r.step_tokens);
    if (r.step_prefill_pairs >= 0) w.field("prefill_pairs", r.step_prefill_pairs);
    w.key("running_for_s");
    w.number(r.step_running_for_s);
    w.raw("}");
  } else {
    w.raw("null");
  }
  w.raw(",");
  w.key("recent_steps");
  w.raw("[");
  // Past the newest step: the asker knew an earlier life of this engine, and gets every step.
  if (!r.recent_steps.empty() && since_step > r.recent_steps.back().index) since_step = 0;
  bool first = true;
  for (const auto& s : r.recent_steps) {
    if (s.index <= since_step) continue;
    w.raw(first ? "[" : ",[");
    first = false;
    w.integer(s.index);
    w.raw(",");
    w.integer(s.seqs);
    w.raw(",");
    w.integer(s.tokens);
    w.raw(",");
    w.number(s.seconds);
    if (s.prefill_pairs >= 0) {
      w.raw(",");
      w.integer(s.prefill_pairs);
    }
    w.raw("]");
  }
  w.raw("]}");
  return w.take();
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
  if (const auto instance = j.find("instance"); instance != j.end() && !instance->is_null()) {
    if (!instance->is_string())
      throw Error("/load: instance: expected a string, got " + instance->dump());
    r.instance = instance->get<std::string>();
  }
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
  if (const auto p = j.find("scheduling_policy"); p != j.end()) {
    if (!p->is_string()) throw Error("/load: scheduling_policy: expected a string");
    r.schedules_by_priority = *p == "priority";
  }
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
