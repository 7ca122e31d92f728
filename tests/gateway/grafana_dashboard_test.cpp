// deploy/grafana/tandem.json against a running stack: every metric its expressions name is one a
// `tandem serve` (gateway plus prefill and decode engines) exports, every label it groups or
// filters by is one those metrics carry, and the panels are well formed (unique ids, a target per
// panel, the datasource variable).
#include <gtest/gtest.h>

#include <map>
#include <regex>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "engine/engine_http.h"
#include "engine/engine_process.h"
#include "util/file.h"

namespace tandem {
namespace {

using nlohmann::json;

// Metric names a /metrics page exports (histograms with their _bucket, _sum and _count series)
// and, per name, the labels its samples carry.
void read_exposition(const std::string& text, std::set<std::string>& names,
                     std::map<std::string, std::set<std::string>>& labels) {
  std::istringstream in(text);
  const std::regex label(R"(([a-zA-Z_][a-zA-Z0-9_]*)=")");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("# TYPE ", 0) == 0) {
      std::istringstream f(line.substr(7));
      std::string name, type;
      f >> name >> type;
      names.insert(name);
      if (type == "histogram")
        for (const char* s : {"_bucket", "_sum", "_count"}) names.insert(name + s);
      continue;
    }
    if (line.empty() || line[0] == '#') continue;
    const size_t end = line.find_first_of("{ ");
    const std::string name = line.substr(0, end);
    names.insert(name);
    if (end != std::string::npos && line[end] == '{') {
      const std::string set = line.substr(end, line.find('}', end) - end);
      for (std::sregex_iterator m(set.begin(), set.end(), label), e; m != e; ++m)
        labels[name].insert((*m)[1]);
    }
  }
}

// Every panel, rows' nested panels included.
void collect_panels(const json& panels, std::vector<json>& out) {
  for (const auto& p : panels) {
    out.push_back(p);
    if (p.contains("panels")) collect_panels(p["panels"], out);
  }
}

TEST(GrafanaDashboard, EveryExpressionNamesMetricsAndLabelsTheStackExports) {
  const json dash =
      json::parse(read_file(std::string(TANDEM_SOURCE_DIR) + "/deploy/grafana/tandem.json"));
  // A whole stack with simulated engines; one request through it, so that labelled series exist.
  testing::EngineProcess serve({TANDEM_BINARY, "serve", "--model", "sim:tiny", "--host",
                                "127.0.0.1", "--port", "0", "--mode", "sequential",
                                "--engine-arg=--served-model-name", "--engine-arg=tiny"});
  std::vector<uint16_t> engines;
  for (const auto& e : testing::read_serve_engines(serve, 2)) engines.push_back(e.port);
  const auto r =
      testing::post_json(serve.port(), "/v1/completions",
                         json{{"model", "tiny"}, {"prompt", "hello"}, {"max_tokens", 4}});
  ASSERT_EQ(r.status, 200) << r.body;
  std::set<std::string> names;
  std::map<std::string, std::set<std::string>> labels;
  std::vector<uint16_t> ports = engines;
  ports.push_back(serve.port());
  for (uint16_t port : ports) {
    const auto m = net::http_request("127.0.0.1", port, "GET", "/metrics");
    ASSERT_EQ(m.status, 200);
    read_exposition(m.body, names, labels);
  }
  ASSERT_GT(names.size(), 30u);

  std::vector<json> panels;
  collect_panels(dash.at("panels"), panels);
  ASSERT_GT(panels.size(), 20u);
  std::set<int64_t> ids;
  size_t exprs = 0;
  const std::regex metric(R"([a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]*)");
  const std::regex by(R"(by \(([^)]*)\))"), matcher(R"(([a-zA-Z_][a-zA-Z0-9_]*)\s*=~?\s*")");
  for (const json& p : panels) {
    SCOPED_TRACE(p.value("title", "?"));
    EXPECT_TRUE(ids.insert(p.at("id").get<int64_t>()).second) << "panel ids must be unique";
    EXPECT_TRUE(p.contains("gridPos"));
    if (p.at("type") == "row") continue;
    EXPECT_EQ(p.at("datasource").at("uid"), "${datasource}");
    ASSERT_FALSE(p.at("targets").empty());
    for (const json& t : p.at("targets")) {
      const std::string expr = t.at("expr").get<std::string>();
      SCOPED_TRACE(expr);
      ++exprs;
      std::set<std::string> used;
      for (std::sregex_iterator m(expr.begin(), expr.end(), metric), e; m != e; ++m) {
        used.insert(m->str());
        EXPECT_TRUE(names.count(m->str())) << m->str() << " is not exported by the stack";
      }
      EXPECT_FALSE(used.empty()) << "an expression without a metric";
      // Labels it groups or filters by: carried by one of its metrics (Prometheus adds job and
      // instance; metrics with no sample yet, e.g. failure counters, cannot say).
      std::set<std::string> wanted;
      for (std::sregex_iterator m(expr.begin(), expr.end(), by), e; m != e; ++m) {
        std::istringstream list((*m)[1].str());
        for (std::string l; std::getline(list, l, ',');) {
          l.erase(0, l.find_first_not_of(' '));
          l.erase(l.find_last_not_of(' ') + 1);
          wanted.insert(l);
        }
      }
      for (std::sregex_iterator m(expr.begin(), expr.end(), matcher), e; m != e; ++m)
        wanted.insert((*m)[1]);
      bool sampled = false;
      for (const auto& u : used) sampled = sampled || labels.count(u);
      for (const auto& l : wanted) {
        if (l == "job" || l == "instance" || !sampled) continue;
        bool carried = false;
        for (const auto& u : used) carried = carried || (labels.count(u) && labels[u].count(l));
        EXPECT_TRUE(carried) << "label " << l << " is on none of its metrics";
      }
    }
  }
  EXPECT_GT(exprs, 30u);
  // Counts both legs of a P/D request would double: each engine's series joined on its role.
  for (const json& p : panels) {
    const std::string title = p.value("title", "");
    if (title != "Tokens per second" && title != "Finished requests per second by reason") continue;
    for (const json& t : p.at("targets")) {
      const std::string expr = t.at("expr").get<std::string>();
      const bool prompts = expr.find("vllm:prompt_tokens_total") != std::string::npos;
      EXPECT_NE(
          expr.find(std::string("* on(job, instance) group_left() tandem:engine_info{role!=\"") +
                    (prompts ? "decode" : "prefill") + "\"}"),
          std::string::npos)
          << title << ": " << expr;
    }
  }
  EXPECT_EQ(serve.stop(), 0);
}

}  // namespace
}  // namespace tandem
