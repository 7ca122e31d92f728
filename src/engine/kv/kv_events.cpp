#include "engine/kv/kv_events.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <bit>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

// msgpack-cxx without Boost: the header-only core is all we need.
#ifndef MSGPACK_NO_BOOST
#define MSGPACK_NO_BOOST
#endif
#include <msgpack.hpp>
#include <nlohmann/json.hpp>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "util/error.h"
#include "util/json.h"
#include "util/zmq_endpoint.h"

namespace tandem::engine {
namespace {

using Packer = msgpack::packer<msgpack::sbuffer>;

void pack_str(Packer& pk, std::string_view s) {
  pk.pack_str(static_cast<uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

void pack_hashes(Packer& pk, const std::vector<uint64_t>& hashes) {
  pk.pack_array(static_cast<uint32_t>(hashes.size()));
  for (const uint64_t h : hashes) pk.pack_uint64(h);
}

// msgspec's array_like + tag=True layout: the tag (class name) first, then the fields in
// declaration order; trailing fields that hold their default are omitted (omit_defaults), which
// for our events means the fields vLLM added later (extra_keys, group_idx, ...).
void pack_event(Packer& pk, const BlockStored& e) {
  pk.pack_array(8);
  pack_str(pk, "BlockStored");
  pack_hashes(pk, e.block_hashes);
  if (e.parent_block_hash)
    pk.pack_uint64(*e.parent_block_hash);
  else
    pk.pack_nil();
  pk.pack_array(static_cast<uint32_t>(e.token_ids.size()));
  for (const int32_t t : e.token_ids) pk.pack_int32(t);
  pk.pack_int64(e.block_size);
  if (e.lora_id)
    pk.pack_int64(*e.lora_id);
  else
    pk.pack_nil();
  pack_str(pk, e.medium);
  if (e.lora_name)
    pack_str(pk, *e.lora_name);
  else
    pk.pack_nil();
}

void pack_event(Packer& pk, const BlockRemoved& e) {
  pk.pack_array(3);
  pack_str(pk, "BlockRemoved");
  pack_hashes(pk, e.block_hashes);
  pack_str(pk, e.medium);
}

void pack_event(Packer& pk, const AllBlocksCleared&) {
  pk.pack_array(1);
  pack_str(pk, "AllBlocksCleared");
}

// msgpack-cxx's pack_double writes integral values as integers; vLLM's ts is always a float64
// (msgspec encodes Python floats so, and strict decoders expect it), so write the format by hand.
void pack_float64(msgpack::sbuffer& buffer, double d) {
  const auto bits = std::bit_cast<uint64_t>(d);
  char out[9];
  out[0] = static_cast<char>(0xcb);
  for (int i = 0; i < 8; ++i) out[1 + i] = static_cast<char>(bits >> (56 - 8 * i));
  buffer.write(out, sizeof(out));
}

std::string be64(uint64_t v) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(v >> (56 - 8 * i));
  return out;
}

uint64_t read_be64(const void* data) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | p[i];
  return v;
}

bool should_bind(const std::string& endpoint) {
  return endpoint.find('*') != std::string::npos || endpoint.find("::") != std::string::npos ||
         endpoint.starts_with("ipc://") || endpoint.starts_with("inproc://");
}

}  // namespace

std::string encode_kv_event_batch(const KvEventBatch& batch) {
  msgpack::sbuffer buffer;
  Packer pk(buffer);
  pk.pack_array(batch.data_parallel_rank ? 3 : 2);
  pack_float64(buffer, batch.ts);
  pk.pack_array(static_cast<uint32_t>(batch.events.size()));
  for (const KvEvent& event : batch.events) {
    std::visit([&](const auto& e) { pack_event(pk, e); }, event);
  }
  if (batch.data_parallel_rank) pk.pack_int64(*batch.data_parallel_rank);
  return std::string(buffer.data(), buffer.size());
}

// ---- configuration ----

// Steps of events kept for replay, or batches queued for the publisher: ten million is far past
// any deployment (vLLM's defaults are 10,000 and 100,000) and keeps `2 * (n + 1)` in range.
constexpr int64_t kMaxBuffered = 10'000'000;

KvEventsConfig KvEventsConfig::parse(std::string_view json) {
  nlohmann::json j;
  try {
    j = parse_untrusted_json(json);  // depth-bounded: a value may be quoted in an error
  } catch (const Error& e) {
    throw Error(std::string("--kv-events-config: not valid JSON: ") + e.what());
  }
  if (!j.is_object()) throw Error("--kv-events-config: expected a JSON object");
  KvEventsConfig config;
  bool publisher_given = false;
  // Bounded above too: hwm is a ZMQ int (a larger value wrapped, and 2^32 became 0, which ZMQ
  // reads as no limit), and the buffers are counts of batches kept in memory.
  const auto integer = [](const std::string& key, const nlohmann::json& v, int64_t min,
                          int64_t max) {
    const bool in_range = v.is_number_unsigned() ? v.get<uint64_t>() <= static_cast<uint64_t>(max)
                                                 : v.is_number_integer() && v.get<int64_t>() <= max;
    if (!in_range || v.get<int64_t>() < min) {
      throw Error("--kv-events-config: '" + key + "' must be an integer from " +
                  std::to_string(min) + " to " + std::to_string(max) + ", got " + json_excerpt(v));
    }
    return v.get<int64_t>();
  };
  const auto string = [](const std::string& key, const nlohmann::json& v) {
    if (!v.is_string()) throw Error("--kv-events-config: '" + key + "' must be a string");
    return v.get<std::string>();
  };
  for (const auto& [key, v] : j.items()) {
    if (key == "enable_kv_cache_events") {
      if (!v.is_boolean()) throw Error("--kv-events-config: '" + key + "' must be true or false");
      config.enable_kv_cache_events = v.get<bool>();
    } else if (key == "publisher") {
      if (!v.is_null()) {
        config.publisher = string(key, v);
        publisher_given = true;
        if (config.publisher != "null" && config.publisher != "zmq") {
          throw Error("--kv-events-config: 'publisher' must be \"null\" or \"zmq\", got " +
                      json_excerpt(v));
        }
      }
    } else if (key == "endpoint") {
      config.endpoint = string(key, v);
    } else if (key == "replay_endpoint") {
      if (v.is_null())
        config.replay_endpoint.reset();
      else
        config.replay_endpoint = string(key, v);
    } else if (key == "buffer_steps") {
      config.buffer_steps = integer(key, v, 1, kMaxBuffered);
    } else if (key == "hwm") {
      config.hwm = integer(key, v, 0, INT32_MAX);
    } else if (key == "max_queue_size") {
      config.max_queue_size = integer(key, v, 1, kMaxBuffered);
    } else if (key == "topic") {
      config.topic = string(key, v);
    } else {
      throw Error("--kv-events-config: unknown field '" + key +
                  "' (known: enable_kv_cache_events, publisher, endpoint, replay_endpoint, "
                  "buffer_steps, hwm, max_queue_size, topic)");
    }
  }
  if (!publisher_given) config.publisher = config.enable_kv_cache_events ? "zmq" : "null";
  return config;
}

std::string offset_endpoint_port(const std::string& endpoint, int64_t data_parallel_rank) {
  if (data_parallel_rank == 0 || endpoint.empty()) return endpoint;
  if (endpoint.starts_with("inproc://") || endpoint.starts_with("ipc://")) {
    return endpoint + "_dp" + std::to_string(data_parallel_rank);
  }
  const size_t colon = endpoint.rfind(':');
  if (endpoint.starts_with("tcp://") && colon != std::string::npos) {
    const std::string port = endpoint.substr(colon + 1);
    if (!port.empty() && port.find_first_not_of("0123456789") == std::string::npos) {
      return endpoint.substr(0, colon + 1) + std::to_string(std::stoll(port) + data_parallel_rank);
    }
    return endpoint;  // a wildcard port gives every rank its own port anyway
  }
  throw Error("kv events endpoint '" + endpoint + "' must be tcp://, ipc:// or inproc://");
}

// ---- ZMQ publisher ----

struct ZmqKvEventPublisher::Impl {
  int64_t dp_rank = 0;
  std::string topic;
  size_t buffer_steps = 0;
  size_t max_queue_size = 0;
  zmq::context_t context{1};
  zmq::socket_t pub;
  zmq::socket_t replay;
  bool has_replay = false;
  std::string endpoint, replay_endpoint;
  int wake_fd = -1;  // eventfd: lets publish() wake the thread that sleeps in zmq_poll

