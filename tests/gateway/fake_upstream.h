#pragma once
// The gateway's Upstream as the gateway's in-process tests fake it: engines whose calls stay open
// until the test answers or ends them, on whatever clock the test drives. For dispatcher_test and
// health_test.
#include <memory>
#include <string>
#include <vector>

#include "gateway/seams.h"
#include "net/async_http_client.h"
#include "net/http.h"

namespace tandem::gateway {

// Engines whose calls the test answers. cancel() reports back at once, as the real client may.
class FakeEngines final : public Upstream {
 public:
  struct Call {
    CallId id = 0;
    net::AsyncHttpRequest request;
    net::AsyncHttpHandlers handlers;
    bool done = false, cancelled = false;
    // Its connection is still being made: cancelled, it reports that it never connected, as
    // net::AsyncHttpClient does.
    bool connecting = false;
  };

  CallId start(net::AsyncHttpRequest request, net::AsyncHttpHandlers handlers) override {
    auto c = std::make_shared<Call>();
    c->id = ++next_;
    c->request = std::move(request);
    c->handlers = std::move(handlers);
    calls_.push_back(c);
    return c->id;
  }
  void cancel(CallId id) override {
    for (auto& c : calls_)
      if (c->id == id && !c->done) {
        c->cancelled = true;
        if (c->connecting) {
          c->done = true;
          if (c->handlers.on_failure) c->handlers.on_failure(net::CallFailure::kNotConnected);
          if (c->handlers.on_done) c->handlers.on_done("cancelled");
          continue;
        }
        if (answer_after_cancel) continue;
        if (answer_crossing_cancel.empty())
          finish(*c, "cancelled");
        else
          answer(*c, answer_crossing_cancel_status, answer_crossing_cancel);
      }
  }
  // When set, a call the gateway cancels had its whole answer on the way already: the call ends
  // with that answer (the answer and the cancel crossed, as they may on the real client).
  std::string answer_crossing_cancel;
  int answer_crossing_cancel_status = 200;
  // When set, a call the gateway cancels stays open for the test to end: its answer crossed the
  // cancel and arrives later (on the real client, another io thread's, after the scheduler moved
  // on).
  bool answer_after_cancel = false;

  // The calls not yet answered to `target` (e.g. "/v1/completions"), oldest first.
  // A call's target without its query (a load poll asks for the steps after one it saw).
  static std::string path_of(const std::string& target) {
    return target.substr(0, target.find('?'));
  }
  std::vector<std::shared_ptr<Call>> open(const std::string& target = {}) const {
    std::vector<std::shared_ptr<Call>> out;
    for (const auto& c : calls_)
      if (!c->done && (target.empty() || path_of(c->request.target) == target)) out.push_back(c);
    return out;
  }
  std::vector<std::shared_ptr<Call>> all(const std::string& target) const {
    std::vector<std::shared_ptr<Call>> out;
    for (const auto& c : calls_)
      if (path_of(c->request.target) == target) out.push_back(c);
    return out;
  }
  // The calls not yet answered to `host`'s `target`.
  std::vector<std::shared_ptr<Call>> open(const std::string& host,
                                          const std::string& target) const {
    std::vector<std::shared_ptr<Call>> out;
    for (const auto& c : open(target))
      if (c->request.host == host) out.push_back(c);
    return out;
  }
  // Answers `host`'s one open call to `target` (a reader that wants no more of the body ends it,
  // as the HTTP client does); false when there is none or several.
  bool answer(const std::string& host, const std::string& target, int status,
              const std::string& body) {
    const auto calls = open(host, target);
    if (calls.size() != 1) return false;
    head(*calls[0], status, "application/json");
    finish(*calls[0], piece(*calls[0], body) ? "" : "cancelled");
    return true;
  }

  static void answer(Call& c, int status, const std::string& body,
                     const std::string& content_type = "application/json") {
    head(c, status, content_type);
    piece(c, body);
    finish(c, "");
  }
  // The engine refuses the call (429 or 503) saying when to come back (Retry-After, seconds).
  static void refuse(Call& c, int status, const std::string& body, const std::string& retry_after) {
    net::Headers h;
    h.set("Content-Type", "application/json");
    h.set("Retry-After", retry_after);
    if (c.handlers.on_head) c.handlers.on_head(status, h);
    piece(c, body);
    finish(c, "");
  }
  static void head(Call& c, int status, const std::string& content_type) {
    net::Headers h;
    h.set("Content-Type", content_type);
    if (c.handlers.on_head) c.handlers.on_head(status, h);
  }
  static bool piece(Call& c, const std::string& bytes) {
    return !c.handlers.on_body || c.handlers.on_body(bytes);
  }
  // The engine's stream: `events` (whole SSE text), then the call ends as the real client ends
  // it: "cancelled" when the gateway's on_body cut it, else by itself.
  static void stream(Call& c, const std::string& events) {
    head(c, 200, "text/event-stream");
    finish(c, piece(c, events) ? "" : "cancelled");
  }
  static void finish(Call& c, const std::string& error) {
    if (c.done) return;
    c.done = true;
    if (!error.empty() && c.handlers.on_failure)
      c.handlers.on_failure(error == "cancelled" ? net::CallFailure::kCancelled
                                                 : net::CallFailure::kUnanswered);
    if (c.handlers.on_done) c.handlers.on_done(error);
  }
  // The call could not connect (as net::AsyncHttpClient reports it): the engine never saw it.
  static void unreachable(Call& c) {
    if (c.done) return;
    c.done = true;
    if (c.handlers.on_failure) c.handlers.on_failure(net::CallFailure::kNotConnected);
    if (c.handlers.on_done) c.handlers.on_done("cannot connect: Connection refused");
  }

 private:
  CallId next_ = 0;
  std::vector<std::shared_ptr<Call>> calls_;
};

}  // namespace tandem::gateway
