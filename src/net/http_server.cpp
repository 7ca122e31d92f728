#include "net/http_server.h"

#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "net/body_read_deadline.h"
#include "net/byte_buffer.h"
#include "net/event_loop.h"
#include "net/http_wire.h"
#include "net/loop_group.h"
#include "net/socket.h"
#include "util/error.h"
#include "util/log_throttle.h"

namespace tandem::net {

using Callbacks = std::vector<std::function<void()>>;

namespace {

// Bytes asked of the kernel per read. A shorter answer means the socket is drained (so, with
// edge-triggered epoll, no read that only says EAGAIN).
constexpr size_t kReadChunk = 16384;
// After an error answer the connection drains the client's input this long, or this much, before
// it closes.
constexpr std::chrono::milliseconds kDrainTime{2000};
constexpr size_t kDrainBytes = size_t{1} << 20;
// What a request waiting for its answer may hold beyond its body: a larger read buffer (grown by
// a large body's reads) is given back, and so is a larger spare capacity of the body (a chunked
// body grows by doubling). Waiting may be long (a gateway's queue), and each waiting request
// would keep them.
constexpr size_t kKeptSlackBytes = size_t{64} << 10;

void check_status(int status) {
  if (status < 200 || status > 999) {
    throw Error("HTTP response status " + std::to_string(status) +
                " is not a final status (expected 200..999)");
  }
}

// `head_only`: the answer to a HEAD request, whose head says what a GET would get but which
// carries no body.
// `headers`: r's, or a copy of them with more.
void append_response(std::string& out, const HttpResponse& r, const Headers& headers, bool close,
                     bool keep_alive_10, bool head_only = false) {
  std::string_view connection = close ? "close" : (keep_alive_10 ? "keep-alive" : "");
  if (!detail::status_has_body(r.status)) {
    detail::append_response_head(out, r.status, r.content_type, headers, detail::BodyKind::kNone, 0,
                                 connection);
    return;
  }
  detail::append_response_head(out, r.status, r.content_type, headers, detail::BodyKind::kLength,
                               r.body.size(), connection);
  if (!head_only) out += r.body;
}

// `headers` with the CORS answer for a request from a browser page of origin... (`allow_origin`
// non-empty, as ServerImpl::allow_origin gave it).
Headers with_cors(const Headers& headers, const std::string& allow_origin) {
  Headers out = headers;
  if (!out.contains("Access-Control-Allow-Origin")) {
    out.set("Access-Control-Allow-Origin", allow_origin);
    // The answer depends on the page's origin: caches must not give it to another.
    if (allow_origin != "*") out.add("Vary", "Origin");
  }
  return out;
}

// `allow_origin`: as ExchangeState's (empty: no CORS header).
void append_error(std::string& out, ErrorFormatter format, int status, std::string_view message,
                  bool close, bool keep_alive_10, const std::string& allow_origin) {
  const HttpResponse r = format(status, message, {}, {});
  append_response(out, r, allow_origin.empty() ? r.headers : with_cors(r.headers, allow_origin),
                  close, keep_alive_10);
}

// The count of connections per address a server with `options` keeps: the shared one, or its own
// for max_connections_per_address; null without a limit.
std::shared_ptr<ConnectionsPerAddress> per_address_count(const HttpServerOptions& options) {
  if (options.connections_per_address) return options.connections_per_address;
  if (options.max_connections_per_address == 0) return nullptr;
  return std::make_shared<ConnectionsPerAddress>(options.max_connections_per_address);
}

void run_callbacks(Callbacks& callbacks) {
  for (auto& callback : callbacks) {
    if (callback) callback();
  }
}

}  // namespace

std::optional<size_t> descriptor_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY)
    return std::nullopt;
  return static_cast<size_t>(limit.rlim_cur);
}

size_t default_max_connections(std::optional<size_t> limit) {
  if (!limit) return size_t{1} << 20;
  return std::max<size_t>(16, *limit / 4 * 3);
}

std::string allowed_origin_error(std::string_view origin) {
  // "null": the Origin a browser sends from a file:// page or a sandboxed iframe.
  if (origin == "*" || origin == "null") return {};
  const size_t scheme_end = origin.find("://");
  if (scheme_end == std::string_view::npos || scheme_end == 0 || scheme_end + 3 == origin.size())
    return "expected an origin such as https://app.example.com (scheme://host[:port]), null "
           "or *";
  for (const char c : origin)
    if (static_cast<unsigned char>(c) <= ' ' || c == 0x7f || c == ',')
      return "an origin has no spaces, commas or control characters";
  if (origin.find_first_of("/?#", scheme_end + 3) != std::string_view::npos)
    return "an origin is scheme://host[:port] without a path (a page's Origin never has one)";
  return {};
}

std::vector<std::string> parse_allowed_origins(std::string_view value) {
  std::vector<std::string> origins;
  const size_t first = value.find_first_not_of(" \t");
  if (first != std::string_view::npos && value[first] == '[') {
    // vLLM's form: --allowed-origins '["https://app.example.com"]'.
    nlohmann::json list;
    try {
      list = nlohmann::json::parse(value);
    } catch (const std::exception&) {
      throw Error("expected origins separated by commas or a JSON list of origins, got '" +
                  std::string(value) + "'");
    }
    if (!list.is_array()) throw Error("expected a JSON list of origins");
    for (const auto& origin : list) {
      if (!origin.is_string())
        throw Error("expected a JSON list of origins (strings), got " + origin.dump());
      origins.push_back(origin.get<std::string>());
    }
  } else {
    for (size_t begin = 0; begin <= value.size() && !value.empty();) {
      size_t end = value.find(',', begin);
      if (end == std::string_view::npos) end = value.size();
      std::string_view origin = value.substr(begin, end - begin);
      while (!origin.empty() && origin.front() == ' ') origin.remove_prefix(1);
      while (!origin.empty() && origin.back() == ' ') origin.remove_suffix(1);
      origins.emplace_back(origin);
      begin = end + 1;
    }
  }
  for (const std::string& origin : origins)
    if (std::string why = allowed_origin_error(origin); !why.empty())
      throw Error("'" + origin + "': " + why);
  return origins;
}

bool ConnectionsPerAddress::admit(const std::string& address) {
  if (limit_ == 0) return true;
  std::lock_guard lock(mu_);
  // Found, not inserted, before the check: a refusal leaves no entry for its address.
  const auto it = held_.find(address);
  if (it == held_.end()) {
    held_.emplace(address, 1);
    return true;
  }
  if (it->second >= limit_) return false;
  ++it->second;
  return true;
}

