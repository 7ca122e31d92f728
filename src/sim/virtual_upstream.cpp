#include "sim/virtual_upstream.h"

#include <algorithm>
#include <vector>

#include "api/error.h"

namespace tandem::sim {

bool respond_with_error(net::Reply& reply, int status, std::string_view message,
                        std::string_view type, std::string_view code) {
  net::HttpResponse r = api::openai_error_response(status, message, type, code);
  return reply.respond(r.status, std::move(r.body), std::move(r.content_type));
}

// One call's answer: the engine's replies turned into the handlers' calls. It ends once (done,
// cancelled or cut), and then forgets its call in the upstream.
class VirtualUpstream::CallReply final : public net::Reply {
 public:
  CallReply(VirtualUpstream& owner, CallId id, net::AsyncHttpHandlers handlers,
            gateway::Executor::Clock::duration timeout)
      : owner_(owner), id_(id), handlers_(std::move(handlers)), timeout_(timeout) {
    deadline_ = owner_.clock_.now() + timeout_;
    arm();
  }

  bool respond(int status, std::string body, std::string content_type) override {
    if (state_ != State::kOpen) return false;
    head(status, content_type);
    if (!body.empty() && handlers_.on_body && !handlers_.on_body(body)) {
      close("cancelled");
      return false;
    }
    finish({});
    return true;
  }
  bool send_error(int status, std::string_view message, std::string_view type,
                  std::string_view code) override {
    return respond_with_error(*this, status, message, type, code);
  }
  bool start_stream(int status, std::string content_type) override {
    if (state_ != State::kOpen) return false;
    head(status, content_type);
    state_ = State::kStreaming;
    return true;
  }
  bool write(std::string_view chunk) override {
    if (state_ != State::kStreaming) return false;
    deadline_ = owner_.clock_.now() + timeout_;  // each wait for the next piece is bounded
    if (!chunk.empty() && handlers_.on_body && !handlers_.on_body(chunk)) {
      close("cancelled");
      return false;
    }
    return true;
  }
  bool end() override {
    if (state_ != State::kStreaming) return false;
    finish({});
    return true;
  }
  void abort() override {
    if (state_ == State::kOpen) {
      respond(500, api::openai_error_body("the engine gave up on this request", "server_error"),
              "application/json");
      return;
    }
    if (state_ == State::kStreaming) finish("the connection was closed mid-stream");
  }
  void on_close(std::function<void()> callback) override {
    if (state_ == State::kClosed)
      callback();
    else if (state_ != State::kDone)
      on_close_.push_back(std::move(callback));
  }

  // The engine died: the call ends with this transport error, whatever it had sent.
  void reset(const std::string& why) {
    if (state_ == State::kDone || state_ == State::kClosed) return;
    state_ = State::kDone;
    on_close_.clear();
    done(why);
  }

  // No engine at the address: the call fails before it connects.
  void refuse(const std::string& why) {
    if (state_ != State::kOpen) return;
    if (handlers_.on_failure) handlers_.on_failure(net::CallFailure::kNotConnected);
    finish(why);
  }

  // Its request reached the engine (still queued on its virtual line, it did not).
  bool delivered = false;

  // The caller gave up (Upstream::cancel, or its handler stopped reading).
  void close(const std::string& why) {
    if (state_ == State::kDone || state_ == State::kClosed) return;
    state_ = State::kClosed;
    auto callbacks = std::move(on_close_);
    for (auto& c : callbacks) c();
    done(why);
  }

 private:
  enum class State { kOpen, kStreaming, kDone, kClosed };

  // One timer per call, moved on lazily: it fires at the deadline it was armed for and re-arms
  // when a piece has arrived since (cheaper than re-arming on every piece of a stream).
  void arm() {
    timer_ = owner_.clock_.at(deadline_, [owner = &owner_, id = id_] {
      auto it = owner->open_.find(id);
      if (it != owner->open_.end()) it->second->on_timer();
    });
  }
  void on_timer() {
    if (state_ == State::kDone || state_ == State::kClosed) return;
    if (owner_.clock_.now() < deadline_) return arm();
    ++owner_.timeouts_;
    close(state_ == State::kOpen ? "cannot read the response header: timed out"
                                 : "cannot read the response body: timed out");
  }

