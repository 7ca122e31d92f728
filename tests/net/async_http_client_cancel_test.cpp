// What a cancelled call reports of how far it got: one cancelled before its connection was made
// never reached the server (CallFailure::kNotConnected), which a gateway needs to know to free
// what the request would have taken over there (a decode leg's KV on its prefill engine). Such a
// call reported kCancelled, as if the server may have seen it. (async_http_client_test.cpp covers
// a call cancelled after the server read it: kCancelled.)
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <optional>
#include <string>

#include "net/async_http_client.h"
#include "util/bounded_wait.h"

namespace tandem::net {
namespace {

using tandem::testing::get_within;
using tandem::testing::kHangGuard;

// A listening socket on the loopback that never accepts, its accept queue full (backlog 0, one
// connection queued): the kernel drops further connections' SYNs, so a client stays connecting.
class FullListener {
 public:
  FullListener() {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(listener_, reinterpret_cast<const sockaddr*>(&address), sizeof address), 0);
    EXPECT_EQ(::listen(listener_, 0), 0);
    socklen_t length = sizeof address;
    EXPECT_EQ(::getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length), 0);
    port_ = ntohs(address.sin_port);
    filler_ = ::socket(AF_INET, SOCK_STREAM, 0);
    EXPECT_EQ(::connect(filler_, reinterpret_cast<const sockaddr*>(&address), sizeof address), 0);
    // The queue is full once the listener reads as ready to accept.
    pollfd ready{listener_, POLLIN, 0};
    EXPECT_EQ(::poll(&ready, 1, static_cast<int>(kHangGuard.count() * 1000)), 1)
        << "the filler connection never reached the accept queue";
  }
  ~FullListener() {
    ::close(filler_);
    ::close(listener_);
  }
  uint16_t port() const { return port_; }

 private:
  int listener_ = -1, filler_ = -1;
  uint16_t port_ = 0;
};

// A loopback port bound but not listening: a connection to it is refused at once.
class ClosedPort {
 public:
  ClosedPort() {
    socket_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(socket_, reinterpret_cast<const sockaddr*>(&address), sizeof address), 0);
    socklen_t length = sizeof address;
    EXPECT_EQ(::getsockname(socket_, reinterpret_cast<sockaddr*>(&address), &length), 0);
    port_ = ntohs(address.sin_port);
  }
  ~ClosedPort() { ::close(socket_); }
  uint16_t port() const { return port_; }

 private:
  int socket_ = -1;
  uint16_t port_ = 0;
};

AsyncHttpRequest post_to(uint16_t port) {
  AsyncHttpRequest request;
  request.host = "127.0.0.1";
  request.port = port;
  request.method = "POST";
  request.target = "/v1/completions";
  request.body = "{}";
  return request;
}

// The call's connection is being made when it is cancelled (ClientConn::connecting()): the client
// runs its tasks in order, so once a later call to a closed port has ended, the first call's start
// has run and its connection waits on the full listener. (Cancelled at once instead, as below,
// a call ends in ClientLoop::begin before it connects, and this path went untested.)
TEST(AsyncHttpClientCancel, ACallCancelledWhileConnectingReportsThatItNeverConnected) {
  FullListener engine;
  ClosedPort closed;
  AsyncHttpClient client;
  std::optional<CallFailure> failure;
  std::promise<std::string> done;
  AsyncHttpHandlers h;
  h.on_failure = [&](CallFailure f) { failure = f; };  // on the client's thread, before on_done
  h.on_done = [&](const std::string& error) { done.set_value(error); };
  const auto id = client.start(post_to(engine.port()), std::move(h));
  std::promise<std::string> refused;
  AsyncHttpHandlers after;
  after.on_done = [&](const std::string& error) { refused.set_value(error); };
  client.start(post_to(closed.port()), std::move(after));
  auto refused_ended = refused.get_future();
  EXPECT_NE(get_within(refused_ended, kHangGuard, "the call to a closed port never ended"), "");
  auto ended = done.get_future();
  EXPECT_EQ(ended.wait_for(std::chrono::seconds(0)), std::future_status::timeout)
      << "the first call ended before it was cancelled: it was not connecting";
  client.cancel(id);
  EXPECT_EQ(get_within(ended, kHangGuard, "the cancelled call never ended"), "cancelled");
  ASSERT_TRUE(failure.has_value());
  EXPECT_EQ(*failure, CallFailure::kNotConnected);
}

// Cancelled before its start ran on the client's thread: it ends in ClientLoop::begin.
TEST(AsyncHttpClientCancel, ACallCancelledBeforeItConnectedReportsThatItNeverConnected) {
  FullListener engine;
  AsyncHttpClient client;
  AsyncHttpRequest request;
  request.host = "127.0.0.1";
  request.port = engine.port();
  request.method = "POST";
  request.target = "/v1/completions";
  request.body = "{}";
  std::optional<CallFailure> failure;
  std::promise<std::string> done;
  AsyncHttpHandlers h;
  h.on_failure = [&](CallFailure f) { failure = f; };  // on the client's thread, before on_done
  h.on_done = [&](const std::string& error) { done.set_value(error); };
  const auto id = client.start(std::move(request), std::move(h));
  client.cancel(id);
  auto ended = done.get_future();
  EXPECT_EQ(get_within(ended, kHangGuard, "the cancelled call never ended"), "cancelled");
  ASSERT_TRUE(failure.has_value());
  EXPECT_EQ(*failure, CallFailure::kNotConnected);
}

}  // namespace
}  // namespace tandem::net
