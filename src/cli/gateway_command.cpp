#include "cli/gateway_command.h"

#include <chrono>
#include <cstdio>
#include <iomanip>
#include <memory>
#include <sstream>
#include <string>
#include <tuple>

#include "cli/gateway_capacity_flags.h"
#include "cli/gateway_shutdown.h"
#include "cli/generation_config_flags.h"
#include "cli/max_tokens_flags.h"
#include "cli/model_commands.h"
#include "cli/number_checks.h"
#include "cli/stop_signals.h"
#include "gateway/gateway.h"
#include "gateway/policy.h"
#include "net/http.h"
#include "util/duration.h"
#include "util/error.h"
#include "util/utf8.h"

namespace tandem::cli {
namespace {

struct GatewayCliOptions {
  std::string config, host = "0.0.0.0", mode = "aggregated", dialect = "auto", policy = "tandem",
                      model, served_model_name, admin_api_key, metrics_api_key, engine_api_key,
                      access_log, priority_classes;
  int port = kDefaultGatewayPort;
  bool reuse_port = false;
  GatewayCapacityFlags capacity;
  MaxTokensFlags max_tokens;
  GenerationConfigFlags generation_config;  // the engines' (as `tandem engine` takes them)
  std::vector<std::string> prefill, decode, api_keys;
  GatewayFailureFlags failure;
  double shutdown_timeout = default_shutdown_timeout();
};

// The settings a flag gives over a --config file: a flag given wins over the file's setting
// (none is ignored). Without --config every flag applies, given or by default.
void apply_setting_flags(gateway::Topology& t, const GatewayCliOptions& o, const CLI::App& cmd,
                         bool from_file) {
  const auto given = [&](const char* flag) { return !from_file || cmd.count(flag) > 0; };
  if (given("--host")) t.host = o.host;
  if (given("--port")) t.port = static_cast<uint16_t>(o.port);
  apply_gateway_capacity_flags(t, o.capacity, cmd, from_file);
  if (given("--served-model-name")) t.served_model_name = o.served_model_name;
  // The key flags replace the file's keys (ignored, a flag meant to guard would guard nothing).
  if (given("--api-key")) t.api_keys = o.api_keys;
  if (given("--admin-api-key")) t.admin_api_key = o.admin_api_key;
  if (given("--metrics-api-key")) t.metrics_api_key = o.metrics_api_key;
  if (given("--engine-api-key")) t.engine_api_key = o.engine_api_key;
  if (given("--access-log")) t.access_log = o.access_log;
  if (given("--max-tokens-limit")) t.max_tokens_limit = o.max_tokens.limit;
  if (given("--default-max-tokens")) t.default_max_tokens = o.max_tokens.default_value;
  apply_gateway_failure_flags(t, o.failure, cmd, from_file);
  if (given("--shutdown-timeout")) t.shutdown_timeout = shutdown_drain(o.shutdown_timeout);
  if (o.reuse_port) t.reuse_port = true;
  if (!o.priority_classes.empty()) t.priority = gateway::load_priority_classes(o.priority_classes);
}

// A topology from flags: the same structure a --config file gives. What the flags say is checked
// here, naming them; the Gateway's own checks name a topology file's keys, which the user of
// flags never wrote.
gateway::Topology from_flags(const GatewayCliOptions& o) {
  gateway::Topology t;
  t.mode = gateway::parse_mode(o.mode, "--mode");
  for (gateway::Pool* p : {&t.prefill, &t.decode})
    p->dialect = gateway::parse_dialect(o.dialect, "--dialect");
  for (const auto& e : o.prefill)
    t.prefill.endpoints.push_back(gateway::parse_endpoint(e, "--prefill"));
  for (const auto& e : o.decode)
    t.decode.endpoints.push_back(gateway::parse_endpoint(e, "--decode"));
  if (t.mode == gateway::PdMode::kAggregated && !o.prefill.empty())
    throw Error(
        "gateway: --prefill: --mode aggregated takes no prefill engines (each --decode "
        "engine does both legs); give --mode sequential or parallel");
  if (t.mode != gateway::PdMode::kAggregated && o.prefill.empty())
    throw Error("gateway: --mode " + o.mode + " needs at least one --prefill engine");
  if (const std::string why = gateway::unknown_policy_error(o.policy); !why.empty())
    throw Error("--policy: " + why);
  t.model = o.model;
  t.policy = o.policy;
  return t;  // validated by the Gateway
}

void run(const GatewayCliOptions& o, const CLI::App& cmd) {
  const StopSignals stop_signals;  // before any thread starts

  // Given empty, a key flag would read as not given: refused, as an empty --api-key is.
  for (const auto& [flag, field, value] :
       {std::tuple{"--admin-api-key", "admin_api_key", &o.admin_api_key},
        std::tuple{"--metrics-api-key", "metrics_api_key", &o.metrics_api_key},
        std::tuple{"--engine-api-key", "engine_api_key", &o.engine_api_key}})
    if (cmd.count(flag) > 0) gateway::check_key_option(*value, field, flag);
  for (const std::string& key : o.api_keys) gateway::check_key_option(key, "api_keys", "--api-key");

  // Given empty it would read as not given (the engines' name served instead): refused.
  if (cmd.count("--served-model-name") > 0 && o.served_model_name.empty())
    throw Error("--served-model-name: expected a name, got ''");

  gateway::Topology t;
  if (!o.config.empty()) {
    // The file's pools and what they are: a flag for them would describe other engines.
    for (const char* flag : {"--prefill", "--decode", "--mode", "--model", "--dialect", "--policy"})
      if (cmd.count(flag) > 0)
        throw Error(std::string("gateway: ") + flag + " and --config exclude each other");
    t = gateway::load_topology(o.config);
  } else {
    if (o.decode.empty()) throw Error("gateway: give --config FILE or at least one --decode");
    if (!o.model.empty()) check_model_folder("--model", o.model);
    t = from_flags(o);
  }
  apply_setting_flags(t, o, cmd, !o.config.empty());
  // /v1/models' JSON and /metrics' labels carry only UTF-8: a name that is not would fail every
  // listing (a 500) and spoil every scrape.
  if (!utf8::is_valid(t.served_model_name))
    throw Error((cmd.count("--served-model-name") > 0
                     ? std::string("--served-model-name")
                     : "--config " + o.config + ": served_model_name") +
                ": expected a UTF-8 name, got '" + utf8::to_valid_lossy(t.served_model_name) + "'");
  // Without a model the gateway does not tokenize and the flags would do nothing: refused, as a
  // flag meant to bound requests that bounded none.
  for (const char* flag : {"--generation-config", "--override-generation-config"})
    if (t.model.empty() && cmd.count(flag) > 0)
      throw Error(std::string("gateway: ") + flag +
                  " applies where the gateway tokenizes: give --model (or the topology's model)");
  if (!t.model.empty()) {
    // A chat's default max_tokens where the gateway tokenizes: the engines' (read as they read it).
    const EngineGenerationConfig g = load_generation_config(o.generation_config, t.model);
    t.generation_max_tokens = g.sampling.max_tokens;
    t.generation_max_tokens_cap = g.sampling.max_tokens_cap;
  }
  const std::string mode = gateway::mode_name(t.mode);
  const size_t prefills = t.prefill.endpoints.size(), decodes = t.decode.endpoints.size();
  net::check_socket_host("--host", t.host);  // the flag's, or the topology file's
  const std::string host = t.host;
  const auto drain = t.shutdown_timeout;
  gateway::Gateway gw(std::move(t), o.config);
  gw.start();
  // The first line on stdout names the port (scripts start gateways with --port 0).
  std::printf("tandem gateway: listening on http://%s:%u (mode %s, %zu prefill, %zu decode)\n",
              net::url_host(host).c_str(), static_cast<unsigned>(gw.port()), mode.c_str(), prefills,
              decodes);
  std::fflush(stdout);
  const int sig = stop_signals.wait();
  gateway::Gateway* const gateways[] = {&gw};
  stop_gateways(gateways, drain, stop_signals, "tandem gateway", sig);
}

}  // namespace

void add_gateway_failure_flags(CLI::App& cmd, GatewayFailureFlags& flags,
                               UpstreamTimeoutUnset unset) {
  cmd.add_option("--prefill-retries", flags.prefill_retries,
                 "other engines tried when a prefill fails before the client got anything")
      ->capture_default_str()
      ->check(CLI::Range(0, gateway::kMaxPrefillRetries));
  std::string timeout_help =
      "seconds for a prefill, for the first token, and between two pieces of a stream";
  if (unset == UpstreamTimeoutUnset::kTopologyDefaults) {
    const gateway::Timeouts defaults;
    const auto seconds = [](std::chrono::milliseconds ms) {
      return CLI::detail::to_string(std::chrono::duration<double>(ms).count());
    };
    timeout_help += " (default: " + seconds(defaults.prefill) + " s for a prefill";
    timeout_help += defaults.first_token == defaults.prefill
                        ? " and the first token"
                        : ", " + seconds(defaults.first_token) + " s for the first token";
    timeout_help += ", " + seconds(defaults.idle) + " s between two pieces of a stream)";
  }
  CLI::Option* timeout = cmd.add_option("--upstream-timeout", flags.upstream_timeout, timeout_help);
  if (unset == UpstreamTimeoutUnset::kFlagDefault) timeout->capture_default_str();
  // At least a millisecond: it is rounded to milliseconds, and less would be none. At most the
  // topology's bound on durations (about 24.8 days); beyond it the conversion to milliseconds
  // could overflow before validation sees the value.
  constexpr double kShortest = 0.001, kLongest = 2147483.647;
  // As CLI::Range says it, but with every digit: "2147483.647", not "2.14748e+06".
  std::ostringstream range;
  range << std::setprecision(10) << "FLOAT in [" << kShortest << " - " << kLongest << "]";
  timeout
      ->check(finite_seconds())
      // Its message says why below a millisecond is refused; the range shows the bound.
      ->check(at_least_a_millisecond().description(""))
      ->check(CLI::Range(kShortest, kLongest).description(range.str()));
}

void apply_gateway_failure_flags(gateway::Topology& t, const GatewayFailureFlags& flags,
                                 const CLI::App& cmd, bool only_given) {
  const auto given = [&](const char* flag) { return !only_given || cmd.count(flag) > 0; };
  if (given("--prefill-retries")) t.prefill_retries = flags.prefill_retries;
  if (given("--upstream-timeout")) {
    const auto ms = milliseconds_of(flags.upstream_timeout);
    t.timeouts.prefill = t.timeouts.first_token = t.timeouts.idle = ms;
  }
}

void add_gateway_command(CLI::App& app) {
  auto o = std::make_shared<GatewayCliOptions>();
  auto* cmd = app.add_subcommand(
      "gateway", "OpenAI endpoint in front of prefill and decode engines (P/D disaggregation)");
  cmd->add_option("--config", o->config,
                  "topology file (YAML, see docs/gateway.md); instead of the pool flags "
                  "(--prefill, --decode, --mode, --dialect, --policy, --model); other flags given "
                  "replace the file's settings");
  cmd->add_option("--host", o->host, "address to listen on")->capture_default_str();
  cmd->add_option("--port", o->port, "port (0: any free port)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--mode", o->mode,
                  "aggregated, sequential (vLLM: prefill then decode pulls the KV) or parallel "
                  "(SGLang: both legs at once through a bootstrap room)")
      ->capture_default_str();
  cmd->add_option("--dialect", o->dialect,
                  "what the engines speak: tandem, vllm, sglang, or auto (each engine is asked "
                  "for Tandem's GET /load; one without it is routed as vLLM/SGLang)")
      ->capture_default_str();
  cmd->add_option("--prefill", o->prefill,
                  "prefill engine HOST:PORT (parallel mode: HOST:PORT@KV_TRANSFER_PORT); "
                  "repeatable");
  cmd->add_option("--decode", o->decode, "decode engine HOST:PORT; repeatable");
  cmd->add_option("--policy", o->policy,
                  "scheduling policy: tandem, least_load, round_robin, cache_aware, kv_router")
      ->capture_default_str();
  cmd->add_option("--model", o->model,
                  "model folder: tokenize in the gateway and send token ids to the engines");
  cmd->add_option("--served-model-name", o->served_model_name,
                  "the model id of /v1/models (default: the engines')");
  cmd->add_option("--api-key", o->api_keys, "accepted client API key (repeatable; none: open)");
  cmd->add_option("--admin-api-key", o->admin_api_key, "enables /admin/* and /debug/requests");
  cmd->add_option("--metrics-api-key", o->metrics_api_key,
                  "required as a Bearer token on /metrics (default: open)");
  cmd->add_option("--engine-api-key", o->engine_api_key,
                  "the key of engines started with --api-key, sent on every call to them");
  cmd->add_option("--access-log", o->access_log, "JSON line per request: a file, or - for stdout");
  cmd->add_flag("--reuse-port", o->reuse_port,
                "share the port with other replicas of this gateway (SO_REUSEPORT; the kernel "
                "spreads connections over them)");
  cmd->add_option("--priority-classes", o->priority_classes,
                  "priority classes file (YAML: classes, default, api_keys; see docs/gateway.md)");
  add_max_tokens_flags(*cmd, o->max_tokens);
  cmd->add_option("--generation-config", o->generation_config.source,
                  "the engines' --generation-config (auto, vllm or a folder): where the gateway "
                  "tokenizes (--model), a chat without max_tokens gets the max_new_tokens they "
                  "take from it, and every request is capped by a folder's")
      ->capture_default_str();
  cmd->add_option("--override-generation-config", o->generation_config.overrides,
                  "the engines' --override-generation-config (a JSON object): its "
                  "max_new_tokens caps every request where the gateway tokenizes");
  add_gateway_capacity_flags(*cmd, o->capacity);
  add_gateway_failure_flags(*cmd, o->failure, UpstreamTimeoutUnset::kFlagDefault);
  add_shutdown_timeout_flag(*cmd, o->shutdown_timeout);
  cmd->callback([o, cmd] { run(*o, *cmd); });
}

}  // namespace tandem::cli