  void head(int status, const std::string& content_type) {
    deadline_ = owner_.clock_.now() + timeout_;
    net::Headers h;
    h.set("Content-Type", content_type);
    if (handlers_.on_head) handlers_.on_head(status, h);
  }
  void finish(const std::string& error) {
    state_ = State::kDone;
    on_close_.clear();
    done(error);
  }
  void done(const std::string& error) {
    owner_.clock_.cancel(timer_);
    auto on_done = std::move(handlers_.on_done);
    handlers_ = {};
    owner_.address_of_.erase(id_);
    owner_.open_.erase(id_);  // may destroy this object: nothing below touches it
    if (on_done) on_done(error);
  }

  VirtualUpstream& owner_;
  CallId id_;
  net::AsyncHttpHandlers handlers_;
  State state_ = State::kOpen;
  std::vector<std::function<void()>> on_close_;
  gateway::Executor::Clock::duration timeout_;
  gateway::Executor::Clock::time_point deadline_;
  gateway::Executor::TimerId timer_;
};

void VirtualUpstream::add(const std::string& host, uint16_t port, SimulatedEngine* engine) {
  engines_[host + ":" + std::to_string(port)] = engine;
}

gateway::Upstream::CallId VirtualUpstream::start(net::AsyncHttpRequest request,
                                                 net::AsyncHttpHandlers handlers) {
  const CallId id = ++next_;
  ++calls_;
  auto reply = std::make_shared<CallReply>(*this, id, std::move(handlers), request.timeout);
  open_[id] = reply;
  address_of_[id] = request.host + ":" + std::to_string(request.port);
  // As the HTTP client does, the call proceeds after start() returned; it reaches the engine
  // after the requests before it and its own body.
  const std::string address = request.host + ":" + std::to_string(request.port);
  const VirtualClock::time_point arrives =
      lines_.try_emplace(address, body_bytes_per_s_)
          .first->second.done_at(clock_.now(), request.body.size());
  const bool queued = arrives > clock_.now();
  auto deliver = [this, id, request = std::move(request)] {
    auto it = open_.find(id);
    if (it == open_.end()) return;  // cancelled before it left
    std::shared_ptr<CallReply> reply = it->second;
    auto engine = engines_.find(request.host + ":" + std::to_string(request.port));
    if (engine == engines_.end()) {
      // As the HTTP client reports a refused connection: the engine never saw the request, which
      // the gateway reads to send a sequential decode leg to another engine with the same KV.
      reply->refuse("connection refused: no simulated engine at " + request.host + ":" +
                    std::to_string(request.port));
      return;
    }
    reply->delivered = true;
    engine->second->call(request, reply);
  };
  if (queued)
    clock_.at(arrives, std::move(deliver));
  else
    clock_.post(std::move(deliver));
  return id;
}

void VirtualUpstream::kill(const std::string& host, uint16_t port) {
  const std::string address = host + ":" + std::to_string(port);
  engines_.erase(address);
  std::vector<std::shared_ptr<CallReply>> cut;
  for (const auto& [id, where] : address_of_)
    if (where == address) cut.push_back(open_.at(id));
  for (auto& reply : cut) clock_.post([reply] { reply->reset("connection reset by peer"); });
}

void VirtualUpstream::cancel(CallId id) {
  auto it = open_.find(id);
  if (it == open_.end()) return;
  std::shared_ptr<CallReply> reply = it->second;
  // on_done comes after cancel() returned, as with the HTTP client. A call still queued on its
  // line never reached the engine: reported as the HTTP client reports a call cancelled before it
  // connected (kNotConnected), so the gateway lets go of a decode leg's KV that no engine took.
  clock_.post([reply] {
    if (!reply->delivered) {
      reply->refuse("cancelled");
      return;
    }
    reply->close("cancelled");
  });
}

}  // namespace tandem::sim
