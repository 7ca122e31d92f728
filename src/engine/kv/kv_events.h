#pragma once
// KV-cache events in vLLM's wire format, and the ZMQ publisher that sends them.
//
// The engine's KvCacheManager records what enters and leaves its prefix cache; once per step the
// engine takes those events, wraps them in a KvEventBatch and hands it to a KvEventPublisher.
// Routers (our gateway, llm-d, Dynamo) rebuild each engine's cache contents from the stream.
//
// Payload: msgpack in vLLM's array_like form (msgspec structs with array_like=True,
// omit_defaults=True, tag = class name), which llm-d's Go decoder and the vLLM releases Dynamo
// consumes expect:
//   batch        = [ts (float64, unix seconds), [event...], data_parallel_rank (int)]
//                  (the rank is omitted, giving a 2-element array, when the batch has none)
//   BlockStored  = ["BlockStored", [hash...], parent_hash or nil, [token...], block_size,
//                   lora_id or nil, medium, lora_name or nil]
//   BlockRemoved = ["BlockRemoved", [hash...], medium]
//   AllBlocksCleared = ["AllBlocksCleared"]
// Hashes are unsigned 64-bit integers (api/block_hash.h), as with vLLM's default
// VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1.
//
// Transport (ZmqKvEventPublisher): a PUB socket sends multipart [topic, seq, payload] with seq an
// 8-byte big-endian counter from 0; an optional ROUTER socket answers replay requests
// [identity, "", start_seq (8 bytes BE)] with [identity, "", seq, payload] for every buffered
// batch with seq >= start_seq, then [identity, "", 0xFFFFFFFFFFFFFFFF (-1), ""].
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace tandem::engine {

// A run of consecutive full blocks of one sequence that entered the prefix cache.
struct BlockStored {
  std::vector<uint64_t> block_hashes;
  std::optional<uint64_t> parent_block_hash;  // hash of the block before the first; none at start
  std::vector<int32_t> token_ids;             // block_hashes.size() * block_size ids
  int64_t block_size = 0;
  std::optional<int64_t> lora_id;  // deprecated in vLLM; we have no LoRA
  std::string medium = "CPU";
  std::optional<std::string> lora_name;
};

// Blocks evicted from the prefix cache.
struct BlockRemoved {
  std::vector<uint64_t> block_hashes;
  std::string medium = "CPU";
};

// The whole prefix cache was dropped (reset_prefix_cache).
struct AllBlocksCleared {};

using KvEvent = std::variant<BlockStored, BlockRemoved, AllBlocksCleared>;

struct KvEventBatch {
  double ts = 0;  // unix time in seconds
  std::vector<KvEvent> events;
  std::optional<int64_t> data_parallel_rank;
};

// The msgpack payload of one batch (see the format above).
std::string encode_kv_event_batch(const KvEventBatch& batch);

// vLLM's --kv-events-config, parsed from the same JSON.
struct KvEventsConfig {
  bool enable_kv_cache_events = false;
  std::string publisher = "null";  // "null" or "zmq"; when not given: "zmq" if enabled
  std::string endpoint = "tcp://*:5557";
  std::optional<std::string> replay_endpoint;
  int64_t buffer_steps = 10000;     // batches kept for replay
  int64_t hwm = 100000;             // high-water mark of the PUB socket
  int64_t max_queue_size = 100000;  // batches waiting for the publisher thread; more are dropped
  std::string topic;

  // Throws tandem::Error naming the field on unknown fields, wrong types or bad values.
  static KvEventsConfig parse(std::string_view json);
};

// The endpoint a data-parallel rank uses, as vLLM derives it: rank 0 keeps `endpoint`; otherwise
// a numeric TCP port is offset by the rank and inproc/ipc names get the suffix "_dp<rank>".
std::string offset_endpoint_port(const std::string& endpoint, int64_t data_parallel_rank);

class KvEventPublisher {
 public:
  virtual ~KvEventPublisher() = default;
  // Queues a batch for sending; never blocks the caller.
  virtual void publish(KvEventBatch batch) = 0;
};

// Publishes nothing (events disabled).
class NullKvEventPublisher final : public KvEventPublisher {
 public:
  void publish(KvEventBatch) override {}
};

// PUB + replay ROUTER publisher. A background thread owns the sockets, encodes and sends; publish()
// only appends to a queue. Sequence numbers are assigned in publish() order, so a batch dropped
// because the queue is full leaves a gap subscribers can see. Binds the endpoint if it contains
// "*" or "::" or is ipc:// or inproc://, otherwise connects (vLLM's rule); the replay endpoint is
// always bound. "tcp://127.0.0.1:*" binds a free port; endpoint() then reports the actual one.
// publish() and flush() may be called from any thread.
class ZmqKvEventPublisher final : public KvEventPublisher {
 public:
  // Throws tandem::Error when an endpoint cannot be bound or connected.
  explicit ZmqKvEventPublisher(const KvEventsConfig& config, int64_t data_parallel_rank = 0);
  // Sends what is still queued, then closes the sockets.
  ~ZmqKvEventPublisher() override;

  // Stamps data_parallel_rank when the batch has none (as vLLM does) and queues it.
  void publish(KvEventBatch batch) override;
  // Returns once every batch queued before the call has been handed to the PUB socket.
  void flush();

  const std::string& endpoint() const;         // the bound address when bound
  const std::string& replay_endpoint() const;  // empty without a replay socket
  int64_t num_dropped() const;                 // batches dropped because the queue was full

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A ZmqKvEventPublisher when events are enabled with publisher "zmq", else a NullKvEventPublisher.
std::unique_ptr<KvEventPublisher> make_kv_event_publisher(const KvEventsConfig& config,
                                                          int64_t data_parallel_rank = 0);

}  // namespace tandem::engine
