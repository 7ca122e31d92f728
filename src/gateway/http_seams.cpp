#include "gateway/http_seams.h"

namespace tandem::gateway {

Upstream::CallId HttpUpstream::start(net::AsyncHttpRequest request,
                                     net::AsyncHttpHandlers handlers) {
  if (!engine_api_key_.empty()) request.headers.set("Authorization", "Bearer " + engine_api_key_);
  return client_.start(std::move(request), std::move(handlers));
}

void HttpUpstream::cancel(CallId id) {
  client_.cancel(id);
}

}  // namespace tandem::gateway
