#pragma once
// Scheduling policy of the gateway: pure functions of a view of the cluster, the request and the
// time (injected, never read from a clock here), so that every decision can be replayed in a
// unit test. The scheduling thread builds the view from the state it owns and applies the
// decision; nothing here has state or side effects.
#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

namespace tandem::gateway {

using Clock = std::chrono::steady_clock;

// One engine as the policy sees it.
struct EndpointLoad {
  int id = 0;  // the scheduler's endpoint id
  int group = 0;
  bool eligible = true;          // healthy and not being removed
  int64_t in_flight = 0;         // requests the gateway has sent it that have not finished
  int64_t max_in_flight = 0;     // its limit: at the limit it is saturated
  int64_t tokens_in_flight = 0;  // prompt tokens of those requests (known or estimated)
};

struct ClusterView {
  std::vector<EndpointLoad> prefill, decode;
};

struct RequestInfo {
  int64_t prompt_tokens = 0;
  Clock::time_point arrived;
  std::vector<int> excluded;  // endpoints that already failed this request
};

struct Choice {
  enum class Kind {
    kChosen,        // `endpoint` takes it now
    kSaturated,     // an eligible engine exists but all are at their limit: wait
    kNoneEligible,  // no engine can take it (none healthy, none in the group): fail
  };
  Kind kind = Kind::kNoneEligible;
  int endpoint = -1;
};

class Policy {
 public:
  virtual ~Policy() = default;
  virtual const char* name() const = 0;
  // The prefill engine for a request (P/D modes).
  virtual Choice choose_prefill(const ClusterView& view, const RequestInfo& request,
                                Clock::time_point now) const = 0;
  // The decode engine; `group` is the chosen prefill engine's group, or -1 for any (aggregated).
  virtual Choice choose_decode(const ClusterView& view, const RequestInfo& request, int group,
                               Clock::time_point now) const = 0;
};

// Parallel mode: a prefill engine and a decode engine of its group, both free now. Tries the
// policy's prefill choices in turn until one has a free decode engine in its group. The result is
// kChosen only when both are; kSaturated if waiting could help; else kNoneEligible.
struct PairChoice {
  Choice::Kind kind = Choice::Kind::kNoneEligible;
  int prefill = -1, decode = -1;
};
PairChoice choose_pair(const Policy& policy, ClusterView view, const RequestInfo& request,
                       Clock::time_point now);

// Fewest requests in flight; ties: fewest prompt tokens in flight, then the lowest id.
std::unique_ptr<Policy> make_least_load_policy();

}  // namespace tandem::gateway
