#include "net/http_server.h"

// Boost 1.74's asio/awaitable.hpp uses std::exchange without including <utility>.
#include <utility>

#include <boost/asio.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>

#include <atomic>
#include <cstdio>
#include <ctime>
#include <exception>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

#include "util/error.h"

namespace tandem::net {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = boost::beast::http;
using tcp = asio::ip::tcp;
using boost::system::error_code;
using Executor = asio::any_io_executor;
using Callbacks = std::vector<std::function<void()>>;

namespace {

constexpr auto kAwait = asio::use_awaitable;

// The Date field value (RFC 9110 5.6.7), e.g. "Sun, 06 Nov 1994 08:49:37 GMT". Names spelled out
// here because strftime's follow the locale.
std::string http_date() {
  static constexpr const char* kDays[] = {"Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"};
  static constexpr const char* kMonths[] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun",
                                            "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};
  // Formatted once per second per thread: it is in every response head.
  thread_local std::time_t cached_at = -1;
  thread_local std::string cached;
  std::time_t now = std::time(nullptr);
  if (now == cached_at) return cached;
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[40];
  std::snprintf(buf, sizeof buf, "%s, %02d %s %04d %02d:%02d:%02d GMT", kDays[tm.tm_wday % 7],
                tm.tm_mday, kMonths[tm.tm_mon % 12], tm.tm_year + 1900, tm.tm_hour, tm.tm_min,
                tm.tm_sec);
  cached_at = now;
  cached = buf;
  return cached;
}

// A response head as bytes. `framing` is the Content-Length or Transfer-Encoding line (without
// CRLF) or empty; `connection` the Connection value or empty.
std::string response_head(int status, std::string_view content_type, const Headers& extra,
                          std::string_view framing, std::string_view connection) {
  std::string head = "HTTP/1.1 " + std::to_string(status) + " ";
  head += status_reason(status);
  head += "\r\n";
  head += "Date: " + http_date() + "\r\n";
  if (!content_type.empty()) {
    head += "Content-Type: ";
    head += content_type;
    head += "\r\n";
  }
  for (const auto& [name, value] : extra) {
    if (iequals(name, "Content-Length") || iequals(name, "Transfer-Encoding") ||
        iequals(name, "Connection") || iequals(name, "Content-Type") || iequals(name, "Date")) {
      continue;
    }
    head += name + ": " + value + "\r\n";
  }
  if (!framing.empty()) {
    head += framing;
    head += "\r\n";
  }
  if (!connection.empty()) {
    head += "Connection: ";
    head += connection;
    head += "\r\n";
  }
  head += "\r\n";
  return head;
}

// 1xx, 204 and 304 responses have no body and no Content-Length (RFC 9110 8.6).
bool status_has_body(int status) {
  return status >= 200 && status != 204 && status != 304;
}

void check_status(int status) {
  if (status < 200 || status > 999) {
    throw Error("HTTP response status " + std::to_string(status) +
                " is not a final status (expected 200..999)");
  }
}

// A complete response as bytes.
std::string serialize_response(const HttpResponse& r, bool close, bool http10_keep_alive) {
  check_status(r.status);
  std::string_view connection = close ? "close" : (http10_keep_alive ? "keep-alive" : "");
  if (!status_has_body(r.status)) {
    return response_head(r.status, r.content_type, r.headers, "", connection);
  }
  std::string bytes = response_head(r.status, r.content_type, r.headers,
                                    "Content-Length: " + std::to_string(r.body.size()), connection);
  bytes += r.body;
  return bytes;
}

HttpResponse error_response(int status, std::string_view message) {
  HttpResponse r;
  r.status = status;
  r.body = openai_error_body(message, default_error_type(status));
  return r;
}

void run_callbacks(Callbacks& callbacks) {
  for (auto& callback : callbacks) {
    if (callback) callback();
  }
}

}  // namespace

namespace detail {

class Connection;

// What an Exchange and the connection serving it share. The producer side (Exchange methods,
// any thread) appends bytes to `out_`; the connection (its strand) takes them and writes them.
// Everything below the constants is guarded by mu_. Callbacks never run under mu_, so they may
// call back into the exchange.
class ExchangeState {
 public:
  ExchangeState(HttpRequest request, bool keep_alive, Executor executor,
                std::weak_ptr<Connection> connection)
      : request(std::move(request)),
        keep_alive_(keep_alive),
        http10_(this->request.version < 11),
        connection_(std::move(connection)),
        executor_(std::move(executor)) {}

