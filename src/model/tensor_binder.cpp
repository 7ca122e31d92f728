#include "model/tensor_binder.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>

#include "model/dtype.h"
#include "model/layout.h"
#include "model/quantize.h"
#include "util/error.h"

namespace tandem::model {

using kernels::Matrix;

namespace {

std::string number_text(float v) {
  return std::isnan(v) ? "nan" : v > 0 ? "inf" : "-inf";
}

// A weight scale that is infinite or NaN makes its whole block (row) of weights NaN or infinite,
// and with it every logit that reads them. No quantizer writes one (a scale is a block's amax over
// the code's maximum; tandem quantize refuses non-finite weights), so it is a damaged file: refused
// naming the tensor and the element. A zero scale stays accepted: it is what amax / 448 gives an
// all-zero block, and its weights come back 0 as they were; a negative one decodes to finite
// weights exactly as vLLM's kernels read them.
void check_scales(const std::string& tensor, const TensorInfo& info, std::span<const float> scales,
                  int64_t cols) {
  for (size_t i = 0; i < scales.size(); ++i)
    if (!std::isfinite(scales[i]))
      throw Error("tensor '" + tensor + "' in " + info.file + ": element [" +
                  std::to_string(int64_t(i) / cols) + ", " + std::to_string(int64_t(i) % cols) +
                  "] is " + number_text(scales[i]) +
                  ": a weight scale must be finite (the file is damaged)");
}

// Where the kernels read an F32 or BF16 matrix from: in place when its data is naturally aligned
// (every file the safetensors library or tandem writes), else an aligned copy in `storage`. The
// format allows any data_offsets, and the kernels read rows through float and uint16_t pointers,
// for which a misaligned address is undefined behaviour (and a fault on some targets). The
// copied-from pages are given back: nothing reads them in place.
const void* aligned_rows(const TensorInfo& t, std::vector<uint8_t>& storage) {
  if (reinterpret_cast<uintptr_t>(t.data) % dtype_size(t.dtype) == 0) return t.data;
  storage.resize(t.nbytes);  // operator new's alignment suits every element type
  std::memcpy(storage.data(), t.data, t.nbytes);
  release_pages(t.data, t.nbytes);
  return storage.data();
}

}  // namespace

Matrix tied_head(const Matrix& embedding) {
  Matrix head =
      kernels::matrix_view(embedding.rows, embedding.cols, embedding.type, embedding.data);
  head.row_scales = embedding.row_scales;  // an INT8 embedding's (one float per row)
  head.row_sums = embedding.row_sums;
  head.packed = embedding.packed;
  return head;
}

TensorBinder::TensorBinder(const Checkpoint& checkpoint, std::optional<Fp8Quantization> fp8,
                           const std::function<void(size_t, size_t)>& progress)
    : checkpoint_(checkpoint), fp8_(fp8), progress_(progress), total_(0) {
  for (const auto& [name, info] : checkpoint.tensors())
    if (!is_unused_rotary_buffer(name)) ++total_;
}

std::vector<float> TensorBinder::vector(const std::string& name, int64_t n) {
  const TensorInfo& t = take(name, {n});
  std::vector<float> out(n);
  to_f32(t.dtype, t.data, out.data(), n);
  return out;
}

Matrix TensorBinder::matrix(const std::string& name, int64_t rows, int64_t cols) {
  const TensorInfo& t = take(name + ".weight", {rows, cols});
  Matrix m;
  m.rows = rows;
  m.cols = cols;
  switch (t.dtype) {
    case DType::kF32:
      m.type = kernels::WeightType::kF32;
      m.data = aligned_rows(t, m.storage);
      break;
    case DType::kBF16:
      m.type = kernels::WeightType::kBF16;
      m.data = aligned_rows(t, m.storage);
      break;
    case DType::kF16: {
      m.type = kernels::WeightType::kF32;
      m.storage.resize(static_cast<size_t>(rows * cols) * 4);
      to_f32(t.dtype, t.data, reinterpret_cast<float*>(m.storage.data()), rows * cols);
      m.data = m.storage.data();
      release_pages(t.data, t.nbytes);  // the kernels read the F32 rows: the F16 ones are done
      break;
    }
    case DType::kF8E4M3:
      dequantize_fp8(name, t, m);
      break;
    case DType::kI8: {
      m.type = kernels::WeightType::kI8;
      m.data = t.data;
      const TensorInfo& s = take(name + ".weight_scale", {rows, 1});
      m.row_scales.resize(rows);
      to_f32(s.dtype, s.data, m.row_scales.data(), rows);
      check_scales(name + ".weight_scale", s, m.row_scales, 1);
      kernels::set_int8_row_sums(m);
      break;
    }
  }
  return m;
}

Matrix TensorBinder::packed_matrix(const std::string& name, int64_t rows, int64_t cols,
                                   PlainRows plain) {
  Matrix m = matrix(name, rows, cols);
  pack(m, plain);
  return m;
}

void TensorBinder::pack(Matrix& m, PlainRows plain) {
  if (!kernels::pack_for_gemm(m, &arena_)) return;
  // Every product reads the packed copy now; the plain rows only absorbed attention (kKeep)
  // and the batch-invariant kernels read.
  if (plain == PlainRows::kKeep || kernels::batch_invariant()) return;
  if (m.storage.empty()) {
    release_pages(m.data, m.bytes());  // mapped: should they be read after all, they come back
  } else {
    // Converted rows (F16 widened, FP8 dequantised) have no file to come back from: freed, so
    // an F16 or FP8 checkpoint's matrices are held once, packed, as a BF16 checkpoint's are.
    std::vector<uint8_t>().swap(m.storage);
    m.data = nullptr;
  }
}

Matrix TensorBinder::int8_matrix(const std::string& name, int64_t rows, int64_t cols) {
  const TensorInfo& t = take_quantizable(name, rows, cols);
  Matrix m = quantized_int8(name, t.dtype, t.data, rows, cols);
  release_pages(t.data, t.nbytes);
  return m;
}

Matrix TensorBinder::int8_matrix_of_embedding(const std::string& name, const Matrix& embedding) {
  take_quantizable(name, embedding.rows, embedding.cols);  // the file's dtype decides, as above
  // matrix() leaves a quantizable tensor as F32 rows (F32 as it is, F16 widened exactly) or BF16.
  const DType rows = embedding.type == kernels::WeightType::kF32 ? DType::kF32 : DType::kBF16;
  return quantized_int8(name, rows, static_cast<const std::byte*>(embedding.data), embedding.rows,
                        embedding.cols);
}

const TensorInfo& TensorBinder::take_quantizable(const std::string& name, int64_t rows,
                                                 int64_t cols) {
  const TensorInfo& t = take(name + ".weight", {rows, cols});
  if (t.dtype != DType::kBF16 && t.dtype != DType::kF32 && t.dtype != DType::kF16)
    throw Error(name + ".weight: INT8 quantization at load needs BF16, F16 or F32 weights, not " +
                std::string(dtype_name(t.dtype)));
  return t;
}

Matrix TensorBinder::quantized_int8(const std::string& name, DType dtype, const std::byte* data,
                                    int64_t rows, int64_t cols) {
  ModelConfig rule;  // only its quantization matters
  rule.int8 = Int8Quantization{};
  Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.type = kernels::WeightType::kI8;
  m.storage.resize(static_cast<size_t>(rows * cols));
  m.row_scales.resize(static_cast<size_t>(rows));
  constexpr int64_t kChunkRows = 1024;
  std::vector<float> wide, scales;
  const size_t element = dtype_size(dtype);
  for (int64_t r0 = 0; r0 < rows; r0 += kChunkRows) {
    const int64_t n = std::min(kChunkRows, rows - r0);
    wide.resize(static_cast<size_t>(n * cols));
    to_f32(dtype, data + static_cast<size_t>(r0 * cols) * element, wide.data(), n * cols);
    quantize_weight(rule, wide, n, cols, reinterpret_cast<std::byte*>(m.storage.data()) + r0 * cols,
                    scales, name + ".weight", r0);
    std::copy(scales.begin(), scales.end(), m.row_scales.begin() + r0);
  }
  m.data = m.storage.data();
  kernels::set_int8_row_sums(m);
  // The INT8 rows stay beside the packed copy (products oneDNN has no kernel for read them).
  kernels::pack_for_gemm(m, &arena_);
  return m;
}

MlpWeights TensorBinder::mlp(const std::string& prefix, int64_t hidden, int64_t inter) {
  return {packed_matrix(prefix + ".gate_proj", inter, hidden),
          packed_matrix(prefix + ".up_proj", inter, hidden),
          packed_matrix(prefix + ".down_proj", hidden, inter)};
}

Matrix TensorBinder::router(const std::string& name, int64_t experts, int64_t hidden) {
  Matrix m = matrix(name, experts, hidden);
  if (m.type == kernels::WeightType::kBF16) {
    // A new buffer: the BF16 bytes may live in `storage` (dequantised at load).
    std::vector<uint8_t> wide(static_cast<size_t>(m.rows * m.cols) * 4);
    to_f32(DType::kBF16, m.data, reinterpret_cast<float*>(wide.data()),
           static_cast<size_t>(m.rows * m.cols));
    m.storage = std::move(wide);
    m.data = m.storage.data();
    m.type = kernels::WeightType::kF32;
  }
  return m;
}

void TensorBinder::skip(const std::string& prefix) {
  const auto& tensors = checkpoint_.tensors();
  for (auto it = tensors.lower_bound(prefix); it != tensors.end() && it->first.starts_with(prefix);
       ++it)
    if (!is_unused_rotary_buffer(it->first)) --total_;
  if (progress_) progress_(done_, total_);
}

const TensorInfo& TensorBinder::take(const std::string& name, const std::vector<int64_t>& shape) {
  const bool first = taken_.insert(name).second;
  const TensorInfo& t = checkpoint_.get(name, shape);
  // A tied embedding is taken twice (the lookup and the head) but is one tensor of the total.
  if (first && progress_) progress_(++done_, total_);
  return t;
}

void TensorBinder::dequantize_fp8(const std::string& name, const TensorInfo& t, Matrix& m) {
  const int64_t br = fp8_ ? fp8_->block_rows : 128;
  const int64_t bc = fp8_ ? fp8_->block_cols : 128;
  const int64_t sr = (m.rows + br - 1) / br, sc = (m.cols + bc - 1) / bc;
  const TensorInfo& s = take(name + ".weight_scale_inv", {sr, sc});
  std::vector<float> scales(sr * sc);
  to_f32(s.dtype, s.data, scales.data(), sr * sc);
  check_scales(name + ".weight_scale_inv", s, scales, sc);
  m.type = kernels::WeightType::kBF16;
  m.storage.resize(static_cast<size_t>(m.rows * m.cols) * 2);
  auto* out = reinterpret_cast<uint16_t*>(m.storage.data());
  const auto* in = reinterpret_cast<const uint8_t*>(t.data);
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t col = 0; col < m.cols; ++col) {
      const float w = f8e4m3_to_f32(in[r * m.cols + col]) * scales[(r / br) * sc + col / bc];
      // E4M3's NaN codes (0x7f, 0xff), or a scale so large the product overflows.
      if (!std::isfinite(w))
        throw Error("tensor '" + name + ".weight' in " + t.file + ": element [" +
                    std::to_string(r) + ", " + std::to_string(col) + "] is " + number_text(w) +
                    " after dequantisation: a weight must be finite (the file is damaged)");
      out[r * m.cols + col] = f32_to_bf16(w);
    }
  m.data = m.storage.data();
  release_pages(t.data, t.nbytes);  // the FP8 bytes are not read again
}

}  // namespace tandem::model
