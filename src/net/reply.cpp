#include "net/reply.h"

#include "net/http_server.h"

namespace tandem::net {

bool ExchangeReply::respond(int status, std::string body, std::string content_type) {
  return exchange_->respond(status, std::move(body), std::move(content_type));
}

bool ExchangeReply::send_error(int status, std::string_view message, std::string_view type,
                               std::string_view code) {
  return exchange_->send_error(status, message, type, code);
}

bool ExchangeReply::respond_with_headers(HttpResponse response) {
  return exchange_->respond(std::move(response));
}

bool ExchangeReply::start_stream(int status, std::string content_type) {
  return exchange_->start_stream(status, std::move(content_type));
}

bool ExchangeReply::write(std::string_view chunk) {
  return exchange_->write(chunk);
}

bool ExchangeReply::end() {
  return exchange_->end();
}

void ExchangeReply::abort() {
  exchange_->abort();
}

void ExchangeReply::on_close(std::function<void()> callback) {
  exchange_->on_close(std::move(callback));
}

}  // namespace tandem::net
