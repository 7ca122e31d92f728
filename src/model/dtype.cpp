#include "model/dtype.h"

#include <bit>
#include <cmath>

#include "util/error.h"

namespace tandem::model {

namespace {

// Every element type: its safetensors name, its size, whether it holds floating-point values.
struct DTypeInfo {
  DType type;
  std::string_view name;
  size_t size;
  bool is_float;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::kF32, "F32", 4, true}, {DType::kBF16, "BF16", 2, true},
    {DType::kF16, "F16", 2, true}, {DType::kF8E4M3, "F8_E4M3", 1, false},
    {DType::kI8, "I8", 1, false},
};

const DTypeInfo* info_of(DType t) {
  for (const auto& d : kDTypes)
    if (d.type == t) return &d;
  return nullptr;
}

}  // namespace

size_t dtype_size(DType t) {
  const DTypeInfo* d = info_of(t);
  return d ? d->size : 0;
}

std::string_view dtype_name(DType t) {
  const DTypeInfo* d = info_of(t);
  return d ? d->name : "?";
}

std::optional<DType> parse_dtype(std::string_view name) {
  for (const auto& d : kDTypes)
    if (d.name == name) return d.type;
  return std::nullopt;
}

bool is_float_dtype(DType t) {
  const DTypeInfo* d = info_of(t);
  return d && d->is_float;
}

float f16_to_f32(uint16_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x8000) << 16;
  const uint32_t exp = (v >> 10) & 0x1F;
  uint32_t mant = v & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000 | (mant << 13);  // inf, or NaN with its payload
  } else if (exp != 0) {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {
    // Subnormal: mant * 2^-24; shift until the implicit bit appears.
    int e = -14;
    while ((mant & 0x400) == 0) {
      mant <<= 1;
      --e;
    }
    bits = sign | (static_cast<uint32_t>(e + 127) << 23) | ((mant & 0x3FF) << 13);
  }
  return std::bit_cast<float>(bits);
}

uint16_t f32_to_f16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  const uint32_t abs = bits & 0x7FFFFFFF;
  if (abs > 0x7F800000) return sign | 0x7E00 | static_cast<uint16_t>((abs >> 13) & 0x1FF);  // NaN
  if (abs >= 0x477FF000) return sign | 0x7C00;  // rounds to >= 65536: inf, as IEEE and torch
  if (abs < 0x38800000) {
    // Result is subnormal (or zero) in f16: its unit is 2^-24. Adding 0.5 (2^-1) to |f| in f32
    // puts the f16 subnormal grid on f32's last mantissa bits and lets the FPU round to even.
    const float shifted = std::bit_cast<float>(abs) + 0.5f;
    return sign | static_cast<uint16_t>(std::bit_cast<uint32_t>(shifted) - 0x3F000000);
  }
  // Normal: rebias the exponent and round the 13 dropped bits to nearest even.
  uint32_t v = abs + ((15u - 127u) << 23);
  v += 0xFFF + ((v >> 13) & 1);
  return sign | static_cast<uint16_t>(v >> 13);
}

float f8e4m3_to_f32(uint8_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x80) << 24;
  const uint32_t exp = (v >> 3) & 0xF;
  const uint32_t mant = v & 0x7;
  if (exp == 0xF && mant == 0x7) return std::bit_cast<float>(sign | 0x7FC00000);  // the only NaN
  if (exp == 0) {
    const float mag = static_cast<float>(mant) * 0.001953125f;  // mant * 2^-9
    return sign ? -mag : mag;
  }
  return std::bit_cast<float>(sign | ((exp + 127 - 7) << 23) | (mant << 20));
}

uint8_t f32_to_f8e4m3(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const uint32_t abs = bits & 0x7FFFFFFF;
  if (abs > 0x7F800000) return sign | 0x7F;  // NaN
  // 448 is the largest finite value; anything that would round above it saturates (weights
  // are scaled into range, so saturation only ever absorbs rounding at the edge).
  if (abs >= 0x43E00000) return sign | 0x7E;
  if (abs < 0x3C800000) {
    // Below 2^-6 the result is subnormal with unit 2^-9; adding 2^14 (whose f32 ulp is 2^-9)
    // aligns that grid with f32's last mantissa bit so the FPU rounds to nearest even.
    const float shifted = std::bit_cast<float>(abs) + 16384.0f;
    return sign | static_cast<uint8_t>(std::bit_cast<uint32_t>(shifted) - 0x46800000);
  }
  uint32_t v = abs + ((7u - 127u) << 23);
  v += 0x7FFFF + ((v >> 20) & 1);
  const uint32_t r = v >> 20;
  return sign | static_cast<uint8_t>(r > 0x7E ? 0x7E : r);
}

void to_f32(DType from, const void* src, float* dst, size_t n) {
  switch (from) {
    case DType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kBF16: {
      const auto* s = static_cast<const uint8_t*>(src);
      for (size_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, s + 2 * i, 2);  // the source need not be aligned
        dst[i] = bf16_to_f32(v);
      }
      return;
    }
    case DType::kF16: {
      const auto* s = static_cast<const uint8_t*>(src);
      for (size_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, s + 2 * i, 2);
        dst[i] = f16_to_f32(v);
      }
      return;
    }
    case DType::kF8E4M3: {
      const auto* s = static_cast<const uint8_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = f8e4m3_to_f32(s[i]);
      return;
    }
    case DType::kI8: {
      const auto* s = static_cast<const int8_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
      return;
    }
  }
  throw Error("to_f32: unknown dtype");
}

void from_f32(DType to, const float* src, void* dst, size_t n) {
  auto* d = static_cast<uint8_t*>(dst);
  switch (to) {
    case DType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kBF16:
      for (size_t i = 0; i < n; ++i) {
        const uint16_t v = f32_to_bf16(src[i]);
        std::memcpy(d + 2 * i, &v, 2);
      }
      return;
    case DType::kF16:
      for (size_t i = 0; i < n; ++i) {
        const uint16_t v = f32_to_f16(src[i]);
        std::memcpy(d + 2 * i, &v, 2);
      }
      return;
    case DType::kF8E4M3:
    case DType::kI8:
      break;
  }
  throw Error("from_f32: " + std::string(dtype_name(to)) +
              " values need scales; quantize them (model/quantize.h)");
}

}  // namespace tandem::model
