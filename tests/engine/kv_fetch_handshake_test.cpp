// A decode engine pulling KV from a prefill engine that is hung: its process stopped (SIGSTOP),
// its sockets still open, so the kernel completes every connection and nothing ever answers.
// The fetch must fail within the handshake timeout (connect, authentication, the prefill's answer
// to a pull of KV it already holds), not the transfer timeout that bounds waits for the
// prefill's compute: the gateway ejects such an engine within seconds, and the request should be
// retried elsewhere as soon.
//
// The hung prefill is a socket that listens and never accepts, reads or writes (over TCP, and
// the abstract Unix socket of the shared-memory transport). The decode engine's transfer timeout
// is 60 s and its handshake timeout 1 s; the wait for the outcome gives up (ending the run)
// after 30 s, so a fetch bounded by the transfer timeout fails the test instead of hanging it.
// Nothing asserts on time: the outcome must be the handshake's failure, blamed on the prefill.
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine/transfer/kv_transfer.h"
#include "engine/transfer/kv_transport.h"
#include "engine/transfer/shm_ring.h"
#include "util/bounded_wait.h"
#include "util/error.h"
#include "util/metrics.h"

namespace tandem::engine {
namespace {

using namespace std::chrono_literals;
using testing::get_within;
using ::testing::HasSubstr;

const KvLayout kLayout{"fake", 3, 4, 8};  // 3 layers, 4 tokens a block, 8 bytes a token

// A decode engine's cache that nothing is ever written into here (the prefill never answers).
class NoKvExecutor : public Executor {
 public:
  NoKvExecutor() {
    info_.model_name = "fake-model";
    info_.vocab_size = 1000;
    info_.max_model_len = 1024;
    info_.num_blocks = 16;
    info_.block_size = kLayout.block_size;
    info_.kv_layout = kLayout;
  }
  const ExecutorInfo& info() const override { return info_; }
  ExecResult execute(std::span<const ExecItem>, const LayerHook&) override {
    throw Error("NoKvExecutor::execute: KV transfer never runs a step");
  }
  const std::byte* kv_bytes(int32_t, int64_t) const override {
    throw Error("NoKvExecutor::kv_bytes: nothing is read from this cache");
  }
  void write_kv(int32_t, int64_t, std::span<const std::byte>) override {
    ADD_FAILURE() << "KV written though the prefill engine never answered";
  }

 private:
  ExecutorInfo info_;
};

// A socket bound and listening that is never accepted on, read or written: the kernel completes
// a peer's connection into the backlog, as it does for a stopped process.
class HungSocket {
 public:
  HungSocket(int family, const sockaddr* address, socklen_t length)
      : fd_(::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    listening_ = fd_ >= 0 && ::bind(fd_, address, length) == 0 && ::listen(fd_, SOMAXCONN) == 0;
  }
  ~HungSocket() {
    if (fd_ >= 0) ::close(fd_);
  }
  HungSocket(const HungSocket&) = delete;
  HungSocket& operator=(const HungSocket&) = delete;
  bool listening() const { return listening_; }
  int fd() const { return fd_; }

 private:
  int fd_;
  bool listening_ = false;
};

// A hung prefill engine on 127.0.0.1: its TCP port and the shared-memory transport's Unix
// socket of that port, neither ever answering.
class HungPrefill {
 public:
  HungPrefill() : tcp_(tcp_on_any_port()) {
    sockaddr_in bound{};
    socklen_t length = sizeof bound;
    if (tcp_->listening() &&
        ::getsockname(tcp_->fd(), reinterpret_cast<sockaddr*>(&bound), &length) == 0)
      port_ = ntohs(bound.sin_port);
    socklen_t unix_length = 0;
    const sockaddr_un name = shm::socket_address("127.0.0.1", port_, unix_length);
    unix_ = std::make_unique<HungSocket>(AF_UNIX, reinterpret_cast<const sockaddr*>(&name),
                                         unix_length);
  }
  bool listening() const { return port_ != 0 && tcp_->listening() && unix_->listening(); }
  uint16_t port() const { return port_; }

 private:
  static std::unique_ptr<HungSocket> tcp_on_any_port() {
    sockaddr_in any{};
    any.sin_family = AF_INET;
    any.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    any.sin_port = 0;
    return std::make_unique<HungSocket>(AF_INET, reinterpret_cast<const sockaddr*>(&any),
                                        sizeof any);
  }

