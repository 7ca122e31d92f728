#include "gateway/http_seams.h"

#include "gateway/answer_text.h"
#include "gateway/engine_get.h"

namespace tandem::gateway {

Upstream::CallId HttpUpstream::start(net::AsyncHttpRequest request,
                                     net::AsyncHttpHandlers handlers) {
  if (!engine_api_key_.empty()) request.headers.set("Authorization", "Bearer " + engine_api_key_);
  return client_.start(std::move(request), std::move(handlers));
}

void HttpUpstream::cancel(CallId id) {
  client_.cancel(id);
}

void relay_engine_call(Upstream& upstream, net::AsyncHttpRequest request,
                       const std::string& engine_name, std::shared_ptr<net::Exchange> ex) {
  const std::string engine = "engine " + engine_name;
  whole_answer(upstream, std::move(request), size_t{16} << 20, [ex, engine](const EngineAnswer& a) {
    if (!a.error.empty()) {
      ex->send_error(502, engine + " failed: " + a.error, "server_error");
    } else if (a.status < 200 || a.status > 599) {
      // Not a status to pass on: the server would refuse a 1xx as final, and no
      // client knows what a status past 599 means.
      ex->send_error(502, engine + " answered HTTP " + std::to_string(a.status), "server_error");
    } else if (a.status < 400) {
      ex->respond(a.status, a.body, "application/json");
    } else if (const EngineError said = read_engine_error(a.body); said.relay) {
      ex->respond(a.status, a.body, "application/json");
    } else {
      // As a leg's error answer: the gateway's own OpenAI error, quoting what the
      // engine said.
      const int status = a.status < 500 ? a.status : 502;
      ex->send_error(status,
                     engine + " answered HTTP " + std::to_string(a.status) +
                         (said.text.empty() ? "" : ": " + said.text),
                     status < 500 ? "" : "server_error");
    }
  });
}

}  // namespace tandem::gateway
