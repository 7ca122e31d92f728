// Fuzzes the KV transfer protocol (engine/transfer/kv_transfer.h) on both ends with a hostile
// peer: the input is the stream of frames the peer sends ([u32 type][u32 zero][u64 bytes] +
// payload, parsed by parse_kv_frame_header like the TCP and shared-memory transports do).
//  - prefill side (the first input byte even): a KvTransferAgent serving the connection, with a
//    held transfer ("prefill-0", blocks 1 2 3, 10 tokens, prompt hash 1234) and a bootstrap room
//    (7, blocks 4 5 6, every layer ready), so valid pulls and registers get their layers;
//  - decode side (odd): a fetch, pulling transfer "prefill-0" or registering room 7, whose
//    answer (accept, layers, done, errors) comes from the input and lands in blocks 5 and 6.
// Bit 1 of that byte turns on the shared-secret handshake, bit 2 has the decode side receive into
// a buffer and write_kv instead of in place. The executor is a plain byte array whose block
// accessors trap on any block or size the agent was not given. The agent's own errors end a
// connection or a fetch; a crash, a sanitizer report, a hang, a payload read whose size is not
// the frame's, or a KV write outside the fetch's blocks is a finding.
#include <sched.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "engine/executor/executor.h"
#include "engine/transfer/kv_frame.h"
#include "engine/transfer/kv_transfer.h"
#include "engine/transfer/kv_transport.h"
#include "util/error.h"
#include "util/metrics.h"

namespace {

using namespace tandem;
using namespace tandem::engine;

void check(bool ok) {
  if (!ok) __builtin_trap();
}

constexpr int64_t kLayers = 2, kBlockSize = 4, kTokenBytes = 8, kBlocks = 8;
constexpr int64_t kBlockBytes = kBlockSize * kTokenBytes;

class ArrayExecutor final : public Executor {
 public:
  explicit ArrayExecutor(bool in_place)
      : in_place_(in_place), kv_(kBlocks * kLayers * kBlockBytes) {
    info_.model_name = "fuzz";
    info_.vocab_size = 1000;
    info_.max_model_len = 64;
    info_.num_blocks = kBlocks;
    info_.block_size = kBlockSize;
    info_.kv_layout = {"fuzz-model", kLayers, kBlockSize, kTokenBytes};
  }
  // Blocks the agent may read (held by the prefill side) and write (the decode side's fetch).
  std::vector<int32_t> readable, writable;

  const ExecutorInfo& info() const override { return info_; }
  ExecResult execute(std::span<const ExecItem>, const LayerHook&) override { __builtin_trap(); }
  const std::byte* kv_bytes(int32_t block, int64_t layer) const override {
    check(contains(readable, block) && layer >= 0 && layer < kLayers);
    return kv_.data() + offset(block, layer);
  }
  void write_kv(int32_t block, int64_t layer, std::span<const std::byte> bytes) override {
    check(contains(writable, block) && layer >= 0 && layer < kLayers &&
          bytes.size() <= size_t(kBlockBytes) && bytes.size() % kTokenBytes == 0);
    std::memcpy(kv_.data() + offset(block, layer), bytes.data(), bytes.size());
  }
  std::byte* kv_bytes_mutable(int32_t block, int64_t layer) override {
    if (!in_place_) return nullptr;
    check(contains(writable, block) && layer >= 0 && layer < kLayers);
    return kv_.data() + offset(block, layer);
  }

 private:
  static bool contains(const std::vector<int32_t>& v, int32_t b) {
    for (int32_t x : v)
      if (x == b) return true;
    return false;
  }
  static size_t offset(int32_t block, int64_t layer) {
    return size_t((int64_t(block) * kLayers + layer) * kBlockBytes);
  }
  bool in_place_;
  ExecutorInfo info_;
  std::vector<std::byte> kv_;
};

// What the harness waits for: the connection to be released by the agent.
struct Ending {
  std::mutex mutex;
  std::condition_variable changed;
  bool consumed = false;  // the agent read the whole input, or asked for more
  bool closed = false;    // the connection was destroyed
  void set(bool Ending::*flag) {
    std::lock_guard lock(mutex);
    this->*flag = true;
    changed.notify_all();
  }
};

class InputConnection final : public KvConnection {
 public:
  InputConnection(std::span<const uint8_t> in, Ending& ending) : in_(in), ending_(ending) {}
  ~InputConnection() override { ending_.set(&Ending::closed); }

