// KV transfer between engines over real TCP on 127.0.0.1 (port 0, read back):
//  - the framed transport: round trips, payload limit, I/O timeout, shutdown from another thread,
//    bytes that are not a Tandem frame, a peer that goes away;
//  - two KvTransferAgents in one process (prefill with a server, decode without), each over a
//    fake executor whose KV cache is a plain byte array: sequential pulls and parallel bootstrap
//    rooms, their errors and timeouts, checked byte for byte in the decode cache;
//  - fake prefill servers written against the wire format by hand, which corrupt or cut a
//    transfer, so the decode side's checks are exercised too.
// The agents' callbacks are posted to a queue that the test thread runs, as the engine thread
// would. Waits are for events, bounded by the shared hang guard (util/bounded_wait.h); a thread
// that must be blocked before the test acts is seen asleep in the kernel, not given a guessed
// time. Sleeps remain only where a test plays a slow peer against a timeout of the code.
// What runs beside the test thread (a sender whose send completes only as the test receives, a
// fake host's accept) runs under std::async, its end awaited with get_within: an ASSERT that
// returns early leaves the future to wait for it (a send nobody reads fails at the I/O timeout,
// the error kept in the future), where a joinable std::thread ended the run in std::terminate
// with the failure unreported; and an error thrown on that thread is the test's failure.
#include "engine/transfer/kv_transfer.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <xxhash.h>
#include <map>
#include <nlohmann/json.hpp>

#include "engine/transfer/kv_frame.h"
#include "engine/transfer/kv_transport.h"
#include "engine/transfer/shm_pieces.h"
#include "engine/transfer/shm_ring.h"
#include "kv_test_clock.h"
#include "util/bounded_wait.h"
#include "util/error.h"
#include "util/error_of.h"
#include "util/metrics.h"
#include "util/shared_memory.h"

namespace tandem::engine {
namespace {

using namespace std::chrono_literals;
using nlohmann::json;
using ::testing::AnyOf;
using testing::error_of;
using testing::get_within;
using ::testing::HasSubstr;
using testing::kHangGuard;
using ::testing::Not;
using testing::repeat_until;
using testing::wait_until_asleep;

std::span<const std::byte> bytes_of(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

std::string text_of(const std::vector<std::byte>& b) {
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}

void send_text(KvConnection& conn, KvFrameType type, const std::string& text) {
  const std::span<const std::byte> parts[] = {bytes_of(text)};
  conn.send(type, parts);
}

// ------------------------------------------------------------------------------- transport

struct Pair {
  std::unique_ptr<KvTransport> transport;
  std::unique_ptr<KvListener> listener;
  std::unique_ptr<KvConnection> client, server;
};

// The transports under test: TCP, and shared memory (which also listens on TCP).
std::unique_ptr<KvTransport> make_transport(const std::string& kind,
                                            std::chrono::milliseconds io_timeout) {
  return kind == "shm" ? make_shm_transport({io_timeout}) : make_tcp_transport({io_timeout});
}

// A connected client/server pair over loopback, whose listener lets peers read `send_memory` in
// place.
std::unique_ptr<Pair> connect_pair(const std::string& kind,
                                   std::chrono::milliseconds io_timeout = 5000ms,
                                   SharedView send_memory = {}) {
  auto p = std::make_unique<Pair>();
  p->transport = make_transport(kind, io_timeout);
  p->listener = p->transport->listen("127.0.0.1", 0, send_memory);
  std::thread acceptor([&] { p->server = p->listener->accept(); });
  try {
    p->client = p->transport->connect("127.0.0.1", p->listener->port());
  } catch (...) {
    p->listener->close();
    acceptor.join();
    throw;
  }
  acceptor.join();
  return p;
}

// A plain POSIX socket, to send bytes that no KvConnection would.
class RawSocket {
 public:
  static constexpr int kHangGuardMs = int(std::chrono::milliseconds(kHangGuard).count());
  explicit RawSocket(uint16_t port) : fd_(::socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = fd_ >= 0 && ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  }
  ~RawSocket() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool connected() const { return connected_; }
  bool write(const void* data, size_t n) {
    return ::send(fd_, data, n, MSG_NOSIGNAL) == static_cast<ssize_t>(n);
  }
  // Whether the server answers or closes this connection within `limit`.
  bool hears_back_within(std::chrono::milliseconds limit) const {
    pollfd p{fd_, POLLIN, 0};
    return ::poll(&p, 1, static_cast<int>(limit.count())) > 0;
  }
  // Reads what the server says next, within the hang guard: its bytes, or "" once it closed.
  std::string next_bytes() const {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, kHangGuardMs) <= 0) return "(nothing within the hang guard)";
    char buf[256];
    const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    return n > 0 ? std::string(buf, size_t(n)) : std::string();
  }
  // The next `n` bytes the server sends, each within the hang guard; fewer once it closed.
  std::string read_exactly(size_t n) const {
    std::string got;
    while (got.size() < n) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, kHangGuardMs) <= 0) break;
      char buf[256];
      const ssize_t r = ::recv(fd_, buf, std::min(sizeof buf, n - got.size()), 0);
      if (r <= 0) break;
      got.append(buf, size_t(r));
    }
    return got;
  }
  // Whether the server has answered or closed this connection (without waiting).
  bool heard_back() const {
    char c;
    return ::recv(fd_, &c, 1, MSG_DONTWAIT | MSG_PEEK) >= 0 ||
           (errno != EAGAIN && errno != EWOULDBLOCK);
  }

 private:
  int fd_;
  bool connected_ = false;
};

