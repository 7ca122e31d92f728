#include "gateway/engine_get.h"

#include <memory>
#include <utility>

namespace tandem::gateway {

Upstream::CallId get_whole_answer(Upstream& upstream, net::AsyncHttpRequest request,
                                  size_t max_body, std::function<void(EngineAnswer)> done) {
  request.method = "GET";
  return whole_answer(upstream, std::move(request), max_body, std::move(done));
}

Upstream::CallId whole_answer(Upstream& upstream, net::AsyncHttpRequest request, size_t max_body,
                              std::function<void(EngineAnswer)> done) {
  auto answer = std::make_shared<EngineAnswer>();
  net::AsyncHttpHandlers h;
  h.on_head = [answer](int status, const net::Headers&) { answer->status = status; };
  h.on_body = [answer, max_body](std::string_view piece) {
    answer->body.append(piece);
    return answer->body.size() <= max_body;
  };
  h.on_done = [answer, done = std::move(done)](const std::string& error) {
    answer->error = error;
    done(std::move(*answer));
  };
  return upstream.start(std::move(request), std::move(h));
}

}  // namespace tandem::gateway
