#include "gateway/http_seams.h"

#include "gateway/answer_text.h"

namespace tandem::gateway {

Upstream::CallId HttpUpstream::start(net::AsyncHttpRequest request,
                                     net::AsyncHttpHandlers handlers) {
  if (!engine_api_key_.empty()) request.headers.set("Authorization", "Bearer " + engine_api_key_);
  return client_.start(std::move(request), std::move(handlers));
}

void HttpUpstream::cancel(CallId id) {
  client_.cancel(id);
}

void relay_engine_get(Upstream& upstream, net::AsyncHttpRequest request,
                      std::shared_ptr<net::Exchange> ex) {
  request.method = "GET";
  auto answer = std::make_shared<std::pair<int, std::string>>();
  net::AsyncHttpHandlers h;
  h.on_head = [answer](int s, const net::Headers&) { answer->first = s; };
  h.on_body = [answer](std::string_view p) {
    answer->second += p;
    return answer->second.size() <= (size_t{16} << 20);
  };
  h.on_done = [ex, answer](const std::string& error) {
    if (!error.empty()) {
      ex->send_error(502, "engine failed: " + error, "server_error");
    } else if (answer->first < 200 || answer->first > 599) {
      // Not a status to pass on: the server would refuse a 1xx as final, and no client knows
      // what a status past 599 means.
      ex->send_error(502, "engine answered HTTP " + std::to_string(answer->first), "server_error");
    } else if (answer->first < 400) {
      ex->respond(answer->first, answer->second, "application/json");
    } else if (const EngineError said = read_engine_error(answer->second); said.relay) {
      ex->respond(answer->first, answer->second, "application/json");
    } else {
      // As a leg's error answer: the gateway's own OpenAI error, quoting what the engine said.
      const int status = answer->first < 500 ? answer->first : 502;
      ex->send_error(status,
                     "engine answered HTTP " + std::to_string(answer->first) +
                         (said.text.empty() ? "" : ": " + said.text),
                     status < 500 ? "" : "server_error");
    }
  };
  upstream.start(std::move(request), std::move(h));
}

}  // namespace tandem::gateway