class KvTransports : public ::testing::TestWithParam<std::string> {};
INSTANTIATE_TEST_SUITE_P(Kinds, KvTransports, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

TEST_P(KvTransports, FramesRoundTripWithGatheredPartsAndEmptyPayloads) {
  auto p = connect_pair(GetParam());
  const std::string a = "{\"transfer_id\":", empty, c = "\"x-1\"}";
  const std::span<const std::byte> parts[] = {bytes_of(a), bytes_of(empty), bytes_of(c)};
  p->client->send(KvFrameType::kPull, parts);
  p->client->send(KvFrameType::kDone, {});

  KvFrame f = p->server->receive(1024);
  EXPECT_EQ(f.type, KvFrameType::kPull);
  EXPECT_EQ(text_of(f.payload), "{\"transfer_id\":\"x-1\"}");
  f = p->server->receive(1024);
  EXPECT_EQ(f.type, KvFrameType::kDone);
  EXPECT_TRUE(f.payload.empty());

  // The other way, a binary payload larger than the socket buffers (sent from a thread, since
  // the send completes only as the receiver reads).
  std::vector<std::byte> big(3 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = std::byte((i * 7 + i / 251) & 0xff);
  auto sender = std::async(std::launch::async, [&] {
    const std::span<const std::byte> halves[] = {std::span(big).first(1000),
                                                 std::span(big).subspan(1000)};
    p->server->send(KvFrameType::kLayer, halves);
  });
  f = p->client->receive(big.size());
  get_within(sender, kHangGuard, "the server's send never ended");
  EXPECT_EQ(f.type, KvFrameType::kLayer);
  EXPECT_TRUE(f.payload == big);
  // And towards the server, three times the shared-memory ring of that direction: it wraps.
  auto client_sender = std::async(std::launch::async, [&] {
    const std::span<const std::byte> whole[] = {std::span(big)};
    p->client->send(KvFrameType::kLayer, whole);
  });
  f = p->server->receive(big.size());
  get_within(client_sender, kHangGuard, "the client's send never ended");
  EXPECT_TRUE(f.payload == big);

  // One buffer reused for several frames takes each frame's size.
  send_text(*p->server, KvFrameType::kAccept, "{\"layers\":3}");
  send_text(*p->server, KvFrameType::kDone, "");
  std::vector<std::byte> buffer(big.size(), std::byte{1});
  EXPECT_EQ(p->client->receive(buffer, 1024), KvFrameType::kAccept);
  EXPECT_EQ(text_of(buffer), "{\"layers\":3}");
  EXPECT_EQ(p->client->receive(buffer, 1024), KvFrameType::kDone);
  EXPECT_TRUE(buffer.empty());

  EXPECT_THAT(p->client->peer(), HasSubstr("127.0.0.1:" + std::to_string(p->listener->port())));
  if (GetParam() == "shm") {  // on one host, shared memory, whoever connects
    EXPECT_THAT(p->client->peer(), HasSubstr("shared memory"));
    EXPECT_THAT(p->server->peer(), HasSubstr("shared memory"));
  } else {
    EXPECT_THAT(p->server->peer(), HasSubstr("127.0.0.1:"));
  }
}

TEST_P(KvTransports, OversizePayloadIsRejected) {
  auto p = connect_pair(GetParam());
  send_text(*p->client, KvFrameType::kLayer, std::string(100, 'x'));
  const std::string e = error_of([&] { p->server->receive(99); });
  EXPECT_THAT(e, HasSubstr("100 bytes exceeds the limit of 99"));
}

// The listener's own words ("KV transfer: cannot listen on 127.0.0.1:P: Address already in use")
// named neither the flag nor why: those of every listener of tandem (net::detail::listen_tcp).
TEST_P(KvTransports, APortInUseIsRefusedNamingTheKvTransferFlagAndTheAddress) {
  const auto transport = make_transport(GetParam(), 5000ms);
  const auto held = transport->listen("127.0.0.1", 0);
  const std::string port = std::to_string(held->port());
  EXPECT_EQ(
      error_of([&] { transport->listen("127.0.0.1", held->port()); }),
      "--kv-transfer-port " + port + ": 127.0.0.1:" + port +
          " is in use (another socket holds it: a listener, or a connection made from that port)");
}

TEST_P(KvTransports, ReceiveTimesOutWhenThePeerSendsNothing) {
  auto p = connect_pair(GetParam(), 200ms);
  const std::string e = error_of([&] { p->client->receive(1024); });
  EXPECT_THAT(e, HasSubstr("timed out receiving after 200 ms"));
  // The connection is unusable afterwards, and says so.
  EXPECT_FALSE(error_of([&] { p->client->receive(1024); }).empty());
}

// A connection's deadline (set_deadline: the agents' handshake and release bounds) ends its
// receives however the peer keeps talking, whether each receive waits for a frame or finds one
// already there: the peer sends kFrames small frames, `peer_pace` apart, to a reader that takes
// one each `reader_pace`; the receives end at the deadline (200 ms) with frames still to come.
// Only the outcome is checked, not when. The paces set who runs ahead, not a wait for anything.
void expect_receives_end_at_the_deadline(const std::string& transport,
                                         std::chrono::milliseconds peer_pace,
                                         std::chrono::milliseconds reader_pace) {
  // An I/O timeout past the hang guard: only the deadline can end the receives.
  auto p = connect_pair(transport, 2 * kHangGuard);
  const int kFrames = 1000;  // 1 s or more at either pace
  std::atomic<bool> stop{false};
  auto peer = std::async(std::launch::async, [&] {
    try {
      for (int i = 0; i < kFrames && !stop; ++i) {
        send_text(*p->server, KvFrameType::kProgress, "{}");
        std::this_thread::sleep_for(peer_pace);
      }
    } catch (const Error&) {
      // A peer still sending when the reader left ends at the shutdown below.
    }
  });
  p->client->set_deadline(std::chrono::steady_clock::now() + 200ms);
  auto reader = std::async(std::launch::async, [&] {
    int received = 0;
    const std::string e = error_of([&] {
      for (;;) {
        p->client->receive(1024);
        ++received;
        std::this_thread::sleep_for(reader_pace);
      }
    });
    return std::pair(received, e);
  });
  const auto [received, error] =
      get_within(reader, kHangGuard, "the receives went on past the connection's deadline");
  stop = true;
  p->server->shutdown();
  get_within(peer, kHangGuard, "the peer's sends never ended");
  EXPECT_THAT(error, HasSubstr("timed out receiving"));
  EXPECT_LT(received, kFrames);
}

TEST_P(KvTransports, AReceiveEndsAtTheDeadlineThoughThePeerKeepsSending) {
  expect_receives_end_at_the_deadline(GetParam(), /*peer_pace=*/5ms, /*reader_pace=*/0ms);
}

// A peer that sends faster than the reader reads: every receive finds a frame waiting.
TEST_P(KvTransports, AReceiveEndsAtTheDeadlineThoughThePeerFloodsIt) {
  expect_receives_end_at_the_deadline(GetParam(), /*peer_pace=*/0ms, /*reader_pace=*/1ms);
}

TEST_P(KvTransports, ShutdownFromAnotherThreadUnblocksAReceive) {
  // An I/O timeout past the hang guard: only shutdown() can end the receive.
  auto p = connect_pair(GetParam(), 2 * kHangGuard);
  std::promise<pid_t> reader_thread;
  auto reader = std::async(std::launch::async, [&] {
    reader_thread.set_value(::gettid());
    return error_of([&] { p->client->receive(1024); });
  });
  // Either order must end the receive; the one worth testing is a receive already waiting.
  auto tid = reader_thread.get_future();
  wait_until_asleep(get_within(tid), "the receive never waited");
  p->client->shutdown();
  const std::string e = get_within(reader, kHangGuard, "shutdown() did not end the receive");
  EXPECT_THAT(e, HasSubstr("shut down"));
  EXPECT_THAT(e, Not(HasSubstr("timed out")));
  // Later calls fail at once.
  EXPECT_THAT(error_of([&] { send_text(*p->client, KvFrameType::kDone, "{}"); }),
              HasSubstr("shut down"));
}

TEST_P(KvTransports, BytesThatAreNotATandemFrameAreAnError) {
  auto transport = make_transport(GetParam(), 5000ms);
  auto listener = transport->listen("127.0.0.1", 0);
  {
    // Someone points an HTTP client at the KV port.
    RawSocket raw(listener->port());
    ASSERT_TRUE(raw.connected());
    const std::string http = "GET /metrics HTTP/1.1\r\nHost: prefill\r\n\r\n";
    ASSERT_TRUE(raw.write(http.data(), http.size()));
    auto conn = listener->accept();
    ASSERT_NE(conn, nullptr);
    EXPECT_THAT(error_of([&] { conn->receive(1 << 20); }), HasSubstr("not a Tandem KV frame"));
  }
  {
    // A valid type with the reserved word set.
    RawSocket raw(listener->port());
    ASSERT_TRUE(raw.connected());
    const uint8_t header[16] = {1, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    ASSERT_TRUE(raw.write(header, sizeof header));
    auto conn = listener->accept();
    ASSERT_NE(conn, nullptr);
    EXPECT_THAT(error_of([&] { conn->receive(1 << 20); }), HasSubstr("not a Tandem KV frame"));
  }
  {
    // A frame that promises 100 bytes and delivers 10 before the peer leaves. Accepted on this
    // thread, as above: an accept left waiting on another one by an ASSERT here that returns
    // would wait forever for a peer that never came.
    std::unique_ptr<KvConnection> conn;
    {
      RawSocket raw(listener->port());
      ASSERT_TRUE(raw.connected());
      uint8_t frame[26] = {4, 0, 0, 0, 0, 0, 0, 0, 100};
      ASSERT_TRUE(raw.write(frame, sizeof frame));
      conn = listener->accept();
    }
    ASSERT_NE(conn, nullptr);
    EXPECT_THAT(error_of([&] { conn->receive(1 << 20); }), HasSubstr("connection closed by peer"));
  }
}

TEST_P(KvTransports, APeerThatLeavesEndsTheReceive) {
  auto p = connect_pair(GetParam());
  p->server.reset();
  EXPECT_THAT(error_of([&] { p->client->receive(1024); }), HasSubstr("connection closed by peer"));
}

// A connection whose peer states a frame of `stated` bytes and sends `sent` of them (a pattern)
// before it leaves. It records, for each receive_payload call, how many bytes it asked for and
// how many had arrived before it: what a receiver holds in memory for the frame at that point.
class StatedFrame : public KvConnection {
 public:
  StatedFrame(uint64_t stated, uint64_t sent) : stated_(stated), sent_(sent) {}
  struct Call {
    uint64_t asked, arrived_before;
  };
  const std::vector<Call>& calls() const { return calls_; }

  void send(KvFrameType, std::span<const std::span<const std::byte>>) override {
    throw Error("not sending");
  }
  KvFrameType receive_header(uint64_t& size, size_t max_payload) override {
    size = stated_;
    if (size > max_payload) throw Error("over the limit");
    return KvFrameType::kPull;
  }
  void receive_payload(std::span<const std::span<std::byte>> parts) override {
    uint64_t asked = 0;
    for (auto p : parts) asked += p.size();
    calls_.push_back({asked, arrived_});
    for (auto p : parts)
      for (std::byte& b : p) {
        if (arrived_ == sent_) throw Error("receiving failed: connection closed by peer");
        b = std::byte(arrived_++ % 251);
      }
  }
  void set_timeout(std::chrono::milliseconds) override {}
  void set_deadline(std::chrono::steady_clock::time_point) override {}
  void shutdown() override {}
  bool peer_gone() override { return arrived_ == sent_; }
  std::string peer() const override { return "a peer that states " + std::to_string(stated_); }
  const char* kind() const override { return "fake"; }

 private:
  const uint64_t stated_, sent_;
  uint64_t arrived_ = 0;
  std::vector<Call> calls_;
};

// A frame's buffer grows with the bytes that arrive, not with the size its header states: a peer
// without the secret (or before any request) stated a 1 MiB request and KvConnection::receive
// allocated all of it before a byte came, on each of the port's 512 connections. Now no call
// asks for more than the first piece (64 KiB) or, past it, what already arrived; what does
// arrive is still the frame whole.
TEST(KvReceive, AFramesBufferGrowsWithTheBytesThatArriveNotWithItsStatedSize) {
  constexpr uint64_t kStated = (1 << 20) + 5;
  for (const uint64_t sent : {uint64_t{0}, uint64_t{1000}, uint64_t{300000}, kStated}) {
    SCOPED_TRACE("sent " + std::to_string(sent));
    StatedFrame peer(kStated, sent);
    std::vector<std::byte> payload;
    if (sent < kStated)
      EXPECT_THAT(error_of([&] { peer.receive(payload, 1 << 21); }),
                  HasSubstr("connection closed by peer"));
    else
      EXPECT_EQ(peer.receive(payload, 1 << 21), KvFrameType::kPull);
    ASSERT_FALSE(peer.calls().empty());
    for (const auto& call : peer.calls())
      EXPECT_LE(call.asked, std::max<uint64_t>(64 << 10, call.arrived_before));
    if (sent < kStated) continue;
    ASSERT_EQ(payload.size(), kStated);
    bool intact = true;
    for (size_t i = 0; i < payload.size(); ++i) intact = intact && payload[i] == std::byte(i % 251);
    EXPECT_TRUE(intact);
  }
}

TEST_P(KvTransports, ConnectingToAClosedPortFails) {
  auto transport = make_transport(GetParam(), 5000ms);
  uint16_t port = 0;
  {
    auto listener = transport->listen("127.0.0.1", 0);
    port = listener->port();
  }
  EXPECT_THAT(error_of([&] { transport->connect("127.0.0.1", port); }),
              HasSubstr("cannot connect to 127.0.0.1:" + std::to_string(port)));
}

TEST_P(KvTransports, CloseUnblocksAccept) {
  auto transport = make_transport(GetParam(), 5000ms);
  auto listener = transport->listen("127.0.0.1", 0);
  EXPECT_NE(listener->port(), 0);
  std::promise<pid_t> acceptor_thread;
  auto accepted = std::async(std::launch::async, [&] {
    acceptor_thread.set_value(::gettid());
    return listener->accept();
  });
  // Either order must return nullptr; the one worth testing is an accept already waiting.
  auto tid = acceptor_thread.get_future();
  wait_until_asleep(get_within(tid), "the accept never waited");
  listener->close();
  EXPECT_EQ(get_within(accepted, kHangGuard, "close() did not end the accept"), nullptr);
  EXPECT_EQ(listener->accept(), nullptr);
}

// ------------------------------------------------------- shared memory: a hostile local peer

// One byte on a Unix socket with descriptor `fd` attached when given (>= 0), built by hand as a
// hostile peer would (not with the transport's own code); true once it is sent.
bool send_byte_by_hand(int sock, char byte, int fd) {
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  if (fd >= 0) {
    m.msg_control = control;
    m.msg_controllen = sizeof control;
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  return ::sendmsg(sock, &m, MSG_NOSIGNAL) == 1;
}

// A process posing as a prefill engine on this host: it holds the shared-memory socket name of
// 127.0.0.1:port (as shm_ring.h defines it) and speaks the segment handshake by hand.
class FakeShmListener {
 public:
  explicit FakeShmListener(uint16_t port, int backlog = 8)
      : fd_(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    socklen_t length = 0;
    const sockaddr_un a = shm::socket_address("127.0.0.1", port, length);
    bound_ = fd_ >= 0 && ::bind(fd_, reinterpret_cast<const sockaddr*>(&a), length) == 0 &&
             ::listen(fd_, backlog) == 0;
  }
  ~FakeShmListener() {
    for (int c : accepted_) ::close(c);
    if (fd_ >= 0) ::close(fd_);
  }
  bool bound() const { return bound_; }
  // A client has connected and waits to be accepted (and welcomed).
  bool has_pending_connection() const {
    pollfd p{fd_, POLLIN, 0};
    return ::poll(&p, 1, 0) > 0;
  }

  // Accepts one client, maps the segment its hello brings and welcomes it, attaching `extra_fd`
  // to the welcome when given (a descriptor the client never asked for).
  SharedSegment accept_and_welcome(int extra_fd = -1) {
    const int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    EXPECT_GE(c, 0);
    accepted_.push_back(c);
    char hello = 0;
    iovec iov{&hello, 1};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr m{};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = control;
    m.msg_controllen = sizeof control;
    EXPECT_EQ(::recvmsg(c, &m, MSG_CMSG_CLOEXEC), 1);
    int segment_fd = -1;
    if (cmsghdr* h = CMSG_FIRSTHDR(&m); h && h->cmsg_type == SCM_RIGHTS)
      std::memcpy(&segment_fd, CMSG_DATA(h), sizeof(int));
    SharedSegment segment = SharedSegment::attach(segment_fd);
    EXPECT_TRUE(send_byte_by_hand(c, shm::kWelcome, extra_fd));
    return segment;
  }

 private:
  int fd_;
  bool bound_ = false;
  std::vector<int> accepted_;
};

// Descriptors this process has open.
size_t open_descriptors() {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

// A shared-memory client of the fake above, connected (the fake accepts on this thread).
struct FakeShmPair {
  std::unique_ptr<KvTransport> tcp = make_tcp_transport({5000ms});
  // Holds the port, so that no other listener takes its shared-memory name; never accepts.
  std::unique_ptr<KvListener> reserved = tcp->listen("127.0.0.1", 0);
  FakeShmListener fake{reserved->port()};
  std::unique_ptr<KvTransport> transport = make_shm_transport({5000ms});
  std::unique_ptr<KvConnection> client;
  SharedSegment segment;

  void connect(int extra_fd = -1) {
    ASSERT_TRUE(fake.bound());
    auto connecting = std::async(std::launch::async,
                                 [&] { return transport->connect("127.0.0.1", reserved->port()); });
    segment = fake.accept_and_welcome(extra_fd);
    client = get_within(connecting, kHangGuard, "the connect to the fake listener never ended");
    ASSERT_TRUE(client);
    ASSERT_STREQ(client->kind(), "shm");
  }
};

// How many mappings of segments named `name` this process has.
int mappings_of(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  int n = 0;
  for (std::string line; std::getline(maps, line);)
    if (line.find("memfd:" + name) != std::string::npos) ++n;
  return n;
}

// A process posing as a decode engine on this host: it connects to the shared-memory socket of
// 127.0.0.1:port and, when told to, says hello with a segment of its own (which it may have
// tampered with first) and waits to be welcomed.
class FakeShmClient {
 public:
  explicit FakeShmClient(uint16_t port)
      : fd_(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0)),
        segment_(SharedSegment::create(shm::kSegmentBytes, "test-fake-client")) {
    socklen_t length = 0;
    const sockaddr_un a = shm::socket_address("127.0.0.1", port, length);
    connected_ = fd_ >= 0 && ::connect(fd_, reinterpret_cast<const sockaddr*>(&a), length) == 0;
  }
  ~FakeShmClient() { hang_up(); }
  bool connected() const { return connected_; }
  void hang_up() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  // Claims to have read nothing of a full ring towards it: the listener's side finds no room
  // for a single byte, ever.
  void claim_a_full_ring() {
    auto* head = reinterpret_cast<shm::RingHead*>(segment_.data() + shm::kToClientHead);
    head->read.store(uint64_t(0) - shm::kToClientBytes);
  }

  // Sends the hello with the segment; true once the welcome came back.
  bool hello() {
    if (!send_byte_by_hand(fd_, shm::kHello, segment_.fd())) return false;
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, int(std::chrono::milliseconds(kHangGuard).count())) <= 0) return false;
    char welcome = 0;
    return ::recv(fd_, &welcome, 1, 0) == 1 && welcome == shm::kWelcome;
  }

 private:
  int fd_;
  SharedSegment segment_;
  bool connected_ = false;
};

TEST(ShmPeer, ARingClaimingMoreBytesThanItHoldsIsAnErrorNotAReadPastIt) {
  FakeShmPair p;
  ASSERT_NO_FATAL_FAILURE(p.connect());
  // A layer frame of 8 MiB announced in the to-client ring, and all of it claimed written at
  // once: four times what the ring holds.
  constexpr uint64_t kClaimed = 8 << 20;
  std::byte* ring = p.segment.data() + shm::kToClientData;
  const auto header = kv_frame_header(KvFrameType::kLayer, kClaimed);
  std::memcpy(ring, header.data(), header.size());
  auto* head = reinterpret_cast<shm::RingHead*>(p.segment.data() + shm::kToClientHead);
  head->written.store(header.size() + kClaimed);
  head->data.fetch_add(1);
  EXPECT_THAT(error_of([&] { p.client->receive(kClaimed); }),
              HasSubstr("corrupt shared-memory ring"));
}

TEST(ShmPeer, ADescriptorThePeerSendsUnaskedIsClosedNotLeaked) {
  const int extra = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(extra, 0);
  const size_t before = open_descriptors();
  {
    FakeShmPair p;
    ASSERT_NO_FATAL_FAILURE(p.connect(extra));
  }
  EXPECT_EQ(open_descriptors(), before);
  ::close(extra);
}

// Any process may take an engine's shared-memory socket name first (abstract names carry no
// permissions); one whose backlog is full refuses every connection with EAGAIN. The engine then
// listens on TCP alone (it warns), and a decode engine connecting takes TCP too: it retried the
// name until its I/O timeout and then failed the transfer.
TEST(ShmPeer, ASquatterOfTheSocketNameWithAFullBacklogLeavesTcp) {
  auto reserved = make_tcp_transport({5000ms});
  auto placeholder = reserved->listen("127.0.0.1", 0);
  const uint16_t port = placeholder->port();
  FakeShmListener squatter(port, 0);  // never accepts: its one queue slot is taken below
  ASSERT_TRUE(squatter.bound());
  const int filler = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  socklen_t length = 0;
  const sockaddr_un a = shm::socket_address("127.0.0.1", port, length);
  ASSERT_EQ(::connect(filler, reinterpret_cast<const sockaddr*>(&a), length), 0);
  placeholder.reset();  // the engine takes its port back
  auto engine = make_shm_transport({5000ms});
  auto listener = engine->listen("127.0.0.1", port);
  // The I/O timeout far beyond the hang guard: a retry of the name would not end by itself.
  auto transport = make_shm_transport({600s});
  std::atomic<bool> give_up{false};
  auto attempt = std::async(std::launch::async, [&] {
    return transport->connect("127.0.0.1", port, [&] { return give_up.load(); });
  });
  const bool connected = attempt.wait_for(kHangGuard) == std::future_status::ready;
  give_up = true;
  ASSERT_TRUE(connected) << "the connect kept retrying the squatted name";
  std::unique_ptr<KvConnection> client;
  try {
    client = attempt.get();
  } catch (const Error& e) {
    FAIL() << e.what();
  }
  EXPECT_STREQ(client->kind(), "tcp");
  auto server = listener->accept();
  ASSERT_TRUE(server);
  EXPECT_STREQ(server->kind(), "tcp");
  send_text(*client, KvFrameType::kPull, "{}");
  EXPECT_EQ(server->receive(16).type, KvFrameType::kPull);
  ::close(filler);
}

// Peers that connect to the shared-memory socket and never say hello do not hold up another one:
// it is welcomed at once (the listener waited for each silent peer's hello in turn, up to a
// second apiece, and everyone else waited behind them).
TEST(ShmPeer, PeersThatNeverSayHelloDoNotHoldUpAnother) {
  auto engine = make_shm_transport({600s});
  auto listener = engine->listen("127.0.0.1", 0);
  std::vector<std::unique_ptr<FakeShmClient>> silent;
  for (int i = 0; i < 30; ++i) {
    silent.push_back(std::make_unique<FakeShmClient>(listener->port()));
    ASSERT_TRUE(silent.back()->connected());
  }
  auto transport = make_shm_transport({600s});
  auto attempt = std::async(std::launch::async,
                            [&] { return transport->connect("127.0.0.1", listener->port()); });
  const bool connected = attempt.wait_for(kHangGuard) == std::future_status::ready;
  silent.clear();  // lets a listener that waits on each of them in turn get through
  ASSERT_TRUE(connected) << "the connect waited behind the silent peers";
  auto client = attempt.get();
  EXPECT_STREQ(client->kind(), "shm");
  auto server = listener->accept();
  ASSERT_TRUE(server);
  EXPECT_STREQ(server->kind(), "shm");
  send_text(*client, KvFrameType::kPull, "{}");
  EXPECT_EQ(server->receive(16).type, KvFrameType::kPull);
}

// Only processes of one user share memory (these tests pose as another user through
// shm_user). A listener drops a peer of another user before it can hand over a segment: it is
// never mapped, and no connection comes of it.
TEST(ShmPeer, AListenerDropsAPeerOfAnotherUserBeforeMappingItsSegment) {
  TcpTransportOptions another_user{5000ms};
  another_user.shm_user = int64_t(::geteuid()) + 1;
  auto engine = make_shm_transport(another_user);
  auto listener = engine->listen("127.0.0.1", 0);
  auto transport = make_shm_transport({5000ms});  // connects to a listener of its own user
  EXPECT_THAT(error_of([&] { transport->connect("127.0.0.1", listener->port()); }),
              HasSubstr("shared-memory handshake with 127.0.0.1:" +
                        std::to_string(listener->port()) + " failed"));
  // The first connection the listener hands out is a later one over TCP.
  auto tcp = make_tcp_transport({5000ms});
  auto client = tcp->connect("127.0.0.1", listener->port());
  auto server = listener->accept();
  ASSERT_TRUE(server);
  EXPECT_STREQ(server->kind(), "tcp");
  EXPECT_EQ(mappings_of("tandem-kv"), 0);
}

// A decode engine ignores a listener of another user (which could feed it any KV, and hold the
// name on purpose) and reaches the engine over TCP.
TEST(ShmPeer, AClientTakesTcpToAListenerOfAnotherUser) {
  auto engine = make_shm_transport({5000ms});
  auto listener = engine->listen("127.0.0.1", 0);
  TcpTransportOptions another_user{5000ms};
  another_user.shm_user = int64_t(::geteuid()) + 1;
  auto transport = make_shm_transport(another_user);
  auto client = transport->connect("127.0.0.1", listener->port());
  EXPECT_STREQ(client->kind(), "tcp");
  auto server = listener->accept();
  ASSERT_TRUE(server);
  EXPECT_STREQ(server->kind(), "tcp");
}

// ------------------------------------------------------------------- shared memory, in place

// A prefill engine's cache in a segment with a pattern no two offsets share within 251 bytes.
SharedSegment patterned_segment(size_t bytes, const std::string& name = "test-send-memory") {
  SharedSegment s = SharedSegment::create(bytes, name);
  for (size_t i = 0; i < bytes; ++i) s.data()[i] = std::byte((i * 13 + i / 251) & 0xff);
  return s;
}

// A connected pair whose listener lets peers read `memory` in place.
std::unique_ptr<Pair> connect_pair_sharing(const std::string& kind, const SharedSegment& memory,
                                           std::chrono::milliseconds io_timeout = 5000ms) {
  return connect_pair(kind, io_timeout, memory.view());
}

std::span<const std::byte> at(const SharedSegment& s, size_t offset, size_t n) {
  return {s.data() + offset, n};
}

TEST_P(KvTransports, FramesGatheredFromTheSharedCacheArriveIntact) {
  const SharedSegment memory = patterned_segment(1 << 20);
  auto p = connect_pair_sharing(GetParam(), memory);
  // A layer frame as KV transfer sends one: a small header of its own, then blocks of the
  // cache, two of them neighbours, in no particular order.
  const std::string header = "layer-header-24-bytes...";
  const std::span<const std::byte> parts[] = {bytes_of(header), at(memory, 500000, 40000),
                                              at(memory, 4096, 30000), at(memory, 34096, 30000),
                                              at(memory, 900001, 7)};
  std::vector<std::byte> expected;
  for (auto part : parts) expected.insert(expected.end(), part.begin(), part.end());
  const int frames = 3;
  auto sender = std::async(std::launch::async, [&] {
    for (int i = 0; i < frames; ++i) p->server->send(KvFrameType::kLayer, parts);
    send_text(*p->server, KvFrameType::kDone, "{}");
  });
  {
    // Scattered over targets that split the frame's parts differently.
    std::vector<std::byte> a(1000), b(expected.size() - 1000, std::byte{0xEE});
    uint64_t size = 0;
    ASSERT_EQ(p->client->receive_header(size, 1 << 20), KvFrameType::kLayer);
    ASSERT_EQ(size, expected.size());
    const std::span<std::byte> targets[] = {a, b};
    p->client->receive_payload(targets);
    a.insert(a.end(), b.begin(), b.end());
    EXPECT_TRUE(a == expected);
  }
  {
    // Whole, as KvConnection::receive takes it: in pieces (64 KiB, then the rest), the first
    // ending inside a block of the cache.
    const KvFrame f = p->client->receive(1 << 20);
    EXPECT_EQ(f.type, KvFrameType::kLayer);
    EXPECT_TRUE(f.payload == expected);
  }
  {
    // In three calls that end inside the header and inside a block.
    std::vector<std::byte> got(expected.size(), std::byte{0xEE});
    uint64_t size = 0;
    ASSERT_EQ(p->client->receive_header(size, 1 << 20), KvFrameType::kLayer);
    for (const auto& [from, to] : {std::pair<size_t, size_t>{0, 10}, {10, 50000}, {50000, size}}) {
      const std::span<std::byte> piece(got.data() + from, to - from);
      p->client->receive_payload(std::span(&piece, 1));
    }
    EXPECT_TRUE(got == expected);
  }
  EXPECT_EQ(p->client->receive(1024).type, KvFrameType::kDone);
  get_within(sender, kHangGuard, "the sender never ended");
  // Over shared memory the cache's parts took one copy, the header went through the ring.
  EXPECT_EQ(p->server->bytes_sent_in_place(),
            GetParam() == "shm" ? uint64_t(frames) * (expected.size() - header.size()) : 0u);
}

TEST(ShmInPlace, PartsOutsideTheSharedCacheGoThroughTheRing) {
  const SharedSegment memory = patterned_segment(1 << 20);
  auto p = connect_pair_sharing("shm", memory);
  std::vector<std::byte> own(100000, std::byte{7});  // too much of it to travel inline
  const std::span<const std::byte> parts[] = {own, at(memory, 0, 100000)};
  auto sender =
      std::async(std::launch::async, [&] { p->server->send(KvFrameType::kLayer, parts); });
  const KvFrame f = p->client->receive(1 << 20);
  get_within(sender, kHangGuard, "the sender never ended");
  ASSERT_EQ(f.payload.size(), 200000u);
  EXPECT_TRUE(std::equal(own.begin(), own.end(), f.payload.begin()));
  EXPECT_TRUE(std::equal(memory.data(), memory.data() + 100000, f.payload.begin() + 100000));
  EXPECT_EQ(p->server->bytes_sent_in_place(), 0u);
}

TEST(ShmInPlace, TheNextFrameNotInPlaceWaitsUntilThePeerHasCopied) {
  SharedSegment memory = patterned_segment(1 << 20);
  auto p = connect_pair_sharing("shm", memory);
  const std::vector<std::byte> original(memory.data(), memory.data() + 200000);
  const std::span<const std::byte> parts[] = {at(memory, 0, 200000)};
  std::atomic<bool> done_sent{false};
  std::promise<pid_t> sender_thread;
  auto sender = std::async(std::launch::async, [&] {
    sender_thread.set_value(::gettid());
    p->server->send(KvFrameType::kLayer, parts);  // returns before the peer copied
    send_text(*p->server, KvFrameType::kDone, "{}");
    done_sent = true;
    // Only now may the sender reuse its blocks (a prefill engine releases them here).
    std::memset(memory.data(), 0xFF, 200000);
  });
  uint64_t size = 0;
  ASSERT_EQ(p->client->receive_header(size, 1 << 20), KvFrameType::kLayer);
  // The sender either waits for the copy, asleep, or has run ahead and ended: then it sent done.
  auto tid = sender_thread.get_future();
  wait_until_asleep(get_within(tid), "the sender neither waited nor ended");
  EXPECT_FALSE(done_sent) << "the done frame went before the layer was copied";
  std::vector<std::byte> got(size);
  const std::span<std::byte> whole[] = {got};
  p->client->receive_payload(whole);
  EXPECT_EQ(p->client->receive(1024).type, KvFrameType::kDone);
  get_within(sender, kHangGuard, "the sender never ended");
  EXPECT_TRUE(got == original);
}

TEST(ShmInPlace, AReceiverThatLeavesFailsTheSendersNextFrame) {
  const SharedSegment memory = patterned_segment(1 << 20);
  auto p = connect_pair_sharing("shm", memory);
  const std::span<const std::byte> parts[] = {at(memory, 0, 200000)};
  p->server->send(KvFrameType::kLayer, parts);
  p->client.reset();  // the decode engine dies before copying
  EXPECT_THAT(error_of([&] { send_text(*p->server, KvFrameType::kDone, "{}"); }),
              HasSubstr("connection closed by peer"));
}

TEST(ShmInPlace, TheReceiverKeepsAPeersMappingAcrossConnectionsUntilThatPeerExits) {
  int to_parent[2], to_child[2];
  ASSERT_EQ(::pipe(to_parent), 0);
  ASSERT_EQ(::pipe(to_child), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // A prefill engine in a process of its own: two transfers, then it exits when told to.
    const SharedSegment memory = patterned_segment(1 << 20, "test-peer-cache");
    auto transport = make_shm_transport({5000ms});
    auto listener = transport->listen("127.0.0.1", 0, memory.view());
    const uint16_t port = listener->port();
    if (::write(to_parent[1], &port, sizeof port) != sizeof port) ::_exit(2);
    const std::span<const std::byte> parts[] = {at(memory, 4096, 100000)};
    for (int i = 0; i < 2; ++i) {
      auto conn = listener->accept();
      if (!conn) ::_exit(3);
      conn->send(KvFrameType::kLayer, parts);
      conn->send(KvFrameType::kDone, {});
    }
    char c;
    if (::read(to_child[0], &c, 1) != 1) ::_exit(4);
    ::_exit(0);
  }
  uint16_t port = 0;
  ASSERT_EQ(::read(to_parent[0], &port, sizeof port), ssize_t(sizeof port));
  auto transport = make_shm_transport({5000ms});
  for (int i = 0; i < 2; ++i) {
    auto conn = transport->connect("127.0.0.1", port);
    const KvFrame f = conn->receive(1 << 20);
    ASSERT_EQ(f.payload.size(), 100000u);
    EXPECT_EQ(f.payload[0], std::byte((4096 * 13 + 4096 / 251) & 0xff));
    EXPECT_EQ(conn->receive(16).type, KvFrameType::kDone);
    EXPECT_EQ(mappings_of("test-peer-cache"), 1) << "connection " << i;
  }
  ASSERT_EQ(::write(to_child[1], "x", 1), 1);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  // The transport lets go of the dead peer's memory when asked (KV transfer asks every second)
  // and at its next connection.
  transport->forget_exited_peers();
  EXPECT_EQ(mappings_of("test-peer-cache"), 0);
  for (int fd : {to_parent[0], to_parent[1], to_child[0], to_child[1]}) ::close(fd);
}

TEST(ShmPieces, ADescriptionMustCoverTheFrameExactlyWithinTheSegment) {
  const ShmPiece in_line{ShmPiece::kInline, 24};
  EXPECT_EQ(check_shm_pieces(std::vector<ShmPiece>{in_line, {0, 1000}, {5000, 76}}, 1100, 8192),
            "");
  EXPECT_EQ(check_shm_pieces({}, 0, 0), "");
  EXPECT_THAT(check_shm_pieces(std::vector<ShmPiece>{{0, 1000}}, 1100, 8192),
              HasSubstr("pieces of 1000 bytes for a frame of 1100"));
  EXPECT_THAT(check_shm_pieces(std::vector<ShmPiece>{{0, 1000}, {0, 200}}, 1100, 8192),
              HasSubstr("piece 1 runs past the frame's 1100 bytes"));
  EXPECT_THAT(check_shm_pieces(std::vector<ShmPiece>{{8000, 200}}, 200, 8192),
              HasSubstr("piece 0 (200 bytes at 8000) lies outside the sender's segment of 8192"));
  // Offsets chosen to overflow a naive offset + length check.
  EXPECT_THAT(check_shm_pieces(std::vector<ShmPiece>{{~uint64_t(0) - 10, 100}}, 100, 8192),
              HasSubstr("lies outside"));
  EXPECT_THAT(check_shm_pieces(std::vector<ShmPiece>{{0, ~uint64_t(0)}, {0, 2}}, 1, 8192),
              HasSubstr("runs past"));
  EXPECT_THAT(check_shm_pieces(std::vector<ShmPiece>(kMaxShmPieces + 1, in_line), 1, 8192),
              HasSubstr("at most"));
}

// ------------------------------------------------------------------------------- fake engines

const KvLayout kLayout{"fake", 3, 4, 8};  // 3 layers, 4 tokens a block, 8 bytes a token
constexpr std::byte kUntouched{0xEE};

// An executor that only has a KV cache: num_blocks * layers blocks of block_size * token_bytes
// bytes, all kUntouched at first, in a shared-memory segment as the engines' caches are. It
// counts writes per layer so tests can wait for them.
class FakeExecutor : public Executor {
 public:
  explicit FakeExecutor(KvLayout layout = kLayout, int64_t num_blocks = 16)
      : memory_(SharedSegment::create(
            size_t(num_blocks * layout.layers * layout.block_size * layout.token_bytes),
            "fake-kv-cache")),
        data_(memory_.data(), memory_.size()) {
    info_.model_name = "fake-model";
    info_.vocab_size = 1000;
    info_.max_model_len = 1024;
    info_.num_blocks = num_blocks;
    info_.block_size = layout.block_size;
    info_.kv_layout = layout;
    block_bytes_ = size_t(layout.block_size * layout.token_bytes);
    std::fill(data_.begin(), data_.end(), kUntouched);
    writes_.assign(size_t(layout.layers), 0);
  }

  const ExecutorInfo& info() const override { return info_; }
  ExecResult execute(std::span<const ExecItem>, const LayerHook&) override {
    throw Error("FakeExecutor::execute: KV transfer never runs a step");
  }
  const std::byte* kv_bytes(int32_t block, int64_t layer) const override {
    std::unique_lock lock(mutex_);
    if (gate_closed_) {
      // A reader stuck mid-transfer, for tests that need a transfer in progress.
      ++waiting_at_gate_;
      written_.notify_all();
      written_.wait_for(lock, kHangGuard, [&] { return !gate_closed_; });
      --waiting_at_gate_;
    }
    return data_.data() + offset(block, layer);
  }
  void write_kv(int32_t block, int64_t layer, std::span<const std::byte> bytes) override {
    // The interface's contract: a whole number of tokens, at most one block.
    EXPECT_EQ(bytes.size() % size_t(info_.kv_layout.token_bytes), 0u);
    EXPECT_LE(bytes.size(), block_bytes_);
    std::memcpy(data_.data() + offset(block, layer), bytes.data(),
                std::min(bytes.size(), block_bytes_));
    {
      std::lock_guard lock(mutex_);
      ++writes_[size_t(layer)];
    }
    written_.notify_all();
  }

  // Every block and layer gets its own 32-byte pattern (no two chunks equal, none kUntouched).
  void fill_distinct() {
    for (int32_t b = 0; b < info_.num_blocks; ++b)
      for (int64_t l = 0; l < info_.kv_layout.layers; ++l)
        for (size_t i = 0; i < block_bytes_; ++i)
          data_[offset(b, l) + i] = std::byte((b * 97 + l * 41 + int64_t(i)) & 0xff);
  }

  std::span<std::byte> block(int32_t b, int64_t layer) {
    return {data_.data() + offset(b, layer), block_bytes_};
  }
  std::vector<std::byte> data() const { return {data_.begin(), data_.end()}; }
  SharedView kv_shared_memory() const override { return memory_.view(); }

  // Tokens [first, num) of `remote` blocks (a whole prompt's table) of `from`, copied into
  // `local` blocks (the table from first on) of this cache: what a transfer should do.
  void copy_tokens(FakeExecutor& from, const std::vector<int32_t>& remote,
                   const std::vector<int32_t>& local, int64_t first, int64_t num,
                   int64_t layers = -1) {
    const int64_t bs = info_.kv_layout.block_size, tb = info_.kv_layout.token_bytes;
    if (layers < 0) layers = info_.kv_layout.layers;
    for (int64_t l = 0; l < layers; ++l)
      for (int64_t t = first; t < num; ++t) {
        const auto src = from.block(remote[size_t(t / bs)], l).subspan(size_t((t % bs) * tb));
        const auto dst = block(local[size_t((t - first) / bs)], l).subspan(size_t((t % bs) * tb));
        std::memcpy(dst.data(), src.data(), size_t(tb));
      }
  }

  // Waits until at least one write into `layer` happened.
  bool wait_for_write(int64_t layer) {
    std::unique_lock lock(mutex_);
    return written_.wait_for(lock, kHangGuard, [&] { return writes_[size_t(layer)] > 0; });
  }
  int64_t writes() const {
    std::lock_guard lock(mutex_);
    int64_t n = 0;
    for (auto w : writes_) n += w;
    return n;
  }
  int64_t writes(int64_t layer) const {
    std::lock_guard lock(mutex_);
    return writes_[size_t(layer)];
  }

  // While closed, kv_bytes() blocks: a sender stays in the middle of its transfer.
  void close_gate() {
    std::lock_guard lock(mutex_);
    gate_closed_ = true;
  }
  void open_gate() {
    {
      std::lock_guard lock(mutex_);
      gate_closed_ = false;
    }
    written_.notify_all();
  }
  bool wait_for_reader_at_gate() {
    std::unique_lock lock(mutex_);
    return written_.wait_for(lock, kHangGuard, [&] { return waiting_at_gate_ > 0; });
  }

 private:
  size_t offset(int32_t block, int64_t layer) const {
    if (block < 0 || block >= info_.num_blocks || layer < 0 || layer >= info_.kv_layout.layers) {
      ADD_FAILURE() << "KV access out of range: block " << block << ", layer " << layer;
      throw Error("FakeExecutor: block " + std::to_string(block) + " layer " +
                  std::to_string(layer) + " out of range");
    }
    return (size_t(block) * size_t(info_.kv_layout.layers) + size_t(layer)) * block_bytes_;
  }

  ExecutorInfo info_;
  size_t block_bytes_ = 0;
  SharedSegment memory_;
  std::span<std::byte> data_;
  mutable std::mutex mutex_;
  mutable std::condition_variable written_;
  std::vector<int64_t> writes_;
  bool gate_closed_ = false;
  mutable int64_t waiting_at_gate_ = 0;
};

// The engine thread of these tests: the agents post here, the test thread runs the tasks.
class TaskQueue {
 public:
  KvTransferAgent::Post post() {
    return [this](KvTransferAgent::Task t) {
      {
        std::lock_guard lock(mutex_);
        tasks_.push_back(std::move(t));
      }
      posted_.notify_all();
    };
  }

  // Runs posted tasks in order until done() holds; false when the hang guard ran out first.
  // done() is evaluated without the queue's lock (the agents post while holding theirs).
  bool run_until(const std::function<bool()>& done) {
    const auto limit = std::chrono::steady_clock::now() + kHangGuard;
    while (!done()) {
      // Checked whatever comes: agents that keep posting (a peer that keeps talking) must not
      // hold the test past the guard either.
      if (std::chrono::steady_clock::now() > limit) return false;
      KvTransferAgent::Task task;
      {
        std::unique_lock lock(mutex_);
        posted_.wait_for(lock, 20ms, [&] { return !tasks_.empty(); });
        if (tasks_.empty()) continue;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      if (task) task();
    }
    return true;
  }

  // Runs the tasks posted so far.
  void run_pending() {
    std::deque<KvTransferAgent::Task> tasks;
    {
      std::lock_guard lock(mutex_);
      tasks.swap(tasks_);
    }
    for (auto& t : tasks)
      if (t) t();
  }

 private:
  std::mutex mutex_;
  std::condition_variable posted_;
  std::deque<KvTransferAgent::Task> tasks_;
};

// The value of the first sample of `name` whose line contains `labels`.
double sample(const metrics::Registry& registry, const std::string& name,
              const std::string& labels = "") {
  const std::string text = registry.render();
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(name, 0) != 0 || line.size() <= name.size()) continue;
    if (line[name.size()] != '{' && line[name.size()] != ' ') continue;
    if (line.find(labels) == std::string::npos) continue;
    return std::stod(line.substr(line.rfind(' ') + 1));
  }
  ADD_FAILURE() << "no sample " << name << " with " << labels << " in:\n" << text;
  return -1;
}

using Outcome = std::shared_ptr<std::optional<KvFetchResult>>;

struct RoomOutcome {
  bool called = false, ok = false, abandoned = false;
  std::string error;
  int calls = 0;
};

class KvTransferAgents : public ::testing::Test {
 protected:
  // The prompt of these tests: 11 tokens in blocks 5, 2, 9 of the prefill engine (the last one
  // holds 3 tokens); the decode engine wants tokens [0, 10) in its blocks 1, 7, 3.
  const std::vector<int32_t> prompt_ = {11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21};
  const std::vector<int32_t> remote_ = {5, 2, 9};
  const std::vector<int32_t> local_ = {1, 7, 3};

  void SetUp() override { prefill_exec_.fill_distinct(); }

  void start(double prefill_timeout_s = 5) {
    KvTransferConfig p;
    p.engine_id = "prefill-0";
    p.listen_host = "127.0.0.1";
    p.port = 0;
    p.advertise_host = "127.0.0.1";
    p.timeout_s = prefill_timeout_s;
    p.checksum = prefill_checksum_;
    p.secret = prefill_secret_;
    p.handshake_timeout_s = handshake_timeout_s_;
    p.max_rooms = prefill_max_rooms_;
    if (prefill_on_test_clock_) p.now = clock_.seam();
    prefill_ = std::make_unique<KvTransferAgent>(p, prefill_exec_,
                                                 make_transport(transport_, prefill_io_timeout_),
                                                 prefill_metrics_, queue_.post());
    decode_ = make_decode(decode_exec_, decode_metrics_);
    ASSERT_TRUE(prefill_->serving());
    ASSERT_NE(prefill_->port(), 0);
    ASSERT_FALSE(decode_->serving());
    EXPECT_EQ(decode_->port(), 0);
  }

  // Over `kind` ("tcp" or "shm"), by default the fixture's transport.
  std::unique_ptr<KvTransferAgent> make_decode(FakeExecutor& exec, metrics::Registry& registry,
                                               const std::string& kind = "") {
    return make_decode(exec, registry,
                       make_transport(kind.empty() ? transport_ : kind, decode_io_timeout_));
  }
  std::unique_ptr<KvTransferAgent> make_decode(FakeExecutor& exec, metrics::Registry& registry,
                                               std::unique_ptr<KvTransport> transport) {
    KvTransferConfig d;
    d.engine_id = "decode-0";
    d.port = -1;
    d.timeout_s = decode_timeout_s_;
    d.checksum = decode_checksum_;
    d.handshake_timeout_s = handshake_timeout_s_;
    d.secret = decode_secret_;
    d.allow = decode_allow_;
    if (decode_on_test_clock_) d.now = clock_.seam();
    return std::make_unique<KvTransferAgent>(d, exec, std::move(transport), registry,
                                             queue_.post());
  }

  KvTransferAgents() = default;
  // Engines with caches of `layout` over `transport` ("tcp" or "shm").
  KvTransferAgents(KvLayout layout, std::string transport)
      : prefill_exec_(layout), decode_exec_(layout), transport_(std::move(transport)) {}

  // Set before start(): the engines' KV transfer secrets (empty: no handshake), how long the
  // prefill side waits for a connection's first frame, and its transport's I/O timeout.
  std::string prefill_secret_, decode_secret_;
  std::vector<std::string> decode_allow_;  // the decode engine's --kv-transfer-allow
  bool prefill_checksum_ = true, decode_checksum_ = true;  // their --kv-transfer-checksum
  double handshake_timeout_s_ = 5;
  double decode_timeout_s_ = 5;  // the decode engine's --kv-transfer-timeout
  size_t prefill_max_rooms_ = KvTransferConfig{}.max_rooms;
  std::chrono::milliseconds prefill_io_timeout_ = 5000ms;
  std::chrono::milliseconds decode_io_timeout_ = 5000ms;
  // Set before start(): which engines read clock_ (KvTransferConfig::now), not the real clock.
  bool prefill_on_test_clock_ = false, decode_on_test_clock_ = false;
  KvTestClock clock_;  // outlives the engines

  // open_room, remembering the claim for the room calls that follow.
  uint64_t open(uint64_t room, uint64_t hash, int64_t tokens, KvTransferAgent::RoomDone done) {
    const uint64_t claim = prefill_->open_room(room, hash, tokens, std::move(done));
    if (claim != 0) claims_[room] = claim;
    return claim;
  }
  std::map<uint64_t, uint64_t> claims_;

  KvFetch pull(const std::string& transfer_id, int64_t first, int64_t num,
               std::vector<int32_t> local, const std::string& request_id = "req-1") {
    KvFetch f;
    f.request_id = request_id;
    f.pull = true;
    f.host = "127.0.0.1";
    f.port = prefill_port();
    f.engine_id = "prefill-0";
    f.transfer_id = transfer_id;
    f.remote_blocks = remote_;
    f.prompt_hash = kv_prompt_hash(prompt_);
    f.prompt_tokens = int64_t(prompt_.size());
    f.first_token = first;
    f.num_tokens = num;
    f.local_blocks = std::move(local);
    return f;
  }

  KvFetch enter_room(uint64_t room, std::vector<int32_t> local, const std::string& request_id) {
    KvFetch f;
    f.request_id = request_id;
    f.pull = false;
    f.host = "127.0.0.1";
    f.port = prefill_port();
    f.room = room;
    f.prompt_hash = kv_prompt_hash(prompt_);
    f.prompt_tokens = int64_t(prompt_.size());
    f.first_token = 0;
    f.num_tokens = int64_t(prompt_.size()) - 1;
    f.local_blocks = std::move(local);
    return f;
  }

  // Gives the room its blocks and finishes its layers one by one: each layer reaches the decode
  // cache before the next one is computed, and none leaves before it is complete.
  void finish_room_layer_by_layer(uint64_t room) {
    prefill_->room_blocks(room, claims_[room], remote_);
    EXPECT_EQ(prefill_->held_blocks(), int64_t(remote_.size()));
    const int64_t layers = prefill_exec_.info().kv_layout.layers;
    for (int64_t done = 1; done <= layers; ++done) {
      prefill_->room_layers_done(room, claims_[room], done);
      ASSERT_TRUE(decode_exec_.wait_for_write(done - 1)) << "layer " << done - 1;
      if (done < layers) {
        EXPECT_EQ(decode_exec_.writes(done), 0);
      }
    }
  }

  uint16_t prefill_port() const { return port_override_ ? port_override_ : prefill_->port(); }

  // Two decode legs registering for `room`: the prefill engine refuses one as a duplicate, which
  // tells that the other one is registered. Returns that one's request id and outcome.
  std::pair<std::string, Outcome> register_decode(uint64_t room) {
    Outcome a = fetch(enter_room(room, local_, "req-a"));
    Outcome b = fetch(enter_room(room, {10, 11, 12}, "req-b"));
    EXPECT_TRUE(queue_.run_until([&] { return a->has_value() || b->has_value(); }));
    EXPECT_NE(a->has_value(), b->has_value());
    EXPECT_THAT((a->has_value() ? **a : **b).error, HasSubstr("duplicate"));
    return a->has_value() ? std::pair{std::string("req-b"), b} : std::pair{std::string("req-a"), a};
  }

  // A registered decode leg whose request ends (cancel_fetch closes its connection) while its
  // room's prefill leg waits for the prompt's last layers: the prefill leg fails at once, as an
  // abandoned room's, and frees its blocks; it waited for the room's timeout (600 s here, past
  // the hang guard), since nothing looked at the connection while the layers were computed.
  void a_decode_that_leaves_mid_transfer_fails_the_room() {
    start(600);
    RoomOutcome done;
    ASSERT_TRUE(open(70, kv_prompt_hash(prompt_), 11, room_done(done)));
    prefill_->room_blocks(70, claims_[70], remote_);
    prefill_->room_layers_done(70, claims_[70], 1);
    Outcome o = fetch(enter_room(70, local_, "req-70"));
    ASSERT_TRUE(decode_exec_.wait_for_write(0));
    decode_->cancel_fetch("req-70");
    EXPECT_FALSE(wait(o).ok);
    ASSERT_TRUE(queue_.run_until([&] { return done.called; }));
    EXPECT_FALSE(done.ok);
    EXPECT_EQ(done.error,
              "the decode engine of bootstrap_room 70 closed its connection (its "
              "request ended)");
    EXPECT_TRUE(done.abandoned);  // its decode leg's doing, not this engine's
    EXPECT_EQ(prefill_->held_blocks(), 0);
    EXPECT_EQ(sample(prefill_metrics_, "tandem:kv_transfers_total", "result=\"error\""), 1);
  }

  // The same leg gone before the prompt's layers were ready: they are not sent into a connection
  // nobody reads. Over shared memory they fitted in the ring, and the transfer counted as sent
  // and the prefill leg answered 200.
  void a_decode_that_left_is_sent_nothing() {
    start(600);
    RoomOutcome done;
    ASSERT_TRUE(open(71, kv_prompt_hash(prompt_), 11, room_done(done)));
    prefill_->room_blocks(71, claims_[71], remote_);
    auto [id, o] = register_decode(71);
    decode_->cancel_fetch(id);
    EXPECT_FALSE(wait(o).ok);  // its connection is closed now
    prefill_->room_layers_done(71, claims_[71], kLayout.layers);
    ASSERT_TRUE(queue_.run_until([&] { return done.called; }));
    EXPECT_FALSE(done.ok);
    EXPECT_THAT(done.error, HasSubstr("closed its connection"));
    EXPECT_TRUE(done.abandoned);
    EXPECT_EQ(decode_exec_.writes(), 0);
    EXPECT_EQ(prefill_->held_blocks(), 0);
    EXPECT_EQ(sample(prefill_metrics_, "tandem:kv_transfers_total", "result=\"error\""), 1);
  }

  // A decode leg that registered and left before its room's prefill leg came: that leg is
  // refused as one of an abandoned room, instead of waiting the timeout for a decode engine that
  // is gone (until the prefill engine notices, it joins the room and then fails at once, as in
  // a_decode_that_leaves_mid_transfer_fails_the_room).
  void a_decode_that_left_before_the_prefill_leg_has_it_refused() {
    start(600);
    auto [id, o] = register_decode(72);
    decode_->cancel_fetch(id);
    EXPECT_FALSE(wait(o).ok);
    // The prefill engine counts the ended registration when it has noticed.
    ASSERT_TRUE(queue_.run_until(
        [&] { return prefill_metrics_.render().find("result=\"error\"") != std::string::npos; }));
    RoomOutcome late;
    try {
      open(72, kv_prompt_hash(prompt_), 11, room_done(late));
      ADD_FAILURE() << "open_room accepted a room whose decode leg left";
    } catch (const KvTransferError& e) {
      EXPECT_THAT(e.what(), HasSubstr("bootstrap_room 72 closed its connection"));
      EXPECT_TRUE(e.room_abandoned);
    }
    // Refused once: the room is free again.
    RoomOutcome again;
    ASSERT_TRUE(open(72, kv_prompt_hash(prompt_), 11, room_done(again)));
    prefill_->room_failed(72, claims_[72], "test over");
    ASSERT_TRUE(queue_.run_until([&] { return again.called; }));
    EXPECT_FALSE(late.called);
  }

  // A decode leg that registered and waited out its timeout (1 s), its prefill leg not come; the
  // prefill engine's room timed out too (1 s). Its deadline was looked at before its connection,
  // so it failed as 'no prefill request ... arrived' and left no refusal: a prefill leg coming
  // later opened a fresh room and waited out the timeout for a decode leg that was gone. It is
  // refused at once now, as the simulator's is.
  void a_decode_that_timed_out_before_the_prefill_leg_has_it_refused() {
    decode_timeout_s_ = 1;
    start(1);
    auto [id, o] = register_decode(73);
    EXPECT_FALSE(wait(o).ok);
    ASSERT_TRUE(queue_.run_until(
        [&] { return prefill_metrics_.render().find("result=\"error\"") != std::string::npos; }));
    RoomOutcome late;
    try {
      open(73, kv_prompt_hash(prompt_), 11, room_done(late));
      ADD_FAILURE() << "open_room accepted a room whose decode leg gave up";
      prefill_->room_failed(73, claims_[73], "test over");
    } catch (const KvTransferError& e) {
      EXPECT_THAT(e.what(), HasSubstr("bootstrap_room 73"));
      EXPECT_TRUE(e.room_abandoned);
    }
  }

  // A pull refused because every connection the prefill engine allows from this address is in
  // use (64 silent ones, in their handshake) says so (prefill_busy), blames no engine, and leaves
  // the hold there: the same pull takes the KV once a connection is free. It was a code-less
  // failure, which sent the gateway back to a prefill though the KV was still held.
  void a_busy_prefill_refuses_a_pull_for_now() {
    handshake_timeout_s_ = 600;  // past the hang guard: only their closing frees their slots
    start(600);                  // nor does the hold expire
    std::vector<std::unique_ptr<RawSocket>> silent;
    for (int64_t i = 0; i < KvHandshakeCounts::kMaxPerAddress; ++i) {
      silent.push_back(std::make_unique<RawSocket>(prefill_->port()));
      ASSERT_TRUE(silent.back()->connected());
    }
    bool released = false;
    const std::string id = prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()),
                                          [&] { released = true; });
    const KvFetchResult refused = wait(fetch(pull(id, 0, 10, local_)));
    EXPECT_FALSE(refused.ok);
    EXPECT_TRUE(refused.prefill_busy) << refused.error;
    EXPECT_FALSE(refused.prefill_fault) << refused.error;
    EXPECT_FALSE(refused.transfer_gone) << refused.error;
    EXPECT_THAT(refused.error, HasSubstr("too many KV transfer connections from this address"));
    EXPECT_EQ(prefill_->held_blocks(), int64_t(remote_.size()));
    EXPECT_EQ(decode_exec_.writes(), 0);
    silent.clear();  // the server notices them go and frees their slots
    int attempt = 0;
    KvFetchResult pulled;
    repeat_until(
        [&] {
          pulled = wait(fetch(pull(id, 0, 10, local_, "req-" + std::to_string(attempt++))));
          // Busy until the server has noticed; never anything else.
          EXPECT_TRUE(pulled.ok || pulled.prefill_busy) << pulled.error;
          return pulled.ok || !pulled.prefill_busy;
        },
        kHangGuard, "the slots of the closed connections were never freed");
    ASSERT_TRUE(pulled.ok) << pulled.error;
    FakeExecutor expected;
    expected.copy_tokens(prefill_exec_, remote_, local_, 0, 10);
    EXPECT_TRUE(decode_exec_.data() == expected.data());
    EXPECT_TRUE(queue_.run_until([&] { return released; }));
  }

  // A room's registration refused for the same reason says so too (prefill_busy): the decode
  // engine then abandons the room (PdCoordinator::on_fetch_done), which ends its prefill leg at
  // once. It was an ordinary refusal, after which nothing told the room, whose prefill leg waited
  // for a registration until the room's timeout.
  void a_busy_prefill_refuses_a_room_registration_for_now() {
    handshake_timeout_s_ = 600;  // past the hang guard: only their closing frees their slots
    start(600);                  // nor does the room time out
    std::vector<std::unique_ptr<RawSocket>> silent;
    for (int64_t i = 0; i < KvHandshakeCounts::kMaxPerAddress; ++i) {
      silent.push_back(std::make_unique<RawSocket>(prefill_->port()));
      ASSERT_TRUE(silent.back()->connected());
    }
    RoomOutcome done;
    ASSERT_TRUE(open(95, kv_prompt_hash(prompt_), 11, room_done(done)));
    const KvFetchResult refused = wait(fetch(enter_room(95, local_, "req-95")));
    EXPECT_FALSE(refused.ok);
    EXPECT_TRUE(refused.prefill_busy) << refused.error;
    EXPECT_FALSE(refused.prefill_fault) << refused.error;
    EXPECT_FALSE(refused.transfer_gone) << refused.error;
    EXPECT_THAT(refused.error, HasSubstr("too many KV transfer connections from this address"));
    EXPECT_FALSE(done.called) << "the refused registration ended the room: " << done.error;
    silent.clear();
    prefill_->room_failed(95, claims_[95], "test over");
    ASSERT_TRUE(queue_.run_until([&] { return done.called; }));
  }

  Outcome fetch(KvTransferAgent& agent, KvFetch f) {
    auto out = std::make_shared<std::optional<KvFetchResult>>();
    agent.fetch(std::move(f), [out](const KvFetchResult& r) { *out = r; });
    return out;
  }
  Outcome fetch(KvFetch f) { return fetch(*decode_, std::move(f)); }

  // The fetch's result; a fetch that never finishes fails the run (testing::fail_hung), as its
  // peer may be a FakePrefill still sending, whose end would otherwise wait for it.
  KvFetchResult wait(const Outcome& o,
                     const std::source_location& where = std::source_location::current()) {
    if (!queue_.run_until([&] { return o->has_value(); }))
      testing::fail_hung("the fetch never finished", kHangGuard, where);
    return o->value();
  }

  KvTransferAgent::RoomDone room_done(RoomOutcome& out) {
    return [&out](bool ok, const std::string& error, bool abandoned) {
      out.called = true;
      out.ok = ok;
      out.error = error;
      out.abandoned = abandoned;
      ++out.calls;
    };
  }

  // Declared first: destroyed after the agents, which post while shutting down.
  TaskQueue queue_;
  FakeExecutor prefill_exec_, decode_exec_;
  const std::string transport_ = "tcp";
  metrics::Registry prefill_metrics_, decode_metrics_;
  std::unique_ptr<KvTransferAgent> prefill_, decode_;
  uint16_t port_override_ = 0;  // a fake prefill server instead of prefill_
};

