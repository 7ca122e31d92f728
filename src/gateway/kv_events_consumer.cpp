#include "gateway/kv_events_consumer.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

// msgpack-cxx without Boost: the header-only core is all we need.
#ifndef MSGPACK_NO_BOOST
#define MSGPACK_NO_BOOST
#endif
#include <msgpack.hpp>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "util/error.h"
#include "util/log_throttle.h"
#include "util/zmq_endpoint.h"

namespace tandem::gateway {
namespace {

using msgpack::object;
namespace mt = msgpack::type;

// ---- msgpack helpers ----

bool is_nil(const object* o) {
  return o == nullptr || o->type == mt::NIL;
}

std::string_view as_str(const object& o, const char* what) {
  if (o.type == mt::STR) return {o.via.str.ptr, o.via.str.size};
  if (o.type == mt::BIN) return {o.via.bin.ptr, o.via.bin.size};
  throw Error(std::string("kv event: '") + what + "' must be a string");
}

int64_t as_int(const object& o, const char* what) {
  if (o.type == mt::POSITIVE_INTEGER && o.via.u64 <= uint64_t(INT64_MAX)) {
    return static_cast<int64_t>(o.via.u64);
  }
  if (o.type == mt::NEGATIVE_INTEGER) return o.via.i64;
  throw Error(std::string("kv event: '") + what + "' must be an integer");
}

double as_number(const object& o, const char* what) {
  if (o.type == mt::FLOAT64 || o.type == mt::FLOAT32) return o.via.f64;
  if (o.type == mt::POSITIVE_INTEGER) return static_cast<double>(o.via.u64);
  if (o.type == mt::NEGATIVE_INTEGER) return static_cast<double>(o.via.i64);
  throw Error(std::string("kv event: '") + what + "' must be a number");
}

// vLLM's hashes: unsigned ints by default, signed (SGLang), or the raw digest as bytes.
uint64_t as_hash(const object& o) {
  if (o.type == mt::POSITIVE_INTEGER) return o.via.u64;
  if (o.type == mt::NEGATIVE_INTEGER) return static_cast<uint64_t>(o.via.i64);
  if (o.type == mt::BIN || o.type == mt::STR) {
    const std::string_view bytes = as_str(o, "block hash");
    const size_t from = bytes.size() > 8 ? bytes.size() - 8 : 0;
    uint64_t v = 0;
    for (size_t i = from; i < bytes.size(); ++i)
      v = (v << 8) | static_cast<unsigned char>(bytes[i]);
    return v;
  }
  throw Error("kv event: a block hash must be an integer or bytes");
}

std::span<const object> as_array(const object& o, const char* what) {
  if (o.type != mt::ARRAY) throw Error(std::string("kv event: '") + what + "' must be an array");
  return {o.via.array.ptr, o.via.array.size};
}

// An event or batch in either encoding: fields by position (array_like, after `skip` leading
// entries such as the tag) or by name (map).
class Fields {
 public:
  Fields(const object& o, size_t skip) : o_(o), skip_(skip) {}
  const object* get(const char* name, size_t position) const {
    if (o_.type == mt::ARRAY) {
      const size_t i = skip_ + position;
      return i < o_.via.array.size ? &o_.via.array.ptr[i] : nullptr;
    }
    for (uint32_t i = 0; i < o_.via.map.size; ++i) {
      const object& key = o_.via.map.ptr[i].key;
      if (key.type == mt::STR && std::string_view(key.via.str.ptr, key.via.str.size) == name) {
        return &o_.via.map.ptr[i].val;
      }
    }
    return nullptr;
  }

