#include "gateway/http_seams.h"

namespace tandem::gateway {

Upstream::CallId HttpUpstream::start(net::AsyncHttpRequest request,
                                     net::AsyncHttpHandlers handlers) {
  return client_.start(std::move(request), std::move(handlers));
}

void HttpUpstream::cancel(CallId id) {
  client_.cancel(id);
}

}  // namespace tandem::gateway
