// KV-cache events on the wire: a KvCacheManager scenario (store, hit, evict, clear) published over
// ZMQ and decoded by an independent Python subscriber (msgpack + pyzmq, block hashes recomputed
// from the token ids), live, with a forced gap filled from the replay socket, and replayed by a
// late subscriber. Plus msgpack bytes checked against the msgpack specification, and config
// parsing.
#include "engine/kv/kv_events.h"

#include <poll.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "engine/kv/kv_cache_manager.h"
#include "text/oracle_support.h"
#include "util/error.h"

namespace tandem::engine {
namespace {

using nlohmann::json;

// The Python subscriber as a child process whose stdout we read line by line (JSON).
class Subscriber {
 public:
  explicit Subscriber(const std::string& args) : err_(test::temp_path("kv-subscriber-err")) {
    const std::string command = "/usr/bin/python3 " +
                                test::quote(test::oracle_dir() / "kv_events_subscriber.py") + " " +
                                args + " 2> " + test::quote(err_);
    pipe_ = ::popen(command.c_str(), "r");
    if (!pipe_) throw std::runtime_error("cannot start " + command);
  }
  ~Subscriber() {
    if (pipe_) ::pclose(pipe_);
    std::filesystem::remove(err_);
  }

  // The next line of output, or nullopt on end of output or after `timeout_ms`.
  std::optional<json> next(int timeout_ms) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    for (;;) {
      const size_t newline = buffer_.find('\n');
      if (newline != std::string::npos) {
        std::string line = buffer_.substr(0, newline);
        buffer_.erase(0, newline + 1);
        return json::parse(line);
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::nullopt;
      pollfd fd{::fileno(pipe_), POLLIN, 0};
      if (::poll(&fd, 1, static_cast<int>(left.count())) <= 0) continue;
      char chunk[65536];
      const ssize_t n = ::read(fd.fd, chunk, sizeof(chunk));
      if (n <= 0) return std::nullopt;  // end of output
      buffer_.append(chunk, static_cast<size_t>(n));
    }
  }

