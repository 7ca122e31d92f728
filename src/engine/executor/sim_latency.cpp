#include "engine/executor/sim_latency.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>

#include <nlohmann/json.hpp>

#include "util/error.h"
#include "util/file.h"
#include "util/json.h"

namespace tandem::engine {
namespace {

constexpr size_t kNumParams = 6;

// The parameters in formula order, with their JSON names. The order matters to the fit: when two
// features are collinear the earlier one takes the cost.
struct ParamField {
  const char* name;
  double SimLatencyParams::*member;
};
constexpr std::array<ParamField, kNumParams> kFields = {{
    {"step_s", &SimLatencyParams::step_s},
    {"prefill_token_s", &SimLatencyParams::prefill_token_s},
    {"prefill_pair_s", &SimLatencyParams::prefill_pair_s},
    {"decode_token_s", &SimLatencyParams::decode_token_s},
    {"decode_seq_s", &SimLatencyParams::decode_seq_s},
    {"decode_pair_s", &SimLatencyParams::decode_pair_s},
}};

// Features in the order of kFields; all zero for an empty step (no fixed cost either).
std::array<double, kNumParams> feature_vector(const StepShape& shape) {
  const StepFeatures f = step_features(shape);
  const bool empty = shape.prefills.empty() && shape.decode_seqs == 0;
  return {empty ? 0.0 : 1.0, f.prefill_tokens, f.prefill_pairs,
          f.decode_tokens,   f.decode_seqs,    f.decode_pairs};
}

// ---------------------------------------------------------------------------------------------
// Presets. Each is one GPU (one attention-DP rank) of the deployment its figures come from.
// References: shared/reference/data-and-methods.md §5 (table "Production and benchmark
// throughput"), which quotes DeepSeek's day-6 note (open-infra-index, 202502OpenSourceWeek/
// day_6_one_more_thing_deepseekV3R1_inference_system_overview.md) and SGLang's large-scale-EP
// blog (lm-sys.github.io blog/2025-05-05-large-scale-ep.md, "Overall Throughput" tables, where
// the "DeepSeek Profile" figures are SGLang's estimates from deepseek-ai/profile-data);
// shared/reference/kernels-engine.md (FlashMLA figures, MLA FLOP count); the H20 figures are from
// SGLang/Ant Group, "Best Practices for Serving DeepSeek-R1 on H20-96G" (lm-sys.github.io
// blog/2025-09-19-sglang-ant-group.md). The tests in tests/engine/sim_latency_test.cpp check that
// each preset reproduces the figures below.
//
// Shared constants. MLA attention per (query, key) pair in the absorbed (MQA) decode form:
// 61 layers x 2 x 128 heads x (576 + 512) = 16.99 MFLOP (kernels-engine.md: FLOPs =
// 2·h·s_q·ctx·(576 + 512) per layer). KV bytes per cached token: 70,272 B in BF16
// (data-and-methods.md §5).

// deepseek-v3-h800: DeepSeek-V3/R1 on H800, FP8 GEMMs, BF16 MLA, prefill EP32, decode EP128-144.
//
// decode_pair_s = 25.7 ns: 16.99 MFLOP per pair at FlashMLA's 660 TFLOPS compute-bound H800
//   figure (kernels-engine.md); the memory bound, 70,272 B at FlashMLA's 3,000 GB/s, is 23.4 ns,
//   so at one query per sequence decode attention is (just) compute-bound.
// step_s and decode_token_s from two DeepSeek anchors, one token per sequence per step (if
//   production used MTP these are the effective per-token costs a user sees):
//   (a) "DeepSeek Profile" decode: 128 requests/GPU, KV length 4,096, 18,598 tok/s per node
//       = 2,324.75 tok/s/GPU, i.e. a 55.06 ms step;
//   (b) day-6 production: 14.8k tok/s per node = 1,850 tok/s/GPU at 20-22 tok/s per user
//       (21 taken: a 47.62 ms step) with average KV length 4,989, i.e. 1,850/21 = 88.1
//       sequences/GPU.
//   Subtracting attention (13.47 ms and 11.30 ms) leaves 41.59 ms at 128 sequences and
//   36.32 ms at 88.1: 0.1318 ms per token and a 24.7 ms fixed step.
// prefill_token_s and prefill_pair_s: the level from "DeepSeek Profile" prefill, 16,384 tokens
//   per GPU of 4,096-token prompts (no cache) at 62,713 tok/s per node = 7,839 tok/s/GPU, i.e.
//   a 2.090 s step; the split between per-token and attention cost from the shape of SGLang's
//   EP32 prefill throughput on H100 (same compute as H800) for 1K/2K/4K prompts, 57,674 /
//   54,543 / 50,302 tok/s per node (per-token time ratios 0.872 / 0.922 / 1 to the 4K case).
//   Least squares over the three points: 104.8 us per token and 10.5 ns per pair (all three
//   within 0.5%). 10.5 ns per pair is 470 TFLOPS on the 4.9 MFLOP of MHA-form prefill
//   attention (61 x 128 heads x 2 x (192 + 128)); 104.8 us per token is ~700 TFLOPS on the
//   74 GFLOP of 37B active parameters: both plausible for H800.
// Check (not fitted): production prefill, 4,383-token prompts with 56.3% cache hits, costs
//   141 us per uncached token, a capacity of 7.1k uncached tok/s/GPU against the 4.0k/GPU
//   (32,206 per node) DeepSeek served on average over the day.
constexpr SimLatencyParams kDeepSeekV3H800 = {
    .step_s = 24.7e-3,
    .prefill_token_s = 104.8e-6,
    .prefill_pair_s = 10.5e-9,
    .decode_token_s = 131.8e-6,
    .decode_seq_s = 0,  // not separable from decode_token_s without MTP figures
    .decode_pair_s = 25.7e-9,
};

// deepseek-v3-h20: DeepSeek-R1 on H20-96G (148 TFLOPS BF16, 296 FP8, 4.0 TB/s), decode
// attention-DP16 + MoE-EP16 with MTP (1 step, 2 draft tokens: 2 tokens per sequence per step,
// accept length 1.8-1.9, 1.85 taken), 4,096-token inputs and 1,536-token outputs (mean context
// 4,096 + 768 = 4,864).
//
// decode_pair_s = 78.4 ns: 16.99 MFLOP per pair at 127.5 TFLOPS (community BF16 FlashMLA on
//   H20, 125-130 TFLOPS, kernels-engine.md) x 1.7 (the blog's ~70% speedup of FP8 MLA).
// step_s and decode_token_s: least squares (relative) over the blog's decode throughputs with
//   MTP 1/1/2, EP16: BS 1: 43 tok/s/GPU, BS 8: 278, BS 32: 675, i.e. steps of 1.85·BS/throughput
//   = 43.0 / 53.2 / 87.7 ms. Result 41.6 ms fixed and 0.340 ms per token (all within 0.2%).
//   The MTP 3/1/4 figures (52 and 554 tok/s) are not used: three sequential draft passes add a
//   cost per draft step that this model does not have.
// Check (not fitted): the blog's SLA tiers, 32 sequences/GPU for TPOT < 50 ms and 48 for
//   TPOT < 70 ms, give 47.4 ms and 59.9 ms (TPOT = step / 1.85).
// prefill: no measured H20 prefill figure is published in text (the blog's chart has no
//   numbers), so H800's prefill_token_s and prefill_pair_s are scaled by the compute ratio
//   989/148 = 6.68 (same for FP8): 700 us per token and 70.2 ns per pair, 1,181 tok/s/GPU on
//   16K tokens of 4K prompts. An estimate: a third-party roofline analysis of DeepSeek's
//   prefill on H20 arrives at a similar 1.1-1.2k tok/s/GPU.
constexpr SimLatencyParams kDeepSeekV3H20 = {
    .step_s = 41.6e-3,
    .prefill_token_s = 700e-6,
    .prefill_pair_s = 70.2e-9,
    .decode_token_s = 340e-6,
    .decode_seq_s = 0,
    .decode_pair_s = 78.4e-9,
};

// qwen3-30b-a3b-h100: Qwen3-30B-A3B in BF16 on one H100 SXM (tensor parallel 1). An ESTIMATE
// from published peak figures and the published architecture, not a measurement: H100 SXM's
// 989 TFLOPS dense BF16 and 3.35 TB/s HBM3 (NVIDIA's datasheet); 48 layers, hidden 2048, 32
// query heads and 4 KV heads of 128, 128 experts of 768 (8 per token); 3.3B active and 30.5B
// total parameters (Qwen3 technical report), i.e. 6.6 GB read per token at batch 1 and 61 GB
// once every expert is touched.
//
// decode_pair_s = 29.3 ns: a cached token's K and V over all layers, 48 x 2 x 4 x 128 x 2 B =
//   98,304 B, read at 3.35 TB/s (GQA attention is memory-bound: 786 kFLOP per pair is 0.8 ns).
// step_s and decode_token_s: the weights a decode step reads, through two anchors at 100% of
//   the bandwidth: batch 1 reads the 3.3B active parameters (1.97 ms); batch 64 touches ~98% of
//   each layer's experts (1 - (120/128)^64), ~60 GB (17.9 ms) plus 64 x 6.6 GFLOP at 60% of
//   peak (0.71 ms). The line through (1, 1.97 ms) and (64, 18.6 ms): 1.71 ms fixed, 0.264 ms
//   per token. (Expert coverage saturates, so the line overstates steps past 64 sequences.)
// prefill_token_s = 11.1 us: 6.6 GFLOP per token at 60% of peak (593 TFLOPS).
// prefill_pair_s = 1.33 ns: 48 x 32 heads x 2 x 2 x 128 = 786 kFLOP per causal pair at 593
//   TFLOPS.
constexpr SimLatencyParams kQwen3A3BH100 = {
    .step_s = 1.71e-3,
    .prefill_token_s = 11.1e-6,
    .prefill_pair_s = 1.33e-9,
    .decode_token_s = 264e-6,
    .decode_seq_s = 0,
    .decode_pair_s = 29.3e-9,
};

// tiny: for tests of the simulated executor. Not derived from hardware; small enough that tests
// run fast (a 100-token prefill takes about 4 ms, a decode step of 4 short sequences about
// 2.5 ms) and non-zero everywhere so that every kind of work costs something.
constexpr SimLatencyParams kTiny = {
    .step_s = 2e-3,
    .prefill_token_s = 20e-6,
    .prefill_pair_s = 2e-9,
    .decode_token_s = 100e-6,
    .decode_seq_s = 20e-6,
    .decode_pair_s = 2e-9,
};

struct Preset {
  const char* name;
  SimLatencyParams params;
};
constexpr std::array<Preset, 4> kPresets = {{
    {"deepseek-v3-h800", kDeepSeekV3H800},
    {"deepseek-v3-h20", kDeepSeekV3H20},
    {"qwen3-30b-a3b-h100", kQwen3A3BH100},
    {"tiny", kTiny},
}};

// ---------------------------------------------------------------------------------------------
// Least squares for the fit.

// Minimises |A z - b| over the columns of A (column-major, each of length b.size()) with
// Householder QR. A column that is (numerically) a combination of earlier ones gets 0.
std::vector<double> least_squares(std::vector<std::vector<double>> cols, std::vector<double> b) {
  const size_t m = b.size(), k = cols.size();
  double scale = 0;
  for (const auto& c : cols) {
    double n2 = 0;
    for (double v : c) n2 += v * v;
    scale = std::max(scale, std::sqrt(n2));
  }
  std::vector<int64_t> pivot_row(k, -1);
  size_t row = 0;
  for (size_t c = 0; c < k && row < m; ++c) {
    double norm2 = 0;
    for (size_t i = row; i < m; ++i) norm2 += cols[c][i] * cols[c][i];
    const double norm = std::sqrt(norm2);
    if (norm <= 1e-10 * scale) continue;  // dependent on the columns before it
    const double alpha = cols[c][row] > 0 ? -norm : norm;
    std::vector<double> v(cols[c].begin() + row, cols[c].end());
    v[0] -= alpha;
    double v2 = 0;
    for (double x : v) v2 += x * x;
    auto reflect = [&](std::vector<double>& y) {
      double dot = 0;
      for (size_t i = 0; i < v.size(); ++i) dot += v[i] * y[row + i];
      const double f = 2 * dot / v2;
      for (size_t i = 0; i < v.size(); ++i) y[row + i] -= f * v[i];
    };
    for (size_t c2 = c; c2 < k; ++c2) reflect(cols[c2]);
    reflect(b);
    pivot_row[c] = static_cast<int64_t>(row++);
  }
  std::vector<double> z(k, 0.0);
  for (size_t c = k; c-- > 0;) {
    if (pivot_row[c] < 0) continue;
    const size_t r = static_cast<size_t>(pivot_row[c]);
    double s = b[r];
    for (size_t c2 = c + 1; c2 < k; ++c2) s -= cols[c2][r] * z[c2];
    z[c] = s / cols[c][r];
  }
  return z;
}

// Lawson-Hanson non-negative least squares: min |A x - b| subject to x >= 0. `cols` are the
// columns of A.
std::vector<double> nnls(const std::vector<std::vector<double>>& cols,
                         const std::vector<double>& b) {
  const size_t n = cols.size(), m = b.size();
  std::vector<double> x(n, 0.0);
  std::vector<bool> passive(n, false), blocked(n, false);
  double bnorm = 0;
  for (double v : b) bnorm += v * v;
  const double tol = 1e-10 * std::sqrt(bnorm);

  auto solve_passive = [&] {
    std::vector<std::vector<double>> sub;
    std::vector<size_t> idx;
    for (size_t j = 0; j < n; ++j) {
      if (passive[j]) {
        sub.push_back(cols[j]);
        idx.push_back(j);
      }
    }
    const std::vector<double> zs = least_squares(std::move(sub), b);
    std::vector<double> z(n, 0.0);
    for (size_t i = 0; i < idx.size(); ++i) z[idx[i]] = zs[i];
    return z;
  };

  for (size_t outer = 0; outer < 10 * n + 10; ++outer) {
    // Gradient of -|Ax - b|²/2: w = Aᵀ(b - Ax).
    std::vector<double> r = b;
    for (size_t j = 0; j < n; ++j) {
      if (x[j] != 0) {
        for (size_t i = 0; i < m; ++i) r[i] -= cols[j][i] * x[j];
      }
    }
    size_t best = n;
    double best_w = tol;
    for (size_t j = 0; j < n; ++j) {
      if (passive[j] || blocked[j]) continue;
      double w = 0;
      for (size_t i = 0; i < m; ++i) w += cols[j][i] * r[i];
      if (w > best_w) {
        best_w = w;
        best = j;
      }
    }
    if (best == n) break;
    passive[best] = true;
    bool changed = false;
    for (size_t inner = 0; inner < 10 * n + 10; ++inner) {
      const std::vector<double> z = solve_passive();
      if (!changed && z[best] <= 0) {
        // Numerically dependent on the passive set: it cannot help; try the others.
        passive[best] = false;
        blocked[best] = true;
        break;
      }
      bool feasible = true;
      double alpha = 1;
      for (size_t j = 0; j < n; ++j) {
        if (passive[j] && z[j] <= 0) {
          feasible = false;
          alpha = std::min(alpha, x[j] / (x[j] - z[j]));
        }
      }
      changed = true;
      if (feasible) {
        x = z;
        break;
      }
      for (size_t j = 0; j < n; ++j) {
        x[j] += alpha * (z[j] - x[j]);
        if (passive[j] && x[j] <= 1e-15) {
          passive[j] = false;
          x[j] = 0;
        }
      }
    }
    if (changed) std::fill(blocked.begin(), blocked.end(), false);
  }
  return x;
}

constexpr const char* kShapeError = "step shape: ";

}  // namespace

StepFeatures step_features(const StepShape& shape) {
  StepFeatures f;
  for (size_t i = 0; i < shape.prefills.size(); ++i) {
    const PrefillPart& p = shape.prefills[i];
    const std::string field = "prefills[" + std::to_string(i) + "]";
    if (p.new_tokens < 1) {
      throw Error(std::string(kShapeError) + field + ".new_tokens must be >= 1 (got " +
                  std::to_string(p.new_tokens) + ")");
    }
    if (p.context_tokens < 0) {
      throw Error(std::string(kShapeError) + field + ".context_tokens must be >= 0 (got " +
                  std::to_string(p.context_tokens) + ")");
    }
    const double n = static_cast<double>(p.new_tokens);
    const double c = static_cast<double>(p.context_tokens);
    f.prefill_tokens += n;
    f.prefill_pairs += n * c + n * (n + 1) / 2;
  }
  if (shape.decode_seqs < 0) {
    throw Error(std::string(kShapeError) + "decode_seqs must be >= 0 (got " +
                std::to_string(shape.decode_seqs) + ")");
  }
  if (shape.decode_context_tokens < 0) {
    throw Error(std::string(kShapeError) + "decode_context_tokens must be >= 0 (got " +
                std::to_string(shape.decode_context_tokens) + ")");
  }
  if (shape.decode_seqs == 0) {
    if (shape.decode_tokens != 0 || shape.decode_context_tokens != 0) {
      throw Error(std::string(kShapeError) +
                  "decode_tokens and decode_context_tokens must be 0 when decode_seqs is 0");
    }
  } else if (shape.decode_tokens < shape.decode_seqs) {
    throw Error(std::string(kShapeError) + "decode_tokens (" + std::to_string(shape.decode_tokens) +
                ") must be >= decode_seqs (" + std::to_string(shape.decode_seqs) +
                "): one token per decoding sequence plus its drafts");
  }
  if (shape.decode_seqs > 0) {
    const double seqs = static_cast<double>(shape.decode_seqs);
    const double tokens = static_cast<double>(shape.decode_tokens);
    f.decode_seqs = seqs;
    f.decode_tokens = tokens;
    f.decode_pairs = static_cast<double>(shape.decode_context_tokens) * tokens / seqs;
  }
  return f;
}

SimLatencyModel::SimLatencyModel(const SimLatencyParams& params, std::string name)
    : params_(params), name_(std::move(name)) {
  for (const ParamField& field : kFields) {
    const double v = params_.*field.member;
    if (!std::isfinite(v) || v < 0) {
      throw Error("latency model " + name_ + ": " + field.name +
                  " must be a non-negative finite number of seconds (got " + std::to_string(v) +
                  ")");
    }
  }
}

double SimLatencyModel::step_seconds(const StepShape& shape) const {
  const auto features = feature_vector(shape);
  double t = 0;
  for (size_t j = 0; j < kNumParams; ++j) t += params_.*kFields[j].member * features[j];
  return t;
}

SimLatencyModel SimLatencyModel::preset(std::string_view name) {
  for (const Preset& p : kPresets) {
    if (name == p.name) return SimLatencyModel(p.params, p.name);
  }
  std::string valid;
  for (const Preset& p : kPresets) valid += (valid.empty() ? "" : ", ") + std::string(p.name);
  throw Error("unknown latency model preset \"" + std::string(name) +
              "\" (expected one of: " + valid + ")");
}

const std::vector<std::string>& SimLatencyModel::preset_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const Preset& p : kPresets) out.emplace_back(p.name);
    return out;
  }();
  return names;
}

