#include "net/async_http_client.h"

#include "net/http_server.h"

#include <atomic>
#include <condition_variable>
#include <future>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http.hpp>

namespace tandem::net {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = boost::beast::http;
using tcp = asio::ip::tcp;
using boost::system::error_code;

namespace {

constexpr auto kAwait = asio::use_awaitable;

// One finished or failed step of a call, with the words on_done reports.
struct CallFailed {
  std::string reason;
};

std::string describe(const char* step, const error_code& ec) {
  if (ec == beast::error::timeout) return std::string(step) + ": timed out";
  if (ec == http::error::end_of_stream || ec == asio::error::eof)
    return std::string(step) + ": connection closed by the server";
  return std::string(step) + ": " + ec.message();
}

}  // namespace

// Everything runs on one strand (of the client's own io thread, or of a server's io threads), so
// the connections, the idle pool and each call's state are only touched there; the mutex guards
// what other threads reach (the call table).
class AsyncHttpClient::Impl {
 public:
  explicit Impl(AsyncHttpClientOptions options)
      : options_(options),
        own_ctx_(std::make_unique<asio::io_context>()),
        ctx_(*own_ctx_),
        strand_(asio::make_strand(ctx_)),
        work_(asio::make_work_guard(ctx_)) {
    thread_ = std::thread([this] { ctx_.run(); });
  }

  Impl(asio::io_context& shared, AsyncHttpClientOptions options)
      : options_(options), ctx_(shared), strand_(asio::make_strand(ctx_)) {}

  ~Impl() {
    shutdown();
    if (work_) work_->reset();
    if (thread_.joinable()) thread_.join();
  }

  void shutdown() {
    std::vector<CallId> ids;
    {
      std::lock_guard lock(mutex_);
      if (shut_down_) return;
      stopping_ = true;
      for (const auto& [id, call] : calls_) ids.push_back(id);
    }
    for (auto id : ids) cancel(id);
    {
      std::unique_lock lock(mutex_);
      idle_cv_.wait(lock, [&] { return calls_.empty(); });
    }
    // A client on a server's threads that never made a call has nothing on the strand (and the
    // server may never have run: waiting for the strand would hang).
    if (!own_ctx_ && !used_.load()) {
      std::lock_guard lock(mutex_);
      shut_down_ = true;
      return;
    }
    // The idle connections belong to the strand: closed there, and waited for.
    std::promise<void> cleared;
    asio::post(strand_, [this, &cleared] {
      idle_.clear();
      cleared.set_value();
    });
    cleared.get_future().wait();
    std::lock_guard lock(mutex_);
    shut_down_ = true;
  }

  CallId start(AsyncHttpRequest request, AsyncHttpHandlers handlers) {
    auto call = std::make_shared<Call>();
    call->request = std::move(request);
    call->handlers = std::move(handlers);
    {
      std::lock_guard lock(mutex_);
      if (shut_down_) return 0;
      used_ = true;
      call->id = ++next_id_;
      calls_[call->id] = call;
      if (stopping_) call->cancelled = true;
    }
    asio::co_spawn(strand_, run(call), asio::detached);
    return call->id;
  }

  void cancel(CallId id) {
    std::shared_ptr<Call> call;
    {
      std::lock_guard lock(mutex_);
      auto it = calls_.find(id);
      if (it == calls_.end()) return;
      call = it->second;
    }
    call->cancelled = true;
    asio::post(strand_, [call] {
      if (call->stream) call->stream->cancel();
    });
  }

  size_t in_flight() const {
    std::lock_guard lock(mutex_);
    return calls_.size();
  }
  uint64_t connections_opened() const { return opened_; }

 private:
  struct Call {
    CallId id = 0;
    AsyncHttpRequest request;
    AsyncHttpHandlers handlers;
    std::atomic<bool> cancelled{false};
    beast::tcp_stream* stream = nullptr;  // the connection in use (io thread only)
  };
  using Stream = std::unique_ptr<beast::tcp_stream>;

  static std::string key(const AsyncHttpRequest& r) {
    return r.host + ":" + std::to_string(r.port);
  }

  Stream take_idle(const std::string& k) {
    auto it = idle_.find(k);
    if (it == idle_.end() || it->second.empty()) return nullptr;
    Stream s = std::move(it->second.back());
    it->second.pop_back();
    return s;
  }

  void put_idle(const std::string& k, Stream s) {
    auto& list = idle_[k];
    if (list.size() >= options_.max_idle_per_host) return;  // closed as it goes
    s->expires_never();
    list.push_back(std::move(s));
  }

  asio::awaitable<Stream> connect(Call& call) {
    const AsyncHttpRequest& r = call.request;
    tcp::resolver resolver(strand_);
    error_code ec;
    auto results = co_await resolver.async_resolve(r.host, std::to_string(r.port),
                                                   asio::redirect_error(kAwait, ec));
    if (ec) throw CallFailed{describe("cannot resolve the host", ec)};
    check_cancelled(call);
    auto stream = std::make_unique<beast::tcp_stream>(strand_);
    call.stream = stream.get();  // cancel() can interrupt the connect
    stream->expires_after(r.connect_timeout.count() > 0 ? r.connect_timeout : r.timeout);
    co_await stream->async_connect(results, asio::redirect_error(kAwait, ec));
    if (ec) throw CallFailed{describe("cannot connect", ec)};
    stream->socket().set_option(tcp::no_delay(true), ec);
    ++opened_;
    co_return stream;
  }

  void check_cancelled(const Call& call) {
    if (call.cancelled) throw CallFailed{"cancelled"};
  }

