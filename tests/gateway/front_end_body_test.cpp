// The front end's hold on a client's body: a request waiting for the scheduler holds the bodies
// its legs are sent with, and not also the client's original in the server's exchange (a 100 MB
// body would otherwise be held twice for as long as the request waits in the queue).
#include <malloc.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>

#include "api/error.h"
#include "gateway/dispatcher.h"
#include "gateway/endpoints.h"
#include "gateway/front_end.h"
#include "gateway/gateway_metrics.h"
#include "gateway/policy.h"
#include "gateway/prefix_index.h"
#include "gateway/topology.h"
#include "net/http_server.h"
#include "util/metrics.h"

namespace tandem::gateway {
namespace {

using namespace std::chrono_literals;

// The scheduling thread, held: what the front end posts (the prepared request with it) waits
// until the test ends, as a request waits in a full queue.
class HeldExecutor final : public Executor {
 public:
  Clock::time_point now() const override { return Clock::now(); }
  void post(Task task) override { hold(std::move(task)); }
  void post_batched(Task task) override { hold(std::move(task)); }
  void set_busy(bool) override {}
  TimerId at(Clock::time_point, Task) override { return {}; }
  void cancel(TimerId) override {}

  // Whether a task was posted within 10 s.
  bool wait_for_a_task() {
    std::unique_lock lock(mu_);
    return posted_.wait_for(lock, 10s, [&] { return !held_.empty(); });
  }
  // Drops what is held (the requests with it) without running it.
  void drop_all() {
    std::vector<Task> dropped;
    std::lock_guard lock(mu_);
    dropped.swap(held_);
  }

 private:
  void hold(Task task) {
    std::lock_guard lock(mu_);
    held_.push_back(std::move(task));
    posted_.notify_all();
  }

  std::mutex mu_;
  std::condition_variable posted_;
  std::vector<Task> held_;
};

// No engine is ever called: nothing the front end posts runs.
class NoEngines final : public Upstream {
 public:
  CallId start(net::AsyncHttpRequest, net::AsyncHttpHandlers) override {
    throw std::logic_error("no engine is called in this test");
  }
  void cancel(CallId) override {}
};

// Heap bytes in use, over every arena and mmapped block.
size_t heap_in_use() {
  const struct mallinfo2 info = ::mallinfo2();
  return info.uordblks + info.hblkhd;
}

// Sends `bytes` on a new loopback connection to `port` and keeps the connection open.
class Client {
 public:
  Client(uint16_t port, std::string_view bytes) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
      throw std::runtime_error("connect failed");
    while (!bytes.empty()) {
      const ssize_t n = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (n <= 0) throw std::runtime_error("send failed");
      bytes.remove_prefix(static_cast<size_t>(n));
    }
  }
  ~Client() { ::close(fd_); }
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

 private:
  int fd_ = -1;
};

Endpoint engine(const std::string& name) {
  Endpoint e;
  e.name = name;
  e.host = "127.0.0.1";
  e.port = 1;
  return e;
}

Topology topology(PdMode mode) {
  Topology t;
  t.mode = mode;
  t.policy = "least_load";
  t.decode.endpoints = {engine("d")};
  if (mode != PdMode::kAggregated) t.prefill.endpoints = {engine("p")};
  return t;
}

// The gateway's front end on an HTTP server, its scheduler held.
class HeldGateway {
 public:
  explicit HeldGateway(PdMode mode)
      : topo(topology(mode)),
        policy(make_policy(topo.policy, policy_options(topo))),
        metrics(registry),
        endpoints(topo, metrics, index),
        dispatcher(topo, exec, engines, *policy, endpoints, metrics, nullptr),
        front_end(topo, exec, engines, dispatcher, endpoints, registry, nullptr),
        server(server_options()) {
    front_end.add_routes(server);
    server.start();
  }
  ~HeldGateway() {
    server.stop();  // the requests' close callbacks run, and let go of them
    exec.drop_all();
  }

  static net::HttpServerOptions server_options() {
    net::HttpServerOptions o;
    o.host = "127.0.0.1";
    o.threads = 1;
    o.max_body_bytes = size_t{64} << 20;
    o.error_response = api::openai_error_response;
    return o;
  }

  Topology topo;
  HeldExecutor exec;
  NoEngines engines;
  std::unique_ptr<Policy> policy;
  PrefixIndex index;
  metrics::Registry registry;
  GatewayMetrics metrics;
  EndpointTable endpoints;
  Dispatcher dispatcher;
  FrontEnd front_end;
  net::HttpServer server;
};

struct BodyCase {
  const char* name;
  PdMode mode;
  int n;               // choices asked for
  size_t bodies_held;  // leg bodies the waiting request holds, each about the client's size
};

class FrontEndBody : public ::testing::TestWithParam<BodyCase> {};

// An 8 MiB prompt: the request the scheduler holds costs its leg bodies (one in aggregated and
// parallel modes, the decode's and the prefill's in sequential mode, those of each choice) and
// little more. Before, the exchange kept the client's body as well: one body more each time.
TEST_P(FrontEndBody, AWaitingRequestHoldsItsLegBodiesNotAlsoTheClientsBody) {
  const BodyCase& c = GetParam();
  HeldGateway gateway(c.mode);
  const size_t prompt = size_t{8} << 20;
  std::string body = R"({"model":"m","prompt":")" + std::string(prompt, 'a') + "\"";
  if (c.n > 1) body += R"(,"n":)" + std::to_string(c.n);
  body += "}";
  const std::string wire =
      "POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: " + std::to_string(body.size()) +
      "\r\n\r\n" + body;
  body = std::string();
  const size_t before = heap_in_use();
  Client client(gateway.server.port(), wire);
  ASSERT_TRUE(gateway.exec.wait_for_a_task());
  const size_t held = heap_in_use() - before;
  // The read buffer the connection may keep and the request's own small parts besides.
  EXPECT_LE(held, c.bodies_held * prompt + (size_t{512} << 10))
      << held << " bytes held for " << c.bodies_held << " bodies of " << prompt;
}

INSTANTIATE_TEST_SUITE_P(
    Modes, FrontEndBody,
    ::testing::Values(BodyCase{"Aggregated", PdMode::kAggregated, 1, 1},
                      BodyCase{"Sequential", PdMode::kSequential, 1, 2},
                      BodyCase{"Parallel", PdMode::kParallel, 1, 1},
                      BodyCase{"SequentialTwoChoices", PdMode::kSequential, 2, 4}),
    [](const ::testing::TestParamInfo<BodyCase>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace tandem::gateway
