// Element type conversions: known bit patterns, exhaustive round trips, brute-force
// nearest-even rounding for FP8, and BF16/F16 rounding against PyTorch (Debian python3-torch).
#include "model/dtype.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "model/model_test_support.h"
#include "text/oracle_support.h"
#include "util/error.h"

namespace tandem::model {
namespace {

float from_bits(uint32_t b) {
  return std::bit_cast<float>(b);
}

TEST(DType, NamesAndSizes) {
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3, DType::kI8})
    EXPECT_EQ(parse_dtype(dtype_name(t)), t);
  EXPECT_EQ(dtype_size(DType::kF32), 4u);
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kF16), 2u);
  EXPECT_EQ(dtype_size(DType::kF8E4M3), 1u);
  EXPECT_EQ(dtype_size(DType::kI8), 1u);
  EXPECT_EQ(dtype_name(DType::kF8E4M3), "F8_E4M3");
  EXPECT_FALSE(parse_dtype("F64"));
  EXPECT_FALSE(parse_dtype("f32"));
  EXPECT_TRUE(is_float_dtype(DType::kF16));
  EXPECT_FALSE(is_float_dtype(DType::kI8));
}

TEST(DType, Bf16KnownBits) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(f32_to_bf16(-2.0f), 0xC000);
  EXPECT_EQ(f32_to_bf16(from_bits(0x3F808000)), 0x3F80);  // tie, even stays
  EXPECT_EQ(f32_to_bf16(from_bits(0x3F818000)), 0x3F82);  // tie, odd rounds up
  EXPECT_EQ(f32_to_bf16(from_bits(0x3F808001)), 0x3F81);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()), 0x7F80);  // rounds to inf
  EXPECT_EQ(f32_to_bf16(from_bits(0x00000001)), 0x0000);              // subnormal rounds to 0
  const uint16_t nan = f32_to_bf16(std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(std::isnan(bf16_to_f32(nan)));
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(from_bits(0x7F800001)))));  // signalling NaN
  EXPECT_EQ(bf16_to_f32(0x4049), 3.140625f);
}

TEST(DType, F16KnownBits) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3C00);
  EXPECT_EQ(f32_to_f16(-2.0f), 0xC000);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7BFF);
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7BFF);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7C00);  // tie between 65504 and 2^16: even is inf
  EXPECT_EQ(f32_to_f16(1e6f), 0x7C00);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000);  // tie to even: 0
  EXPECT_EQ(f32_to_f16(std::ldexp(3.0f, -25)), 0x0002);  // tie to even: 2
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_f16(from_bits(0x3F801000)), 0x3C00);  // tie below odd? 1 + 2^-11: even
  EXPECT_EQ(f32_to_f16(from_bits(0x3F803000)), 0x3C02);  // 1 + 3*2^-11: to even 1 + 2^-9
  EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_f32(0x7C00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(f16_to_f32(0x3555), 0.333251953125f);
}

TEST(DType, F16RoundTripsEveryCode) {
  for (uint32_t c = 0; c < 0x10000; ++c) {
    const uint16_t code = static_cast<uint16_t>(c);
    const float f = f16_to_f32(code);
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_f16(f), code) << std::hex << c;
  }
}

TEST(DType, Bf16RoundTripsEveryCode) {
  for (uint32_t c = 0; c < 0x10000; ++c) {
    const uint16_t code = static_cast<uint16_t>(c);
    const float f = bf16_to_f32(code);
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_bf16(f), code) << std::hex << c;
  }
}