  std::mutex mutex;
  std::condition_variable idle;  // signalled when the thread finishes a round of sends
  std::deque<std::pair<uint64_t, KvEventBatch>> queue;
  uint64_t next_seq = 0;
  bool sending = false;
  bool stopping = false;
  std::atomic<int64_t> dropped{0};

  std::deque<std::pair<uint64_t, std::string>> history;  // owned by the thread
  std::thread thread;

  void wake() const {
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = ::write(wake_fd, &one, sizeof(one));
  }

  void send_batch(uint64_t seq, const KvEventBatch& batch) {
    std::string payload = encode_kv_event_batch(batch);
    const std::string seq_bytes = be64(seq);
    try {
      pub.send(zmq::buffer(topic), zmq::send_flags::sndmore);
      pub.send(zmq::buffer(seq_bytes), zmq::send_flags::sndmore);
      pub.send(zmq::buffer(payload), zmq::send_flags::none);
    } catch (const zmq::error_t&) {
      // PUB drops rather than blocks; an error here means a broken socket. The batch stays in
      // the history, so subscribers can still replay it.
    }
    history.emplace_back(seq, std::move(payload));
    while (history.size() > buffer_steps) history.pop_front();
  }

  void serve_replay() {
    for (;;) {
      std::vector<zmq::message_t> frames;
      std::optional<size_t> n;
      try {
        n = zmq::recv_multipart(replay, std::back_inserter(frames), zmq::recv_flags::dontwait);
      } catch (const zmq::error_t&) {
        return;
      }
      if (!n) return;                                             // nothing more waiting
      if (frames.size() != 3 || frames[2].size() != 8) continue;  // not a replay request
      const uint64_t start = read_be64(frames[2].data());
      const std::string identity = frames[0].to_string();
      try {
        for (const auto& [seq, payload] : history) {
          if (seq < start) continue;
          const std::string seq_bytes = be64(seq);
          replay.send(zmq::buffer(identity), zmq::send_flags::sndmore);
          replay.send(zmq::message_t(), zmq::send_flags::sndmore);
          replay.send(zmq::buffer(seq_bytes), zmq::send_flags::sndmore);
          replay.send(zmq::buffer(payload), zmq::send_flags::none);
        }
        const std::string end = be64(~uint64_t{0});  // -1 as a signed 64-bit integer
        replay.send(zmq::buffer(identity), zmq::send_flags::sndmore);
        replay.send(zmq::message_t(), zmq::send_flags::sndmore);
        replay.send(zmq::buffer(end), zmq::send_flags::sndmore);
        replay.send(zmq::message_t(), zmq::send_flags::none);
      } catch (const zmq::error_t&) {
        // The client went away; nothing to do.
      }
    }
  }

