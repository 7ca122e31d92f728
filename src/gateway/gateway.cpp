#include "gateway/gateway.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "api/error.h"
#include "gateway/access_log.h"
#include "gateway/admin_api.h"
#include "gateway/dashboard.h"
#include "gateway/dispatcher.h"
#include "gateway/endpoints.h"
#include "gateway/front_end.h"
#include "gateway/gateway_metrics.h"
#include "gateway/health.h"
#include "gateway/http_seams.h"
#include "gateway/policy.h"
#include "gateway/prefix_index.h"
#include "gateway/scheduling_thread.h"
#include "gateway/tokens_in.h"
#include "net/async_http_client.h"
#include "net/http_server.h"
#include "net/loop_tasks.h"
#include "util/error.h"
#include "util/interruptible.h"
#include "util/metrics.h"

namespace tandem::gateway {

namespace {

// The topology's policy. A file's unknown name is refused naming the file and its key, as the
// file's other errors are ("topo.yaml: policy: unknown scheduling policy 'tandom'; ...").
std::unique_ptr<Policy> policy_of(const Topology& t, const std::string& config_path) {
  if (std::string why = unknown_policy_error(t.policy); !why.empty() && !config_path.empty())
    throw Error(config_path + ": policy: " + why);
  return make_policy(t.policy, policy_options(t));
}

}  // namespace

// The parts wired together: who owns what and in which order they start and stop.
class Gateway::Impl {
 public:
  Impl(Topology topology, std::string config_path, std::shared_ptr<AdminReplicas> replicas,
       std::shared_ptr<metrics::RegistryGroup> metrics_group,
       std::shared_ptr<net::ConnectionsPerAddress> connections_per_address)
      : topo_((validate(topology), std::move(topology))),
        policy_(policy_of(topo_, config_path)),
        registry_(topo_.metrics_replica.empty()
                      ? metrics::LabelPairs{}
                      : metrics::LabelPairs{{"gateway_replica", topo_.metrics_replica}},
                  std::move(metrics_group)),
        metrics_(registry_, topo_.served_model_name),
        tokenizer_(topo_.model.empty()
                       ? nullptr
                       : std::make_unique<PromptTokenizer>(topo_.model, topo_.served_model_name)),
        access_log_(topo_.access_log.empty() ? nullptr
                                             : std::make_unique<AccessLog>(
                                                   topo_.access_log, &metrics_.access_log_dropped)),
        server_(server_options(std::move(connections_per_address))),
        client_(server_),
        upstream_(client_, topo_.engine_api_key),
        executor_(make_executor()),
        endpoints_(topo_, metrics_, prefix_index_),
        dispatcher_(topo_, *executor_, upstream_, *policy_, endpoints_, metrics_,
                    access_log_.get()),
        health_(topo_, *executor_, upstream_, endpoints_,
                [this] { dispatcher_.engines_changed(); }),
        front_end_(topo_, *executor_, upstream_, dispatcher_, endpoints_, registry_,
                   tokenizer_.get()),
        admin_(topo_, std::move(config_path), *executor_, dispatcher_, std::move(replicas)),
        dashboard_(topo_, *executor_, upstream_, dispatcher_, admin_) {
    if (tokenizer_) {
      tokenizer_->limit_max_tokens(topo_.max_tokens_limit, topo_.default_max_tokens);
      tokenizer_->use_generation_max_tokens(topo_.generation_max_tokens,
                                            topo_.generation_max_tokens_cap);
    }
    for (const auto& e : topo_.prefill.endpoints) endpoints_.add(true, e);
    for (const auto& e : topo_.decode.endpoints) endpoints_.add(false, e);
    front_end_.add_routes(server_);
    admin_.add_routes(server_);
    dashboard_.add_routes(server_);
  }

  void start() {
    server_.start();  // first: the client runs on its threads
    if (sched_) sched_->start();
    executor_->post([this] { health_.start(); });
    started_ = true;
  }
  uint16_t port() const { return server_.port(); }
  void refuse_new_requests() { front_end_.stop(); }
  void end_drain() {
    {
      std::lock_guard lock(drain_->mutex);
      drain_->cut = true;
    }
    drain_->changed.notify_all();
    server_.end_flush();
  }
  void stop(std::chrono::milliseconds drain) {
    if (stopped_.exchange(true)) return;
    const auto deadline = std::chrono::steady_clock::now() + drain;
    // New requests get 503.
    front_end_.stop();
    if (started_) {
      // A request the front end took before it stopped posts its submit from the io thread's
      // handler that took it: once each io thread has passed its current handler, every such
      // submit is queued ahead of the drain's tasks, so it is drained, not answered 503.
      io_threads_pass();
      // The drain: the requests in flight may finish (legs still start, failures are retried),
      // until none is left, the time is up or end_drain() cuts it short.
      if (drain > std::chrono::milliseconds::zero()) {
        executor_->post([this, state = drain_] {
          dispatcher_.when_idle([state] {
            {
              std::lock_guard lock(state->mutex);
              state->idle = true;
            }
            state->changed.notify_all();
          });
        });
        std::unique_lock lock(drain_->mutex);
        drain_->changed.wait_until(lock, deadline, [this] { return drain_->idle || drain_->cut; });
      }
      // Those left end now, answered 503 (or their streams cut) rather than dropped; no leg
      // starts after this.
      auto done = std::make_shared<std::promise<void>>();
      auto shut = done->get_future();
      executor_->post([this, done] {
        dispatcher_.shut_down();
        done->set_value();
      });
      shut.wait();
    }
    // The client runs on the server's io threads: its calls end (cancelled, their callbacks
    // reporting to the scheduler and cutting streams) before the server stops those threads.
    client_.shutdown();
    // The answers written above go to the sockets before the connections close, within what is
    // left of the drain: a slow reader's complete answer is cut only at the deadline (the 503s
    // of a drain that ran out get what the sockets take at once).
    server_.stop(std::max(std::chrono::milliseconds::zero(),
                          std::chrono::duration_cast<std::chrono::milliseconds>(
                              deadline - std::chrono::steady_clock::now())));
    if (sched_) sched_->stop();
  }

