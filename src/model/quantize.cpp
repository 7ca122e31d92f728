#include "model/quantize.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstring>

#include <nlohmann/json.hpp>

#include "model/layout.h"
#include "model/model_folder.h"
#include "model/safetensors.h"
#include "util/error.h"
#include "util/file.h"

namespace tandem::model {
namespace {

namespace fs = std::filesystem;

// A weight no scale keeps finite (its block or row would be NaN at load) is refused.
void check_finite(std::span<const float> w, int64_t cols, const std::string& name,
                  int64_t first_row) {
  for (size_t i = 0; i < w.size(); ++i) {
    if (std::isfinite(w[i])) continue;
    std::string value = "nan";
    if (std::isinf(w[i])) value = w[i] > 0 ? "inf" : "-inf";
    const auto c = static_cast<size_t>(cols);
    throw Error(name + " [" + std::to_string(first_row + static_cast<int64_t>(i / c)) + ", " +
                std::to_string(i % c) + "] is " + value + ": cannot quantize");
  }
}

// amax / `top_code`, but a normal float: below FLT_MIN it would be subnormal or 0 (0/0 codes, NaN
// at load), and weights that small quantize to (nearly) zero with FLT_MIN as well.
float scale_for(float amax, float top_code) {
  return amax > 0.f ? std::max(amax / top_code, FLT_MIN) : 1.f;
}

std::vector<float> floats_of(const TensorInfo& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  to_f32(t.dtype, t.data, v.data(), v.size());
  return v;
}

}  // namespace

bool is_weight_scale(const std::string& name) {
  for (const std::string_view suffix : {".weight_scale_inv", ".weight_scale"})
    if (name.size() >= suffix.size() &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
      return true;
  return false;
}

void quantize_weight(const ModelConfig& c, std::span<const float> w, int64_t rows, int64_t cols,
                     std::byte* q, std::vector<float>& scales, const std::string& name,
                     int64_t first_row) {
  if (c.fp8 || c.int8)
    check_finite(w.first(static_cast<size_t>(rows * cols)), cols, name, first_row);
  if (c.fp8) {
    const int64_t br = c.fp8->block_rows, bc = c.fp8->block_cols;
    const int64_t sr = (rows + br - 1) / br, sc = (cols + bc - 1) / bc;
    scales.assign(static_cast<size_t>(sr * sc), 0.f);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t col = 0; col < cols; ++col) {
        float& s = scales[(r / br) * sc + col / bc];
        s = std::max(s, std::fabs(w[r * cols + col]));
      }
    for (float& s : scales) s = scale_for(s, 448.f);
    if (q)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t col = 0; col < cols; ++col) {
          const float s = scales[(r / br) * sc + col / bc];
          q[r * cols + col] = static_cast<std::byte>(f32_to_f8e4m3(w[r * cols + col] / s));
        }
    return;
  }
  if (c.int8) {
    scales.assign(static_cast<size_t>(rows), 0.f);
    for (int64_t r = 0; r < rows; ++r) {
      float amax = 0.f;
      for (int64_t col = 0; col < cols; ++col) amax = std::max(amax, std::fabs(w[r * cols + col]));
      const float s = scale_for(amax, 127.f);
      scales[r] = s;
      if (!q) continue;
      for (int64_t col = 0; col < cols; ++col) {
        const float v = std::clamp(std::nearbyint(w[r * cols + col] / s), -127.f, 127.f);
        q[r * cols + col] = static_cast<std::byte>(static_cast<int8_t>(v));
      }
    }
    return;
  }
  throw Error("quantize: the config names no quantization (fp8 or int8)");
}

ModelConfig quantize_checkpoint(const QuantizeOptions& o,
                                const std::function<void(size_t, size_t)>& progress) {
  if (o.dtype != DType::kI8 && o.dtype != DType::kF8E4M3)
    throw Error("quantize: --dtype must be int8 or fp8, not " + std::string(dtype_name(o.dtype)));
  std::error_code ec;
  if (fs::exists(o.out) && fs::equivalent(o.in, o.out, ec))
    throw Error("quantize: --out must be another folder than --in (" + o.in.string() + ")");
  const ModelConfig source = ModelConfig::load(o.in);
  if (source.fp8 || source.int8)
    throw Error("quantize: " + (o.in / "config.json").string() +
                " is already quantized (quantization_config); start from a BF16, F16 or F32 "
                "checkpoint");
  const Checkpoint ck = Checkpoint::open(o.in);
  // The layers the checkpoint holds: a derived one without its MTP layers quantizes without them
  // (config.json keeps the field, as the source's does).
  ModelConfig held = source;
  if (const std::string warning = drop_absent_mtp_layers(ck, held); !warning.empty())
    std::fprintf(stderr, "tandem quantize: warning: %s. The output has none either\n",
                 warning.c_str());
  validate_checkpoint(ck, held);  // names the first missing or mis-shaped tensor

  ModelConfig c = source;
  c.torch_dtype = "bfloat16";
  if (o.dtype == DType::kI8)
    c.int8 = Int8Quantization{};
  else
    c.fp8 = Fp8Quantization{};
  ModelConfig written = c;
  written.num_nextn_predict_layers = held.num_nextn_predict_layers;
  const std::vector<TensorSpec> specs = checkpoint_layout(written, o.dtype);

  fs::create_directories(o.out, ec);
  if (ec) throw Error(o.out.string() + ": cannot create folder: " + ec.message());
  auto source_tensor = [&](const std::string& name) -> const TensorInfo& {
    auto it = ck.tensors().find(name);
    if (it == ck.tensors().end())
      throw Error("quantize: " + o.in.string() + " has no tensor " + name);
    return it->second;
  };
  write_checkpoint(
      o.out, specs,
      [&](const TensorSpec& spec, std::span<std::byte> out) {
        if (is_weight_scale(spec.name)) {
          const std::string weight = spec.name.substr(0, spec.name.rfind('.')) + ".weight";
          const TensorInfo& w = source_tensor(weight);
          std::vector<float> scales;
          quantize_weight(c, floats_of(w), w.shape[0], w.shape[1], nullptr, scales, weight);
          std::memcpy(out.data(), scales.data(), out.size());
          return;
        }
        const TensorInfo& t = source_tensor(spec.name);
        if (spec.dtype == DType::kI8 || spec.dtype == DType::kF8E4M3) {
          std::vector<float> scales;
          quantize_weight(c, floats_of(t), t.shape[0], t.shape[1], out.data(), scales, spec.name);
          return;
        }
        if (t.dtype == spec.dtype) {
          std::memcpy(out.data(), t.data, out.size());
          return;
        }
        // Converted in slices: an embedding is a gigabyte as floats.
        const size_t n = static_cast<size_t>(t.numel()), esize = dtype_size(t.dtype);
        constexpr size_t kSlice = size_t{1} << 16;
        std::vector<float> buf(std::min(n, kSlice));
        for (size_t begin = 0; begin < n; begin += kSlice) {
          const size_t len = std::min(kSlice, n - begin);
          to_f32(t.dtype, t.data + begin * esize, buf.data(), len);
          from_f32(spec.dtype, buf.data(), out.data() + begin * dtype_size(spec.dtype), len);
        }
      },
      o.max_shard_bytes, progress);

  write_file_atomically(o.out / "config.json", c.to_json().dump(2) + "\n");
  copy_tokenizer_files(o.in, o.out, true, "quantize");
  return c;
}

}  // namespace tandem::model