TEST(DType, F8KnownCodes) {
  EXPECT_EQ(f8e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(f8e4m3_to_f32(0x7E), 448.0f);
  EXPECT_EQ(f8e4m3_to_f32(0xFE), -448.0f);
  EXPECT_EQ(f8e4m3_to_f32(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(f8e4m3_to_f32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(f8e4m3_to_f32(0x07), std::ldexp(7.0f, -9));
  EXPECT_EQ(f8e4m3_to_f32(0x3C), 1.5f);
  EXPECT_EQ(f8e4m3_to_f32(0x80), 0.0f);
  EXPECT_TRUE(std::signbit(f8e4m3_to_f32(0x80)));
  EXPECT_TRUE(std::isnan(f8e4m3_to_f32(0x7F)));
  EXPECT_TRUE(std::isnan(f8e4m3_to_f32(0xFF)));
  EXPECT_FALSE(std::isnan(f8e4m3_to_f32(0x77)));  // e=1110 m=111: 240, no inf in E4M3FN
  EXPECT_EQ(f8e4m3_to_f32(0x77), 240.0f);
  EXPECT_EQ(f32_to_f8e4m3(1.0f), 0x38);
  EXPECT_EQ(f32_to_f8e4m3(448.0f), 0x7E);
  EXPECT_EQ(f32_to_f8e4m3(500.0f), 0x7E);  // saturates
  EXPECT_EQ(f32_to_f8e4m3(-1e9f), 0xFE);
  EXPECT_EQ(f32_to_f8e4m3(std::numeric_limits<float>::infinity()), 0x7E);
  EXPECT_EQ(f32_to_f8e4m3(std::ldexp(1.0f, -10)), 0x00);  // half the smallest subnormal: even 0
  EXPECT_EQ(f32_to_f8e4m3(std::ldexp(3.0f, -10)), 0x02);  // 1.5 units: to even 2
  EXPECT_EQ(f32_to_f8e4m3(1.0625f), 0x38);                // tie between 1 and 1.125: even 1
  EXPECT_EQ(f32_to_f8e4m3(1.1875f), 0x3A);                // tie between 1.125 and 1.25: 1.25
  EXPECT_EQ(f32_to_f8e4m3(std::numeric_limits<float>::quiet_NaN()) & 0x7F, 0x7F);
}

TEST(DType, F8RoundsToNearestEvenLikeABruteForceSearch) {
  std::vector<std::pair<float, uint8_t>> finite;  // value, code (non-negative codes)
  for (int c = 0; c < 0x7F; ++c)
    finite.push_back({f8e4m3_to_f32(static_cast<uint8_t>(c)), static_cast<uint8_t>(c)});
  auto reference = [&](float x) {
    const float a = std::min(std::fabs(x), 448.0f);
    uint8_t best = 0;
    float best_err = INFINITY;
    for (auto [v, c] : finite) {
      const float err = std::fabs(a - v);
      if (err < best_err || (err == best_err && (c & 1) == 0)) {
        best = c;
        best_err = err;
      }
    }
    return static_cast<uint8_t>(best | (std::signbit(x) ? 0x80 : 0));
  };
  std::mt19937 rng(7);
  std::vector<float> inputs;
  for (size_t i = 0; i + 1 < finite.size(); ++i) {  // every code, every midpoint, and neighbours
    const float lo = finite[i].first, hi = finite[i + 1].first, mid = (lo + hi) / 2;
    for (float v : {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      inputs.push_back(v);
      inputs.push_back(-v);
    }
  }
  std::uniform_real_distribution<float> log_mag(-12.0f, 9.5f);
  for (int i = 0; i < 20000; ++i) inputs.push_back((i % 2 ? -1 : 1) * std::exp2(log_mag(rng)));
  for (float x : inputs) ASSERT_EQ(f32_to_f8e4m3(x), reference(x)) << x;
  for (int c = 0; c < 256; ++c) {
    const float v = f8e4m3_to_f32(static_cast<uint8_t>(c));
    if (!std::isnan(v)) {
      EXPECT_EQ(f32_to_f8e4m3(v), c);
    }
  }
}

TEST(DType, ToF32ReadsUnalignedSources) {
  alignas(8) uint8_t raw[16] = {};
  const uint16_t bf = f32_to_bf16(-1.5f), h = f32_to_f16(0.25f);
  std::memcpy(raw + 1, &bf, 2);
  std::memcpy(raw + 3, &h, 2);
  float out[2];
  to_f32(DType::kBF16, raw + 1, out, 1);
  to_f32(DType::kF16, raw + 3, out + 1, 1);
  EXPECT_EQ(out[0], -1.5f);
  EXPECT_EQ(out[1], 0.25f);
  const int8_t i8[3] = {-127, 0, 5};
  float o3[3];
  to_f32(DType::kI8, i8, o3, 3);
  EXPECT_EQ(o3[0], -127.0f);
  EXPECT_EQ(o3[2], 5.0f);
  const uint8_t f8[2] = {0x38, 0xFE};
  to_f32(DType::kF8E4M3, f8, o3, 2);
  EXPECT_EQ(o3[0], 1.0f);
  EXPECT_EQ(o3[1], -448.0f);
}

TEST(DType, FromF32WritesWhatTheElementConversionsGiveAndRefusesScaledTypes) {
  const float in[3] = {1.0f / 3, -2.5e-3f, 65504.0f};
  alignas(8) uint8_t raw[1 + 3 * 4] = {};
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    from_f32(t, in, raw + 1, 3);  // unaligned on purpose
    for (int i = 0; i < 3; ++i) {
      uint32_t got = 0;
      std::memcpy(&got, raw + 1 + i * dtype_size(t), dtype_size(t));
      uint32_t want = 0;
      if (t == DType::kF32) std::memcpy(&want, &in[i], 4);
      if (t == DType::kBF16) want = f32_to_bf16(in[i]);
      if (t == DType::kF16) want = f32_to_f16(in[i]);
      EXPECT_EQ(got, want) << dtype_name(t) << " " << i;
    }
  }
  EXPECT_THROW(from_f32(DType::kI8, in, raw, 3), Error);
  EXPECT_THROW(from_f32(DType::kF8E4M3, in, raw, 3), Error);
}

// BF16 and F16 rounding of many float32 values (random bit patterns, exact ties, subnormal and
// overflow edges) must equal PyTorch's bit for bit.
TEST(DType, Bf16AndF16MatchPyTorch) {
  std::vector<float> values;
  std::mt19937 rng(1234);
  for (int i = 0; i < 20000; ++i) {
    const float f = std::bit_cast<float>(static_cast<uint32_t>(rng()));
    if (!std::isnan(f)) values.push_back(f);
  }
  for (int i = 0; i < 4000; ++i) {  // exact BF16 ties, and values one ulp around them
    const uint32_t hi = rng() & 0x7F7F0000;
    for (uint32_t lo : {0x8000u, 0x7FFFu, 0x8001u}) {
      values.push_back(std::bit_cast<float>(hi | lo));
      values.push_back(-std::bit_cast<float>(hi | lo));
    }
  }
  std::uniform_real_distribution<float> log_mag(-26.0f, 17.0f);  // F16 subnormals to overflow
  for (int i = 0; i < 20000; ++i) values.push_back((i % 2 ? -1 : 1) * std::exp2(log_mag(rng)));
  for (uint32_t c = 0; c < 0x10000; c += 7) {  // F16 ties: halfway between neighbours
    const float a = f16_to_f32(static_cast<uint16_t>(c)),
                b = f16_to_f32(static_cast<uint16_t>(c + 1));
    if (std::isfinite(a) && std::isfinite(b)) values.push_back((a + b) / 2);
  }
  for (float v : {65504.0f, 65519.99f, 65520.0f, 65536.0f, 1e-8f, 5.96e-8f, 2.98e-8f})
    values.push_back(v);

  test::TempDir dir("dtype");
  test::write_bytes(dir / "values.bin",
                    std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4));
  const auto r =
      test::run_capture("/usr/bin/python3 " + test::quote(test::oracle_dir() / "dtype_oracle.py") +
                        " " + test::quote(dir / "values.bin"));
  ASSERT_EQ(r.status, 0) << "the PyTorch oracle failed (Debian python3-torch and python3-numpy "
                            "are needed: scripts/install-deps.sh installs them)";
  const auto doc = nlohmann::json::parse(r.output);
  const auto bf16 = doc["bf16"].get<std::vector<uint16_t>>();
  const auto f16 = doc["f16"].get<std::vector<uint16_t>>();
  ASSERT_EQ(bf16.size(), values.size());
  ASSERT_EQ(f16.size(), values.size());
  int mismatches = 0;
  for (size_t i = 0; i < values.size() && mismatches < 10; ++i) {
    if (f32_to_bf16(values[i]) != bf16[i]) {
      ADD_FAILURE() << "bf16 of " << values[i] << " (bits " << std::hex
                    << std::bit_cast<uint32_t>(values[i]) << "): ours " << f32_to_bf16(values[i])
                    << ", torch " << bf16[i];
      ++mismatches;
    }
    if (f32_to_f16(values[i]) != f16[i]) {
      ADD_FAILURE() << "f16 of " << values[i] << " (bits " << std::hex
                    << std::bit_cast<uint32_t>(values[i]) << "): ours " << f32_to_f16(values[i])
                    << ", torch " << f16[i];
      ++mismatches;
    }
  }
}

}  // namespace
}  // namespace tandem::model
