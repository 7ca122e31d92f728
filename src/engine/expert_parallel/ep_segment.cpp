#include "engine/expert_parallel/ep_segment.h"

#include <new>

#include "util/error.h"

namespace tandem::engine::ep {
namespace {

constexpr uint64_t kMagic = 0x31657061646e6174ull;  // "tandape1"

size_t round_up(size_t n) {
  return (n + 63) / 64 * 64;
}

// Byte sizes of the parts, in segment order; one definition for format, open and bytes.
struct Sizes {
  size_t header, items, tokens, blocks, table, rank, logits, cache;
  size_t entries, result_rows, rows, results, routed, work;
  explicit Sizes(const EpShape& s) {
    header = round_up(sizeof(Header));
    items = round_up(sizeof(int64_t) + sizeof(ItemDesc) * size_t(s.max_items));
    tokens = round_up(sizeof(int32_t) * size_t(s.max_tokens));
    blocks = round_up(sizeof(int32_t) * size_t(s.max_block_refs));
    table = round_up(sizeof(int32_t) * size_t(s.moe_layers) * (1 + 2 * size_t(s.max_slots)));
    const size_t max_entries = size_t(s.max_tokens * s.top_k);
    entries = round_up(sizeof(Entry) * max_entries);
    result_rows = round_up(sizeof(int64_t) * max_entries);
    rows = round_up(sizeof(float) * size_t(s.max_tokens * s.hidden));
    results = round_up(sizeof(float) * max_entries * size_t(s.hidden));
    routed = round_up(sizeof(int64_t) * size_t(s.moe_layers * s.experts));
    work = round_up(sizeof(RankWork));
    rank = 64 + entries + result_rows + rows + results + routed + work;
    logits = round_up(sizeof(float) * size_t(s.max_items * s.vocab));
    cache = size_t(s.cache_blocks * s.cache_block_bytes);
  }
  size_t total(int ranks) const {
    return header + items + tokens + blocks + 2 * table + rank * size_t(ranks) + logits + cache;
  }
};

void check_shape(const EpShape& s) {
  if (s.ranks < 1 || s.hidden < 1 || s.top_k < 1 || s.experts < 1 || s.moe_layers < 0 ||
      s.max_tokens < 1 || s.max_items < 1 || s.max_block_refs < 1 || s.vocab < 1 ||
      s.max_slots < s.experts || s.block_size < 1 || s.cache_blocks < 1 || s.cache_block_bytes < 1)
    throw Error("expert parallelism: inconsistent segment shape");
}

}  // namespace

size_t EpSegment::bytes(const EpShape& shape) {
  check_shape(shape);
  return Sizes(shape).total(shape.ranks);
}

EpSegment::EpSegment(std::byte* base) {
  header_ = reinterpret_cast<Header*>(base);
  const Sizes z(header_->shape);
  std::byte* p = base + z.header;
  item_count_ = reinterpret_cast<int64_t*>(p);
  items_ = reinterpret_cast<ItemDesc*>(p + sizeof(int64_t));
  p += z.items;
  tokens_ = reinterpret_cast<int32_t*>(p);
  p += z.tokens;
  blocks_ = reinterpret_cast<int32_t*>(p);
  p += z.blocks;
  tables_[0] = p;
  tables_[1] = p + z.table;
  p += 2 * z.table;
  ranks_ = p;
  p += z.rank * size_t(header_->shape.ranks);
  logits_ = reinterpret_cast<float*>(p);
  p += z.logits;
  cache_ = p;
}

EpSegment EpSegment::format(const SharedSegment& memory, const EpShape& shape) {
  if (memory.size() != bytes(shape))
    throw Error("expert parallelism: the segment's size is not its layout's");
  auto* h = new (memory.data()) Header();
  h->shape = shape;
  h->magic = kMagic;
  return EpSegment(memory.data());
}

EpSegment EpSegment::open(const SharedSegment& memory) {
  if (memory.size() < sizeof(Header))
    throw Error("expert parallelism: the shared segment is too small for a header");
  const auto* h = reinterpret_cast<const Header*>(memory.data());
  if (h->magic != kMagic)
    throw Error("expert parallelism: the shared segment is not an EP segment");
  check_shape(h->shape);
  // Equal, not just large enough: a rank from another build would lay the segment out otherwise.
  if (memory.size() != bytes(h->shape))
    throw Error(
        "expert parallelism: the shared segment's layout differs from this program's "
        "(the engine and its ranks must be the same build)");
  return EpSegment(memory.data());
}

PlacementTable EpSegment::table(uint32_t which) const {
  const EpShape& s = header_->shape;
  auto* p = reinterpret_cast<int32_t*>(tables_[which & 1]);
  return {p, p + s.moe_layers, p + s.moe_layers + s.moe_layers * s.max_slots};
}

RankArea EpSegment::rank(int r) const {
  const Sizes z(header_->shape);
  std::byte* p = ranks_ + z.rank * size_t(r);
  RankArea a{};
  // Both counters in the area's first cache line.
  a.entry_count = reinterpret_cast<std::atomic<int64_t>*>(p);
  a.arrivals = reinterpret_cast<std::atomic<uint32_t>*>(p + sizeof(std::atomic<int64_t>));
  p += 64;
  a.entries = reinterpret_cast<Entry*>(p);
  p += z.entries;
  a.result_row = reinterpret_cast<int64_t*>(p);
  p += z.result_rows;
  a.rows = reinterpret_cast<float*>(p);
  p += z.rows;
  a.results = reinterpret_cast<float*>(p);
  p += z.results;
  a.routed = reinterpret_cast<int64_t*>(p);
  p += z.routed;
  a.work = reinterpret_cast<RankWork*>(p);
  return a;
}

void write_placement(const PlacementTable& table, const EpShape& shape,
                     const placement::Placement& placement) {
  if (placement.num_layers() != shape.moe_layers)
    throw Error("placement: has " + std::to_string(placement.num_layers()) +
                " layers, the model has " + std::to_string(shape.moe_layers) + " MoE layers");
  if (placement.ranks != shape.ranks)
    throw Error("placement: is for " + std::to_string(placement.ranks) + " ranks, the engine has " +
                std::to_string(shape.ranks));
  if (placement.experts != shape.experts)
    throw Error("placement: places " + std::to_string(placement.experts) +
                " experts, the model has " + std::to_string(shape.experts));
  for (int64_t l = 0; l < shape.moe_layers; ++l) {
    int32_t slot = 0;
    if (placement.slots(l) > shape.max_slots)
      throw Error("placement: layer " + std::to_string(l) + " has " +
                  std::to_string(placement.slots(l)) + " slots, at most " +
                  std::to_string(shape.max_slots) +
                  " fit (one copy of every expert on every rank, or the start placement's most "
                  "slots in a layer if more: restart the engine with an --expert-placement that "
                  "has as many slots in a layer to make room)");
    for (int r = 0; r < shape.ranks; ++r)
      for (int32_t e : placement.layers[l][r]) {
        table.slot_rank[l * shape.max_slots + slot] = r;
        table.slot_expert[l * shape.max_slots + slot] = e;
        ++slot;
      }
    table.slot_count[l] = slot;
  }
}

placement::Placement read_placement(const PlacementTable& table, const EpShape& shape) {
  placement::Placement p{shape.ranks, shape.experts, {}};
  for (int64_t l = 0; l < shape.moe_layers; ++l) {
    auto& layer = p.layers.emplace_back(shape.ranks);
    for (int32_t s = 0; s < table.slot_count[l]; ++s)
      layer[table.slot_rank[l * shape.max_slots + s]].push_back(
          table.slot_expert[l * shape.max_slots + s]);
  }
  return p;
}

}  // namespace tandem::engine::ep