std::string SimLatencyModel::to_json() const {
  // Ordered, so files read in formula order.
  nlohmann::ordered_json doc;
  doc["name"] = name_;
  for (const ParamField& field : kFields) doc[field.name] = params_.*field.member;
  return doc.dump(2);
}

SimLatencyModel SimLatencyModel::from_json(std::string_view text, std::string_view origin) {
  const std::string where(origin);
  nlohmann::json doc;
  try {
    doc = parse_untrusted_json(text);  // depth-bounded: a value may be quoted in an error
  } catch (const Error& e) {
    throw Error(where + ": invalid JSON: " + e.what());
  }
  if (!doc.is_object()) throw Error(where + ": expected a JSON object");
  std::string expected = "name";
  for (const ParamField& field : kFields) expected += std::string(", ") + field.name;
  for (const auto& [key, value] : doc.items()) {
    const bool known =
        key == "name" || std::any_of(kFields.begin(), kFields.end(),
                                     [&](const ParamField& f) { return key == f.name; });
    if (!known) {
      throw Error(where + ": unknown field \"" + key + "\" (expected " + expected + ")");
    }
  }
  std::string name = "custom";
  if (doc.contains("name")) {
    if (!doc["name"].is_string()) throw Error(where + ": field \"name\" must be a string");
    name = doc["name"].get<std::string>();
  }
  SimLatencyParams params;
  for (const ParamField& field : kFields) {
    if (!doc.contains(field.name)) {
      throw Error(where + ": field \"" + field.name + "\" is missing");
    }
    const auto& v = doc[field.name];
    if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 0) {
      throw Error(where + ": field \"" + field.name +
                  "\" must be a non-negative finite number of seconds, got " + json_excerpt(v));
    }
    params.*field.member = v.get<double>();
  }
  return SimLatencyModel(params, std::move(name));
}

