#include "util/npy.h"

#include <cstring>
#include <limits>
#include <regex>

#include "util/error.h"
#include "util/file.h"

namespace tandem {
namespace {

constexpr std::string_view kMagic = "\x93NUMPY";
constexpr size_t kMaxHeader = 4096;
constexpr uint64_t kMaxElements = uint64_t(1) << 34;

struct IntType {
  const char* descr;
  int bytes;
  bool is_signed;
};
constexpr IntType kIntTypes[] = {{"<i1", 1, true},  {"|i1", 1, true},  {"<i2", 2, true},
                                 {"<i4", 4, true},  {"<i8", 8, true},  {"|u1", 1, false},
                                 {"<u1", 1, false}, {"<u2", 2, false}, {"<u4", 4, false},
                                 {"<u8", 8, false}, {"|b1", 1, false}};

int64_t load_le(const unsigned char* p, const IntType& t, const std::string& source) {
  uint64_t u = 0;
  for (int i = t.bytes - 1; i >= 0; --i) u = (u << 8) | p[i];
  if (t.is_signed && t.bytes < 8 && (u >> (t.bytes * 8 - 1)) & 1)
    u |= ~uint64_t(0) << (t.bytes * 8);
  if (!t.is_signed && t.bytes == 8 && u > uint64_t(std::numeric_limits<int64_t>::max()))
    throw Error(source + ": uint64 value " + std::to_string(u) + " does not fit int64");
  return int64_t(u);
}

}  // namespace

NpyArray parse_npy(std::string_view bytes, const std::string& source) {
  if (bytes.size() < 10 || bytes.substr(0, 6) != kMagic)
    throw Error(source + ": not a NumPy .npy file (missing \\x93NUMPY magic)");
  const auto u8 = [&](size_t i) { return uint32_t(static_cast<unsigned char>(bytes[i])); };
  const uint32_t major = u8(6);
  size_t header_len = 0, offset = 0;
  if (major == 1) {
    header_len = u8(8) | (u8(9) << 8);
    offset = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) throw Error(source + ": truncated .npy header");
    header_len = u8(8) | (u8(9) << 8) | (u8(10) << 16) | (u8(11) << 24);
    offset = 12;
  } else {
    throw Error(source + ": unsupported .npy format version " + std::to_string(major));
  }
  // NumPy writes headers of a hundred bytes for integer arrays; a longer one is not ours to read
  // (and would cost the regex engine stack).
  if (header_len > kMaxHeader)
    throw Error(source + ": .npy header of " + std::to_string(header_len) +
                " bytes is longer than " + std::to_string(kMaxHeader));
  if (bytes.size() < offset + header_len) throw Error(source + ": truncated .npy header");
  const std::string header(bytes.substr(offset, header_len));
  offset += header_len;

  std::smatch m;
  static const std::regex descr_re(R"('descr'\s*:\s*'([^']*)')");
  static const std::regex order_re(R"('fortran_order'\s*:\s*(True|False))");
  static const std::regex shape_re(R"('shape'\s*:\s*\(([^)]*)\))");
  if (!std::regex_search(header, m, descr_re)) throw Error(source + ": .npy header has no 'descr'");
  NpyArray array;
  array.dtype = m[1];
  if (!std::regex_search(header, m, order_re))
    throw Error(source + ": .npy header has no 'fortran_order'");
  if (m[1] == "True")
    throw Error(source + ": Fortran-order arrays are not supported (want C order)");
  if (!std::regex_search(header, m, shape_re)) throw Error(source + ": .npy header has no 'shape'");
  const std::string dims = m[1];
  const auto bad_shape = [&] {
    return Error(source + ": .npy 'shape' (" + dims +
                 ") is not a tuple of non-negative integers such as (3,) or (2, 4)");
  };
  // Comma-separated integers, with a trailing comma allowed (NumPy's 1-tuples have one); each
  // is checked whole, so a sign or any other character refuses the header.
  uint64_t count = 1;
  size_t i = 0;
  const auto skip_spaces = [&] {
    while (i < dims.size() && (dims[i] == ' ' || dims[i] == '\t')) ++i;
  };
  skip_spaces();
  while (i < dims.size()) {
    const size_t start = i;
    while (i < dims.size() && dims[i] >= '0' && dims[i] <= '9') ++i;
    if (i == start) throw bad_shape();
    const std::string d = dims.substr(start, i - start);
    if (d.size() > 12) throw Error(source + ": .npy dimension " + d + " is too large");
    const uint64_t dim = std::stoull(d);
    // Checked before multiplying, so the element count cannot wrap around.
    if (dim > kMaxElements || (dim > 0 && count > kMaxElements / dim))
      throw Error(source + ": .npy array is too large");
    array.shape.push_back(int64_t(dim));
    count *= dim;
    skip_spaces();
    if (i == dims.size()) break;
    if (dims[i] != ',') throw bad_shape();
    ++i;
    skip_spaces();
  }

  const IntType* type = nullptr;
  for (const IntType& t : kIntTypes)
    if (array.dtype == t.descr) type = &t;
  if (!type)
    throw Error(source + ": .npy dtype '" + array.dtype +
                "' is not supported (want a little-endian integer array such as <i4 or <i8)");
  const uint64_t want = count * uint64_t(type->bytes);
  if (bytes.size() - offset != want)
    throw Error(source + ": .npy data holds " + std::to_string(bytes.size() - offset) +
                " bytes, the shape and dtype need " + std::to_string(want));
  array.values.resize(count);
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data() + offset);
  for (uint64_t i = 0; i < count; ++i)
    array.values[i] = load_le(p + i * type->bytes, *type, source);
  return array;
}

NpyArray read_npy(const std::filesystem::path& path) {
  return parse_npy(read_file(path), path.string());
}

std::string encode_npy(const std::vector<int64_t>& shape, const std::vector<int64_t>& values,
                       bool int32) {
  std::string dims;  // as NumPy writes it: "(3,)" and "(3, 4)"
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) dims += ", ";
    dims += std::to_string(shape[i]);
  }
  if (shape.size() == 1) dims += ",";
  std::string header = std::string("{'descr': '") + (int32 ? "<i4" : "<i8") +
                       "', 'fortran_order': False, 'shape': (" + dims + "), }";
  // NumPy pads the header with spaces so the data starts on a 64-byte boundary.
  const size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  std::string out(kMagic);
  out += char(1);
  out += char(0);
  out += char(header.size() & 0xff);
  out += char(header.size() >> 8);
  out += header;
  const int width = int32 ? 4 : 8;
  out.reserve(out.size() + values.size() * width);
  for (int64_t v : values) {
    if (int32 &&
        (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max()))
      throw Error("value " + std::to_string(v) + " does not fit an int32 .npy array");
    uint64_t u = uint64_t(v);
    for (int i = 0; i < width; ++i, u >>= 8) out += char(u & 0xff);
  }
  return out;
}

void write_npy(const std::filesystem::path& path, const std::vector<int64_t>& shape,
               const std::vector<int64_t>& values, bool int32) {
  write_file_atomically(path, encode_npy(shape, values, int32));
}

}  // namespace tandem