  void run() {
    zmq_pollitem_t items[2] = {{nullptr, wake_fd, ZMQ_POLLIN, 0}, {nullptr, -1, ZMQ_POLLIN, 0}};
    if (has_replay) items[1].socket = replay.handle();
    const size_t num_items = has_replay ? 2 : 1;
    for (;;) {
      try {
        zmq::poll(items, num_items, std::chrono::milliseconds(-1));
      } catch (const zmq::error_t& e) {
        if (e.num() != EINTR) throw;
        continue;
      }
      if (items[0].revents & ZMQ_POLLIN) {
        uint64_t count;
        [[maybe_unused]] const ssize_t n = ::read(wake_fd, &count, sizeof(count));
      }
      if (has_replay && (items[1].revents & ZMQ_POLLIN)) serve_replay();

      std::deque<std::pair<uint64_t, KvEventBatch>> work;
      bool stop;
      {
        std::lock_guard lock(mutex);
        work.swap(queue);
        stop = stopping;
        sending = !work.empty();
      }
      for (const auto& [seq, batch] : work) send_batch(seq, batch);
      {
        std::lock_guard lock(mutex);
        sending = false;
      }
      idle.notify_all();
      if (stop) return;  // everything queued before stopping was in `work`
    }
  }
};

ZmqKvEventPublisher::ZmqKvEventPublisher(const KvEventsConfig& config, int64_t data_parallel_rank)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.dp_rank = data_parallel_rank;
  s.topic = config.topic;
  s.buffer_steps = static_cast<size_t>(std::max<int64_t>(1, config.buffer_steps));
  s.max_queue_size = static_cast<size_t>(std::max<int64_t>(1, config.max_queue_size));
  const std::string endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank);

  s.pub = zmq::socket_t(s.context, zmq::socket_type::pub);
  s.pub.set(zmq::sockopt::ipv6, zmq_endpoint_is_ipv6(endpoint) ? 1 : 0);
  s.pub.set(zmq::sockopt::sndhwm, static_cast<int>(config.hwm));
  // A short linger gives subscribers a moment to receive the last batches at shutdown without
  // letting a stuck peer hold the process.
  s.pub.set(zmq::sockopt::linger, 100);
  try {
    if (should_bind(endpoint)) {
      s.pub.bind(endpoint);
      s.endpoint = s.pub.get(zmq::sockopt::last_endpoint);
    } else {
      s.pub.connect(endpoint);
      s.endpoint = endpoint;
    }
  } catch (const zmq::error_t& e) {
    throw Error("kv events: cannot " + std::string(should_bind(endpoint) ? "bind" : "connect") +
                " endpoint '" + endpoint + "': " + e.what());
  }
  if (config.replay_endpoint) {
    const std::string replay = offset_endpoint_port(*config.replay_endpoint, data_parallel_rank);
    s.replay = zmq::socket_t(s.context, zmq::socket_type::router);
    s.replay.set(zmq::sockopt::ipv6, zmq_endpoint_is_ipv6(replay) ? 1 : 0);
    s.replay.set(zmq::sockopt::linger, 0);
    // ROUTER drops replies beyond its high-water mark: leave room for one full replay.
    s.replay.set(zmq::sockopt::sndhwm,
                 static_cast<int>(std::min<int64_t>(2 * (config.buffer_steps + 1), 1 << 30)));
    try {
      s.replay.bind(replay);
    } catch (const zmq::error_t& e) {
      throw Error("kv events: cannot bind replay endpoint '" + replay + "': " + e.what());
    }
    s.replay_endpoint = s.replay.get(zmq::sockopt::last_endpoint);
    s.has_replay = true;
  }
  s.wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (s.wake_fd < 0) throw Error(std::string("kv events: eventfd failed: ") + std::strerror(errno));
  // The sockets move to the thread here; thread creation orders their setup before its use.
  s.thread = std::thread([&s] { s.run(); });
}

