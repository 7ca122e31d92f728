#include "net/async_http_client.h"

#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <future>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "net/byte_buffer.h"
#include "net/event_loop.h"
#include "net/http_server.h"
#include "net/http_wire.h"
#include "net/loop_group.h"
#include "net/socket.h"
#include "util/task_thread.h"

namespace tandem::net {

using detail::EventLoop;

namespace {

constexpr size_t kReadChunk = 16384;

}  // namespace

namespace detail {

class ClientLoop;
class ClientConn;

// One call. Owned by shared_ptr: the client's call table, the connection serving it and queued
// tasks. `cancelled` is set from any thread; everything else below it belongs to the home loop.
struct Call final : Task, std::enable_shared_from_this<Call> {
  enum Op { kStart, kCancel, kResolved };

  AsyncHttpClient::CallId id = 0;
  AsyncHttpRequest request;
  AsyncHttpHandlers handlers;
  ClientLoop* home = nullptr;
  std::atomic<bool> cancelled{false};

  ClientConn* conn = nullptr;
  bool done = false;
  bool retried = false;
  // A host name's lookup, done on the client's resolver thread (kResolved brings it home).
  std::vector<Address> addresses;
  std::string resolve_error;

  void run(int op) override;
};

// What every thread reaches: the calls in flight (for cancel and in_flight) and the counters.
class CallTable {
 public:
  // Forgets a call that ended, before its on_done runs (in_flight() is 0 once the caller learns
  // it); done_calling() follows its on_done. shutdown() waits for both, so no on_done is still
  // running when it returns. Notified under the lock: the waiter may destroy the table next.
  void erase(AsyncHttpClient::CallId id) {
    std::lock_guard lock(mu_);
    calls_.erase(id);
    ++calling_;
  }
  void done_calling() {
    std::lock_guard lock(mu_);
    --calling_;
    empty_cv_.notify_all();
  }
  void count_open() { ++opened_; }

 protected:
  std::atomic<uint64_t> opened_{0};
  mutable std::mutex mu_;
  std::condition_variable empty_cv_;
  size_t calling_ = 0;  // under mu_: on_done callbacks of erased calls still running
  std::unordered_map<AsyncHttpClient::CallId, std::shared_ptr<Call>> calls_;
};

// The client's part of one loop: its connections and the idle ones by host:port.
class ClientLoop {
 public:
  ClientLoop(CallTable& calls, EventLoop& loop, const AsyncHttpClientOptions& options,
             util::TaskThread& resolver)
      : calls_(calls), loop_(loop), options_(options), resolver_(resolver) {}

  EventLoop& loop() { return loop_; }
  const AsyncHttpClientOptions& options() const { return options_; }
  std::chrono::steady_clock::time_point now() const {
    if (options_.clock) return options_.clock();
    return std::chrono::steady_clock::time_point(std::chrono::milliseconds(loop_.now_ms()));
  }

  void begin(const std::shared_ptr<Call>& call);
  void cancel(Call& call);
  // A new connection for `call` (after a stale reused one, or when none is idle). Numeric hosts
  // and names looked up in the last kNameTtlMs connect at once; other names are looked up on
  // the resolver thread first (getaddrinfo blocks, and the loop serves every other connection).
  void connect(const std::shared_ptr<Call>& call);
  // The resolver's answer for `call` (kResolved).
  void resolved(const std::shared_ptr<Call>& call);
  // Ends the call: on_done(error), exactly once; on_failure(failure) first when error is not
  // empty (a call that succeeded has no failure: the default is never read).
  void finish(Call& call, const std::string& error, CallFailure failure = CallFailure::kCancelled);
  // The connection finished its call cleanly and may serve another.
  void put_idle(ClientConn* c);
  // The connection is closed: forget it (destroyed at the end of the iteration).
  void remove(ClientConn* c);
  void counted_open();
  void clear_idle();

 private:
  static constexpr int64_t kNameTtlMs = 30000;
  struct KnownName {
    std::vector<Address> addresses;
    int64_t expires_ms = 0;
  };
  void connect_to(const std::shared_ptr<Call>& call, std::vector<Address> addresses);