  // Reads everything left; returns the exit status.
  int finish(std::vector<json>& lines) {
    while (auto line = next(30000)) lines.push_back(*line);
    const int status = ::pclose(pipe_);
    pipe_ = nullptr;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  std::string stderr_text() const {
    std::ifstream in(err_);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }

 private:
  FILE* pipe_ = nullptr;
  std::filesystem::path err_;
  std::string buffer_;
};

std::vector<int32_t> tokens_from(int32_t first, size_t n) {
  std::vector<int32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = first + static_cast<int32_t>(i * 7919 % 1000);
  return t;
}

// One engine step of the scenario: the events it produced and the cache contents after it.
struct Step {
  std::vector<KvEvent> events;
  std::set<uint64_t> cached;
};

std::set<uint64_t> cached_set(const KvCacheManager& m) {
  std::set<uint64_t> out;
  for (int32_t b = 0; b < m.num_blocks(); ++b) {
    if (auto h = m.cached_hash(b)) out.insert(*h);
  }
  return out;
}

// store, store with a hit, evict, clear. 8 blocks of 4 tokens.
std::vector<Step> run_scenario() {
  KvCacheManager m(8, 4, true, KvCacheOptions{.enable_events = true, .medium = "CPU"});
  std::vector<Step> steps;
  const auto end_step = [&] { steps.push_back({m.take_events(), cached_set(m)}); };

  const auto a = tokens_from(1000, 13);  // 3 full blocks + 1 token
  EXPECT_TRUE(m.allocate("a", 13, m.find_cached_prefix(a)));
  m.cache_full_blocks("a", a);
  end_step();

  auto b = std::vector<int32_t>(a.begin(), a.begin() + 8);  // shares a's first two blocks
  const auto tail = tokens_from(5000, 9);
  b.insert(b.end(), tail.begin(), tail.end());
  const PrefixHit hit = m.find_cached_prefix(b);
  EXPECT_EQ(hit.num_tokens, 8);
  EXPECT_TRUE(m.allocate("b", 17, hit));
  m.cache_full_blocks("b", b);
  end_step();

  m.free("a");
  m.free("b");
  EXPECT_TRUE(m.allocate("big", 24));  // 3 uncached free blocks, then evicts 3 cached ones
  end_step();

  m.free("big");
  m.reset_prefix_cache();
  end_step();
  return steps;
}

KvEventBatch batch_of(const Step& step, double ts) {
  return KvEventBatch{ts, step.events, {}};
}

// Checks one decoded batch against the events published, and replays it into `replayed`.
void check_batch(const json& decoded, const Step& step, std::set<uint64_t>& replayed) {
  const json& events = decoded.at("events");
  ASSERT_EQ(events.size(), step.events.size());
  for (size_t i = 0; i < events.size(); ++i) {
    const json& e = events[i];
    if (const auto* s = std::get_if<BlockStored>(&step.events[i])) {
      ASSERT_EQ(e.at("type"), "BlockStored");
      EXPECT_EQ(e.at("block_hashes").get<std::vector<uint64_t>>(), s->block_hashes);
      if (s->parent_block_hash) {
        EXPECT_EQ(e.at("parent_block_hash").get<uint64_t>(), *s->parent_block_hash);
      } else {
        EXPECT_TRUE(e.at("parent_block_hash").is_null());
      }
      EXPECT_EQ(e.at("token_ids").get<std::vector<int32_t>>(), s->token_ids);
      EXPECT_EQ(e.at("block_size"), 4);
      EXPECT_TRUE(e.at("lora_id").is_null());
      EXPECT_EQ(e.at("medium"), "CPU");
      EXPECT_TRUE(e.at("lora_name").is_null());
      // The Python side recomputed the chained hashes from token_ids and the parent.
      EXPECT_EQ(e.at("hashes_match_tokens"), true);
      for (const uint64_t h : e.at("block_hashes").get<std::vector<uint64_t>>()) replayed.insert(h);
    } else if (const auto* r = std::get_if<BlockRemoved>(&step.events[i])) {
      ASSERT_EQ(e.at("type"), "BlockRemoved");
      EXPECT_EQ(e.at("block_hashes").get<std::vector<uint64_t>>(), r->block_hashes);
      EXPECT_EQ(e.at("medium"), "CPU");
      for (const uint64_t h : r->block_hashes) EXPECT_EQ(replayed.erase(h), 1u);
    } else {
      ASSERT_EQ(e.at("type"), "AllBlocksCleared");
      replayed.clear();
    }
  }
  EXPECT_EQ(replayed, step.cached) << "the cache rebuilt from events differs from the engine's";
}

KvEventsConfig tcp_config(const std::string& topic) {
  return KvEventsConfig::parse(R"({"enable_kv_cache_events": true, "publisher": "zmq",
      "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*",
      "buffer_steps": 100, "hwm": 1000, "topic": ")" +
                               topic + R"("})");
}

// Starts a live subscriber and publishes empty probe batches until one reaches it, so the
// subscription is known to be in place before the scenario starts.
void wait_until_live(Subscriber& sub, ZmqKvEventPublisher& pub) {
  const auto ready = sub.next(20000);
  ASSERT_TRUE(ready && ready->value("ready", false)) << sub.stderr_text();
  for (int attempt = 0; attempt < 2000; ++attempt) {
    pub.publish(KvEventBatch{1.0, {}, {}});
    if (const auto line = sub.next(10)) {
      ASSERT_FALSE(line->contains("error")) << line->dump();
      EXPECT_TRUE(line->at("batch").at("events").empty());
      return;
    }
  }
  FAIL() << "no probe batch reached the subscriber: " << sub.stderr_text();
}

void run_live(const std::vector<int>& drop_nonempty) {
  const auto steps = run_scenario();
  ASSERT_EQ(steps.size(), 4u);
  const std::string topic = "kv@127.0.0.1@tiny-v3";
  ZmqKvEventPublisher pub(tcp_config(topic));
  ASSERT_TRUE(pub.endpoint().starts_with("tcp://127.0.0.1:")) << pub.endpoint();
  ASSERT_NE(pub.endpoint(), "tcp://127.0.0.1:*");
  std::string args = "subscribe --endpoint " + pub.endpoint() + " --replay " +
                     pub.replay_endpoint() + " --topic " + topic + " --batches 4";
  for (const int n : drop_nonempty) args += " --drop-nonempty " + std::to_string(n);
  Subscriber sub(args);
  wait_until_live(sub, pub);
  if (::testing::Test::HasFatalFailure()) return;
  for (size_t i = 0; i < steps.size(); ++i) pub.publish(batch_of(steps[i], 1700000000.5 + i));

  std::vector<json> lines;
  const int rc = sub.finish(lines);
  ASSERT_EQ(rc, 0) << sub.stderr_text() << (lines.empty() ? "" : lines.back().dump());
  std::vector<json> scenario;
  std::optional<uint64_t> last_seq;
  for (const json& line : lines) {
    ASSERT_FALSE(line.contains("error")) << line.dump();
    const uint64_t seq = line.at("seq");
    if (last_seq) {
      EXPECT_EQ(seq, *last_seq + 1) << "sequence numbers must be contiguous";
    }
    last_seq = seq;
    if (!line.at("batch").at("events").empty()) scenario.push_back(line);
  }
  ASSERT_EQ(scenario.size(), steps.size());
  std::set<uint64_t> replayed;
  for (size_t i = 0; i < steps.size(); ++i) {
    SCOPED_TRACE("step " + std::to_string(i));
    // Before the dropped batch everything arrives live; the dropped one comes from the replay
    // socket, and so may later ones that were already buffered when the gap was noticed.
    const int n = static_cast<int>(i + 1);
    if (drop_nonempty.empty() || n < drop_nonempty.front()) {
      EXPECT_EQ(scenario[i].at("via"), "live");
    } else if (n == drop_nonempty.front()) {
      EXPECT_EQ(scenario[i].at("via"), "replay");
    }
    EXPECT_DOUBLE_EQ(scenario[i].at("batch").at("ts").get<double>(), 1700000000.5 + i);
    EXPECT_EQ(scenario[i].at("batch").at("data_parallel_rank"), 0);  // stamped by the publisher
    check_batch(scenario[i].at("batch"), steps[i], replayed);
  }
  EXPECT_EQ(pub.num_dropped(), 0);
}

TEST(KvEventsTest, LiveSubscriberRebuildsTheCache) {
  run_live({});
}

TEST(KvEventsTest, SubscriberFillsAGapFromReplay) {
  run_live({2});
}

TEST(KvEventsTest, LateSubscriberReplaysFromAnySequence) {
  const auto steps = run_scenario();
  ZmqKvEventPublisher pub(tcp_config(""), /*data_parallel_rank=*/2);
  for (size_t i = 0; i < steps.size(); ++i) pub.publish(batch_of(steps[i], 10.0 + i));
  pub.flush();

  for (const int start : {0, 2, 9}) {
    SCOPED_TRACE("start " + std::to_string(start));
    Subscriber sub("replay --replay " + pub.replay_endpoint() + " --start " +
                   std::to_string(start));
    std::vector<json> lines;
    ASSERT_EQ(sub.finish(lines), 0) << sub.stderr_text();
    ASSERT_FALSE(lines.empty());
    EXPECT_EQ(lines.back(), json({{"end", true}}));
    lines.pop_back();
    const size_t expected = start < 4 ? 4 - static_cast<size_t>(start) : 0;
    ASSERT_EQ(lines.size(), expected);
    std::set<uint64_t> replayed;
    if (start == 0) {
      for (size_t i = 0; i < lines.size(); ++i) {
        EXPECT_EQ(lines[i].at("seq"), i);
        EXPECT_EQ(lines[i].at("batch").at("data_parallel_rank"), 2);
        check_batch(lines[i].at("batch"), steps[i], replayed);
      }
    } else {
      for (size_t i = 0; i < lines.size(); ++i) EXPECT_EQ(lines[i].at("seq"), start + i);
    }
  }
}

TEST(KvEventsTest, ReplayBufferKeepsTheLastBufferSteps) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("tandem-kv-events-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto config = KvEventsConfig::parse(R"({"enable_kv_cache_events": true, "buffer_steps": 3})");
  config.endpoint = "ipc://" + (dir / "pub").string();
  config.replay_endpoint = "ipc://" + (dir / "replay").string();
  {
    ZmqKvEventPublisher pub(config);
    EXPECT_EQ(pub.endpoint(), config.endpoint);
    for (int i = 0; i < 5; ++i) pub.publish(KvEventBatch{double(i), {AllBlocksCleared{}}, {}});
    pub.flush();
    Subscriber sub("replay --replay " + pub.replay_endpoint());
    std::vector<json> lines;
    ASSERT_EQ(sub.finish(lines), 0) << sub.stderr_text();
    ASSERT_EQ(lines.size(), 4u);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(lines[i].at("seq"), i + 2);
      EXPECT_EQ(lines[i].at("batch").at("events")[0].at("type"), "AllBlocksCleared");
    }
    EXPECT_EQ(lines[3], json({{"end", true}}));
  }
  std::filesystem::remove_all(dir);
}

// Byte-level checks against the msgpack specification (independent of msgpack-cxx).
TEST(KvEventsTest, EncodingMatchesMsgpackSpec) {
  auto bytes = [](std::initializer_list<int> v) {
    std::string s;
    for (int c : v) s.push_back(static_cast<char>(c));
    return s;
  };
  const std::string tag = "AllBlocksCleared";
  // [1.5, [["AllBlocksCleared"]], 3]: fixarray(3), float64 1.5 (0x3FF8...), fixarray(1),
  // fixarray(1), fixstr(16), positive fixint 3.
  std::string expected = bytes({0x93, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, 0x91, 0x91, 0xb0});
  expected += tag + bytes({0x03});
  EXPECT_EQ(encode_kv_event_batch({1.5, {AllBlocksCleared{}}, 3}), expected);
  // No rank: a 2-element batch, as msgspec's omit_defaults writes it.
  expected = bytes({0x92, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, 0x90});
  EXPECT_EQ(encode_kv_event_batch({1.5, {}, {}}), expected);

  BlockStored stored;
  stored.block_hashes = {0xFFFFFFFFFFFFFFFEULL};
  stored.token_ids = {1, 300};
  stored.block_size = 2;
  BlockRemoved removed{{5}, "CPU"};
  expected = bytes({0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x92});
  expected += bytes({0x98, 0xab}) + "BlockStored";
  expected += bytes({0x91, 0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe});  // uint64
  expected += bytes({0xc0});                                                        // nil parent
  expected += bytes({0x92, 0x01, 0xcd, 0x01, 0x2c});  // [1, 300 as uint16]
  expected += bytes({0x02, 0xc0, 0xa3}) + "CPU" + bytes({0xc0});
  expected += bytes({0x93, 0xac}) + "BlockRemoved" + bytes({0x91, 0x05, 0xa3}) + "CPU";
  EXPECT_EQ(encode_kv_event_batch({0.0, {stored, removed}, {}}), expected);
}

TEST(KvEventsTest, ConfigParsing) {
  const auto c = KvEventsConfig::parse(
      R"({"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",
          "replay_endpoint":"tcp://*:5558","buffer_steps":10000,"hwm":100000,"topic":""})");
  EXPECT_TRUE(c.enable_kv_cache_events);
  EXPECT_EQ(c.publisher, "zmq");
  EXPECT_EQ(c.endpoint, "tcp://*:5557");
  EXPECT_EQ(c.replay_endpoint, "tcp://*:5558");
  EXPECT_EQ(c.buffer_steps, 10000);
  EXPECT_EQ(c.hwm, 100000);
  EXPECT_EQ(c.max_queue_size, 100000);
  EXPECT_EQ(c.topic, "");