  std::unique_ptr<HungSocket> tcp_, unix_;
  uint16_t port_ = 0;
};

// The decode engine's settings that matter here: a transfer timeout far past the wait below, a
// short handshake timeout.
constexpr double kTransferTimeoutS = 60;
// Long enough for a healthy prefill agent on a loaded machine to answer a pull within it.
constexpr double kHandshakeTimeoutS = 1.0;
constexpr std::chrono::seconds kOutcomeGuard{30};  // < kTransferTimeoutS: a hang fails the test

struct Case {
  std::string transport;  // "tcp" or "shm"
  std::string secret;     // empty: no authentication handshake
  bool pull = true;       // else a bootstrap room's registration
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return info.param.transport + (info.param.secret.empty() ? "" : "_WithASecret") +
         (info.param.pull ? "_Pull" : "_Room");
}

class AHungPrefill : public ::testing::TestWithParam<Case> {
 protected:
  // Fetches from the hung prefill engine as a decode engine configured as above; the outcome.
  KvFetchResult fetch_from_hung_prefill() {
    const Case& c = GetParam();
    HungPrefill prefill;
    EXPECT_TRUE(prefill.listening());
    TcpTransportOptions io;
    io.io_timeout = std::chrono::milliseconds(int64_t(kTransferTimeoutS * 1000));  // engine.cpp's
    KvTransferConfig d;
    d.engine_id = "decode-0";
    d.port = -1;
    d.timeout_s = kTransferTimeoutS;
    d.handshake_timeout_s = kHandshakeTimeoutS;
    d.secret = c.secret;
    d.transport = c.transport == "shm" ? KvTransportKind::kShm : KvTransportKind::kTcp;
    // The outcome is posted: run on the agent's thread here, it only fulfils the promise.
    KvTransferAgent decode(d, executor_,
                           c.transport == "shm" ? make_shm_transport(io) : make_tcp_transport(io),
                           registry_, [](KvTransfers::Task t) { t(); });

    KvFetch f;
    f.request_id = "req-1";
    f.pull = c.pull;
    f.host = "127.0.0.1";
    f.port = prefill.port();
    f.engine_id = "prefill-0";
    f.transfer_id = "prefill-0-00000000000000000000000000000000";
    f.remote_blocks = {5, 2, 9};
    f.room = 7;
    f.prompt_hash = 1234;
    f.prompt_tokens = 11;
    f.first_token = 0;
    f.num_tokens = 10;
    f.local_blocks = {1, 7, 3};
    std::promise<KvFetchResult> outcome;
    auto future = outcome.get_future();
    decode.fetch(std::move(f), [&outcome](const KvFetchResult& r) { outcome.set_value(r); });
    return get_within(future, kOutcomeGuard,
                      "the fetch from a hung prefill engine waited past the handshake timeout");
  }

  NoKvExecutor executor_;
  metrics::Registry registry_;
};

// The pull, and the room's registration (its connect and authentication: what follows waits for
// the prefill's compute), fail as the handshake's failure, and blame the prefill engine: the
// engine retries the request elsewhere instead of answering it with a client error.
TEST_P(AHungPrefill, FailsTheFetchAtTheHandshakeTimeout) {
  const KvFetchResult r = fetch_from_hung_prefill();
  EXPECT_FALSE(r.ok);
  EXPECT_THAT(r.error, HasSubstr("did not answer within the handshake timeout"));
  EXPECT_TRUE(r.prefill_fault) << r.error;
  EXPECT_FALSE(r.transfer_gone) << r.error;
}

INSTANTIATE_TEST_SUITE_P(, AHungPrefill,
                         ::testing::Values(Case{"tcp", "", true}, Case{"tcp", "s3cret", true},
                                           Case{"tcp", "s3cret", false}, Case{"shm", "", true},
                                           Case{"shm", "", false}),
                         case_name);

// A transport whose connect first blocks for `lookup` (a name service answering slowly, as
// Kubernetes' conntrack race delays an A/AAAA lookup by 5 s), before it calls give_up at all,
// then connects over TCP as the engines do.
class SlowLookupTransport : public KvTransport {
 public:
  SlowLookupTransport(std::chrono::milliseconds lookup, const TcpTransportOptions& io)
      : lookup_(lookup), tcp_(make_tcp_transport(io)) {}
  std::string name() const override { return "slow-lookup"; }
  std::unique_ptr<KvListener> listen(const std::string& host, uint16_t port,
                                     SharedView shared) override {
    return tcp_->listen(host, port, shared);
  }
  std::unique_ptr<KvConnection> connect(const std::string& host, uint16_t port,
                                        const GiveUp& give_up) override {
    std::this_thread::sleep_for(lookup_);  // the lookup's time, not a wait on another thread
    return tcp_->connect(host, port, give_up);
  }