  CallTable& calls_;
  EventLoop& loop_;
  const AsyncHttpClientOptions& options_;
  util::TaskThread& resolver_;
  std::unordered_map<std::string, KnownName> names_;  // host:port -> its recent lookup
  std::unordered_map<std::string, std::vector<ClientConn*>> idle_;
  std::unordered_map<ClientConn*, std::unique_ptr<ClientConn>> conns_;
};

// One TCP connection to a server. Serves one call at a time; kept alive between calls.
class ClientConn : public IoHandler, public Timer::Target, public Retired {
 public:
  ClientConn(ClientLoop& home, std::string key)
      : home_(home),
        loop_(home.loop()),
        key_(std::move(key)),
        head_parser_(home.options().max_header_bytes),
        timer_(loop_, *this) {}
  ~ClientConn() override {
    if (fd_ >= 0) ::close(fd_);
  }

  const std::string& key() const { return key_; }
  // Connects to the first of `addresses` that takes the connection (a name like localhost may
  // resolve to ::1 and 127.0.0.1, with the server on only one of them), then sends `call`.
  void start_connecting(const std::shared_ptr<Call>& call, std::vector<Address> addresses) {
    addresses_ = std::move(addresses);
    phase_ = Phase::kConnecting;
    attach(call, false);
    connect_next(0);
  }
  // Sends `call`'s request on this (connected or connecting) connection.
  void attach(const std::shared_ptr<Call>& call, bool reused);
  // Closes the connection and ends its call with `error` (if it has one).
  void fail(CallFailure failure, const std::string& error);
  // Closes an idle connection (or one whose call already ended).
  void close();
  bool usable() const { return detail::idle_connection_usable(fd_); }
  // Still connecting: the server has not seen the call.
  bool connecting() const { return phase_ == Phase::kConnecting; }
  void become_idle(std::chrono::steady_clock::time_point now) {
    phase_ = Phase::kIdle;
    idle_since_ = now;
    timer_.disarm();
  }
  std::chrono::steady_clock::time_point idle_since() const { return idle_since_; }

  void on_io(uint32_t events) override;
  void on_timer() override;

 private:
  enum class Phase { kConnecting, kSending, kHead, kBody, kIdle, kClosed };

  void connected();
  // Starts connecting to the next address; false (and the call failed) when none is left.
  // `error` is why the previous one failed.
  bool connect_next(int error);
  void flush();
  void read_input();
  void parse();
  void complete();
  // An I/O failure during `step`: retried on a new connection when it looks like a reused
  // connection the server had closed and sending again cannot run the request twice, else the
  // call fails.
  void io_failed(const char* step, const std::string& why);
  // Runs a handler; an exception fails the call (it is the caller's bug, reported as the error).
  template <class F>
  bool guard(F&& f);

  ClientLoop& home_;
  EventLoop& loop_;
  int fd_ = -1;
  const std::string key_;
  std::vector<Address> addresses_;  // while connecting: where to try, next_address_ onwards
  size_t next_address_ = 0;
  Phase phase_ = Phase::kIdle;
  std::shared_ptr<Call> call_;
  bool reused_ = false;
  bool got_bytes_ = false;  // a byte of the current response arrived
  bool eof_ = false;
  bool read_more_ = false;  // the last read stopped at the buffer cap, not at a drained socket
  // The peer closed its side (EPOLLRDHUP/EPOLLHUP): reads go on until recv says EOF, since the
  // FIN came with the data's edge and no later event will tell of it.
  bool peer_closed_ = false;
  int read_errno_ = 0;
  int send_errno_ = 0;  // the send of the request failed (its answer may still be readable)
  bool head_request_ = false;
  std::chrono::steady_clock::time_point idle_since_{};

  ByteBuffer in_;
  std::string out_;
  size_t written_ = 0;
  bool want_write_ = false;
  HeadParser head_parser_;
  BodyParser body_parser_;
  MessageHead head_;
  ParseError error_;
  std::string piece_;  // the de-chunked body of one read, handed to on_body

