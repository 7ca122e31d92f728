#include "gateway/engine_get.h"

#include <memory>
#include <string>
#include <utility>

namespace tandem::gateway {
namespace {

std::string size_text(size_t bytes) {
  if (bytes % (size_t{1} << 20) == 0) return std::to_string(bytes >> 20) + " MiB";
  return std::to_string(bytes) + " bytes";
}

}  // namespace

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
    answer->too_large = answer->body.size() > max_body;
    return !answer->too_large;
  };
  h.on_done = [answer, max_body, done = std::move(done)](const std::string& error) {
    // The cut's own error ("cancelled") would read as the engine's failure.
    answer->error = answer->too_large ? "the answer is larger than " + size_text(max_body) +
                                            ", the most the gateway reads of it"
                                      : error;
    done(std::move(*answer));
  };
  return upstream.start(std::move(request), std::move(h));
}

}  // namespace tandem::gateway
