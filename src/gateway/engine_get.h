#pragma once
// A call to an engine whose whole answer the gateway reads (a load report, a model list, what it
// relays to a client: a GET, or a POST such as /tokenize): collected up to a size, then handed
// over at once.
#include <cstddef>
#include <functional>
#include <string>

#include "gateway/seams.h"

namespace tandem::gateway {

struct EngineAnswer {
  std::string error;  // the call's transport error; empty: it answered
  int status = 0;
  std::string body;
  // The body went past the size the caller reads: the call was cut, `error` names the limit
  // ("the answer is larger than 1 MiB, ...") and `body` is partial. The engine answered, so this
  // is no transport failure.
  bool too_large = false;
};

// Starts `request` (its method and body as given); `done` gets the answer once, on the thread
// that ends the call. A body past `max_body` bytes ends the call, too_large.
Upstream::CallId whole_answer(Upstream& upstream, net::AsyncHttpRequest request, size_t max_body,
                              std::function<void(EngineAnswer)> done);
// The same for a GET (the request's method is set to it).
Upstream::CallId get_whole_answer(Upstream& upstream, net::AsyncHttpRequest request,
                                  size_t max_body, std::function<void(EngineAnswer)> done);

}  // namespace tandem::gateway