  asio::awaitable<void> run(std::shared_ptr<Call> call) {
    std::string error;
    const AsyncHttpRequest& r = call->request;
    Stream stream;
    try {
      check_cancelled(*call);
      http::request<http::string_body> req;
      req.method_string(r.method);
      req.target(r.target);
      req.version(11);
      req.set(http::field::host, r.host + ":" + std::to_string(r.port));
      for (const auto& [name, value] : r.headers) req.insert(name, value);
      if (!r.body.empty() && !r.headers.contains("Content-Type"))
        req.set(http::field::content_type, "application/json");
      req.body() = r.body;
      req.keep_alive(true);
      req.prepare_payload();

      // A reused connection the server closed while it was idle fails before any response
      // byte: then the request is sent once more on a new connection.
      std::optional<http::response_parser<http::string_body>> parser;
      beast::flat_buffer buffer;
      // Beast reads at most the buffer's free capacity (at least 512 bytes) per call: room for
      // a whole small response or many stream events per system call.
      buffer.reserve(16384);
      for (int attempt = 0;; ++attempt) {
        stream = attempt == 0 ? take_idle(key(r)) : nullptr;
        const bool reused = stream != nullptr;
        if (!stream) stream = co_await connect(*call);
        call->stream = stream.get();
        check_cancelled(*call);
        error_code wec, hec;
        stream->expires_after(r.timeout);
        co_await http::async_write(*stream, req, asio::redirect_error(kAwait, wec));
        check_cancelled(*call);
        parser.emplace();
        // Unlimited (streams): Beast 1.74 compares against an empty optional as if below any
        // value, so the limit is the largest number rather than none.
        parser->body_limit(std::numeric_limits<std::uint64_t>::max());
        parser->header_limit(static_cast<std::uint32_t>(options_.max_header_bytes));

        buffer.clear();
        if (!wec) {
          stream->expires_after(r.timeout);
          co_await http::async_read_header(*stream, buffer, *parser,
                                           asio::redirect_error(kAwait, hec));
        }
        check_cancelled(*call);
        const error_code first = wec ? wec : hec;
        if (first && reused && attempt == 0 &&
            (first == http::error::end_of_stream || first == asio::error::eof ||
             first == asio::error::connection_reset || first == asio::error::broken_pipe)) {
          call->stream = nullptr;
          stream.reset();
          continue;
        }
        if (wec) throw CallFailed{describe("cannot send the request", wec)};
        if (hec) throw CallFailed{describe("cannot read the response header", hec)};
        break;
      }

      if (call->handlers.on_head) {
        Headers headers;
        for (const auto& field : parser->get())
          headers.add(std::string(field.name_string()), std::string(field.value()));
        call->handlers.on_head(static_cast<int>(parser->get().result_int()), headers);
      }
      auto deliver = [&] {
        std::string& piece = parser->get().body();
        if (piece.empty()) return;
        const bool more = !call->handlers.on_body || call->handlers.on_body(piece);
        piece.clear();
        if (!more) call->cancelled = true;
      };
      deliver();  // body bytes that came with the header
      check_cancelled(*call);
      while (!parser->is_done()) {
        error_code ec;
        stream->expires_after(r.timeout);
        co_await http::async_read_some(*stream, buffer, *parser, asio::redirect_error(kAwait, ec));
        check_cancelled(*call);
        if (ec) throw CallFailed{describe("cannot read the response body", ec)};
        // Beast parses a chunked body one chunk per call: parse what this read brought as far
        // as it goes, so one read reaches on_body (and a relay's client) as one piece.
        while (buffer.size() > 0 && !parser->is_done()) {
          error_code pec;
          const size_t used = parser->put(buffer.data(), pec);
          buffer.consume(used);
          if (pec == http::error::need_more || used == 0) break;
          if (pec) throw CallFailed{describe("cannot read the response body", pec)};
        }
        deliver();
        check_cancelled(*call);
      }
      call->stream = nullptr;
      if (parser->get().keep_alive()) put_idle(key(r), std::move(stream));
    } catch (const CallFailed& f) {
      error = f.reason;
    } catch (const std::exception& e) {
      error = e.what();
    }
    call->stream = nullptr;
    stream.reset();  // a failed or cancelled connection is never reused
    {
      std::lock_guard lock(mutex_);
      calls_.erase(call->id);  // before on_done: in_flight() is 0 once the caller learns it
    }
    idle_cv_.notify_all();  // before on_done, which may throw
    try {
      if (call->handlers.on_done) call->handlers.on_done(error);
    } catch (const std::exception&) {
      // The caller's bug, not the call's: the call is over either way.
    }
  }

  AsyncHttpClientOptions options_;
  std::unique_ptr<asio::io_context> own_ctx_;  // none when running on a server's threads
  asio::io_context& ctx_;
  asio::strand<asio::io_context::executor_type> strand_;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work_;
  std::map<std::string, std::vector<Stream>> idle_;  // io thread only
  std::atomic<uint64_t> opened_{0};
  mutable std::mutex mutex_;
  std::condition_variable idle_cv_;
  std::unordered_map<CallId, std::shared_ptr<Call>> calls_;
  CallId next_id_ = 0;
  bool stopping_ = false, shut_down_ = false;
  std::atomic<bool> used_{false};  // a call was ever started
  std::thread thread_;             // own io thread only; started once everything above exists
};

AsyncHttpClient::AsyncHttpClient(AsyncHttpClientOptions options)
    : impl_(std::make_unique<Impl>(options)) {}
AsyncHttpClient::AsyncHttpClient(HttpServer& server, AsyncHttpClientOptions options)
    : impl_(std::make_unique<Impl>(server.io_context(), options)) {}
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
