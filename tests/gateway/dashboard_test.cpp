// The gateway's dashboard and routing-quality split against a running `tandem serve` (a gateway
// in front of simulated prefill and decode engines publishing KV events): the split end to end
// (what the prefix index had, what routing chose, what the engine reused), the data routes behind
// the admin key, and the page itself in headless Chromium (it renders the engines of the stack,
// polls, reflects new requests, logs nothing to the console; a screenshot is left in the test's
// output folder).
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <regex>
#include <string>

#include <nlohmann/json.hpp>

#include "engine/engine_http.h"
#include "engine/engine_process.h"
#include "model/model_test_support.h"
#include "net/http_client.h"
#include "util/child_process.h"
#include "util/file.h"
#include "util/headless_chromium.h"

namespace tandem {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

constexpr const char* kAdminKey = "dash-admin";

struct Stack {
  test::TempDir dir{"dashboard"};
  testing::EngineProcess serve;
  std::vector<std::string> engines;  // names ("HOST:PORT"), prefill first

  Stack()
      : serve({TANDEM_BINARY, "serve", "--model", "sim:tiny", "--host", "127.0.0.1", "--port", "0",
               "--mode", "sequential", "--kv-events", "--admin-api-key", kAdminKey, "--access-log",
               (dir / "access.jsonl").string()}) {
    for (const auto& e : testing::read_serve_engines(serve, 2)) engines.push_back(e.address);
  }

