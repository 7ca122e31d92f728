// The access log's writer thread: every line added before the log is destroyed is written, each
// adder's lines in its order; invalid UTF-8 is replaced, not thrown; a file that cannot be opened
// is named. And the lines themselves: client text in them is clipped.
#include "gateway/access_log.h"

#include <gtest/gtest.h>

#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "gateway/gateway_metrics.h"
#include "gateway/request_record.h"
#include "util/error.h"
#include "util/metrics.h"

namespace tandem::gateway {
namespace {

using nlohmann::json;

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
  EXPECT_LT(line.dump().size(), size_t{2000});
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
  EXPECT_EQ(state["recent"][0]["model"], clipped);
  EXPECT_LT(state.dump().size(), size_t{2000});
}

}  // namespace
}  // namespace tandem::gateway