// ------------------------------------------------------------------------------- sequential

TEST_F(KvTransferAgents, PullCopiesExactlyTheRequestedTokens) {
  start();
  bool released = false;
  const std::string id = prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()),
                                        [&] { released = true; });
  EXPECT_THAT(id, HasSubstr("prefill-0"));
  EXPECT_EQ(prefill_->held_blocks(), 3);

  // The decode recomputes the last prompt token: it asks for [0, 10), a partial last block.
  const KvFetchResult r = wait(fetch(pull(id, 0, 10, local_)));
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_EQ(r.bytes, 10u * 8 * 3);
  FakeExecutor expected;
  expected.copy_tokens(prefill_exec_, remote_, local_, 0, 10);
  EXPECT_TRUE(decode_exec_.data() == expected.data()) << "decode cache differs from the expected";
  // Token 10 of block 3 (the recomputed one) and the rest of that block stay untouched.
  EXPECT_EQ(decode_exec_.block(3, 0)[2 * 8], kUntouched);

  ASSERT_TRUE(queue_.run_until([&] { return released; })) << "release never posted";
  EXPECT_EQ(prefill_->held_blocks(), 0);
  EXPECT_EQ(sample(decode_metrics_, "tandem:kv_transfer_bytes_total", "direction=\"received\""),
            240);
  EXPECT_EQ(sample(prefill_metrics_, "tandem:kv_transfer_bytes_total", "direction=\"sent\""), 240);
  EXPECT_EQ(sample(decode_metrics_, "tandem:kv_transfers_total", "result=\"ok\""), 1);

  // Pulled once: the hold is gone.
  const KvFetchResult again = wait(fetch(pull(id, 0, 10, local_, "req-2")));
  EXPECT_FALSE(again.ok);
  EXPECT_THAT(again.error, HasSubstr("unknown transfer '" + id + "'"));
  EXPECT_THAT(again.error, HasSubstr("127.0.0.1:" + std::to_string(prefill_->port())));
}