  const HttpRequest request;

  // --- producer side ---

  bool respond(const HttpResponse& response) {
    std::string bytes = serialize_response(response, !keep_alive_, http10_ && keep_alive_);
    Callbacks dropped;
    std::lock_guard lock(mu_);
    if (closed_locked() || phase_ != Phase::kIdle) return false;
    out_ += bytes;
    phase_ = Phase::kComplete;
    close_after_ = !keep_alive_;
    dropped.swap(on_close_);
    wake_locked();
    return true;
  }

  bool start_stream(int status, std::string_view content_type, const Headers& headers) {
    check_status(status);
    // HTTP/1.0 has no chunked encoding: the body runs until the connection closes.
    bool chunked = !http10_;
    bool close = !keep_alive_ || !chunked;
    std::string head =
        response_head(status, content_type, headers, chunked ? "Transfer-Encoding: chunked" : "",
                      close ? "close" : (http10_ ? "keep-alive" : ""));
    std::lock_guard lock(mu_);
    if (closed_locked() || phase_ != Phase::kIdle) return false;
    out_ += head;
    phase_ = status_has_body(status) ? Phase::kStreaming : Phase::kComplete;
    chunked_ = chunked;
    close_after_ = close;
    wake_locked();
    return true;
  }

  bool write(std::string_view chunk) {
    std::lock_guard lock(mu_);
    if (closed_locked() || phase_ != Phase::kStreaming) return false;
    if (chunk.empty()) return true;  // an empty chunk would end a chunked body
    if (chunked_) {
      char size[20];
      int n = std::snprintf(size, sizeof size, "%zx\r\n", chunk.size());
      out_.append(size, static_cast<size_t>(n));
      out_ += chunk;
      out_ += "\r\n";
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
    if (chunked_) out_ += "0\r\n\r\n";
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
  // connection. The callbacks run on the connection's strand, not here: the caller may hold
  // locks that they take.
  void abort(std::string_view message) {
    std::lock_guard lock(mu_);
    if (aborted_ || lost_ || phase_ == Phase::kComplete) return;
    aborted_ = true;
    if (phase_ == Phase::kIdle) {
      out_ +=
          serialize_response(error_response(500, message), !keep_alive_, http10_ && keep_alive_);
      phase_ = Phase::kComplete;
      close_after_ = !keep_alive_;
    }
    wake_locked();
  }

  // --- connection side (its strand) ---

  struct Pending {
    std::string bytes;
    bool complete = false;     // bytes end the response
    bool cut = false;          // aborted mid-stream: close the connection
    bool close_after = false;  // close the connection after the response
    Callbacks callbacks;       // to run now (aborted)
  };

  Pending take() {
    std::lock_guard lock(mu_);
    Pending p;
    p.bytes.swap(out_);
    p.complete = phase_ == Phase::kComplete;
    p.cut = aborted_ && phase_ != Phase::kComplete;
    p.close_after = close_after_;
    if (aborted_) p.callbacks.swap(on_close_);
    wake_posted_ = false;
    return p;
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

  // The connection is done with this exchange; from now on nothing may reach its executor.
  void detach() {
    std::lock_guard lock(mu_);
    detached_ = true;
    executor_.reset();
    std::string().swap(out_);
  }

 private:
  enum class Phase { kIdle, kStreaming, kComplete };

  bool closed_locked() const { return lost_ || aborted_; }
  void wake_locked();

  const bool keep_alive_;
  const bool http10_;
  const std::weak_ptr<Connection> connection_;

  mutable std::mutex mu_;
  // Reset on detach: a strand executor must not outlive its io_context, and the producer may
  // hold this state much longer than the server lives.
  std::optional<Executor> executor_;
  Phase phase_ = Phase::kIdle;
  bool chunked_ = false;
  bool close_after_ = false;
  bool aborted_ = false;
  bool lost_ = false;
  bool detached_ = false;
  bool wake_posted_ = false;  // a wake is queued and take() has not run since
  std::string out_;
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
  return respond(
      status, openai_error_body(message, type.empty() ? default_error_type(status) : type, code));
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

class ServerImpl {
 public:
  asio::io_context& io_context() { return io_; }
  explicit ServerImpl(HttpServerOptions options) : options_(std::move(options)) {}

  void route(std::string method, std::string path, Handler handler);
  void set_fallback(Handler handler);
  void start();
  void stop();
  uint16_t port() const { return port_; }

  // --- for connections ---

  const HttpServerOptions& options() const { return options_; }
  void log(const std::string& message) const {
    if (options_.log) {
      options_.log(message);
    } else {
      std::fprintf(stderr, "tandem http: %s\n", message.c_str());
    }
  }
  // Calls the handler for the request, or answers 404/405 itself.
  void dispatch(const HttpRequest& request, const std::shared_ptr<Exchange>& exchange);
  bool stopping() const { return stopping_flag_.load(std::memory_order_acquire); }
  void remove(uint64_t id) {
    std::lock_guard lock(mu_);
    connections_.erase(id);
  }

 private:
  asio::awaitable<void> accept_loop();
  // Registers a live connection; false if the server is stopping (the caller drops it).
  bool add(uint64_t id, const std::shared_ptr<Connection>& connection) {
    std::lock_guard lock(mu_);
    if (stopping_) return false;
    connections_[id] = connection;
    return true;
  }

  const HttpServerOptions options_;
  // Written before start() only, then read by every io thread.
  std::map<std::string, std::map<std::string, Handler>> routes_;  // path -> method -> handler
  Handler fallback_;
  std::atomic<uint16_t> port_{0};

  asio::io_context io_;
  std::optional<tcp::acceptor> acceptor_;
  std::vector<std::thread> threads_;
  std::mutex stop_mu_;  // serialises start/stop
  bool started_ = false;
  bool stopped_ = false;
  uint64_t next_id_ = 0;  // accept loop only

  std::mutex mu_;  // guards stopping_ and connections_
  bool stopping_ = false;
  std::atomic<bool> stopping_flag_{false};  // stopping_, readable without mu_
  std::unordered_map<uint64_t, std::weak_ptr<Connection>> connections_;
};

// One TCP connection: reads requests one after the other, dispatches each and writes what its
// exchange produces. All of its state lives on one strand (the socket's executor), which the
// coroutines below and every handler posted to it share, so none of it needs a lock.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(ServerImpl& server, uint64_t id, tcp::socket socket)
      : server_(server),
        id_(id),
        socket_(std::move(socket)),
        wake_(socket_.get_executor()),
        deadline_(socket_.get_executor()) {
    wake_.expires_at(asio::steady_timer::time_point::max());
    error_code ec;
    // Tokens go out one small write at a time; Nagle would hold them back.
    socket_.set_option(tcp::no_delay(true), ec);
    tcp::endpoint peer = socket_.remote_endpoint(ec);
    if (!ec) {
      asio::ip::address address = peer.address();
      // A dual-stack listener sees IPv4 clients as ::ffff:a.b.c.d; report them as a.b.c.d.
      if (address.is_v6() && address.to_v6().is_v4_mapped()) {
        address = asio::ip::make_address_v4(asio::ip::v4_mapped, address.to_v6());
      }
      remote_address_ = address.to_string();
      remote_port_ = peer.port();
    }
  }

  Executor executor() { return socket_.get_executor(); }

  // `self` keeps the connection alive from the moment the coroutine is created.
  asio::awaitable<void> run(std::shared_ptr<Connection> self);

  // Wakes the coroutine waiting for its exchange (posted by ExchangeState).
  void wake() { wake_.cancel(); }

  // The server stops: end everything now.
  void shutdown() {
    stopping_ = true;
    error_code ec;
    socket_.shutdown(tcp::socket::shutdown_both, ec);
    socket_.close(ec);
    wake_.cancel();
    disarm();
  }

 private:
  enum class ReadResult { kRequest, kQuiet, kError };

  asio::awaitable<void> serve();
  // Reads one request into `parser`; on kError, `status`/`message` say what to answer.
  asio::awaitable<ReadResult> read_request(http::request_parser<http::string_body>& parser,
                                           int& status, std::string& message);
  // Writes what the exchange produces until it is complete; true if the connection may serve
  // another request.
  asio::awaitable<bool> serve_exchange(std::shared_ptr<ExchangeState> state);
  // Reads while a response is pending, to notice a client that goes away.
  asio::awaitable<void> watch(std::shared_ptr<Connection> self);
  asio::awaitable<bool> write_all(const std::string& bytes);
  // Half-closes, then drains what the client still sends for a moment before closing: closing
  // with unread input makes the kernel send RST, which can destroy the response in flight.
  asio::awaitable<void> close_gracefully();
  HttpRequest make_request(http::request<http::string_body>& message) const;

  // The deadline closes the socket when it fires; every arm() is followed by disarm() once the
  // operation it guards completes. The generation makes a stale expiry harmless.
  void arm(std::chrono::milliseconds timeout) {
    if (stopping_) return;
    uint64_t generation = ++deadline_generation_;
    deadline_.expires_after(timeout);
    deadline_.async_wait([self = shared_from_this(), generation](error_code ec) {
      if (!ec && generation == self->deadline_generation_) {
        error_code ignored;
        self->socket_.close(ignored);
      }
    });
  }
  void disarm() {
    ++deadline_generation_;
    deadline_.cancel();
  }

  ServerImpl& server_;
  const uint64_t id_;
  tcp::socket socket_;
  beast::flat_buffer buffer_;
  asio::steady_timer wake_;  // never expires; cancel() wakes whoever waits on it
  asio::steady_timer deadline_;
  uint64_t deadline_generation_ = 0;
  std::string remote_address_;
  unsigned short remote_port_ = 0;
  bool stopping_ = false;
  bool watching_ = false;
  bool stop_watching_ = false;
  bool peer_lost_ = false;
};

void ExchangeState::wake_locked() {
  if (detached_ || wake_posted_) return;
  wake_posted_ = true;
  asio::post(*executor_, [connection = connection_] {
    if (auto c = connection.lock()) c->wake();
  });
}

asio::awaitable<void> Connection::run([[maybe_unused]] std::shared_ptr<Connection> self) {
  try {
    co_await serve();
  } catch (const std::exception& e) {
    server_.log(std::string("connection failed: ") + e.what());
  }
  error_code ec;
  socket_.close(ec);
  disarm();
  server_.remove(id_);
}

asio::awaitable<void> Connection::serve() {
  const HttpServerOptions& options = server_.options();
  while (!stopping_) {
    http::request_parser<http::string_body> parser;
    parser.header_limit(static_cast<uint32_t>(
        std::min<size_t>(options.max_header_bytes, std::numeric_limits<uint32_t>::max())));
    parser.body_limit(options.max_body_bytes);
    int status = 0;
    std::string message;
    ReadResult result = co_await read_request(parser, status, message);
    if (result == ReadResult::kQuiet) co_return;
    if (result == ReadResult::kError) {
      if (co_await write_all(serialize_response(error_response(status, message), true, false))) {
        co_await close_gracefully();
      }
      co_return;
    }

    HttpRequest request;
    std::optional<std::string> bad_field;
    try {
      request = make_request(parser.get());
    } catch (const Error& e) {
      bad_field = e.what();
    }
    if (bad_field) {
      if (co_await write_all(serialize_response(error_response(400, *bad_field), true, false))) {
        co_await close_gracefully();
      }
      co_return;
    }
    bool keep_alive = parser.get().keep_alive() && !server_.stopping();
    auto state = std::make_shared<ExchangeState>(std::move(request), keep_alive, executor(),
                                                 weak_from_this());
    {
      auto exchange = std::make_shared<Exchange>(state);
      try {
        server_.dispatch(state->request, exchange);
      } catch (const std::exception& e) {
        server_.log("handler for " + state->request.method + " " + state->request.path +
                    " threw: " + e.what());
        state->abort(e.what());
      } catch (...) {
        server_.log("handler for " + state->request.method + " " + state->request.path +
                    " threw a non-standard exception");
        state->abort("internal error");
      }
    }  // Our reference goes; if the handler kept none and sent nothing, that is a 500.
    if (!co_await serve_exchange(std::move(state))) {
      co_await close_gracefully();
      co_return;
    }
  }
}

asio::awaitable<Connection::ReadResult> Connection::read_request(
    http::request_parser<http::string_body>& parser, int& status, std::string& message) {
  const HttpServerOptions& options = server_.options();
  error_code ec;
  if (buffer_.size() == 0) {
    // Waiting for a request to begin is the idle time of a keep-alive connection.
    arm(options.idle_timeout);
    co_await socket_.async_wait(tcp::socket::wait_read, asio::redirect_error(kAwait, ec));
    disarm();
    if (ec || stopping_) co_return ReadResult::kQuiet;
  }
  arm(options.read_timeout);
  co_await http::async_read_header(socket_, buffer_, parser, asio::redirect_error(kAwait, ec));
  if (!ec && !parser.is_done()) {
    auto expect = parser.get().find(http::field::expect);
    if (expect != parser.get().end() &&
        iequals(std::string_view(expect->value().data(), expect->value().size()), "100-continue") &&
        parser.get().version() >= 11) {
      static const std::string kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
      co_await asio::async_write(socket_, asio::buffer(kContinue),
                                 asio::redirect_error(kAwait, ec));
    }
    if (!ec) {
      co_await http::async_read(socket_, buffer_, parser, asio::redirect_error(kAwait, ec));
    }
  }
  disarm();
  if (!ec && !stopping_) co_return ReadResult::kRequest;
  if (stopping_) co_return ReadResult::kQuiet;
  if (ec == http::error::header_limit) {
    status = 431;
    message =
        "the request header is larger than " + std::to_string(options.max_header_bytes) + " bytes";
    co_return ReadResult::kError;
  }
  if (ec == http::error::body_limit) {
    status = 413;
    message =
        "the request body is larger than " + std::to_string(options.max_body_bytes) + " bytes";
    co_return ReadResult::kError;
  }
  // A client that closes or stalls mid-request gets nothing: it is gone or timed out.
  if (ec.category() != http::make_error_code(http::error::bad_method).category() ||
      ec == http::error::end_of_stream || ec == http::error::partial_message) {
    co_return ReadResult::kQuiet;
  }
  status = 400;
  message = "malformed HTTP request: " + ec.message();
  co_return ReadResult::kError;
}

HttpRequest Connection::make_request(http::request<http::string_body>& message) const {
  HttpRequest request;
  request.method = std::string(message.method_string());
  request.target = std::string(message.target());
  size_t question = request.target.find('?');
  request.path = request.target.substr(0, question);
  if (question != std::string::npos) request.query = request.target.substr(question + 1);
  request.version = static_cast<int>(message.version());
  for (const auto& field : message) {
    request.headers.add(std::string(field.name_string()), std::string(field.value()));
  }
  request.body = std::move(message.body());
  request.remote_address = remote_address_;
  request.remote_port = remote_port_;
  return request;
}

asio::awaitable<bool> Connection::serve_exchange(std::shared_ptr<ExchangeState> state) {
  // Detach on every way out, exceptions and the frame's destruction included: after that no
  // producer posts to this executor.
  struct Detach {
    ExchangeState* state;
    ~Detach() { state->detach(); }
  } detach{state.get()};

  watching_ = true;
  stop_watching_ = false;
  asio::co_spawn(executor(), watch(shared_from_this()), asio::detached);

  bool keep_alive = false;
  for (;;) {
    ExchangeState::Pending pending = state->take();
    run_callbacks(pending.callbacks);
    if (pending.cut) break;
    if (!pending.bytes.empty() && !co_await write_all(pending.bytes)) {
      state->lose();
      break;
    }
    if (pending.complete) {
      keep_alive = !pending.close_after;
      break;
    }
    if (peer_lost_ || stopping_) {
      state->lose();
      break;
    }
    // Sleep only when this take() found nothing: a wake that arrived while we were writing
    // found no waiter and is gone, but its bytes are still queued.
    if (!pending.bytes.empty()) continue;
    error_code ec;
    co_await wake_.async_wait(asio::redirect_error(kAwait, ec));
  }

  if (watching_) {
    stop_watching_ = true;
    error_code ec;
    socket_.cancel(ec);
    while (watching_) co_await wake_.async_wait(asio::redirect_error(kAwait, ec));
  }
  co_return keep_alive && !peer_lost_ && !stopping_;
}

asio::awaitable<void> Connection::watch([[maybe_unused]] std::shared_ptr<Connection> self) {
  // Bytes read here are the start of the next request (a pipelining client); they stay in
  // buffer_ for the parser. Past a header's worth we stop reading: writes still notice a
  // vanished client.
  try {
    while (!stop_watching_ && buffer_.size() < server_.options().max_header_bytes) {
      error_code ec;
      size_t n =
          co_await socket_.async_read_some(buffer_.prepare(4096), asio::redirect_error(kAwait, ec));
      if (ec) {
        // EOF counts as gone: clients that half-close and still wait for the answer are rare,
        // and an engine computing for a vanished client is expensive.
        if (!stop_watching_) peer_lost_ = true;
        break;
      }
      buffer_.commit(n);
    }
  } catch (const std::exception& e) {
    server_.log(std::string("connection watch failed: ") + e.what());
  }
  watching_ = false;
  wake_.cancel();
}

asio::awaitable<bool> Connection::write_all(const std::string& bytes) {
  error_code ec;
  arm(server_.options().write_timeout);
  co_await asio::async_write(socket_, asio::buffer(bytes), asio::redirect_error(kAwait, ec));
  disarm();
  co_return !ec && !stopping_;
}

asio::awaitable<void> Connection::close_gracefully() {
  error_code ec;
  socket_.shutdown(tcp::socket::shutdown_send, ec);
  if (!ec && !stopping_) {
    arm(std::chrono::seconds(2));
    char scratch[4096];
    size_t drained = 0;
    while (drained < (size_t{1} << 20)) {
      size_t n =
          co_await socket_.async_read_some(asio::buffer(scratch), asio::redirect_error(kAwait, ec));
      if (ec) break;
      drained += n;
    }
    disarm();
  }
  socket_.close(ec);
}

// ---------------------------------------------------------------------------------------------
// ServerImpl

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

void ServerImpl::set_fallback(Handler handler) {
  if (started_) throw Error("HttpServer::set_fallback: only before start()");
  fallback_ = std::move(handler);
}

void ServerImpl::dispatch(const HttpRequest& request, const std::shared_ptr<Exchange>& exchange) {
  auto path = routes_.find(request.path);
  if (path == routes_.end()) {
    if (fallback_) {
      fallback_(request, exchange);
    } else {
      exchange->send_error(404, "Invalid URL (" + request.method + " " + request.path + ")");
    }
    return;
  }
  auto method = path->second.find(request.method);
  if (method == path->second.end()) {
    std::string allowed;
    for (const auto& [name, handler] : path->second) {
      allowed += (allowed.empty() ? "" : ", ") + name;
    }
    HttpResponse r = error_response(405, "Method " + request.method + " is not allowed for " +
                                             request.path + " (allowed: " + allowed + ")");
    r.headers.add("Allow", allowed);
    exchange->respond(std::move(r));
    return;
  }
  method->second(request, exchange);
}

void ServerImpl::start() {
  std::lock_guard stop_lock(stop_mu_);
  if (started_) throw Error("HttpServer::start: the server was already started");
  if (options_.threads < 1) {
    throw Error("HttpServer: threads must be at least 1, got " + std::to_string(options_.threads));
  }
  error_code ec;
  tcp::resolver resolver(io_);
  auto endpoints = resolver.resolve(options_.host, std::to_string(options_.port),
                                    tcp::resolver::passive | tcp::resolver::numeric_service, ec);
  std::string where = options_.host + ":" + std::to_string(options_.port);
  if (ec || endpoints.empty()) {
    throw Error("HttpServer: cannot resolve listen address " + where + ": " + ec.message());
  }
  tcp::endpoint endpoint = endpoints.begin()->endpoint();
  acceptor_.emplace(asio::make_strand(io_));
  acceptor_->open(endpoint.protocol(), ec);
  if (!ec) acceptor_->set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) acceptor_->bind(endpoint, ec);
  if (!ec) acceptor_->listen(asio::socket_base::max_listen_connections, ec);
  if (ec) throw Error("HttpServer: cannot listen on " + where + ": " + ec.message());
  port_ = acceptor_->local_endpoint().port();
  started_ = true;

  asio::co_spawn(acceptor_->get_executor(), accept_loop(), [this](std::exception_ptr e) {
    if (!e) return;
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      log(std::string("accept loop failed: ") + x.what());
    }
  });
  for (int i = 0; i < options_.threads; ++i) {
    threads_.emplace_back([this] {
      // Handlers catch their exceptions; this only keeps a stray one from ending the process.
      for (;;) {
        try {
          io_.run();
          return;
        } catch (const std::exception& e) {
          log(std::string("io thread: ") + e.what());
        }
      }
    });
  }
}

asio::awaitable<void> ServerImpl::accept_loop() {
  asio::steady_timer backoff(acceptor_->get_executor());
  for (;;) {
    error_code ec;
    tcp::socket socket =
        co_await acceptor_->async_accept(asio::make_strand(io_), asio::redirect_error(kAwait, ec));
    if (stopping()) co_return;
    if (ec) {
      if (ec == asio::error::operation_aborted) co_return;
      // Out of file descriptors and the like: wait a little rather than spin.
      log("accept failed: " + ec.message());
      backoff.expires_after(std::chrono::milliseconds(50));
      co_await backoff.async_wait(asio::redirect_error(kAwait, ec));
      continue;
    }
    uint64_t id = ++next_id_;
    auto connection = std::make_shared<detail::Connection>(*this, id, std::move(socket));
    if (!add(id, connection)) co_return;
    asio::co_spawn(connection->executor(), connection->run(connection), asio::detached);
  }
}

void ServerImpl::stop() {
  std::lock_guard stop_lock(stop_mu_);
  if (!started_ || stopped_) {
    stopped_ = true;
    return;
  }
  stopped_ = true;
  std::vector<std::shared_ptr<detail::Connection>> live;
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    stopping_flag_.store(true, std::memory_order_release);
    for (auto& [id, weak] : connections_) {
      if (auto c = weak.lock()) live.push_back(std::move(c));
    }
  }
  asio::post(acceptor_->get_executor(), [this] {
    error_code ec;
    acceptor_->close(ec);
  });
  for (auto& c : live) {
    asio::post(c->executor(), [c] { c->shutdown(); });
  }
  live.clear();
  // Every connection ends, so the io threads run out of work and return.
  for (auto& t : threads_) t.join();
  threads_.clear();
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

void HttpServer::set_fallback(Handler handler) {
  impl_->set_fallback(std::move(handler));
}

void HttpServer::start() {
  impl_->start();
}

uint16_t HttpServer::port() const {
  return impl_->port();
}

void HttpServer::stop() {
  impl_->stop();
}

boost::asio::io_context& HttpServer::io_context() {
  return impl_->io_context();
}

}  // namespace tandem::net
