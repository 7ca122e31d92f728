#include "model/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace tandem::model {
namespace {

// The dimension index at which a rotation completes `rotations` turns over `max_pos` positions.
double correction_dim(double rotations, int64_t dim, double base, int64_t max_pos) {
  return dim * std::log(max_pos / (rotations * 2 * std::numbers::pi)) / (2 * std::log(base));
}

}  // namespace

double yarn_get_mscale(double factor, double mscale) {
  return factor <= 1.0 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0;
}

Rope::Rope(const ModelConfig& c) {
  set_frequencies(c.qk_rope_head_dim, c.rope_theta, c.yarn);
  if (c.yarn)
    mscale_ = yarn_get_mscale(c.yarn->factor, c.yarn->mscale.value_or(1.0)) /
              yarn_get_mscale(c.yarn->factor, c.yarn->mscale_all_dim);
}

Rope::Rope(int64_t dim, double theta, const std::optional<YarnScaling>& yarn, double mscale)
    : mscale_(mscale) {
  set_frequencies(dim, theta, yarn);
}

void Rope::set_frequencies(int64_t dim, double base, const std::optional<YarnScaling>& yarn) {
  inv_freq_.resize(dim / 2);
  for (int64_t i = 0; i < dim / 2; ++i) inv_freq_[i] = 1.0 / std::pow(base, 2.0 * i / dim);
  if (!yarn) return;
  const YarnScaling& y = *yarn;
  double low = correction_dim(y.beta_fast, dim, base, y.original_max_position_embeddings);
  double high = correction_dim(y.beta_slow, dim, base, y.original_max_position_embeddings);
  if (y.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // avoid a zero-width ramp
  for (int64_t i = 0; i < dim / 2; ++i) {
    // Fast-turning dimensions (below `low`) keep their frequency; slow ones (above `high`) are
    // interpolated by the context-extension factor; a linear ramp joins the two.
    double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    inv_freq_[i] = inv_freq_[i] / y.factor * ramp + inv_freq_[i] * (1.0 - ramp);
  }
}

void Rope::apply(float* x, int64_t position) const {
  apply(x, 0, 1, position);
}

void Rope::apply(float* x, int64_t stride, int64_t count, int64_t position) const {
  for (size_t i = 0; i < inv_freq_.size(); ++i) {
    const double angle = static_cast<double>(position) * inv_freq_[i];
    const double c = std::cos(angle) * mscale_, s = std::sin(angle) * mscale_;
    for (int64_t k = 0; k < count; ++k) {
      float* v = x + k * stride;
      const double a = v[2 * i], b = v[2 * i + 1];
      v[2 * i] = static_cast<float>(a * c - b * s);
      v[2 * i + 1] = static_cast<float>(a * s + b * c);
    }
  }
}

}  // namespace tandem::model

namespace tandem::model {

void Rope::apply_halves(float* x, int64_t stride, int64_t count, int64_t position) const {
  const size_t half = inv_freq_.size();
  for (size_t i = 0; i < half; ++i) {
    const double angle = static_cast<double>(position) * inv_freq_[i];
    const double c = std::cos(angle) * mscale_, s = std::sin(angle) * mscale_;
    for (int64_t k = 0; k < count; ++k) {
      float* v = x + k * stride;
      const double a = v[i], b = v[i + half];
      v[i] = static_cast<float>(a * c - b * s);
      v[i + half] = static_cast<float>(b * c + a * s);
    }
  }
}

}  // namespace tandem::model
