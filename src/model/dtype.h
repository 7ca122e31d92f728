#pragma once
// Element types of checkpoints and their conversions. Names follow safetensors ("F32", "BF16",
// "F16", "F8_E4M3", "I8"); conversions round to nearest even, as PyTorch does.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

#include "kernels/cpu/bf16.h"

namespace tandem::model {

enum class DType { kF32, kBF16, kF16, kF8E4M3, kI8 };

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);                     // safetensors spelling
std::optional<DType> parse_dtype(std::string_view name);  // from safetensors spelling
bool is_float_dtype(DType t);                             // F32, BF16 or F16

// BF16 conversions live with the kernels (the lowest layer that needs them).
using kernels::bf16_to_f32;
using kernels::f32_to_bf16;

float f16_to_f32(uint16_t v);
uint16_t f32_to_f16(float f);
float f8e4m3_to_f32(uint8_t v);
// Rounds to nearest even like torch's float8_e4m3fn cast; magnitudes beyond 448 saturate to
// +-448 (torch turns those from 480 up into NaN; quantizers scale values into range first).
uint8_t f32_to_f8e4m3(float f);

// Converts n elements of type `from` at src to f32.
void to_f32(DType from, const void* src, float* dst, size_t n);
// Converts n f32 values to `to` (F32, BF16 or F16; round to nearest even) at dst, which need not
// be aligned. Throws tandem::Error for the quantized types, which need scales.
void from_f32(DType to, const float* src, void* dst, size_t n);

}  // namespace tandem::model