TEST_F(KvTransferAgents, PullFromABlockAlignedOffsetSkipsTheCachedPrefix) {
  start();
  bool released = false;
  const std::string id = prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()),
                                        [&] { released = true; });
  // The decode engine has tokens [0, 4) cached: it asks for [4, 10) into blocks 7 and 3.
  const KvFetchResult r = wait(fetch(pull(id, 4, 10, {7, 3})));
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_EQ(r.bytes, 6u * 8 * 3);
  FakeExecutor expected;
  expected.copy_tokens(prefill_exec_, remote_, {7, 3}, 4, 10);
  EXPECT_TRUE(decode_exec_.data() == expected.data());
  EXPECT_TRUE(queue_.run_until([&] { return released; }));
}

TEST_F(KvTransferAgents, EmptyPullStillReleasesTheHold) {
  // Everything the decode needs is cached there (or a one-token prompt): the transfer moves no
  // bytes but tells the prefill engine to let go of its blocks.
  start();
  bool released = false;
  const std::string id = prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()),
                                        [&] { released = true; });
  const KvFetchResult r = wait(fetch(pull(id, 8, 8, {})));
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_EQ(r.bytes, 0u);
  EXPECT_EQ(decode_exec_.writes(), 0);
  EXPECT_TRUE(queue_.run_until([&] { return released; }));
  EXPECT_EQ(prefill_->held_blocks(), 0);
}

// The gateway's release of a request that ended before any decode engine took its KV (POST
// /v1/kv_transfer/release): the hold is freed as a pull would free it, and a later pull finds it
// gone, as it would after the hold's expiry; releasing again, or an id never held, frees nothing.
TEST_F(KvTransferAgents, AReleasedHoldIsFreedAndCanNoLongerBePulled) {
  start(600);  // expiry far past the hang guard: only the release can free it
  bool released = false;
  const std::string id = prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()),
                                        [&] { released = true; });
  EXPECT_TRUE(prefill_->release_held(id));
  EXPECT_EQ(prefill_->held_blocks(), 0);
  EXPECT_TRUE(queue_.run_until([&] { return released; }));
  EXPECT_FALSE(prefill_->release_held(id));
  EXPECT_FALSE(prefill_->release_held("prefill-0-00000000000000000000000000000000"));

  const KvFetchResult r = wait(fetch(pull(id, 0, 10, local_)));
  EXPECT_FALSE(r.ok);
  EXPECT_TRUE(r.transfer_gone) << r.error;
  EXPECT_EQ(decode_exec_.writes(), 0);
  EXPECT_EQ(sample(prefill_metrics_, "tandem:kv_transfer_expired_total"), 0);
}

// A release that comes while a decode engine pulls the hold (the gateway gave up on a request
// whose decode leg had just reached its engine) frees nothing: the blocks stay until the pull
// ends, which copies them whole and frees them then.
TEST_F(KvTransferAgents, AReleaseLeavesAHoldBeingPulledToItsPull) {
  start(600);
  int released = 0;
  const std::string id = prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()),
                                        [&] { ++released; });
  prefill_exec_.close_gate();
  Outcome pulling = fetch(pull(id, 0, 10, local_, "req-pulling"));
  ASSERT_TRUE(prefill_exec_.wait_for_reader_at_gate());  // the pull is sending layer 0

  EXPECT_FALSE(prefill_->release_held(id));
  EXPECT_EQ(prefill_->held_blocks(), int64_t(remote_.size()));

  prefill_exec_.open_gate();
  const KvFetchResult r = wait(pulling);
  ASSERT_TRUE(r.ok) << r.error;
  FakeExecutor expected;
  expected.copy_tokens(prefill_exec_, remote_, local_, 0, 10);
  EXPECT_TRUE(decode_exec_.data() == expected.data());
  EXPECT_TRUE(queue_.run_until([&] { return released == 1; }));
  EXPECT_EQ(prefill_->held_blocks(), 0);
  EXPECT_FALSE(prefill_->release_held(id));
  EXPECT_EQ(released, 1);
}

TEST_F(KvTransferAgents, BadPullsNameTheProblemAndKeepTheHold) {
  start();
  bool released = false;
  const std::string id = prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()),
                                        [&] { released = true; });

  KvFetch f = pull(id, 0, 10, local_);
  f.engine_id = "someone-else";
  KvFetchResult r = wait(fetch(f));
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("remote_engine_id 'someone-else' is not this prefill engine"));
  // Another engine's transfer (this one restarted at its address with a new id): its KV is not
  // here, so the request must be prefilled again, as for an expired transfer.
  EXPECT_TRUE(r.transfer_gone) << "a pull of another engine's transfer did not say it is gone";

  f = pull(id, 0, 10, local_);
  f.remote_blocks = {5, 2, 8};
  r = wait(fetch(f));
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("remote_block_ids do not match"));

  r = wait(fetch(pull(id, 0, 12, {1, 7, 3})));  // more tokens than held
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("tokens [0, 12) are not within the 11 held tokens"));

  r = wait(fetch(pull(id, 2, 10, local_)));  // a start that is not block aligned
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("tokens [2, 10)"));

  r = wait(fetch(pull("prefill-0-99", 0, 10, local_)));
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("unknown transfer 'prefill-0-99'"));
  EXPECT_TRUE(r.transfer_gone) << r.error;

  EXPECT_EQ(decode_exec_.writes(), 0);
  EXPECT_FALSE(released);
  EXPECT_EQ(prefill_->held_blocks(), 3);
  EXPECT_EQ(sample(decode_metrics_, "tandem:kv_transfers_total", "result=\"error\""), 5);

  // None of that consumed the hold.
  r = wait(fetch(pull(id, 0, 10, local_)));
  EXPECT_TRUE(r.ok) << r.error;
  EXPECT_TRUE(queue_.run_until([&] { return released; }));
}

// A pull refused for its remote_block_ids, or by a decode engine of another layout, is followed by
// that decode engine's release of the hold (PdCoordinator::on_fetch_done: the gateway prefills
// the prompt again), which names the same blocks and layout. A release moves no KV, so neither
// matters to it: it frees the hold. It was refused for the same reason, and the blocks stayed
// held until the timeout (600 s here, past the hang guard).
TEST_F(KvTransferAgents, AReleaseAfterAPullRefusedForItsBlocksOrLayoutFreesTheHold) {
  start(600);
  bool released = false;
  const std::string id = prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()),
                                        [&] { released = true; });
  KvFetch f = pull(id, 0, 10, local_);
  f.remote_blocks = {5, 2, 8};
  const KvFetchResult r = wait(fetch(f));
  EXPECT_THAT(r.error, HasSubstr("remote_block_ids do not match"));
  EXPECT_EQ(prefill_->held_blocks(), 3);
  decode_->release_remote("127.0.0.1", prefill_->port(), "prefill-0", id, f.remote_blocks);
  EXPECT_TRUE(queue_.run_until([&] { return released; }));

  bool other_released = false;
  const std::string other_id = prefill_->hold(
      remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()), [&] { other_released = true; });
  FakeExecutor other(KvLayout{"fake", 3, 8, 8});  // 8 tokens a block
  metrics::Registry registry;
  auto other_decode = make_decode(other, registry);
  const KvFetchResult refused = wait(fetch(*other_decode, pull(other_id, 0, 10, {1, 2})));
  EXPECT_THAT(refused.error, HasSubstr("block_size mismatch"));
  other_decode->release_remote("127.0.0.1", prefill_->port(), "prefill-0", other_id, remote_);
  EXPECT_TRUE(queue_.run_until([&] { return other_released; }));
  EXPECT_EQ(prefill_->held_blocks(), 0);
  EXPECT_EQ(decode_exec_.writes(), 0);
  EXPECT_EQ(other.writes(), 0);
}

TEST_F(KvTransferAgents, LayoutMismatchIsNamed) {
  start();
  bool released = false;
  const std::string id = prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()),
                                        [&] { released = true; });
  {
    FakeExecutor other(KvLayout{"fake", 3, 8, 8});  // 8 tokens a block
    metrics::Registry registry;
    auto agent = make_decode(other, registry);
    const KvFetchResult r = wait(fetch(*agent, pull(id, 0, 10, {1, 2})));
    EXPECT_FALSE(r.ok);
    EXPECT_THAT(r.error, HasSubstr("block_size mismatch: this prefill engine has 4, the decode "
                                   "engine 8"));
    EXPECT_EQ(other.writes(), 0);
  }
  {
    FakeExecutor other(KvLayout{"other-model", 3, 4, 8});
    metrics::Registry registry;
    auto agent = make_decode(other, registry);
    const KvFetchResult r = wait(fetch(*agent, pull(id, 0, 10, local_)));
    EXPECT_FALSE(r.ok);
    EXPECT_THAT(r.error, HasSubstr("model mismatch"));
    EXPECT_THAT(r.error, HasSubstr("other-model"));
  }
  {
    FakeExecutor other(KvLayout{"fake", 3, 4, 16});
    metrics::Registry registry;
    auto agent = make_decode(other, registry);
    const KvFetchResult r = wait(fetch(*agent, pull(id, 0, 10, local_)));
    EXPECT_FALSE(r.ok);
    EXPECT_THAT(r.error, HasSubstr("token_bytes mismatch"));
  }
  EXPECT_FALSE(released);
  EXPECT_EQ(prefill_->held_blocks(), 3);
}

TEST(KvPeerAllow, HostsMatchAsWrittenAndAddressesByIpv4Block) {
  EXPECT_TRUE(kv_peer_allowed({}, "anywhere.example"));
  const std::vector<std::string> allow = {"prefill-0.cluster", "10.1.0.0/16", "192.168.5.7"};
  EXPECT_TRUE(kv_peer_allowed(allow, "prefill-0.cluster"));
  EXPECT_TRUE(kv_peer_allowed(allow, "10.1.255.3"));
  EXPECT_TRUE(kv_peer_allowed(allow, "192.168.5.7"));
  EXPECT_FALSE(kv_peer_allowed(allow, "10.2.0.1"));
  EXPECT_FALSE(kv_peer_allowed(allow, "192.168.5.8"));
  EXPECT_FALSE(kv_peer_allowed(allow, "prefill-1.cluster"));
  EXPECT_FALSE(kv_peer_allowed(allow, "localhost"));
  EXPECT_TRUE(kv_peer_allowed({"0.0.0.0/0"}, "8.8.8.8"));
  EXPECT_NO_THROW(check_kv_peer_allow(allow));
  for (const std::string bad : {"10.0.0.0/33", "10.0.0/8", "10.0.0.0/", "10.0.0.0/x", ""})
    EXPECT_THROW(check_kv_peer_allow({bad}), Error) << bad;
}

// One host owns an IPv6 /64 and can take a new address in it for every connection: counted per
// address, it held 64 of the port's 512 slots per address, i.e. all of them. Its connections now
// count together per /64; an IPv4-mapped address counts as its IPv4 address, which stays alone.
TEST(KvHandshakeGroup, IPv6PeersCountPerSlash64AndIPv4PeersPerAddress) {
  EXPECT_EQ(kv_handshake_group("2001:db8:1:2::1:40000"), "2001:db8:1:2::/64");
  EXPECT_EQ(kv_handshake_group("2001:db8:1:2:ffff:ffff:ffff:ffff:40001"), "2001:db8:1:2::/64");
  EXPECT_EQ(kv_handshake_group("2001:db8:1:2:a:b:c:d:1"), "2001:db8:1:2::/64");
  EXPECT_EQ(kv_handshake_group("2001:db8:1:3::1:40000"), "2001:db8:1:3::/64");
  EXPECT_EQ(kv_handshake_group("::1:40000"), "::/64");
  EXPECT_EQ(kv_handshake_group("[2001:db8:1:2::7]:40000"), "2001:db8:1:2::/64");
  EXPECT_EQ(kv_handshake_group("::ffff:10.0.0.7:5000"), "10.0.0.7");
  EXPECT_EQ(kv_handshake_group("10.0.0.7:6000"), "10.0.0.7");
  EXPECT_EQ(kv_handshake_group("10.0.0.8:6000"), "10.0.0.8");
  EXPECT_EQ(kv_handshake_group("shared memory (local peer, pid 5)"),
            "shared memory (local peer, pid 5)");
}

TEST(KvPeerAddress, IsTheAddressAloneInOneFormForEachAddress) {
  EXPECT_EQ(kv_peer_address("2001:db8:1:2::1:40000"), "2001:db8:1:2::1");
  EXPECT_EQ(kv_peer_address("[2001:db8:1:2:0:0:0:1]:40000"), "2001:db8:1:2::1");
  EXPECT_EQ(kv_peer_address("::ffff:10.0.0.7:5000"), "10.0.0.7");
  EXPECT_EQ(kv_peer_address("10.0.0.7:6000"), "10.0.0.7");
  EXPECT_EQ(kv_peer_address("shared memory (local peer, pid 5)"),
            "shared memory (local peer, pid 5)");
}

// Connections in their handshake count per address (64) and per IPv6 /64 (256). Counted per /64
// alone under the one cap of 64, the decode engines of one subnet (a cloud's IPv6 subnet, a
// Kubernetes node's pod range, each a /64) shared 64 handshakes: a burst of more concurrent
// fetches across them was refused "too many KV transfer connections from this address".
TEST(KvHandshakeCounts, EachAddressHas64AndEachSlash64Has256) {
  KvHandshakeCounts counts;
  const auto peer = [](int host, int port) {
    return "2001:db8:1:2::" + std::to_string(host) + ":" + std::to_string(40000 + port);
  };
  // Four decode engines of one /64, 64 connections each, all in their handshake at once.
  for (int host = 1; host <= 4; ++host)
    for (int i = 0; i < 64; ++i)
      ASSERT_EQ(counts.admit(peer(host, i)), "") << "engine " << host << ", connection " << i;
  EXPECT_EQ(counts.admit(peer(1, 64)),
            "too many KV transfer connections from this address; try again");
  // A fifth address of that /64 (a host taking a new one for each connection) is past the /64's.
  EXPECT_EQ(counts.admit(peer(5, 0)),
            "too many KV transfer connections from this address's /64 network; try again");
  EXPECT_EQ(counts.admit("[2001:db8:1:3::5]:40000"), "") << "another /64";
  EXPECT_EQ(counts.admit("10.0.0.7:6000"), "");
  // One past its handshake frees a slot of its address and of its /64.
  counts.over(peer(1, 0));
  EXPECT_EQ(counts.admit(peer(5, 0)), "");
  EXPECT_EQ(counts.admit(peer(1, 64)),
            "too many KV transfer connections from this address's /64 network; try again");
  counts.over(peer(5, 0));
  EXPECT_EQ(counts.admit(peer(1, 64)), "");
  // An IPv4 address has its own 64, whatever its neighbours hold.
  for (int i = 1; i < 64; ++i) ASSERT_EQ(counts.admit("10.0.0.7:" + std::to_string(i)), "");
  EXPECT_EQ(counts.admit("10.0.0.7:9999"),
            "too many KV transfer connections from this address; try again");
  EXPECT_EQ(counts.admit("10.0.0.8:9999"), "");
}

TEST_F(KvTransferAgents, ADecodeEngineConnectsOnlyToAllowedHosts) {
  decode_allow_ = {"10.0.0.0/8"};
  start();
  const std::string id =
      prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()), [] {});
  const KvFetchResult r = wait(fetch(pull(id, 0, 10, local_)));
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("127.0.0.1 refused: the host is not in --kv-transfer-allow"));
  EXPECT_FALSE(r.prefill_fault) << "this engine's own refusal blamed the prefill engine";
  EXPECT_EQ(decode_exec_.writes(), 0);
  EXPECT_EQ(prefill_->held_blocks(), 3);  // nothing reached the prefill engine
}

TEST_F(KvTransferAgents, AHoldNobodyPullsExpires) {
  start(0.3);
  bool released = false;
  const std::string id = prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()),
                                        [&] { released = true; });
  ASSERT_TRUE(queue_.run_until([&] { return released; })) << "expired hold never released";
  EXPECT_EQ(prefill_->held_blocks(), 0);
  EXPECT_EQ(sample(prefill_metrics_, "tandem:kv_transfer_expired_total"), 1);
  const KvFetchResult r = wait(fetch(pull(id, 0, 10, local_)));
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("unknown transfer"));
  EXPECT_FALSE(r.prefill_fault) << "a refusal the prefill engine answered blamed it";
  EXPECT_TRUE(r.transfer_gone) << "an expired hold did not say the KV is gone";
  EXPECT_EQ(decode_exec_.writes(), 0);
}

TEST_F(KvTransferAgents, ShuttingDownReturnsHeldBlocks) {
  start();
  bool released = false;
  prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()),
                 [&] { released = true; });
  prefill_.reset();
  EXPECT_TRUE(queue_.run_until([&] { return released; }));
}

// Connections run on a pool of reused threads. Peers that connect and send nothing hold a worker
// each until the I/O timeout; a pull that comes after them must be served meanwhile (the pool
// grows rather than queueing work behind blocked workers), also with a worker left idle by an
// earlier transfer.
TEST_F(KvTransferAgents, SilentConnectionsDoNotHoldUpATransfer) {
  handshake_timeout_s_ = 600;  // past the hang guard: they stay open while the transfer runs
  start();
  const auto hash = kv_prompt_hash(prompt_);
  const auto n = int64_t(prompt_.size());
  const std::string first = prefill_->hold(remote_, hash, n, [] {});
  ASSERT_TRUE(wait(fetch(pull(first, 0, 10, local_))).ok);  // leaves an idle worker behind
  std::vector<std::unique_ptr<RawSocket>> silent;
  for (int i = 0; i < 3; ++i) {
    silent.push_back(std::make_unique<RawSocket>(prefill_->port()));
    ASSERT_TRUE(silent.back()->connected());
  }
  const std::string second = prefill_->hold(remote_, hash, n, [] {});
  const KvFetchResult r = wait(fetch(pull(second, 0, 10, local_, "req-2")));
  ASSERT_TRUE(r.ok) << r.error;
  // Served while the silent ones still wait: none of them was answered or timed out first.
  for (const auto& s : silent) EXPECT_FALSE(s->heard_back());
}

// One address cannot hold more than 64 of the port's slots with connections that never get past
// the handshake: reconnecting faster than the handshake timeout closes them no longer exhausts
// the port (other addresses keep their slots; here every peer is 127.0.0.1, so the transfer is
// refused too until the silent connections go).
TEST_F(KvTransferAgents, OneAddressHoldsAtMost64ConnectionsInTheHandshake) {
  handshake_timeout_s_ = 600;  // past the hang guard: only their closing frees their slots
  start();
  std::vector<std::unique_ptr<RawSocket>> silent;
  for (int i = 0; i < 64; ++i) {
    silent.push_back(std::make_unique<RawSocket>(prefill_->port()));
    ASSERT_TRUE(silent.back()->connected());
  }
  RawSocket one_more(prefill_->port());
  EXPECT_TRUE(one_more.hears_back_within(kHangGuard));
  const auto hash = kv_prompt_hash(prompt_);
  const std::string id = prefill_->hold(remote_, hash, int64_t(prompt_.size()), [] {});
  const KvFetchResult refused = wait(fetch(pull(id, 0, 10, local_)));
  EXPECT_FALSE(refused.ok);
  EXPECT_THAT(refused.error, HasSubstr("too many KV transfer connections from this address"));
  for (const auto& s : silent) EXPECT_FALSE(s->heard_back());
  silent.clear();   // the server notices them go and frees their slots
  int attempt = 0;  // refused until it has noticed; a pull then succeeds
  repeat_until(
      [&] { return wait(fetch(pull(id, 0, 10, local_, "req-" + std::to_string(attempt++)))).ok; },
      kHangGuard, "the slots of the closed connections were never freed");
}