 private:
  const object& o_;
  size_t skip_;
};

std::vector<uint64_t> hashes_of(const object* o) {
  std::vector<uint64_t> out;
  if (is_nil(o)) throw Error("kv event: 'block_hashes' is missing");
  for (const object& h : as_array(*o, "block_hashes")) out.push_back(as_hash(h));
  return out;
}

// Whether a BlockStored's extra_keys name anything beyond the token ids (one entry per block,
// each nil or a tuple of keys).
bool has_extra_keys(const object* o) {
  if (is_nil(o)) return false;
  if (o->type != mt::ARRAY) return true;
  for (const object& per_block : as_array(*o, "extra_keys")) {
    if (per_block.type == mt::NIL) continue;
    if (per_block.type == mt::ARRAY && per_block.via.array.size == 0) continue;
    return true;
  }
  return false;
}

bool main_group(const object* group_idx) {
  return is_nil(group_idx) || as_int(*group_idx, "group_idx") == 0;
}

std::optional<KvEventRecord> decode_event(const object& o) {
  std::string_view tag;
  size_t skip = 0;
  if (o.type == mt::ARRAY) {
    if (o.via.array.size == 0) throw Error("kv event: an event array must start with its tag");
    tag = as_str(o.via.array.ptr[0], "tag");
    skip = 1;
  } else if (o.type == mt::MAP) {
    const object* type = Fields(o, 0).get("type", 0);
    if (is_nil(type)) throw Error("kv event: an event map must have a 'type'");
    tag = as_str(*type, "type");
  } else {
    throw Error("kv event: an event must be an array or a map");
  }
  const Fields f(o, skip);
  KvEventRecord e;
  if (tag == "BlockStored") {
    e.kind = KvEventRecord::Kind::kBlockStored;
    e.block_hashes = hashes_of(f.get("block_hashes", 0));
    if (const object* p = f.get("parent_block_hash", 1); !is_nil(p))
      e.parent_block_hash = as_hash(*p);
    if (const object* t = f.get("token_ids", 2); !is_nil(t)) {
      for (const object& id : as_array(*t, "token_ids")) {
        if (id.type == mt::ARRAY) {  // SGLang's EAGLE bigram pages: not plain token blocks
          e.indexable = false;
          e.token_ids.clear();
          break;
        }
        e.token_ids.push_back(static_cast<int32_t>(as_int(id, "token_ids")));
      }
    }
    if (const object* bs = f.get("block_size", 3); !is_nil(bs)) {
      e.block_size = as_int(*bs, "block_size");
      // 0 (or less) is a placeholder, not indexed (apply_kv_event_batch); the batch's other
      // events still apply.
      if (e.block_size > kMaxKvEventBlockSize) {
        throw Error("kv event: 'block_size' must be at most " +
                    std::to_string(kMaxKvEventBlockSize) + ", got " + std::to_string(e.block_size));
      }
    }
    if (const object* m = f.get("medium", 5); !is_nil(m)) e.medium = as_str(*m, "medium");
    if (!is_nil(f.get("lora_id", 4)) || !is_nil(f.get("lora_name", 6)) ||
        has_extra_keys(f.get("extra_keys", 7)) || !main_group(f.get("group_idx", 8))) {
      e.indexable = false;
    }
  } else if (tag == "BlockRemoved") {
    e.kind = KvEventRecord::Kind::kBlockRemoved;
    e.block_hashes = hashes_of(f.get("block_hashes", 0));
    if (const object* m = f.get("medium", 1); !is_nil(m)) e.medium = as_str(*m, "medium");
    if (!main_group(f.get("group_idx", 2))) e.indexable = false;
  } else if (tag == "AllBlocksCleared") {
    e.kind = KvEventRecord::Kind::kAllBlocksCleared;
  } else {
    return std::nullopt;  // a newer event type: not ours to understand
  }
  return e;
}

// ---- transport helpers ----

std::string be64(uint64_t v) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(v >> (56 - 8 * i));
  return out;
}

uint64_t read_be64(const zmq::message_t& m) {
  const auto* p = static_cast<const unsigned char*>(m.data());
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | p[i];
  return v;
}

constexpr uint64_t kReplayEnd = ~uint64_t{0};  // -1 as a signed 64-bit integer
constexpr size_t kMaxDepth = 16;               // msgpack nesting a payload may have

}  // namespace

