// A decode engine's releases and abandons (KvTransferAgent::release_remote, abandon_room) sent to
// prefill engines by its bounded pool of senders, over a fake network that stands for the prefill
// engines: hosts whose connects never complete (a hung or black-holed machine), hosts that answer
// each message at once, and a gate that holds every connect until the test opens it, so that
// messages queue. What the network saw (each message, in the order the prefill engines got them,
// and the most connections at once to each engine and each host) is checked against the bounds
// and the order the agent promises. Nothing here waits on time: waits are for events, under the
// shared hang guard.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "engine/transfer/kv_transfer.h"
#include "engine/transfer/kv_transport.h"
#include "kv_test_clock.h"
#include "util/bounded_wait.h"
#include "util/error.h"
#include "util/metrics.h"

namespace tandem::engine {
namespace {

using testing::kHangGuard;

// The most connections the network saw at once, to each engine (host:port), each host, and in
// all.
struct Peaks {
  std::map<std::string, int> by_peer, by_host;
  int total = 0;
};

// The prefill engines of the test, all in one object: connects by the decode engine's senders
// land here.
class ReleaseNetwork {
 public:
  // Connects to these hosts never complete; the sender gives up only when its agent asks it to
  // (its shutdown: the handshake timeout of these tests is longer than the hang guard).
  std::set<std::string> hung_hosts;
  // And to these engines ("host:port") alone.
  std::set<std::string> hung_peers;
  // These engines ("host:port") refuse this many messages as busy (every connection they allow
  // in use), then take them.
  std::map<std::string, int> busy_refusals;
  // When set, the time of each message's every try (attempts()).
  KvTestClock* clock = nullptr;
  bool refuse_as_busy(const std::string& peer) {
    std::lock_guard lock(mutex_);
    if (clock) attempts_[peer].push_back(clock->peek());
    changed_.notify_all();
    auto it = busy_refusals.find(peer);
    if (it == busy_refusals.end() || it->second == 0) return false;
    --it->second;
    return true;
  }

  // Connects to hosts that answer wait here until the gate opens.
  void close_gate() {
    std::lock_guard lock(mutex_);
    gate_open_ = false;
  }
  void open_gate() {
    {
      std::lock_guard lock(mutex_);
      gate_open_ = true;
    }
    changed_.notify_all();
  }

