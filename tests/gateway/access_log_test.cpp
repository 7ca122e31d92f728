// The access log's writer thread: every line added before the log is destroyed is written, each
// adder's lines in its order; invalid UTF-8 is replaced, not thrown; a file that cannot be opened
// is named. A reader that does not read costs at most the cap's bytes (the rest is dropped and
// counted) and cannot hold destruction past its deadline; failed writes are counted and said.
// And the lines themselves: client text in them is clipped; they say the client's address and the
// body bytes it was given.
#include "gateway/access_log.h"

#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "api/error.h"
#include "gateway/gateway_metrics.h"
#include "gateway/request_record.h"
#include "net/http_client.h"
#include "net/http_server.h"
#include "net/reply.h"
#include "util/bounded_wait.h"
#include "util/error.h"
#include "util/metrics.h"
#include "util/prometheus_oracle.h"

namespace tandem::gateway {
namespace {

using nlohmann::json;
using tandem::testing::get_within;
using tandem::testing::kHangGuard;

class AccessLogFile : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = std::filesystem::temp_directory_path() /
            ("access-log-" + std::to_string(::getpid()) + "-" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name() + ".jsonl");
    std::filesystem::remove(path_);
  }
  void TearDown() override { std::filesystem::remove(path_); }
  std::vector<json> lines() const {
    std::vector<json> out;
    std::ifstream in(path_);
    for (std::string l; std::getline(in, l);) out.push_back(json::parse(l));
    return out;
  }
  std::filesystem::path path_;
};

TEST_F(AccessLogFile, EveryLineAddedBeforeDestructionIsWrittenInEachAddersOrder) {
  constexpr int kThreads = 4, kLines = 2000;
  {
    AccessLog log(path_.string());
    std::vector<std::thread> adders;
    for (int t = 0; t < kThreads; ++t)
      adders.emplace_back([&log, t] {
        for (int i = 0; i < kLines; ++i) log.add({{"thread", t}, {"i", i}});
      });
    for (auto& a : adders) a.join();
  }
  const auto written = lines();
  ASSERT_EQ(written.size(), size_t{kThreads * kLines});
  std::vector<int> next(kThreads, 0);
  for (const auto& l : written) {
    const int t = l["thread"];
    EXPECT_EQ(l["i"], next[t]) << "thread " << t;
    next[t] = l["i"].get<int>() + 1;
  }
}

TEST_F(AccessLogFile, AppendsToWhatIsThere) {
  { AccessLog(path_.string()).add({{"n", 1}}); }
  { AccessLog(path_.string()).add({{"n", 2}}); }
  const auto written = lines();
  ASSERT_EQ(written.size(), 2u);
  EXPECT_EQ(written[0]["n"], 1);
  EXPECT_EQ(written[1]["n"], 2);
}

TEST_F(AccessLogFile, InvalidUtf8IsReplacedNotThrown) {
  { AccessLog(path_.string()).add({{"error", "engine said \xff\xfe"}}); }
  const auto written = lines();
  ASSERT_EQ(written.size(), 1u);
  EXPECT_EQ(written[0]["error"], "engine said \xef\xbf\xbd\xef\xbf\xbd");
}

TEST(AccessLog, AFileThatCannotBeOpenedIsNamed) {
  try {
    AccessLog log("/nonexistent-dir/for/sure/access.jsonl");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir/for/sure/access.jsonl"),
              std::string::npos)
        << e.what();
  }
}

