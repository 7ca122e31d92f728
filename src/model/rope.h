#pragma once
// Rotary position embedding as DeepSeek applies it to the decoupled rope dimensions: pairs
// (x[2i], x[2i+1]) rotated by position * inv_freq[i], with YaRN's frequency interpolation and
// magnitude scale when the config asks for it.
#include <cstdint>
#include <vector>

#include "model/config.h"

namespace tandem::model {

class Rope {
 public:
  explicit Rope(const ModelConfig& config);
  // Rotates x[dim] (dim = qk_rope_head_dim) in place for `position`.
  void apply(float* x, int64_t position) const;
  // The same rotation for `count` vectors at one position, x + k * stride for k < count: the
  // angles are computed once (a token's heads share them).
  void apply(float* x, int64_t stride, int64_t count, int64_t position) const;
  const std::vector<double>& inv_freq() const { return inv_freq_; }
  double magnitude() const { return mscale_; }

 private:
  std::vector<double> inv_freq_;
  double mscale_ = 1.0;
};

}  // namespace tandem::model