  // The messages each engine ("host:port") received, in order: a release's transfer id, an
  // abandon's "room N".
  std::map<std::string, std::vector<std::string>> received() const {
    std::lock_guard lock(mutex_);
    return received_;
  }
  Peaks peaks() const {
    std::lock_guard lock(mutex_);
    return peaks_;
  }
  // The times (`clock`) at which each engine ("host:port") was sent a message, refused or not.
  std::vector<KvTestClock::Clock::time_point> attempts(const std::string& peer) const {
    std::lock_guard lock(mutex_);
    auto it = attempts_.find(peer);
    return it == attempts_.end() ? std::vector<KvTestClock::Clock::time_point>{} : it->second;
  }
  // Waits until `peer` was sent `n` messages, refused or not; false when the hang guard ran out.
  bool wait_attempts(const std::string& peer, size_t n) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, kHangGuard, [&] { return attempts_[peer].size() >= n; });
  }
  // Waits until `done` holds of the connections open now; false when the hang guard ran out.
  bool wait_until_open(const std::function<bool(const Peaks&)>& done) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, kHangGuard, [&] {
      return done({open_by_peer_, open_by_host_, open_});
    });
  }
  // Waits until `done` holds of what the engines received; false when the hang guard ran out.
  bool wait_until(
      const std::function<bool(const std::map<std::string, std::vector<std::string>>&)>& done) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, kHangGuard, [&] { return done(received_); });
  }
  // Waits until each peer of `counts` received exactly its count of messages; false when the hang
  // guard ran out.
  bool wait_received(const std::map<std::string, size_t>& counts) {
    return wait_until([&](const auto& got) {
      for (const auto& [peer, n] : counts)
        if (!got.count(peer) || got.at(peer).size() != n) return false;
      return true;
    });
  }

  // Each message of an engine when it arrives: how many messages of that engine sent before it
  // (by the order of the decode engine's calls, `sequence`) had not arrived yet. Only those of
  // senders still on their way can be missing: at most the engine's senders but one.
  int most_overtaken() const {
    std::lock_guard lock(mutex_);
    return most_overtaken_;
  }
  // The order in which the test asked for each engine's messages (what most_overtaken compares
  // with).
  void expect(const std::string& peer, const std::string& message) {
    std::lock_guard lock(mutex_);
    sequence_[peer].push_back(message);
  }

  std::unique_ptr<KvConnection> connect(const std::string& host, uint16_t port,
                                        const KvTransport::GiveUp& give_up);

 private:
  friend class FakeConnection;
  void arrived(const std::string& peer, const std::string& message) {
    {
      std::lock_guard lock(mutex_);
      auto& got = received_[peer];
      got.push_back(message);
      const auto& asked = sequence_[peer];
      const auto at = std::find(asked.begin(), asked.end(), message);
      int missing = 0;
      for (auto it = asked.begin(); it != at; ++it)
        if (std::find(got.begin(), got.end(), *it) == got.end()) ++missing;
      most_overtaken_ = std::max(most_overtaken_, missing);
    }
    changed_.notify_all();
  }
  void connection_ended(const std::string& host, const std::string& peer) {
    {
      std::lock_guard lock(mutex_);
      --open_by_peer_[peer];
      --open_by_host_[host];
      --open_;
    }
    changed_.notify_all();
  }

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  bool gate_open_ = true;
  std::map<std::string, std::vector<std::string>> received_, sequence_;
  std::map<std::string, std::vector<KvTestClock::Clock::time_point>> attempts_;
  std::map<std::string, int> open_by_peer_, open_by_host_;
  int open_ = 0;
  Peaks peaks_;
  int most_overtaken_ = 0;
};

// An answering prefill engine's end of one connection: it reads the message and answers done.
class FakeConnection : public KvConnection {
 public:
  FakeConnection(ReleaseNetwork& network, std::string host, std::string peer)
      : network_(network), host_(std::move(host)), peer_(std::move(peer)) {}
  ~FakeConnection() override { network_.connection_ended(host_, peer_); }

  void send(KvFrameType type, std::span<const std::span<const std::byte>> parts) override {
    if (network_.refuse_as_busy(peer_)) {
      busy_ = true;
      return;
    }
    std::string text;
    for (const auto& part : parts)
      text.append(reinterpret_cast<const char*>(part.data()), part.size());
    const auto j = nlohmann::json::parse(text);
    network_.arrived(peer_, type == KvFrameType::kAbandon
                                ? "room " + std::to_string(j.at("room").get<uint64_t>())
                                : j.at("transfer_id").get<std::string>());
  }
  KvFrameType receive_header(uint64_t& size, size_t) override {
    size = busy_ ? kBusy.size() : 0;
    return busy_ ? KvFrameType::kError : KvFrameType::kDone;
  }
  void receive_payload(std::span<const std::span<std::byte>> parts) override {
    size_t at = 0;
    for (const auto& part : parts) {
      const size_t n = std::min(part.size(), kBusy.size() - at);
      std::memcpy(part.data(), kBusy.data() + at, n);
      at += n;
    }
  }
  void set_timeout(std::chrono::milliseconds) override {}
  void set_deadline(std::chrono::steady_clock::time_point) override {}
  void shutdown() override {}
  bool peer_gone() override { return false; }
  std::string peer() const override { return peer_; }
  const char* kind() const override { return "fake"; }

 private:
  // The prefill engine's refusal when every connection it allows is in use.
  static inline const std::string kBusy =
      R"({"message":"too many KV transfer connections","busy":true})";
  ReleaseNetwork& network_;
  std::string host_, peer_;
  bool busy_ = false;
};

