#pragma once
// One engine's KV-cache event stream, applied to the gateway's PrefixIndex.
//
// Wire format (vLLM's, what src/engine/kv/kv_events.h publishes; docs/gateway.md): a ZMQ PUB
// socket sends multipart [topic, seq (8-byte big-endian, from 0), payload]; the payload is a
// msgpack EventBatch. vLLM versions disagree on its encoding, so each level is accepted either
// way: the batch as [ts, events, data_parallel_rank?, ...] or {"ts", "events",
// "data_parallel_rank"}; each event as [tag, field...] (msgspec array_like, tag = class name) or
// {"type": tag, field: ...}. Unknown event types, unknown map keys and extra trailing array
// fields are ignored. Block hashes may be unsigned or signed 64-bit integers or raw digest bytes
// (vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0; folded to their last 8 bytes, big-endian).
//
// Sequence numbers: a consumer applies batches in seq order exactly once. A live batch with a
// seq beyond the next expected one means batches were lost (PUB drops at its high-water mark,
// the engine drops when its queue is full): the consumer asks the engine's replay socket (a
// ROUTER; we connect a DEALER and send ["", start_seq (8 bytes BE)]) for everything from the
// first missing seq, applies the answer up to its end marker (seq -1), then goes on. A new
// consumer warms up the same way, from seq 0. If the replay cannot fill the gap (no replay
// endpoint, no answer, or the engine's buffer no longer holds the batches), the engine's blocks
// are cleared from the index, since removals may have been lost: the index may then miss blocks
// the engine holds (a lost cache hit), but never claims blocks it dropped. A live seq lower than
// the previous live one means the engine restarted (its counter starts at 0 again): its blocks
// are cleared and the consumer warms up again.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "gateway/prefix_index.h"

namespace tandem::gateway {

// ---- decoding (exposed for tests) ----

// The largest block_size a BlockStored may name. Engines use 16..a few thousand tokens (vLLM's
// hybrid models pad theirs to match a Mamba state's pages); each block's tokens are hashed in
// one buffer, so a publisher naming 2^61 would have the gateway allocate that.
inline constexpr int64_t kMaxKvEventBlockSize = int64_t{1} << 16;

struct KvEventRecord {
  enum class Kind { kBlockStored, kBlockRemoved, kAllBlocksCleared };
  Kind kind = Kind::kAllBlocksCleared;
  std::vector<uint64_t> block_hashes;
  std::optional<uint64_t> parent_block_hash;
  std::vector<int32_t> token_ids;
  int64_t block_size = 0;
  std::string medium;  // "" when the event has none
  // False when the blocks' identity depends on more than their token ids (a LoRA adapter,
  // multimodal inputs, a cache salt: vLLM's lora_id/lora_name/extra_keys) or they belong to a
  // KV-cache group other than the main one (group_idx != 0, e.g. sliding-window layers): the
  // index's token-id key cannot represent them, so they are not indexed.
  bool indexable = true;
};

struct KvEventBatchRecord {
  double ts = 0;
  std::vector<KvEventRecord> events;  // known event types only
  std::optional<int64_t> data_parallel_rank;
};

// Decodes one msgpack payload. Throws tandem::Error naming what is malformed (a block_size
// above kMaxKvEventBlockSize included).
KvEventBatchRecord decode_kv_event_payload(std::string_view payload);

// Applies a decoded batch to the index as engine `engine`'s events. A BlockStored whose
// block_size differs from the index's for that engine re-registers the engine with the new size
// (dropping what it held). Returns the number of events applied (skipped ones: not indexable,
// orphans).
int64_t apply_kv_event_batch(PrefixIndex& index, EngineKey engine, const KvEventBatchRecord& batch);

// ---- the consumer ----

struct KvEventsConsumerOptions {
  EngineKey engine = 0;
  std::string endpoint;         // the engine's PUB endpoint, e.g. "tcp://10.0.0.5:5557"
  std::string replay_endpoint;  // its replay ROUTER; empty: gaps cannot be filled
  std::string topic;            // subscription (prefix of the topic frame); "" = everything
  int64_t block_size = kDefaultKvBlockSize;  // until events say otherwise
  int replay_timeout_ms = 2000;              // silence from the replay socket that ends a replay
  int64_t receive_hwm = 100000;              // batches the SUB socket may queue
  // A message larger than this (live or replayed) makes ZMQ drop the connection it came on, so
  // a hostile or broken publisher cannot make the gateway buffer without bound. ZMQ does not
  // reconnect after it (a protocol error). A step's batch of a 128K-token prompt is about 1 MB.
  int64_t max_message_bytes = int64_t{64} << 20;
};

struct KvEventsConsumerStats {
  int64_t batches = 0;               // applied (live or replayed)
  int64_t replayed_batches = 0;      // of those, from the replay socket
  int64_t events = 0;                // applied events
  int64_t gaps = 0;                  // gaps seen (warm-up included)
  int64_t unfilled_gaps = 0;         // gaps replay could not fill (the engine was cleared)
  int64_t restarts = 0;              // engine restarts detected
  int64_t malformed = 0;             // messages or payloads that could not be decoded or applied
  std::optional<uint64_t> last_seq;  // the last seq applied
};

// Owns a thread with a SUB socket to one engine; starts with a warm-up replay from seq 0.
// Construct, then read the PrefixIndex from any thread; destroy (or stop()) to end.
class KvEventsConsumer {
 public:
  // Throws tandem::Error when an endpoint is malformed. `index` must outlive the consumer.
  KvEventsConsumer(PrefixIndex& index, KvEventsConsumerOptions options);
  ~KvEventsConsumer();
  KvEventsConsumer(const KvEventsConsumer&) = delete;
  KvEventsConsumer& operator=(const KvEventsConsumer&) = delete;

  // Stops the thread and closes the sockets; the index keeps what was applied. Idempotent.
  void stop();
  KvEventsConsumerStats stats() const;
  // Blocks until a batch with seq >= `seq` has been applied or `timeout_ms` passed; returns
  // whether it was (for tests and start-up).
  bool wait_for_seq(uint64_t seq, int timeout_ms) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::gateway