void ConnectionsPerAddress::release(const std::string& address) {
  std::lock_guard lock(mu_);
  auto it = held_.find(address);
  if (it != held_.end() && --it->second == 0) held_.erase(it);
}

size_t ConnectionsPerAddress::addresses() const {
  std::lock_guard lock(mu_);
  return held_.size();
}

namespace detail {

class Connection;

// What an Exchange and the connection serving it share. Producers (Exchange methods, any thread)
// append response bytes to out_ under mu_; the connection, on its loop, swaps them out and writes
// them. Callbacks never run under mu_, so they may call back into the exchange.
class ExchangeState : public Task, public std::enable_shared_from_this<ExchangeState> {
 public:
  // `allow_origin`: the Access-Control-Allow-Origin of every answer (empty: none).
  ExchangeState(HttpRequest request, bool keep_alive, EventLoop& loop, Connection& connection,
                std::string buffer, ErrorFormatter format_error, size_t max_unsent,
                std::string allow_origin)
      : request(std::move(request)),
        format_error(format_error),
        max_unsent_(max_unsent),
        allow_origin_(std::move(allow_origin)),
        keep_alive_(keep_alive),
        http10_(this->request.version < 11),
        head_only_(this->request.method == "HEAD"),
        loop_(&loop),
        connection_(&connection),
        out_(std::move(buffer)) {}

  HttpRequest request;  // changed by Exchange::take_body() only
  const ErrorFormatter format_error;

  // --- producer side (any thread) ---

  bool respond(const HttpResponse& response) {
    check_status(response.status);
    // The producer's `Connection: close` (a stopping gateway's refusal) ends the connection
    // after this response: a keep-alive client reconnects, elsewhere, for its next request.
    const std::string* connection = response.headers.find("Connection");
    const bool close = !keep_alive_ || (connection && iequals(*connection, "close"));
    Callbacks dropped;  // destroyed after the lock: they may hold the last exchange reference
    std::lock_guard lock(mu_);
    if (closed_locked() || phase_ != Phase::kIdle) return false;
    append_whole_locked(response, close);
    phase_ = Phase::kComplete;
    close_after_ = close;
    dropped.swap(on_close_);
    wake_locked();
    return true;
  }

  bool start_stream(int status, std::string_view content_type, const Headers& headers) {
    check_status(status);
    // HTTP/1.0 has no chunked encoding: the body runs until the connection closes.
    const bool chunked = !http10_;
    const bool close = !keep_alive_ || !chunked;
    std::lock_guard lock(mu_);
    if (closed_locked() || phase_ != Phase::kIdle) return false;
    const bool body = status_has_body(status);
    append_response_head(out_, status, content_type,
                         allow_origin_.empty() ? headers : with_cors(headers, allow_origin_),
                         chunked && body ? BodyKind::kChunked : BodyKind::kNone, 0,
                         close ? "close" : (http10_ ? "keep-alive" : ""));
    phase_ = body ? Phase::kStreaming : Phase::kComplete;
    chunked_ = chunked;
    close_after_ = close;
    wake_locked();
    return true;
  }

  bool write(std::string_view chunk) {
    std::lock_guard lock(mu_);
    if (closed_locked() || phase_ != Phase::kStreaming) return false;
    if (chunk.empty() || head_only_) return true;  // an empty chunk would end a chunked body
    const size_t unsent = out_.size() + sending_.load(std::memory_order_relaxed);
    if (unsent > 0 && unsent + chunk.size() > max_unsent_) {
      // The client does not read: holding more would let it pin the producer's whole output in
      // our memory until the write timeout. Its connection is cut on its loop, where the
      // callbacks run (the caller may hold locks they take).
      stalled_ = true;
      out_ = std::string();
      wake_posted_ = false;  // the wake still queued may have been spent on a blocked write
      wake_locked();
      return false;
    }
    if (chunked_) {
      append_chunk(out_, chunk);
    } else {
      out_ += chunk;
    }
    wake_locked();
    return true;
  }

  bool end() {
    Callbacks dropped;
    std::lock_guard lock(mu_);
    if (closed_locked() || phase_ != Phase::kStreaming) return false;
    if (chunked_ && !head_only_) out_ += kLastChunk;
    phase_ = Phase::kComplete;
    dropped.swap(on_close_);
    wake_locked();
    return true;
  }

  bool closed() const {
    std::lock_guard lock(mu_);
    return closed_locked();
  }

  bool complete() const {
    std::lock_guard lock(mu_);
    return phase_ == Phase::kComplete;
  }

  void on_close(std::function<void()> callback) {
    {
      std::lock_guard lock(mu_);
      if (!closed_locked()) {
        if (phase_ != Phase::kComplete) on_close_.push_back(std::move(callback));
        return;
      }
    }
    if (callback) callback();
  }

  // The producer gave up (or the handler threw): answer 500 if nothing was sent, else cut the
  // connection. The callbacks run on the connection's loop, not here: the caller may hold locks
  // that they take.
  void abort(std::string_view message) {
    std::lock_guard lock(mu_);
    if (closed_locked() || phase_ == Phase::kComplete) return;
    aborted_ = true;
    if (phase_ == Phase::kIdle) {
      append_whole_locked(format_error(500, message, {}, {}), !keep_alive_);
      phase_ = Phase::kComplete;
      close_after_ = !keep_alive_;
    }
    wake_locked();
  }

  // --- connection side (its loop) ---

  struct Pending {
    bool complete = false;     // the response is complete (once its bytes are written)
    bool cut = false;          // aborted mid-stream: close the connection
    bool close_after = false;  // close the connection after the response
    Callbacks callbacks;       // to run now (aborted)
  };

  // Swaps the queued bytes into `bytes`, which must be empty; it gets the state's buffer, the
  // state gets `bytes`' capacity, so no allocation happens in steady state.
  Pending take(std::string& bytes) {
    std::lock_guard lock(mu_);
    Pending p;
    bytes.swap(out_);
    sending_.store(bytes.size(), std::memory_order_relaxed);
    p.complete = phase_ == Phase::kComplete;
    p.cut = aborted_ && phase_ != Phase::kComplete;
    p.close_after = close_after_;
    if (aborted_) p.callbacks.swap(on_close_);
    wake_posted_ = false;
    return p;
  }

  // The connection still has `bytes` of this exchange's output to write.
  void sending(size_t bytes) { sending_.store(bytes, std::memory_order_relaxed); }

  // A write went past max_unsent_bytes: the connection must be cut (then lose()).
  bool stalled() const {
    std::lock_guard lock(mu_);
    return stalled_;
  }

  // The client is gone, a write failed or the server stops.
  void lose() {
    Callbacks callbacks;
    {
      std::lock_guard lock(mu_);
      if (lost_) return;
      lost_ = true;
      out_.clear();
      callbacks.swap(on_close_);
    }
    run_callbacks(callbacks);
  }