std::unique_ptr<KvConnection> ReleaseNetwork::connect(const std::string& host, uint16_t port,
                                                      const KvTransport::GiveUp& give_up) {
  const std::string peer = host + ":" + std::to_string(port);
  std::unique_lock lock(mutex_);
  peaks_.by_peer[peer] = std::max(peaks_.by_peer[peer], ++open_by_peer_[peer]);
  peaks_.by_host[host] = std::max(peaks_.by_host[host], ++open_by_host_[host]);
  peaks_.total = std::max(peaks_.total, ++open_);
  changed_.notify_all();
  const bool hung = hung_hosts.count(host) > 0 || hung_peers.count(peer) > 0;
  // The transport's contract: give_up is asked every few tens of milliseconds while connecting.
  while (hung || !gate_open_) {
    lock.unlock();
    const bool giving_up = give_up && give_up();
    lock.lock();
    if (giving_up) {
      --open_by_peer_[peer];
      --open_by_host_[host];
      --open_;
      throw Error("connect to " + peer + " abandoned");
    }
    changed_.wait_for(lock, std::chrono::milliseconds(20));
  }
  lock.unlock();
  return std::make_unique<FakeConnection>(*this, host, peer);
}

class FakeTransport : public KvTransport {
 public:
  explicit FakeTransport(ReleaseNetwork& network) : network_(network) {}
  std::string name() const override { return "fake"; }
  std::unique_ptr<KvListener> listen(const std::string&, uint16_t, SharedView) override {
    throw Error("the decode engine of these tests does not listen");
  }
  std::unique_ptr<KvConnection> connect(const std::string& host, uint16_t port,
                                        const GiveUp& give_up) override {
    return network_.connect(host, port, give_up);
  }

 private:
  ReleaseNetwork& network_;
};

// A decode engine has no use for its executor's cache when it only sends releases.
class NoCache : public Executor {
 public:
  NoCache() {
    info_.model_name = "fake-model";
    info_.kv_layout = KvLayout{"fake", 3, 4, 8};
  }
  const ExecutorInfo& info() const override { return info_; }
  ExecResult execute(std::span<const ExecItem>, const LayerHook&) override {
    throw Error("NoCache::execute: never called");
  }
  const std::byte* kv_bytes(int32_t, int64_t) const override {
    throw Error("NoCache::kv_bytes: never called");
  }
  void write_kv(int32_t, int64_t, std::span<const std::byte>) override {
    throw Error("NoCache::write_kv: never called");
  }

 private:
  ExecutorInfo info_;
};

class KvReleaseSenders : public ::testing::Test {
 protected:
  // A decode engine whose releases go to network_; its handshake timeout (what ends a release to
  // a host that does not answer) is past the hang guard: only its shutdown ends those.
  std::unique_ptr<KvTransferAgent> make_decode(KvTransferConfig config = {}) {
    config.engine_id = "decode-0";
    config.port = -1;
    config.handshake_timeout_s = 600;
    return std::make_unique<KvTransferAgent>(config, executor_,
                                             std::make_unique<FakeTransport>(network_), metrics_,
                                             [](KvTransferAgent::Task) {});
  }
  void release(KvTransferAgent& agent, const std::string& host, uint16_t port,
               const std::string& transfer_id) {
    network_.expect(host + ":" + std::to_string(port), transfer_id);
    agent.release_remote(host, port, "prefill", transfer_id, {1, 2});
  }
  // Releases "a-0".."a-<n-1>" to one engine; not through release(): the order of so many is not
  // checked (most_overtaken's check is quadratic in an engine's messages).
  static void fill(KvTransferAgent& agent, const std::string& host, uint16_t port, int n) {
    for (int i = 0; i < n; ++i)
      agent.release_remote(host, port, "prefill", "a-" + std::to_string(i), {1, 2});
  }
  double dropped() {
    const std::string text = metrics_.render();
    const std::string name = "tandem:kv_transfer_releases_dropped_total";
    const auto at = text.find(name + "{");
    if (at == std::string::npos) return -1;
    const auto end = text.find('\n', at);
    return std::stod(text.substr(text.rfind(' ', end) + 1, end - text.rfind(' ', end) - 1));
  }

