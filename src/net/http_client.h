#pragma once
// A small synchronous HTTP/1.1 client: tests, tools, and the gateway's calls to engines. Each call
// blocks the calling thread until the response is read or the timeout passes.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "net/http.h"
#include "util/error.h"

namespace tandem::net {

struct HttpClientResponse {
  int status = 0;
  Headers headers;
  std::string body;  // empty for the streaming calls
};

// Receives the body as it arrives, de-chunked, in pieces of any size. Return false to stop: the
// connection is then closed, which the server sees as a client that went away.
using BodyCallback = std::function<bool(std::string_view piece)>;

struct HttpClientOptions {
  // Bounds connecting, sending the request, and receiving the whole response; for
  // request_stream it bounds the wait for each piece instead of the whole body.
  std::chrono::milliseconds timeout = std::chrono::seconds(30);
  // A kept-alive connection idle this long is closed before the next request, not reused (0: no
  // limit). It stays below the keep-alive of common servers (uvicorn, under vLLM and SGLang,
  // closes an idle connection after 5 s): a POST sent as the server closes fails, since one that
  // went out whole is not sent again.
  std::chrono::milliseconds max_idle_age = std::chrono::seconds(2);
  // The steady time idle ages are measured in; unset, std::chrono::steady_clock. For tests.
  std::function<std::chrono::steady_clock::time_point()> clock;
};

// No connection was made: the host does not resolve, or every address refused, was unreachable
// or never completed the handshake. Nothing listens there; unlike a timeout once connected,
// which a busy server may cause.
class HttpConnectError : public Error {
 public:
  using Error::Error;
};

// One keep-alive connection to host:port, opened on first use and reopened when the server
// closed it. Not thread-safe: one request at a time. Failures (connect, timeout, malformed
// response) throw tandem::Error (HttpConnectError for no connection); an HTTP error status is a
// normal response.
class HttpClient {
 public:
  HttpClient(std::string host, uint16_t port, HttpClientOptions options);
  HttpClient(std::string host, uint16_t port,
             std::chrono::milliseconds timeout = std::chrono::seconds(30));
  ~HttpClient();
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  // Sends Host and Content-Length itself, and Content-Type application/json when there is a
  // body and `headers` has no Content-Type.
  HttpClientResponse request(std::string_view method, std::string_view target,
                             std::string_view body = {}, const Headers& headers = {});
  // As request(), but the body goes to `on_body` piece by piece.
  HttpClientResponse request_stream(std::string_view method, std::string_view target,
                                    std::string_view body, const Headers& headers,
                                    const BodyCallback& on_body);
  // Closes the connection (the next request opens a new one).
  void close();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

// One request on a fresh connection.
HttpClientResponse http_request(const std::string& host, uint16_t port, std::string_view method,
                                std::string_view target, std::string_view body = {},
                                const Headers& headers = {},
                                std::chrono::milliseconds timeout = std::chrono::seconds(30));
HttpClientResponse http_request_stream(
    const std::string& host, uint16_t port, std::string_view method, std::string_view target,
    std::string_view body, const Headers& headers, const BodyCallback& on_body,
    std::chrono::milliseconds timeout = std::chrono::seconds(30));

}  // namespace tandem::net