  // The connection is done with this exchange; returns its buffer (cleared) for the next one.
  // From now on nothing reaches the loop or the connection.
  std::string detach() {
    std::lock_guard lock(mu_);
    detached_ = true;
    out_.clear();
    return std::move(out_);
  }

  // A wake posted from another thread (Task).
  void run(int op) override;

 private:
  enum class Phase { kIdle, kStreaming, kComplete };

  bool closed_locked() const { return lost_ || aborted_ || stalled_; }
  void wake_locked();
  // Every whole response of the exchange goes through here, so that a HEAD gets no body on any
  // path (a body would be read as the next response by a keep-alive client).
  void append_whole_locked(const HttpResponse& response, bool close) {
    append_response(
        out_, response,
        allow_origin_.empty() ? response.headers : with_cors(response.headers, allow_origin_),
        close, http10_ && keep_alive_, head_only_);
  }

  const size_t max_unsent_;
  const std::string allow_origin_;
  const bool keep_alive_;
  const bool http10_;
  const bool head_only_;          // a HEAD request: the response's head goes out, its body does not
  EventLoop* const loop_;         // valid until detached
  Connection* const connection_;  // valid until detached; used on the loop only

  mutable std::mutex mu_;
  Phase phase_ = Phase::kIdle;
  bool chunked_ = false;
  bool close_after_ = false;
  bool aborted_ = false;
  bool lost_ = false;
  bool stalled_ = false;  // the client read too slowly (max_unsent_bytes)
  bool detached_ = false;
  bool wake_posted_ = false;  // a wake is queued and take() has not run since
  std::string out_;
  // Bytes the connection took and has not written yet: with out_, what the client has not got.
  // Written by the connection (its loop), read by producers.
  std::atomic<size_t> sending_{0};
  Callbacks on_close_;
};

}  // namespace detail

using detail::ExchangeState;

// ---------------------------------------------------------------------------------------------
// Exchange

Exchange::Exchange(std::shared_ptr<detail::ExchangeState> state) : state_(std::move(state)) {}

Exchange::~Exchange() {
  state_->abort("the server did not produce a response");
}

const HttpRequest& Exchange::request() const {
  return state_->request;
}

std::string Exchange::take_body() {
  return std::exchange(state_->request.body, std::string());
}

bool Exchange::respond(HttpResponse response) {
  return state_->respond(response);
}

bool Exchange::respond(int status, std::string body, std::string content_type) {
  HttpResponse r;
  r.status = status;
  r.body = std::move(body);
  r.content_type = std::move(content_type);
  return state_->respond(r);
}

bool Exchange::send_error(int status, std::string_view message, std::string_view type,
                          std::string_view code) {
  return respond(state_->format_error(status, message, type, code));
}

bool Exchange::start_stream(int status, std::string content_type, Headers headers) {
  return state_->start_stream(status, content_type, headers);
}

bool Exchange::write(std::string_view chunk) {
  return state_->write(chunk);
}

bool Exchange::end() {
  return state_->end();
}

bool Exchange::closed() const {
  return state_->closed();
}

void Exchange::on_close(std::function<void()> callback) {
  state_->on_close(std::move(callback));
}

bool Exchange::complete() const {
  return state_->complete();
}

void Exchange::abort() {
  state_->abort("the request was aborted by the server");
}

// ---------------------------------------------------------------------------------------------
// Server internals

namespace detail {

class ServerLoop;

class ServerImpl {
 public:
  explicit ServerImpl(HttpServerOptions options)
      : options_(std::move(options)),
        max_body_time_(total_body_time(options_.max_body_time, options_.max_body_bytes)),
        per_address_(per_address_count(options_)),
        loops_(static_cast<size_t>(std::max(1, options_.threads))) {}
  ~ServerImpl() { stop(std::chrono::milliseconds::zero()); }

  void route(std::string method, std::string path, Handler handler);
  void route_prefix(std::string method, std::string prefix, Handler handler);
  void start();
  void stop(std::chrono::milliseconds flush);
  void end_flush();
  uint16_t port() const { return port_; }
  size_t max_connections() const { return max_connections_; }
  LoopGroup& loops() { return loops_; }

  // --- for connections ---

  const HttpServerOptions& options() const { return options_; }
  // The total bound on a body's time: options().max_body_time, scaled up to max_body_bytes
  // (total_body_time).
  std::chrono::milliseconds max_body_time() const { return max_body_time_; }
  void log(const std::string& message) const {
    if (options_.log) {
      options_.log(message);
    } else {
      std::fprintf(stderr, "tandem http: %s\n", message.c_str());
    }
  }
  // Calls the handler for the request, or answers 404/405/501 or a CORS preflight itself.
  void dispatch(const HttpRequest& request, const std::shared_ptr<Exchange>& exchange);
  // The Access-Control-Allow-Origin for the answers to `request`: empty unless it came from a
  // browser page (Origin) of an allowed origin; "*" when any origin is.
  std::string allow_origin(const HttpRequest& request) const {
    const std::string* origin = request.headers.find("Origin");
    if (!origin) return {};
    const auto& allowed = options_.allowed_origins;
    if (std::find(allowed.begin(), allowed.end(), "*") != allowed.end()) return "*";
    if (std::find(allowed.begin(), allowed.end(), *origin) != allowed.end()) return *origin;
    return {};
  }
  bool stopping() const { return stopping_.load(std::memory_order_acquire); }
  // A connection from `address` was accepted: false (and the caller closes it) when the cap, or
  // the address's own cap, is reached.
  bool admit_connection(const std::string& address);
  void connection_closed(const std::string& address);
  // A new connection could not be taken (out of file descriptors, memory and the like): `why`.
  void connection_failed(const std::string& why);
  // A loop that was told to finish has closed its last connection (ServerLoop::finish).
  void loop_finished();

 private:
  const HttpServerOptions options_;
  const std::chrono::milliseconds max_body_time_;
  using Methods = std::map<std::string, Handler>;  // method -> handler
  // The routes of `path`: its own, else those of the longest prefix it is under; null if none.
  const Methods* routes_of(const std::string& path) const;

  // Written before start() only, then read by every io thread.
  std::map<std::string, Methods> routes_;         // path -> its routes
  std::map<std::string, Methods> prefix_routes_;  // prefix -> the routes of the paths under it
  std::atomic<uint16_t> port_{0};
  size_t max_connections_ = 0;  // resolved at start()
  std::atomic<size_t> open_connections_{0};
  // Connections per peer address, shared or the server's own; null without a per-address limit.
  const std::shared_ptr<ConnectionsPerAddress> per_address_;
  // Strangers can repeat these at will: at most one log line per interval each.
  LogThrottle cap_log_{std::chrono::seconds(10)};
  LogThrottle address_cap_log_{std::chrono::seconds(10)};
  LogThrottle accept_log_{std::chrono::seconds(10)};