  ReleaseNetwork network_;
  NoCache executor_;
  metrics::Registry metrics_;
};

// Four prefill engines on one machine that stopped answering (its kernel drops their SYNs, or a
// stopped process's accept queues are full) each take the senders one engine may have; those
// were all 16, and a release to another machine's engine waited behind them until their
// handshake timeouts. An engine takes at most 2 now, and a host past its share of 4 only what no
// other host's message waits for.
TEST_F(KvReleaseSenders, FourHungEnginesOnOneHostHoldUpNoOtherHostsReleases) {
  network_.hung_hosts = {"10.0.0.1"};
  auto decode = make_decode();
  for (uint16_t port = 1; port <= 4; ++port)
    for (int i = 0; i < 8; ++i)
      release(*decode, "10.0.0.1", port, "hung-" + std::to_string(port) + "-" + std::to_string(i));
  release(*decode, "10.0.0.2", 7000, "healthy");
  EXPECT_TRUE(network_.wait_until([](const auto& got) { return got.count("10.0.0.2:7000") > 0; }))
      << "the release to the healthy host waited behind the hung host's";
  EXPECT_LE(network_.peaks().by_host["10.0.0.1"], 8);
  decode.reset();  // the hung connects give up at the shutdown
  EXPECT_EQ(network_.received().count("10.0.0.1:1"), 0u);
}

// Messages to nine engines on three hosts, in a random order, queued behind a closed gate: once
// it opens each arrives exactly once, each engine's in the order they were asked for (only a
// message still on its way on another of that engine's senders may arrive after a later one),
// none dropped, and the senders at once stay within their bounds: 16 in all, 2 to an engine.
TEST_F(KvReleaseSenders, QueuedMessagesEachGoOnceInTheirEnginesOrder) {
  network_.close_gate();
  auto decode = make_decode();
  std::mt19937 random(20261207);
  std::map<std::string, int> asked;
  std::map<std::string, std::vector<std::string>> expected;
  const int kMessages = 900;
  for (int i = 0; i < kMessages; ++i) {
    const std::string host = "10.0.1." + std::to_string(random() % 3);
    const uint16_t port = uint16_t(7000 + random() % 3);
    const std::string peer = host + ":" + std::to_string(port);
    const std::string id = peer + "/" + std::to_string(asked[peer]++);
    expected[peer].push_back(id);
    if (i % 5 == 4) {
      // An abandon goes the same way (the room number stands for its message).
      const uint64_t room = uint64_t(i);
      network_.expect(peer, "room " + std::to_string(room));
      expected[peer].back() = "room " + std::to_string(room);
      decode->abandon_room(host, port, room, 1, 2, "test");
    } else {
      release(*decode, host, port, id);
    }
  }
  network_.open_gate();
  ASSERT_TRUE(network_.wait_until([&](const auto& got) {
    size_t n = 0;
    for (const auto& [peer, messages] : got) n += messages.size();
    return n >= size_t(kMessages);
  })) << "not every queued message was sent";
  const auto got = network_.received();
  for (const auto& [peer, messages] : expected) {
    auto sorted_got = got.at(peer), sorted_expected = messages;
    std::sort(sorted_got.begin(), sorted_got.end());
    std::sort(sorted_expected.begin(), sorted_expected.end());
    EXPECT_EQ(sorted_got, sorted_expected) << peer << ": not each message exactly once";
  }
  EXPECT_LE(network_.most_overtaken(), 1);
  EXPECT_EQ(dropped(), 0);
  const Peaks peaks = network_.peaks();
  EXPECT_LE(peaks.total, 16);
  for (const auto& [peer, n] : peaks.by_peer) EXPECT_LE(n, 2) << peer;
  decode.reset();
  size_t n = 0;
  for (const auto& [peer, messages] : network_.received()) n += messages.size();
  EXPECT_EQ(n, size_t(kMessages));
}

