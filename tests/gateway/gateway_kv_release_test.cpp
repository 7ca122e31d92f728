// The gateway's release of prefill KV that no decode engine took, end to end in virtual time:
// the gateway's own dispatcher and relay in front of simulated engines (src/sim: the serving
// engine with its generation API, KV over the virtual links), as `tandem simulate` runs them.
// A sequential request that ends after its prefill engine answered with kv_transfer_params and
// before a decode engine took them has that engine free the prompt's blocks at once; they stayed
// held until --kv-transfer-timeout. The simulated engines answer POST /v1/kv_transfer/release as
// the live ones do (kv_release_route_test.cpp), so a simulated run frees that KV too.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/sim_engine_fixture.h"
#include "gateway/dispatcher.h"
#include "gateway/endpoints.h"
#include "gateway/front_end.h"
#include "gateway/gateway_metrics.h"
#include "gateway/policy.h"
#include "gateway/prefix_index.h"
#include "gateway/virtual_executor.h"
#include "sim/simulated_engine.h"
#include "sim/virtual_kv_links.h"
#include "sim/virtual_time.h"
#include "sim/virtual_upstream.h"

namespace tandem::gateway {
namespace {

using nlohmann::json;

// What a client got.
class Client final : public ClientReply {
 public:
  bool respond(int s, std::string b, std::string) override {
    status = s;
    body = std::move(b);
    return true;
  }
  bool send_error(int s, std::string_view message, std::string_view, std::string_view) override {
    status = s;
    body = std::string(message);
    return true;
  }
  bool start_stream(int s, std::string) override {
    status = s;
    return true;
  }
  bool write(std::string_view) override { return true; }
  bool end() override { return true; }
  void abort() override {}
  void on_close(std::function<void()> callback) override { close = std::move(callback); }

  int status = 0;
  std::string body;
  std::function<void()> close;
};

constexpr double kKvTimeoutS = 600;  // past anything here: only a pull or a release frees a hold

// One simulated prefill engine "p" and, unless `with_decode_engine` is false, one decode engine
// "d", behind the gateway in sequential mode. Without "d" the decode pool names an address where
// nothing answers: every decode leg fails without connecting.
class SimulatedCluster {
 public:
  explicit SimulatedCluster(bool with_decode_engine)
      : topo_(topology()),
        policy_(make_policy(topo_.policy, policy_options(topo_))),
        metrics_(registry_),
        endpoints_(topo_, metrics_, index_),
        dispatcher_(topo_, clock_, upstream_, *policy_, endpoints_, metrics_, nullptr),
        front_end_(topo_, clock_, upstream_, dispatcher_, endpoints_, registry_, nullptr) {
    prefill_ = add_engine(true, topo_.prefill.endpoints[0]);
    if (with_decode_engine)
      add_engine(false, topo_.decode.endpoints[0]);
    else
      endpoints_.add(false, topo_.decode.endpoints[0]);
  }
  ~SimulatedCluster() {
    for (const auto& c : clients_) c->close = nullptr;  // they hold their requests
  }

  std::shared_ptr<Client> send() {
    auto client = std::make_shared<Client>();
    clients_.push_back(client);
    net::HttpRequest req;
    req.method = "POST";
    req.target = req.path = "/v1/completions";
    req.body =
        json{{"model", "tiny"}, {"prompt", "The capital of France is a city"}, {"max_tokens", 4}}
            .dump();
    RequestPtr r = front_end_.prepare(req, client);
    EXPECT_TRUE(r);
    if (r) {
      client->close = [this, r] { dispatcher_.client_gone(r); };
      clock_.post_batched([this, r] { dispatcher_.submit(r); });
    }
    clock_.run_ready();
    return client;
  }

  // Runs the cluster's timers until `done` holds (steps, transfers and answers take virtual
  // time); false when it never did.
  template <class Done>
  bool run_until(Done done) {
    for (int i = 0; i < 100000 && !done(); ++i) {
      Executor::Clock::time_point next;
      if (!clock_.next_timer(&next)) return done();
      clock_.advance_to(next);
    }
    return done();
  }