  LoopGroup loops_;
  std::vector<std::unique_ptr<ServerLoop>> server_loops_;
  int listen_fd_ = -1;
  std::mutex stop_mu_;  // serialises start/stop
  bool started_ = false;
  bool stopped_ = false;
  std::atomic<bool> stopping_{false};
  // What ends stop()'s flush, besides its time: every loop finished, or end_flush().
  std::mutex flush_mu_;
  std::condition_variable flush_changed_;
  size_t loops_finished_ = 0;  // under flush_mu_
  bool flush_ended_ = false;   // under flush_mu_
};

// The server's part of one loop: its listener registration and its connections. Loop thread
// only, except construction and destruction (before the thread starts, after it ended).
class ServerLoop final : public IoHandler, public Timer::Target {
 public:
  ServerLoop(ServerImpl& server, EventLoop& loop, int listen_fd)
      : server_(server), loop_(loop), listen_fd_(listen_fd) {}
  ~ServerLoop();

  void start() { loop_.add_listener(listen_fd_, this); }
  // Accepts what is waiting on the listener.
  void on_io(uint32_t events) override;
  // The accept back-off ended.
  void on_timer() override;
  // The server stops: stops accepting and ends every connection, those with a complete response
  // to write once it is written (Connection::finish); tells the server when the last is gone.
  void finish();
  // Closes every connection now (their exchanges become closed) and stops accepting.
  void shutdown();
  void remove(Connection* c);

  ServerImpl& server() { return server_; }
  EventLoop& loop() { return loop_; }

 private:
  ServerImpl& server_;
  EventLoop& loop_;
  const int listen_fd_;
  bool listening_ = true;
  bool finishing_ = false;  // finish() ran: the server hears when no connection is left
  std::unique_ptr<Timer> backoff_;
  std::unordered_map<Connection*, std::unique_ptr<Connection>> connections_;
};

// One TCP connection: reads requests one after the other, dispatches each and writes what its
// exchange produces, on its loop's thread only.
class Connection : public IoHandler, public Deferred, public Timer::Target, public Retired {
 public:
  Connection(ServerLoop& owner, int fd, std::string remote_address, unsigned short remote_port)
      : owner_(owner),
        server_(owner.server()),
        loop_(owner.loop()),
        fd_(fd),
        head_parser_(server_.options().max_header_bytes),
        timer_(loop_, *this),
        remote_address_(std::move(remote_address)),
        remote_port_(remote_port) {}
  ~Connection() override {
    if (fd_ >= 0) ::close(fd_);
  }

  void start() {
    loop_.add(fd_, this);
    timer_.arm(server_.options().idle_timeout);
  }
  void on_io(uint32_t events) override;
  void run_deferred() override;
  void on_timer() override;
  // The exchange has bytes or news (from ExchangeState, on this loop).
  void wake() { loop_.defer(this); }
  // The server stops: a complete response still to write goes on being written, then the
  // connection closes gracefully; everything else closes now.
  void finish();
  // The server stops now: end everything.
  void shutdown() { close_now(); }
  const std::string& remote_address() const { return remote_address_; }

 private:
  enum class Phase { kHead, kBody, kExchange, kErrorSent, kDraining, kClosed };

  void read_input();
  void process();
  void begin_request();
  void make_room_for_body();
  void dispatch();
  void pump();
  bool flush();
  void end_exchange(bool close_after);
  // Arms the timer for the earlier of the read and write deadlines; disarms it if neither runs.
  void arm_deadlines();
  void fail_request(const ParseError& error);
  void close_gracefully();
  void close_now();

  ServerLoop& owner_;
  ServerImpl& server_;
  EventLoop& loop_;
  int fd_;
  Phase phase_ = Phase::kHead;

  ByteBuffer in_;
  HeadParser head_parser_;
  BodyParser body_parser_;
  MessageHead head_;
  ParseError error_;
  HttpRequest request_;
  bool request_started_ = false;  // a byte of the current request arrived (read timeout runs)
  bool peer_eof_ = false;         // the client closed its side, or reading failed
  bool peer_closed_ = false;      // epoll said so (EPOLLRDHUP): read on until recv sees the EOF
  bool read_paused_ = false;      // input left unread: enough is buffered
  size_t drained_ = 0;

  std::shared_ptr<ExchangeState> exchange_;
  std::string out_;  // being written; out_[written_..] is left
  size_t written_ = 0;
  std::string spare_;  // lent to the next exchange as its buffer
  bool want_write_ = false;

  // On the loop's clock (EventLoop::now_ms), 0 when not running. The read deadline bounds the
  // request being read: its head from its first byte, then its body by body_deadline_ (moved on
  // by each read that brings body bytes). It keeps running while something is written meanwhile
  // (a 100 Continue that had to wait): a write must neither suspend nor lift it. The write
  // deadline runs while output waits for the client, from its last progress.
  int64_t read_deadline_ = 0;
  std::optional<BodyReadDeadline> body_deadline_;  // while a body is read
  int64_t write_deadline_ = 0;
  Timer timer_;
  std::string remote_address_;
  unsigned short remote_port_ = 0;
};

void ExchangeState::wake_locked() {
  if (detached_ || wake_posted_) return;
  wake_posted_ = true;
  if (loop_->in_loop_thread()) {
    // A producer on the connection's own thread (a relay): write at the end of the iteration,
    // with whatever else it produces meanwhile, and without a cross-thread hop.
    connection_->wake();
  } else {
    loop_->post(shared_from_this());
  }
}

void ExchangeState::run(int) {
  // detached_ is only written on this thread, so it can be read here without the lock.
  if (!detached_) connection_->wake();
}

// --- Connection --------------------------------------------------------------------------------

void Connection::on_io(uint32_t events) {
  if (phase_ == Phase::kClosed) return;
  if ((events & EPOLLOUT) && want_write_) {
    // A write that must wait again still leaves this event's input to read: edge-triggered, the
    // event may be the only report of a pipelined request or of the client's hang-up.
    if (flush()) {
      if (phase_ == Phase::kExchange) pump();
      if (phase_ == Phase::kHead) loop_.defer(this);  // a pipelined request may be waiting
    }
    if (phase_ == Phase::kClosed) return;
  }
  if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
    if (events & (EPOLLRDHUP | EPOLLHUP)) peer_closed_ = true;
    read_input();
    process();
  }
}