// Two hung engines of a host take 2 senders each, its share of 4: a release to a healthy engine
// of that host waited behind them for their handshake timeouts (never, within the test), though
// 12 senders were idle.
TEST_F(KvReleaseSenders, TwoHungEnginesDoNotHoldUpTheirHostMatesReleases) {
  network_.hung_peers = {"10.0.3.1:1", "10.0.3.1:2"};
  auto decode = make_decode();
  for (uint16_t port = 1; port <= 2; ++port)
    for (int i = 0; i < 4; ++i)
      release(*decode, "10.0.3.1", port, "hung-" + std::to_string(port) + "-" + std::to_string(i));
  release(*decode, "10.0.3.1", 3, "healthy");
  EXPECT_TRUE(network_.wait_until([](const auto& got) { return got.count("10.0.3.1:3") > 0; }))
      << "the release to the healthy engine waited behind its host-mates'";
  EXPECT_LE(network_.peaks().by_peer["10.0.3.1:1"], 2);
  EXPECT_LE(network_.peaks().by_peer["10.0.3.1:2"], 2);
  EXPECT_EQ(network_.received().count("10.0.3.1:1"), 0u);
}

// Every prefill engine on one machine (tandem serve): with nothing else to send, their messages
// use every sender, 2 to each of 8 engines, not the host's share of 4.
TEST_F(KvReleaseSenders, OneHostAloneMayUseEverySender) {
  network_.close_gate();
  auto decode = make_decode();
  for (uint16_t port = 1; port <= 8; ++port)
    for (int i = 0; i < 3; ++i)
      release(*decode, "10.0.4.1", port, "t-" + std::to_string(port) + "-" + std::to_string(i));
  EXPECT_TRUE(network_.wait_until_open([](const Peaks& open) { return open.total == 16; }))
      << "one host alone had " << network_.peaks().total << " senders at once";
  network_.open_gate();
  EXPECT_TRUE(network_.wait_until([](const auto& got) {
    size_t n = 0;
    for (const auto& [peer, messages] : got) n += messages.size();
    return n == 24;
  }));
  EXPECT_EQ(dropped(), 0);
}

// One engine may fill the whole queue (4096) while nothing else waits; once it is full, a message
// to another engine takes the place of its newest, which is dropped. The first engine's queue was
// bounded at 512 (its host's at 1024), past which its messages were dropped with the queue all
// but empty.
TEST_F(KvReleaseSenders, OneEngineMayFillTheQueueAndOthersStillFindRoom) {
  network_.close_gate();
  auto decode = make_decode();
  const int kFirst = 2 + 4096;  // its 2 senders' and a full queue
  fill(*decode, "10.0.5.1", 7000, kFirst);
  EXPECT_EQ(dropped(), 0);
  // Two of these take senders at once; the third waits, in the place of the first engine's newest.
  for (int i = 0; i < 3; ++i) release(*decode, "10.0.5.2", 7000, "b-" + std::to_string(i));
  EXPECT_EQ(dropped(), 1);
  network_.open_gate();
  EXPECT_TRUE(network_.wait_received({{"10.0.5.2:7000", 3}, {"10.0.5.1:7000", kFirst - 1}}))
      << "a message to the engine with the shorter queue was dropped";
  const auto got = network_.received();
  EXPECT_EQ(std::count(got.at("10.0.5.1:7000").begin(), got.at("10.0.5.1:7000").end(),
                       "a-" + std::to_string(kFirst - 1)),
            0)
      << "not the newest message was dropped";
}

