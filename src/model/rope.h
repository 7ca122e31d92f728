#pragma once
// Rotary position embedding with YaRN's frequency interpolation and magnitude scale when the
// config asks for it. DeepSeek rotates pairs (x[2i], x[2i+1]) of its decoupled rope dimensions;
// Qwen3 rotates (x[i], x[i + dim/2]) of whole heads (the "rotate half" convention).
#include <cstdint>
#include <optional>
#include <vector>

#include "model/config.h"

namespace tandem::model {

// YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when factor <= 1), as DeepSeek's
// and transformers' get_mscale.
double yarn_get_mscale(double factor, double mscale = 1.0);

class Rope {
 public:
  explicit Rope(const ModelConfig& config);
  // Rotary dimension `dim`, base `theta`, YaRN when given; `mscale` multiplies cos and sin.
  Rope(int64_t dim, double theta, const std::optional<YarnScaling>& yarn, double mscale);
  // Rotates x[dim] (dim = qk_rope_head_dim) in place for `position`.
  void apply(float* x, int64_t position) const;
  // The same rotation for `count` vectors at one position, x + k * stride for k < count: the
  // angles are computed once (a token's heads share them).
  void apply(float* x, int64_t stride, int64_t count, int64_t position) const;
  // The rotate-half convention: pairs (x[i], x[i + dim/2]).
  void apply_halves(float* x, int64_t stride, int64_t count, int64_t position) const;
  const std::vector<double>& inv_freq() const { return inv_freq_; }
  double magnitude() const { return mscale_; }

 private:
  void set_frequencies(int64_t dim, double theta, const std::optional<YarnScaling>& yarn);
  std::vector<double> inv_freq_;
  double mscale_ = 1.0;
};

}  // namespace tandem::model