TEST_F(KvTransferAgents, APullRefusedForWantOfConnectionsSaysTheKvIsStillHeld) {
  a_busy_prefill_refuses_a_pull_for_now();
}

// With a secret the refusal answers the handshake's first frame, not the pull.
TEST_F(KvTransferAgents, WithASecretAPullRefusedForWantOfConnectionsSaysTheKvIsStillHeld) {
  prefill_secret_ = decode_secret_ = "s3cret";
  a_busy_prefill_refuses_a_pull_for_now();
}

TEST_F(KvTransferAgents, ARoomRegistrationRefusedForWantOfConnectionsSaysSo) {
  a_busy_prefill_refuses_a_room_registration_for_now();
}

TEST_F(KvTransferAgents, WithASecretARoomRegistrationRefusedForWantOfConnectionsSaysSo) {
  prefill_secret_ = decode_secret_ = "s3cret";
  a_busy_prefill_refuses_a_room_registration_for_now();
}

TEST_F(KvTransferAgents, TheServerSurvivesStrangersAndMalformedRequests) {
  start();
  {
    RawSocket raw(prefill_->port());
    ASSERT_TRUE(raw.connected());
    const std::string http = "GET / HTTP/1.1\r\nHost: prefill\r\n\r\n";
    ASSERT_TRUE(raw.write(http.data(), http.size()));
  }
  auto transport = make_tcp_transport({5000ms});
  {
    auto conn = transport->connect("127.0.0.1", prefill_->port());
    send_text(*conn, KvFrameType::kDone, "{}");
    const KvFrame f = conn->receive(1 << 20);
    EXPECT_EQ(f.type, KvFrameType::kError);
    EXPECT_THAT(
        text_of(f.payload),
        HasSubstr("expected a pull, register or abandon frame, got a done frame of 2 bytes"));
  }
  for (const KvFrameType type : {KvFrameType::kPull, KvFrameType::kRegister}) {
    auto conn = transport->connect("127.0.0.1", prefill_->port());
    send_text(*conn, type, "{\"room\": ");
    const KvFrame f = conn->receive(1 << 20);
    EXPECT_EQ(f.type, KvFrameType::kError) << "the peer learns why, not just a closed connection";
    EXPECT_THAT(text_of(f.payload), HasSubstr("malformed JSON frame"));
  }
  {
    auto conn = transport->connect("127.0.0.1", prefill_->port());
    send_text(*conn, KvFrameType::kPull, "{\"transfer_id\": 5}");
    const KvFrame f = conn->receive(1 << 20);
    EXPECT_EQ(f.type, KvFrameType::kError);
    EXPECT_THAT(text_of(f.payload), HasSubstr("malformed pull request"));
  }
  {
    auto conn = transport->connect("127.0.0.1", prefill_->port());
    send_text(*conn, KvFrameType::kRegister, "{\"room\": 1}");
    const KvFrame f = conn->receive(1 << 20);
    EXPECT_EQ(f.type, KvFrameType::kError);
    EXPECT_THAT(text_of(f.payload), HasSubstr("malformed register request"));
  }
  // Still serving.
  bool released = false;
  const std::string id = prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()),
                                        [&] { released = true; });
  const KvFetchResult r = wait(fetch(pull(id, 0, 10, local_)));
  EXPECT_TRUE(r.ok) << r.error;
  EXPECT_TRUE(queue_.run_until([&] { return released; }));
}

// ------------------------------------------------------------------------------- handshake

TEST_F(KvTransferAgents, WithASecretBothSidesProveItAndTheTransferRuns) {
  prefill_secret_ = decode_secret_ = "one deployment's secret";
  start();
  bool released = false;
  const std::string id = prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()),
                                        [&] { released = true; });
  const KvFetchResult r = wait(fetch(pull(id, 0, 10, local_)));
  ASSERT_TRUE(r.ok) << r.error;
  FakeExecutor expected;
  expected.copy_tokens(prefill_exec_, remote_, local_, 0, 10);
  EXPECT_TRUE(decode_exec_.data() == expected.data());
  EXPECT_TRUE(queue_.run_until([&] { return released; }));
  EXPECT_EQ(sample(prefill_metrics_, "tandem:kv_transfer_refused_total"), 0);
}

TEST_F(KvTransferAgents, APeerWithoutTheSecretIsRefusedAndLearnsNothingOfTheModel) {
  prefill_secret_ = "one deployment's secret";
  start();  // the decode agent has no secret
  const std::string id =
      prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()), [] {});
  const KvFetchResult r = wait(fetch(pull(id, 0, 10, local_)));
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("KV transfer refused: not authenticated"));
  // A stranger speaking the protocol by hand, with a request that names the right layout, gets
  // the same single sentence: no model name, layers, block size or bytes per token.
  auto transport = make_tcp_transport({5000ms});
  auto conn = transport->connect("127.0.0.1", prefill_->port());
  send_text(*conn, KvFrameType::kPull,
            json{{"transfer_id", id},
                 {"layout",
                  {{"model", "fake-model"}, {"layers", 3}, {"block_size", 4}, {"token_bytes", 8}}}}
                .dump());
  const KvFrame f = conn->receive(1 << 20);
  EXPECT_EQ(f.type, KvFrameType::kError);
  EXPECT_EQ(text_of(f.payload),
            json({{"message", "KV transfer refused: not authenticated"}}).dump());
  EXPECT_EQ(sample(prefill_metrics_, "tandem:kv_transfer_refused_total"), 2);
  // Nothing was taken: a decode engine holding the secret still gets the KV.
  decode_secret_ = prefill_secret_;
  FakeExecutor exec;
  metrics::Registry registry;
  auto trusted = make_decode(exec, registry);
  const KvFetchResult ok = wait(fetch(*trusted, pull(id, 0, 10, local_, "req-2")));
  ASSERT_TRUE(ok.ok) << ok.error;
  FakeExecutor expected;
  expected.copy_tokens(prefill_exec_, remote_, local_, 0, 10);
  EXPECT_TRUE(exec.data() == expected.data());
}

TEST_F(KvTransferAgents, DifferentSecretsFailTheTransferAndTakeNothing) {
  prefill_secret_ = "one deployment's secret";
  decode_secret_ = "another deployment's secret";
  start();
  const std::string id =
      prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()), [] {});
  const KvFetchResult r = wait(fetch(pull(id, 0, 10, local_)));
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("--kv-transfer-secret differs"));
  EXPECT_EQ(prefill_->held_blocks(), 3);
  EXPECT_TRUE(queue_.run_until(
      [&] { return sample(prefill_metrics_, "tandem:kv_transfer_refused_total") == 1; }));
}

TEST_F(KvTransferAgents, ADecodeWithASecretIsToldThatThePrefillHasNone) {
  decode_secret_ = "one deployment's secret";
  start();
  const std::string id =
      prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()), [] {});
  const KvFetchResult r = wait(fetch(pull(id, 0, 10, local_)));
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("does not authenticate KV transfers"));
  EXPECT_EQ(prefill_->held_blocks(), 3);
}

TEST_F(KvTransferAgents, ASilentConnectionIsClosedAfterTheHandshakeTimeout) {
  // The transfer timeout (and the transport's I/O timeout) far beyond the hang guard: only the
  // handshake timeout can close the connection within it. It bounds the pull's handshake below
  // too (both sides have it), which a loaded machine must finish within it.
  handshake_timeout_s_ = 3;
  prefill_io_timeout_ = 600s;
  start(600);
  RawSocket silent(prefill_->port());
  ASSERT_TRUE(silent.connected());
  EXPECT_TRUE(queue_.run_until([&] { return silent.heard_back(); }))
      << "a connection that never sent a frame was kept open";
  // The port still serves.
  const std::string id =
      prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()), [] {});
  const KvFetchResult r = wait(fetch(pull(id, 0, 10, local_)));
  EXPECT_TRUE(r.ok) << r.error;
}

TEST_F(KvTransferAgents, CancelFetchEndsAWaitingFetch) {
  start();
  // Registered for a room whose prefill never comes: only the cancel ends it (well before the
  // prefill side's 5 s timeout).
  Outcome o = fetch(enter_room(31, local_, "req-cancel"));
  decode_->cancel_fetch("req-cancel");
  const KvFetchResult r = wait(o);
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, AnyOf(HasSubstr("cancelled"), HasSubstr("shut down")));
  EXPECT_THAT(r.error, Not(HasSubstr("arrived within")));
  EXPECT_EQ(decode_exec_.writes(), 0);
}

// A shared-memory listener of this host that accepts nobody (an engine stopped with SIGSTOP,
// say): a fetch still connecting to it ends when it is cancelled.
class KvTransferOverShm : public KvTransferAgents {
 protected:
  KvTransferOverShm() : KvTransferAgents(KvLayout{"fake", 3, 4, 8}, "shm") {}

  // 64 local peers in their handshake, the most one address may have: the next is refused.
  std::vector<std::unique_ptr<FakeShmClient>> silent_peers_at_the_limit() {
    std::vector<std::unique_ptr<FakeShmClient>> silent;
    for (int i = 0; i < 64; ++i) {
      silent.push_back(std::make_unique<FakeShmClient>(prefill_->port()));
      if (!silent.back()->hello()) ADD_FAILURE() << "silent peer " << i << " was not welcomed";
    }
    return silent;
  }
};

TEST_F(KvTransferOverShm, CancelFetchEndsAFetchStillConnecting) {
  decode_io_timeout_ = 600s;  // far beyond the hang guard: only the cancel can end it
  start();
  auto tcp = make_tcp_transport({5000ms});
  auto reserved = tcp->listen("127.0.0.1", 0);
  FakeShmListener stalled(reserved->port());
  ASSERT_TRUE(stalled.bound());
  port_override_ = reserved->port();
  Outcome o = fetch(pull("prefill-0-0", 0, 10, local_, "req-stuck"));
  ASSERT_TRUE(queue_.run_until([&] { return stalled.has_pending_connection(); }));
  decode_->cancel_fetch("req-stuck");
  const KvFetchResult r = wait(o);
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error,
              HasSubstr("handshake with 127.0.0.1:" + std::to_string(port_override_) + " failed"));
}

// A refused connection (here a 65th in its handshake from one process) is told why without
// waiting on the peer: a local peer whose ring claims to be full (it writes the ring's counters)
// held the accept loop, and with it every other peer and the engine's shutdown, for the I/O
// timeout.
TEST_F(KvTransferOverShm, ARefusedPeerWhoseRingIsNeverFreeHoldsUpNothing) {
  prefill_io_timeout_ = 600s;
  handshake_timeout_s_ = 600;  // past the hang guard: the silent peers stay in their handshake
  start();
  const auto silent = silent_peers_at_the_limit();
  const std::string id =
      prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()), [] {});
  // A well-behaved peer refused is still told why.
  const KvFetchResult refused = wait(fetch(pull(id, 0, 10, local_, "req-refused")));
  EXPECT_FALSE(refused.ok);
  EXPECT_THAT(refused.error, HasSubstr("too many KV transfer connections from this address"));
  FakeShmClient hostile(prefill_->port());
  hostile.claim_a_full_ring();
  ASSERT_TRUE(hostile.hello());
  // A decode engine of another address (over TCP) is served.
  metrics::Registry registry;
  auto over_tcp = make_decode(decode_exec_, registry, "tcp");
  const KvFetchResult r = wait(fetch(*over_tcp, pull(id, 0, 10, local_)));
  EXPECT_TRUE(r.ok) << r.error;
  auto shutdown = std::async(std::launch::async, [&] { prefill_.reset(); });
  if (shutdown.wait_for(kHangGuard) != std::future_status::ready) {
    ADD_FAILURE() << "the prefill engine's shutdown waited on the refused peer";
    hostile.hang_up();  // which ends the wait
  }
}

// The decode side of a race: each connection is handed over only once its peer has closed it
// (or after the hang guard). A prefill engine that refuses a connection says why and closes at
// once, which may come before the decode engine sends its first frame.
class HandedOverOnceClosed : public KvTransport {
 public:
  explicit HandedOverOnceClosed(std::unique_ptr<KvTransport> inner) : inner_(std::move(inner)) {}
  std::string name() const override { return inner_->name(); }
  std::unique_ptr<KvListener> listen(const std::string& host, uint16_t port,
                                     SharedView send_memory) override {
    return inner_->listen(host, port, send_memory);
  }
  std::unique_ptr<KvConnection> connect(const std::string& host, uint16_t port,
                                        const GiveUp& give_up) override {
    auto conn = inner_->connect(host, port, give_up);
    const auto until = std::chrono::steady_clock::now() + kHangGuard;
    while (!conn->peer_gone() && std::chrono::steady_clock::now() < until)
      std::this_thread::yield();
    return conn;
  }

 private:
  std::unique_ptr<KvTransport> inner_;
};

TEST_F(KvTransferOverShm, ARefusalIsToldEvenWhenThePeerClosedBeforeTheFirstFrameWentOut) {
  handshake_timeout_s_ = 600;  // past the hang guard: the silent peers stay in their handshake
  start();
  const auto silent = silent_peers_at_the_limit();
  const std::string id =
      prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()), [] {});
  metrics::Registry registry;
  auto late = make_decode(decode_exec_, registry,
                          std::make_unique<HandedOverOnceClosed>(make_shm_transport()));
  const KvFetchResult refused = wait(fetch(*late, pull(id, 0, 10, local_, "req-refused")));
  EXPECT_FALSE(refused.ok);
  EXPECT_THAT(refused.error, HasSubstr("too many KV transfer connections from this address"));
}

// A client may name any host in a decode leg that is then refused; each refusal asks that host
// to release the hold. Against a host that accepts and never answers, the releases sent to it at
// once are bounded in number (2), those waiting their turn too (4096, the whole queue while
// nothing else waits; past that they are dropped and counted), and the engine still shuts down at
// once.
TEST_F(KvTransferAgents, ReleasesToASilentHostAreBoundedAndEndAtShutdown) {
  decode_io_timeout_ = 600s;
  handshake_timeout_s_ = 600;  // what bounds a release: only the shutdown can end them here
  start();
  auto silent = make_tcp_transport({600s});
  auto listener = silent->listen("127.0.0.1", 0);
  std::mutex m;
  std::vector<std::unique_ptr<KvConnection>> accepted;
  std::thread acceptor([&] {
    while (auto c = listener->accept()) {
      std::lock_guard lock(m);
      accepted.push_back(std::move(c));
    }
  });
  for (int i = 0; i < 2 + 4096 + 3; ++i)
    decode_->release_remote("127.0.0.1", listener->port(), "prefill-9", "t-" + std::to_string(i),
                            {1, 2});
  const auto count = [&] {
    std::lock_guard lock(m);
    return accepted.size();
  };
  EXPECT_TRUE(queue_.run_until([&] { return count() >= 2; }));
  EXPECT_EQ(sample(decode_metrics_, "tandem:kv_transfer_releases_dropped_total"), 3);
  auto shutdown = std::async(std::launch::async, [&] { decode_.reset(); });
  get_within(shutdown, kHangGuard, "the engine waited for releases nobody answers");
  EXPECT_EQ(count(), 2u);
  listener->close();
  acceptor.join();
}

// A burst of releases to a hung prefill engine (it accepts and never answers, as a stopped
// process's kernel does) takes at most 2 of the 16 senders: a release to a healthy engine goes at
// once, not after the hung engine's handshake timeouts (600 s here: never within the test). The
// burst took every sender, one after another, and the healthy engine's release waited behind it.
TEST_F(KvTransferAgents, AHungPrefillEngineHoldsUpOnlyItsOwnReleases) {
  decode_io_timeout_ = 600s;
  handshake_timeout_s_ = 600;
  start(600);  // the hold does not expire: only the release frees it
  auto hung = make_tcp_transport({600s});
  auto listener = hung->listen("127.0.0.1", 0);
  std::mutex m;
  std::vector<std::unique_ptr<KvConnection>> accepted;
  std::thread acceptor([&] {
    while (auto c = listener->accept()) {
      std::lock_guard lock(m);
      accepted.push_back(std::move(c));
    }
  });
  for (int i = 0; i < 100; ++i)
    decode_->release_remote("127.0.0.1", listener->port(), "prefill-9", "t-" + std::to_string(i),
                            {1, 2});
  bool released = false;
  const std::string id = prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()),
                                        [&] { released = true; });
  decode_->release_remote("127.0.0.1", prefill_->port(), "prefill-0", id, remote_);
  EXPECT_TRUE(queue_.run_until([&] { return released; }))
      << "the release to the healthy engine waited behind the hung one's";
  EXPECT_EQ(prefill_->held_blocks(), 0);
  {
    std::lock_guard lock(m);
    EXPECT_LE(accepted.size(), 2u);
  }
  auto shutdown = std::async(std::launch::async, [&] { decode_.reset(); });
  get_within(shutdown, kHangGuard, "the engine waited for releases nobody answers");
  listener->close();
  acceptor.join();
}