// A client chooses the port a release goes to (remote_port): one host named on 4,112 ports fills
// the whole queue with one message per engine, and then another host's only message was dropped,
// since no engine's queue was longer than its would be. The victim now comes from the host with
// the most queued: one of its messages is dropped instead. That engine, left with nothing queued
// or sent, is forgotten: it was kept for good, so the other host's client cycling ports too left
// one more idle engine for each message dropped, which every pick of the next message walked.
TEST_F(KvReleaseSenders, OneHostOnManyPortsCannotCrowdOutAnotherHostsMessage) {
  network_.close_gate();
  auto decode = make_decode();
  const int kFirst = 16 + 4096;  // every sender's and a full queue
  for (int i = 0; i < kFirst; ++i)
    decode->release_remote("10.0.8.1", uint16_t(1 + i), "prefill", "a-" + std::to_string(i),
                           {1, 2});
  EXPECT_EQ(dropped(), 0);
  EXPECT_EQ(decode->release_queue_state().engines, size_t(kFirst));
  const int kSecond = 100;  // on as many ports: each takes the place of the first host's newest
  for (int i = 0; i < kSecond; ++i)
    release(*decode, "10.0.8.2", uint16_t(7000 + i), "b-" + std::to_string(i));
  EXPECT_EQ(dropped(), kSecond);
  EXPECT_EQ(decode->release_queue_state().engines, size_t(kFirst))
      << "an engine whose only message was dropped was kept";
  network_.open_gate();
  EXPECT_TRUE(network_.wait_until([&](const auto& got) {
    size_t n = 0, second = 0;
    for (const auto& [peer, messages] : got) {
      n += messages.size();
      if (peer.starts_with("10.0.8.2:")) second += messages.size();
    }
    return second == size_t(kSecond) && n == size_t(kFirst);
  })) << "the other host's messages were dropped";
  testing::repeat_until([&] { return decode->release_queue_state().engines == 0; }, kHangGuard,
                        "an engine was kept after its messages were sent");
}

// Within one host, engines share alike: once one engine filled the queue, a message to another
// engine of its host takes the place of its newest.
TEST_F(KvReleaseSenders, WithinAHostAnEngineWithAShorterQueueStillFindsRoom) {
  network_.close_gate();
  auto decode = make_decode();
  const int kFirst = 2 + 4096;  // its 2 senders' and a full queue
  fill(*decode, "10.0.9.1", 7000, kFirst);
  release(*decode, "10.0.9.1", 7001, "b-0");
  release(*decode, "10.0.9.1", 7001, "b-1");
  release(*decode, "10.0.9.1", 7001, "b-2");  // takes the place of the first engine's newest
  EXPECT_EQ(dropped(), 1);
  network_.open_gate();
  EXPECT_TRUE(network_.wait_received({{"10.0.9.1:7001", 3}, {"10.0.9.1:7000", kFirst - 1}}))
      << "a message to the engine with the shorter queue was dropped";
}