void Connection::run_deferred() {
  if (phase_ == Phase::kExchange) pump();
  if (phase_ == Phase::kHead || phase_ == Phase::kBody) process();
}

void Connection::read_input() {
  read_paused_ = false;
  if (phase_ == Phase::kClosed || peer_eof_) return;
  // How much unparsed input to hold. While a response is pending: a head's worth of the next
  // request (a client that goes away is still noticed when the response is written). Else
  // enough for the parser to make progress; the rest waits in the kernel until it has.
  const size_t header = server_.options().max_header_bytes;
  const size_t cap = phase_ == Phase::kExchange ? header : header + 4 * kReadChunk;
  const bool discard = phase_ == Phase::kErrorSent || phase_ == Phase::kDraining;
  for (;;) {
    if (!discard && in_.size() >= cap) {
      // Edge-triggered: nothing tells us again about what is left, so remember it.
      read_paused_ = true;
      // While a response is pending, what is left stays unread until it is written, so no recv
      // reaches the client's EOF: epoll's hang-up is all that says it went, and it counts as the
      // EOF does. Otherwise the producer (an engine) works on for nobody until its answer fails.
      if (phase_ == Phase::kExchange && peer_closed_) peer_eof_ = true;
      return;
    }
    char* at = in_.prepare(kReadChunk);
    const size_t room = in_.room();
    ssize_t n = ::recv(fd_, at, room, 0);
    if (n > 0) {
      if (discard) {
        // After an error answer, what the client still sends is read and dropped, up to a point.
        drained_ += static_cast<size_t>(n);
        if (drained_ > kDrainBytes) return close_now();
      } else {
        in_.commit(static_cast<size_t>(n));
      }
      // Drained: the next arrival is a new edge. Not so the peer's close when it came with this
      // data's edge: only the next recv sees that EOF.
      if (static_cast<size_t>(n) < room && !peer_closed_) return;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    // EOF counts as gone: clients that half-close and still wait for the answer are rare, and
    // an engine computing for a vanished client is expensive.
    peer_eof_ = true;
    return;
  }
}

void Connection::process() {
  const HttpServerOptions& options = server_.options();
  for (;;) {
    if (read_paused_ && (phase_ == Phase::kHead || phase_ == Phase::kBody)) read_input();
    switch (phase_) {
      case Phase::kHead: {
        if (in_.empty()) {
          if (peer_eof_) return close_now();
          return;  // the idle timer runs
        }
        if (!request_started_) {
          request_started_ = true;
          read_deadline_ =
              loop_.now_ms() + std::min(options.header_timeout, options.read_timeout).count();
          arm_deadlines();
        }
        Parse r = head_parser_.request(in_.view(), head_, error_);
        if (r == Parse::kError) return fail_request(error_);
        if (r == Parse::kNeedMore) {
          // A client that closes mid-request gets nothing: it is gone.
          if (peer_eof_) return close_now();
          return;
        }
        begin_request();
        break;
      }
      case Phase::kBody: {
        if (head_.body == BodyKind::kLength) make_room_for_body();
        size_t used = 0;
        const size_t had = request_.body.size();
        Parse r = body_parser_.feed(in_.view(), used, request_.body, error_);
        in_.consume(used);
        if (r == Parse::kError) return fail_request(error_);
        if (used > 0) {
          body_deadline_->received(loop_.now_ms(), used, request_.body.size() - had);
          read_deadline_ = body_deadline_->due_ms();
          arm_deadlines();  // a later deadline costs the timer nothing (EventLoop::timer_arm)
        }
        if (r == Parse::kNeedMore) {
          if (read_paused_) break;  // more is waiting in the kernel
          if (peer_eof_) return close_now();
          return;
        }
        dispatch();
        break;
      }
      case Phase::kExchange:
        // The client went away while the response is pending.
        if (peer_eof_ && exchange_ && !exchange_->complete()) {
          exchange_->lose();
          return close_now();
        }
        return;
      case Phase::kErrorSent:
      case Phase::kDraining:
        if (peer_eof_) return close_now();
        return;
      case Phase::kClosed:
        return;
    }
  }
}

void Connection::begin_request() {
  const HttpServerOptions& options = server_.options();
  request_.method.assign(head_.method);
  request_.target.assign(head_.empty_path ? "/" : "");
  request_.target.append(head_.target);
  const std::string_view target = request_.target;
  size_t question = target.find('?');
  request_.path.assign(target.substr(0, question));
  decode_unreserved_escapes(request_.path);  // so that /v1/%6dodels finds /v1/models
  if (question != std::string_view::npos) {
    request_.query.assign(target.substr(question + 1));
  } else {
    request_.query.clear();
  }
  request_.version = head_.version;
  request_.headers = Headers();
  copy_fields(head_, request_.headers);
  request_.body.clear();
  request_.remote_address = remote_address_;
  request_.remote_port = remote_port_;
  in_.consume(head_.head_bytes);
  head_parser_.reset();

  if (head_.body == BodyKind::kLength && head_.content_length > options.max_body_bytes) {
    // Rejected from the head alone, before the client sends (or we read) the body.
    ParseError e{413, "the request body is larger than " + std::to_string(options.max_body_bytes) +
                          " bytes"};
    return fail_request(e);
  }
  body_parser_.start(head_, options.max_body_bytes, options.max_header_bytes);
  phase_ = Phase::kBody;
  body_deadline_.emplace(loop_.now_ms(), options.read_timeout, options.min_body_bytes_per_second,
                         server_.max_body_time());
  read_deadline_ = body_deadline_->due_ms();
  arm_deadlines();
  if (head_.expect_continue && !body_parser_.done() && in_.empty()) {
    out_ += "HTTP/1.1 100 Continue\r\n\r\n";
    flush();
  }
}

// A body of announced length gets its buffer as its bytes arrive, doubling up to that length.
// Reserved up front, a head alone made the server hold the whole announced length (8 MiB for a
// head announcing it) for as long as the body's deadline allowed. Doubling keeps the copies to
// about the body's size in all, and the last step is exact, so a body never holds more than its
// length: a fresh string reserved to it and swapped in, because libstdc++'s reserve() on a string
// that has a buffer grows it to at least twice its capacity (an 8 MiB body held 10.6 MB of heap
// at its last step, up to twice its length); reserve() on an empty string is exact.
void Connection::make_room_for_body() {
  std::string& body = request_.body;
  const uint64_t length = head_.content_length;
  const size_t wanted = body.size() + std::min<uint64_t>(in_.size(), length - body.size());
  if (wanted <= body.capacity()) return;
  const auto target =
      static_cast<size_t>(std::min<uint64_t>(length, std::max(wanted, 2 * body.capacity())));
  std::string grown;
  grown.reserve(target);
  grown.append(body);
  body.swap(grown);
}

void Connection::dispatch() {
  phase_ = Phase::kExchange;
  request_started_ = false;
  read_deadline_ = 0;
  body_deadline_.reset();
  arm_deadlines();  // no timeout while the server waits for its handler, unless it writes
  if (request_.body.capacity() - request_.body.size() > kKeptSlackBytes) {
    request_.body.shrink_to_fit();
  }
  if (in_.empty() && in_.room() > kKeptSlackBytes) in_.release_if_empty();
  const bool keep_alive = head_.keep_alive && !server_.stopping();
  std::string allow_origin = server_.allow_origin(request_);
  exchange_ =
      std::make_shared<ExchangeState>(std::move(request_), keep_alive, loop_, *this,
                                      std::move(spare_), server_.options().error_response,
                                      server_.options().max_unsent_bytes, std::move(allow_origin));
  request_ = HttpRequest();
  {
    auto exchange = std::make_shared<Exchange>(exchange_);
    try {
      server_.dispatch(exchange_->request, exchange);
    } catch (const std::exception& e) {
      server_.log("handler for " + exchange_->request.method + " " + exchange_->request.path +
                  " threw: " + e.what());
      exchange_->abort(e.what());
    } catch (...) {
      server_.log("handler for " + exchange_->request.method + " " + exchange_->request.path +
                  " threw a non-standard exception");
      exchange_->abort("internal error");
    }
  }  // Our reference goes; if the handler kept none and sent nothing, that is a 500.
  // Input that came with the request (EOF) is judged now that the exchange exists. A hang-up
  // seen while the body was read may have left input unread, and no event comes again for it.
  if (peer_closed_) read_input();
  if (peer_eof_) process();
}

void Connection::pump() {
  while (phase_ == Phase::kExchange) {
    // Before the flush: a stalled client's write would wait for EPOLLOUT, which never comes.
    if (exchange_->stalled()) {
      exchange_->lose();
      return close_now();
    }
    if (written_ < out_.size() && !flush()) return;  // closed, or waiting for EPOLLOUT
    ExchangeState::Pending p = exchange_->take(out_);
    run_callbacks(p.callbacks);
    if (p.cut) {
      exchange_->lose();
      return close_now();
    }
    if (!out_.empty()) continue;  // write it, then look again
    if (p.complete) return end_exchange(p.close_after);
    if (peer_eof_ || server_.stopping()) {
      exchange_->lose();
      return close_now();
    }
    return;  // the producer wakes us
  }
}

bool Connection::flush() {
  const size_t before = written_;
  if (const int err = send_pending(fd_, out_, written_)) {
    if (err == EAGAIN) {
      if (exchange_) exchange_->sending(out_.size() - written_);
      // The write timeout runs from the last send that made progress, as nginx's send_timeout:
      // it finds a client that stopped reading, while one that reads slowly but steadily gets
      // its whole response, however long that takes.
      if (!want_write_ || written_ > before) {
        want_write_ = true;
        write_deadline_ = loop_.now_ms() + server_.options().write_timeout.count();
        arm_deadlines();
      }
      return false;
    }
    // The client is gone.
    if (exchange_) exchange_->lose();
    close_now();
    return false;
  }
  out_.clear();
  written_ = 0;
  if (exchange_) exchange_->sending(0);
  if (want_write_) {
    want_write_ = false;
    write_deadline_ = 0;
    arm_deadlines();  // the request being read, if any, is bound by its deadline again
  }
  if (phase_ == Phase::kErrorSent) {
    close_gracefully();
    return false;
  }
  return true;
}

void Connection::end_exchange(bool close_after) {
  spare_ = exchange_->detach();
  exchange_.reset();
  if (close_after || server_.stopping()) return close_gracefully();
  // A client that half-closed after pipelining (`printf ... | nc -N`) still gets the answers to
  // the requests that arrived whole: process() closes once the input holds no whole request.
  if (peer_eof_ && in_.empty()) return close_gracefully();
  phase_ = Phase::kHead;
  if (in_.empty()) {
    // Idle until the next request, maybe for long: hold no buffers meanwhile (about 1 KiB per
    // idle connection instead of 17; the next request allocates them again).
    in_.release_if_empty();
    spare_ = std::string();
    out_ = std::string();
    written_ = 0;
  }
  timer_.arm(server_.options().idle_timeout);
  loop_.defer(this);  // a pipelined request may be buffered already
}

void Connection::arm_deadlines() {
  int64_t at = read_deadline_;
  if (want_write_ && write_deadline_ != 0 && (at == 0 || write_deadline_ < at)) {
    at = write_deadline_;
  }
  if (at == 0) return timer_.disarm();
  // A deadline already past fires on the next iteration.
  timer_.arm(std::chrono::milliseconds(std::max<int64_t>(0, at - loop_.now_ms())));
}

void Connection::fail_request(const ParseError& error) {
  // Once its head was read (a 413 from its Content-Length, a body that is malformed or late), a
  // page's request gets its CORS header, as any answer: without it the browser hides the error
  // from the page. (Until begin_request, request_ holds no fields: a head that failed has none.)
  const std::string allow_origin = server_.allow_origin(request_);
  request_started_ = false;
  body_deadline_.reset();
  phase_ = Phase::kErrorSent;
  append_error(out_, server_.options().error_response, error.status, error.message, true, false,
               allow_origin);
  read_deadline_ = 0;
  arm_deadlines();
  flush();
}

void Connection::finish() {
  switch (phase_) {
    case Phase::kExchange:
      if (exchange_->complete()) return pump();  // ends in close_gracefully once written
      exchange_->lose();
      return close_now();
    case Phase::kErrorSent:
    case Phase::kDraining:
    case Phase::kClosed:
      return;  // on their way out already
    case Phase::kHead:
    case Phase::kBody:
      return close_now();
  }
}

void Connection::close_gracefully() {
  // Half-close, then drain what the client still sends for a moment before closing: closing
  // with unread input makes the kernel send RST, which can destroy the response in flight. Also
  // while the server stops: its flush bounds the drain.
  if (phase_ == Phase::kClosed) return;
  if (peer_eof_) return close_now();
  ::shutdown(fd_, SHUT_WR);
  phase_ = Phase::kDraining;
  in_.clear();
  timer_.arm(kDrainTime);
  read_input();
  if (peer_eof_) close_now();
}

void Connection::on_timer() {
  // One timer, whose meaning follows the phase: a stalled write, an idle keep-alive connection,
  // a request that does not arrive in time (either, whichever is due first: arm_deadlines), or
  // the end of the drain. A body that does not arrive in time is answered 408, so that its
  // client learns why (its head was a request; a head that stalls gets nothing: slowloris);
  // every other case closes the connection.
  if (phase_ == Phase::kBody && read_deadline_ != 0 && read_deadline_ <= loop_.now_ms()) {
    // The message names the bound that fired, so that a client (or its operator) knows which
    // one to meet: pausing, the average rate or the whole time.
    const HttpServerOptions& options = server_.options();
    std::string message = "the request body did not arrive in time: ";
    switch (body_deadline_->due().bound) {
      case BodyReadDeadline::Bound::kBetweenReads:
        message += "no part of it came within " + std::to_string(options.read_timeout.count()) +
                   " ms of the last";
        break;
      case BodyReadDeadline::Bound::kLeastRate:
        message += "it came at less than " + std::to_string(options.min_body_bytes_per_second) +
                   " bytes per second on average";
        break;
      case BodyReadDeadline::Bound::kTotal:
        message += "it was not complete within " + std::to_string(server_.max_body_time().count()) +
                   " ms of the request's head";
        break;
    }
    return fail_request(ParseError{408, std::move(message)});
  }
  if (exchange_) exchange_->lose();
  close_now();
}

void Connection::close_now() {
  if (phase_ == Phase::kClosed) return;
  phase_ = Phase::kClosed;
  if (exchange_) {
    exchange_->lose();
    exchange_->detach();
    exchange_.reset();
  }
  timer_.disarm();
  ::close(fd_);  // also unregisters it from epoll
  fd_ = -1;
  owner_.remove(this);
}

// --- ServerLoop --------------------------------------------------------------------------------

ServerLoop::~ServerLoop() = default;

void ServerLoop::on_io(uint32_t) {
  // A bounded batch per wake-up: the listener is level-triggered, what is left wakes us again.
  for (int i = 0; i < 64 && listening_; ++i) {
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if (errno == EINTR || errno == ECONNABORTED) continue;
      // Out of file descriptors and the like: wait a little rather than spin.
      server_.connection_failed(std::string("accept failed: ") + std::strerror(errno));
      loop_.remove(listen_fd_);
      listening_ = false;
      if (!backoff_) backoff_ = std::make_unique<Timer>(loop_, *this);
      backoff_->arm(std::chrono::milliseconds(50));
      return;
    }
    std::string address;
    unsigned short port = 0;
    peer_of(fd, address, port);
    if (server_.stopping() || !server_.admit_connection(address)) {
      ::close(fd);
      continue;
    }
    set_no_delay(fd);
    auto connection = std::make_unique<Connection>(*this, fd, std::move(address), port);
    Connection* c = connection.get();
    connections_.emplace(c, std::move(connection));
    try {
      c->start();
    } catch (const std::exception& e) {
      // epoll could not take the socket (ENOMEM, ENOSPC): no event would ever serve or close it,
      // so it goes now, with its slot under the connection caps.
      server_.connection_failed(std::string("a new connection could not be registered: ") +
                                e.what());
      c->shutdown();
    }
  }
}