void SimLatencyModel::save(const std::filesystem::path& path) const {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw Error("cannot write latency model to " + path.string());
  out << to_json() << '\n';
  out.close();
  if (!out) throw Error("error while writing latency model to " + path.string());
}

SimLatencyModel SimLatencyModel::load(const std::filesystem::path& path) {
  return from_json(read_file(path), path.string());
}

LatencyFit fit_sim_latency(const std::vector<LatencySample>& samples, std::string name) {
  if (samples.empty()) throw Error("latency fit: no samples");
  const size_t m = samples.size();
  // Rows divided by the measured time: minimising |A x - 1| minimises relative error.
  std::vector<std::vector<double>> cols(kNumParams, std::vector<double>(m));
  for (size_t i = 0; i < m; ++i) {
    const double y = samples[i].seconds;
    if (!std::isfinite(y) || y <= 0) {
      throw Error("latency fit: samples[" + std::to_string(i) +
                  "].seconds must be a positive finite number (got " + std::to_string(y) + ")");
    }
    std::array<double, kNumParams> features;
    try {
      features = feature_vector(samples[i].shape);
    } catch (const Error& e) {
      throw Error("latency fit: samples[" + std::to_string(i) + "]: " + e.what());
    }
    if (features[0] == 0) {
      throw Error("latency fit: samples[" + std::to_string(i) + "] is an empty step");
    }
    for (size_t j = 0; j < kNumParams; ++j) cols[j][i] = features[j] / y;
  }
  // Unit-norm columns: the features differ by many orders of magnitude (1 vs 1e9 pairs).
  std::array<double, kNumParams> norms{};
  for (size_t j = 0; j < kNumParams; ++j) {
    double n2 = 0;
    for (double v : cols[j]) n2 += v * v;
    norms[j] = std::sqrt(n2);
    if (norms[j] > 0) {
      for (double& v : cols[j]) v /= norms[j];
    }
  }
  const std::vector<double> x = nnls(cols, std::vector<double>(m, 1.0));
  SimLatencyParams params;
  for (size_t j = 0; j < kNumParams; ++j) {
    params.*kFields[j].member = norms[j] > 0 ? std::max(0.0, x[j] / norms[j]) : 0.0;
  }
  LatencyFit fit{SimLatencyModel(params, std::move(name)), 0, 0};
  double sum2 = 0;
  for (const LatencySample& s : samples) {
    const double rel = fit.model.step_seconds(s.shape) / s.seconds - 1;
    sum2 += rel * rel;
    fit.max_relative_error = std::max(fit.max_relative_error, std::abs(rel));
  }
  fit.rms_relative_error = std::sqrt(sum2 / static_cast<double>(m));
  return fit;
}

}  // namespace tandem::engine
