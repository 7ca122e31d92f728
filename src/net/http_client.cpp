#include "net/http_client.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "net/byte_buffer.h"
#include "net/http_wire.h"
#include "net/socket.h"
#include "util/error.h"

namespace tandem::net {

namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kReadChunk = 16384;
constexpr size_t kMaxHeaderBytes = size_t{64} << 10;
// A whole (not streamed) response is held in memory: a server cannot make it grow without end.
constexpr size_t kMaxWholeBody = size_t{1} << 30;

HttpClientOptions with_timeout(std::chrono::milliseconds timeout) {
  HttpClientOptions options;
  options.timeout = timeout;
  return options;
}

}  // namespace

// The same wire code as the asynchronous client, over one non-blocking socket whose waits are
// poll() calls bounded by the deadline of the step.
class HttpClient::Impl {
 public:
  Impl(std::string host, uint16_t port, HttpClientOptions options)
      : host_(std::move(host)),
        port_(port),
        timeout_(options.timeout),
        max_idle_age_(options.max_idle_age),
        clock_(std::move(options.clock)),
        head_parser_(kMaxHeaderBytes) {}
  ~Impl() { close(); }

  HttpClientResponse request(std::string_view method, std::string_view target,
                             std::string_view body, const Headers& headers,
                             const BodyCallback* on_body) {
    what_ = std::string(method) + " http://" + host_ + ":" + std::to_string(port_) +
            std::string(target);
    out_.clear();
    detail::append_request(out_, method, target, host_, port_, headers, body);
    head_request_ = method == "HEAD";
    idempotent_ = detail::idempotent_method(method);
    // A reused connection may have been closed by the server while idle (its keep-alive
    // timeout): one whose close already arrived, or old enough for one to be on its way, is not
    // used, and one that fails before any answer is retried once on a new connection when that
    // cannot run the request twice (exchange() throws StaleConnection only then).
    const bool young = max_idle_age_.count() <= 0 || now() - idle_since_ < max_idle_age_;
    if (fd_ >= 0 && (!young || !detail::idle_connection_usable(fd_))) close();
    const bool reused = fd_ >= 0;
    for (int attempt = 0;; ++attempt) {
      try {
        return exchange(on_body);
      } catch (const StaleConnection&) {
        close();
        if (!reused || attempt > 0) fail("the server closed the connection");
      }
    }
  }

  void close() {
    if (fd_ >= 0) {
      ::shutdown(fd_, SHUT_RDWR);
      ::close(fd_);
      fd_ = -1;
    }
    in_.clear();
  }

 private:
  struct StaleConnection {};

  Clock::time_point now() const { return clock_ ? clock_() : Clock::now(); }

  [[noreturn]] void fail(std::string_view step, std::string_view why = {}) {
    close();
    throw Error(failure(step, why));
  }
  [[noreturn]] void fail_to_connect(std::string_view step, std::string_view why) {
    close();
    throw HttpConnectError(failure(step, why));
  }
  std::string failure(std::string_view step, std::string_view why) const {
    std::string message = "HTTP " + what_ + ": " + std::string(step);
    if (!why.empty()) message += ": " + std::string(why);
    return message;
  }

