// The gateway's topology: endpoint, mode and dialect strings, the YAML topology file (every key,
// defaults, types, unknown keys, relative paths) and the consistency rules of validate().
#include "gateway/topology.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "model/model_test_support.h"
#include "util/error.h"
#include "util/file.h"

namespace tandem::gateway {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using namespace std::chrono_literals;

// The message of the tandem::Error that `parse` throws ("" when it throws none).
template <typename F>
std::string error_of(F&& parse) {
  try {
    parse();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string yaml_error(const std::string& text) {
  return error_of([&] { parse_topology_yaml(text, "t.yaml"); });
}

// A parallel-mode topology with one engine in each pool, plus `extra` top-level lines.
std::string parallel_yaml(const std::string& extra = "") {
  return "mode: parallel\n"
         "prefill: {endpoints: [\"p:1@2\"]}\n"
         "decode: {endpoints: [\"d:3\"]}\n" +
         extra;
}

// ---------------------------------------------------------------------------------------------
// Strings

TEST(ParseEndpoint, AcceptsTheShortForms) {
  Endpoint e = parse_endpoint("10.0.0.1:8100");
  EXPECT_EQ(e.host, "10.0.0.1");
  EXPECT_EQ(e.port, 8100);
  EXPECT_EQ(e.bootstrap_port, 0);
  EXPECT_EQ(e.name, "");
  EXPECT_EQ(e.group, 0);
  EXPECT_EQ(e.max_in_flight, 0);

  e = parse_endpoint("http://engine-a:8200");
  EXPECT_EQ(e.host, "engine-a");
  EXPECT_EQ(e.port, 8200);

  e = parse_endpoint("http://engine-a:8200/");
  EXPECT_EQ(e.host, "engine-a");
  EXPECT_EQ(e.port, 8200);

  e = parse_endpoint("10.0.0.2:8100@8998");
  EXPECT_EQ(e.host, "10.0.0.2");
  EXPECT_EQ(e.port, 8100);
  EXPECT_EQ(e.bootstrap_port, 8998);

  e = parse_endpoint("[::1]:65535@1");
  EXPECT_EQ(e.host, "::1");
  EXPECT_EQ(e.port, 65535);
  EXPECT_EQ(e.bootstrap_port, 1);
}

TEST(ParseEndpoint, RejectsMalformedTextNamingIt) {
  for (const std::string text :
       {"engine", "engine:", ":8000", "engine:0", "engine:70000", "engine:80x", "engine:-1",
        "engine:8000@", "engine:8000@0", "https://engine:8000", "http://engine:8000/v1", "::1:8000",
        "", "en gine:80"}) {
    const std::string message = error_of([&] { parse_endpoint(text); });
    EXPECT_THAT(message, StartsWith("endpoint: expected ")) << text;
    EXPECT_THAT(message, HasSubstr("'" + text + "'")) << text;
  }
  EXPECT_EQ(error_of([] { parse_endpoint("engine:70000"); }),
            "endpoint: expected a port 1..65535 in 'engine:70000', got '70000'");
}

TEST(ParseMode, AcceptsNamesAndAliases) {
  EXPECT_EQ(parse_mode("aggregated"), PdMode::kAggregated);
  EXPECT_EQ(parse_mode("sequential"), PdMode::kSequential);
  EXPECT_EQ(parse_mode("vllm"), PdMode::kSequential);
  EXPECT_EQ(parse_mode("parallel"), PdMode::kParallel);
  EXPECT_EQ(parse_mode("sglang"), PdMode::kParallel);
  for (PdMode mode : {PdMode::kAggregated, PdMode::kSequential, PdMode::kParallel})
    EXPECT_EQ(parse_mode(mode_name(mode)), mode);
  EXPECT_EQ(error_of([] { parse_mode("Parallel"); }),
            "mode: expected aggregated, sequential (vllm) or parallel (sglang), got 'Parallel'");
}

TEST(ParseDialect, AcceptsAutoAndTheThreeDialects) {
  EXPECT_EQ(parse_dialect("auto"), Dialect::kAuto);
  EXPECT_EQ(parse_dialect("tandem"), Dialect::kTandem);
  EXPECT_EQ(parse_dialect("vllm"), Dialect::kVllm);
  EXPECT_EQ(parse_dialect("sglang"), Dialect::kSglang);
  for (Dialect d : {Dialect::kAuto, Dialect::kTandem, Dialect::kVllm, Dialect::kSglang})
    EXPECT_EQ(parse_dialect(dialect_name(d)), d);
  EXPECT_EQ(error_of([] { parse_dialect("trtllm"); }),
            "dialect: expected auto, tandem, vllm or sglang, got 'trtllm'");
}

// ---------------------------------------------------------------------------------------------
// The file: the documented example, defaults, forms

// The example between the markers in docs/gateway.md, without its code fence.
std::string documented_example() {
  const std::string doc = read_file(TANDEM_SOURCE_DIR "/docs/gateway.md");
  const std::string begin = "<!-- topology-example-begin -->\n```yaml\n";
  const std::string end = "```\n<!-- topology-example-end -->";
  const auto from = doc.find(begin);
  const auto to = doc.find(end);
  if (from == std::string::npos || to == std::string::npos || to < from) return "";
  return doc.substr(from + begin.size(), to - from - begin.size());
}

TEST(TopologyYaml, TheDocumentedExampleParsesToEveryField) {
  const std::string text = documented_example();
  ASSERT_FALSE(text.empty()) << "docs/gateway.md lacks the topology example markers";
  const Topology t = parse_topology_yaml(text, "/srv/gateway/topology.yaml");

  EXPECT_EQ(t.host, "0.0.0.0");
  EXPECT_EQ(t.port, 8080);
  EXPECT_EQ(t.io_threads, 2);
  EXPECT_EQ(t.max_body_bytes, 8388608u);
  EXPECT_EQ(t.max_unsent_bytes, 8388608u);
  EXPECT_EQ(t.max_answer_bytes, 33554432u);
  EXPECT_EQ(t.mode, PdMode::kParallel);
  EXPECT_EQ(t.model, "/srv/gateway/models/tiny-v3");
  EXPECT_EQ(t.served_model_name, "tiny");
  EXPECT_EQ(t.api_keys, (std::vector<std::string>{"k1", "k2"}));
  EXPECT_EQ(t.admin_api_key, "secret");
  EXPECT_EQ(t.metrics_api_key, "scrape-secret");
  EXPECT_EQ(t.engine_api_key, "engines-secret");
  EXPECT_EQ(t.max_tokens_limit, 8192);
  EXPECT_EQ(t.default_max_tokens, 1024);
  EXPECT_EQ(t.max_connections, 15000u);
  EXPECT_EQ(t.max_connections_per_address, 1000u);
  EXPECT_EQ(t.max_queue, 1024u);
  EXPECT_EQ(t.prefill_retries, 2);
  EXPECT_EQ(t.shutdown_timeout, 20s);
  EXPECT_EQ(t.access_log, "-");
  EXPECT_EQ(t.policy, "tandem");
  EXPECT_EQ(t.scheduling.queue.length_weight, 0.8);
  EXPECT_EQ(t.scheduling.queue.wait_weight, 0.2);
  EXPECT_EQ(t.scheduling.queue.starvation_after, 2000ms);
  EXPECT_EQ(t.scheduling.load_interval, 100ms);
  EXPECT_EQ(t.scheduling.tandem.max_queued_prefill_tokens, 32000);
  EXPECT_EQ(t.scheduling.tandem.max_prefill_seqs, 32);
  EXPECT_EQ(t.scheduling.tandem.max_batch_tokens, 2048);
  EXPECT_EQ(t.scheduling.cache_aware.cache_threshold, 0.5);
  EXPECT_EQ(t.scheduling.cache_aware.balance_abs_threshold, 32);
  EXPECT_EQ(t.scheduling.cache_aware.balance_rel_threshold, 2);
  EXPECT_EQ(t.scheduling.cache_aware.eviction_interval, 60000ms);
  EXPECT_EQ(t.scheduling.cache_aware.max_tree_size, 1000000);
  EXPECT_EQ(t.scheduling.kv_router.overlap_score_weight, 2);
  EXPECT_EQ(t.scheduling.kv_router.block_size, 32);
  EXPECT_EQ(t.scheduling.tandem.max_hold, 2000ms);
  EXPECT_EQ(t.scheduling.tandem.prefill_deadline_slack, 4);
  EXPECT_EQ(t.scheduling.tandem.prefill_deadline_cap_s, 2.5);
  EXPECT_EQ(t.health.probe_interval, 2000ms);
  EXPECT_EQ(t.health.probe_timeout, 1000ms);
  EXPECT_EQ(t.health.failures_to_eject, 3);
  EXPECT_EQ(t.health.slow_start, 10000ms);
  EXPECT_EQ(t.timeouts.queue, 300000ms);
  EXPECT_EQ(t.timeouts.connect, 5000ms);
  EXPECT_EQ(t.timeouts.prefill, 300000ms);
  EXPECT_EQ(t.timeouts.first_token, 300000ms);
  EXPECT_EQ(t.timeouts.idle, 120000ms);

  EXPECT_EQ(t.prefill.dialect, Dialect::kTandem);
  EXPECT_TRUE(t.prefill.tokens_in);
  EXPECT_EQ(t.prefill.max_in_flight, 256);
  ASSERT_EQ(t.prefill.endpoints.size(), 3u);
  const Endpoint& p0 = t.prefill.endpoints[0];
  EXPECT_EQ(p0.name, "p0");
  EXPECT_EQ(p0.host, "10.0.0.1");
  EXPECT_EQ(p0.port, 8100);
  EXPECT_EQ(p0.bootstrap_port, 8998);
  EXPECT_EQ(p0.group, 0);
  EXPECT_EQ(p0.max_in_flight, 64);
  const Endpoint& p1 = t.prefill.endpoints[1];
  EXPECT_EQ(p1.name, "10.0.0.2:8100");
  EXPECT_EQ(p1.host, "10.0.0.2");
  EXPECT_EQ(p1.port, 8100);
  EXPECT_EQ(p1.bootstrap_port, 8998);
  EXPECT_EQ(p1.group, 1);
  EXPECT_EQ(p1.max_in_flight, 0);
  const Endpoint& p2 = t.prefill.endpoints[2];
  EXPECT_EQ(p2.name, "10.0.0.5:8100");
  EXPECT_EQ(p2.bootstrap_port, 8998);
  EXPECT_EQ(p2.group, 0);

  EXPECT_EQ(t.decode.dialect, Dialect::kTandem);
  ASSERT_EQ(t.decode.endpoints.size(), 2u);
  EXPECT_EQ(t.decode.endpoints[0].name, "10.0.0.3:8200");
  EXPECT_EQ(t.decode.endpoints[0].port, 8200);
  EXPECT_EQ(t.decode.endpoints[0].group, 0);
  EXPECT_EQ(t.decode.endpoints[1].host, "10.0.0.4");
  EXPECT_EQ(t.decode.endpoints[1].port, 8200);
  EXPECT_EQ(t.decode.endpoints[1].group, 1);
}

TEST(TopologyYaml, OnlyDecodeEndpointsGiveTheDefaults) {
  const Topology t = parse_topology_yaml("decode: {endpoints: [\"d:3\"]}", "t.yaml");
  const Topology defaults;
  EXPECT_EQ(t.mode, PdMode::kAggregated);
  EXPECT_EQ(t.host, defaults.host);
  EXPECT_EQ(t.port, defaults.port);
  EXPECT_EQ(t.io_threads, defaults.io_threads);
  EXPECT_EQ(t.max_body_bytes, defaults.max_body_bytes);
  EXPECT_EQ(t.max_unsent_bytes, size_t{16} << 20);
  EXPECT_EQ(t.max_answer_bytes, size_t{64} << 20);
  EXPECT_EQ(t.model, "");
  EXPECT_EQ(t.served_model_name, "");
  EXPECT_TRUE(t.api_keys.empty());
  EXPECT_EQ(t.admin_api_key, "");
  EXPECT_EQ(t.metrics_api_key, "");
  EXPECT_EQ(t.max_queue, defaults.max_queue);
  EXPECT_EQ(t.max_queued_body_bytes, size_t{1} << 30);
  EXPECT_EQ(t.prefill_retries, defaults.prefill_retries);
  EXPECT_EQ(t.shutdown_timeout, defaults.shutdown_timeout);
  EXPECT_EQ(t.access_log, "");
  EXPECT_EQ(t.health.probe_interval, defaults.health.probe_interval);
  EXPECT_EQ(t.health.failures_to_eject, defaults.health.failures_to_eject);
  EXPECT_EQ(t.timeouts.queue, defaults.timeouts.queue);
  EXPECT_EQ(t.timeouts.idle, defaults.timeouts.idle);
  EXPECT_TRUE(t.prefill.endpoints.empty());
  EXPECT_EQ(t.decode.dialect, Dialect::kAuto);
  EXPECT_TRUE(t.decode.tokens_in);
  EXPECT_EQ(t.decode.max_in_flight, 256);
  ASSERT_EQ(t.decode.endpoints.size(), 1u);
  EXPECT_EQ(t.decode.endpoints[0].name, "d:3");
  EXPECT_EQ(t.decode.endpoints[0].max_in_flight, 0);
}

TEST(TopologyYaml, TheDefaultModeFollowsThePools) {
  EXPECT_EQ(parse_topology_yaml("prefill: {endpoints: [\"p:1@2\"]}\n"
                                "decode: {endpoints: [\"d:3\"]}",
                                "t.yaml")
                .mode,
            PdMode::kParallel);
  EXPECT_EQ(parse_topology_yaml("prefill: {dialect: vllm, endpoints: [\"p:1\"]}\n"
                                "decode: {endpoints: [\"d:3\"]}",
                                "t.yaml")
                .mode,
            PdMode::kSequential);
  EXPECT_EQ(parse_topology_yaml("prefill: {endpoints: [\"p:1\"]}\n"
                                "decode: {dialect: vllm, endpoints: [\"d:3\"]}",
                                "t.yaml")
                .mode,
            PdMode::kSequential);
  // A prefill pool without engines is no prefill pool.
  EXPECT_EQ(
      parse_topology_yaml("prefill: {endpoints: []}\ndecode: {endpoints: [\"d:3\"]}", "t.yaml")
          .mode,
      PdMode::kAggregated);
}

TEST(TopologyYaml, EndpointsComeInShortAndLongForms) {
  const Topology t = parse_topology_yaml(
      "mode: sequential\n"
      "prefill:\n"
      "  endpoints:\n"
      "    - p:1\n"
      "    - http://q:2\n"
      "    - {url: \"http://r:3\", name: r, group: 0, max_in_flight: 5}\n"
      "decode:\n"
      "  endpoints:\n"
      "    - {host: \"::1\", port: 4, name: d}\n"
      "    - {url: \"s:5@6\"}\n",
      "t.yaml");
  ASSERT_EQ(t.prefill.endpoints.size(), 3u);
  EXPECT_EQ(t.prefill.endpoints[0].host, "p");
  EXPECT_EQ(t.prefill.endpoints[0].port, 1);
  EXPECT_EQ(t.prefill.endpoints[1].host, "q");
  EXPECT_EQ(t.prefill.endpoints[1].name, "q:2");
  EXPECT_EQ(t.prefill.endpoints[2].host, "r");
  EXPECT_EQ(t.prefill.endpoints[2].name, "r");
  EXPECT_EQ(t.prefill.endpoints[2].max_in_flight, 5);
  ASSERT_EQ(t.decode.endpoints.size(), 2u);
  EXPECT_EQ(t.decode.endpoints[0].host, "::1");
  EXPECT_EQ(t.decode.endpoints[0].port, 4);
  EXPECT_EQ(t.decode.endpoints[0].name, "d");
  EXPECT_EQ(t.decode.endpoints[1].name, "s:5");
  EXPECT_EQ(t.decode.endpoints[1].bootstrap_port, 6);
}

TEST(TopologyYaml, LongFormEndpointsNeedOneAddress) {
  EXPECT_THAT(yaml_error("decode: {endpoints: [{url: \"d:1\", host: d}]}"),
              StartsWith("t.yaml: decode.endpoints[0].host: expected either url or host and port"));
  EXPECT_THAT(
      yaml_error("decode: {endpoints: [{host: d}]}"),
      StartsWith("t.yaml: decode.endpoints[0]: expected url, or host and port, got no port"));
  EXPECT_THAT(yaml_error("decode: {endpoints: [{name: d}]}"),
              StartsWith("t.yaml: decode.endpoints[0]: expected url, or host and port"));
  EXPECT_THAT(
      yaml_error("decode: {endpoints: [{url: \"d:1@2\", bootstrap_port: 3}]}"),
      StartsWith("t.yaml: decode.endpoints[0].bootstrap_port: expected one bootstrap port"));
  EXPECT_THAT(yaml_error("decode: {endpoints: [{url: \"d\"}]}"),
              StartsWith("t.yaml: decode.endpoints[0].url: expected HOST:PORT"));
  EXPECT_THAT(yaml_error("decode: {endpoints: [\"d:1\", \"d\"]}"),
              StartsWith("t.yaml: decode.endpoints[1]: expected HOST:PORT"));
}

// The host goes into the Host header of every call to the engine.
TEST(TopologyYaml, HostsWithCharactersOfNoNameOrAddressAreErrors) {
  EXPECT_EQ(yaml_error("decode: {endpoints: [{host: \"d\\r\\nX-Injected: 1\", port: 1}]}"),
            "t.yaml: decode.endpoints[0].host: expected a host name or address (letters, digits "
            "and . - _ : %; IPv6 without brackets), got a host with '\\x0d' in it");
  EXPECT_THAT(yaml_error("decode: {endpoints: [{url: \"http://d\\r\\nX: 1:80\"}]}"),
              StartsWith("t.yaml: decode.endpoints[0].url: expected HOST:PORT"));
  EXPECT_THAT(yaml_error("decode: {endpoints: [{host: \"d e\", port: 1}]}"),
              HasSubstr("got a host with ' ' in it"));
  Topology t = parse_topology_yaml(
      "decode: {endpoints: [{host: \"fe80::1%eth0\", port: 1}, {host: my_engine-2.local, "
      "port: 2}]}",
      "t.yaml");
  EXPECT_EQ(t.decode.endpoints[0].host, "fe80::1%eth0");
  EXPECT_EQ(t.decode.endpoints[1].host, "my_engine-2.local");
}

// A consumer connects to each engine's KV-event endpoints when the engine joins, and ZMQ refused
// 'bogus' only then: on POST /admin/reload after the engines it replaced were drained (every
// engine gone, /health 503). The file's reader refuses what no consumer could connect to.
TEST(TopologyYaml, KvEventEndpointsAreOnesAConsumerCanConnectTo) {
  const auto error = [](const std::string& key, const std::string& value) {
    return yaml_error("decode: {endpoints: [{url: \"d:1\", " + key + ": \"" + value + "\"}]}");
  };
  const std::string expected =
      "expected a ZMQ endpoint to connect to: tcp://HOST:PORT, ipc://PATH or inproc://NAME, got ";
  EXPECT_EQ(error("kv_events", "bogus"),
            "t.yaml: decode.endpoints[0].kv_events: " + expected + "'bogus'");
  EXPECT_EQ(error("kv_events_replay", "tcp://10.0.0.5"),
            "t.yaml: decode.endpoints[0].kv_events_replay: " + expected + "'tcp://10.0.0.5'");
  EXPECT_EQ(error("kv_events", "tcp://e:1\\r\\nX: 1"),
            "t.yaml: decode.endpoints[0].kv_events: " + expected + "'tcp://e:1\\x0d\\x0aX: 1'");
  for (const std::string& bad : std::vector<std::string>{
           "tcp://*:5557", "tcp://e:0", "tcp://e:65536", "tcp://e:*", "tcp://::1:5557",
           "tcp://[]:5557", "tcp://e f:5557", "http://e:5557", "tcp://e:5557/", "ipc://",
           "ipc://" + std::string(108, 'p'), "inproc://"})
    EXPECT_THAT(error("kv_events", bad), HasSubstr(expected)) << bad;
  EXPECT_THAT(error("kv_events", ""), HasSubstr("got an empty string"));

  const Topology t = parse_topology_yaml(
      "decode: {endpoints: [{url: \"a:1\", kv_events: \"tcp://10.0.0.5:5557\", "
      "kv_events_replay: \"tcp://[fe80::1%eth0]:5558\"}, {url: \"b:1\", kv_events: "
      "\"ipc:///run/engine-b/kv\"}, {url: \"c:1\", kv_events: \"inproc://c\"}, {url: \"e:1\", "
      "kv_events: \"tcp://engine-e.local:5557\"}]}",
      "t.yaml");
  EXPECT_EQ(t.decode.endpoints[0].kv_events_replay, "tcp://[fe80::1%eth0]:5558");
  EXPECT_EQ(t.decode.endpoints[1].kv_events, "ipc:///run/engine-b/kv");

  // The admin API reads its engines with the same reader (built topologies: below).
  EXPECT_EQ(
      error_of([] { parse_endpoint_entry(R"({"url":"d:1","kv_events":"bogus"})", "endpoint"); }),
      "endpoint.kv_events: " + expected + "'bogus'");
}

// The admin API's engines: JSON read by the file's reader, with the file's checks.
TEST(ParseEndpointEntry, ReadsJsonAsTheFileReadsAnEndpointsEntry) {
  Endpoint e = parse_endpoint_entry(
      R"({"host":"10.0.0.9","port":8100,"bootstrap_port":8998,"group":2,"max_in_flight":7,)"
      R"("kv_events":"tcp://10.0.0.9:5557"})",
      "endpoint");
  EXPECT_EQ(e.host, "10.0.0.9");
  EXPECT_EQ(e.port, 8100);
  EXPECT_EQ(e.bootstrap_port, 8998);
  EXPECT_EQ(e.group, 2);
  EXPECT_EQ(e.max_in_flight, 7);
  EXPECT_EQ(e.kv_events, "tcp://10.0.0.9:5557");
  EXPECT_EQ(e.name, "10.0.0.9:8100");
  e = parse_endpoint_entry(R"("[::1]:8000@9")", "endpoint");
  EXPECT_EQ(e.host, "::1");
  EXPECT_EQ(e.name, "[::1]:8000");
  EXPECT_EQ(parse_endpoint_entry(R"({"url":"http://a:1","name":"a"})", "endpoint").name, "a");

  auto error = [](const std::string& json) {
    return error_of([&] { parse_endpoint_entry(json, "endpoint"); });
  };
  EXPECT_EQ(error(R"({"host":"a","port":65616})"),
            "endpoint.port: expected a port 1..65535, got 65616");
  EXPECT_EQ(error(R"({"host":"a","port":"80"})"),
            "endpoint.port: expected a port 1..65535, got \"80\" (a quoted string)");
  EXPECT_EQ(error(R"({"url":"a:1","bootstrap_port":65616})"),
            "endpoint.bootstrap_port: expected a port 1..65535, got 65616");
  EXPECT_EQ(error(R"({"url":"a:1","group":1e+300})"),
            "endpoint.group: expected a whole number >= 0, got 1e+300");
  EXPECT_EQ(error(R"({"url":"a:1","group":4294967296})"),
            "endpoint.group: expected a whole number >= 0, got 4294967296");
  EXPECT_THAT(error(R"({"url":"a:1","grop":1})"),
              StartsWith("endpoint.grop: expected one of url, host, port, "));
  EXPECT_THAT(error(R"({"host":"a\r\nX-Injected: 1","port":80})"),
              StartsWith("endpoint.host: expected a host name or address"));
  EXPECT_THAT(error(R"({"host":"a"})"), StartsWith("endpoint: expected url, or host and port"));
  EXPECT_THAT(error("[1, 2"), StartsWith("endpoint: expected YAML or JSON, got a syntax error"));
}

// ---------------------------------------------------------------------------------------------
// The file: errors name the key path

// CORS for browser pages (net::HttpServerOptions::allowed_origins): no setting set it, so a
// gateway allowed every origin, always. listen.allowed_origins lists them ("*": any, the default;
// []: none); an entry that is no origin (a path, a missing scheme) would never match a page's
// Origin, and is refused naming it.
TEST(TopologyYaml, ListenAllowedOriginsListsTheOriginsOfPagesThatMayCall) {
  EXPECT_EQ(parse_topology_yaml(parallel_yaml(), "t.yaml").allowed_origins,
            std::vector<std::string>{"*"});
  EXPECT_EQ(parse_topology_yaml(parallel_yaml("listen: {allowed_origins: [\"https://a.example\", "
                                              "\"http://localhost:3000\"]}\n"),
                                "t.yaml")
                .allowed_origins,
            (std::vector<std::string>{"https://a.example", "http://localhost:3000"}));
  EXPECT_TRUE(parse_topology_yaml(parallel_yaml("listen: {allowed_origins: []}\n"), "t.yaml")
                  .allowed_origins.empty());
  EXPECT_THAT(yaml_error(parallel_yaml("listen: {allowed_origins: \"*\"}\n")),
              StartsWith("t.yaml: listen.allowed_origins: expected a list of origins"));
  EXPECT_THAT(yaml_error(parallel_yaml("listen: {allowed_origins: [\"https://a.example/\"]}\n")),
              StartsWith("t.yaml: listen.allowed_origins[0]: 'https://a.example/': an origin is "
                         "scheme://host[:port] without a path"));
  EXPECT_THAT(yaml_error(parallel_yaml("listen: {allowed_origins: [\"*\", a.example]}\n")),
              StartsWith("t.yaml: listen.allowed_origins[1]: 'a.example': expected an origin"));
}

TEST(TopologyYaml, UnknownKeysAreErrors) {
  EXPECT_THAT(yaml_error(parallel_yaml("modes: parallel\n")),
              StartsWith("t.yaml: modes: expected one of listen, mode, model, "));
  EXPECT_THAT(
      yaml_error(parallel_yaml("listen: {hots: a}\n")),
      StartsWith("t.yaml: listen.hots: expected one of host, port, io_threads, reuse_port, "
                 "max_body_bytes, max_unsent_bytes, max_connections, max_connections_per_address, "
                 "max_body_time_ms, allowed_origins, got an unknown key"));
  EXPECT_THAT(yaml_error(parallel_yaml("timeouts: {queue: 5}\n")),
              StartsWith("t.yaml: timeouts.queue: expected one of queue_ms, "));
  EXPECT_THAT(yaml_error(parallel_yaml("health: {interval_ms: 5}\n")),
              StartsWith("t.yaml: health.interval_ms: expected one of "));
  EXPECT_THAT(yaml_error("decode: {endpoints: [\"d:1\"], endpoint: [\"d:2\"]}"),
              StartsWith("t.yaml: decode.endpoint: expected one of dialect, tokens_in, "));
  EXPECT_THAT(yaml_error("decode: {endpoints: [{host: d, port: 1, grop: 1}]}"),
              StartsWith("t.yaml: decode.endpoints[0].grop: expected one of url, host, "));
}

TEST(TopologyYaml, KeysGivenTwiceAreErrors) {
  EXPECT_EQ(yaml_error("max_queue: 1\nmax_queue: 2\ndecode: {endpoints: [\"d:1\"]}"),
            "t.yaml: max_queue: expected each key once, got it twice");
}

TEST(TopologyYaml, WrongTypesAreErrors) {
  EXPECT_EQ(yaml_error(parallel_yaml("listen: {port: 70000}\n")),
            "t.yaml: listen.port: expected a port 1..65535, got 70000");
  EXPECT_EQ(yaml_error(parallel_yaml("listen: {port: \"8080\"}\n")),
            "t.yaml: listen.port: expected a port 1..65535, got \"8080\" (a quoted string)");
  EXPECT_EQ(yaml_error(parallel_yaml("listen: {port: http}\n")),
            "t.yaml: listen.port: expected a port 1..65535, got http");
  EXPECT_EQ(yaml_error(parallel_yaml("listen: 8080\n")),
            "t.yaml: listen: expected a mapping, got 8080");
  EXPECT_EQ(yaml_error(parallel_yaml("max_queue: 1.5\n")),
            "t.yaml: max_queue: expected a whole number >= 1, got 1.5");
  EXPECT_EQ(yaml_error(parallel_yaml("max_queue: [1]\n")),
            "t.yaml: max_queue: expected a whole number >= 1, got a list");
  EXPECT_EQ(yaml_error(parallel_yaml("timeouts: {idle_ms: 2s}\n")),
            "t.yaml: timeouts.idle_ms: expected a duration in milliseconds 1..2147483647 (at most "
            "about 24.8 days), got 2s");
  EXPECT_EQ(yaml_error(parallel_yaml("api_keys: k1\n")),
            "t.yaml: api_keys: expected a list of keys, got k1");
  EXPECT_EQ(yaml_error(parallel_yaml("api_keys: [k1, {k: 2}]\n")),
            "t.yaml: api_keys[1]: expected a key, got a mapping");
  EXPECT_EQ(yaml_error(parallel_yaml("model:\n")),
            "t.yaml: model: expected a model folder, got nothing");
  EXPECT_EQ(yaml_error("mode: 3\ndecode: {endpoints: [\"d:1\"]}"),
            "t.yaml: mode: expected aggregated, sequential (vllm) or parallel (sglang), got '3'");
  EXPECT_EQ(yaml_error("decode: {tokens_in: yes, endpoints: [\"d:1\"]}"),
            "t.yaml: decode.tokens_in: expected true or false, got yes");
  EXPECT_EQ(yaml_error("decode: {tokens_in: \"false\", endpoints: [\"d:1\"]}"),
            "t.yaml: decode.tokens_in: expected true or false, got \"false\" (a quoted string)");
  EXPECT_EQ(yaml_error("decode: {dialect: trtllm, endpoints: [\"d:1\"]}"),
            "t.yaml: decode.dialect: expected auto, tandem, vllm or sglang, got 'trtllm'");
  EXPECT_EQ(yaml_error("decode: {endpoints: \"d:1\"}"),
            "t.yaml: decode.endpoints: expected a list of engines, got \"d:1\" (a quoted string)");
  EXPECT_EQ(yaml_error("decode: {endpoints: [{host: d, port: 1, group: first}]}"),
            "t.yaml: decode.endpoints[0].group: expected a whole number >= 0, got first");
}

TEST(TopologyYaml, DocumentsThatAreNoMappingAreErrors) {
  EXPECT_EQ(yaml_error(""), "t.yaml: (top level): expected a mapping, got nothing");
  EXPECT_EQ(yaml_error("- d:1\n"), "t.yaml: (top level): expected a mapping, got a list");
  EXPECT_THAT(yaml_error("decode: {endpoints: [\"d:1\"]\n"), StartsWith("t.yaml:2:"));
  EXPECT_THAT(yaml_error("decode: {endpoints: [\"d:1\"]\n"), HasSubstr("expected YAML"));
}

// A key with nothing after it (its keys not indented under it, or a list entry left empty) was
// "prefill: expected a mapping, got nothing" and "decode.endpoints[0]: expected a mapping": it is
// named an empty value, with what the key takes.
TEST(TopologyYaml, AKeyWithAnEmptyValueIsSaidSoWithWhatItTakes) {
  EXPECT_EQ(yaml_error("prefill:\ndecode: {endpoints: [\"d:1\"]}\n"),
            "t.yaml: prefill: expected a mapping of dialect, tokens_in, max_in_flight, endpoints "
            "(indented under it), got an empty value");
  EXPECT_EQ(yaml_error(parallel_yaml("timeouts:\n")),
            "t.yaml: timeouts: expected a mapping of queue_ms, connect_ms, prefill_ms, "
            "first_token_ms, idle_ms, decode_queue_ms (indented under it), got an empty value");
  EXPECT_EQ(yaml_error("decode:\n  endpoints:\n    -\n"),
            "t.yaml: decode.endpoints[0]: expected HOST:PORT, http://HOST:PORT or "
            "HOST:PORT@BOOTSTRAP_PORT, or a mapping with url, or host and port, got an empty "
            "value");
}

TEST(TopologyYaml, LimitsAreChecked) {
  const std::pair<std::string, std::string> cases[] = {
      {"listen: {io_threads: 0}", "listen.io_threads: expected a whole number 1..64, got 0"},
      // As --http-threads: 100000 failed later as "eventfd: Too many open files", naming neither.
      {"listen: {io_threads: 65}", "listen.io_threads: expected a whole number 1..64, got 65"},
      {"listen: {max_body_bytes: 0}", "listen.max_body_bytes: expected a size in bytes >= 1"},
      {"max_queue: 0", "max_queue: expected a whole number >= 1, got 0"},
      {"prefill_retries: -1", "prefill_retries: expected a whole number 0..16, got -1"},
      // Unbounded, one request against an engine answering 503 made tens of thousands of calls.
      {"prefill_retries: 17", "prefill_retries: expected a whole number 0..16, got 17"},
      {"health: {probe_interval_ms: 0}", "health.probe_interval_ms: expected a duration"},
      {"health: {probe_timeout_ms: -5}", "health.probe_timeout_ms: expected a duration"},
      {"health: {failures_to_eject: 0}", "health.failures_to_eject: expected a whole number >= 1"},
      {"health: {slow_start_ms: -1}", "health.slow_start_ms: expected a duration"},
      {"timeouts: {queue_ms: 0}", "timeouts.queue_ms: expected a duration"},
      {"timeouts: {connect_ms: 0}", "timeouts.connect_ms: expected a duration"},
      {"timeouts: {prefill_ms: 0}", "timeouts.prefill_ms: expected a duration"},
      {"timeouts: {first_token_ms: 0}", "timeouts.first_token_ms: expected a duration"},
      {"timeouts: {idle_ms: 0}", "timeouts.idle_ms: expected a duration"},
      {"scheduling: {queue_length_weight: -0.5}",
       "scheduling.queue_length_weight: expected a number >= 0, got -0.5"},
      {"scheduling: {queue_wait_weight: .nan}", "scheduling.queue_wait_weight: expected a number"},
      {"scheduling: {queue_wait_weight: \"0.2\"}",
       "scheduling.queue_wait_weight: expected a number"},
      {"scheduling: {starvation_ms: -1}", "scheduling.starvation_ms: expected a duration"},
      {"scheduling: {load_interval_ms: 1.5}", "scheduling.load_interval_ms: expected a duration"},
      {"scheduling: {max_prefill_seqs: -1}",
       "scheduling.max_prefill_seqs: expected a whole number >= 0"},
      {"scheduling: {max_hold_ms: -5}", "scheduling.max_hold_ms: expected a duration"},
      {"scheduling: {max_batch_tokens: 0}",
       "scheduling.max_batch_tokens: expected a whole number >= 1"},
      {"scheduling: {prefill_deadline_slack: -1}",
       "scheduling.prefill_deadline_slack: expected a number >= 0"},
      {"scheduling: {max_queued: 5}", "scheduling.max_queued: expected one of"},
      {"scheduling: {cache_aware: {cache_threshold: 1.5}}",
       "scheduling.cache_aware.cache_threshold: expected a fraction 0..1"},
      {"scheduling: {cache_aware: {balance_rel_threshold: 0.5}}",
       "scheduling.cache_aware.balance_rel_threshold: expected a number >= 1"},
      {"scheduling: {cache_aware: {eviction_interval_ms: 0}}",
       "scheduling.cache_aware.eviction_interval_ms: expected a duration"},
      {"scheduling: {cache_aware: {tree: 5}}", "scheduling.cache_aware.tree: expected one of"},
      {"scheduling: {kv_router: {block_size: 0}}",
       "scheduling.kv_router.block_size: expected a whole number >= 1"},
      {"scheduling: {kv_router: {overlap_score_weight: -1}}",
       "scheduling.kv_router.overlap_score_weight: expected a number >= 0"},
  };
  for (const auto& [line, expected] : cases)
    EXPECT_THAT(yaml_error(parallel_yaml(line + "\n")), StartsWith("t.yaml: " + expected)) << line;
  EXPECT_THAT(yaml_error("decode: {max_in_flight: 0, endpoints: [\"d:1\"]}"),
              StartsWith("t.yaml: decode.max_in_flight: expected a whole number >= 1, got 0"));
  EXPECT_THAT(
      yaml_error("decode: {endpoints: [{url: \"d:1\", max_in_flight: 0}]}"),
      StartsWith("t.yaml: decode.endpoints[0].max_in_flight: expected a whole number >= 1"));
  EXPECT_THAT(yaml_error("decode: {endpoints: [{url: \"d:1\", group: -1}]}"),
              StartsWith("t.yaml: decode.endpoints[0].group: expected a whole number >= 0"));
  EXPECT_THAT(yaml_error("decode: {endpoints: [{host: d, port: 0}]}"),
              StartsWith("t.yaml: decode.endpoints[0].port: expected a port 1..65535, got 0"));
}

// listen.max_body_time_ms, the total bound on a request body (net's max_body_time, which had no
// key): a duration in whole milliseconds, 1 to 2^31 - 1 as every duration; anything else is
// refused naming the key and the range, and a topology built in code is checked likewise.
TEST(TopologyYaml, MaxBodyTimeIsADurationInMillisecondsCheckedNamingTheKey) {
  EXPECT_EQ(parse_topology_yaml(parallel_yaml(), "t.yaml").max_body_time, std::chrono::minutes(5));
  EXPECT_EQ(parse_topology_yaml(parallel_yaml("listen: {max_body_time_ms: 600000}\n"), "t.yaml")
                .max_body_time,
            std::chrono::minutes(10));
  const std::string range =
      "expected a duration in milliseconds 1..2147483647 (at most about 24.8 days), got ";
  for (const auto& [value, got] : {
           std::pair<std::string, std::string>{"0", "0"},
           {"-1", "-1"},
           {"1.5", "1.5"},
           {"0x10", "0x10"},
           {"5m", "5m"},
           {"2147483648", "2147483648"},
           {"\"1000\"", "\"1000\" (a quoted string)"},
       }) {
    EXPECT_EQ(yaml_error(parallel_yaml("listen: {max_body_time_ms: " + value + "}\n")),
              "t.yaml: listen.max_body_time_ms: " + range + got)
        << value;
  }
  Topology t = parse_topology_yaml(parallel_yaml(), "t.yaml");
  t.max_body_time = std::chrono::milliseconds(0);
  try {
    validate(t);
    ADD_FAILURE() << "a max_body_time of 0 was taken";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("listen.max_body_time_ms: " + range + "0"));
  }
}

// The queue's byte bound beside max_queue (DispatcherOptions had it, and nothing set it): a whole
// number of bytes, 0 for no bound; anything else refused naming the key.
TEST(TopologyYaml, TheQueuesByteBoundIsAWholeNumberOfBytesOrZero) {
  EXPECT_EQ(parse_topology_yaml(parallel_yaml("max_queued_body_bytes: 65536\n"), "t.yaml")
                .max_queued_body_bytes,
            65536u);
  EXPECT_EQ(parse_topology_yaml(parallel_yaml("max_queued_body_bytes: 0\n"), "t.yaml")
                .max_queued_body_bytes,
            0u);
  const std::string expected =
      "t.yaml: max_queued_body_bytes: expected a size in bytes >= 0 (0: no bound), got ";
  for (const std::string value : {"-1", "1GiB", "1.5", "99999999999999999999", "[1]"})
    EXPECT_THAT(yaml_error(parallel_yaml("max_queued_body_bytes: " + value + "\n")),
                HasSubstr(expected))
        << value;
}

// The two byte limits on what the gateway holds for one client: whole numbers of bytes from 1
// to 16 GiB, anything else refused naming the key and the range.
TEST(TopologyYaml, ByteLimitsOnWhatOneClientHoldsAreCheckedNamingTheKey) {
  const std::string range = "expected a size in bytes 1..17179869184 (at most 16 GiB), got ";
  const std::pair<std::string, std::string> cases[] = {
      {"0", "0"},
      {"-1", "-1"},
      {"1.5", "1.5"},
      {"16MiB", "16MiB"},
      {"\"1024\"", "\"1024\" (a quoted string)"},
      {"17179869185", "17179869185"},
      {"99999999999999999999", "99999999999999999999"},
      {"[1]", "a list"},
  };
  for (const auto& [value, got] : cases) {
    EXPECT_EQ(yaml_error(parallel_yaml("listen: {max_unsent_bytes: " + value + "}\n")),
              "t.yaml: listen.max_unsent_bytes: " + range + got)
        << value;
    EXPECT_EQ(yaml_error(parallel_yaml("max_answer_bytes: " + value + "\n")),
              "t.yaml: max_answer_bytes: " + range + got)
        << value;
  }
  const Topology t = parse_topology_yaml(
      parallel_yaml("listen: {max_unsent_bytes: 1}\nmax_answer_bytes: 17179869184\n"), "t.yaml");
  EXPECT_EQ(t.max_unsent_bytes, 1u);
  EXPECT_EQ(t.max_answer_bytes, size_t{16} << 30);
}

// A duration is added to the clock's now() by the timers: one past 2^31 - 1 ms would overflow
// that sum into a time already due (a probe re-armed for the past spins the scheduling thread;
// a first-token deadline in the past times every request out at once).
TEST(TopologyYaml, DurationsPastAboutTwentyFiveDaysAreErrorsNamingTheFieldAndTheLimit) {
  EXPECT_EQ(yaml_error(parallel_yaml("health: {probe_interval_ms: 10000000000000}\n")),
            "t.yaml: health.probe_interval_ms: expected a duration in milliseconds 1..2147483647 "
            "(at most about 24.8 days), got 10000000000000");
  const std::string lines[] = {
      "timeouts: {first_token_ms: 2147483648}",
      "timeouts: {queue_ms: 9223372036854775807}",
      "health: {probe_timeout_ms: 2147483648}",
      "health: {slow_start_ms: 2147483648}",
      "scheduling: {starvation_ms: 2147483648}",
      "scheduling: {cache_aware: {eviction_interval_ms: 2147483648}}",
      "priority_classes: {classes: [{name: a, max_wait_ms: 2147483648}]}",
      "priority_classes: {classes: [{name: a, hold_ms: 2147483648}]}",
  };
  for (const auto& line : lines) {
    const std::string message = yaml_error(parallel_yaml(line + "\n"));
    EXPECT_THAT(message, HasSubstr("..2147483647 (at most about 24.8 days), got ")) << line;
  }
  EXPECT_THAT(yaml_error(parallel_yaml("priority_classes: {classes: [{name: a, "
                                       "max_wait_ms: 2147483648}]}\n")),
              StartsWith("t.yaml: priority_classes.classes[0].max_wait_ms: expected "));
  // The limit itself is accepted.
  EXPECT_EQ(parse_topology_yaml(parallel_yaml("timeouts: {first_token_ms: 2147483647}\n"), "t.yaml")
                .timeouts.first_token,
            2147483647ms);
}

// ---------------------------------------------------------------------------------------------
// Consistency (validate), through the file

TEST(TopologyValidate, NeedsADecodeEngine) {
  EXPECT_EQ(yaml_error("decode: {endpoints: []}"),
            "t.yaml: decode.endpoints: expected at least one decode engine, got none");
  EXPECT_EQ(yaml_error("decode: {dialect: tandem}"),
            "t.yaml: decode.endpoints: expected a list of engines, got nothing");
  EXPECT_EQ(yaml_error("mode: aggregated"),
            "t.yaml: decode.endpoints: expected a list of engines, got nothing");
}

TEST(TopologyValidate, PrefillPoolMatchesTheMode) {
  EXPECT_THAT(yaml_error("mode: aggregated\nprefill: {endpoints: [\"p:1\"]}\n"
                         "decode: {endpoints: [\"d:2\"]}"),
              StartsWith("t.yaml: prefill.endpoints: expected no prefill engines in aggregated"));
  EXPECT_EQ(yaml_error("mode: sequential\ndecode: {endpoints: [\"d:2\"]}"),
            "t.yaml: prefill.endpoints: expected at least one prefill engine in sequential mode, "
            "got none");
  EXPECT_THAT(yaml_error("mode: parallel\ndecode: {endpoints: [\"d:2\"]}"),
              StartsWith("t.yaml: prefill.endpoints: expected at least one prefill engine"));
}

TEST(TopologyValidate, DialectsMatchTheMode) {
  EXPECT_EQ(yaml_error("mode: parallel\nprefill: {dialect: vllm, endpoints: [\"p:1@9\"]}\n"
                       "decode: {endpoints: [\"d:2\"]}"),
            "t.yaml: prefill.dialect: expected a dialect that serves parallel mode (auto, "
            "tandem or sglang), got vllm");
  EXPECT_EQ(yaml_error("mode: parallel\nprefill: {endpoints: [\"p:1@9\"]}\n"
                       "decode: {dialect: vllm, endpoints: [\"d:2\"]}"),
            "t.yaml: decode.dialect: expected a dialect that serves parallel mode (auto, "
            "tandem or sglang), got vllm");
  EXPECT_EQ(yaml_error("mode: sequential\nprefill: {dialect: sglang, endpoints: [\"p:1\"]}\n"
                       "decode: {endpoints: [\"d:2\"]}"),
            "t.yaml: prefill.dialect: expected a dialect that serves sequential mode (auto, "
            "tandem or vllm), got sglang");
  EXPECT_THAT(yaml_error("mode: sequential\nprefill: {endpoints: [\"p:1\"]}\n"
                         "decode: {dialect: sglang, endpoints: [\"d:2\"]}"),
              StartsWith("t.yaml: decode.dialect: expected a dialect that serves sequential"));
  // Mixing the two families is named as such, whatever the mode.
  EXPECT_EQ(yaml_error("mode: sequential\nprefill: {dialect: vllm, endpoints: [\"p:1\"]}\n"
                       "decode: {dialect: sglang, endpoints: [\"d:2\"]}"),
            "t.yaml: decode.dialect: expected a dialect that works with the prefill pool's vllm "
            "(tandem or vllm), got sglang");
  EXPECT_THAT(yaml_error("prefill: {dialect: sglang, endpoints: [\"p:1@9\"]}\n"
                         "decode: {dialect: vllm, endpoints: [\"d:2\"]}"),
              StartsWith("t.yaml: decode.dialect: expected a dialect that works with the prefill "
                         "pool's sglang"));
  // Matching and tandem pools are fine; aggregated mode takes any dialect.
  EXPECT_NO_THROW(
      parse_topology_yaml("prefill: {dialect: sglang, endpoints: [\"p:1@9\"]}\n"
                          "decode: {dialect: sglang, endpoints: [\"d:2\"]}",
                          "t.yaml"));
  EXPECT_NO_THROW(
      parse_topology_yaml("mode: vllm\nprefill: {dialect: vllm, endpoints: [\"p:1\"]}\n"
                          "decode: {endpoints: [\"d:2\"]}",
                          "t.yaml"));
  EXPECT_NO_THROW(parse_topology_yaml("decode: {dialect: vllm, endpoints: [\"d:2\"]}", "t.yaml"));
  EXPECT_NO_THROW(parse_topology_yaml("decode: {dialect: sglang, endpoints: [\"d:2\"]}", "t.yaml"));
}

TEST(TopologyValidate, ParallelPrefillEnginesNeedABootstrapPort) {
  EXPECT_THAT(yaml_error("mode: parallel\nprefill: {endpoints: [\"p:1@9\", \"q:1\"]}\n"
                         "decode: {endpoints: [\"d:2\"]}"),
              StartsWith("t.yaml: prefill.endpoints[1].bootstrap_port: expected the engine's "
                         "bootstrap (KV transfer) port in parallel mode"));
  EXPECT_NO_THROW(
      parse_topology_yaml("mode: sequential\nprefill: {endpoints: [\"q:1\"]}\n"
                          "decode: {endpoints: [\"d:2\"]}",
                          "t.yaml"));
}

TEST(TopologyValidate, NamesAreUniqueAcrossPools) {
  EXPECT_EQ(yaml_error("mode: sequential\nprefill: {endpoints: [{url: \"p:1\", name: a}]}\n"
                       "decode: {endpoints: [\"d:2\", {url: \"e:3\", name: a}]}"),
            "t.yaml: decode.endpoints[1].name: expected a name unique in the topology, got 'a', "
            "as prefill.endpoints[0] has");
}

// A name labels metric series and the dashboard: text, not bytes.
TEST(TopologyValidate, ANameThatIsNotUtf8IsRefused) {
  EXPECT_THAT(yaml_error("decode: {endpoints: [{url: \"d:2\", name: \"a\xff\"}]}"),
              StartsWith("t.yaml: decode.endpoints[0].name: expected a name of 1..256 bytes of "
                         "UTF-8 text without control characters"));
  EXPECT_NO_THROW(
      parse_topology_yaml("decode: {endpoints: [{url: \"d:2\", name: \"d\xc3\xa9\"}]}", "t.yaml"));
}

// One engine twice in a pool under two names would take twice its in-flight limit: the admin
// API refuses it (endpoints.cpp), and so does a topology file (and so a reload).
TEST(TopologyValidate, AnAddressTwiceInAPoolIsRefusedNamingBothNames) {
  EXPECT_EQ(yaml_error("decode: {endpoints: [{url: \"d:2\", name: a}, \"e:3\", "
                       "{url: \"http://d:2\", name: b}]}"),
            "t.yaml: decode.endpoints[2].url: expected an engine not yet in the decode pool, got "
            "d:2 as 'b', which the decode pool has as 'a'");
  EXPECT_EQ(yaml_error("mode: sequential\nprefill: {endpoints: [{host: p, port: 1, name: x}, "
                       "{url: \"p:1\", name: y}]}\ndecode: {endpoints: [\"d:2\"]}"),
            "t.yaml: prefill.endpoints[1].url: expected an engine not yet in the prefill pool, "
            "got p:1 as 'y', which the prefill pool has as 'x'");
  // Without names the duplicate is named by its url, as with them: the default names (HOST:PORT)
  // also collide, but the error named a key the user never wrote.
  EXPECT_EQ(yaml_error("decode: {endpoints: [\"d:2\", \"http://d:2\"]}"),
            "t.yaml: decode.endpoints[1].url: expected an engine not yet in the decode pool, got "
            "d:2 as 'd:2', which the decode pool has as 'd:2'");
  // Host names are case-insensitive (DNS): LOCALHOST is the engine localhost names.
  EXPECT_EQ(yaml_error("decode: {endpoints: [\"localhost:2\", \"LOCALHOST:2\"]}"),
            "t.yaml: decode.endpoints[1].url: expected an engine not yet in the decode pool, got "
            "LOCALHOST:2 as 'LOCALHOST:2', which the decode pool has as 'localhost:2'");
  Topology flags;
  flags.decode.endpoints = {parse_endpoint("d:2"), parse_endpoint("d:2")};  // --decode d:2 twice
  EXPECT_THAT(error_of([&] { validate(flags); }),
              StartsWith("decode.endpoints[1].url: expected an engine not yet in the decode pool"));
  // The same engine in both pools is allowed (a tandem engine of role both serves either leg),
  // as are two ports of one host.
  EXPECT_NO_THROW(
      parse_topology_yaml("mode: sequential\nprefill: {endpoints: [{url: \"e:1\", name: p}]}\n"
                          "decode: {endpoints: [{url: \"e:1\", name: d}, \"e:2\"]}",
                          "t.yaml"));
}

TEST(TopologyValidate, EveryGroupHasEnginesInBothPools) {
  EXPECT_EQ(yaml_error("mode: sequential\n"
                       "prefill: {endpoints: [\"p:1\"]}\n"
                       "decode: {endpoints: [\"d:2\", {url: \"e:3\", group: 1}]}"),
            "t.yaml: decode.endpoints[1].group: expected a group that also has a prefill engine, "
            "got group 1, which has no prefill engine");
  EXPECT_EQ(yaml_error("mode: sequential\n"
                       "prefill: {endpoints: [\"p:1\", {url: \"q:3\", group: 2}]}\n"
                       "decode: {endpoints: [\"d:2\"]}"),
            "t.yaml: prefill.endpoints[1].group: expected a group that also has a decode engine, "
            "got group 2, which has no decode engine");
  EXPECT_NO_THROW(
      parse_topology_yaml("mode: sequential\n"
                          "prefill: {endpoints: [{url: \"p:1\", group: 1}]}\n"
                          "decode: {endpoints: [{url: \"d:2\", group: 1}]}",
                          "t.yaml"));
  // Aggregated mode has no prefill legs, so decode groups need no partner.
  EXPECT_NO_THROW(parse_topology_yaml("decode: {endpoints: [{url: \"d:2\", group: 5}]}", "t.yaml"));
}

// ---------------------------------------------------------------------------------------------
// Consistency (validate), on a topology built in code as from flags

Topology flag_topology() {
  Topology t;
  t.mode = PdMode::kParallel;
  t.prefill.endpoints.push_back(parse_endpoint("p:1@2"));
  t.decode.endpoints.push_back(parse_endpoint("d:3"));
  return t;
}

TEST(TopologyValidate, NamesEndpointsAndChecksLimitsOfBuiltTopologies) {
  Topology t = flag_topology();
  t.prefill.endpoints.push_back(parse_endpoint("[::1]:4@5"));
  validate(t);
  EXPECT_EQ(t.prefill.endpoints[0].name, "p:1");
  EXPECT_EQ(t.prefill.endpoints[1].name, "[::1]:4");
  EXPECT_EQ(t.decode.endpoints[0].name, "d:3");

  t = flag_topology();
  t.decode.endpoints[0].port = 0;
  EXPECT_EQ(error_of([&] { validate(t); }),
            "decode.endpoints[0].port: expected a port 1..65535, got 0");
  t = flag_topology();
  t.timeouts.first_token = -1ms;
  EXPECT_EQ(error_of([&] { validate(t); }),
            "timeouts.first_token_ms: expected a duration in milliseconds 1..2147483647 (at most "
            "about 24.8 days), got -1");
  t = flag_topology();
  t.timeouts.first_token = 10'000'000'000'000ms;  // would overflow now() + first_token
  EXPECT_THAT(error_of([&] { validate(t); }),
              StartsWith("timeouts.first_token_ms: expected a duration in milliseconds "
                         "1..2147483647"));
  t = flag_topology();
  t.health.probe_interval = 2147483648ms;
  EXPECT_THAT(error_of([&] { validate(t); }), StartsWith("health.probe_interval_ms: expected "));
  t = flag_topology();
  t.priority.classes = {PriorityClass{"c", 0, 2147483648ms, std::nullopt}};
  EXPECT_THAT(error_of([&] { validate(t); }),
              StartsWith("priority_classes.classes[0].max_wait_ms: expected "));
  t = flag_topology();
  t.api_keys = {"k1", ""};
  EXPECT_EQ(error_of([&] { validate(t); }),
            "api_keys (--api-key): expected non-empty keys, got an empty key");
  t = flag_topology();
  t.max_body_bytes = 0;
  EXPECT_THAT(error_of([&] { validate(t); }), StartsWith("listen.max_body_bytes: "));
  t = flag_topology();
  t.max_unsent_bytes = 0;
  EXPECT_EQ(error_of([&] { validate(t); }),
            "listen.max_unsent_bytes: expected a size in bytes 1..17179869184 (at most 16 GiB), "
            "got 0");
  t = flag_topology();
  t.max_answer_bytes = kMaxHeldBytesLimit + 1;
  EXPECT_EQ(error_of([&] { validate(t); }),
            "max_answer_bytes: expected a size in bytes 1..17179869184 (at most 16 GiB), got "
            "17179869185");
  t = flag_topology();
  t.decode.endpoints[0].kv_events_replay = "tcp://*:5558";  // tandem serve's engines name theirs
  EXPECT_EQ(error_of([&] { validate(t); }),
            "decode.endpoints[0].kv_events_replay: expected a ZMQ endpoint to connect to: "
            "tcp://HOST:PORT, ipc://PATH or inproc://NAME, got 'tcp://*:5558'");
  t = flag_topology();
  t.decode.endpoints[0].max_in_flight = -1;
  EXPECT_THAT(error_of([&] { validate(t); }), StartsWith("decode.endpoints[0].max_in_flight: "));
  t = flag_topology();
  t.mode = PdMode::kAggregated;
  EXPECT_THAT(error_of([&] { validate(t); }), StartsWith("prefill.endpoints: expected no prefill"));
  t = flag_topology();
  t.io_threads = 100000;
  EXPECT_EQ(error_of([&] { validate(t); }),
            "listen.io_threads: expected a whole number 1..64, got 100000");
  t = flag_topology();
  t.prefill_retries = 100000;
  EXPECT_EQ(error_of([&] { validate(t); }),
            "prefill_retries: expected a whole number 0..16, got 100000");
  // Port 0 to listen on lets the system choose one, as tests do.
  t = flag_topology();
  t.port = 0;
  EXPECT_NO_THROW(validate(t));
}

// What a reload would silently leave as it was is refused instead.
TEST(ReloadRefusal, NamesTheModeAndTokensInWhichOnlyARestartChanges) {
  const Topology now = parse_topology_yaml(parallel_yaml(), "t.yaml");
  Topology next = now;
  next.prefill.max_in_flight = 3;
  next.decode.dialect = Dialect::kTandem;
  EXPECT_EQ(reload_refusal(now, next), "");
  next.mode = PdMode::kSequential;
  EXPECT_EQ(reload_refusal(now, next),
            "reload cannot change the mode (restart the gateway for that)");
  next = now;
  next.decode.tokens_in = false;
  EXPECT_EQ(reload_refusal(now, next),
            "reload cannot change decode.tokens_in (restart the gateway for that)");
}

// ---------------------------------------------------------------------------------------------
// Files

TEST(LoadTopology, RelativePathsAreRelativeToTheFilesFolder) {
  test::TempDir dir("topology");
  std::filesystem::create_directories(dir / "conf");
  const auto file = dir / "conf" / "topology.yaml";
  test::write_bytes(file,
                    "model: ../models/tiny\n"
                    "access_log: logs/access.log\n"
                    "decode: {endpoints: [\"d:1\"]}\n");
  Topology t = load_topology(file.string());
  EXPECT_EQ(t.model, (dir.path() / "models" / "tiny").string());
  EXPECT_EQ(t.access_log, (dir.path() / "conf" / "logs" / "access.log").string());

  test::write_bytes(file,
                    "model: /abs/models/tiny\n"
                    "access_log: \"-\"\n"
                    "decode: {endpoints: [\"d:1\"]}\n");
  t = load_topology(file.string());
  EXPECT_EQ(t.model, "/abs/models/tiny");
  EXPECT_EQ(t.access_log, "-");

  // Errors name the file as it was given.
  test::write_bytes(file, "decode: {endpoints: []}\n");
  EXPECT_EQ(error_of([&] { load_topology(file.string()); }),
            file.string() + ": decode.endpoints: expected at least one decode engine, got none");
}

// ---------------------------------------------------------------------------------------------
// Priority classes and replicas

TEST(TopologyYaml, PriorityClassesParseWithTheirKeysAndDefaults) {
  const Topology t = parse_topology_yaml(
      parallel_yaml("api_keys: [k-batch, k-chat]\n"
                    "priority_classes:\n"
                    "  classes:\n"
                    "    - {name: interactive, priority: -5, max_wait_ms: 500, hold_ms: 0}\n"
                    "    - {name: batch, priority: 10}\n"
                    "  default: batch\n"
                    "  api_keys: {k-batch: batch, k-chat: interactive}\n"
                    "listen: {reuse_port: true}\n"),
      "t.yaml");
  ASSERT_EQ(t.priority.classes.size(), 2u);
  EXPECT_EQ(t.priority.classes[0].name, "interactive");
  EXPECT_EQ(t.priority.classes[0].priority, -5);
  EXPECT_EQ(t.priority.classes[0].max_wait, 500ms);
  EXPECT_EQ(t.priority.classes[1].priority, 10);
  EXPECT_EQ(t.priority.classes[1].max_wait, 2000ms);  // the default bound
  EXPECT_EQ(t.priority.classes[0].hold, 0ms);
  EXPECT_FALSE(t.priority.classes[1].hold.has_value());  // the policy's max_hold
  EXPECT_EQ(t.priority.default_class, 1u);
  EXPECT_EQ(t.priority.api_keys.at("k-batch"), 1u);
  EXPECT_EQ(t.priority.api_keys.at("k-chat"), 0u);
  EXPECT_TRUE(t.reuse_port);
  // Without priorities, classes take their positions; without a default, the first class.
  const Topology plain = parse_topology_yaml(
      parallel_yaml("priority_classes: {classes: [{name: a}, {name: b}]}\n"), "t.yaml");
  EXPECT_EQ(plain.priority.classes[1].priority, 1);
  EXPECT_EQ(plain.priority.default_class, 0u);
  EXPECT_FALSE(parse_topology_yaml(parallel_yaml(), "t.yaml").priority.enabled());
}

TEST(TopologyYaml, PriorityClassMistakesNameTheKey) {
  const std::pair<std::string, std::string> cases[] = {
      {"priority_classes: {}", "priority_classes.classes: expected a list of classes"},
      {"priority_classes: {classes: []}", "priority_classes.classes: expected a list of at least"},
      {"priority_classes: {classes: [{priority: 1}]}",
       "priority_classes.classes[0].name: expected a class name"},
      {"priority_classes: {classes: [{name: a, weight: 1}]}",
       "priority_classes.classes[0].weight: expected one of"},
      {"priority_classes: {classes: [{name: a, priority: high}]}",
       "priority_classes.classes[0].priority: expected a whole number"},
      {"priority_classes: {classes: [{name: a, max_wait_ms: 0}]}",
       "priority_classes.classes[0].max_wait_ms: expected a duration"},
      {"priority_classes: {classes: [{name: a}], default: b}",
       "priority_classes.default: expected the name of a class in priority_classes.classes, got "
       "'b'"},
      {"priority_classes: {classes: [{name: a}], api_keys: {secret-key: b}}",
       "priority_classes.api_keys (entry 1): expected the name of a class"},
      {"priority_classes: {classes: [{name: a}, {name: a}]}",
       "priority_classes.classes[1].name: expected a class name used once"},
      {"priority_classes: {classes: [{name: a, priority: 3}, {name: b, priority: 3}]}",
       "priority_classes.classes[1].priority: expected a priority no other class has, got 3, as "
       "class 'a'"},
      {"api_keys: [k1]\npriority_classes: {classes: [{name: a}], api_keys: {secret-key: a}}",
       "priority_classes.api_keys: expected keys the gateway accepts"},
      {"priority_classes: {classes: [{name: a, hold_ms: -1}]}",
       "priority_classes.classes[0].hold_ms: expected a duration in milliseconds 0..2147483647"},
      {"listen: {reuse_port: 1}", "listen.reuse_port: expected true or false"},
  };
  for (const auto& [line, expected] : cases) {
    const std::string error = yaml_error(parallel_yaml(line + "\n"));
    EXPECT_THAT(error, StartsWith("t.yaml: " + expected)) << line;
    EXPECT_THAT(error, ::testing::Not(HasSubstr("secret-key"))) << "an error shows a key";
  }
}

TEST(LoadTopology, APriorityClassesFileHoldsTheSectionAlone) {
  test::TempDir dir("topology");
  const std::string path = (dir / "classes.yaml").string();
  write_file_atomically(path,
                        "classes: [{name: chat, priority: 0}, {name: bulk, priority: 9}]\n"
                        "api_keys: {k: bulk}\n");
  const PriorityClasses pc = load_priority_classes(path);
  ASSERT_EQ(pc.classes.size(), 2u);
  EXPECT_EQ(pc.classes[1].name, "bulk");
  EXPECT_EQ(pc.api_keys.at("k"), 1u);
  write_file_atomically(path, "classes: [{name: chat}]\ndefault: bulk\n");
  EXPECT_THAT(error_of([&] { load_priority_classes(path); }),
              StartsWith(path + ": default: expected the name of a class in classes"));
}

// docs/gateway.md shows the section with its key (`priority_classes:`), as a topology file has
// it; a file of its own may copy it as it is (it was "priority_classes: expected one of
// classes, default, api_keys, got an unknown key").
TEST(LoadTopology, APriorityClassesFileMayKeepTheSectionsKey) {
  test::TempDir dir("topology");
  const std::string path = (dir / "classes.yaml").string();
  write_file_atomically(path,
                        "priority_classes:\n"
                        "  classes: [{name: chat, priority: 0}, {name: bulk, priority: 9}]\n"
                        "  default: bulk\n"
                        "  api_keys: {k: chat}\n");
  const PriorityClasses pc = load_priority_classes(path);
  ASSERT_EQ(pc.classes.size(), 2u);
  EXPECT_EQ(pc.classes[1].name, "bulk");
  EXPECT_EQ(pc.default_class, 1u);
  EXPECT_EQ(pc.api_keys.at("k"), 0u);
  // Errors name the keys as the file has them.
  write_file_atomically(path, "priority_classes:\n  classes: [{name: chat}]\n  default: bulk\n");
  EXPECT_THAT(error_of([&] { load_priority_classes(path); }),
              StartsWith(path + ": priority_classes.default: expected the name of a class in "
                                "priority_classes.classes"));
  // The key with other keys beside it is neither form.
  write_file_atomically(path, "priority_classes: {classes: [{name: a}]}\nclasses: [{name: b}]\n");
  EXPECT_THAT(error_of([&] { load_priority_classes(path); }),
              StartsWith(path + ": priority_classes: expected one of classes, default, api_keys"));
}

// How long a stop drains: shutdown_timeout, in seconds (30 by default, 0: no drain).
TEST(TopologyYaml, ShutdownTimeoutIsSecondsAndZeroIsNoDrain) {
  EXPECT_EQ(parse_topology_yaml(parallel_yaml(), "t.yaml").shutdown_timeout, 30s);
  EXPECT_EQ(Topology{}.shutdown_timeout, 30s);
  EXPECT_EQ(
      parse_topology_yaml(parallel_yaml("shutdown_timeout: 2.5\n"), "t.yaml").shutdown_timeout,
      2500ms);
  EXPECT_EQ(parse_topology_yaml(parallel_yaml("shutdown_timeout: 0\n"), "t.yaml").shutdown_timeout,
            0ms);
  const std::string expected =
      "t.yaml: shutdown_timeout: expected a number of seconds 0..2147483 (0: no drain; at most "
      "about 24.8 days), got ";
  for (const std::string bad : {"-1", "soon", "\"5\"", "3000000", ".nan", "[1]"})
    EXPECT_THAT(yaml_error(parallel_yaml("shutdown_timeout: " + bad + "\n")), StartsWith(expected))
        << bad;
  EXPECT_EQ(yaml_error(parallel_yaml("shutdown_timeout: -1\n")), expected + "-1");
  // A topology built in code is checked too.
  Topology t = parse_topology_yaml(parallel_yaml(), "t.yaml");
  t.shutdown_timeout = -1ms;
  EXPECT_THAT(error_of([&] { validate(t); }), StartsWith("shutdown_timeout: expected a number"));
}

// retry_backoff_ms given without retry_backoff_max_ms: the max is ten times it (Envoy's default
// ratio), never below the 1000 ms default. `retry_backoff_ms: 2000` alone was refused, naming
// retry_backoff_max_ms, a field the file did not set.
TEST(TopologyYaml, ARetryBackoffGivenAloneHasAMaxThatFollowsIt) {
  const std::string pools =
      "mode: sequential\nprefill: {dialect: tandem, endpoints: [p:1]}\n"
      "decode: {dialect: tandem, endpoints: [d:1]}\n";
  EXPECT_EQ(yaml_error(pools + "retry_backoff_ms: 2000\n"), "");
  const Topology large = parse_topology_yaml(pools + "retry_backoff_ms: 2000\n", "t.yaml");
  EXPECT_EQ(large.retry_backoff.first, 2000ms);
  EXPECT_EQ(large.retry_backoff.max, 20000ms);
  const Topology small = parse_topology_yaml(pools + "retry_backoff_ms: 20\n", "t.yaml");
  EXPECT_EQ(small.retry_backoff.first, 20ms);
  EXPECT_EQ(small.retry_backoff.max, 1000ms);
  // A max given is kept, and checked against the first wait.
  EXPECT_EQ(
      parse_topology_yaml(pools + "retry_backoff_ms: 2000\nretry_backoff_max_ms: 3000\n", "t.yaml")
          .retry_backoff.max,
      3000ms);
  EXPECT_NE(yaml_error(pools + "retry_backoff_ms: 2000\nretry_backoff_max_ms: 1000\n")
                .find("retry_backoff_max_ms"),
            std::string::npos);
}

TEST(LoadTopology, AMissingFileIsAnErrorNamingIt) {
  test::TempDir dir("topology");
  const std::string path = (dir / "absent.yaml").string();
  EXPECT_THAT(error_of([&] { load_topology(path); }), HasSubstr(path));
}

}  // namespace
}  // namespace tandem::gateway