KvEventBatchRecord decode_kv_event_payload(std::string_view payload) {
  msgpack::object_handle handle;
  try {
    // msgpack allocates an array's or a map's elements when it reads their count, before the
    // elements: a 5-byte payload claiming 2^32 map entries would allocate 128 GB. Every element
    // takes a byte at least, so no count can exceed the payload's size; the depth bounds how many
    // such claims are open at once (an event batch nests a few levels deep).
    const size_t n = payload.size();
    const msgpack::unpack_limit limit(n, n, n, n, n, kMaxDepth);
    handle = msgpack::unpack(payload.data(), payload.size(), nullptr, nullptr, limit);
  } catch (const std::exception& e) {
    throw Error(std::string("kv event batch: not valid msgpack: ") + e.what());
  }
  const object& o = handle.get();
  if (o.type != mt::ARRAY && o.type != mt::MAP) {
    throw Error("kv event batch: expected an array or a map");
  }
  const Fields f(o, 0);
  KvEventBatchRecord batch;
  if (const object* ts = f.get("ts", 0); !is_nil(ts)) batch.ts = as_number(*ts, "ts");
  const object* events = f.get("events", 1);
  if (is_nil(events)) throw Error("kv event batch: 'events' is missing");
  for (const object& event : as_array(*events, "events")) {
    if (auto e = decode_event(event)) batch.events.push_back(std::move(*e));
  }
  if (const object* rank = f.get("data_parallel_rank", 2); !is_nil(rank)) {
    batch.data_parallel_rank = as_int(*rank, "data_parallel_rank");
  }
  return batch;
}

int64_t apply_kv_event_batch(PrefixIndex& index, EngineKey engine,
                             const KvEventBatchRecord& batch) {
  int64_t applied = 0;
  for (const KvEventRecord& e : batch.events) {
    switch (e.kind) {
      case KvEventRecord::Kind::kBlockStored: {
        if (!e.indexable || e.block_size <= 0 || e.block_hashes.empty()) break;
        if (!tokens_fill_blocks(e.token_ids.size(), e.block_hashes.size(), e.block_size)) break;
        if (index.block_size(engine) != e.block_size) index.set_block_size(engine, e.block_size);
        if (index.add_blocks(engine, e.block_hashes, e.token_ids, e.parent_block_hash, e.medium)) {
          ++applied;
        }
        break;
      }
      case KvEventRecord::Kind::kBlockRemoved:
        if (!e.indexable) break;
        index.remove_blocks(engine, e.block_hashes, e.medium);
        ++applied;
        break;
      case KvEventRecord::Kind::kAllBlocksCleared:
        index.clear(engine);
        ++applied;
        break;
    }
  }
  return applied;
}

// ---- the consumer ----

struct KvEventsConsumer::Impl {
  PrefixIndex& index;
  KvEventsConsumerOptions options;
  zmq::context_t context{1};
  zmq::socket_t sub;
  int wake_fd = -1;
  std::thread thread;

  mutable std::mutex mutex;  // guards stats and stopping
  mutable std::condition_variable applied;
  KvEventsConsumerStats stats;
  bool stopping = false;
  bool stopped = false;

  // Owned by the thread.
  LogThrottle log_throttle{std::chrono::seconds(10)};
  uint64_t next_seq = 0;
  bool applied_any = false;
  std::optional<uint64_t> last_live;

  Impl(PrefixIndex& i, KvEventsConsumerOptions o) : index(i), options(std::move(o)) {}

  bool should_stop() const {
    std::lock_guard lock(mutex);
    return stopping;
  }

  template <typename F>
  void update(F&& f) {
    {
      std::lock_guard lock(mutex);
      f(stats);
    }
    applied.notify_all();
  }

  void apply(uint64_t seq, const zmq::message_t& payload, bool replayed) {
    next_seq = seq + 1;
    applied_any = true;
    try {
      const KvEventBatchRecord batch = decode_kv_event_payload(payload.to_string_view());
      const int64_t n = apply_kv_event_batch(index, options.engine, batch);
      update([&](KvEventsConsumerStats& s) {
        ++s.batches;
        s.replayed_batches += replayed;
        s.events += n;
        s.last_seq = seq;
      });
    } catch (const std::exception& e) {
      // A batch we cannot read or apply is skipped, not retried: the seq is spent either way.
      // Any exception: one escaping this thread ends the whole gateway (std::terminate).
      update([&](KvEventsConsumerStats& s) {
        ++s.malformed;
        s.last_seq = seq;
      });
      report("skipped batch " + std::to_string(seq), e.what());
    }
  }

  // A publisher decides how often this happens: one line per 10 s at most, with a count.
  void report(const std::string& what, const char* why) {
    if (const auto held_back = log_throttle.admit(LogThrottle::Clock::now())) {
      std::fprintf(stderr, "tandem gateway: KV events from %s: %s: %s%s\n",
                   options.endpoint.c_str(), what.c_str(), why,
                   *held_back > 0 ? (" (and " + std::to_string(*held_back) +
                                     " more such errors since the last line)")
                                        .c_str()
                                  : "");
    }
  }

