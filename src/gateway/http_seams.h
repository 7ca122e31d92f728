#pragma once
// The running gateway's seams (seams.h) over its HTTP stack: engines are called with the
// asynchronous HTTP client, clients are answered through the server's exchanges.
#include <memory>

#include "gateway/seams.h"
#include "net/async_http_client.h"
#include "net/http_server.h"

namespace tandem::gateway {

class HttpUpstream final : public Upstream {
 public:
  explicit HttpUpstream(net::AsyncHttpClient& client) : client_(client) {}
  CallId start(net::AsyncHttpRequest request, net::AsyncHttpHandlers handlers) override;
  void cancel(CallId id) override;

 private:
  net::AsyncHttpClient& client_;
};

class ExchangeReply final : public ClientReply {
 public:
  explicit ExchangeReply(std::shared_ptr<net::Exchange> exchange)
      : exchange_(std::move(exchange)) {}
  bool respond(int status, std::string body, std::string content_type) override;
  bool send_error(int status, std::string_view message, std::string_view type,
                  std::string_view code) override;
  bool start_stream(int status, std::string content_type) override;
  bool write(std::string_view chunk) override;
  bool end() override;
  void abort() override;
  void on_close(std::function<void()> callback) override;

 private:
  std::shared_ptr<net::Exchange> exchange_;
};

}  // namespace tandem::gateway
