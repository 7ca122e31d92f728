#pragma once
// The gateway's Upstream seam (gateway/seams.h) in the cluster simulator: a call to "HOST:PORT"
// goes to the simulated engine registered under that address, in virtual time, and the engine's
// answer comes back through the call's handlers as the HTTP client would deliver it (head, body
// pieces, done), within the request's timeout as the client bounds it (the wait for the head, and
// each wait for the next piece of the body). No sockets; calls to an unknown address fail as a
// refused connection would.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "gateway/seams.h"
#include "sim/simulated_engine.h"
#include "sim/virtual_time.h"

namespace tandem::sim {

// What a server answers when a handler sends an error: the OpenAI error response
// (api::openai_error_response), through `reply`'s respond(). For Reply implementations here.
bool respond_with_error(net::Reply& reply, int status, std::string_view message,
                        std::string_view type, std::string_view code);

class VirtualUpstream final : public gateway::Upstream {
 public:
  // Requests reach an engine one after another, each after its body's bytes at
  // `body_bytes_per_s` (sending and parsing it on the engine's HTTP thread; 0: at once), as on a
  // live engine, where a 100K-token prompt's JSON takes milliseconds and what follows waits.
  explicit VirtualUpstream(gateway::Executor& clock, double body_bytes_per_s = 0)
      : clock_(clock), body_bytes_per_s_(body_bytes_per_s) {}

  // `engine` answers calls to host:port; it must outlive the upstream's calls.
  void add(const std::string& host, uint16_t port, SimulatedEngine* engine);

  CallId start(net::AsyncHttpRequest request, net::AsyncHttpHandlers handlers) override;
  void cancel(CallId id) override;

  // The engine at host:port died: its open calls end with a reset connection, and calls to it
  // are refused from now on.
  void kill(const std::string& host, uint16_t port);

  int64_t calls() const { return calls_; }
  int64_t timeouts() const { return timeouts_; }  // calls that ended by their timeout

 private:
  class CallReply;
  gateway::Executor& clock_;
  double body_bytes_per_s_;
  std::map<std::string, BodyLine> lines_;            // each engine's HTTP thread, by "host:port"
  std::map<std::string, SimulatedEngine*> engines_;  // by "host:port"
  std::map<CallId, std::shared_ptr<CallReply>> open_;
  std::map<CallId, std::string> address_of_;  // open calls' engine, "host:port"
  CallId next_ = 0;
  int64_t calls_ = 0, timeouts_ = 0;
};

}  // namespace tandem::sim