  // Batches were lost and cannot be recovered: what the index holds for the engine may include
  // blocks it has since removed, so drop it all and go on from `seq`.
  void give_up_until(uint64_t seq) {
    if (applied_any) {
      index.clear(options.engine);
      update([](KvEventsConsumerStats& s) { ++s.unfilled_gaps; });
    }
    next_seq = seq;
  }

  // Asks the replay socket for every batch from next_seq and applies them. Returns false when
  // no complete answer came (no endpoint, timeout, stop).
  bool replay() {
    if (options.replay_endpoint.empty()) return false;
    // A fresh socket per request, so a late answer to an abandoned request cannot be mistaken
    // for the next one's.
    zmq::socket_t dealer(context, zmq::socket_type::dealer);
    dealer.set(zmq::sockopt::ipv6, zmq_endpoint_is_ipv6(options.replay_endpoint) ? 1 : 0);
    dealer.set(zmq::sockopt::linger, 0);
    dealer.set(zmq::sockopt::rcvhwm, 0);
    dealer.set(zmq::sockopt::maxmsgsize, options.max_message_bytes);
    dealer.connect(options.replay_endpoint);
    dealer.send(zmq::message_t(), zmq::send_flags::sndmore);
    dealer.send(zmq::buffer(be64(next_seq)), zmq::send_flags::none);
    zmq_pollitem_t items[2] = {{dealer.handle(), 0, ZMQ_POLLIN, 0},
                               {nullptr, wake_fd, ZMQ_POLLIN, 0}};
    for (;;) {
      int ready;
      try {
        ready = zmq::poll(items, 2, std::chrono::milliseconds(options.replay_timeout_ms));
      } catch (const zmq::error_t& e) {
        if (e.num() == EINTR) continue;
        return false;
      }
      if (ready == 0 || (items[1].revents & ZMQ_POLLIN)) return false;  // silence, or stop()
      for (;;) {
        // A replay may bring buffer_steps (10,000) batches, and stop() waits for this thread on
        // the gateway's scheduling thread (a restarted engine's consumer is rebuilt there).
        if (should_stop()) return false;
        std::vector<zmq::message_t> frames;
        if (!zmq::recv_multipart(dealer, std::back_inserter(frames), zmq::recv_flags::dontwait)) {
          break;
        }
        // [ "", seq, payload ]: the delimiter the ROUTER echoes, then the batch.
        if (frames.size() < 2 || frames[frames.size() - 2].size() != 8) {
          update([](KvEventsConsumerStats& s) { ++s.malformed; });
          continue;
        }
        const uint64_t seq = read_be64(frames[frames.size() - 2]);
        if (seq == kReplayEnd) return true;
        if (seq < next_seq) continue;
        if (seq > next_seq) give_up_until(seq);  // the engine's buffer starts later
        apply(seq, frames.back(), /*replayed=*/true);
      }
    }
  }

  void on_live(std::vector<zmq::message_t>& frames) {
    if (frames.size() != 3 || frames[1].size() != 8) {
      update([](KvEventsConsumerStats& s) { ++s.malformed; });
      return;
    }
    const uint64_t seq = read_be64(frames[1]);
    if (last_live && seq < *last_live) {
      // One publisher's live seqs only grow: the engine restarted and counts from 0 again.
      index.clear(options.engine);
      update([](KvEventsConsumerStats& s) { ++s.restarts; });
      next_seq = 0;
      applied_any = false;
    }
    last_live = seq;
    if (seq < next_seq) return;  // already applied from a replay
    if (seq > next_seq) {
      update([](KvEventsConsumerStats& s) { ++s.gaps; });
      replay();
      if (should_stop()) return;
      if (seq < next_seq) return;              // the replay covered it
      if (seq > next_seq) give_up_until(seq);  // the replay did not reach it
    }
    apply(seq, frames[2], /*replayed=*/false);
  }

  // The thread's body. Nothing may escape it (the process would end): a message that cannot be
  // handled is counted as malformed; a failure of the loop itself (sockets) ends this consumer
  // only, leaving the index as it was for the engine.
  void run() {
    try {
      follow();
    } catch (const std::exception& e) {
      report("stopped following the engine", e.what());
    } catch (...) {
      report("stopped following the engine", "an unknown error");
    }
  }