// Black-holed prefill hosts (their SYNs dropped: here listeners whose accept queues are full) hold
// each release to them for the handshake timeout (1 s), not the I/O timeout (600 s): 16 releases
// to four of them held a release to a healthy engine queued behind them for that long. (They and
// the healthy engine share 127.0.0.1: the holes take 2 senders each, and the healthy one's
// release goes at once.)
TEST_F(KvTransferAgents, AnUnreachableHostHoldsUpReleasesOnlyForTheHandshakeTimeout) {
  decode_io_timeout_ = 600s;
  handshake_timeout_s_ = 1;
  start();
  std::vector<int> holes, fillers;
  std::vector<uint16_t> hole_ports;
  for (int h = 0; h < 4; ++h) {
    const int hole = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(hole, 0);
    holes.push_back(hole);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof a;
    ASSERT_EQ(::bind(hole, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    ASSERT_EQ(::listen(hole, 0), 0);
    ASSERT_EQ(::getsockname(hole, reinterpret_cast<sockaddr*>(&a), &length), 0);
    hole_ports.push_back(ntohs(a.sin_port));
    // Fill its accept queue (never accepted): the kernel drops every later SYN.
    for (int i = 0; i < 4; ++i) {
      fillers.push_back(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
      ::connect(fillers.back(), reinterpret_cast<sockaddr*>(&a), sizeof a);
    }
  }
  auto peer = make_tcp_transport({60s});
  auto healthy = peer->listen("127.0.0.1", 0);
  std::atomic<bool> reached{false};
  std::thread acceptor([&] {
    while (auto c = healthy->accept()) reached = true;
  });
  for (int i = 0; i < 16; ++i)
    decode_->release_remote("127.0.0.1", hole_ports[size_t(i % 4)], "prefill-9",
                            "t-" + std::to_string(i), {1, 2});
  decode_->release_remote("127.0.0.1", healthy->port(), "prefill-9", "t-healthy", {1, 2});
  EXPECT_TRUE(queue_.run_until([&] { return reached.load(); }))
      << "the release to the healthy engine waited behind the unreachable ones";
  decode_.reset();
  healthy->close();
  acceptor.join();
  for (int fd : fillers) ::close(fd);
  for (int fd : holes) ::close(fd);
}

// A peer's end of one connection, on the test clock: it sends its frames in turn, the last one
// again and again, each one `pace` of that clock after the last (header and payload apart), and
// like a real connection fails a receive that would wait past its deadline or its call's timeout.
// It counts the frames it gave whole and those sent to it.
class PacedPeer : public KvConnection {
 public:
  struct Seen {
    std::mutex mutex;
    std::condition_variable changed;
    int frames_given = 0, frames_sent = 0;
    bool closed = false;
  };
  using Frames = std::vector<std::pair<KvFrameType, std::string>>;
  PacedPeer(KvTestClock& clock, KvFrameType type, std::string payload,
            std::chrono::milliseconds header_pace, std::chrono::milliseconds payload_pace,
            std::shared_ptr<Seen> seen)
      : PacedPeer(clock, Frames{{type, std::move(payload)}}, header_pace, payload_pace,
                  std::move(seen)) {}
  PacedPeer(KvTestClock& clock, Frames frames, std::chrono::milliseconds header_pace,
            std::chrono::milliseconds payload_pace, std::shared_ptr<Seen> seen)
      : clock_(clock),
        frames_(std::move(frames)),
        header_pace_(header_pace),
        payload_pace_(payload_pace),
        seen_(std::move(seen)) {}
  ~PacedPeer() override {
    {
      std::lock_guard lock(seen_->mutex);
      seen_->closed = true;
    }
    seen_->changed.notify_all();
  }

  void send(KvFrameType, std::span<const std::span<const std::byte>>) override {
    std::lock_guard lock(seen_->mutex);
    ++seen_->frames_sent;
  }
  KvFrameType receive_header(uint64_t& size, size_t) override {
    wait(header_pace_);
    size = frame().second.size();
    return frame().first;
  }
  void receive_payload(std::span<const std::span<std::byte>> parts) override {
    wait(payload_pace_);
    size_t at = 0;
    for (const auto& part : parts) {
      std::memcpy(part.data(), frame().second.data() + at, part.size());
      at += part.size();
    }
    ++given_;
    std::lock_guard lock(seen_->mutex);
    ++seen_->frames_given;
  }
  void set_timeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }
  void set_deadline(std::chrono::steady_clock::time_point deadline) override {
    deadline_ = deadline;
  }
  void shutdown() override {}
  bool peer_gone() override { return false; }
  std::string peer() const override { return "127.0.0.1:1"; }
  const char* kind() const override { return "fake"; }
  // As a real connection under an agent on the test clock: it bounds its calls in real time,
  // which that clock (an hour ahead) never sees pass.
  void ignore_deadlines() { ignores_deadlines_ = true; }

 private:
  void wait(std::chrono::milliseconds pace) {
    const auto until = kv_call_deadline(clock_.peek(), timeout_, deadline_);
    clock_.advance(pace);
    if (clock_.peek() > until && !ignores_deadlines_) throw Error("timed out receiving");
  }
  const std::pair<KvFrameType, std::string>& frame() const {
    return frames_[std::min(given_, frames_.size() - 1)];
  }
  KvTestClock& clock_;
  const Frames frames_;
  size_t given_ = 0;
  const std::chrono::milliseconds header_pace_, payload_pace_;
  std::shared_ptr<Seen> seen_;
  std::chrono::milliseconds timeout_{std::chrono::hours(1)};
  std::chrono::steady_clock::time_point deadline_ = std::chrono::steady_clock::time_point::max();
  bool ignores_deadlines_ = false;
};

// Every connection is a PacedPeer: made by connect(), or the one accept() gives before it waits
// for close().
class PacedTransport : public KvTransport {
 public:
  explicit PacedTransport(std::function<std::unique_ptr<KvConnection>()> make)
      : make_(std::move(make)) {}
  std::string name() const override { return "fake"; }
  std::unique_ptr<KvListener> listen(const std::string&, uint16_t, SharedView) override {
    return std::make_unique<Listener>(make_);
  }
  std::unique_ptr<KvConnection> connect(const std::string&, uint16_t, const GiveUp&) override {
    return make_();
  }

 private:
  class Listener : public KvListener {
   public:
    explicit Listener(std::function<std::unique_ptr<KvConnection>()> make)
        : make_(std::move(make)) {}
    std::unique_ptr<KvConnection> accept() override {
      std::unique_lock lock(mutex_);
      if (!given_) {
        given_ = true;
        return make_();
      }
      closed_changed_.wait(lock, [&] { return closed_; });
      return nullptr;
    }
    uint16_t port() const override { return 1; }
    void close() override {
      {
        std::lock_guard lock(mutex_);
        closed_ = true;
      }
      closed_changed_.notify_all();
    }

   private:
    std::function<std::unique_ptr<KvConnection>()> make_;
    std::mutex mutex_;
    std::condition_variable closed_changed_;
    bool given_ = false, closed_ = false;
  };
  std::function<std::unique_ptr<KvConnection>()> make_;
};

// Waits until the PacedPeer that `seen` watches was closed; false when the hang guard ran out.
bool closed(PacedPeer::Seen& seen) {
  std::unique_lock lock(seen.mutex);
  return seen.changed.wait_for(lock, kHangGuard, [&] { return seen.closed; });
}

// A release is bounded by the handshake timeout (1 s) as a whole: a host that answers it with a
// frame every 400 ms, none of them the done that ends it, is left after that second, having
// given 2 frames. Each of its receives had a timeout of its own (up to layers + 2 of them, header
// and payload apart), so a host that kept talking held a release slot ten times as long, and 16
// such hosts held every release behind them.
TEST_F(KvTransferAgents, AReleaseIsBoundedByTheHandshakeTimeoutAsAWhole) {
  handshake_timeout_s_ = 1;
  decode_on_test_clock_ = true;
  auto seen = std::make_shared<PacedPeer::Seen>();
  decode_ = make_decode(decode_exec_, decode_metrics_, std::make_unique<PacedTransport>([&] {
                          return std::make_unique<PacedPeer>(clock_, KvFrameType::kProgress, "{}",
                                                             400ms, 0ms, seen);
                        }));
  decode_->release_remote("127.0.0.1", 1, "prefill-9", "t-slow", {1, 2});
  ASSERT_TRUE(closed(*seen)) << "the release never ended";
  EXPECT_EQ(seen->frames_sent, 1) << "not the one release";
  EXPECT_EQ(seen->frames_given, 2) << "the release kept listening past its handshake timeout";
}

// A connection's first frame arrives within the handshake timeout (1 s) as a whole: its header
// at 0.6 s and its payload at 1.2 s is too late, and the connection closes unanswered. The
// header and the payload each had the timeout, so the frame could take twice as long.
TEST_F(KvTransferAgents, AFirstFrameArrivesWithinTheHandshakeTimeoutAsAWhole) {
  KvTransferConfig p;
  p.engine_id = "prefill-0";
  p.port = 0;
  p.handshake_timeout_s = 1;
  p.now = clock_.seam();
  auto seen = std::make_shared<PacedPeer::Seen>();
  prefill_ = std::make_unique<KvTransferAgent>(
      p, prefill_exec_, std::make_unique<PacedTransport>([&] {
        return std::make_unique<PacedPeer>(clock_, KvFrameType::kPull, "{}", 600ms, 600ms, seen);
      }),
      prefill_metrics_, queue_.post());
  ASSERT_TRUE(closed(*seen)) << "the slow connection was kept open";
  EXPECT_EQ(seen->frames_given, 0);
  EXPECT_EQ(seen->frames_sent, 0) << "the late frame was read and answered";
}

// A decode engine's wait for a room's prompt (3 s) starts again at each progress frame that tells
// of more of the prompt computed: a prefill engine reporting a chunk a second is waited for past
// those 3 s, and its answer at 5 s (here a refusal) is what the fetch reports, not "no progress".
TEST_F(KvTransferAgents, EachProgressOfTheRoomsPromptRestartsTheDecodeEnginesWait) {
  decode_timeout_s_ = 3;
  decode_on_test_clock_ = true;
  port_override_ = 1;
  PacedPeer::Frames frames;
  for (int chunk = 1; chunk <= 5; ++chunk)
    frames.push_back({KvFrameType::kProgress, json{{"computed_tokens", chunk}}.dump()});
  frames.push_back({KvFrameType::kError, json{{"message", "the test's refusal at 6 s"}}.dump()});
  auto seen = std::make_shared<PacedPeer::Seen>();
  decode_ = make_decode(decode_exec_, decode_metrics_, std::make_unique<PacedTransport>([&] {
                          return std::make_unique<PacedPeer>(clock_, frames, 1s, 0ms, seen);
                        }));
  const KvFetchResult r = wait(fetch(enter_room(7, local_, "req-long")));
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("the test's refusal at 6 s"));
  EXPECT_THAT(r.error, Not(HasSubstr("no progress")));
  EXPECT_EQ(seen->frames_given, 6);
}

// A prefill engine that floods a waiting room with progress frames that do not advance (each
// receive finds one ready) fails the fetch at the timeout (3 s) all the same: the wait ended only
// when a receive failed, and a connection whose receives never fail held the decode leg until
// the prefill engine said something else (here its refusal at 10 s).
TEST_F(KvTransferAgents, ProgressFramesThatDoNotAdvanceFailARoomAtTheTimeoutHoweverFast) {
  decode_timeout_s_ = 3;
  decode_on_test_clock_ = true;
  port_override_ = 1;
  PacedPeer::Frames frames(9, {KvFrameType::kProgress, json{{"computed_tokens", 1}}.dump()});
  frames.push_back({KvFrameType::kError, json{{"message", "the test's refusal at 10 s"}}.dump()});
  auto seen = std::make_shared<PacedPeer::Seen>();
  decode_ = make_decode(decode_exec_, decode_metrics_, std::make_unique<PacedTransport>([&] {
                          auto peer = std::make_unique<PacedPeer>(clock_, frames, 1s, 0ms, seen);
                          peer->ignore_deadlines();
                          return peer;
                        }));
  const KvFetchResult r = wait(fetch(enter_room(7, local_, "req-flooded")));
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("the prefill of bootstrap_room 7 made no progress within 3 s"));
  EXPECT_LT(seen->frames_given, 10);
}

// A burst of releases (a gateway cancelling many decode legs at once) beyond those sent at once
// waits its turn instead of being dropped: every one reaches the prefill engine, which would
// otherwise hold the blocks of all but the first 16 until its timeout.
TEST_F(KvTransferAgents, ABurstOfReleasesIsSentInTurnNotDropped) {
  start();
  auto peer = make_tcp_transport({60s});
  auto listener = peer->listen("127.0.0.1", 0);
  std::mutex m;
  size_t accepted = 0;
  std::thread acceptor([&] {
    // Answers each at once: the connection closes, which ends the release.
    while (auto c = listener->accept()) {
      std::lock_guard lock(m);
      ++accepted;
    }
  });
  for (int i = 0; i < 60; ++i)
    decode_->release_remote("127.0.0.1", listener->port(), "prefill-9", "t-" + std::to_string(i),
                            {1, 2});
  EXPECT_TRUE(queue_.run_until([&] {
    std::lock_guard lock(m);
    return accepted >= 60;
  }));
  EXPECT_EQ(sample(decode_metrics_, "tandem:kv_transfer_releases_dropped_total"), 0);
  decode_.reset();
  listener->close();
  acceptor.join();
  EXPECT_EQ(accepted, 60u);
}

// A hold whose pull has begun outlives its timeout. The first pull must begin within the
// timeout (5 s); then a hold made after it, which has a later deadline, expires: the reaper has
// looked past the first one's deadline too, and kept it.
TEST_F(KvTransferAgents, AHoldBeingPulledIsNeitherPulledTwiceNorExpired) {
  decode_io_timeout_ = 60s;  // the first pull waits at the gate for the timeout and more
  start(5);
  bool released = false;
  const std::string id = prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()),
                                        [&] { released = true; });
  prefill_exec_.close_gate();
  Outcome first = fetch(pull(id, 0, 10, local_, "req-first"));
  ASSERT_TRUE(prefill_exec_.wait_for_reader_at_gate());  // the first pull is sending layer 0

  const KvFetchResult second = wait(fetch(pull(id, 0, 10, {10, 11, 12}, "req-second")));
  EXPECT_FALSE(second.ok);
  EXPECT_THAT(second.error, HasSubstr("is being pulled by another connection"));

  // Past the hold's timeout: a hold in transfer stays.
  bool later_released = false;
  prefill_->hold({20, 21, 22}, kv_prompt_hash(prompt_), int64_t(prompt_.size()),
                 [&] { later_released = true; });
  EXPECT_TRUE(queue_.run_until([&] { return later_released; }));
  EXPECT_EQ(sample(prefill_metrics_, "tandem:kv_transfer_expired_total"), 1);
  EXPECT_FALSE(released);
  EXPECT_EQ(prefill_->held_blocks(), 3);

  prefill_exec_.open_gate();
  const KvFetchResult r = wait(first);
  ASSERT_TRUE(r.ok) << r.error;
  FakeExecutor expected;
  expected.copy_tokens(prefill_exec_, remote_, local_, 0, 10);
  EXPECT_TRUE(decode_exec_.data() == expected.data());
  EXPECT_TRUE(queue_.run_until([&] { return released; }));
  EXPECT_EQ(sample(prefill_metrics_, "tandem:kv_transfer_expired_total"), 1);  // the later one
}

TEST_F(KvTransferAgents, CancelFetchEndsATransferInProgress) {
  start();
  const std::string id =
      prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()), [] {});
  prefill_exec_.close_gate();
  Outcome o = fetch(pull(id, 0, 10, local_, "req-x"));
  ASSERT_TRUE(prefill_exec_.wait_for_reader_at_gate());
  decode_->cancel_fetch("req-x");
  const KvFetchResult r = wait(o);
  prefill_exec_.open_gate();
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("shut down"));
  EXPECT_EQ(decode_exec_.writes(), 0);
}

// A decode leg cut off mid-pull (its client left): the prefill engine lets go of the blocks once
// the broken pull ends, not at the hold's expiry (600 s here, past the hang guard).
TEST_F(KvTransferAgents, APullThatBreaksMidTransferReleasesTheHold) {
  start(600);
  bool released = false;
  const std::string id = prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()),
                                        [&] { released = true; });
  prefill_exec_.close_gate();
  Outcome o = fetch(pull(id, 0, 10, local_, "req-cut"));
  ASSERT_TRUE(prefill_exec_.wait_for_reader_at_gate());
  decode_->cancel_fetch("req-cut");
  EXPECT_FALSE(wait(o).ok);
  prefill_exec_.open_gate();
  EXPECT_TRUE(queue_.run_until([&] { return released; }));
  EXPECT_EQ(prefill_->held_blocks(), 0);
  EXPECT_EQ(sample(prefill_metrics_, "tandem:kv_transfer_expired_total"), 0);
}

TEST_F(KvTransferAgents, ShuttingDownTheDecodeEngineEndsItsFetches) {
  start();
  Outcome o = fetch(enter_room(33, local_, "req-33"));  // waits for a prefill leg (5 s)
  decode_.reset();
  const KvFetchResult r = wait(o);
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, AnyOf(HasSubstr("cancelled"), HasSubstr("shut down")));
  EXPECT_EQ(decode_exec_.writes(), 0);
}

TEST_F(KvTransferAgents, ShuttingDownThePrefillEngineFailsARegisteredDecode) {
  start();
  RoomOutcome done;
  ASSERT_TRUE(open(34, kv_prompt_hash(prompt_), 11, room_done(done)));
  prefill_->room_blocks(34, claims_[34], remote_);
  Outcome a = fetch(enter_room(34, local_, "req-a"));
  Outcome b = fetch(enter_room(34, {10, 11, 12}, "req-b"));
  ASSERT_TRUE(queue_.run_until([&] { return a->has_value() || b->has_value(); }));
  ASSERT_NE(a->has_value(), b->has_value());  // the other one is registered now
  prefill_.reset();
  const KvFetchResult r = wait(a->has_value() ? b : a);
  EXPECT_FALSE(r.ok);
  // Either the server's "shutting down" or the closed connection, whichever comes first.
  EXPECT_THAT(r.error, AnyOf(HasSubstr("shutting down"), HasSubstr("connection closed")));
  ASSERT_TRUE(queue_.run_until([&] { return done.called; }));
  EXPECT_FALSE(done.ok);
  EXPECT_THAT(done.error, HasSubstr("shutting down"));
  EXPECT_EQ(decode_exec_.writes(), 0);
}

// ------------------------------------------------------------------------------- rooms

TEST_F(KvTransferAgents, RoomOpenedFirstStreamsEachLayerAsItCompletes) {
  start();
  RoomOutcome done;
  ASSERT_TRUE(open(42, kv_prompt_hash(prompt_), int64_t(prompt_.size()), room_done(done)));
  RoomOutcome other;
  EXPECT_FALSE(open(42, kv_prompt_hash(prompt_), 11, room_done(other)));

  Outcome o = fetch(enter_room(42, local_, "req-room"));
  finish_room_layer_by_layer(42);
  const KvFetchResult r = wait(o);
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_EQ(r.bytes, 10u * 8 * 3);
  FakeExecutor expected;
  expected.copy_tokens(prefill_exec_, remote_, local_, 0, 10);
  EXPECT_TRUE(decode_exec_.data() == expected.data());

  ASSERT_TRUE(queue_.run_until([&] { return done.called; }));
  EXPECT_TRUE(done.ok) << done.error;
  EXPECT_EQ(done.calls, 1);
  EXPECT_FALSE(other.called);
  EXPECT_EQ(prefill_->held_blocks(), 0);
  EXPECT_EQ(sample(prefill_metrics_, "tandem:kv_transfers_total", "result=\"ok\""), 1);
}

// Engines whose layer frames are large enough to go in place over shared memory (8 KiB a block
// and layer): the decode side copies the prompt's blocks straight from the prefill's cache.
class KvTransferInPlace : public KvTransferAgents {
 protected:
  static constexpr KvLayout kBigLayout{"fake", 3, 4, 2048};
  KvTransferInPlace() : KvTransferAgents(kBigLayout, "shm") {}
};

TEST_F(KvTransferInPlace, APullCopiesThePromptStraightFromThePrefillCache) {
  start();
  bool released = false;
  const std::string id = prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()),
                                        [&] { released = true; });
  const KvFetchResult r = wait(fetch(pull(id, 0, 10, local_)));
  ASSERT_TRUE(r.ok) << r.error;
  FakeExecutor expected(kBigLayout);
  expected.copy_tokens(prefill_exec_, remote_, local_, 0, 10);
  EXPECT_TRUE(decode_exec_.data() == expected.data());
  ASSERT_TRUE(queue_.run_until([&] { return released; }));
  const double bytes = 10.0 * 2048 * 3;
  EXPECT_EQ(sample(prefill_metrics_, "tandem:kv_transfer_bytes_total", "direction=\"sent\""),
            bytes);
  EXPECT_EQ(sample(prefill_metrics_, "tandem:kv_transfer_in_place_bytes_total"), bytes);
  EXPECT_EQ(sample(decode_metrics_, "tandem:kv_transfer_connections_total", "transport=\"shm\""),
            1);
}

TEST_F(KvTransferInPlace, ARoomStreamsEachLayerInPlaceAsItCompletes) {
  start();
  RoomOutcome done;
  ASSERT_TRUE(open(7, kv_prompt_hash(prompt_), int64_t(prompt_.size()), room_done(done)));
  Outcome o = fetch(enter_room(7, local_, "req-room"));
  finish_room_layer_by_layer(7);
  const KvFetchResult r = wait(o);
  ASSERT_TRUE(r.ok) << r.error;
  FakeExecutor expected(kBigLayout);
  expected.copy_tokens(prefill_exec_, remote_, local_, 0, 10);
  EXPECT_TRUE(decode_exec_.data() == expected.data());
  ASSERT_TRUE(queue_.run_until([&] { return done.called; }));
  EXPECT_TRUE(done.ok) << done.error;
  EXPECT_EQ(sample(prefill_metrics_, "tandem:kv_transfer_in_place_bytes_total"), 10.0 * 2048 * 3);
}

// Two registrations of one room: whichever the server reads second is refused as a duplicate,
// and from that moment the other one is known to be registered (which orders the rest).
TEST_F(KvTransferAgents, DecodeRegisteringFirstAndADuplicateRegistration) {
  start();
  const std::vector<int32_t> local_b = {10, 11, 12};
  Outcome a = fetch(enter_room(7, local_, "req-a"));
  Outcome b = fetch(enter_room(7, local_b, "req-b"));
  ASSERT_TRUE(queue_.run_until([&] { return a->has_value() || b->has_value(); }));
  ASSERT_NE(a->has_value(), b->has_value());
  const bool a_refused = a->has_value();
  const KvFetchResult refused = a_refused ? **a : **b;
  EXPECT_FALSE(refused.ok);
  EXPECT_THAT(refused.error, HasSubstr("bootstrap_room 7 already has a decode engine registered"));
  EXPECT_THAT(refused.error, HasSubstr("duplicate"));

  // Now the prefill leg arrives, after the registration.
  RoomOutcome done;
  ASSERT_TRUE(open(7, kv_prompt_hash(prompt_), 11, room_done(done)));
  prefill_->room_blocks(7, claims_[7], remote_);
  prefill_->room_layers_done(7, claims_[7], kLayout.layers);
  const KvFetchResult r = wait(a_refused ? b : a);
  ASSERT_TRUE(r.ok) << r.error;
  FakeExecutor expected;
  expected.copy_tokens(prefill_exec_, remote_, a_refused ? local_b : local_, 0, 10);
  EXPECT_TRUE(decode_exec_.data() == expected.data());
  ASSERT_TRUE(queue_.run_until([&] { return done.called; }));
  EXPECT_TRUE(done.ok) << done.error;
  EXPECT_EQ(prefill_->held_blocks(), 0);
}

// A long prompt's prefill outlasts the prefill side's timeout (3 s here), but each computed
// chunk restarts it: the decode engine still gets its KV. A room whose prefill says nothing
// fails. Both engines read the test clock, which moves 500 ms a chunk; their connections' own
// I/O timeouts are past the hang guard. (The decode side's restart is not seen here, as a real
// connection waits in real time, the clock an hour ahead of it: see
// EachProgressOfTheRoomsPromptRestartsTheDecodeEnginesWait.)
TEST_F(KvTransferAgents, APrefillThatKeepsProgressingOutlastsTheTransferTimeouts) {
  decode_timeout_s_ = 3;
  decode_io_timeout_ = 600s;
  prefill_io_timeout_ = 600s;
  prefill_on_test_clock_ = decode_on_test_clock_ = true;
  start(/*prefill_timeout_s=*/3);
  RoomOutcome done, silent_done;
  ASSERT_TRUE(open(7, kv_prompt_hash(prompt_), int64_t(prompt_.size()), room_done(done)));
  ASSERT_TRUE(open(8, kv_prompt_hash(prompt_), int64_t(prompt_.size()), room_done(silent_done)));
  Outcome o = fetch(enter_room(7, local_, "req-long"));
  Outcome silent = fetch(enter_room(8, {10, 11, 12}, "req-silent"));
  for (int64_t chunk = 1; chunk <= 7; ++chunk) {  // 3.5 s of prefill
    clock_.advance(500ms);
    prefill_->room_progress(7, claims_[7], chunk);
    // The engines look at the clock (each room's server about every 100 ms, each reaper every
    // 50 ms) before it moves again.
    EXPECT_TRUE(clock_.wait_reads(clock_.reads(), 12));
  }
  prefill_->room_blocks(7, claims_[7], remote_);
  prefill_->room_layers_done(7, claims_[7], kLayout.layers);
  const KvFetchResult r = wait(o);
  ASSERT_TRUE(r.ok) << r.error;
  FakeExecutor expected;
  expected.copy_tokens(prefill_exec_, remote_, local_, 0, 10);
  EXPECT_TRUE(decode_exec_.data() == expected.data());
  const KvFetchResult s = wait(silent);
  EXPECT_FALSE(s.ok);
  EXPECT_THAT(s.error, HasSubstr("the prefill of bootstrap_room 8 did not complete within 3 s"));
}