  void send(KvFrameType, std::span<const std::span<const std::byte>> parts) override {
    if (shut_) throw Error("connection shut down");
    for (auto p : parts) sent_ += p.size();
  }
  KvFrameType receive_header(uint64_t& size, size_t max_payload) override {
    check(pending_ == 0);  // the previous payload was read whole
    take(kKvFrameHeaderBytes);
    const KvFrameType type = parse_kv_frame_header(
        reinterpret_cast<const std::byte*>(in_.data() + at_ - kKvFrameHeaderBytes), size,
        max_payload, "fuzz peer");
    pending_ = size;
    return type;
  }
  void receive_payload(std::span<const std::span<std::byte>> parts) override {
    size_t total = 0;
    for (auto p : parts) total += p.size();
    check(total == pending_);  // a transport reads exactly the frame's payload
    pending_ = 0;
    take(total);
    size_t from = at_ - total;
    for (auto p : parts) {
      if (!p.empty()) std::memcpy(p.data(), in_.data() + from, p.size());
      from += p.size();
    }
  }
  void set_timeout(std::chrono::milliseconds) override {}
  void shutdown() override { shut_ = true; }
  std::string peer() const override { return "fuzz peer"; }
  const char* kind() const override { return "fuzz"; }

 private:
  void take(size_t n) {
    if (shut_) throw Error("connection shut down");
    if (in_.size() - at_ < n) {
      pending_ = 0;
      ending_.set(&Ending::consumed);
      throw Error("the peer closed the connection");
    }
    at_ += n;
    if (at_ == in_.size()) ending_.set(&Ending::consumed);
  }
  std::span<const uint8_t> in_;
  Ending& ending_;
  size_t at_ = 0;
  uint64_t pending_ = 0;
  size_t sent_ = 0;
  bool shut_ = false;
};

// Hands the prefill side's listener one connection (the input) and the decode side the same.
struct Offer {
  std::mutex mutex;
  std::condition_variable changed;
  std::unique_ptr<KvConnection> connection;
  bool closed = false;
};

class OfferListener final : public KvListener {
 public:
  explicit OfferListener(Offer& offer) : offer_(offer) {}
  std::unique_ptr<KvConnection> accept() override {
    std::unique_lock lock(offer_.mutex);
    offer_.changed.wait(lock, [&] { return offer_.closed || offer_.connection; });
    if (offer_.closed) return nullptr;
    return std::move(offer_.connection);
  }
  uint16_t port() const override { return 1; }
  void close() override {
    std::lock_guard lock(offer_.mutex);
    offer_.closed = true;
    offer_.changed.notify_all();
  }

 private:
  Offer& offer_;
};

class OfferTransport final : public KvTransport {
 public:
  explicit OfferTransport(Offer& offer) : offer_(offer) {}
  std::string name() const override { return "fuzz"; }
  std::unique_ptr<KvListener> listen(const std::string&, uint16_t) override {
    return std::make_unique<OfferListener>(offer_);
  }
  std::unique_ptr<KvConnection> connect(const std::string&, uint16_t) override {
    std::lock_guard lock(offer_.mutex);
    if (!offer_.connection) throw Error("connection refused");
    return std::move(offer_.connection);
  }

