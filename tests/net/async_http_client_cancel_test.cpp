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