  EXPECT_EQ(KvEventsConfig::parse(R"({"enable_kv_cache_events":true})").publisher, "zmq");
  EXPECT_EQ(KvEventsConfig::parse("{}").publisher, "null");
  EXPECT_FALSE(KvEventsConfig::parse("{}").replay_endpoint);

  const auto message = [](const std::string& j) {
    try {
      KvEventsConfig::parse(j);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(
      message(R"({"enable_kv_cache_event":true})").find("unknown field 'enable_kv_cache_event'"),
      std::string::npos);
  EXPECT_NE(message(R"({"hwm":"10"})").find("'hwm'"), std::string::npos);
  EXPECT_NE(message(R"({"buffer_steps":0})").find("'buffer_steps'"), std::string::npos);
  // hwm is a ZMQ int: 2^31 used to escape as an unexplained exception, and 2^32 wrapped to 0
  // (no limit at all).
  EXPECT_NE(message(R"({"hwm":2147483648})").find("'hwm' must be an integer from 0 to 2147483647"),
            std::string::npos);
  EXPECT_NE(message(R"({"hwm":4294967296})").find("'hwm'"), std::string::npos);
  EXPECT_NE(message(R"({"hwm":18446744073709551615})").find("'hwm'"), std::string::npos);
  EXPECT_EQ(KvEventsConfig::parse(R"({"hwm":2147483647})").hwm, 2147483647);
  EXPECT_NE(message(R"({"buffer_steps":4611686018427387904})").find("'buffer_steps'"),
            std::string::npos);
  EXPECT_NE(message(R"({"max_queue_size":10000001})").find("'max_queue_size'"), std::string::npos);
  // A value quoted in a message is an excerpt: a 60,000-element list is not written out whole,
  // a string past its 100 bytes neither, and deep nesting is refused as such (writing it out
  // recursed once per level).
  EXPECT_LT(message(R"({"hwm":)" + nlohmann::json(std::vector<int>(60000, 7)).dump() + "}").size(),
            300u);
  EXPECT_LT(message(R"({"publisher":")" + std::string(60000, 'k') + "\"}").size(), 300u);
  EXPECT_NE(message(R"({"hwm":)" + std::string(100000, '[') + std::string(100000, ']') + "}")
                .find("deeper than 64 levels"),
            std::string::npos);
  EXPECT_NE(message(R"({"publisher":"kafka"})").find("'publisher'"), std::string::npos);
  EXPECT_NE(message(R"({"enable_kv_cache_events":1})").find("'enable_kv_cache_events'"),
            std::string::npos);
  EXPECT_NE(message("[1]").find("JSON object"), std::string::npos);
  EXPECT_NE(message("{").find("not valid JSON"), std::string::npos);

  EXPECT_EQ(offset_endpoint_port("tcp://*:5557", 0), "tcp://*:5557");
  EXPECT_EQ(offset_endpoint_port("tcp://*:5557", 3), "tcp://*:5560");
  EXPECT_EQ(offset_endpoint_port("tcp://127.0.0.1:*", 3), "tcp://127.0.0.1:*");
  EXPECT_EQ(offset_endpoint_port("inproc://cache", 1), "inproc://cache_dp1");
  EXPECT_THROW(offset_endpoint_port("udp://x:1", 1), Error);
}

TEST(KvEventsTest, PublisherFactoryAndEndpoints) {
  auto null = make_kv_event_publisher(KvEventsConfig::parse("{}"));
  EXPECT_NE(dynamic_cast<NullKvEventPublisher*>(null.get()), nullptr);
  null->publish(KvEventBatch{});
  auto disabled = make_kv_event_publisher(
      KvEventsConfig::parse(R"({"enable_kv_cache_events":false,"publisher":"zmq"})"));
  EXPECT_NE(dynamic_cast<NullKvEventPublisher*>(disabled.get()), nullptr);

  // No '*': connect (succeeds even with nobody listening, as ZMQ connects lazily).
  auto connect =
      KvEventsConfig::parse(R"({"enable_kv_cache_events":true,"endpoint":"tcp://127.0.0.1:9"})");
  ZmqKvEventPublisher connected(connect);
  EXPECT_EQ(connected.endpoint(), "tcp://127.0.0.1:9");
  EXPECT_EQ(connected.replay_endpoint(), "");
  connected.publish(KvEventBatch{1.0, {AllBlocksCleared{}}, {}});
  connected.flush();

  auto bad = KvEventsConfig::parse(
      R"({"enable_kv_cache_events":true,"endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://*:notaport"})");
  EXPECT_THROW(ZmqKvEventPublisher{bad}, Error);
}

}  // namespace
}  // namespace tandem::engine