 private:
  // Where the decisions run: with one io thread, on it (one thread serves a request end to end);
  // with more, on a scheduling thread of their own that every io thread hands work to.
  Executor* make_executor() {
    if (topo_.io_threads == 1) {
      io_executor_ = std::make_unique<IoThreadExecutor>(server_);
      return io_executor_.get();
    }
    sched_ = std::make_unique<SchedulingThread>();
    return sched_.get();
  }

  void io_threads_pass() {
    net::pass_io_threads(server_, static_cast<size_t>(std::max(1, topo_.io_threads)));
  }

  net::HttpServerOptions server_options(
      std::shared_ptr<net::ConnectionsPerAddress> connections_per_address) const {
    net::HttpServerOptions o;
    o.host = topo_.host;
    o.port = topo_.port;
    // Set by the flag or the topology file: a listen error names both.
    o.host_flag = "--host/listen.host";
    o.port_flag = "--port/listen.port";
    o.threads = topo_.io_threads;
    o.reuse_port = topo_.reuse_port;
    o.max_body_bytes = topo_.max_body_bytes;
    o.max_body_time = topo_.max_body_time;
    o.max_unsent_bytes = topo_.max_unsent_bytes;
    o.max_connections = topo_.max_connections;
    o.max_connections_per_address = topo_.max_connections_per_address;
    o.connections_per_address = std::move(connections_per_address);
    o.allowed_origins = topo_.allowed_origins;
    o.error_response = api::openai_error_response;
    return o;
  }

  // What ends the drain: the dispatcher idle (its callback may outlive the wait: shared) or
  // end_drain().
  struct DrainState {
    std::mutex mutex;
    std::condition_variable changed;
    bool idle = false, cut = false;
  };

  const Topology topo_;
  const std::shared_ptr<DrainState> drain_ = std::make_shared<DrainState>();
  std::unique_ptr<Policy> policy_;
  // The engines' cached prefixes, fed by one KV-event consumer per engine that publishes them
  // (their threads write the index; the scheduling thread reads it).
  PrefixIndex prefix_index_;
  metrics::Registry registry_;
  GatewayMetrics metrics_;
  std::unique_ptr<PromptTokenizer> tokenizer_;
  std::unique_ptr<AccessLog> access_log_;  // its own writer thread
  // Destroyed in reverse: the parts first, then the executor, the client (on the server's io
  // threads), the server, and the scheduling thread last (everything posts to it).
  std::unique_ptr<SchedulingThread> sched_;
  net::HttpServer server_;
  net::AsyncHttpClient client_;
  HttpUpstream upstream_;
  std::unique_ptr<IoThreadExecutor> io_executor_;
  Executor* executor_;
  EndpointTable endpoints_;
  Dispatcher dispatcher_;
  HealthMonitor health_;
  FrontEnd front_end_;
  AdminApi admin_;
  Dashboard dashboard_;
  std::atomic<bool> started_{false}, stopped_{false};
};

Gateway::Gateway(Topology topology, std::string config_path,
                 std::shared_ptr<AdminReplicas> replicas,
                 std::shared_ptr<metrics::RegistryGroup> metrics_group,
                 std::shared_ptr<net::ConnectionsPerAddress> connections_per_address)
    : impl_(std::make_unique<Impl>(std::move(topology), std::move(config_path), std::move(replicas),
                                   std::move(metrics_group), std::move(connections_per_address))) {}
Gateway::~Gateway() {
  stop(std::chrono::milliseconds::zero());
}
void Gateway::start() {
  impl_->start();
}
uint16_t Gateway::port() const {
  return impl_->port();
}
void Gateway::stop(std::chrono::milliseconds drain) {
  impl_->stop(drain);
}
void Gateway::refuse_new_requests() {
  impl_->refuse_new_requests();
}
void Gateway::end_drain() {
  impl_->end_drain();
}

void stop_together(std::span<Gateway* const> gateways, std::chrono::milliseconds drain,
                   const std::function<bool(std::chrono::milliseconds wait)>& interrupted) {
  // Every replica refuses before any drains: a client turned away by one is not taken by
  // another that has yet to stop.
  for (Gateway* g : gateways) g->refuse_new_requests();
  util::run_interruptibly(
      [&] {
        std::vector<std::thread> stops;
        stops.reserve(gateways.size());
        for (Gateway* g : gateways) stops.emplace_back([g, drain] { g->stop(drain); });
        for (auto& t : stops) t.join();
      },
      interrupted,
      [&] {
        for (Gateway* g : gateways) g->end_drain();
      });
}

}  // namespace tandem::gateway