void ServerLoop::on_timer() {
  if (server_.stopping() || listening_) return;
  listening_ = true;
  loop_.add_listener(listen_fd_, this);
}

void ServerLoop::remove(Connection* c) {
  auto it = connections_.find(c);
  if (it == connections_.end()) return;
  server_.connection_closed(c->remote_address());
  loop_.retire(std::move(it->second));
  connections_.erase(it);
  if (finishing_ && connections_.empty()) server_.loop_finished();
}

void ServerLoop::finish() {
  if (listening_) loop_.remove(listen_fd_);
  listening_ = false;
  backoff_.reset();
  std::vector<Connection*> live;
  for (auto& [c, owned] : connections_) live.push_back(c);
  finishing_ = !live.empty();
  if (live.empty()) return server_.loop_finished();
  for (Connection* c : live) c->finish();
}

void ServerLoop::shutdown() {
  if (listening_) loop_.remove(listen_fd_);
  listening_ = false;
  backoff_.reset();
  finishing_ = false;  // the server no longer waits
  std::vector<Connection*> live;
  for (auto& [c, owned] : connections_) live.push_back(c);
  for (Connection* c : live) c->shutdown();
}

// --- ServerImpl --------------------------------------------------------------------------------

void ServerImpl::route(std::string method, std::string path, Handler handler) {
  if (started_) throw Error("HttpServer::route: routes must be registered before start()");
  if (method.empty() || path.empty() || path[0] != '/') {
    throw Error("HttpServer::route: expected a method and a path starting with '/', got '" +
                method + "' '" + path + "'");
  }
  if (!handler) throw Error("HttpServer::route: empty handler for " + method + " " + path);
  auto [it, inserted] = routes_[path].emplace(method, std::move(handler));
  if (!inserted) throw Error("HttpServer::route: " + method + " " + path + " registered twice");
}