  int64_t held_on_prefill() const { return prefill_->engine().transfer()->held_blocks(); }
  int64_t prefill_blocks_in_use() const {
    const auto load = prefill_->engine().load();
    return load.total_blocks - load.free_blocks;
  }
  double releases(const std::string& result) const {
    const std::string series = "tandem:gateway_kv_releases_total{result=\"" + result + "\"}";
    const std::string text = registry_.render();
    const size_t at = text.find("\n" + series + " ");
    return at == std::string::npos ? 0 : std::stod(text.substr(at + series.size() + 2));
  }
  size_t active() const { return dispatcher_.active(); }

 private:
  static Topology topology() {
    Topology t;
    t.mode = PdMode::kSequential;
    t.policy = "least_load";
    t.prefill_retries = 0;
    t.prefill.dialect = t.decode.dialect = Dialect::kTandem;
    for (auto [pool, name] : {std::pair{&t.prefill, "p"}, std::pair{&t.decode, "d"}}) {
      Endpoint e;
      e.name = e.host = name;
      e.port = 8000;
      pool->endpoints.push_back(e);
      pool->max_in_flight = 8;
    }
    return t;
  }

  sim::SimulatedEngine* add_engine(bool prefill, const Endpoint& e) {
    endpoints_.add(prefill, e);
    sim::SimulatedEngineOptions o;
    o.name = e.name;
    o.config.role = prefill ? engine::EngineRole::kPrefill : engine::EngineRole::kDecode;
    engine::KvTransferConfig t;
    t.engine_id = e.name;
    t.advertise_host = e.host;
    t.port = prefill ? 8998 : -1;
    t.timeout_s = kKvTimeoutS;
    o.config.transfer = t;
    o.executor.preset = "tiny";
    o.executor.model_name = "tiny";
    o.executor.num_blocks = 64;
    engines_.push_back(std::make_unique<sim::SimulatedEngine>(
        clock_, test::borrowed(test::deepseek_v3_tokenizer()), o, nullptr, &network_));
    upstream_.add(e.host, e.port, engines_.back().get());
    return engines_.back().get();
  }

  VirtualExecutor clock_;
  sim::VirtualUpstream upstream_{clock_};
  sim::VirtualKvNetwork network_{clock_, sim::KvLinkModel{}};
  Topology topo_;
  std::unique_ptr<Policy> policy_;
  PrefixIndex index_;
  metrics::Registry registry_;
  GatewayMetrics metrics_;
  EndpointTable endpoints_;
  Dispatcher dispatcher_;
  FrontEnd front_end_;
  std::vector<std::unique_ptr<sim::SimulatedEngine>> engines_;
  sim::SimulatedEngine* prefill_ = nullptr;
  std::vector<std::shared_ptr<Client>> clients_;
};

// The decode legs are spent without reaching a decode engine (none answers at the decode pool's
// address): the client gets its 502, and the simulated prefill engine frees the prompt's blocks
// when the gateway's release reaches it, long before its hold would expire.
TEST(GatewayKvRelease, ARequestWhoseDecodeLegsNeverReachedAnEngineFreesItsPrefillKv) {
  SimulatedCluster c(false);
  auto client = c.send();
  ASSERT_TRUE(c.run_until([&] { return client->status != 0; }));
  EXPECT_EQ(client->status, 502) << client->body;
  ASSERT_TRUE(c.run_until([&] { return c.releases("released") == 1; }))
      << "held blocks: " << c.held_on_prefill();
  EXPECT_EQ(c.held_on_prefill(), 0);
  EXPECT_TRUE(c.run_until([&] { return c.prefill_blocks_in_use() == 0; }));
  EXPECT_EQ(c.active(), 0u);
}

// A request whose decode engine took the KV sends no release: the pull freed the hold.
TEST(GatewayKvRelease, ARequestThatDecodedSendsNoRelease) {
  SimulatedCluster c(true);
  auto client = c.send();
  ASSERT_TRUE(c.run_until([&] { return client->status != 0 && c.active() == 0; }));
  EXPECT_EQ(client->status, 200) << client->body;
  EXPECT_EQ(c.held_on_prefill(), 0);
  for (const char* result : {"released", "not_held", "failed", "dropped"})
    EXPECT_EQ(c.releases(result), 0) << result;
}

}  // namespace
}  // namespace tandem::gateway