  // One message, whatever it holds: counted as malformed if handling it throws.
  template <typename F>
  void guarded(F&& handle) {
    try {
      handle();
    } catch (const std::exception& e) {
      update([](KvEventsConsumerStats& s) { ++s.malformed; });
      report("skipped a message", e.what());
    }
  }

  void follow() {
    // Subscribed before the warm-up, so nothing published after the replay's snapshot is lost;
    // what both deliver is applied once (by seq).
    guarded([this] { replay(); });
    zmq_pollitem_t items[2] = {{sub.handle(), 0, ZMQ_POLLIN, 0}, {nullptr, wake_fd, ZMQ_POLLIN, 0}};
    while (!should_stop()) {
      try {
        zmq::poll(items, 2, std::chrono::milliseconds(-1));
      } catch (const zmq::error_t& e) {
        if (e.num() == EINTR) continue;
        return;
      }
      if (items[1].revents & ZMQ_POLLIN) continue;  // stop() (checked by the loop)
      for (int i = 0; i < 1024 && !should_stop(); ++i) {
        std::vector<zmq::message_t> frames;
        if (!zmq::recv_multipart(sub, std::back_inserter(frames), zmq::recv_flags::dontwait)) {
          break;
        }
        guarded([&] { on_live(frames); });
      }
    }
  }
};

KvEventsConsumer::KvEventsConsumer(PrefixIndex& index, KvEventsConsumerOptions options)
    : impl_(std::make_unique<Impl>(index, std::move(options))) {
  Impl& s = *impl_;
  // The consumer owns its engine's entries: it rebuilds them from seq 0.
  index.clear(s.options.engine);
  index.set_block_size(s.options.engine, s.options.block_size);
  s.sub = zmq::socket_t(s.context, zmq::socket_type::sub);
  s.sub.set(zmq::sockopt::ipv6, zmq_endpoint_is_ipv6(s.options.endpoint) ? 1 : 0);
  s.sub.set(zmq::sockopt::linger, 0);
  s.sub.set(zmq::sockopt::rcvhwm,
            static_cast<int>(std::min<int64_t>(s.options.receive_hwm, 1 << 30)));
  s.sub.set(zmq::sockopt::maxmsgsize, s.options.max_message_bytes);
  s.sub.set(zmq::sockopt::subscribe, s.options.topic);
  try {
    s.sub.connect(s.options.endpoint);
  } catch (const zmq::error_t& e) {
    throw Error("kv events consumer: cannot connect to endpoint '" + s.options.endpoint +
                "': " + e.what());
  }
  if (!s.options.replay_endpoint.empty()) {
    // Validate now rather than on the thread: connect is lazy, so this only checks the address.
    zmq::socket_t probe(s.context, zmq::socket_type::dealer);
    probe.set(zmq::sockopt::ipv6, zmq_endpoint_is_ipv6(s.options.replay_endpoint) ? 1 : 0);
    probe.set(zmq::sockopt::linger, 0);
    try {
      probe.connect(s.options.replay_endpoint);
    } catch (const zmq::error_t& e) {
      throw Error("kv events consumer: cannot connect to replay endpoint '" +
                  s.options.replay_endpoint + "': " + e.what());
    }
  }
  s.wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (s.wake_fd < 0) {
    throw Error(std::string("kv events consumer: eventfd failed: ") + std::strerror(errno));
  }
  s.thread = std::thread([&s] { s.run(); });
}

KvEventsConsumer::~KvEventsConsumer() {
  stop();
}

void KvEventsConsumer::stop() {
  Impl& s = *impl_;
  {
    std::lock_guard lock(s.mutex);
    if (s.stopped) return;
    s.stopping = s.stopped = true;
  }
  const uint64_t one = 1;
  [[maybe_unused]] const ssize_t n = ::write(s.wake_fd, &one, sizeof(one));
  s.thread.join();
  s.sub.close();
  ::close(s.wake_fd);
  s.applied.notify_all();
}

KvEventsConsumerStats KvEventsConsumer::stats() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->stats;
}

bool KvEventsConsumer::wait_for_seq(uint64_t seq, int timeout_ms) const {
  std::unique_lock lock(impl_->mutex);
  return impl_->applied.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] {
    return impl_->stats.last_seq && *impl_->stats.last_seq >= seq;
  });
}

}  // namespace tandem::gateway