  Timer timer_;
};

}  // namespace detail

using detail::Call;
using detail::ClientConn;
using detail::ClientLoop;

// The part every thread reaches: the call table (under mu_) and the loops.
class AsyncHttpClient::Impl : public detail::CallTable {
 public:
  explicit Impl(AsyncHttpClientOptions options)
      : options_(options), own_(std::make_unique<detail::LoopGroup>(1)), group_(*own_) {
    make_loops();
    resolver_.start();
    own_->start({});
  }

  Impl(detail::LoopGroup& shared, AsyncHttpClientOptions options)
      : options_(options), group_(shared) {
    make_loops();
    resolver_.start();
  }

  ~Impl() {
    shutdown();
    if (own_) own_->stop_and_join();
  }

  void shutdown() {
    std::vector<std::shared_ptr<Call>> calls;
    {
      std::lock_guard lock(mu_);
      if (shut_down_) return;
      stopping_ = true;
      for (const auto& [id, call] : calls_) calls.push_back(call);
    }
    // On loops that do not run (a server never started, or already stopped: its threads are
    // joined), nothing else touches the calls: they end here, or shutdown would wait forever.
    const bool running = group_.running();
    for (auto& call : calls) {
      if (running) {
        cancel(*call);
      } else {
        call->cancelled = true;
        call->home->cancel(*call);
      }
    }
    calls.clear();
    {
      std::unique_lock lock(mu_);
      empty_cv_.wait(lock, [&] { return calls_.empty() && calling_ == 0; });
    }
    // Lookups still running finish here; their answers find their calls ended.
    resolver_.stop();
    // Idle connections belong to their loops: closed there, and waited for. A loop that does not
    // run (a server never started, or stopped) is closed from here: nothing else touches it.
    if (used_.load()) {
      for (size_t i = 0; i < loops_.size(); ++i) {
        ClientLoop* l = loops_[i].get();
        if (!group_.running()) {
          l->clear_idle();
          continue;
        }
        std::promise<void> cleared;
        if (group_.at(i).post([l, &cleared] {
              l->clear_idle();
              cleared.set_value();
            })) {
          cleared.get_future().wait();
        } else {
          l->clear_idle();
        }
      }
    }
    std::lock_guard lock(mu_);
    shut_down_ = true;
  }

  CallId start(AsyncHttpRequest request, AsyncHttpHandlers handlers) {
    auto call = std::make_shared<Call>();
    call->request = std::move(request);
    call->handlers = std::move(handlers);
    const size_t loop = group_.pick();
    call->home = loops_[loop].get();
    {
      std::lock_guard lock(mu_);
      if (shut_down_) return 0;
      used_ = true;
      call->id = ++next_id_;
      calls_[call->id] = call;
      if (stopping_) call->cancelled = true;
    }
    const CallId id = call->id;
    // Never run inline, even on the loop's own thread: callers may hold locks on_done takes.
    if (!group_.at(loop).post(call, Call::kStart)) {
      // The loop is gone (its server stopped): the call cannot run.
      call->done = true;
      erase(id);
      try {
        if (call->handlers.on_failure) call->handlers.on_failure(CallFailure::kNotConnected);
        if (call->handlers.on_done) call->handlers.on_done("the client's io thread has stopped");
      } catch (const std::exception&) {
      }
      done_calling();
    }
    return id;
  }

  void cancel(CallId id) {
    std::shared_ptr<Call> call;
    {
      std::lock_guard lock(mu_);
      auto it = calls_.find(id);
      if (it == calls_.end()) return;
      call = it->second;
    }
    cancel(*call);
  }

  void cancel(Call& call) {
    call.cancelled = true;
    call.home->loop().post(call.shared_from_this(), Call::kCancel);
  }

  size_t in_flight() const {
    std::lock_guard lock(mu_);
    return calls_.size();
  }
  uint64_t connections_opened() const { return opened_; }

 private:
  void make_loops() {
    for (size_t i = 0; i < group_.size(); ++i) {
      loops_.push_back(std::make_unique<ClientLoop>(*this, group_.at(i), options_, resolver_));
    }
  }