ZmqKvEventPublisher::~ZmqKvEventPublisher() {
  Impl& s = *impl_;
  {
    std::lock_guard lock(s.mutex);
    s.stopping = true;
  }
  s.wake();
  s.thread.join();
  s.pub.close();
  s.replay.close();
  ::close(s.wake_fd);
}

void ZmqKvEventPublisher::publish(KvEventBatch batch) {
  Impl& s = *impl_;
  if (!batch.data_parallel_rank) batch.data_parallel_rank = s.dp_rank;
  {
    std::lock_guard lock(s.mutex);
    const uint64_t seq = s.next_seq++;
    if (s.queue.size() >= s.max_queue_size) {
      // Never block the scheduler. The sequence number is spent, so subscribers see the gap.
      s.dropped.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    s.queue.emplace_back(seq, std::move(batch));
  }
  s.wake();
}

void ZmqKvEventPublisher::flush() {
  Impl& s = *impl_;
  s.wake();
  std::unique_lock lock(s.mutex);
  s.idle.wait(lock, [&] { return s.queue.empty() && !s.sending; });
}

const std::string& ZmqKvEventPublisher::endpoint() const {
  return impl_->endpoint;
}
const std::string& ZmqKvEventPublisher::replay_endpoint() const {
  return impl_->replay_endpoint;
}
int64_t ZmqKvEventPublisher::num_dropped() const {
  return impl_->dropped.load(std::memory_order_relaxed);
}

std::unique_ptr<KvEventPublisher> make_kv_event_publisher(const KvEventsConfig& config,
                                                          int64_t data_parallel_rank) {
  if (config.enable_kv_cache_events && config.publisher == "zmq") {
    return std::make_unique<ZmqKvEventPublisher>(config, data_parallel_rank);
  }
  return std::make_unique<NullKvEventPublisher>();
}

}  // namespace tandem::engine
