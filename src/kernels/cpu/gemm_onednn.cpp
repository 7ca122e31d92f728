#include "kernels/cpu/gemm_onednn.h"

#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <tuple>
#include <vector>

#include <dnnl.hpp>

#include "kernels/cpu/matvec_avx512.h"

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
  // primitive of their exact shape (oneDNN's brgemm kernels); larger ones on plain weights share
  // one whose token count is given at run time (its jit gemm needs no packed copy); packed
  // weights always get exact shapes (kPackedLargeChunk tokens at most).
  // The weight type gets 16 added for primitives that read packed weights.
  std::map<std::tuple<int64_t, int64_t, int64_t, int>, std::shared_ptr<Primitive>> cache;
  // onednn_gemm's primitives (all sizes and strides given at run time), by (bf16, transposed);
  // null where oneDNN has none.
  std::map<std::pair<bool, bool>, std::shared_ptr<Primitive>> gemm_cache;
};

Context& context() {
  static Context c;
  return c;
}

constexpr int64_t kExactShapeMaxTokens = 64;
// Packed weights take products of many tokens in exact-shape chunks of this many tokens (brgemm:
// 93-97% of peak on the dense and attention shapes of a 512-token prompt, where the plain
// weights' runtime-shape gemm reaches 76-91%). Larger chunks gained nothing more.
constexpr int64_t kPackedLargeChunk = 256;
constexpr size_t kMaxCachedPrimitives = 512;

}  // namespace

namespace {

// The oneDNN descriptor of packed weights: the [cols, rows] operand in the blocked format
// packed_weights.h describes.
memory::desc packed_desc(const PackedLayout& l) {
  return memory::desc({l.cols, l.rows}, l.group == 2 ? Type::bf16 : Type::s8,
                      l.group == 2 ? Tag::BA16a64b2a : Tag::BA16a64b4a);
}

// The cached primitive for this product, created on first use; null if oneDNN has no kernel.
// With `packed`, the primitive reads weights in that layout (exact token counts only).
std::shared_ptr<Primitive> primitive(int64_t n, int64_t cols, int64_t rows, WeightType wtype,
                                     Type src_type, Type wei_type, Type dst_type,
                                     const PackedWeights* packed = nullptr) {
  Context& c = context();
  const int64_t key_tokens = n <= kExactShapeMaxTokens || packed ? n : DNNL_RUNTIME_DIM_VAL;
  const auto key =
      std::make_tuple(key_tokens, cols, rows, static_cast<int>(wtype) + (packed ? 16 : 0));
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
    // W is [rows, cols] row-major, i.e. the [cols, rows] weights operand in "ba" order.
    memory::desc wei =
        packed ? packed_desc(packed->layout) : memory::desc({cols, rows}, wei_type, Tag::ba);
    memory::desc dst({key_tokens, rows}, dst_type, Tag::ab);
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src, wei, dst), attr, c.engine);
    if (packed && pd.weights_desc() != wei) return nullptr;
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

// Tokens of the chunk starting at t of n: kPackedLargeChunk while that many remain, then 64 at a
// time, then the rest, so a product of any length needs primitives of few shapes.
int64_t packed_chunk(int64_t t, int64_t n) {
  if (n - t >= kPackedLargeChunk) return kPackedLargeChunk;
  return std::min(kExactShapeMaxTokens, n - t);
}

// Runs the product in chunks on the packed weights: every chunk size has a primitive of its exact
// shape reading that one layout.
template <typename Src, typename Dst>
bool packed_matmul(const Matrix& w, const Src* x, int64_t n, Dst* y, Type src_type, Type dst_type) {
  const PackedWeights& packed = *w.packed;
  const dnnl::engine& engine = context().engine;
  const memory::desc desc = packed_desc(packed.layout);
  memory wei(desc, engine, packed.data.get());
  for (int64_t t = 0, m = 0; t < n; t += m) {
    m = packed_chunk(t, n);
    auto p = primitive(m, w.cols, w.rows, w.type, src_type, desc.data_type(), dst_type, &packed);
    if (!p) return false;
    memory src({{m, w.cols}, src_type, Tag::ab}, engine, const_cast<Src*>(x + t * w.cols));
    memory dst({{m, w.rows}, dst_type, Tag::ab}, engine, y + t * w.rows);
    execute(*p, src, wei, dst);
  }
  return true;
}

}  // namespace

