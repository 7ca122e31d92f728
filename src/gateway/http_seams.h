#pragma once
// The running gateway's seams (seams.h) over its HTTP stack: engines are called with the
// asynchronous HTTP client, clients are answered through the server's exchanges
// (net::ExchangeReply, net/reply.h), and with one io thread the scheduling runs on it
// (IoThreadExecutor).
#include <memory>
#include <string>

#include "gateway/seams.h"
#include "net/async_http_client.h"
#include "net/http_server.h"
#include "net/loop_tasks.h"

namespace tandem::gateway {

class HttpUpstream final : public Upstream {
 public:
  // `engine_api_key`: sent as the Bearer token of every call (engines started with --api-key);
  // empty: calls carry what their builder put (a client's own Authorization, or none).
  explicit HttpUpstream(net::AsyncHttpClient& client, std::string engine_api_key = {})
      : client_(client), engine_api_key_(std::move(engine_api_key)) {}
  CallId start(net::AsyncHttpRequest request, net::AsyncHttpHandlers handlers) override;
  void cancel(CallId id) override;

 private:
  net::AsyncHttpClient& client_;
  const std::string engine_api_key_;
};

// One call to engine `engine_name` (`request`: method, host, port, target, headers, body,
// timeout) answered to `ex` as the engine answered it (up to 16 MiB of body), or 502 when the
// call failed or the engine's status is outside 200..599. An error status with a body that is no
// OpenAI error is answered with the gateway's own, quoting it (read_engine_error), as a request's
// error answer is. Any thread.
void relay_engine_call(Upstream& upstream, net::AsyncHttpRequest request,
                       const std::string& engine_name, std::shared_ptr<net::Exchange> ex);

// The scheduling on the server's first io thread (net/loop_tasks.h): with one io thread the
// gateway then serves a request on that one thread, without waking a scheduling thread twice per
// request; posts from the loop itself batch at the end of its iteration.
class IoThreadExecutor final : public Executor {
 public:
  explicit IoThreadExecutor(net::HttpServer& server) : tasks_(server, 0) {}
  Clock::time_point now() const override { return Clock::now(); }
  void post(Task task) override { tasks_.post(std::move(task)); }
  void post_batched(Task task) override { tasks_.post(std::move(task)); }
  void set_busy(bool) override {}
  TimerId at(Clock::time_point when, Task task) override {
    return {when, tasks_.at(when, std::move(task))};
  }
  void cancel(TimerId id) override {
    if (id.seq != 0) tasks_.cancel(id.when, id.seq);
  }

 private:
  net::LoopTasks tasks_;
};

}  // namespace tandem::gateway