// A room that a decode engine registered times out on the prefill engine (5 s of the test
// clock) before its prefill leg comes: the decode leg is told that no prefill request arrived, and
// a prefill leg that comes later is refused with what happened: the room expired and its decode
// request was failed. That leg was told the decode leg's text, "no prefill request ... arrived".
TEST_F(KvTransferAgents, APrefillLegLateForATimedOutRoomIsToldThatItsDecodeRequestFailed) {
  decode_timeout_s_ = 600;
  decode_io_timeout_ = 600s;
  prefill_on_test_clock_ = true;
  start(5);
  auto [id, o] = register_decode(74);
  clock_.advance(5s);
  const KvFetchResult r = wait(o);
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("no prefill request with bootstrap_room 74 arrived within 5 s"));
  RoomOutcome late;
  try {
    open(74, kv_prompt_hash(prompt_), 11, room_done(late));
    ADD_FAILURE() << "open_room accepted a room whose decode leg was failed";
    prefill_->room_failed(74, claims_[74], "test over");
  } catch (const KvTransferError& e) {
    EXPECT_THAT(e.what(), HasSubstr("bootstrap_room 74 expired: its decode request waited 5 s "
                                    "for this prefill request and was failed"));
    EXPECT_THAT(e.what(), Not(HasSubstr("arrived")));
    EXPECT_TRUE(e.room_abandoned);
  }
}

TEST_F(KvTransferAgents, DifferentPromptsInOneRoomFailBothLegs) {
  start();
  RoomOutcome done;
  ASSERT_TRUE(open(9, kv_prompt_hash(prompt_), 11, room_done(done)));
  prefill_->room_blocks(9, claims_[9], remote_);
  prefill_->room_layers_done(9, claims_[9], kLayout.layers);
  KvFetch f = enter_room(9, local_, "req-9");
  const std::vector<int32_t> other_prompt = {11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 99};
  f.prompt_hash = kv_prompt_hash(other_prompt);
  const KvFetchResult r = wait(fetch(f));
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("bootstrap_room 9: the decode and prefill requests have "
                                 "different prompts"));
  ASSERT_TRUE(queue_.run_until([&] { return done.called; }));
  EXPECT_FALSE(done.ok);
  EXPECT_THAT(done.error, HasSubstr("different prompts"));
  EXPECT_EQ(decode_exec_.writes(), 0);
  EXPECT_EQ(prefill_->held_blocks(), 0);
}

TEST_F(KvTransferAgents, RoomFailedBeforeAnyLayerTellsTheDecodeWhy) {
  start();
  RoomOutcome done;
  ASSERT_TRUE(open(5, kv_prompt_hash(prompt_), 11, room_done(done)));
  prefill_->room_blocks(5, claims_[5], remote_);
  // A second registration is the probe that tells when the first one is in place.
  Outcome a = fetch(enter_room(5, local_, "req-a"));
  Outcome b = fetch(enter_room(5, {10, 11, 12}, "req-b"));
  ASSERT_TRUE(queue_.run_until([&] { return a->has_value() || b->has_value(); }));
  ASSERT_NE(a->has_value(), b->has_value());
  EXPECT_THAT((a->has_value() ? **a : **b).error, HasSubstr("duplicate"));

  prefill_->room_failed(5, claims_[5], "the prefill request ended: aborted by the client");
  const KvFetchResult r = wait(a->has_value() ? b : a);
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("the prefill request ended: aborted by the client"));
  ASSERT_TRUE(queue_.run_until([&] { return done.called; }));
  EXPECT_FALSE(done.ok);
  EXPECT_THAT(done.error, HasSubstr("aborted by the client"));
  EXPECT_EQ(done.calls, 1);
  EXPECT_EQ(decode_exec_.writes(), 0);
  EXPECT_EQ(prefill_->held_blocks(), 0);
}

TEST_F(KvTransferAgents, RoomFailedAfterALayerStopsTheRest) {
  start();
  RoomOutcome done;
  ASSERT_TRUE(open(6, kv_prompt_hash(prompt_), 11, room_done(done)));
  prefill_->room_blocks(6, claims_[6], remote_);
  prefill_->room_layers_done(6, claims_[6], 1);
  Outcome o = fetch(enter_room(6, local_, "req-6"));
  ASSERT_TRUE(decode_exec_.wait_for_write(0));
  prefill_->room_failed(6, claims_[6], "step failed: out of memory");
  const KvFetchResult r = wait(o);
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("step failed: out of memory"));
  ASSERT_TRUE(queue_.run_until([&] { return done.called; }));
  EXPECT_FALSE(done.ok);
  // Layer 0 arrived, nothing of layers 1 and 2.
  FakeExecutor expected;
  expected.copy_tokens(prefill_exec_, remote_, local_, 0, 10, 1);
  EXPECT_TRUE(decode_exec_.data() == expected.data());
}

TEST_F(KvTransferAgents, RoomFailedWithoutADecodeFinishesThePrefillLeg) {
  start();
  RoomOutcome done;
  ASSERT_TRUE(open(8, kv_prompt_hash(prompt_), 11, room_done(done)));
  prefill_->room_blocks(8, claims_[8], remote_);
  prefill_->room_failed(8, claims_[8], "aborted");
  ASSERT_TRUE(queue_.run_until([&] { return done.called; }));
  EXPECT_FALSE(done.ok);
  EXPECT_EQ(done.error, "aborted");
  EXPECT_EQ(prefill_->held_blocks(), 0);
  // The room is free again.
  RoomOutcome again;
  EXPECT_TRUE(open(8, kv_prompt_hash(prompt_), 11, room_done(again)));
  prefill_->room_failed(8, claims_[8], "aborted again");
  EXPECT_TRUE(queue_.run_until([&] { return again.called; }));
}

TEST_F(KvTransferAgents, ARegistrationWithoutAPrefillTimesOut) {
  start(0.3);
  const KvFetchResult r = wait(fetch(enter_room(77, local_, "req-77")));
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("no prefill request with bootstrap_room 77 arrived"));
  EXPECT_EQ(decode_exec_.writes(), 0);
}

TEST_F(KvTransferAgents, ACompletedRoomNobodyRegistersExpires) {
  start(0.3);
  RoomOutcome done;
  ASSERT_TRUE(open(78, kv_prompt_hash(prompt_), 11, room_done(done)));
  prefill_->room_blocks(78, claims_[78], remote_);
  prefill_->room_layers_done(78, claims_[78], kLayout.layers);
  ASSERT_TRUE(queue_.run_until([&] { return done.called; }));
  EXPECT_FALSE(done.ok);
  EXPECT_THAT(done.error, HasSubstr("no decode engine registered bootstrap_room 78"));
  EXPECT_EQ(prefill_->held_blocks(), 0);
}

TEST_F(KvTransferAgents, ALayoutMismatchFailsTheRoomsPrefillLegInEitherOrder) {
  start();
  FakeExecutor other(KvLayout{"fake", 3, 8, 8});
  metrics::Registry registry;
  auto agent = make_decode(other, registry);

  // The prefill leg first: it fails as soon as the mismatched decode registers.
  RoomOutcome done;
  ASSERT_TRUE(open(60, kv_prompt_hash(prompt_), 11, room_done(done)));
  KvFetchResult r = wait(fetch(*agent, enter_room(60, {1, 2}, "req-60")));
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("block_size mismatch"));
  ASSERT_TRUE(queue_.run_until([&] { return done.called; }));
  EXPECT_FALSE(done.ok);
  EXPECT_THAT(done.error, HasSubstr("block_size mismatch"));
  EXPECT_FALSE(done.abandoned);

  // The decode leg first: the prefill leg that arrives later is refused with the reason.
  r = wait(fetch(*agent, enter_room(61, {1, 2}, "req-61")));
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("block_size mismatch"));
  RoomOutcome late;
  try {
    open(61, kv_prompt_hash(prompt_), 11, room_done(late));
    ADD_FAILURE() << "open_room accepted a room whose decode leg was refused";
  } catch (const KvTransferError& e) {
    EXPECT_THAT(e.what(), HasSubstr("block_size mismatch"));
    EXPECT_FALSE(e.room_abandoned);
  }
  // Refused once; the room number is free again afterwards.
  RoomOutcome again;
  EXPECT_TRUE(open(61, kv_prompt_hash(prompt_), 11, room_done(again)));
  prefill_->room_failed(61, claims_[61], "test over");
  ASSERT_TRUE(queue_.run_until([&] { return again.called; }));
  EXPECT_FALSE(late.called);
  EXPECT_EQ(other.writes(), 0);
  EXPECT_EQ(prefill_->held_blocks(), 0);
}

// When the prefill leg of a room fails before its decode engine registered, the room keeps the
// reason (until the timeout) so a late registration fails at once with it.
TEST_F(KvTransferAgents, RoomFailedBeforeTheDecodeRegistersReachesTheLateDecode) {
  // The marker lasts for the timeout: however late the registration comes, it finds it. Were the
  // reason lost, the decode side's 5 s I/O timeout would end the wait.
  start(600);
  RoomOutcome done;
  ASSERT_TRUE(open(62, kv_prompt_hash(prompt_), 11, room_done(done)));
  prefill_->room_blocks(62, claims_[62], remote_);
  prefill_->room_failed(62, claims_[62], "the prefill request ended: aborted by the client");
  ASSERT_TRUE(queue_.run_until([&] { return done.called; }));
  EXPECT_FALSE(done.ok);

  const KvFetchResult r = wait(fetch(enter_room(62, local_, "req-62")));
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("aborted by the client"));
}

// A decode leg that ends before it registers (no free blocks for the prompt, its client gone)
// abandons its room: the prefill leg fails at once with the reason and frees its blocks instead of
// holding them for the timeout (600 s here), or, not arrived yet, is refused when it comes. An
// abandonment naming another prompt leaves the room alone, before its prefill leg too.
TEST_F(KvTransferAgents, AnAbandonedRoomFailsItsPrefillLegAtOnceOrRefusesALateOne) {
  start(600);
  const uint64_t hash = kv_prompt_hash(prompt_);
  RoomOutcome done;
  ASSERT_TRUE(open(90, hash, 11, room_done(done)));
  prefill_->room_blocks(90, claims_[90], remote_);
  prefill_->room_layers_done(90, claims_[90], kLayout.layers);
  EXPECT_EQ(prefill_->held_blocks(), 3);
  decode_->abandon_room("127.0.0.1", prefill_port(), 90, hash, 11,
                        "the decode request ended before it registered: abort");
  ASSERT_TRUE(queue_.run_until([&] { return done.called; }));
  EXPECT_FALSE(done.ok);
  EXPECT_EQ(done.error, "the decode request ended before it registered: abort");
  EXPECT_TRUE(done.abandoned);  // the engine's answer says so (api::kRoomAbandonedCode)
  EXPECT_EQ(prefill_->held_blocks(), 0);

  // By hand, so that the test knows when the prefill engine has read each one (its kDone).
  auto transport = make_tcp_transport({5000ms});
  auto abandon = [&](uint64_t room, uint64_t prompt_hash, const std::string& reason,
                     int64_t prompt_tokens = 11) {
    auto conn = transport->connect("127.0.0.1", prefill_->port());
    send_text(*conn, KvFrameType::kAbandon,
              json{{"room", room},
                   {"prompt_hash", prompt_hash},
                   {"prompt_tokens", prompt_tokens},
                   {"reason", reason}}
                  .dump());
    return conn->receive(1 << 20).type;
  };
  RoomOutcome other;
  ASSERT_TRUE(open(91, hash, 11, room_done(other)));
  EXPECT_EQ(abandon(91, hash + 1, "another prompt's"), KvFrameType::kDone);
  queue_.run_pending();
  EXPECT_FALSE(other.called);
  prefill_->room_failed(91, claims_[91], "test over");
  ASSERT_TRUE(queue_.run_until([&] { return other.called; }));
  EXPECT_EQ(other.error, "test over");
  EXPECT_FALSE(other.abandoned);

  // Before the prefill leg: it is refused when it arrives, once.
  EXPECT_EQ(abandon(92, hash, "the decode request ended before it registered: no free blocks"),
            KvFrameType::kDone);
  RoomOutcome late;
  try {
    open(92, hash, 11, room_done(late));
    ADD_FAILURE() << "open_room accepted a room whose decode leg was abandoned";
  } catch (const KvTransferError& e) {
    EXPECT_THAT(e.what(), HasSubstr("ended before it registered: no free blocks"));
    EXPECT_TRUE(e.room_abandoned);
  }
  RoomOutcome again;
  EXPECT_TRUE(open(92, hash, 11, room_done(again)));
  prefill_->room_failed(92, claims_[92], "test over");
  ASSERT_TRUE(queue_.run_until([&] { return again.called; }));
  EXPECT_FALSE(late.called);

  // Before the prefill leg, for another prompt (hash, or length): the leg that arrives is served.
  EXPECT_EQ(abandon(93, hash + 1, "another prompt's"), KvFrameType::kDone);
  EXPECT_EQ(abandon(94, hash, "a longer prompt's", 12), KvFrameType::kDone);
  for (const uint64_t room : {93, 94}) {
    RoomOutcome served;
    uint64_t claim = 0;
    EXPECT_NO_THROW(claim = open(room, hash, 11, room_done(served))) << "room " << room;
    ASSERT_NE(claim, 0u) << "room " << room;
    queue_.run_pending();
    EXPECT_FALSE(served.called) << "room " << room;
    prefill_->room_failed(room, claim, "test over");
    ASSERT_TRUE(queue_.run_until([&] { return served.called; }));
    EXPECT_EQ(served.error, "test over");
  }

  // Malformed: the peer learns why.
  auto conn = transport->connect("127.0.0.1", prefill_->port());
  send_text(*conn, KvFrameType::kAbandon, "{\"room\": 1}");
  const KvFrame f = conn->receive(1 << 20);
  EXPECT_EQ(f.type, KvFrameType::kError);
  EXPECT_THAT(text_of(f.payload), HasSubstr("malformed abandon request"));
}

// Peers leave refusals for rooms the prefill engine has not seen; a flood of them must not grow
// its room table (and the reaper's scan of it) without bound: past max_rooms none is kept.
TEST_F(KvTransferAgents, RefusalsLeftByPeersAreBoundedByTheRoomTable) {
  prefill_max_rooms_ = 2;
  start(600);
  const uint64_t hash = kv_prompt_hash(prompt_);
  auto transport = make_tcp_transport({5000ms});
  auto abandon = [&](uint64_t room) {
    auto conn = transport->connect("127.0.0.1", prefill_->port());
    send_text(*conn, KvFrameType::kAbandon,
              json{{"room", room}, {"prompt_hash", hash}, {"prompt_tokens", 11}, {"reason", "gone"}}
                  .dump());
    return conn->receive(1 << 20).type;
  };
  for (uint64_t room : {201, 202, 203}) EXPECT_EQ(abandon(room), KvFrameType::kDone);
  // The first two were kept and refuse their prefill legs; the third found the table full.
  for (uint64_t room : {201, 202}) {
    RoomOutcome refused;
    EXPECT_THROW(open(room, hash, 11, room_done(refused)), KvTransferError) << room;
  }
  RoomOutcome accepted;
  EXPECT_TRUE(open(203, hash, 11, room_done(accepted)));
  prefill_->room_failed(203, claims_[203], "test over");
  ASSERT_TRUE(queue_.run_until([&] { return accepted.called; }));
}

TEST_F(KvTransferAgents, ADecodeThatLeavesMidTransferFailsItsRoomAtOnce) {
  a_decode_that_leaves_mid_transfer_fails_the_room();
}
TEST_F(KvTransferOverShm, ADecodeThatLeavesMidTransferFailsItsRoomAtOnce) {
  a_decode_that_leaves_mid_transfer_fails_the_room();
}
TEST_F(KvTransferAgents, ADecodeThatLeftIsSentNothing) {
  a_decode_that_left_is_sent_nothing();
}
TEST_F(KvTransferOverShm, ADecodeThatLeftIsSentNothing) {
  a_decode_that_left_is_sent_nothing();
}
TEST_F(KvTransferAgents, ADecodeThatLeftBeforeThePrefillLegHasItRefused) {
  a_decode_that_left_before_the_prefill_leg_has_it_refused();
}
TEST_F(KvTransferOverShm, ADecodeThatLeftBeforeThePrefillLegHasItRefused) {
  a_decode_that_left_before_the_prefill_leg_has_it_refused();
}

TEST_F(KvTransferAgents, ADecodeThatTimedOutBeforeThePrefillLegHasItRefused) {
  a_decode_that_timed_out_before_the_prefill_leg_has_it_refused();
}
TEST_F(KvTransferOverShm, ADecodeThatTimedOutBeforeThePrefillLegHasItRefused) {
  a_decode_that_timed_out_before_the_prefill_leg_has_it_refused();
}

// A register request that is not an object, or whose checksum is not a bool: the peer is told
// that it is malformed (the connection only closed).
TEST_F(KvTransferAgents, AMalformedRegisterRequestIsAnsweredWithAnError) {
  prefill_checksum_ = false;  // else the request's checksum is never read
  start();
  auto transport = make_tcp_transport({5000ms});
  json bad_checksum = {{"room", 1},           {"first_token", 0}, {"num_tokens", 10},
                       {"prompt_tokens", 11}, {"prompt_hash", 5}, {"checksum", "yes"}};
  for (const std::string& request : {std::string("[1, 2]"), bad_checksum.dump()}) {
    auto conn = transport->connect("127.0.0.1", prefill_->port());
    send_text(*conn, KvFrameType::kRegister, request);
    KvFrame f;
    ASSERT_NO_THROW(f = conn->receive(1 << 20)) << request;
    EXPECT_EQ(f.type, KvFrameType::kError) << request;
    EXPECT_THAT(text_of(f.payload), HasSubstr("malformed register request")) << request;
  }
}

// ------------------------------------------------------------------------------- fake prefill

// A prefill server that speaks the wire by hand: `script` answers the first frame of one
// connection (checked to be a pull) and then the connection closes. Its end shuts that
// connection down, so a script still sending (a prefill that keeps a room waiting) stops there
// instead of holding the test's end until it gives up on its own.
class FakePrefill {
 public:
  using Script = std::function<void(KvConnection&, const json& request)>;
  explicit FakePrefill(Script script, KvFrameType request = KvFrameType::kPull)
      : transport_(make_tcp_transport({5000ms})), listener_(transport_->listen("127.0.0.1", 0)) {
    thread_ = std::thread([this, script = std::move(script), request] {
      std::shared_ptr<KvConnection> conn = listener_->accept();
      if (!conn) return;
      {
        std::lock_guard lock(mutex_);
        if (ending_) return;
        conn_ = conn;
      }
      try {
        const KvFrame f = conn->receive(1 << 20);
        EXPECT_EQ(f.type, request);
        script(*conn, json::parse(text_of(f.payload)));
      } catch (const Error&) {
        // A send after the decode side gave up (what these tests provoke): not a failure.
      } catch (const std::exception& e) {
        ADD_FAILURE() << "fake prefill: " << e.what();
      }
      std::lock_guard lock(mutex_);
      conn_.reset();  // with `conn`, the last owner: the connection closes as the script ends
    });
  }
  ~FakePrefill() {
    listener_->close();
    {
      std::lock_guard lock(mutex_);
      ending_ = true;
      if (conn_) conn_->shutdown();  // the script's next send or receive fails: it ends
    }
    thread_.join();
  }
  uint16_t port() const { return listener_->port(); }

 private:
  std::unique_ptr<KvTransport> transport_;
  std::unique_ptr<KvListener> listener_;
  std::mutex mutex_;
  bool ending_ = false;                 // guarded by mutex_
  std::shared_ptr<KvConnection> conn_;  // the accepted connection; guarded by mutex_
  std::thread thread_;
};

// [u32 layer][u32 flags][u64 XXH3-64] little-endian + data, as the header of kv_transfer.h says.
std::vector<std::byte> layer_payload(uint32_t layer, std::span<const std::byte> data, bool checksum,
                                     bool corrupt_checksum = false) {
  std::vector<std::byte> p(16);
  uint64_t sum = checksum ? XXH3_64bits(data.data(), data.size()) : 0;
  if (corrupt_checksum) sum ^= 1;
  for (int b = 0; b < 4; ++b) p[size_t(b)] = std::byte((layer >> (8 * b)) & 0xff);
  p[4] = std::byte(checksum ? 1 : 0);
  for (int b = 0; b < 8; ++b) p[size_t(8 + b)] = std::byte((sum >> (8 * b)) & 0xff);
  p.insert(p.end(), data.begin(), data.end());
  return p;
}

void send_bytes(KvConnection& conn, KvFrameType type, const std::vector<std::byte>& payload) {
  const std::span<const std::byte> parts[] = {payload};
  conn.send(type, parts);
}

// 10 tokens of 8 bytes: one layer of the decode's request.
std::vector<std::byte> layer_data(int seed) {
  std::vector<std::byte> d(80);
  for (size_t i = 0; i < d.size(); ++i) d[i] = std::byte((seed * 53 + int(i)) & 0xff);
  return d;
}

void send_accept(KvConnection& conn) {
  send_text(conn, KvFrameType::kAccept, R"({"layers":3,"first_token":0,"num_tokens":10})");
}

TEST_F(KvTransferAgents, ThePullRequestCarriesTheDocumentedFields) {
  decode_checksum_ = false;  // then layers may come with or without a checksum
  start();
  FakePrefill fake([&](KvConnection& conn, const json& req) {
    EXPECT_FALSE(req.contains("checksum"));
    EXPECT_EQ(req.at("transfer_id"), "prefill-0-3");
    EXPECT_EQ(req.at("engine_id"), "prefill-0");
    EXPECT_EQ(req.at("block_ids"), json({5, 2, 9}));
    EXPECT_EQ(req.at("first_token"), 0);
    EXPECT_EQ(req.at("num_tokens"), 10);
    EXPECT_EQ(req.at("layout"),
              json({{"model", "fake"}, {"layers", 3}, {"block_size", 4}, {"token_bytes", 8}}));
    send_accept(conn);
    for (uint32_t l = 0; l < 3; ++l)
      send_bytes(conn, KvFrameType::kLayer, layer_payload(l, layer_data(int(l)), l != 1));
    send_text(conn, KvFrameType::kDone, "{}");
  });
  port_override_ = fake.port();
  const KvFetchResult r = wait(fetch(pull("prefill-0-3", 0, 10, local_)));
  ASSERT_TRUE(r.ok) << r.error;
  // Check what landed where: layer l's 80 bytes fill blocks 1 and 7 and half of block 3.
  for (int64_t l = 0; l < 3; ++l) {
    const auto d = layer_data(int(l));
    const auto b1 = decode_exec_.block(1, l), b7 = decode_exec_.block(7, l),
               b3 = decode_exec_.block(3, l);
    EXPECT_TRUE(std::equal(b1.begin(), b1.end(), d.begin()));
    EXPECT_TRUE(std::equal(b7.begin(), b7.end(), d.begin() + 32));
    EXPECT_TRUE(std::equal(b3.begin(), b3.begin() + 16, d.begin() + 64));
    EXPECT_TRUE(
        std::all_of(b3.begin() + 16, b3.end(), [](std::byte x) { return x == kUntouched; }));
  }
}

