// KvTransport over TCP on the project's own socket helpers (src/net's, no Asio): non-blocking
// sockets, and each blocking call waits in poll() for at most the I/O timeout. shutdown() from
// another thread shuts the socket down, which wakes a poll() blocked on it; the descriptor itself
// is closed only when the connection is destroyed, so no call ever races a reused descriptor.
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <mutex>
#include <thread>

#include "engine/transfer/kv_frame.h"
#include "engine/transfer/kv_transport.h"
#include "net/socket.h"
#include "util/error.h"
#include "util/little_endian.h"

namespace tandem::engine {
namespace {

using Clock = std::chrono::steady_clock;

std::string peer_text(int fd) {
  std::string address;
  unsigned short port = 0;
  net::detail::peer_of(fd, address, port);
  if (address.empty()) return "unknown peer";
  return address + ":" + std::to_string(port);
}

// Waits until `fd` is ready for `events` or `deadline` passes. Returns false on timeout. With
// `give_up`, polls in short slices and throws once it says to stop.
bool wait_ready(int fd, short events, Clock::time_point deadline,
                const KvTransport::GiveUp& give_up = {}) {
  for (;;) {
    const auto now = Clock::now();
    if (now >= deadline) return false;
    // Rounded up: a timeout reported is one whose deadline has passed (callers tell by that
    // which of their bounds ended a call).
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - now);
    if (give_up && give_up()) throw Error("abandoned");
    pollfd p{fd, events, 0};
    const int64_t slice = give_up ? 50 : int64_t{1} << 30;
    const int n = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), slice)));
    if (n > 0) return true;  // ready, or an error/hangup the next call reports
    if (n < 0 && errno != EINTR) return true;
  }
}

class TcpConnection : public KvConnection {
 public:
  TcpConnection(int fd, std::chrono::milliseconds timeout)
      : fd_(fd), timeout_(timeout), peer_(peer_text(fd)) {
    net::detail::set_no_delay(fd_);
  }
  ~TcpConnection() override { ::close(fd_); }

  void send(KvFrameType type, std::span<const std::span<const std::byte>> parts) override {
    uint64_t total = 0;
    for (auto p : parts) total += p.size();
    auto header = kv_frame_header(type, total);
    std::vector<iovec> iov;
    iov.reserve(parts.size() + 1);
    iov.push_back({header.data(), header.size()});
    for (auto p : parts)
      if (!p.empty()) iov.push_back({const_cast<std::byte*>(p.data()), p.size()});
    transfer(iov, /*sending=*/true);
  }

  KvFrameType receive_header(uint64_t& size, size_t max_payload) override {
    std::array<std::byte, kKvFrameHeaderBytes> header{};
    std::vector<iovec> iov = {{header.data(), header.size()}};
    transfer(iov, /*sending=*/false);
    return parse_kv_frame_header(header.data(), size, max_payload, peer_);
  }

  void receive_payload(std::span<const std::span<std::byte>> parts) override {
    std::vector<iovec> iov;
    iov.reserve(parts.size());
    for (auto p : parts)
      if (!p.empty()) iov.push_back({p.data(), p.size()});
    if (!iov.empty()) transfer(iov, /*sending=*/false);
  }

  void shutdown() override {
    stopped_ = true;
    ::shutdown(fd_, SHUT_RDWR);  // wakes a poll() blocked on the socket
  }

  bool peer_gone() override { return socket_peer_gone(fd_); }

