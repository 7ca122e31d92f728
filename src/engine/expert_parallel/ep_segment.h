#pragma once
// The layout of an expert-parallel engine's one shared segment: a header (shape, the step and
// barrier words), the step the front posts (sequences, tokens, block tables, which rank runs
// each), two placement tables (the one in force and the next), one exchange area per rank, the
// sampled rows' logits, and the paged latent cache every rank reads and writes.
//
// A rank's exchange area holds what it dispatches (its tokens' normalised rows and one entry per
// (token, chosen expert)), what it computes for others (the rows of its
// slots' results, found through result_row) and its routes per (MoE layer, expert) of the step.
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "engine/executor/executor.h"
#include "placement/placement.h"
#include "util/shared_memory.h"

namespace tandem::engine::ep {

struct EpShape {
  int32_t ranks = 0;
  int32_t cache_type = 0;  // kernels::LatentType
  int64_t hidden = 0, top_k = 0, experts = 0, moe_layers = 0;
  int64_t max_tokens = 0;      // new tokens per step
  int64_t max_items = 0;       // sequences per step
  int64_t max_block_refs = 0;  // block-table entries per step, all sequences together
  int64_t vocab = 0;
  int64_t max_slots = 0;  // physical expert slots per layer
  int64_t block_size = 0, cache_blocks = 0, cache_block_bytes = 0;
  bool operator==(const EpShape&) const = default;
};

enum class Command : uint32_t { kNone = 0, kStep = 1, kShutdown = 2, kSwitchPlacement = 3 };

struct alignas(64) Header {
  uint64_t magic = 0;
  EpShape shape;
  std::atomic<uint32_t> posted{0};   // bumped by the front for every command (a futex word)
  std::atomic<uint32_t> command{0};  // Command
  std::atomic<uint32_t> abort{0};    // set once a rank failed: every wait gives up
  std::atomic<uint32_t> table{0};    // the placement table in force (0 or 1)
  // A live remap: the front writes the other table, bumps `staged` (a futex word); each rank's
  // loader loads its new copies in the background and bumps `prepared` (a futex word); then
  // the front posts kSwitchPlacement between two steps.
  std::atomic<uint32_t> staged{0};
  std::atomic<uint32_t> prepared{0};
  SharedBarrier barrier;
};

struct ItemDesc {
  int32_t rank = 0;
  int32_t sample = 0;
  int64_t start = 0;  // position of the first new token
  int64_t first_token = 0, tokens = 0;
  int64_t first_block = 0, blocks = 0;
};

struct Entry {  // one token's use of one expert; the copy it runs on is slots_for_entries'
  int32_t token = 0;
  int32_t expert = 0;  // logical
  float weight = 0;
};

struct PlacementTable {
  int32_t* slot_count;   // [moe_layers]
  int32_t* slot_rank;    // [moe_layers][max_slots]
  int32_t* slot_expert;  // [moe_layers][max_slots]
};

struct RankArea {
  std::atomic<int64_t>* entry_count;
  // Barriers this rank has reached since it started: the front names a stalled rank by it
  // (stall_watch.h).
  std::atomic<uint32_t>* arrivals;
  Entry* entries;       // [max_tokens * top_k]
  int64_t* result_row;  // per entry: the row of its result in its slot's rank's `results`
  float* rows;          // [max_tokens, hidden]
  float* results;       // [max_tokens * top_k, hidden]
  int64_t* routed;      // [moe_layers, experts] this step
  RankWork* work;       // the rank's figures since it started, copied in at the end of each step
};

class EpSegment {
 public:
  static size_t bytes(const EpShape& shape);
  // Lays out a fresh (zero) segment for `shape`.
  static EpSegment format(const SharedSegment& memory, const EpShape& shape);
  // An existing segment; throws when it is not one.
  static EpSegment open(const SharedSegment& memory);

  Header& header() const { return *header_; }
  const EpShape& shape() const { return header_->shape; }
  int64_t& item_count() const { return *item_count_; }
  ItemDesc* items() const { return items_; }
  int32_t* tokens() const { return tokens_; }
  int32_t* blocks() const { return blocks_; }
  PlacementTable table(uint32_t which) const;
  RankArea rank(int r) const;
  float* logits(int64_t item) const { return logits_ + item * header_->shape.vocab; }
  std::byte* cache() const { return cache_; }

 private:
  explicit EpSegment(std::byte* base);
  Header* header_ = nullptr;
  int64_t* item_count_ = nullptr;
  ItemDesc* items_ = nullptr;
  int32_t *tokens_ = nullptr, *blocks_ = nullptr;
  std::byte* tables_[2] = {};
  std::byte* ranks_ = nullptr;
  float* logits_ = nullptr;
  std::byte* cache_ = nullptr;
};

// The placement's slots as a table (throws when it needs more layers or slots than the table
// has), and back.
void write_placement(const PlacementTable& table, const EpShape& shape,
                     const placement::Placement& placement);
placement::Placement read_placement(const PlacementTable& table, const EpShape& shape);

}  // namespace tandem::engine::ep