  const AsyncHttpClientOptions options_;
  std::unique_ptr<detail::LoopGroup> own_;  // none when running on a server's threads
  detail::LoopGroup& group_;
  std::vector<std::unique_ptr<ClientLoop>> loops_;  // one per loop of group_
  util::TaskThread resolver_{"resolve"};            // getaddrinfo, off the loops
  CallId next_id_ = 0;
  bool stopping_ = false, shut_down_ = false;
  std::atomic<bool> used_{false};  // a call was ever started
};

namespace detail {

void Call::run(int op) {
  // A task queued for a call that already ended (a late cancel) must not touch the client, which
  // may be gone by now.
  if (done) return;
  if (op == kStart) {
    home->begin(shared_from_this());
  } else if (op == kResolved) {
    home->resolved(shared_from_this());
  } else {
    home->cancel(*this);
  }
}

// --- ClientLoop --------------------------------------------------------------------------------

void ClientLoop::begin(const std::shared_ptr<Call>& call) {
  if (call->cancelled) return finish(*call, "cancelled", CallFailure::kNotConnected);
  const AsyncHttpRequest& r = call->request;
  std::string key = r.host + ":" + std::to_string(r.port);
  auto it = idle_.find(key);
  while (it != idle_.end() && !it->second.empty()) {
    ClientConn* c = it->second.back();
    it->second.pop_back();
    // A connection the server closed since its last event, or may be closing about now (its
    // keep-alive timeout): dropped, because once a POST went out whole on it, it would not be
    // sent again. The peek sees a close that arrived; the age keeps clear of one on its way.
    const bool young =
        options_.max_idle_age.count() <= 0 || now() - c->idle_since() < options_.max_idle_age;
    if (young && c->usable()) {
      c->attach(call, true);
      return;
    }
    c->close();
  }
  connect(call);
}

void ClientLoop::connect(const std::shared_ptr<Call>& call) {
  const AsyncHttpRequest& r = call->request;
  if (std::optional<Address> numeric = numeric_address(r.host, r.port))
    return connect_to(call, {*numeric});
  const std::string key = r.host + ":" + std::to_string(r.port);
  if (auto it = names_.find(key); it != names_.end() && loop_.now_ms() < it->second.expires_ms)
    return connect_to(call, it->second.addresses);
  // The answer comes back as a task of this loop; shutdown() joins the resolver before the
  // loops stop, so the task finds this loop.
  resolver_.post([call] {
    call->addresses = resolve(call->request.host, call->request.port, false, call->resolve_error);
    call->home->loop().post(call, Call::kResolved);
  });
}

void ClientLoop::resolved(const std::shared_ptr<Call>& call) {
  const AsyncHttpRequest& r = call->request;
  if (call->cancelled) return finish(*call, "cancelled", CallFailure::kNotConnected);
  if (call->addresses.empty())
    return finish(*call, "cannot resolve the host: " + call->resolve_error,
                  CallFailure::kNotConnected);
  names_[r.host + ":" + std::to_string(r.port)] = {call->addresses, loop_.now_ms() + kNameTtlMs};
  connect_to(call, std::move(call->addresses));
}

void ClientLoop::connect_to(const std::shared_ptr<Call>& call, std::vector<Address> addresses) {
  const AsyncHttpRequest& r = call->request;
  auto conn = std::make_unique<ClientConn>(*this, r.host + ":" + std::to_string(r.port));
  ClientConn* c = conn.get();
  conns_.emplace(c, std::move(conn));
  c->start_connecting(call, std::move(addresses));
}

void ClientLoop::cancel(Call& call) {
  if (call.done) return;
  // The server sees the client go. A call cancelled before its connection was made never
  // reached the server, which its caller may need to know (a gateway frees what the request
  // would have taken over there).
  if (call.conn)
    return call.conn->fail(
        call.conn->connecting() ? CallFailure::kNotConnected : CallFailure::kCancelled,
        "cancelled");
  finish(call, "cancelled", CallFailure::kNotConnected);  // its host's name was being looked up
}

void ClientLoop::finish(Call& call, const std::string& error, CallFailure failure) {
  if (call.done) return;
  call.done = true;
  call.conn = nullptr;
  calls_.erase(call.id);
  try {
    if (!error.empty() && call.handlers.on_failure) call.handlers.on_failure(failure);
    if (call.handlers.on_done) call.handlers.on_done(error);
  } catch (const std::exception&) {
    // The caller's bug, not the call's: the call is over either way.
  }
  // What the handlers hold (the caller's state) goes now, not when the last task lets go.
  call.handlers = AsyncHttpHandlers();
  calls_.done_calling();
}

void ClientLoop::put_idle(ClientConn* c) {
  auto& list = idle_[c->key()];
  if (list.size() >= options_.max_idle_per_host) return c->close();
  c->become_idle(now());
  list.push_back(c);
}

void ClientLoop::remove(ClientConn* c) {
  auto it = idle_.find(c->key());
  if (it != idle_.end()) std::erase(it->second, c);
  auto owned = conns_.find(c);
  if (owned == conns_.end()) return;
  loop_.retire(std::move(owned->second));
  conns_.erase(owned);
}

void ClientLoop::counted_open() {
  calls_.count_open();
}

void ClientLoop::clear_idle() {
  std::vector<ClientConn*> idle;
  for (auto& [key, list] : idle_) idle.insert(idle.end(), list.begin(), list.end());
  for (ClientConn* c : idle) c->close();
  idle_.clear();
}

// --- ClientConn --------------------------------------------------------------------------------

template <class F>
bool ClientConn::guard(F&& f) {
  try {
    f();
    return true;
  } catch (const std::exception& e) {
    fail(CallFailure::kAnswerBroken, e.what());
  } catch (...) {
    fail(CallFailure::kAnswerBroken, "a callback threw a non-standard exception");
  }
  return false;
}

void ClientConn::attach(const std::shared_ptr<Call>& call, bool reused) {
  call_ = call;
  call->conn = this;
  reused_ = reused;
  got_bytes_ = false;
  send_errno_ = 0;
  const AsyncHttpRequest& r = call->request;
  head_request_ = r.method == "HEAD";
  out_.clear();
  written_ = 0;
  append_request(out_, r.method, r.target, r.host, r.port, r.headers, r.body);
  head_parser_.reset();
  if (phase_ == Phase::kConnecting) {
    timer_.arm(r.connect_timeout.count() > 0 ? r.connect_timeout : r.timeout);
    return;  // sent once connected
  }
  phase_ = Phase::kSending;
  timer_.arm(r.timeout);
  flush();
}

void ClientConn::on_io(uint32_t events) {
  switch (phase_) {
    case Phase::kClosed:
      return;
    case Phase::kConnecting:
      if (events & (EPOLLOUT | EPOLLERR | EPOLLHUP)) connected();
      // A server that answered and closed at once did so in this same edge: read it now.
      if (phase_ == Phase::kConnecting || phase_ == Phase::kClosed) return;
      break;
    case Phase::kIdle:
      // The server closed the idle connection (or sent what nobody asked for): drop it now,
      // rather than find out when the next call tries it.
      if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
        char byte;
        ssize_t n = ::recv(fd_, &byte, 1, MSG_PEEK);
        if (n >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) close();
      }
      return;
    default:
      break;
  }
  if (events & (EPOLLRDHUP | EPOLLHUP)) peer_closed_ = true;
  if ((events & EPOLLOUT) && want_write_) flush();
  if (phase_ == Phase::kClosed) return;
  if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
    read_input();
    parse();
  }
}