  net::HttpClientResponse get(const std::string& target, bool with_key = true) {
    net::Headers h;
    if (with_key) h.set("Authorization", std::string("Bearer ") + kAdminKey);
    return net::http_request("127.0.0.1", serve.port(), "GET", target, {}, h);
  }
  json state() {
    const auto r = get("/dashboard/state");
    EXPECT_EQ(r.status, 200) << r.body;
    return json::parse(r.body);
  }
  void complete(const std::string& prompt) {
    const auto r = testing::post_json(serve.port(), "/v1/completions",
                                      {{"model", "tiny"}, {"prompt", prompt}, {"max_tokens", 3}});
    ASSERT_EQ(r.status, 200) << r.body;
  }
  std::string url(const std::string& query = "") const {
    return "http://127.0.0.1:" + std::to_string(serve.port()) + "/dashboard" + query;
  }
};

double metric(uint16_t port, const std::string& series) {
  const std::string text = net::http_request("127.0.0.1", port, "GET", "/metrics").body;
  const size_t at = text.find("\n" + series + " ");
  return at == std::string::npos ? -1 : std::stod(text.substr(at + series.size() + 2));
}

std::string prompt() {
  std::string p;
  for (int i = 0; i < 40; ++i)
    p += "the gateway routes this shared prefix " + std::to_string(i) + " ";
  return p;
}

// Engines on an IPv6 host publish KV events the gateway follows (serve refused --kv-events with
// an IPv6 --engine-host while ZMQ sockets were IPv4-only). Skipped without an IPv6 loopback.
TEST(RoutingQuality, KvEventsReachTheGatewayFromEnginesOnAnIpv6Host) {
  {
    const int fd = ::socket(AF_INET6, SOCK_STREAM, 0);
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_loopback;
    const bool ok = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    if (fd >= 0) ::close(fd);
    if (!ok) GTEST_SKIP() << "no IPv6 loopback on this host";
  }
  testing::EngineProcess serve({TANDEM_BINARY, "serve", "--model", "sim:tiny", "--host",
                                "127.0.0.1", "--port", "0", "--engine-host", "::1", "--kv-events",
                                "--admin-api-key", kAdminKey});
  net::Headers h;
  h.set("Authorization", std::string("Bearer ") + kAdminKey);
  // Each request publishes more batches: a subscription that came up after the first one's
  // catches up from the replay socket at the next.
  EXPECT_TRUE(testing::eventually([&] {
    const auto r = testing::post_json(serve.port(), "/v1/completions",
                                      {{"model", "tiny"}, {"prompt", prompt()}, {"max_tokens", 3}});
    EXPECT_EQ(r.status, 200) << r.body;
    const auto got = net::http_request("127.0.0.1", serve.port(), "GET", "/dashboard/state", {}, h);
    if (got.status != 200) return false;
    const json state = json::parse(got.body);
    for (const auto& e : state["endpoints"])
      if (e.value("prefix_blocks", 0) > 0) return true;
    return false;
  }));
}

TEST(RoutingQuality, TheSplitFollowsTheEnginesKvEventsAndWhatTheEngineReused) {
  Stack s;
  s.state();  // the dashboard is open: the requests that end next are kept for it
  const std::string p = prompt();
  s.complete(p);
  // Once the prefill engine's KV events reached the gateway's index, the prefix is available.
  ASSERT_TRUE(testing::eventually([&] {
    const json state = s.state();
    for (const auto& e : state["endpoints"])
      if (e["pool"] == "prefill" && e.value("prefix_blocks", 0) > 0) return true;
    return false;
  }));
  s.complete(p);
  s.complete(p + " and a different tail");
  // A request is recorded just after its answer went out.
  ASSERT_TRUE(testing::eventually(
      [&] { return metric(s.serve.port(), "tandem:gateway_prefix_reuse_requests_total") == 3; }));
  const json recent = s.state()["recent"];
  ASSERT_EQ(recent.size(), 3u);
  EXPECT_EQ(recent[0]["prefix_reuse"], (json{{"available", 0}, {"chosen", 0}, {"delivered", 0}}));
  for (int i = 1; i < 3; ++i) {
    const json& split = recent[i]["prefix_reuse"];
    const int64_t chosen = split["chosen"], delivered = split["delivered"];
    EXPECT_EQ(split["available"], chosen);  // one prefill engine: routing cannot miss
    EXPECT_GE(chosen, 16 * 8) << split;
    // The engine recomputes at least the prompt's last token: up to one block less than indexed.
    EXPECT_LE(delivered, chosen) << split;
    EXPECT_GE(delivered, chosen - 16) << split;
    EXPECT_EQ(recent[i]["prefill"], s.engines[0]);
  }
  // The access log carries the same split.
  const std::string log = read_file(s.dir / "access.jsonl");
  EXPECT_THAT(log, HasSubstr("\"prefix_reuse\":{\"available\":" +
                             recent[1]["prefix_reuse"]["available"].dump()));
  // Prometheus totals are the sums of the requests'.
  int64_t delivered = 0;
  for (const auto& r : recent) delivered += r["prefix_reuse"]["delivered"].get<int64_t>();
  EXPECT_EQ(metric(s.serve.port(), "tandem:gateway_prefix_reuse_tokens_total{split=\"delivered\"}"),
            static_cast<double>(delivered));
}

// Aggregated mode: a client's stream without stream_options is measured too (the gateway asks the
// engine for its usage chunk and keeps it from the client).
TEST(RoutingQuality, AnAggregatedStreamIsMeasuredWithoutTheClientSeeingTheUsageChunk) {
  test::TempDir dir("aggregated-split");
  testing::EngineProcess serve({TANDEM_BINARY, "serve", "--model", "sim:tiny", "--host",
                                "127.0.0.1", "--port", "0", "--mode", "aggregated", "--kv-events"});
  const std::string p = prompt();
  for (int i = 0; i < 2; ++i) {
    const auto r =
        testing::post_json(serve.port(), "/v1/completions",
                           {{"model", "tiny"}, {"prompt", p}, {"max_tokens", 3}, {"stream", true}});
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_THAT(r.body, HasSubstr("data: [DONE]"));
    EXPECT_THAT(r.body, ::testing::Not(HasSubstr("\"choices\":[]"))) << r.body;
    // The client's own request for usage is honoured.
    const auto own = testing::post_json(serve.port(), "/v1/completions",
                                        {{"model", "tiny"},
                                         {"prompt", "short " + std::to_string(i)},
                                         {"max_tokens", 2},
                                         {"stream", true},
                                         {"stream_options", {{"include_usage", true}}}});
    EXPECT_THAT(own.body, HasSubstr("\"choices\":[]"));
  }
  ASSERT_TRUE(testing::eventually(
      [&] { return metric(serve.port(), "tandem:gateway_prefix_reuse_requests_total") == 4; }));
  EXPECT_GT(metric(serve.port(), "tandem:gateway_prefix_reuse_tokens_total{split=\"delivered\"}"),
            0);
}

TEST(Dashboard, DataRoutesNeedTheAdminKeyThePageDoesNot) {
  Stack s;
  const auto page = s.get("/dashboard", false);
  EXPECT_EQ(page.status, 200);
  EXPECT_THAT(page.headers.get("Content-Type"), HasSubstr("text/html"));
  EXPECT_THAT(page.body, HasSubstr("/dashboard/state"));
  EXPECT_THAT(page.body, ::testing::Not(HasSubstr("<script src")));  // self-contained
  const auto refused = s.get("/dashboard/state", false);
  EXPECT_EQ(refused.status, 401);
  EXPECT_EQ(json::parse(refused.body)["error"]["code"], "invalid_api_key");
  EXPECT_EQ(s.get("/dashboard/expert_load?endpoint=" + s.engines[0], false).status, 401);
  const auto missing = s.get("/dashboard/expert_load");
  EXPECT_EQ(missing.status, 400);
  EXPECT_THAT(json::parse(missing.body)["error"]["message"].get<std::string>(),
              HasSubstr("endpoint"));
  const auto unknown = s.get("/dashboard/expert_load?endpoint=no%20such");
  EXPECT_EQ(unknown.status, 404);
  EXPECT_THAT(unknown.body, HasSubstr("no such"));
  // The engine's own answer comes through: sim:tiny's executor routes no experts.
  const auto relayed = s.get("/dashboard/expert_load?endpoint=" + s.engines[1]);
  EXPECT_EQ(relayed.status, 404);
  EXPECT_THAT(relayed.body, HasSubstr("expert routing"));
  const json state = s.state();
  EXPECT_EQ(state["mode"], "sequential");
  EXPECT_EQ(state["endpoints"].size(), 2u);
  for (const char* h : {"ttft", "tpot", "itl", "e2e"})
    EXPECT_EQ(state["histograms"][h]["cumulative"].size(),
              state["histograms"][h]["bounds"].size() + 1)
        << h;
}

// Without an admin key, a gateway guarded by client keys guards the dashboard's data with them
// (they were open to anyone: every engine, the last requests, and the engines' expert loads
// fetched with the engines' own key); the page stays open. No engine is needed for the keys.
TEST(Dashboard, WithoutAnAdminKeyTheDataRoutesNeedAClientKey) {
  testing::EngineProcess gateway({TANDEM_BINARY, "gateway", "--host", "127.0.0.1", "--port", "0",
                                  "--decode", "127.0.0.1:9", "--api-key", "client-key"});
  auto get = [&](const std::string& target, const std::string& key) {
    net::Headers h;
    if (!key.empty()) h.set("Authorization", "Bearer " + key);
    return net::http_request("127.0.0.1", gateway.port(), "GET", target, {}, h);
  };
  EXPECT_EQ(get("/dashboard", "").status, 200);
  for (const std::string target :
       {"/dashboard/state", "/dashboard/expert_load?endpoint=127.0.0.1:9"}) {
    const auto refused = get(target, "");
    EXPECT_EQ(refused.status, 401) << target << ": " << refused.body;
    EXPECT_EQ(get(target, "wrong").status, 401) << target;
  }
  const auto state = get("/dashboard/state", "client-key");
  EXPECT_EQ(state.status, 200) << state.body;
  EXPECT_EQ(json::parse(state.body)["endpoints"].size(), 1u);
  // With the key, the relay is reached (the engine is not there: not a 401).
  EXPECT_NE(get("/dashboard/expert_load?endpoint=127.0.0.1:9", "client-key").status, 401);
}

int dom_attribute(const std::string& dom, const std::string& name) {
  std::smatch m;
  if (!std::regex_search(dom, m, std::regex(name + "=\"(\\d+)\""))) return -1;
  return std::stoi(m[1]);
}

TEST(Dashboard, RendersTheStackLiveInHeadlessChromium) {
  const std::string chromium = testing::find_chromium();
  if (chromium.empty())
    GTEST_SKIP() << "no `chromium` on PATH (Debian package chromium, scripts/install-deps.sh "
                    "installs it); the dashboard render check did not run";
  Stack s;
  for (int i = 0; i < 3; ++i) s.complete("hello dashboard " + std::to_string(i));
  ASSERT_TRUE(testing::eventually([&] { return s.state()["totals"]["requests"] == 3; }));
  const std::string query = std::string("?key=") + kAdminKey;

  // Four seconds of the page's (virtual) time: it polls once a second.
  const auto r = testing::render_in_chromium(chromium, s.url(query), s.dir.path(),
                                             "--virtual-time-budget=4000");
  ASSERT_EQ(r.status, 0) << r.stderr_text;
  EXPECT_TRUE(r.console.empty()) << ::testing::PrintToString(r.console);
  EXPECT_GE(dom_attribute(r.dom, "data-updates"), 2) << r.dom.substr(0, 3000);
  EXPECT_EQ(dom_attribute(r.dom, "data-engines"), 2);
  EXPECT_THAT(r.dom, HasSubstr("data-conn=\"ok\""));
  for (const auto& name : s.engines) EXPECT_THAT(r.dom, HasSubstr("data-engine=\"" + name + "\""));
  EXPECT_THAT(r.dom, HasSubstr("<b id=\"requests\">3</b>"));

  // New requests show on the next load: the page reads the gateway's live state.
  s.complete("one more");
  s.complete("and another");
  ASSERT_TRUE(testing::eventually([&] { return s.state()["totals"]["requests"] == 5; }));
  const auto again = testing::render_in_chromium(chromium, s.url(query), s.dir.path(),
                                                 "--virtual-time-budget=2500");
  EXPECT_THAT(again.dom, HasSubstr("<b id=\"requests\">5</b>"));
  EXPECT_EQ(dom_attribute(again.dom, "data-updates") >= 1, true);

  // Without the key the page says what it needs instead of showing data.
  const auto locked =
      testing::render_in_chromium(chromium, s.url(), s.dir.path(), "--virtual-time-budget=2500");
  EXPECT_THAT(locked.dom, HasSubstr("data-conn=\"auth\""));
  EXPECT_TRUE(locked.console.empty()) << ::testing::PrintToString(locked.console);

  // The screenshot, for a person to look at (the test's output folder).
  const std::filesystem::path out = TANDEM_TEST_OUTPUT_DIR;
  std::filesystem::create_directories(out);
  const auto png = out / "dashboard.png";
  std::filesystem::remove(png);
  const std::string shot = "timeout 120 '" + chromium +
                           "' --headless=new --disable-gpu --no-sandbox --no-first-run "
                           "--user-data-dir='" +
                           (s.dir / "profile-shot").string() +
                           "' --hide-scrollbars --window-size=1400,1100 "
                           "--virtual-time-budget=3000 --screenshot='" +
                           png.string() + "' '" + s.url(query) + "' >/dev/null 2>&1";
  ASSERT_EQ(std::system(shot.c_str()), 0);
  const std::string bytes = read_file(png);
  ASSERT_GT(bytes.size(), 10000u);
  EXPECT_EQ(bytes.substr(1, 3), "PNG");
}

// The page's own logic against a fake gateway state (tests/gateway/dashboard_fake_server.py):
// hostile engine names and errors stay text, expert load is drawn for the engines that report
// one, priority classes get their panel, and a gateway that goes away shows the banner.
TEST(Dashboard, ThePageEscapesHostileTextAndDrawsWhatTheStateHolds) {
  const std::string chromium = testing::find_chromium();
  if (chromium.empty()) GTEST_SKIP() << "no `chromium` on PATH: the render check did not run";
  test::TempDir dir("dashboard-fake");
  const std::string script =
      std::string(TANDEM_SOURCE_DIR) + "/tests/gateway/dashboard_fake_server.py";
  auto fake = std::make_unique<ChildProcess>(
      "/usr/bin/python3", std::vector<std::string>{"python3", script, "--port", "0"});
  const std::string line = fake->read_line();
  ASSERT_EQ(line.rfind("port ", 0), 0u) << line;
  const std::string url = "http://127.0.0.1:" + line.substr(5) + "/dashboard";
  const auto r =
      testing::render_in_chromium(chromium, url, dir.path(), "--virtual-time-budget=6000");
  ASSERT_EQ(r.status, 0) << r.stderr_text;
  EXPECT_TRUE(r.console.empty()) << ::testing::PrintToString(r.console);
  EXPECT_GE(dom_attribute(r.dom, "data-updates"), 3);
  EXPECT_EQ(dom_attribute(r.dom, "data-engines"), 5);
  EXPECT_THAT(r.dom, HasSubstr("data-engine=\"&lt;/script&gt;&lt;b&gt;x\""));
  EXPECT_THAT(r.dom, ::testing::Not(HasSubstr("<b>x")));
  EXPECT_THAT(r.dom, ::testing::Not(HasSubstr("<img src=x")));
  EXPECT_THAT(r.dom, HasSubstr("data-expert=\"d0\""));
  EXPECT_THAT(r.dom, ::testing::Not(HasSubstr("data-expert=\"p0\"")));
  EXPECT_THAT(r.dom, HasSubstr("data-class=\"batch\""));
  // The gateway goes away: the page says so instead of showing stale numbers as live.
  fake.reset();
  const auto down =
      testing::render_in_chromium(chromium, url, dir.path(), "--virtual-time-budget=2000");
  EXPECT_THAT(down.dom, ::testing::Not(HasSubstr("data-conn=\"ok\"")));
}

}  // namespace
}  // namespace tandem
