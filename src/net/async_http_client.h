#pragma once
// An asynchronous HTTP/1.1 client: many requests in flight from one thread. It is the client
// side of the one HTTP stack (its own event loop and parser, hidden here like in http_server.h),
// for callers that keep hundreds of streams open at once: a load generator, or a gateway relaying
// engine streams to its clients (Exchange may be written from this client's thread).
//
// Each call connects, or reuses an idle keep-alive connection to the same host and port, sends
// the request, then calls on_head once with the status and headers, on_body for every piece of
// the body as it arrives (de-chunked), and on_done exactly once: with an empty string when the
// whole response arrived, else with the reason, which on_failure (when set) gets first as a
// CallFailure: how far the call got. All callbacks run on the client's thread, one at a time:
// keep them short and never block in them. cancel() ends a call from any thread; its on_done
// then says "cancelled" (unless the call had already finished).
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "net/http.h"

namespace tandem::net {

struct AsyncHttpRequest {
  std::string host;
  uint16_t port = 0;
  std::string method = "GET";
  std::string target = "/";
  Headers headers;  // Host and Content-Length are set by the client
  std::string body;
  // Bounds connecting, sending, the wait for the response head, and each wait for the next
  // piece of the body: a stream may last any time as long as it keeps moving.
  std::chrono::milliseconds timeout = std::chrono::seconds(30);
  // Bounds connecting alone when set (> 0); else `timeout` does.
  std::chrono::milliseconds connect_timeout{0};
};

// How far a call that failed got: what its server can have seen of it, for callers that decide
// whether sending the request again is safe.
enum class CallFailure {
  // No connection was made (the host did not resolve, refused, or did not answer within the
  // connect timeout; or the call was cancelled, or the client stopped, first): the server never
  // saw the request.
  kNotConnected,
  // Connected, but no response head came (the request failed to send, the connection closed or
  // reset, or the wait timed out): the server may have received and acted on the request.
  kUnanswered,
  // The response began and did not end well (cut, malformed, or a callback threw).
  kAnswerBroken,
  // cancel(), on_body returning false, or the client shutting down, once connected.
  kCancelled,
};

struct AsyncHttpHandlers {
  std::function<void(int status, const Headers& headers)> on_head;
  // Return false to stop reading: the call ends as cancelled and its connection is closed.
  std::function<bool(std::string_view piece)> on_body;
  // A call that failed: how far it got, just before its on_done (never for one that succeeded).
  std::function<void(CallFailure failure)> on_failure;
  std::function<void(const std::string& error)> on_done;
};

struct AsyncHttpClientOptions {
  size_t max_idle_per_host = 64;  // keep-alive connections kept for reuse, per host:port
  size_t max_header_bytes = size_t{64} << 10;
  // A keep-alive connection idle this long is closed when a call would pick it (0: no limit).
  // It stays below the keep-alive of common servers (uvicorn, under vLLM and SGLang, closes an
  // idle connection after 5 s): a request sent as the server closes fails, and a POST that went
  // out whole is not sent again, since it may be running.
  std::chrono::milliseconds max_idle_age = std::chrono::seconds(2);
  // The steady time idle ages are measured in; unset, the client's loop clock. For tests.
  std::function<std::chrono::steady_clock::time_point()> clock;
};

class HttpServer;

class AsyncHttpClient {
 public:
  using CallId = uint64_t;

  // A client with its own io thread.
  explicit AsyncHttpClient(AsyncHttpClientOptions options = {});
  // A client without a thread of its own: it runs on `server`'s io threads, which saves a thread
  // hop per call when a server's handlers relay to upstreams. A call runs on the io thread that
  // started it, or, started from any other thread, on the server's io threads in turn; its
  // callbacks run one at a time on that thread, but calls on different io threads may run their
  // callbacks concurrently. Idle keep-alive connections are kept per io thread. The server must
  // be started for calls to progress, and shutdown() should run before the server stops (its io
  // threads finish the calls); run after, it ends what is left on the calling thread.
  AsyncHttpClient(HttpServer& server, AsyncHttpClientOptions options = {});
  // shutdown(), then joins the client's own thread (if it has one).
  ~AsyncHttpClient();

  // Cancels every call and waits until each on_done ran; closes idle connections. Later
  // start() calls do nothing and return 0 (no callbacks). Idempotent; not from a callback.
  void shutdown();
  AsyncHttpClient(const AsyncHttpClient&) = delete;
  AsyncHttpClient& operator=(const AsyncHttpClient&) = delete;

  // Thread-safe. Starts a call; its callbacks follow on the client's thread.
  CallId start(AsyncHttpRequest request, AsyncHttpHandlers handlers);
  // Thread-safe. Unknown or finished ids are ignored.
  void cancel(CallId id);

  size_t in_flight() const;             // calls started and not yet done
  uint64_t connections_opened() const;  // TCP connections opened so far (reuse shows here)

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::net