bool ClientConn::connect_next(int error) {
  while (next_address_ < addresses_.size()) {
    if (fd_ >= 0) ::close(fd_);  // also unregisters it from epoll
    fd_ = start_connect(addresses_[next_address_++]);
    if (fd_ >= 0) {
      loop_.add(fd_, this);
      return true;
    }
    error = errno;
  }
  fail(CallFailure::kNotConnected, std::string("cannot connect: ") + std::strerror(error));
  return false;
}

void ClientConn::connected() {
  int error = 0;
  socklen_t length = sizeof error;
  if (::getsockopt(fd_, SOL_SOCKET, SO_ERROR, &error, &length) != 0) error = errno;
  if (error != 0) {
    connect_next(error);
    return;
  }
  addresses_.clear();
  home_.counted_open();
  phase_ = Phase::kSending;
  timer_.arm(call_->request.timeout);
  flush();
}

void ClientConn::flush() {
  if (const int err = send_pending(fd_, out_, written_)) {
    if (err == EAGAIN) {
      want_write_ = true;
      return;
    }
    want_write_ = false;
    send_errno_ = err;
    // A server that refused the request from its head may have answered, then closed without
    // reading the rest: that answer is the call's outcome, not the failed send.
    read_input();
    parse();
    if (call_ && (phase_ == Phase::kSending || phase_ == Phase::kHead)) {
      io_failed("cannot send the request", std::strerror(err));
    }
    return;
  }
  want_write_ = false;
  if (phase_ == Phase::kSending) {
    phase_ = Phase::kHead;
    timer_.arm(call_->request.timeout);
  }
}

