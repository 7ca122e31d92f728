#include "kernels/cpu/gemm_onednn.h"

#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include <dnnl.hpp>

#include "kernels/cpu/bf16.h"

namespace tandem::kernels {
namespace {

using dnnl::memory;
using Tag = memory::format_tag;
using Type = memory::data_type;

struct Context {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::mutex mutex;
  // (tokens or -1 for "any", cols, rows, weight type) -> primitive. Small token counts get a primitive
  // of their exact shape (oneDNN's brgemm kernels); larger ones share one whose token count is
  // given at run time (its jit gemm is the faster of the two there).
  std::map<std::tuple<int64_t, int64_t, int64_t, int>, dnnl::matmul> cache;
};

Context& context() {
  static Context c;
  return c;
}

constexpr int64_t kExactShapeMaxTokens = 64;
constexpr size_t kMaxCachedPrimitives = 512;

}  // namespace

bool onednn_matmul(const Matrix& w, const float* x, int64_t n, float* y) {
  if (w.type == WeightType::kI8) return false;
  const bool bf16 = w.type == WeightType::kBF16;
  Context& c = context();
  const Type in_type = bf16 ? Type::bf16 : Type::f32;
  const int64_t key_tokens = n <= kExactShapeMaxTokens ? n : DNNL_RUNTIME_DIM_VAL;

  std::lock_guard lock(c.mutex);  // one stream; the forward pass is single-threaded above oneDNN
  auto key = std::make_tuple(key_tokens, w.cols, w.rows, static_cast<int>(w.type));
  auto it = c.cache.find(key);
  if (it == c.cache.end()) {
    // Attention products change shape with the context length; a bounded cache keeps a long
    // run from accumulating compiled kernels.
    if (c.cache.size() >= kMaxCachedPrimitives) c.cache.clear();
    try {
      memory::desc src({key_tokens, w.cols}, in_type, Tag::ab);
      memory::desc wei({w.cols, w.rows}, in_type, Tag::ba);  // W is [rows, cols] row-major
      memory::desc dst({key_tokens, w.rows}, Type::f32, Tag::ab);
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src, wei, dst), c.engine);
      it = c.cache.emplace(key, dnnl::matmul(pd)).first;
    } catch (const dnnl::error&) {
      return false;  // e.g. no BF16 kernel on this CPU: the caller's own loops take over
    }
  }

  thread_local std::vector<uint16_t> x_bf16;
  void* src_ptr = const_cast<float*>(x);
  if (bf16) {
    x_bf16.resize(static_cast<size_t>(n * w.cols));
    const int64_t count = n * w.cols;
    uint16_t* dst = x_bf16.data();
#pragma omp parallel for schedule(static) if (count > (1 << 15))
    for (int64_t i = 0; i < count; ++i) dst[i] = f32_to_bf16(x[i]);
    src_ptr = x_bf16.data();
  }
  memory src({{n, w.cols}, in_type, Tag::ab}, c.engine, src_ptr);
  memory wei({{w.cols, w.rows}, in_type, Tag::ba}, c.engine, const_cast<void*>(w.data));
  memory dst({{n, w.rows}, Type::f32, Tag::ab}, c.engine, y);
  it->second.execute(c.stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}});
  c.stream.wait();
  return true;
}

bool onednn_matmul_u8s8(const Matrix& w, const uint8_t* xq, int64_t n, int32_t* acc) {
  if (w.type != WeightType::kI8) return false;
  Context& c = context();
  const int64_t key_tokens = n <= kExactShapeMaxTokens ? n : DNNL_RUNTIME_DIM_VAL;
  std::lock_guard lock(c.mutex);
  auto key = std::make_tuple(key_tokens, w.cols, w.rows, static_cast<int>(w.type));
  auto it = c.cache.find(key);
  if (it == c.cache.end()) {
    if (c.cache.size() >= kMaxCachedPrimitives) c.cache.clear();
    try {
      memory::desc src({key_tokens, w.cols}, Type::u8, Tag::ab);
      memory::desc wei({w.cols, w.rows}, Type::s8, Tag::ba);
      memory::desc dst({key_tokens, w.rows}, Type::s32, Tag::ab);
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src, wei, dst), c.engine);
      it = c.cache.emplace(key, dnnl::matmul(pd)).first;
    } catch (const dnnl::error&) {
      return false;
    }
  }
  memory src({{n, w.cols}, Type::u8, Tag::ab}, c.engine, const_cast<uint8_t*>(xq));
  memory wei({{w.cols, w.rows}, Type::s8, Tag::ba}, c.engine, const_cast<void*>(w.data));
  memory dst({{n, w.rows}, Type::s32, Tag::ab}, c.engine, acc);
  it->second.execute(c.stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}});
  c.stream.wait();
  return true;
}

}  // namespace tandem::kernels