void ServerImpl::route_prefix(std::string method, std::string prefix, Handler handler) {
  if (started_) throw Error("HttpServer::route_prefix: routes must be registered before start()");
  if (method.empty() || prefix.empty() || prefix.front() != '/' || prefix.back() != '/') {
    throw Error("HttpServer::route_prefix: expected a method and a prefix starting and ending " +
                std::string("with '/', got '") + method + "' '" + prefix + "'");
  }
  if (!handler) throw Error("HttpServer::route_prefix: empty handler for " + method + " " + prefix);
  auto [it, inserted] = prefix_routes_[prefix].emplace(method, std::move(handler));
  if (!inserted)
    throw Error("HttpServer::route_prefix: " + method + " " + prefix + " registered twice");
}

const ServerImpl::Methods* ServerImpl::routes_of(const std::string& path) const {
  if (auto it = routes_.find(path); it != routes_.end()) return &it->second;
  const Methods* longest = nullptr;
  size_t longest_size = 0;
  for (const auto& [prefix, methods] : prefix_routes_) {
    if (path.size() > prefix.size() && path.starts_with(prefix) && prefix.size() > longest_size) {
      longest = &methods;
      longest_size = prefix.size();
    }
  }
  return longest;
}

void ServerImpl::dispatch(const HttpRequest& request, const std::shared_ptr<Exchange>& exchange) {
  // TRACE would echo credentials back, CONNECT would make this a tunnel; other methods are
  // unknown to the server. Routes decide about the rest (404, 405).
  static const std::set<std::string, std::less<>> kResourceMethods = {
      "GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"};
  if (!kResourceMethods.contains(request.method)) {
    exchange->send_error(501, "Method " + request.method + " is not implemented by this server");
    return;
  }
  const Methods* path = routes_of(request.path);
  if (!path) {
    exchange->send_error(404, "Invalid URL (" + request.method + " " + request.path + ")");
    return;
  }
  auto method = path->find(request.method);
  if (method == path->end() && request.method == "HEAD") method = path->find("GET");
  if (method == path->end()) {
    std::string allowed;
    for (const auto& [name, handler] : *path) {
      allowed += (allowed.empty() ? "" : ", ") + name;
      if (name == "GET" && !path->contains("HEAD")) allowed += ", HEAD";
    }
    // A browser asks before a cross-origin POST with a JSON body: answered as Starlette's
    // CORSMiddleware answers vLLM's (the exchange adds Access-Control-Allow-Origin).
    if (request.method == "OPTIONS" && request.headers.contains("Access-Control-Request-Method") &&
        !allow_origin(request).empty()) {
      HttpResponse r;
      r.status = 200;
      r.body = "OK";
      r.content_type = "text/plain; charset=utf-8";
      r.headers.set("Access-Control-Allow-Methods", allowed);
      // Any header the page asks for (vLLM's default allowed headers are "*").
      if (const std::string* asked = request.headers.find("Access-Control-Request-Headers"))
        r.headers.set("Access-Control-Allow-Headers", *asked);
      r.headers.set("Access-Control-Max-Age", "600");
      exchange->respond(std::move(r));
      return;
    }
    HttpResponse r = options_.error_response(405,
                                             "Method " + request.method + " is not allowed for " +
                                                 request.path + " (allowed: " + allowed + ")",
                                             {}, {});
    r.headers.add("Allow", allowed);
    exchange->respond(std::move(r));
    return;
  }
  method->second(request, exchange);
}