void ClientConn::read_input() {
  read_more_ = false;
  if (eof_) return;
  for (;;) {
    char* at = in_.prepare(kReadChunk);
    const size_t room = in_.room();
    ssize_t n = ::recv(fd_, at, room, 0);
    if (n > 0) {
      in_.commit(static_cast<size_t>(n));
      got_bytes_ = true;
      // A short read drained the socket; a full one may have left more. Parsing comes first
      // either way when enough is buffered, so a fast server cannot grow the buffer unbounded.
      // Drained with the peer closed, only the next recv sees the EOF.
      if (static_cast<size_t>(n) < room && !peer_closed_) return;
      if (in_.size() >= 4 * kReadChunk) {
        read_more_ = true;  // edge-triggered: nothing tells us again about what is left
        return;
      }
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    eof_ = true;
    read_errno_ = n < 0 ? errno : 0;
    return;
  }
}

void ClientConn::parse() {
  for (;;) {
    if (phase_ == Phase::kSending || phase_ == Phase::kHead) {
      Parse r = head_parser_.response(in_.view(), head_request_, head_, error_);
      if (r == Parse::kError)
        return fail(CallFailure::kAnswerBroken,
                    "cannot read the response header: " + error_.message);
      if (r == Parse::kNeedMore) {
        if (eof_) {
          if (send_errno_) return io_failed("cannot send the request", std::strerror(send_errno_));
          return io_failed(
              "cannot read the response header",
              read_errno_ ? std::strerror(read_errno_) : "connection closed by the server");
        }
        if (!read_more_) return;
        read_input();
        continue;
      }
      // The client never asks for an upgrade: after a 101 the connection speaks something else,
      // and no HTTP answer follows on it.
      if (head_.status == 101)
        return fail(CallFailure::kAnswerBroken, "the server switched protocols (HTTP 101) unasked");
      if (head_.status < 200) {
        // An interim response (100 Continue): the real one follows.
        in_.consume(head_.head_bytes);
        head_parser_.reset();
        continue;
      }
      // A final answer that came before the whole request went out (an engine refusing a large
      // body from its head): the rest is not sent (RFC 9112 9.3), and complete() will not reuse
      // the connection, whose peer would read the next request as the rest of this body.
      if (written_ < out_.size()) want_write_ = false;
      if (call_->handlers.on_head) {
        Headers headers;
        copy_fields(head_, headers);
        if (!guard([&] { call_->handlers.on_head(head_.status, headers); })) return;
      }
      in_.consume(head_.head_bytes);
      body_parser_.start(head_, UINT64_MAX, home_.options().max_header_bytes);
      phase_ = Phase::kBody;
      timer_.arm(call_->request.timeout);
      if (call_->cancelled) return fail(CallFailure::kCancelled, "cancelled");
    }
    if (phase_ != Phase::kBody) return;
    size_t used = 0;
    Parse r = body_parser_.feed(in_.view(), used, piece_, error_);
    in_.consume(used);
    if (!piece_.empty()) {
      bool more = true;
      if (call_->handlers.on_body && !guard([&] { more = call_->handlers.on_body(piece_); })) {
        return;
      }
      piece_.clear();
      if (!more) call_->cancelled = true;
    }
    if (call_->cancelled) return fail(CallFailure::kCancelled, "cancelled");
    if (r == Parse::kError)
      return fail(CallFailure::kAnswerBroken, "cannot read the response body: " + error_.message);
    if (r == Parse::kDone) return complete();
    if (eof_) {
      // A close ends such a body; a reset or read error cut it.
      if (head_.body == BodyKind::kUntilClose && read_errno_ == 0) return complete();
      return fail(
          CallFailure::kAnswerBroken,
          std::string("cannot read the response body: ") +
              (read_errno_ ? std::strerror(read_errno_) : "connection closed by the server"));
    }
    timer_.arm(call_->request.timeout);  // each wait for the next piece is bounded
    if (!read_more_) return;
    read_input();
  }
}

void ClientConn::complete() {
  std::shared_ptr<Call> call = std::move(call_);
  call->conn = nullptr;
  const bool reuse = head_.keep_alive && in_.empty() && !eof_ && written_ == out_.size();
  if (reuse) {
    home_.put_idle(this);
  } else {
    close();
  }
  home_.finish(*call, "");
}

void ClientConn::io_failed(const char* step, const std::string& why) {
  // A reused connection the server closed while it was idle fails before any response byte. The
  // request is sent once more on a new connection when the server cannot have got it whole (the
  // send failed before its end) or getting it twice is harmless (an idempotent method). A POST
  // that went out whole may have reached the engine even so (a send only fills the socket
  // buffer): sent again it would generate twice, or prefill twice into one bootstrap room, past
  // the gateway's counted retries. It fails instead, and the caller decides (the gateway retries
  // it on another engine while --prefill-retries allow).
  const bool resend = call_ && !call_->retried && !call_->cancelled && reused_ && !got_bytes_ &&
                      (written_ < out_.size() || idempotent_method(call_->request.method));
  if (!resend) return fail(CallFailure::kUnanswered, std::string(step) + ": " + why);
  std::shared_ptr<Call> call = std::move(call_);
  call->conn = nullptr;
  call->retried = true;
  close();
  home_.connect(call);
}

void ClientConn::on_timer() {
  const char* step = "cannot read the response body";
  CallFailure failure = CallFailure::kAnswerBroken;
  switch (phase_) {
    case Phase::kConnecting:
      step = "cannot connect";
      failure = CallFailure::kNotConnected;
      break;
    case Phase::kSending:
      step = "cannot send the request";
      failure = CallFailure::kUnanswered;
      break;
    case Phase::kHead:
      step = "cannot read the response header";
      failure = CallFailure::kUnanswered;
      break;
    default:
      break;
  }
  fail(failure, std::string(step) + ": timed out");
}

void ClientConn::fail(CallFailure failure, const std::string& error) {
  std::shared_ptr<Call> call = std::move(call_);
  close();  // a failed or cancelled connection is never reused
  if (call) home_.finish(*call, error, failure);
}

void ClientConn::close() {
  if (phase_ == Phase::kClosed) return;
  phase_ = Phase::kClosed;
  timer_.disarm();
  if (fd_ >= 0) ::close(fd_);  // also unregisters it from epoll
  fd_ = -1;
  if (call_) call_->conn = nullptr;
  home_.remove(this);
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------

AsyncHttpClient::AsyncHttpClient(AsyncHttpClientOptions options)
    : impl_(std::make_unique<Impl>(options)) {}
AsyncHttpClient::AsyncHttpClient(HttpServer& server, AsyncHttpClientOptions options)
    : impl_(std::make_unique<Impl>(server.loops(), options)) {}
AsyncHttpClient::~AsyncHttpClient() = default;
void AsyncHttpClient::shutdown() {
  impl_->shutdown();
}

AsyncHttpClient::CallId AsyncHttpClient::start(AsyncHttpRequest request,
                                               AsyncHttpHandlers handlers) {
  return impl_->start(std::move(request), std::move(handlers));
}
void AsyncHttpClient::cancel(CallId id) {
  impl_->cancel(id);
}
size_t AsyncHttpClient::in_flight() const {
  return impl_->in_flight();
}
uint64_t AsyncHttpClient::connections_opened() const {
  return impl_->connections_opened();
}

}  // namespace tandem::net
