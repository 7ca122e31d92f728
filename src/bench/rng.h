#pragma once
// The random numbers of `tandem bench`. Every draw is written out here on top of std::mt19937_64
// (whose output the C++ standard fixes) rather than taken from <random>'s distributions, whose
// algorithms differ between standard libraries: a seed gives the same workload and arrivals on
// every platform.
#include <cmath>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

namespace tandem::bench {

class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}

  uint64_t next() { return engine_(); }

  // Uniform over [0, n), n > 0, without modulo bias (rejection of the short top range).
  uint64_t below(uint64_t n) {
    const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    uint64_t x;
    do {
      x = engine_();
    } while (x >= limit);
    return x % n;
  }

  // Uniform over the integers [low, high], low <= high.
  int64_t between(int64_t low, int64_t high) {
    return low + static_cast<int64_t>(below(static_cast<uint64_t>(high - low) + 1));
  }

  // Uniform over [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }

  // Uniform over (0, 1]: safe under log().
  double uniform_open0() { return 1.0 - uniform(); }

  // Standard normal (Box-Muller; the second value is dropped to keep the stream simple).
  double normal() {
    const double u1 = uniform_open0();
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
  }

  // Gamma(shape, scale), shape > 0: Marsaglia and Tsang (2000); shape < 1 through
  // Gamma(shape + 1) * U^(1/shape).
  double gamma(double shape, double scale) {
    if (shape < 1.0) {
      const double g = gamma(shape + 1.0, 1.0);
      return g * std::pow(uniform_open0(), 1.0 / shape) * scale;
    }
    const double d = shape - 1.0 / 3.0;
    const double c = 1.0 / std::sqrt(9.0 * d);
    while (true) {
      double x, v;
      do {
        x = normal();
        v = 1.0 + c * x;
      } while (v <= 0.0);
      v = v * v * v;
      const double u = uniform_open0();
      if (std::log(u) < 0.5 * x * x + d - d * v + d * std::log(v)) return d * v * scale;
    }
  }

  // Fisher-Yates.
  template <typename T>
  void shuffle(std::vector<T>& items) {
    for (size_t i = items.size(); i > 1; --i) {
      std::swap(items[i - 1], items[below(i)]);
    }
  }

 private:
  std::mt19937_64 engine_;
};

}  // namespace tandem::bench