bool ServerImpl::admit_connection(const std::string& address) {
  if (open_connections_.fetch_add(1, std::memory_order_relaxed) >= max_connections_) {
    open_connections_.fetch_sub(1, std::memory_order_relaxed);
    if (auto held_back = cap_log_.admit(LogThrottle::Clock::now())) {
      log("connection cap reached (" + std::to_string(max_connections_) +
          " connections): closing new connections" +
          (*held_back > 0 ? " (" + std::to_string(*held_back) + " closed since the last line)"
                          : ""));
    }
    return false;
  }
  if (!per_address_ || per_address_->admit(address)) return true;
  open_connections_.fetch_sub(1, std::memory_order_relaxed);
  // One line per interval whatever the address: a stranger must not be able to flood the log.
  if (auto held_back = address_cap_log_.admit(LogThrottle::Clock::now())) {
    log("per-address connection cap reached (" + std::to_string(per_address_->limit()) + " from " +
        address + "): closing its new connections" +
        (*held_back > 0 ? " (" + std::to_string(*held_back) + " closed since the last line)" : ""));
  }
  return false;
}

void ServerImpl::connection_closed(const std::string& address) {
  open_connections_.fetch_sub(1, std::memory_order_relaxed);
  if (per_address_) per_address_->release(address);
}

void ServerImpl::loop_finished() {
  {
    std::lock_guard lock(flush_mu_);
    ++loops_finished_;
  }
  flush_changed_.notify_all();
}

void ServerImpl::end_flush() {
  {
    std::lock_guard lock(flush_mu_);
    flush_ended_ = true;
  }
  flush_changed_.notify_all();
}

void ServerImpl::connection_failed(const std::string& why) {
  if (auto held_back = accept_log_.admit(LogThrottle::Clock::now())) {
    log(why + (*held_back > 0 ? " (and " + std::to_string(*held_back) + " more failures)" : ""));
  }
}

void ServerImpl::start() {
  std::lock_guard stop_lock(stop_mu_);
  if (started_) throw Error("HttpServer::start: the server was already started");
  if (options_.threads < 1) {
    throw Error("HttpServer: threads must be at least 1, got " + std::to_string(options_.threads));
  }
  max_connections_ = options_.max_connections > 0 ? options_.max_connections
                                                  : default_max_connections(descriptor_limit());
  uint16_t bound = 0;
  listen_fd_ = listen_tcp({options_.host, options_.port, options_.host_flag, options_.port_flag},
                          bound, options_.reuse_port);
  port_ = bound;
  started_ = true;
  for (size_t i = 0; i < loops_.size(); ++i) {
    server_loops_.push_back(std::make_unique<ServerLoop>(*this, loops_.at(i), listen_fd_));
    server_loops_.back()->start();
  }
  loops_.start([this](const std::string& message) { log(message); });
}

void ServerImpl::stop(std::chrono::milliseconds flush) {
  std::lock_guard stop_lock(stop_mu_);
  if (!started_ || stopped_) {
    stopped_ = true;
    return;
  }
  stopped_ = true;
  const auto flush_end = std::chrono::steady_clock::now() + flush;
  stopping_.store(true, std::memory_order_release);
  // Each loop first writes what its sockets take and keeps the connections with a complete
  // response left to write; the rest close now.
  for (size_t i = 0; i < loops_.size(); ++i) {
    ServerLoop* s = server_loops_[i].get();
    loops_.at(i).post([s] { s->finish(); });
  }
  {
    std::unique_lock lock(flush_mu_);
    flush_changed_.wait_until(lock, flush_end,
                              [&] { return flush_ended_ || loops_finished_ == loops_.size(); });
  }
  // What is left is cut.
  for (size_t i = 0; i < loops_.size(); ++i) {
    ServerLoop* s = server_loops_[i].get();
    loops_.at(i).post([s] { s->shutdown(); });
  }
  // Runs what was posted (the shutdowns above, an AsyncHttpClient's last work), then joins.
  loops_.stop_and_join();
  server_loops_.clear();
  ::close(listen_fd_);
  listen_fd_ = -1;
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// HttpServer

HttpServer::HttpServer(HttpServerOptions options)
    : impl_(std::make_unique<detail::ServerImpl>(std::move(options))) {}

HttpServer::~HttpServer() {
  stop();
}

void HttpServer::route(std::string method, std::string path, Handler handler) {
  impl_->route(std::move(method), std::move(path), std::move(handler));
}

void HttpServer::route_prefix(std::string method, std::string prefix, Handler handler) {
  impl_->route_prefix(std::move(method), std::move(prefix), std::move(handler));
}

void HttpServer::start() {
  impl_->start();
}

size_t HttpServer::max_connections() const {
  return impl_->max_connections();
}

uint16_t HttpServer::port() const {
  return impl_->port();
}

void HttpServer::stop(std::chrono::milliseconds flush) {
  impl_->stop(flush);
}

void HttpServer::end_flush() {
  impl_->end_flush();
}

detail::LoopGroup& HttpServer::loops() {
  return impl_->loops();
}

}  // namespace tandem::net
