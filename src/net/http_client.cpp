#include "net/http_client.h"

#include <utility>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http.hpp>

#include <cstdint>
#include <limits>
#include <optional>

#include "util/error.h"

namespace tandem::net {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = boost::beast::http;
using tcp = asio::ip::tcp;
using boost::system::error_code;

class HttpClient::Impl {
 public:
  Impl(std::string host, uint16_t port, std::chrono::milliseconds timeout)
      : host_(std::move(host)), port_(port), timeout_(timeout) {}

  HttpClientResponse request(std::string_view method, std::string_view target,
                             std::string_view body, const Headers& headers,
                             const BodyCallback* on_body) {
    http::request<http::string_body> req;
    req.method_string(beast::string_view(method.data(), method.size()));
    req.target(beast::string_view(target.data(), target.size()));
    req.version(11);
    req.set(http::field::host, host_ + ":" + std::to_string(port_));
    for (const auto& [name, value] : headers) req.insert(name, value);
    if (!body.empty() && !headers.contains("Content-Type")) {
      req.set(http::field::content_type, "application/json");
    }
    req.body() = std::string(body);
    req.prepare_payload();
    what_ = std::string(method) + " http://" + host_ + ":" + std::to_string(port_) +
            std::string(target);

    // A reused connection may have been closed by the server while idle (its keep-alive
    // timeout); then the request never reached it and is sent again on a new connection.
    bool reused = stream_.has_value();
    for (int attempt = 0;; ++attempt) {
      try {
        return exchange(req, on_body);
      } catch (const StaleConnection&) {
        close();
        if (!reused || attempt > 0) fail("the server closed the connection", {});
      }
    }
  }

  void close() {
    if (stream_) {
      error_code ec;
      stream_->socket().shutdown(tcp::socket::shutdown_both, ec);
      stream_->socket().close(ec);
      stream_.reset();
    }
    buffer_.clear();
  }

 private:
  struct StaleConnection {};

  [[noreturn]] void fail(std::string_view step, error_code ec) {
    close();
    std::string message = "HTTP " + what_ + ": " + std::string(step);
    if (ec) message += ": " + ec.message();
    throw Error(message);
  }

  // Runs the io_context until the operation started before completes. The stream's timer
  // (expires_after) turns a stalled operation into error::timeout.
  void run() {
    io_.restart();
    io_.run();
  }

  void connect() {
    tcp::resolver resolver(io_);
    error_code ec;
    auto endpoints = resolver.resolve(host_, std::to_string(port_), ec);
    if (ec) fail("cannot resolve host", ec);
    stream_.emplace(io_);
    stream_->expires_after(timeout_);
    stream_->async_connect(endpoints, [&](error_code e, const tcp::endpoint&) { ec = e; });
    run();
    if (ec) fail("cannot connect", ec);
    stream_->socket().set_option(tcp::no_delay(true), ec);
  }

  HttpClientResponse exchange(http::request<http::string_body>& req, const BodyCallback* on_body) {
    bool fresh = !stream_;
    if (fresh) connect();
    error_code ec;
    stream_->expires_after(timeout_);
    http::async_write(*stream_, req, [&](error_code e, size_t) { ec = e; });
    run();
    if (ec) {
      if (!fresh) throw StaleConnection{};
      fail("cannot send the request", ec);
    }

    http::response_parser<http::string_body> parser;
    // Unlimited. Not boost::none: Beast 1.74 compares the length against an empty optional as
    // if it were below every value, so none would reject every body.
    parser.body_limit(std::numeric_limits<std::uint64_t>::max());
    // For a plain request this deadline covers the whole response; a stream renews it for
    // every piece below.
    stream_->expires_after(timeout_);
    http::async_read_header(*stream_, buffer_, parser, [&](error_code e, size_t) { ec = e; });
    run();
    if (ec == http::error::end_of_stream && !fresh) throw StaleConnection{};
    if (ec) fail("cannot read the response header", ec);

    HttpClientResponse response;
    response.status = static_cast<int>(parser.get().result_int());
    for (const auto& field : parser.get()) {
      response.headers.add(std::string(field.name_string()), std::string(field.value()));
    }
    while (!parser.is_done()) {
      if (on_body) stream_->expires_after(timeout_);
      http::async_read_some(*stream_, buffer_, parser, [&](error_code e, size_t) { ec = e; });
      run();
      if (ec) fail("cannot read the response body", ec);
      if (on_body) {
        std::string& piece = parser.get().body();
        if (!piece.empty()) {
          bool more = (*on_body)(piece);
          piece.clear();
          if (!more) {
            close();
            return response;
          }
        }
      }
    }
    if (!on_body) response.body = std::move(parser.get().body());
    if (!parser.get().keep_alive()) close();
    return response;
  }

  const std::string host_;
  const uint16_t port_;
  const std::chrono::milliseconds timeout_;
  std::string what_;  // "METHOD url" for error messages
  asio::io_context io_;
  std::optional<beast::tcp_stream> stream_;
  beast::flat_buffer buffer_;
};

HttpClient::HttpClient(std::string host, uint16_t port, std::chrono::milliseconds timeout)
    : impl_(std::make_unique<Impl>(std::move(host), port, timeout)) {}

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
