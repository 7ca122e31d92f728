#include "kernels/cpu/gemm_onednn.h"

#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <tuple>
#include <vector>

#include <dnnl.hpp>

#include "kernels/cpu/bf16.h"

namespace tandem::kernels {
namespace {

using dnnl::memory;
using Tag = memory::format_tag;
using Type = memory::data_type;

// Products may run concurrently (the MoE layer runs one expert per thread), so each thread has
// its own stream and scratchpad (user-managed: the library's shared scratchpad is not safe for
// concurrent execution of one primitive), and the primitive cache is behind a shared lock.
struct Primitive {
  dnnl::matmul matmul;
  size_t scratchpad_bytes = 0;
};

struct Context {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  std::shared_mutex mutex;
  // (tokens or -1 for "any", cols, rows, weight type) -> primitive. Small token counts get a
  // primitive of their exact shape (oneDNN's brgemm kernels); larger ones share one whose token
  // count is given at run time (its jit gemm is the faster of the two there).
  std::map<std::tuple<int64_t, int64_t, int64_t, int>, std::shared_ptr<Primitive>> cache;
};

Context& context() {
  static Context c;
  return c;
}

constexpr int64_t kExactShapeMaxTokens = 64;
constexpr size_t kMaxCachedPrimitives = 512;

// The cached primitive for this product, created on first use; null if oneDNN has no kernel.
std::shared_ptr<Primitive> primitive(int64_t n, int64_t cols, int64_t rows, WeightType wtype,
                                     Type src_type, Type wei_type, Type dst_type) {
  Context& c = context();
  const int64_t key_tokens = n <= kExactShapeMaxTokens ? n : DNNL_RUNTIME_DIM_VAL;
  const auto key = std::make_tuple(key_tokens, cols, rows, static_cast<int>(wtype));
  {
    std::shared_lock lock(c.mutex);
    auto it = c.cache.find(key);
    if (it != c.cache.end()) return it->second;
  }
  std::unique_lock lock(c.mutex);
  auto it = c.cache.find(key);
  if (it != c.cache.end()) return it->second;
  // Attention products change shape with the context length; a bounded cache keeps a long run
  // from accumulating compiled kernels (holders keep evicted primitives alive).
  if (c.cache.size() >= kMaxCachedPrimitives) c.cache.clear();
  try {
    memory::desc src({key_tokens, cols}, src_type, Tag::ab);
    memory::desc wei({cols, rows}, wei_type, Tag::ba);  // W is [rows, cols] row-major
    memory::desc dst({key_tokens, rows}, dst_type, Tag::ab);
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src, wei, dst), attr, c.engine);
    auto p = std::make_shared<Primitive>();
    p->matmul = dnnl::matmul(pd);
    p->scratchpad_bytes = pd.scratchpad_desc().get_size();
    c.cache.emplace(key, p);
    return p;
  } catch (const dnnl::error&) {
    return nullptr;  // e.g. no BF16 kernel on this CPU: the caller's own loops take over
  }
}

void execute(const Primitive& p, memory& src, memory& wei, memory& dst) {
  Context& c = context();
  thread_local dnnl::stream stream(c.engine);
  thread_local std::vector<uint8_t> scratch;
  if (scratch.size() < p.scratchpad_bytes) scratch.resize(p.scratchpad_bytes);
  memory pad({{static_cast<int64_t>(p.scratchpad_bytes)}, Type::u8, Tag::a}, c.engine,
             scratch.data());
  p.matmul.execute(stream, {{DNNL_ARG_SRC, src},
                            {DNNL_ARG_WEIGHTS, wei},
                            {DNNL_ARG_DST, dst},
                            {DNNL_ARG_SCRATCHPAD, pad}});
  stream.wait();
}

}  // namespace

bool onednn_matmul(const Matrix& w, const float* x, int64_t n, float* y) {
  if (w.type == WeightType::kI8) return false;
  const bool bf16 = w.type == WeightType::kBF16;
  const Type in_type = bf16 ? Type::bf16 : Type::f32;
  auto p = primitive(n, w.cols, w.rows, w.type, in_type, in_type, Type::f32);
  if (!p) return false;

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
  const dnnl::engine& engine = context().engine;
  memory src({{n, w.cols}, in_type, Tag::ab}, engine, src_ptr);
  memory wei({{w.cols, w.rows}, in_type, Tag::ba}, engine, const_cast<void*>(w.data));
  memory dst({{n, w.rows}, Type::f32, Tag::ab}, engine, y);
  execute(*p, src, wei, dst);
  return true;
}

bool onednn_matmul_u8s8(const Matrix& w, const uint8_t* xq, int64_t n, int32_t* acc) {
  if (w.type != WeightType::kI8) return false;
  auto p = primitive(n, w.cols, w.rows, w.type, Type::u8, Type::s8, Type::s32);
  if (!p) return false;
  const dnnl::engine& engine = context().engine;
  memory src({{n, w.cols}, Type::u8, Tag::ab}, engine, const_cast<uint8_t*>(xq));
  memory wei({{w.cols, w.rows}, Type::s8, Tag::ba}, engine, const_cast<void*>(w.data));
  memory dst({{n, w.rows}, Type::s32, Tag::ab}, engine, acc);
  execute(*p, src, wei, dst);
  return true;
}

}  // namespace tandem::kernels