// A FIFO at a path, as `--access-log` may name one.
struct FifoAt {
  std::filesystem::path dir, path;
  FifoAt() {
    dir = std::filesystem::temp_directory_path() /
          ("access-log-fifo-" + std::to_string(::getpid()) + "-" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    path = dir / "fifo";
    EXPECT_EQ(::mkfifo(path.c_str(), 0600), 0) << std::strerror(errno);
  }
  ~FifoAt() { std::filesystem::remove_all(dir); }
};

// A FIFO nobody reads yet: the log is refused at once, naming the path and what is missing,
// instead of waiting in open() for a reader that may never come (the gateway would hang at
// start, deaf to SIGTERM). Should open() block (the bug), the guard below lets it go by opening
// the read end, so the test fails instead of hanging.
TEST(AccessLog, AFifoWithoutAReaderIsRefusedAtOnceNamingThePath) {
  FifoAt fifo;
  auto opened = std::async(std::launch::async, [&]() -> std::string {
    try {
      AccessLog log(fifo.path.string());
      return "opened";
    } catch (const Error& e) {
      return e.what();
    }
  });
  int rescue = -1;
  if (opened.wait_for(std::chrono::seconds(30)) != std::future_status::ready)
    rescue = ::open(fifo.path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);  // hang guard only
  const std::string said = opened.get();
  if (rescue >= 0) ::close(rescue);
  EXPECT_LT(rescue, 0) << "open() waited for a reader";
  EXPECT_NE(said.find("'" + fifo.path.string() + "'"), std::string::npos) << said;
  EXPECT_NE(said.find("no reader"), std::string::npos) << said;
}

// With its reader there, a FIFO is written like a pipe: every line arrives whole.
TEST(AccessLog, AFifoWithAReaderGetsTheLines) {
  FifoAt fifo;
  const int reader = ::open(fifo.path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  ASSERT_GE(reader, 0) << std::strerror(errno);
  {
    AccessLog log(fifo.path.string());
    for (int i = 0; i < 3; ++i) log.add({{"i", i}});
  }  // destruction writes what is queued (the FIFO has room for it)
  std::string read;
  char buf[4096];
  for (ssize_t n; (n = ::read(reader, buf, sizeof buf)) > 0;) read.append(buf, size_t(n));
  ::close(reader);
  EXPECT_EQ(read, "{\"i\":0}\n{\"i\":1}\n{\"i\":2}\n");
}

// A pipe whose reader never reads: `pipe()` gives both ends, and the log opens the write end by
// its /proc name, as it would a FIFO's path.
struct UnreadPipe {
  int fds[2] = {-1, -1};
  UnreadPipe() { EXPECT_EQ(::pipe2(fds, O_CLOEXEC), 0); }
  ~UnreadPipe() {
    ::close(fds[0]);
    ::close(fds[1]);
  }
  std::string write_path() const { return "/proc/self/fd/" + std::to_string(fds[1]); }
  size_t capacity() const { return static_cast<size_t>(::fcntl(fds[1], F_GETPIPE_SZ)); }
  // What was written, read once the writer is gone.
  std::string drain() const {
    ::fcntl(fds[0], F_SETFL, ::fcntl(fds[0], F_GETFL) | O_NONBLOCK);
    std::string out;
    char buf[65536];
    for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, size_t(n));
    return out;
  }
};

constexpr AccessLog::Limits kSmall{size_t{64} << 10, std::chrono::milliseconds(20)};

json line_of(int i) {
  return {{"i", i}, {"pad", std::string(1000, 'x')}};
}

TEST(AccessLog, AReaderThatDoesNotReadCostsAtMostTheCapAndDestructionReturns) {
  UnreadPipe pipe;
  metrics::Registry registry;
  metrics::IntCounter& dropped = registry.int_counter("dropped_total", "test");
  constexpr int kLines = 1000;  // about 1 MB: far more than the pipe and the cap hold
  const size_t line_bytes = line_of(0).dump().size() + 1;
  {
    AccessLog log(pipe.write_path(), &dropped, kSmall);
    for (int i = 0; i < kLines; ++i) log.add(line_of(i));
    // Whatever the writer got into the pipe meanwhile, the pipe and the queue hold at most this.
    const size_t kept_at_most = (pipe.capacity() + kSmall.max_queued_bytes) / line_bytes + 1;
    EXPECT_GE(log.dropped_lines(), kLines - kept_at_most);
    EXPECT_EQ(dropped.value(), log.dropped_lines());
  }  // must return: the reader never reads
  // Every line was either written whole or counted.
  const std::string written = pipe.drain();
  const auto whole = static_cast<uint64_t>(std::count(written.begin(), written.end(), '\n'));
  EXPECT_GT(whole, 0u);
  EXPECT_EQ(whole + dropped.value(), uint64_t{kLines});
}

// Two logs on one pipe (gateway replicas of one `serve` share its standard output): however
// their writes interleave, every line the reader gets is whole. Each log's lines pile up while the
// pipe is full, so each writes a batch far larger than the pipe takes at once.
TEST(AccessLog, LogsSharingAPipeNeverCutEachOthersLines) {
  UnreadPipe pipe;
  ::fcntl(pipe.fds[1], F_SETPIPE_SZ, 4096);
  constexpr int kLines = 300;  // 300 KB per log, all within the cap below
  constexpr AccessLog::Limits kRoomy{size_t{4} << 20, std::chrono::milliseconds(10000)};
  std::string read;
  {
    AccessLog a(pipe.write_path(), nullptr, kRoomy), b(pipe.write_path(), nullptr, kRoomy);
    for (int i = 0; i < kLines; ++i) {
      a.add(line_of(i));
      b.add(line_of(kLines + i));
    }
    // Bounded: the pipe's write end stays open (UnreadPipe holds it), so a line the logs dropped
    // would leave the reader in read() for ever.
    auto reader = std::async(std::launch::async, [&] {
      char buf[4096];
      size_t newlines = 0;
      while (newlines < 2 * kLines) {
        const ssize_t n = ::read(pipe.fds[0], buf, sizeof buf);
        if (n <= 0) break;
        read.append(buf, size_t(n));
        newlines += size_t(std::count(buf, buf + n, '\n'));
      }
    });
    get_within(reader, kHangGuard, "the reader did not get every line");
  }
  std::istringstream lines(read);
  int count = 0;
  for (std::string line; std::getline(lines, line); ++count) {
    const json j = json::parse(line, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << "a cut line: " << line.substr(0, 80);
  }
  EXPECT_EQ(count, 2 * kLines);
}

// Standard output on a pipe: written without blocking through a descriptor of the log's own, and
// standard output itself is left blocking (the shell may share it).
TEST(AccessLog, StandardOutputOnAnUnreadPipeDoesNotHoldDestruction) {
  UnreadPipe pipe;
  std::fflush(stdout);
  const int saved = ::dup(STDOUT_FILENO);
  ASSERT_GE(saved, 0);
  ASSERT_EQ(::dup2(pipe.fds[1], STDOUT_FILENO), STDOUT_FILENO);
  uint64_t dropped = 0;
  bool stdout_blocking = false;
  {
    AccessLog log("-", nullptr, kSmall);
    for (int i = 0; i < 1000; ++i) log.add(line_of(i));
    stdout_blocking = (::fcntl(STDOUT_FILENO, F_GETFL) & O_NONBLOCK) == 0;
    dropped = log.dropped_lines();
  }
  ::dup2(saved, STDOUT_FILENO);
  ::close(saved);
  EXPECT_TRUE(stdout_blocking);
  EXPECT_GT(dropped, 0u);
}

TEST(AccessLog, FailedWritesAreCountedAndSaidOnce) {
  metrics::Registry registry;
  metrics::IntCounter& dropped = registry.int_counter("dropped_total", "test");
  ::testing::internal::CaptureStderr();
  {
    AccessLog log("/dev/full", &dropped);  // every write: ENOSPC
    for (int i = 0; i < 3; ++i) log.add({{"i", i}});
  }
  const std::string said = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(dropped.value(), 3u);
  EXPECT_NE(said.find("'/dev/full': write failed: " + std::string(std::strerror(ENOSPC))),
            std::string::npos)
      << said;
  // One line for the failures (however many batches failed), one for the total at the end.
  EXPECT_EQ(std::count(said.begin(), said.end(), '\n'), 2) << said;
  EXPECT_NE(said.find("3 lines were not written"), std::string::npos) << said;
}

// A client names the model (and an engine's 404 repeats it): the line, and the dashboard's copy
// of it, quote it clipped, so 20 requests cannot make hundreds of megabytes of log.
TEST(AccessLogLine, ClientTextIsClippedInTheLineAndTheDashboard) {
  Topology topo;
  Request r;
  r.id = "req-1";
  r.method = "POST";
  r.path = "/v1/completions";
  r.model = std::string(7 << 20, 'm');
  r.times.mark(Phase::kReceived, 0);
  r.outcome = {404, "The model `" + r.model + "` does not exist."};
  r.retried_after = {"engine-a: " + r.model};
  const std::string clipped =
      std::string(256, 'm') + "\u2026(+" + std::to_string(r.model.size() - 256) + " bytes)";

  const json line = access_log_line(r, topo, 1'000'000);
  ASSERT_LT(line.dump().size(), size_t{2000});  // before comparing what could be megabytes
  EXPECT_EQ(line["model"], clipped);
  EXPECT_EQ(line["error"].get<std::string>().rfind("The model `mmm", 0), 0u) << line["error"];
  EXPECT_LT(line["error"].get<std::string>().size(), 300u);
  EXPECT_LT(line["retried_after"][0].get<std::string>().size(), 300u);

  metrics::Registry registry;
  GatewayMetrics metrics(registry);
  RequestRecorder recorder(metrics, nullptr, topo);
  recorder.watch(0);
  recorder.record(r, 1'000'000);
  const json state = recorder.dashboard_json();
  ASSERT_EQ(state["recent"].size(), 1u);
  ASSERT_LT(state.dump().size(), size_t{2000});
  EXPECT_EQ(state["recent"][0]["model"], clipped);
}

// A client's reply that takes every call until the client is gone.
class Client final : public ClientReply {
 public:
  bool gone = false;
  bool respond(int, std::string, std::string) override { return !gone; }
  bool send_error(int, std::string_view, std::string_view, std::string_view) override {
    return !gone;
  }
  bool start_stream(int, std::string) override { return !gone; }
  bool write(std::string_view) override { return !gone; }
  bool end() override { return !gone; }
  void abort() override {}
  void on_close(std::function<void()>) override {}
};

// Each line says who asked (client_address) and how many response body bytes it was given
// (body_bytes_sent, nginx's): a whole answer's, an error's (the OpenAI body the gateway's server
// writes), a stream's chunks up to where the client left (a chunk it could not take is not
// counted), a refusal's with header fields. A request whose reply counts nothing says 0 and no
// address.
TEST(AccessLogLine, SaysTheClientsAddressAndTheBodyBytesItWasGiven) {
  Topology topo;
  net::HttpRequest req;
  req.remote_address = "10.1.2.3";
  auto line_of = [&](const Request& r) { return access_log_line(r, topo, 1'000'000); };
  auto request = [&] {
    auto r = std::make_unique<Request>();
    r->times.mark(Phase::kReceived, 0);
    set_client(*r, req, std::make_shared<Client>());
    return r;
  };

  const auto whole = request();
  ASSERT_TRUE(whole->reply->respond(200, std::string(1234, 'x'), "application/json"));
  EXPECT_EQ(line_of(*whole)["client_address"], "10.1.2.3");
  EXPECT_EQ(line_of(*whole)["body_bytes_sent"], 1234);

  const auto error = request();
  ASSERT_TRUE(error->reply->send_error(503, "no engine", "server_error", ""));
  EXPECT_EQ(line_of(*error)["body_bytes_sent"],
            api::openai_error_response(503, "no engine", "server_error", "").body.size());

  // A refusal with header fields (the gateway's 429 with Retry-After) counts its body; one the
  // client was gone for counts nothing.
  auto refused_client = std::make_shared<Client>();
  Request refused;
  refused.times.mark(Phase::kReceived, 0);
  set_client(refused, req, refused_client);
  net::HttpResponse busy = api::openai_error_response(429, "busy", "", "");
  busy.headers.set("Retry-After", "1");
  const size_t busy_size = busy.body.size();
  ASSERT_TRUE(refused.reply->respond_with_headers(busy));
  EXPECT_EQ(line_of(refused)["body_bytes_sent"], busy_size);
  refused_client->gone = true;
  EXPECT_FALSE(refused.reply->respond_with_headers(busy));
  EXPECT_EQ(line_of(refused)["body_bytes_sent"], busy_size);

  auto client = std::make_shared<Client>();
  Request stream;
  stream.times.mark(Phase::kReceived, 0);
  set_client(stream, req, client);
  ASSERT_TRUE(stream.reply->start_stream(200, "text/event-stream"));
  ASSERT_TRUE(stream.reply->write("data: {\"a\": 1}\n\n"));  // 16 bytes
  ASSERT_TRUE(stream.reply->write("data: {\"b\": 2}\n\n"));
  client->gone = true;
  EXPECT_FALSE(stream.reply->write("data: [DONE]\n\n"));
  EXPECT_EQ(line_of(stream)["body_bytes_sent"], 32);

  Request uncounted;
  uncounted.times.mark(Phase::kReceived, 0);
  EXPECT_EQ(line_of(uncounted)["body_bytes_sent"], 0);
  EXPECT_FALSE(line_of(uncounted).contains("client_address"));
}

// body_bytes_sent is what a real client receives through the gateway's server (its OpenAI error
// body, ErrorFormatter api::openai_error_response), not a size the test computes as the code
// does: a whole answer, an error, a 429 with Retry-After, and a stream's chunks.
TEST(AccessLogLine, TheBodyBytesSentAreThoseAClientReceivedFromTheServer) {
  net::HttpServerOptions o;
  o.host = "127.0.0.1";
  o.error_response = api::openai_error_response;
  net::HttpServer server(o);
  // Each request's count, once its handler's reply calls returned (and so were counted).
  std::mutex mutex;
  std::map<std::string, std::promise<uint64_t>> counted;
  auto route = [&](const std::string& path, std::function<void(net::Reply&)> answer) {
    counted[path];
    server.route(
        "GET", path,
        [&, path, answer](const net::HttpRequest& req, std::shared_ptr<net::Exchange> exchange) {
          Request r;
          set_client(r, req, std::make_shared<net::ExchangeReply>(std::move(exchange)));
          answer(*r.reply);
          std::lock_guard lock(mutex);
          counted[path].set_value(r.body_bytes_sent->load());
        });
  };
  route("/whole",
        [](net::Reply& reply) { reply.respond(200, std::string(1234, 'x'), "text/plain"); });
  route("/error",
        [](net::Reply& reply) { reply.send_error(503, "no engine", "server_error", ""); });
  route("/busy", [](net::Reply& reply) {
    net::HttpResponse busy = api::openai_error_response(429, "busy", "", "");
    busy.headers.set("Retry-After", "1");
    reply.respond_with_headers(std::move(busy));
  });
  route("/stream", [](net::Reply& reply) {
    reply.start_stream(200, "text/event-stream");
    reply.write("data: {\"a\": 1}\n\n");
    reply.write("data: {\"b\": 2}\n\n");
    reply.write("data: [DONE]\n\n");
    reply.end();
  });
  server.start();
  for (const std::string path : {"/whole", "/error", "/busy", "/stream"}) {
    SCOPED_TRACE(path);
    const net::HttpClientResponse got = net::http_request("127.0.0.1", server.port(), "GET", path);
    std::future<uint64_t> count;
    {
      std::lock_guard lock(mutex);
      count = counted[path].get_future();
    }
    EXPECT_GT(got.body.size(), 0u);
    EXPECT_EQ(count.get(), got.body.size()) << got.body;
    if (path == "/busy") {
      EXPECT_EQ(got.headers.get("Retry-After"), "1");
    }
  }
  server.stop();
}

// vllm:time_per_output_token_seconds is observed once per gap between token events, as vLLM
// and the engine observe it (the gateway observed each stream's mean under it, once per request);
// the mean goes to vLLM's per-request name, vllm:request_time_per_output_token_seconds.
TEST(RequestRecorder, TpotIsPerGapAndThePerRequestMeanHasVllmsPerRequestName) {
  Topology topo;
  metrics::Registry registry;
  GatewayMetrics metrics(registry);
  RequestRecorder recorder(metrics, nullptr, topo);
  Request r;
  r.times.mark(Phase::kReceived, 0);
  r.outcome = {200, ""};
  r.output_events = 4;
  r.first_token_ns = 100'000'000;
  r.last_token_ns = 700'000'000;
  r.itl = {0.1, 0.0, 0.5};
  recorder.record(r, 1'000'000'000);
  const std::string text = registry.render();
  auto value = [&](const std::string& series) {
    const size_t at = text.find("\n" + series + " ");
    if (at == std::string::npos) return -1.0;
    return std::stod(text.substr(at + series.size() + 2));
  };
  EXPECT_EQ(value("vllm:time_per_output_token_seconds_count"), 3) << text;
  EXPECT_DOUBLE_EQ(value("vllm:time_per_output_token_seconds_sum"), 0.6);
  EXPECT_EQ(value("vllm:time_per_output_token_seconds_bucket{le=\"0.01\"}"), 1);  // the 0 gap
  EXPECT_EQ(value("vllm:request_time_per_output_token_seconds_count"), 1);
  EXPECT_DOUBLE_EQ(value("vllm:request_time_per_output_token_seconds_sum"), 0.2);
  EXPECT_EQ(value("vllm:inter_token_latency_seconds_count"), 3);
}

// The gateway's vllm:* series carry model_name, as the engines label theirs, when it knows the
// served model's name (the topology's served_model_name); its tandem:* series never do, and
// without the name no series does. Read back through the Prometheus oracle.
TEST(GatewayMetrics, VllmSeriesCarryTheServedModelsName) {
  for (const std::string served : {"tiny", ""}) {
    metrics::Registry registry;
    GatewayMetrics metrics(registry, served);
    const json parsed = test::parse_prometheus(registry.render());
    ASSERT_FALSE(parsed.is_null());
    std::set<std::string> vllm;
    for (const auto& family : parsed["families"]) {
      const std::string name = family["name"];
      const bool is_vllm = name.rfind("vllm:", 0) == 0;
      if (is_vllm) vllm.insert(name);
      for (const auto& sample : family["samples"]) {
        const auto labels = sample["labels"].get<std::map<std::string, std::string>>();
        const auto it = labels.find("model_name");
        if (is_vllm && !served.empty()) {
          EXPECT_TRUE(it != labels.end() && it->second == served) << sample.dump();
        } else {
          EXPECT_TRUE(it == labels.end()) << sample.dump();
        }
      }
    }
    EXPECT_EQ(vllm,
              (std::set<std::string>{
                  "vllm:time_to_first_token_seconds", "vllm:request_time_per_output_token_seconds",
                  "vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds",
                  "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                  "vllm:num_requests_running", "vllm:num_requests_waiting"}));
  }
}

// A stream that produced tokens and then failed (its engine died after 66 tokens) or lost its
// client (499) still had a first token and gaps between tokens: both are observed, as vLLM
// observes TTFT when the first token is produced whatever the outcome. End-to-end latency stays
// the successful requests' (docs/gateway.md), and a request without tokens observes no TTFT.
TEST(RequestRecorder, TokensOfRequestsThatDidNotSucceedAreObserved) {
  Topology topo;
  metrics::Registry registry;
  GatewayMetrics metrics(registry);
  RequestRecorder recorder(metrics, nullptr, topo);
  auto stream = [](Request& r, int status, int64_t events) {
    r.times.mark(Phase::kReceived, 0);
    r.outcome = {status, status == 200 ? "" : "it ended"};
    r.output_events = events;
    r.first_token_ns = 100'000'000;
    r.last_token_ns = 100'000'000 + (events - 1) * 10'000'000;
    r.itl.assign(static_cast<size_t>(events - 1), 0.01);
  };
  Request cut, left, ok;
  stream(cut, 502, 66);
  stream(left, 499, 2);
  stream(ok, 200, 3);
  Request refused;
  refused.times.mark(Phase::kReceived, 0);
  refused.outcome = {503, "no engine"};
  for (Request* r : {&cut, &left, &ok, &refused}) recorder.record(*r, 1'000'000'000);
  const std::string text = registry.render();
  auto value = [&](const std::string& series) {
    const size_t at = text.find("\n" + series + " ");
    if (at == std::string::npos) return -1.0;
    return std::stod(text.substr(at + series.size() + 2));
  };
  EXPECT_EQ(value("vllm:time_to_first_token_seconds_count"), 3) << text;
  EXPECT_EQ(value("vllm:inter_token_latency_seconds_count"), 65 + 1 + 2);
  EXPECT_EQ(value("vllm:time_per_output_token_seconds_count"), 65 + 1 + 2);
  EXPECT_EQ(value("vllm:request_time_per_output_token_seconds_count"), 3);
  EXPECT_EQ(value("vllm:e2e_request_latency_seconds_count"), 1);
}

// The phases last microseconds (a decision) to minutes (a long decode): the histogram's buckets
// span 10 us to past 60 s, log-spaced, where vLLM's end-to-end buckets started at 0.3 s and put
// every short phase in the first. Read back through the Prometheus oracle.
TEST(GatewayMetrics, PhaseBucketsSpanMicrosecondsToMinutes) {
  metrics::Registry registry;
  GatewayMetrics metrics(registry);
  metrics.phase_seconds.labels({"queued"}).observe(50e-6);
  const json parsed = test::parse_prometheus(registry.render());
  ASSERT_FALSE(parsed.is_null());
  std::vector<double> bounds;
  double below_100us = -1;
  for (const auto& family : parsed["families"]) {
    if (family["name"] != "tandem:gateway_phase_seconds") continue;
    for (const auto& sample : family["samples"]) {
      if (sample["name"] != "tandem:gateway_phase_seconds_bucket") continue;
      const std::string le = sample["labels"]["le"];
      if (le == "+Inf") continue;
      bounds.push_back(std::stod(le));
      if (std::stod(le) <= 1e-4) below_100us = std::max(below_100us, sample["value"].get<double>());
    }
  }
  ASSERT_FALSE(bounds.empty());
  std::sort(bounds.begin(), bounds.end());
  EXPECT_LE(bounds.front(), 1e-5);
  EXPECT_GE(bounds.back(), 60.0);
  for (size_t i = 1; i < bounds.size(); ++i) EXPECT_LE(bounds[i] / bounds[i - 1], 3.0) << i;
  EXPECT_EQ(below_100us, 1);  // the 50 us phase is told from 100 us ones
}
}  // namespace
}  // namespace tandem::gateway