 private:
  Offer& offer_;
};

KvTransferConfig config(const std::string& id, int port, bool secret) {
  KvTransferConfig c;
  c.engine_id = id;
  c.port = port;
  c.timeout_s = 60;  // nothing expires while an input runs: the runs are deterministic
  c.secret = secret ? "fuzz-secret" : "";
  c.checksum = true;
  return c;
}

void run_prefill(std::span<const uint8_t> frames, bool secret) {
  Ending ending;  // outlives the connection, wherever that is
  Offer offer;
  ArrayExecutor executor(true);
  executor.readable = {1, 2, 3, 4, 5, 6};
  metrics::Registry registry;
  {
    KvTransferAgent agent(config("prefill", 0, secret), executor,
                          std::make_unique<OfferTransport>(offer), registry,
                          [](auto task) { task(); });
    (void)agent.hold({1, 2, 3}, 1234, 10, [] {});
    const uint64_t claim = agent.open_room(7, 1234, 10, [](bool, const std::string&) {});
    agent.room_blocks(7, claim, {4, 5, 6});
    agent.room_layers_done(7, claim, kLayers);
    {
      std::lock_guard lock(offer.mutex);
      offer.connection = std::make_unique<InputConnection>(frames, ending);
      offer.changed.notify_all();
    }
    std::unique_lock lock(ending.mutex);
    // A register for a room that no prefill request claims waits for one until the timeout,
    // whether or not the input holds more frames (it reads none while it waits); stopping the
    // agent ends that wait. Everything else ends its connection within a millisecond or two.
    ending.changed.wait_for(lock, std::chrono::milliseconds(5),
                            [&] { return ending.closed || ending.consumed; });
    if (!ending.closed)
      ending.changed.wait_for(lock, std::chrono::milliseconds(2), [&] { return ending.closed; });
  }  // the agent stops: shuts the connection, waits for its threads
}

// The decode side keeps its agents (one per mode) across inputs, as an engine does: a fetch
// leaves nothing behind, and creating threads per input would dominate the run.
struct Decoder {
  Offer offer;
  ArrayExecutor executor;
  metrics::Registry registry;
  KvTransferAgent agent;
  Decoder(bool secret, bool in_place)
      : executor(in_place),
        agent(config("decode", -1, secret), executor, std::make_unique<OfferTransport>(offer),
              registry, [](auto task) { task(); }) {
    executor.writable = {5, 6};
  }
};

void run_decode(std::span<const uint8_t> frames, bool secret, bool in_place, bool pull) {
  static Decoder decoders[2][2] = {{Decoder(false, false), Decoder(false, true)},
                                   {Decoder(true, false), Decoder(true, true)}};
  Decoder& d = decoders[secret][in_place];
  Ending ending;
  {
    std::lock_guard lock(d.offer.mutex);
    d.offer.connection = std::make_unique<InputConnection>(frames, ending);
  }
  std::mutex mutex;
  std::condition_variable changed;
  bool done = false;
  KvFetch f;
  f.request_id = "r";
  f.pull = pull;
  f.host = "prefill";
  f.port = 1;
  f.engine_id = "prefill";
  f.transfer_id = "prefill-0";
  f.remote_blocks = {1, 2, 3};
  f.room = 7;
  f.prompt_hash = 1234;
  f.prompt_tokens = 10;
  f.first_token = 4;
  f.num_tokens = 9;
  f.local_blocks = {5, 6};
  d.agent.fetch(std::move(f), [&](const KvFetchResult&) {
    std::lock_guard lock(mutex);
    done = true;
    changed.notify_all();
  });
  {
    std::unique_lock lock(mutex);
    changed.wait(lock, [&] { return done; });
  }
  // The fetch's thread drops the connection after `done`: wait for it, `ending` goes now.
  std::unique_lock lock(ending.mutex);
  ending.changed.wait(lock, [&] { return ending.closed; });
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Each input hands work between threads (this one and the agent's); on one CPU a hand-off is a
  // context switch, across CPUs a wake-up that took about a millisecond here (5x fewer runs/s).
  // The threads started later inherit this.
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(sched_getcpu(), &one);
  sched_setaffinity(0, sizeof one, &one);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  const std::span<const uint8_t> frames(data + 1, size - 1);
  const bool secret = mode & 2;
  if (mode & 1)
    run_decode(frames, secret, !(mode & 4), !(mode & 8));
  else
    run_prefill(frames, secret);
  return 0;
}