 private:
  std::chrono::milliseconds lookup_;
  std::unique_ptr<KvTransport> tcp_;
};

// The handshake timeout bounds the prefill engine's answers, not this host's name lookup: a
// healthy prefill engine reached after a lookup longer than the timeout answers the pull (here a
// refusal: it holds no such transfer), and nothing blames it. (A name that does not resolve is
// the prefill engine's fault: it advertised it.)
class APrefillBehindASlowLookup : public ::testing::Test {
 protected:
  KvFetchResult pull_from(std::unique_ptr<KvTransport> transport, const std::string& host,
                          uint16_t port) {
    KvTransferConfig d;
    d.engine_id = "decode-0";
    d.port = -1;
    d.timeout_s = kTransferTimeoutS;
    d.handshake_timeout_s = kHandshakeTimeoutS;
    d.transport = KvTransportKind::kTcp;
    KvTransferAgent decode(d, executor_, std::move(transport), registry_,
                           [](KvTransfers::Task t) { t(); });
    KvFetch f;
    f.request_id = "req-1";
    f.host = host;
    f.port = port;
    f.engine_id = "prefill-0";
    f.transfer_id = "prefill-0-00000000000000000000000000000000";
    f.remote_blocks = {5, 2, 9};
    f.prompt_hash = 1234;
    f.prompt_tokens = 11;
    f.num_tokens = 10;
    f.local_blocks = {1, 7, 3};
    std::promise<KvFetchResult> outcome;
    auto future = outcome.get_future();
    decode.fetch(std::move(f), [&outcome](const KvFetchResult& r) { outcome.set_value(r); });
    return get_within(future, kOutcomeGuard, "the fetch behind a slow lookup never ended");
  }

  NoKvExecutor executor_;
  metrics::Registry registry_, prefill_registry_;
};

TEST_F(APrefillBehindASlowLookup, AnswersThePullAndIsNotBlamed) {
  KvTransferConfig p;
  p.engine_id = "prefill-0";
  p.listen_host = "127.0.0.1";
  p.port = 0;
  p.advertise_host = "127.0.0.1";
  p.timeout_s = kTransferTimeoutS;
  p.transport = KvTransportKind::kTcp;
  KvTransferAgent prefill(p, executor_, make_tcp_transport(), prefill_registry_,
                          [](KvTransfers::Task t) { t(); });
  ASSERT_TRUE(prefill.serving());
  TcpTransportOptions io;
  io.io_timeout = std::chrono::milliseconds(int64_t(kTransferTimeoutS * 1000));
  const auto lookup = std::chrono::milliseconds(int64_t(3 * kHandshakeTimeoutS * 1000));
  const KvFetchResult r =
      pull_from(std::make_unique<SlowLookupTransport>(lookup, io), "127.0.0.1", prefill.port());
  EXPECT_FALSE(r.ok);
  EXPECT_TRUE(r.transfer_gone) << r.error;  // the prefill engine's own answer
  EXPECT_FALSE(r.prefill_fault) << r.error;
  EXPECT_THAT(r.error, ::testing::Not(HasSubstr("did not answer")));
}

// A release of held KV (a pull of nothing) is bounded by the handshake timeout as a whole too, and
// that clock too starts after this host's name lookup: a healthy prefill engine reached after a
// lookup longer than the timeout gets the release and frees the KV. The release gave up at its
// first check, so the prefill engine held the KV until --kv-transfer-timeout.
TEST_F(APrefillBehindASlowLookup, GetsAReleaseAndFreesTheKv) {
  KvTransferConfig p;
  p.engine_id = "prefill-0";
  p.listen_host = "127.0.0.1";
  p.port = 0;
  p.advertise_host = "127.0.0.1";
  p.timeout_s = kTransferTimeoutS;  // the hold outlives the wait below: only the release frees it
  p.transport = KvTransportKind::kTcp;
  std::promise<void> freed;
  auto future = freed.get_future();
  KvTransferAgent prefill(p, executor_, make_tcp_transport(), prefill_registry_,
                          [](KvTransfers::Task t) { t(); });
  ASSERT_TRUE(prefill.serving());
  const std::string id = prefill.hold({5, 2, 9}, 1234, 11, [&freed] { freed.set_value(); });

  KvTransferConfig d;
  d.engine_id = "decode-0";
  d.port = -1;
  d.timeout_s = kTransferTimeoutS;
  d.handshake_timeout_s = kHandshakeTimeoutS;
  d.transport = KvTransportKind::kTcp;
  TcpTransportOptions io;
  io.io_timeout = std::chrono::milliseconds(int64_t(kTransferTimeoutS * 1000));
  const auto lookup = std::chrono::milliseconds(int64_t(3 * kHandshakeTimeoutS * 1000));
  KvTransferAgent decode(d, executor_, std::make_unique<SlowLookupTransport>(lookup, io), registry_,
                         [](KvTransfers::Task t) { t(); });
  decode.release_remote("127.0.0.1", prefill.port(), "prefill-0", id, {5, 2, 9});
  get_within(future, kOutcomeGuard, "the release behind a slow lookup never reached the prefill");
  EXPECT_EQ(prefill.held_blocks(), 0);
}

}  // namespace
}  // namespace tandem::engine