  void set_timeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }
  void set_deadline(Clock::time_point deadline) override { deadline_ = deadline; }
  std::string peer() const override { return peer_; }
  const char* kind() const override { return "tcp"; }

 private:
  // Sends or receives all of `iov` (consumed as it goes) within one I/O timeout.
  void transfer(std::vector<iovec>& iov, bool sending) {
    const char* what = sending ? "sending" : "receiving";
    if (stopped_ || broken_) throw Error("KV transfer with " + peer_ + ": connection shut down");
    const auto now = Clock::now();
    const auto deadline = kv_call_deadline(now, timeout_, deadline_);
    // The wait below sees the deadline only when nothing is ready: a peer that keeps the socket
    // full (or drained) would hold a step of many calls past it.
    if (now >= deadline_) timed_out(what, now, deadline);
    size_t first = 0;
    while (first < iov.size()) {
      msghdr m{};
      m.msg_iov = iov.data() + first;
      m.msg_iovlen = std::min<size_t>(iov.size() - first, IOV_MAX);
      const ssize_t n = sending ? ::sendmsg(fd_, &m, MSG_NOSIGNAL) : ::recvmsg(fd_, &m, 0);
      if (n > 0) {
        size_t left = static_cast<size_t>(n);
        while (left > 0 && first < iov.size()) {
          const size_t take = std::min(left, iov[first].iov_len);
          iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + take;
          iov[first].iov_len -= take;
          left -= take;
          if (iov[first].iov_len == 0) ++first;
        }
        continue;
      }
      if (stopped_) fail("connection shut down");  // our own shutdown() ended the call
      if (n == 0 && !sending) fail("receiving failed: connection closed by peer");
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (stopped_) fail("connection shut down");
        if (!wait_ready(fd_, sending ? POLLOUT : POLLIN, deadline)) timed_out(what, now, deadline);
        continue;
      }
      if (stopped_) fail("connection shut down");
      if (n < 0 && (errno == EPIPE || errno == ECONNRESET))
        fail(std::string(what) + " failed: connection closed by peer");
      fail(std::string(what) + " failed: " + std::strerror(errno));
    }
    if (stopped_) fail("connection shut down");
  }

  [[noreturn]] void fail(const std::string& why) {
    broken_ = true;
    throw Error("KV transfer with " + peer_ + ": " + why);
  }

  // Part of a frame may have gone (or a frame's header without its payload): the stream is out
  // of step.
  [[noreturn]] void timed_out(const char* what, Clock::time_point start,
                              Clock::time_point deadline) {
    fail(std::string("timed out ") + what + " after " +
         std::to_string(kv_wait_ms(start, deadline)) + " ms");
  }

  const int fd_;
  std::chrono::milliseconds timeout_;
  Clock::time_point deadline_ = Clock::time_point::max();
  const std::string peer_;
  std::atomic<bool> stopped_{false};
  bool broken_ = false;  // the calling thread's: a failed or timed-out call left the stream
};

class TcpListener : public KvListener {
 public:
  TcpListener(const std::string& host, uint16_t port, std::chrono::milliseconds timeout)
      // The engine's KV transfer listener: its errors name the flags that place it.
      : fd_(net::detail::listen_tcp({host, port, "--kv-transfer-host", "--kv-transfer-port"},
                                    port_)),
        timeout_(timeout) {}
  ~TcpListener() override {
    close();
    ::close(fd_);
  }

  std::unique_ptr<KvConnection> accept() override {
    while (!closed_) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, -1) < 0 && errno != EINTR) break;
      if (closed_) break;
      const int fd = ::accept4(fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd >= 0) return std::make_unique<TcpConnection>(fd, timeout_);
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED)
        continue;
      // No file descriptors left (or the like): do not spin.
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return nullptr;
  }

  uint16_t port() const override { return port_; }

  void close() override {
    std::lock_guard lock(mutex_);
    if (closed_) return;
    closed_ = true;
    // shutdown() on the listening socket wakes a thread blocked in poll() on it.
    ::shutdown(fd_, SHUT_RDWR);
  }

 private:
  uint16_t port_ = 0;
  const int fd_;
  const std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::atomic<bool> closed_{false};
};

class TcpTransport : public KvTransport {
 public:
  explicit TcpTransport(const TcpTransportOptions& options) : options_(options) {}
  std::string name() const override { return "tcp"; }

  std::unique_ptr<KvListener> listen(const std::string& host, uint16_t port, SharedView) override {
    return std::make_unique<TcpListener>(host, port, options_.io_timeout);
  }

  std::unique_ptr<KvConnection> connect(const std::string& host, uint16_t port,
                                        const GiveUp& give_up) override {
    const std::string where = host + ":" + std::to_string(port);
    std::string error;
    const auto addresses = net::detail::resolve(host, port, /*passive=*/false, error);
    if (addresses.empty()) throw Error("KV transfer: cannot resolve " + where + ": " + error);
    const auto deadline = Clock::now() + options_.io_timeout;
    std::string last = "no address";
    // Every address in turn: a name may resolve to ::1 and 127.0.0.1 with the server on one.
    for (const auto& a : addresses) {
      const int fd = net::detail::start_connect(a);
      if (fd < 0) {
        last = std::strerror(errno);
        continue;
      }
      bool ready = false;
      try {
        ready = wait_ready(fd, POLLOUT, deadline, give_up);
      } catch (const Error&) {
        ::close(fd);
        throw Error("KV transfer: connecting to " + where + " abandoned");
      }
      if (!ready) {
        ::close(fd);
        throw Error("KV transfer: connecting to " + where + " timed out");
      }
      int so_error = 0;
      socklen_t length = sizeof so_error;
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &length);
      if (so_error == 0) return std::make_unique<TcpConnection>(fd, options_.io_timeout);
      ::close(fd);
      last = std::strerror(so_error);
    }
    throw Error("KV transfer: cannot connect to " + where + ": " + last);
  }

 private:
  TcpTransportOptions options_;
};

}  // namespace

bool socket_peer_gone(int fd) {
  char c;
  const ssize_t n = ::recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

std::unique_ptr<KvTransport> make_tcp_transport(const TcpTransportOptions& options) {
  return std::make_unique<TcpTransport>(options);
}

}  // namespace tandem::engine
