#pragma once
// NumPy .npy arrays (format versions 1-3, C order, little-endian), the exchange format of expert
// load snapshots and Omni Placement patterns. Integer arrays only: that is all both carry.
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace tandem {

struct NpyArray {
  std::vector<int64_t> shape;
  std::vector<int64_t> values;  // row-major, widened from the file's integer dtype
  std::string dtype;            // the file's descr, e.g. "<i4"
};

// Parses an .npy file's bytes. Accepts the integer dtypes <i1 <i2 <i4 <i8 |u1 <u2 <u4 <u8 and
// |b1; throws tandem::Error naming `source` and what was expected for anything else (floats,
// big-endian, Fortran order, a shape that does not match the data, a truncated file).
NpyArray parse_npy(std::string_view bytes, const std::string& source);
NpyArray read_npy(const std::filesystem::path& path);

// Encodes values as `<i8` or `<i4` (values must fit) with the given shape.
std::string encode_npy(const std::vector<int64_t>& shape, const std::vector<int64_t>& values,
                       bool int32 = false);
// Writes atomically (temporary file, then rename).
void write_npy(const std::filesystem::path& path, const std::vector<int64_t>& shape,
               const std::vector<int64_t>& values, bool int32 = false);

}  // namespace tandem