bool pack_for_gemm(Matrix& w, util::HugePageArena* arena) {
  if (w.type != WeightType::kBF16 && w.type != WeightType::kI8) return false;
  // Packed INT8 weights serve the VNNI kernels (the integer GEMM and the decode rows); elsewhere
  // oneDNN would still pack them (AVX2 has a u8s8 GEMM), and the copy would sit unused.
  if (w.type == WeightType::kI8 && !avx512::has_vnni()) return false;
  if (w.type == WeightType::kBF16 && !avx512::has_bf16_dot()) return false;
  const bool bf16 = w.type == WeightType::kBF16;
  PackedLayout layout;
  layout.rows = w.rows;
  layout.cols = w.cols;
  layout.group = bf16 ? 2 : 4;
  Context& c = context();
  try {
    const memory::desc desc = packed_desc(layout);
    // Only where oneDNN's own choice for its small-batch and large-chunk kernels is this layout
    // (AVX-512 BF16 / VNNI brgemm): elsewhere its GEMMs would not read it.
    for (int64_t tokens : {kExactShapeMaxTokens, kPackedLargeChunk}) {
      memory::desc src({tokens, w.cols}, bf16 ? Type::bf16 : Type::u8, Tag::ab);
      memory::desc any({w.cols, w.rows}, desc.data_type(), Tag::any);
      memory::desc dst({tokens, w.rows}, bf16 ? Type::f32 : Type::s32, Tag::ab);
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src, any, dst), c.engine);
      if (pd.weights_desc() != desc) return false;
    }
    layout.cols_padded = desc.data.padded_dims[0];
    layout.rows_padded = desc.data.padded_dims[1];
    if (layout.rows_padded % PackedLayout::kBlockRows != 0 ||
        layout.cols_padded % layout.group != 0)
      return false;
    auto packed = std::make_shared<PackedWeights>();
    packed->layout = layout;
    packed->bytes = desc.get_size();
    // Zeroed: the decode kernels read the padding.
    packed->data = arena ? arena->allocate(packed->bytes)
                         : util::HugePageSlice(util::HugePageBuffer(packed->bytes));
    memory to(desc, c.engine, packed->data.get());
    memory from({{w.cols, w.rows}, desc.data_type(), Tag::ba}, c.engine, const_cast<void*>(w.data));
    dnnl::stream stream(c.engine);
    dnnl::reorder(from, to).execute(stream, from, to);
    stream.wait();
    w.packed = std::move(packed);
    return true;
  } catch (const dnnl::error&) {
    return false;
  }
}

namespace {

bool plain_matmul(const Matrix& w, const void* x, int64_t n, float* y, Type in_type) {
  auto p = primitive(n, w.cols, w.rows, w.type, in_type, in_type, Type::f32);
  if (!p) return false;
  const dnnl::engine& engine = context().engine;
  memory src({{n, w.cols}, in_type, Tag::ab}, engine, const_cast<void*>(x));
  memory wei({{w.cols, w.rows}, in_type, Tag::ba}, engine, const_cast<void*>(w.data));
  memory dst({{n, w.rows}, Type::f32, Tag::ab}, engine, y);
  execute(*p, src, wei, dst);
  return true;
}

}  // namespace

bool onednn_has_bf16_matmul() {
  static const bool has = [] {
    return primitive(kExactShapeMaxTokens, 64, 64, WeightType::kBF16, Type::bf16, Type::bf16,
                     Type::f32) != nullptr;
  }();
  return has;
}

bool onednn_matmul_bf16(const Matrix& w, const uint16_t* x, int64_t n, float* y) {
  if (w.type != WeightType::kBF16) return false;
  if (w.packed) return packed_matmul(w, x, n, y, Type::bf16, Type::f32);
  return plain_matmul(w, x, n, y, Type::bf16);
}

bool onednn_matmul(const Matrix& w, const float* x, int64_t n, float* y) {
  if (w.type == WeightType::kF32) return plain_matmul(w, x, n, y, Type::f32);
  if (w.type != WeightType::kBF16) return false;
  thread_local std::vector<uint16_t> x_bf16;
  x_bf16.resize(static_cast<size_t>(n * w.cols));
  to_bf16(x, n * w.cols, x_bf16.data());
  return onednn_matmul_bf16(w, x_bf16.data(), n, y);
}

bool onednn_gemm(bool bf16, int64_t m, int64_t n, int64_t k, const void* a, int64_t lda,
                 const void* b, int64_t ldb, bool b_transposed, float* c, int64_t ldc) {
  Context& ctx = context();
  const Type type = bf16 ? Type::bf16 : Type::f32;
  const auto key = std::make_pair(bf16, b_transposed);
  std::shared_ptr<Primitive> p;
  {
    std::shared_lock lock(ctx.mutex);
    auto it = ctx.gemm_cache.find(key);
    if (it != ctx.gemm_cache.end()) p = it->second;
  }
  if (!p) {
    std::unique_lock lock(ctx.mutex);
    auto it = ctx.gemm_cache.find(key);
    if (it != ctx.gemm_cache.end()) {
      p = it->second;
    } else {
      constexpr int64_t any = DNNL_RUNTIME_DIM_VAL;
      try {
        memory::desc src({any, any}, type, memory::dims{any, 1});
        memory::desc wei({any, any}, type,
                         b_transposed ? memory::dims{1, any} : memory::dims{any, 1});
        memory::desc dst({any, any}, Type::f32, memory::dims{any, 1});
        dnnl::primitive_attr attr;
        attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
        dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src, wei, dst), attr, ctx.engine);
        p = std::make_shared<Primitive>();
        p->matmul = dnnl::matmul(pd);
        p->scratchpad_bytes = pd.scratchpad_desc().get_size();
      } catch (const dnnl::error&) {
        p = nullptr;
      }
      ctx.gemm_cache.emplace(key, p);
    }
  }
  if (!p) return false;
  memory src({{m, k}, type, {lda, 1}}, ctx.engine, const_cast<void*>(a));
  memory wei({{k, n}, type, b_transposed ? memory::dims{1, ldb} : memory::dims{ldb, 1}}, ctx.engine,
             const_cast<void*>(b));
  memory dst({{m, n}, Type::f32, {ldc, 1}}, ctx.engine, c);
  execute(*p, src, wei, dst);
  return true;
}

bool onednn_matmul_u8s8(const Matrix& w, const uint8_t* xq, int64_t n, int32_t* acc) {
  if (w.type != WeightType::kI8) return false;
  if (w.packed) return packed_matmul(w, xq, n, acc, Type::u8, Type::s32);
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