TEST_F(KvTransferAgents, ADecodeEngineThatChecksumsAsksForChecksumsAndRefusesALayerWithout) {
  start();
  FakePrefill fake([&](KvConnection& conn, const json& req) {
    EXPECT_EQ(req.value("checksum", false), true);
    send_accept(conn);
    send_bytes(conn, KvFrameType::kLayer, layer_payload(0, layer_data(0), false));
    send_text(conn, KvFrameType::kDone, "{}");
  });
  port_override_ = fake.port();
  const KvFetchResult r = wait(fetch(pull("prefill-0-0", 0, 10, local_)));
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("layer 0 came without a checksum"));
}

TEST_F(KvTransferAgents, APrefillEngineChecksumsWhenTheDecodeEngineAsks) {
  prefill_checksum_ = false;  // only the decode engine was started with --kv-transfer-checksum
  start();
  RoomOutcome room;
  open(41, kv_prompt_hash(prompt_), int64_t(prompt_.size()), room_done(room));
  Outcome o = fetch(enter_room(41, local_, "req-room"));
  finish_room_layer_by_layer(41);
  const KvFetchResult r = wait(o);
  EXPECT_TRUE(r.ok) << r.error;
  // The same through a pull.
  const std::string id =
      prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()), [] {});
  const KvFetchResult rp = wait(fetch(pull(id, 0, 10, local_, "req-pull")));
  EXPECT_TRUE(rp.ok) << rp.error;
}

TEST_F(KvTransferAgents, AWrongChecksumIsDetectedBeforeAnythingIsWritten) {
  start();
  FakePrefill fake([&](KvConnection& conn, const json&) {
    send_accept(conn);
    send_bytes(conn, KvFrameType::kLayer, layer_payload(0, layer_data(0), true, true));
    send_text(conn, KvFrameType::kDone, "{}");
  });
  port_override_ = fake.port();
  const KvFetchResult r = wait(fetch(pull("prefill-0-0", 0, 10, local_)));
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("layer 0: checksum mismatch"));
  EXPECT_EQ(decode_exec_.writes(), 0);
  EXPECT_TRUE(decode_exec_.data() == FakeExecutor().data());
}

TEST_F(KvTransferAgents, APrefillThatHangsUpMidTransferFailsTheFetch) {
  start();
  FakePrefill fake([&](KvConnection& conn, const json&) {
    send_accept(conn);
    send_bytes(conn, KvFrameType::kLayer, layer_payload(0, layer_data(0), true));
    // ...and the connection closes.
  });
  port_override_ = fake.port();
  const KvFetchResult r = wait(fetch(pull("prefill-0-0", 0, 10, local_)));
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("connection closed by peer"));
  EXPECT_THAT(r.error, HasSubstr("KV transfer from the prefill engine at 127.0.0.1:" +
                                 std::to_string(fake.port()) + " failed"));
  // Layer 0's tokens were written, nothing beyond them.
  const auto d = layer_data(0);
  FakeExecutor expected;
  std::memcpy(expected.block(1, 0).data(), d.data(), 32);
  std::memcpy(expected.block(7, 0).data(), d.data() + 32, 32);
  std::memcpy(expected.block(3, 0).data(), d.data() + 64, 16);
  EXPECT_TRUE(decode_exec_.data() == expected.data());
}

TEST_F(KvTransferAgents, MalformedLayerFramesAreRejected) {
  start();
  struct Case {
    const char* what;
    std::function<void(KvConnection&)> send;
    const char* error;
  };
  const std::vector<Case> cases = {
      {"layers out of order",
       [](KvConnection& c) {
         send_bytes(c, KvFrameType::kLayer, layer_payload(1, layer_data(0), true));
       },
       "expected layer 0, got 1"},
      {"a short layer",
       [](KvConnection& c) {
         auto d = layer_data(0);
         d.resize(72);
         send_bytes(c, KvFrameType::kLayer, layer_payload(0, d, true));
       },
       "expected a layer frame of 96 bytes"},
      {"a layer larger than asked for",
       [](KvConnection& c) {
         auto d = layer_data(0);
         d.resize(88);
         send_bytes(c, KvFrameType::kLayer, layer_payload(0, d, true));
       },
       "exceeds the limit of 96"},
      {"an error instead of a layer",
       [](KvConnection& c) {
         send_text(c, KvFrameType::kError, R"({"message":"prefill engine overloaded"})");
       },
       "prefill engine overloaded"},
      {"done before the layers", [](KvConnection& c) { send_text(c, KvFrameType::kDone, "{}"); },
       "expected a layer frame of 96 bytes, got a done frame of 2 bytes"},
      {"an error without a message",
       [](KvConnection& c) { send_text(c, KvFrameType::kError, "{}"); },
       "the peer reported an error without a message"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    FakePrefill fake([&](KvConnection& conn, const json&) {
      send_accept(conn);
      c.send(conn);
    });
    port_override_ = fake.port();
    const KvFetchResult r = wait(fetch(pull("prefill-0-0", 0, 10, local_)));
    EXPECT_FALSE(r.ok);
    EXPECT_THAT(r.error, HasSubstr(c.error));
  }
  EXPECT_EQ(decode_exec_.writes(), 0);
}

// Sends `progress` (a computed_tokens value each time it is called) every 50 ms until a send
// fails: the decode engine left, or the FakePrefill ended (shut the connection down).
void keep_sending_progress(KvConnection& conn, const std::function<json()>& progress) {
  for (;;) {
    send_text(conn, KvFrameType::kProgress, json{{"computed_tokens", progress()}}.dump());
    std::this_thread::sleep_for(50ms);  // a prefill's pace, not a wait for another thread
  }
}

// Progress frames restart a waiting room's timeout only while they tell of more of its prompt
// computed: a prefill that keeps saying the same, or counts past the prompt's length, or says
// nothing readable, is one that stopped progressing and fails the fetch at the timeout (1 s
// here); every one of them restarted it, and the decode leg and its reserved blocks waited
// forever.
TEST_F(KvTransferAgents, ProgressThatDoesNotProgressFailsARoomAtTheTimeout) {
  decode_timeout_s_ = 1;
  start();
  struct Case {
    const char* what;
    std::function<json()> progress;
  };
  int64_t n = 0;
  const std::vector<Case> cases = {
      {"the same count again", [] { return json(1); }},
      {"counts past the prompt's 11 tokens", [&] { return json(12 + n++); }},
      {"no count", [] { return json("many"); }},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    FakePrefill fake(
        [&](KvConnection& conn, const json&) { keep_sending_progress(conn, c.progress); },
        KvFrameType::kRegister);
    port_override_ = fake.port();
    const KvFetchResult r = wait(fetch(enter_room(7, local_, "req-7")));
    EXPECT_FALSE(r.ok);
    EXPECT_THAT(r.error, HasSubstr("the prefill of bootstrap_room 7 made no progress within 1 s"));
    EXPECT_TRUE(r.prefill_fault) << "a prefill engine that stopped progressing was not blamed";
  }
  EXPECT_EQ(decode_exec_.writes(), 0);
}

// Progress belongs to a room still being computed: a pull's prompt was computed before it was
// held, so a progress frame there is a prefill engine out of step, not a reason to wait longer.
TEST_F(KvTransferAgents, AProgressFrameAnsweringAPullIsAnError) {
  start();
  int64_t n = 0;
  FakePrefill fake(
      [&](KvConnection& conn, const json&) { keep_sending_progress(conn, [&] { return ++n; }); });
  port_override_ = fake.port();
  const KvFetchResult r = wait(fetch(pull("prefill-0-0", 0, 10, local_)));
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("expected an accept frame, got a progress frame"));
}

// A client of a decode engine can name any host in a request, its own too; a refused request
// then has the decode engine connect there to release the hold. A stranger at that host who
// relays the handshake between the decode engine and a prefill engine is authenticated for the
// decode engine's proof, and sent its own pull for a prompt's KV on that connection: the prefill
// engine took it. Every request after the handshake now carries a MAC keyed by the secret and the
// handshake's nonces, so a relay can pass on only the decode engine's own requests.
TEST_F(KvTransferAgents, AStrangerRelayingTheHandshakeCannotSendItsOwnRequest) {
  prefill_secret_ = decode_secret_ = "one deployment's secret";
  start();
  const std::string id =
      prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()), [] {});
  auto transport = make_tcp_transport({5000ms});
  auto listener = transport->listen("127.0.0.1", 0);
  KvFrameType answer = KvFrameType::kAccept;
  std::string said;
  auto stranger = std::async(std::launch::async, [&] {
    auto from_decode = listener->accept();
    if (!from_decode) return;
    auto to_prefill = transport->connect("127.0.0.1", prefill_->port());
    const auto relay = [](KvConnection& from, KvConnection& to) {
      const KvFrame f = from.receive(1 << 20);
      send_bytes(to, f.type, f.payload);
      return f.type;
    };
    try {
      relay(*from_decode, *to_prefill);  // the decode engine's nonce
      relay(*to_prefill, *from_decode);  // the prefill engine's nonce and proof
      relay(*from_decode, *to_prefill);  // the decode engine's proof
      // What the decode engine sends next is passed on only while it authenticates a request
      // (the release, which the stranger drops for its own).
      KvFrame next = from_decode->receive(1 << 20);
      if (next.type == KvFrameType::kAuth) send_bytes(*to_prefill, next.type, next.payload);
      send_text(*to_prefill, KvFrameType::kPull,
                json{{"transfer_id", id},
                     {"engine_id", "prefill-0"},
                     {"block_ids", remote_},
                     {"first_token", 0},
                     {"num_tokens", 10},
                     {"prompt_hash", kv_prompt_hash(prompt_)},
                     {"prompt_tokens", prompt_.size()},
                     {"layout",
                      {{"model", "fake"}, {"layers", 3}, {"block_size", 4}, {"token_bytes", 8}}}}
                    .dump());
      const KvFrame reply = to_prefill->receive(1 << 20);
      answer = reply.type;
      said = text_of(reply.payload);
    } catch (const std::exception& e) {
      said = e.what();
    }
  });
  decode_->release_remote("127.0.0.1", listener->port(), "prefill-0", "t-of-the-stranger", {1});
  get_within(stranger, kHangGuard, "the decode engine's release never reached the stranger");
  listener->close();
  EXPECT_EQ(answer, KvFrameType::kError) << said;
  EXPECT_THAT(said, HasSubstr("KV transfer refused: not authenticated"));
  EXPECT_EQ(prefill_->held_blocks(), 3);  // nothing was taken
  // The hold is still there for the decode engine the prompt is for.
  const KvFetchResult r = wait(fetch(pull(id, 0, 10, local_)));
  EXPECT_TRUE(r.ok) << r.error;
}

// The decode engine's own requests still pass, a release among them.
TEST_F(KvTransferAgents, WithASecretAReleaseStillLetsTheHoldGo) {
  prefill_secret_ = decode_secret_ = "one deployment's secret";
  start();
  bool released = false;
  const std::string id = prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()),
                                        [&] { released = true; });
  decode_->release_remote("127.0.0.1", prefill_->port(), "prefill-0", id, remote_);
  EXPECT_TRUE(queue_.run_until([&] { return released; }));
  EXPECT_EQ(sample(prefill_metrics_, "tandem:kv_transfer_refused_total"), 0);
}

// A hold's id does not follow from another's: it was the engine's id and a counter, so whoever
// could connect to the port (within --kv-transfer-allow, with the secret when there is one)
// released the next request's held KV by counting, and that request's decode leg then failed.
TEST_F(KvTransferAgents, AHoldsIdDoesNotFollowFromAnothersAndAGuessFreesNothing) {
  start();
  const auto hash = kv_prompt_hash(prompt_);
  const auto n = int64_t(prompt_.size());
  bool released = false;
  const std::string first = prefill_->hold(remote_, hash, n, [] {});
  const std::string second = prefill_->hold(remote_, hash, n, [&] { released = true; });
  // The engine's id, then 128 random bits as 32 hex digits.
  const std::string prefix = "prefill-0-";
  for (const std::string& id : {first, second}) {
    ASSERT_EQ(id.rfind(prefix, 0), 0u) << id;
    const std::string bits = id.substr(prefix.size());
    EXPECT_EQ(bits.size(), 32u) << id;
    EXPECT_EQ(bits.find_first_not_of("0123456789abcdef"), std::string::npos) << id;
  }
  // Independent random digits agree in 2 of 32 places on average; in 16 or more with odds
  // below 1e-9.
  size_t same = 0;
  for (size_t i = prefix.size(); i < std::min(first.size(), second.size()); ++i)
    same += first[i] == second[i];
  EXPECT_LT(same, 16u) << first << " and " << second;
  // Releases (pulls of nothing, with the held blocks) naming ids counted from an engine's id,
  // or from the first hold's, or made up, free nothing.
  const std::vector<std::string> guesses = {prefix + "0", prefix + "1", prefix + "2", first + "1",
                                            prefix + std::string(32, '0')};
  for (size_t i = 0; i < guesses.size(); ++i) {
    const KvFetchResult r = wait(fetch(pull(guesses[i], 0, 0, {}, "guess-" + std::to_string(i))));
    EXPECT_FALSE(r.ok) << guesses[i];
    EXPECT_THAT(r.error, HasSubstr("unknown transfer '" + guesses[i] + "'"));
  }
  queue_.run_pending();
  EXPECT_FALSE(released);
  EXPECT_EQ(prefill_->held_blocks(), 6);
  // The decode leg that was told the id still pulls its KV.
  const KvFetchResult r = wait(fetch(pull(second, 0, 10, local_)));
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_TRUE(queue_.run_until([&] { return released; }));
}

// Before a peer has proven that it holds the secret, a frame it states is kept only up to the
// largest one of the handshake: it was read into a buffer of the size its header stated (up to
// 1 MiB, allocated before any of it came), on every connection the port admits. A handshake
// frame stated larger is refused at once, without waiting for (or keeping) its payload; a
// request sent without a handshake (a decode engine without the secret) is still told why,
// however long. The handshake timeout (600 s) is past the hang guard: only a refusal that does
// not wait for the payload is heard within it.
TEST_F(KvTransferAgents, AStrangerCannotMakeThePrefillEngineKeepALargeFrameBeforeTheHandshake) {
  prefill_secret_ = decode_secret_ = "one deployment's secret";
  handshake_timeout_s_ = 600;
  start();
  const std::string refusal = json({{"message", "KV transfer refused: not authenticated"}}).dump();
  {
    // A first frame that claims to be a handshake of 1 MiB; nothing of it follows.
    RawSocket stranger(prefill_->port());
    ASSERT_TRUE(stranger.connected());
    const auto header = kv_frame_header(KvFrameType::kAuth, 1 << 20);
    ASSERT_TRUE(stranger.write(header.data(), header.size()));
    EXPECT_THAT(stranger.next_bytes(), AnyOf(HasSubstr(refusal), ""));
  }
  {
    // A decode engine's nonce, then a proof that claims 1 MiB; nothing of it follows.
    RawSocket stranger(prefill_->port());
    ASSERT_TRUE(stranger.connected());
    const std::string nonce = json{{"nonce", std::string(32, 'a')}}.dump();
    const auto header = kv_frame_header(KvFrameType::kAuth, nonce.size());
    ASSERT_TRUE(stranger.write(header.data(), header.size()));
    ASSERT_TRUE(stranger.write(nonce.data(), nonce.size()));
    const std::string answer_header = stranger.read_exactly(kKvFrameHeaderBytes);
    ASSERT_EQ(answer_header.size(), kKvFrameHeaderBytes);
    uint64_t size = 0;
    ASSERT_EQ(parse_kv_frame_header(reinterpret_cast<const std::byte*>(answer_header.data()), size,
                                    1 << 20, "the prefill engine"),
              KvFrameType::kAuth);
    ASSERT_THAT(stranger.read_exactly(size_t(size)), HasSubstr("\"proof\""));
    const auto proof = kv_frame_header(KvFrameType::kAuth, 1 << 20);
    ASSERT_TRUE(stranger.write(proof.data(), proof.size()));
    EXPECT_THAT(stranger.next_bytes(), AnyOf(HasSubstr(refusal), ""));
  }
  {
    // A decode engine without the secret whose request is larger than any handshake frame.
    auto transport = make_tcp_transport({5000ms});
    auto conn = transport->connect("127.0.0.1", prefill_->port());
    send_text(*conn, KvFrameType::kPull,
              json{{"transfer_id", std::string(100000, 'x')}, {"block_ids", remote_}}.dump());
    const KvFrame f = conn->receive(1 << 20);
    EXPECT_EQ(f.type, KvFrameType::kError);
    EXPECT_EQ(text_of(f.payload), refusal);
  }
  EXPECT_EQ(sample(prefill_metrics_, "tandem:kv_transfer_refused_total"), 3);
  // The port still serves a decode engine that holds the secret.
  const std::string id =
      prefill_->hold(remote_, kv_prompt_hash(prompt_), int64_t(prompt_.size()), [] {});
  const KvFetchResult r = wait(fetch(pull(id, 0, 10, local_)));
  EXPECT_TRUE(r.ok) << r.error;
}

// The decode side likewise: a prefill engine (or whoever a request names) answers the handshake
// with a frame larger than any handshake frame, and the decode engine fails the fetch on its
// header instead of reading it (up to 1 MiB) before the peer has proven anything.
TEST_F(KvTransferAgents, ADecodeEngineRefusesAHandshakeAnswerLargerThanAnyHandshakeFrame) {
  decode_secret_ = "one deployment's secret";
  start();
  FakePrefill fake(
      [&](KvConnection& conn, const json&) {
        send_text(conn, KvFrameType::kAuth, std::string(1 << 20, ' '));
      },
      KvFrameType::kAuth);
  port_override_ = fake.port();
  const KvFetchResult r = wait(fetch(pull("prefill-0-0", 0, 10, local_)));
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("frame of 1048576 bytes exceeds the limit"));
  EXPECT_TRUE(r.prefill_fault);  // it broke the protocol
}

// The text a peer leaves with a room's refusal is clipped: each refusal is kept until the
// timeout, up to max_rooms (65536) of them, and a peer sent a reason (or a layout field) of up to
// 1 MiB each, which the engine kept whole: 64 GiB from one peer within one timeout.
TEST_F(KvTransferAgents, TheTextAPeerLeavesWithARefusalIsClipped) {
  start(600);
  const uint64_t hash = kv_prompt_hash(prompt_);
  const std::string huge(500000, 'r');
  auto transport = make_tcp_transport({5000ms});
  auto tell = [&](KvFrameType type, const json& request) {
    auto conn = transport->connect("127.0.0.1", prefill_->port());
    send_text(*conn, type, request.dump());
    return conn->receive(1 << 20);
  };
  EXPECT_EQ(tell(KvFrameType::kAbandon,
                 {{"room", 301}, {"prompt_hash", hash}, {"prompt_tokens", 11}, {"reason", huge}})
                .type,
            KvFrameType::kDone);
  const KvFrame mismatch =
      tell(KvFrameType::kRegister,
           {{"room", 302},
            {"first_token", 0},
            {"num_tokens", 10},
            {"prompt_tokens", 11},
            {"prompt_hash", hash},
            {"layout", {{"model", huge}, {"layers", 3}, {"block_size", 4}, {"token_bytes", 8}}}});
  EXPECT_EQ(mismatch.type, KvFrameType::kError);
  EXPECT_LT(mismatch.payload.size(), 1000u);
  for (uint64_t room : {301, 302}) {
    RoomOutcome refused;
    try {
      open(room, hash, 11, room_done(refused));
      ADD_FAILURE() << "room " << room << " was not refused";
    } catch (const KvTransferError& e) {
      const std::string what = e.what();
      EXPECT_LT(what.size(), 1000u) << room;
      EXPECT_THAT(what, HasSubstr("bytes)")) << room;  // says how much was cut
    }
  }
}

// A layer of 2.5 MiB (10 tokens of 256 KiB): an error frame in its place was read whole into a
// buffer of the size its header stated, up to the layer's, though an error is a JSON control
// frame of 1 MiB at most.
class KvTransferLargeLayers : public KvTransferAgents {
 protected:
  KvTransferLargeLayers() : KvTransferAgents(KvLayout{"fake", 1, 4, 256 << 10}, "tcp") {}
};

TEST_F(KvTransferLargeLayers, AnErrorFrameIsAControlFrameHoweverLargeALayerIs) {
  start();
  FakePrefill fake([&](KvConnection& conn, const json&) {
    send_text(conn, KvFrameType::kAccept, R"({"layers":1,"first_token":0,"num_tokens":10})");
    send_text(conn, KvFrameType::kError, json{{"message", std::string(2 << 20, 'e')}}.dump());
  });
  port_override_ = fake.port();
  const KvFetchResult r = wait(fetch(pull("prefill-0-0", 0, 10, local_)));
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("exceeds the limit of 1048576"));
  EXPECT_LT(r.error.size(), 1000u);
  EXPECT_EQ(decode_exec_.writes(), 0);
}

// An error frame within the limit: its message is a peer's text, which reaches the fetch's error,
// the logs and the client's 502, so it is clipped as a refusal's is.
TEST_F(KvTransferAgents, AnErrorFramesMessageIsClippedLikeAnyPeersText) {
  start();
  FakePrefill fake([&](KvConnection& conn, const json&) {
    send_text(conn, KvFrameType::kError, json{{"message", std::string(512 << 10, 'e')}}.dump());
  });
  port_override_ = fake.port();
  const KvFetchResult r = wait(fetch(pull("prefill-0-0", 0, 10, local_)));
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("eeee"));
  EXPECT_THAT(r.error, HasSubstr("bytes)"));  // says how much was cut
  EXPECT_LT(r.error.size(), 1000u);
}

}  // namespace
}  // namespace tandem::engine
