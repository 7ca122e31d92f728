#pragma once
// The answering side of one HTTP request, as code that produces a response sees it: the server's
// exchange (net::Exchange, through ExchangeReply) or, in unit tests and the cluster simulator,
// anything else that takes the same calls without a socket. The gateway answers its clients
// through it, and the engine's generation API answers the gateway's legs through it.
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "net/http.h"

namespace tandem::net {

class Exchange;

// Methods that send return false and do nothing once the client cannot take that call any more
// (gone, or already answered). Thread-safe (net::Exchange's contract).
class Reply {
 public:
  virtual ~Reply() = default;
  virtual bool respond(int status, std::string body, std::string content_type) = 0;
  // An OpenAI error body (api/error.h) with this status, message, type and code.
  virtual bool send_error(int status, std::string_view message, std::string_view type = {},
                          std::string_view code = {}) = 0;
  // respond() with extra header fields (the gateway's Retry-After on an overload answer, or an
  // engine's on its refusal). A reply that keeps no header fields (a test's, the simulator's)
  // answers as respond() does, without them; one choice of several (ChoiceMerger's Part) passes
  // them on with its failure to the client's answer.
  virtual bool respond_with_headers(HttpResponse response) {
    return respond(response.status, std::move(response.body), std::move(response.content_type));
  }
  virtual bool start_stream(int status, std::string content_type) = 0;
  virtual bool write(std::string_view chunk) = 0;
  virtual bool end() = 0;    // the stream is complete
  virtual void abort() = 0;  // cuts a stream (or answers 500 when nothing was sent)
  // Runs once if the client goes away before the reply is complete (right away if it already
  // has); quick and non-blocking, as it may run on an io thread.
  virtual void on_close(std::function<void()> callback) = 0;
};

// A Reply through the HTTP server's exchange.
class ExchangeReply final : public Reply {
 public:
  explicit ExchangeReply(std::shared_ptr<Exchange> exchange) : exchange_(std::move(exchange)) {}
  bool respond(int status, std::string body, std::string content_type) override;
  bool send_error(int status, std::string_view message, std::string_view type,
                  std::string_view code) override;
  bool respond_with_headers(HttpResponse response) override;
  bool start_stream(int status, std::string content_type) override;
  bool write(std::string_view chunk) override;
  bool end() override;
  void abort() override;
  void on_close(std::function<void()> callback) override;

 private:
  std::shared_ptr<Exchange> exchange_;
};

}  // namespace tandem::net