  // Waits until the socket is ready for `events` or the deadline passes (then fails `step`).
  void wait(short events, Clock::time_point deadline, const char* step) {
    if (!ready(events, deadline, step)) fail(step, "timed out");
  }
  // The same, false when the deadline passes.
  bool ready(short events, Clock::time_point deadline, const char* step) {
    for (;;) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) return false;
      pollfd p{fd_, events, 0};
      int n = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 1 << 30)));
      if (n > 0) return true;
      if (n < 0 && errno != EINTR) fail(step, std::strerror(errno));
    }
  }

  void connect() {
    std::string error;
    std::vector<detail::Address> addresses = detail::resolve(host_, port_, false, error);
    if (addresses.empty()) fail_to_connect("cannot resolve host", error);
    const auto deadline = Clock::now() + timeout_;
    int last = 0;
    for (const detail::Address& a : addresses) {
      fd_ = detail::start_connect(a);
      if (fd_ < 0) {
        last = errno;
        continue;
      }
      // A running server's kernel completes the handshake however busy the server is: no answer
      // to it is a host that drops the connection (firewalled, down), as good as none there.
      int so_error = ETIMEDOUT;
      if (ready(POLLOUT, deadline, "cannot connect")) {
        socklen_t length = sizeof so_error;
        ::getsockopt(fd_, SOL_SOCKET, SO_ERROR, &so_error, &length);
      }
      if (so_error == 0) return;
      last = so_error;
      ::close(fd_);
      fd_ = -1;
    }
    fail_to_connect("cannot connect", std::strerror(last));
  }

  // Sends the request: 0, or the errno that stopped it before its end.
  int send_all() {
    const auto deadline = Clock::now() + timeout_;
    size_t sent = 0;
    while (sent < out_.size()) {
      ssize_t n = ::send(fd_, out_.data() + sent, out_.size() - sent, MSG_NOSIGNAL);
      if (n > 0) {
        sent += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        wait(POLLOUT, deadline, "cannot send the request");
        continue;
      }
      return n < 0 ? errno : EPIPE;
    }
    return 0;
  }

  // Reads what is there (waiting until something is, unless `wait_for_more` is false); false at
  // EOF, or with nothing there and no waiting.
  bool read_some(Clock::time_point deadline, const char* step, bool wait_for_more = true) {
    for (;;) {
      char* at = in_.prepare(kReadChunk);
      ssize_t n = ::recv(fd_, at, in_.room(), 0);
      if (n > 0) {
        in_.commit(static_cast<size_t>(n));
        return true;
      }
      if (n == 0) return false;
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (!wait_for_more) return false;
        wait(POLLIN, deadline, step);
        continue;
      }
      if (errno == ECONNRESET) {
        // An end, but not a clean one: a body delimited by the close is then cut, not whole.
        reset_ = true;
        return false;
      }
      fail(step, std::strerror(errno));
    }
  }

  HttpClientResponse exchange(const BodyCallback* on_body) {
    const bool fresh = fd_ < 0;
    reset_ = false;
    if (fresh) connect();
    // A server that refused the request from its head may have answered, then closed without
    // reading the rest (a reset): that answer is the outcome, not the failed send. Only what
    // already arrived is read then; the broken connection brings nothing more.
    const int send_error = send_all();

    // For a plain request this deadline covers the whole response; a stream renews it for every
    // piece below.
    auto deadline = Clock::now() + timeout_;
    const char* step = "cannot read the response header";
    detail::ParseError error;
    bool got_bytes = !in_.empty();
    for (;;) {
      head_parser_.reset();
      detail::Parse r;
      while ((r = head_parser_.response(in_.view(), head_request_, head_, error)) ==
             detail::Parse::kNeedMore) {
        if (!read_some(deadline, step, send_error == 0)) {
          if (send_error != 0) {
            // Not all of it went out: the server cannot have taken it for a whole request.
            if (!fresh && !got_bytes) throw StaleConnection{};
            fail("cannot send the request", std::strerror(send_error));
          }
          // The whole request went out: a POST may be running on the server, and is not sent
          // twice (the caller decides).
          if (!fresh && !got_bytes && idempotent_) throw StaleConnection{};
          fail(step, "connection closed by the server");
        }
        got_bytes = true;
      }
      if (r == detail::Parse::kError) fail(step, error.message);
      // Never asked for: after a 101 the connection speaks something other than HTTP.
      if (head_.status == 101) fail(step, "the server switched protocols (HTTP 101) unasked");
      if (head_.status >= 200) break;
      in_.consume(head_.head_bytes);  // an interim 1xx response
    }
    HttpClientResponse response;
    response.status = head_.status;
    detail::copy_fields(head_, response.headers);
    in_.consume(head_.head_bytes);
    const bool keep_alive = head_.keep_alive;
    const detail::BodyKind kind = head_.body;

    step = "cannot read the response body";
    body_parser_.start(head_, UINT64_MAX, kMaxHeaderBytes);
    std::string piece;
    std::string& sink = on_body ? piece : response.body;
    for (;;) {
      size_t used = 0;
      detail::Parse r = body_parser_.feed(in_.view(), used, sink, error);
      in_.consume(used);
      if (r == detail::Parse::kError) fail(step, error.message);
      if (!on_body && response.body.size() > kMaxWholeBody)
        fail(step, "the response body is larger than " + std::to_string(kMaxWholeBody) +
                       " bytes (read it as a stream)");
      if (on_body && !piece.empty()) {
        bool more = (*on_body)(piece);
        piece.clear();
        if (!more) {
          close();
          return response;
        }
      }
      if (r == detail::Parse::kDone) break;
      if (on_body) deadline = Clock::now() + timeout_;
      if (!read_some(deadline, step)) {
        if (kind == detail::BodyKind::kUntilClose && !reset_) {
          close();
          return response;
        }
        fail(step, reset_ ? "connection reset by the server" : "connection closed by the server");
      }
    }
    // After a failed send the server did not read the whole request: the next one would be
    // taken for the rest of it.
    if (!keep_alive || !in_.empty() || send_error != 0) {
      close();
    } else {
      idle_since_ = now();
    }
    return response;
  }

  const std::string host_;
  const uint16_t port_;
  const std::chrono::milliseconds timeout_;
  const std::chrono::milliseconds max_idle_age_;
  const std::function<Clock::time_point()> clock_;
  Clock::time_point idle_since_{};  // when the open connection's last answer ended
  std::string what_;                // "METHOD url" for error messages
  int fd_ = -1;
  bool head_request_ = false;
  bool idempotent_ = false;
  bool reset_ = false;  // the last read ended with a reset (ECONNRESET), not a close
  std::string out_;
  detail::ByteBuffer in_;
  detail::HeadParser head_parser_;
  detail::BodyParser body_parser_;
  detail::MessageHead head_;
};

HttpClient::HttpClient(std::string host, uint16_t port, HttpClientOptions options)
    : impl_(std::make_unique<Impl>(std::move(host), port, std::move(options))) {}

HttpClient::HttpClient(std::string host, uint16_t port, std::chrono::milliseconds timeout)
    : HttpClient(std::move(host), port, with_timeout(timeout)) {}

HttpClient::~HttpClient() = default;

HttpClientResponse HttpClient::request(std::string_view method, std::string_view target,
                                       std::string_view body, const Headers& headers) {
  return impl_->request(method, target, body, headers, nullptr);
}

HttpClientResponse HttpClient::request_stream(std::string_view method, std::string_view target,
                                              std::string_view body, const Headers& headers,
                                              const BodyCallback& on_body) {
  return impl_->request(method, target, body, headers, &on_body);
}

void HttpClient::close() {
  impl_->close();
}

HttpClientResponse http_request(const std::string& host, uint16_t port, std::string_view method,
                                std::string_view target, std::string_view body,
                                const Headers& headers, std::chrono::milliseconds timeout) {
  return HttpClient(host, port, timeout).request(method, target, body, headers);
}

HttpClientResponse http_request_stream(const std::string& host, uint16_t port,
                                       std::string_view method, std::string_view target,
                                       std::string_view body, const Headers& headers,
                                       const BodyCallback& on_body,
                                       std::chrono::milliseconds timeout) {
  return HttpClient(host, port, timeout).request_stream(method, target, body, headers, on_body);
}

}  // namespace tandem::net