// A prefill engine that refuses a release as busy (every connection it allows in use, as when
// it refused the room registration an abandon follows) gets it again 100 ms later, then after
// twice as long each time. It was dropped: the hold, or the room's prefill leg, waited out the
// prefill engine's timeout. After 5 tries the message is dropped and counted; the count missed
// those. The clock moves only here, once the agent has looked at it.
TEST_F(KvReleaseSenders, AMessageRefusedAsBusyIsSentAgainLaterEachTimeUpToFiveTries) {
  using std::chrono::milliseconds;
  const milliseconds first_wait(100);  // kv_transfer.cpp's kBusyRetryFirst
  KvTestClock clock;
  network_.clock = &clock;
  KvTransferConfig config;
  config.now = clock.seam();
  auto decode = make_decode(config);
  // Waits until `peer`'s try `n` is over: the message is queued again, its next try's time set
  // from the clock, or, after the `last` try, dropped (nothing queued or being sent); false when
  // the hang guard ran out. (Counting clock reads told nothing: the reaper reads it too.)
  const auto try_over = [&](const std::string& peer, size_t n, bool last = false) {
    if (!network_.wait_attempts(peer, n)) return false;
    testing::repeat_until(
        [&] {
          const auto state = decode->release_queue_state();
          return last ? state.queued == 0 && state.sending == 0 : state.deferred == 1;
        },
        kHangGuard, "the refused message was neither queued again nor dropped");
    return true;
  };
  // Sets the clock to just before the wait after try `n` (1 ms short, then a few reaper rounds: no
  // try), then to its end (a try), and returns that wait (0 when the try came too early or never).
  const auto wait_after_try = [&](const std::string& peer, size_t n) {
    using std::chrono::duration_cast;
    EXPECT_TRUE(try_over(peer, n));
    const auto last = network_.attempts(peer).back();
    const milliseconds expected = first_wait * (1 << (n - 1));
    clock.set(last + expected - milliseconds(1));
    EXPECT_TRUE(clock.wait_reads(clock.reads(), 6));
    if (network_.attempts(peer).size() != n) {
      ADD_FAILURE() << "try " << n + 1 << " came before its wait of " << expected.count() << " ms";
      return milliseconds(0);
    }
    clock.set(last + expected);
    if (!network_.wait_attempts(peer, n + 1)) return milliseconds(0);
    return duration_cast<milliseconds>(network_.attempts(peer).at(n) - last);
  };

  network_.busy_refusals["10.0.6.1:7000"] = 3;
  release(*decode, "10.0.6.1", 7000, "held");
  for (size_t n = 1; n <= 3; ++n)
    EXPECT_EQ(wait_after_try("10.0.6.1:7000", n), first_wait * (1 << (n - 1))) << "try " << n + 1;
  EXPECT_TRUE(network_.wait_until([](const auto& got) { return got.count("10.0.6.1:7000") > 0; }))
      << "the release refused as busy was not sent again";
  EXPECT_EQ(dropped(), 0);

  // One refused every time is tried 5 times: no sixth however long the clock moves on.
  network_.busy_refusals["10.0.6.2:7000"] = 1000;
  release(*decode, "10.0.6.2", 7000, "refused");
  for (size_t n = 1; n <= 4; ++n)
    EXPECT_EQ(wait_after_try("10.0.6.2:7000", n), first_wait * (1 << (n - 1))) << "try " << n + 1;
  EXPECT_TRUE(try_over("10.0.6.2:7000", 5, /*last=*/true));
  clock.advance(std::chrono::minutes(10));
  EXPECT_TRUE(clock.wait_reads(clock.reads(), 6));
  decode.reset();  // its threads joined: the count is final
  EXPECT_EQ(network_.attempts("10.0.6.2:7000").size(), 5u);
  EXPECT_EQ(dropped(), 1) << "the message dropped after its last try was not counted";
  EXPECT_EQ(network_.received().count("10.0.6.2:7000"), 0u);
}

// A thread starter that fails its first start, as a process out of threads does (std::thread
// throws std::system_error), then starts threads.
std::function<void(std::function<void()>)> fails_once() {
  auto failed = std::make_shared<std::atomic<bool>>(false);
  return [failed](std::function<void()> body) {
    if (!failed->exchange(true))
      throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again),
                              "no thread for the test");
    std::thread(std::move(body)).detach();
  };
}

// A release whose sender could not start (no thread) stays queued: the next release's sender
// takes it too, first, as its engine's order says. It was lost, and its KV held until the prefill
// engine's timeout.
TEST_F(KvReleaseSenders, AReleaseWhoseSenderCouldNotStartGoesWithTheNextOne) {
  KvTransferConfig config;
  config.start_thread = fails_once();
  auto decode = make_decode(config);
  release(*decode, "10.0.2.1", 7000, "first");
  release(*decode, "10.0.2.1", 7000, "second");
  EXPECT_TRUE(network_.wait_received({{"10.0.2.1:7000", 2}}))
      << "the release whose sender could not start was lost";
  EXPECT_LE(network_.most_overtaken(), 1);
  EXPECT_EQ(dropped(), 0);
}

// With no release after it, the agent tries again on its own (its reaper, about once a second).
TEST_F(KvReleaseSenders, AReleaseWhoseSenderCouldNotStartGoesWithoutAnother) {
  KvTransferConfig config;
  config.start_thread = fails_once();
  auto decode = make_decode(config);
  release(*decode, "10.0.2.1", 7000, "only");
  EXPECT_TRUE(network_.wait_until([](const auto& got) { return got.count("10.0.2.1:7000") > 0; }))
      << "the release whose sender could not start was lost";
}

}  // namespace
}  // namespace tandem::engine
