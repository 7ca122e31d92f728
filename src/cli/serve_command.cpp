#include "cli/serve_command.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "cli/engine_child.h"
#include "cli/engine_command.h"
#include "cli/gateway_capacity_flags.h"
#include "cli/gateway_command.h"
#include "cli/gateway_shutdown.h"
#include "cli/generation_config_flags.h"
#include "cli/max_tokens_flags.h"
#include "cli/model_commands.h"
#include "cli/stop_signals.h"
#include "engine/api_server.h"
#include "engine/transfer/kv_transfer.h"
#include "gateway/admin_api.h"
#include "gateway/gateway.h"
#include "gateway/priority.h"
#include "model/make_model.h"
#include "net/http.h"
#include "net/http_client.h"
#include "net/http_server.h"
#include "util/child_process.h"
#include "util/error.h"
#include "util/metrics.h"
#include "util/secret.h"
#include "util/utf8.h"

namespace tandem::cli {
namespace {

// The most engines of a role one serve starts.
constexpr int kMaxEngines = 64;
// The longest an engine's health probe waits for its answer, and between two probes.
constexpr std::chrono::milliseconds kProbeWait = std::chrono::seconds(5);

struct ServeOptions {
  bool kv_events = false;
  std::string model = "tiny-v3", host = "127.0.0.1", engine_host = "127.0.0.1", mode = "parallel",
              policy = "tandem", access_log, admin_api_key, metrics_api_key, priority_classes;
  MaxTokensFlags max_tokens;
  GenerationConfigFlags generation_config;  // passed to every engine
  GatewayFailureFlags gateway_failure;      // `tandem gateway`'s, for every gateway replica
  GatewayCapacityFlags gateway_capacity;    // likewise
  int port = kDefaultGatewayPort, prefill = 1, decode = 1, expert_parallel = 1,
      speculative_tokens = 0, gateways = 1, engine_start_timeout_s = 1800, engine_hang_seconds = 30;
  bool no_gateway_tokenizer = false, batch_invariant = false;
  std::string reasoning_parser;  // passed to every engine
  double shutdown_timeout = default_shutdown_timeout();
  std::vector<std::string> engine_args, api_keys;  // engine_args: passed to every engine
};

// A folder and sim: presets are used as they are; a make-model preset name becomes its
// checkpoint's folder in the user's cache, which run() writes (on first use) once every flag is
// checked.
std::string model_folder(const std::string& model) {
  if (model.rfind("sim:", 0) == 0 || std::filesystem::exists(model)) return model;
  for (const auto& p : model::model_presets())
    if (p == model) return preset_model_path(model).string();
  throw Error("serve: --model '" + model + "' is neither a folder, a sim: preset nor one of the " +
              "make-model presets (tiny-v3, tiny-v2-lite, bench, tiny-qwen3-moe, bench-qwen3-moe)");
}

// The access log gateway replica `replica` writes: --access-log's file, FILE.k for replica k > 0
// (one writer per file), or "-" (standard output, shared).
std::string replica_access_log(const std::string& access_log, int replica) {
  if (replica == 0 || access_log.empty() || access_log == "-") return access_log;
  return access_log + "." + std::to_string(replica);
}

// Where open(O_CREAT) creates a file for `path` when nothing is there: the path itself, or, for a
// dangling symlink, its target (a link's relative target is read from the link's folder). A
// chain longer than the kernel follows is left as it is, for the open to refuse.
std::filesystem::path file_created_for(std::filesystem::path path) {
  namespace fs = std::filesystem;
  constexpr int kMaxLinks = 40;  // Linux's MAXSYMLINKS
  std::error_code ec;
  for (int i = 0; i < kMaxLinks && fs::is_symlink(fs::symlink_status(path, ec)); ++i) {
    const fs::path target = fs::read_symlink(path, ec);
    if (ec) break;
    path = target.is_absolute() ? target : path.parent_path() / target;
  }
  return path;
}

// Whether the gateway will be able to open `path` for appending (creating it if missing), told
// before anything starts and without writing anything: a typo in the folder must not cost a
// model load. Asked with the effective ids, as the open is. What only the open can tell (a FIFO
// without a reader) is left to the gateway.
void check_access_log(const std::string& path) {
  namespace fs = std::filesystem;
  if (path.empty() || path == "-") return;
  const std::string said = "--access-log " + path + ": ";
  const auto can = [](const fs::path& p, int mode) {
    return ::faccessat(AT_FDCWD, p.c_str(), mode, AT_EACCESS) == 0;
  };
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (fs::is_directory(status)) throw Error(said + "is a directory, not a file");
  if (fs::exists(status)) {
    if (!can(path, W_OK)) throw Error(said + "cannot be written: " + std::strerror(errno));
    return;
  }
  if (ec && status.type() != fs::file_type::not_found) throw Error(said + ec.message());
  const fs::path created = file_created_for(path);
  const fs::path parent = created.parent_path();
  const fs::path folder = parent.empty() ? fs::path(".") : parent;
  const std::string where =
      created == fs::path(path) ? "" : " (the link's target " + created.string() + ")";
  if (!fs::is_directory(folder, ec))
    throw Error(said + "its folder " + folder.string() + " does not exist" + where);
  if (!can(folder, W_OK | X_OK))
    throw Error(said + "cannot create a file in " + folder.string() + where + ": " +
                std::strerror(errno));
}

gateway::Endpoint endpoint(const EngineChild& c, const std::string& host, bool bootstrap) {
  gateway::Endpoint e;
  e.host = host;
  e.port = c.ports().http;
  e.bootstrap_port = bootstrap ? c.ports().kv_transfer : 0;
  e.kv_events = c.ports().events;
  e.kv_events_replay = c.ports().events_replay;
  return e;
}

// The gateways answer /health once their listeners and scheduling threads run; their engines'
// endpoints start healthy (the engines named their ports), so this waits for the gateway
// itself, not for its probes. A deadline for the whole wait, each try bounded by what is left.
void wait_healthy(const std::string& host, uint16_t port) {
  constexpr auto kLimit = std::chrono::seconds(30);
  const auto deadline = std::chrono::steady_clock::now() + kLimit;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left <= std::chrono::milliseconds(0)) break;
    try {
      if (net::http_request(host, port, "GET", "/health", {}, {},
                            std::min<std::chrono::milliseconds>(left, std::chrono::seconds(1)))
              .status == 200)
        return;
    } catch (const std::exception&) {
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  throw Error("serve: the gateway on " + net::url_host(host) + ":" + std::to_string(port) +
              " did not answer /health with 200 within " + std::to_string(kLimit.count()) + " s");
}

void run(const ServeOptions& o, const CLI::App& cmd) {
  // Given empty, a key flag would read as not given: refused before any engine loads, as an
  // empty --api-key is.
  for (const auto& [flag, field, value] :
       {std::tuple{"--admin-api-key", "admin_api_key", &o.admin_api_key},
        std::tuple{"--metrics-api-key", "metrics_api_key", &o.metrics_api_key}})
    if (cmd.count(flag) > 0) gateway::check_key_option(*value, field, flag);
  for (const std::string& key : o.api_keys) gateway::check_key_option(key, "api_keys", "--api-key");
  net::check_socket_host("--host", o.host);
  net::check_socket_host("--engine-host", o.engine_host);
  // The decode engines take it as their one --kv-transfer-allow entry, which must name something.
  if (o.engine_host.empty())
    throw Error("serve: --engine-host: expected an address for the engines to listen on, got ''");
  const StopSignals stop_signals;  // before any thread starts
  // Until the stack answers, a stop signal ends serve at once; its engines die with it
  // (EngineChild: PR_SET_PDEATHSIG), the loading ones too.
  std::optional<StopWhileStarting> starting(std::in_place, stop_signals, "tandem serve");
  // One KV transfer secret for the deployment (unless the caller's environment has one): every
  // engine started below inherits it, so only they move KV through each other's transfer ports.
  if (const char* own = std::getenv(engine::kKvTransferSecretVariable); !own || !*own)
    ::setenv(engine::kKvTransferSecretVariable, random_secret_hex().c_str(), 1);
  // Likewise an API key for the engines, which the gateway sends on every call to them: clients
  // reach the engines through the gateway only, with the gateway's keys.
  const std::string engine_api_key = random_secret_hex();
  ::setenv(engine::kEngineApiKeyVariable, engine_api_key.c_str(), 1);
  // The gateway reaches engines listening on every address through the loopback one.
  const std::string engine_address = o.engine_host == "0.0.0.0" ? "127.0.0.1"
                                     : o.engine_host == "::"    ? "::1"
                                                                : o.engine_host;

  const gateway::PdMode mode = gateway::parse_mode(o.mode, "--mode");
  gateway::PriorityClasses classes;
  if (!o.priority_classes.empty()) classes = gateway::load_priority_classes(o.priority_classes);
  if (const std::string why = gateway::unknown_policy_error(o.policy); !why.empty())
    throw Error("--policy: " + why);
  const std::unique_ptr<gateway::Policy> policy = gateway::make_policy(o.policy);
  // Refused, not dropped, as `tandem gateway` refuses prefill engines for an aggregated pool.
  const bool aggregated = mode == gateway::PdMode::kAggregated;
  if (aggregated && cmd.count("--prefill") > 0 && o.prefill > 0)
    throw Error("serve: --prefill " + std::to_string(o.prefill) +
                ": --mode aggregated runs no prefill engines (each engine does both legs); drop "
                "--prefill, or give --mode sequential or parallel");
  if (!aggregated && o.prefill < 1)
    throw Error("serve: --prefill " + std::to_string(o.prefill) + ": --mode " + o.mode +
                " needs at least one prefill engine (--mode aggregated runs none)");
  const int prefills = aggregated ? 0 : o.prefill;
  // The generation config's own flags (a folder, an override); the model's file is read below.
  load_generation_config(o.generation_config, std::string());
  for (int i = 0; i < o.gateways; ++i) check_access_log(replica_access_log(o.access_log, i));
  // One model id for the gateway and every engine: the engines' own flag if given, else the
  // name the user typed (a preset, a sim: preset) or the folder's name.
  std::string served;
  std::vector<std::string> extra;
  for (size_t i = 0; i < o.engine_args.size(); ++i) {
    const std::string& a = o.engine_args[i];
    if (a == "--served-model-name" && i + 1 < o.engine_args.size()) served = o.engine_args[i + 1];
    if (a.rfind("--served-model-name=", 0) == 0) served = a.substr(20);
  }
  // Before any engine starts: /v1/models' JSON and /metrics' labels carry only UTF-8.
  if (!utf8::is_valid(served))
    throw Error("--served-model-name: expected a UTF-8 name, got '" + utf8::to_valid_lossy(served) +
                "'");
  const std::string model = model_folder(o.model);  // a preset's is written below
  if (served.empty()) {
    std::filesystem::path folder(model);
    if (folder.filename().empty()) folder = folder.parent_path();  // "dir/"
    served = model == o.model ? folder.filename().string() : o.model;
    if (model.rfind("sim:", 0) == 0) served = model.substr(4);
    extra = {"--served-model-name", served};
    if (!utf8::is_valid(served))
      throw Error("--model " + utf8::to_valid_lossy(o.model) +
                  ": the served model name is the folder's name, which is not UTF-8; give "
                  "--engine-arg=--served-model-name with a UTF-8 name");
  }
  // An engine's command line for its ports (0: any free one; a restarted engine gets its own
  // again, so the gateway finds it where it was): what serve's own flags say, then the user's
  // --engine-arg values.
  auto serve_engine_args = [&](const std::string& role, const EnginePorts& ports) {
    std::vector<std::string> a = {"tandem", "engine",      "--model", model,
                                  "--host", o.engine_host, "--port",  std::to_string(ports.http),
                                  "--role", role};
    if (role == "prefill")
      a.insert(a.end(), {"--kv-transfer-port", std::to_string(ports.kv_transfer)});
    else if (o.engine_host != "0.0.0.0" && o.engine_host != "::")  // its prefills: this address
      a.insert(a.end(), {"--kv-transfer-allow", o.engine_host});
    if (o.expert_parallel > 1)
      a.insert(a.end(), {"--expert-parallel", std::to_string(o.expert_parallel)});
    if (o.speculative_tokens > 0)  // every engine: P/D legs must agree to move the MTP layer
      a.insert(a.end(), {"--speculative-tokens", std::to_string(o.speculative_tokens)});
    if (o.batch_invariant) a.push_back("--batch-invariant");
    for (std::string& arg : generation_config_args(o.generation_config))
      a.push_back(std::move(arg));
    // Every engine: in P/D the decode leg writes the answer, and any engine may serve a chat.
    if (!o.reasoning_parser.empty()) a.insert(a.end(), {"--reasoning-parser", o.reasoning_parser});
    // The gateway passes each request's class as its priority, or the policy's deadline to the
    // engine that computes the prompt: the engines schedule by it.
    if (gateway::engine_schedules_by_priority(classes, *policy, role != "decode"))
      a.insert(a.end(), {"--scheduling-policy", "priority"});
    if (o.kv_events) {  // the gateway's prefix index subscribes
      const std::string any = "tcp://" + net::url_host(o.engine_host) + ":*";
      a.insert(a.end(),
               {"--kv-events-config",
                R"({"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": ")" +
                    (ports.events.empty() ? any : ports.events) + R"(", "replay_endpoint": ")" +
                    (ports.events_replay.empty() ? any : ports.events_replay) + R"("})"});
    }
    if (o.max_tokens.limit > 0)
      a.insert(a.end(), {"--max-tokens-limit", std::to_string(o.max_tokens.limit)});
    if (o.max_tokens.default_value > 0)
      a.insert(a.end(), {"--default-max-tokens", std::to_string(o.max_tokens.default_value)});
    // The gateway has drained the stack when its engines are stopped: what an engine still holds
    // then (KV a decode leg will never pull) would only hold up the stop, to ChildProcess's kill.
    // An --engine-arg of the user's says otherwise.
    const bool own_drain =
        std::any_of(o.engine_args.begin(), o.engine_args.end(),
                    [](const std::string& arg) { return arg.rfind("--shutdown-timeout", 0) == 0; });
    if (!own_drain) a.insert(a.end(), {"--shutdown-timeout", "0"});
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  auto engine_args = [&](const std::string& role, const EnginePorts& ports) {
    std::vector<std::string> a = serve_engine_args(role, ports);
    a.insert(a.end(), o.engine_args.begin(), o.engine_args.end());
    return a;
  };
  // Each role's command line as its engines will check it (a typo in an --engine-arg made every
  // engine exit at its start): first what serve's own flags put there, so an error there names
  // no --engine-arg the user never gave, then with the user's values, which also say how long the
  // engines drain at the stop (serve waits that long before it kills one).
  std::chrono::milliseconds engine_drain{0};
  for (const char* role : mode == gateway::PdMode::kAggregated ? std::vector{"both"}
                                                               : std::vector{"prefill", "decode"}) {
    try {
      // With the name the user gave by --engine-arg, as the engines get it: without one the engine
      // names the model by its folder's path, refused where that is not UTF-8 (the very case
      // whose error asks for --engine-arg=--served-model-name).
      std::vector<std::string> own = serve_engine_args(role, EnginePorts{});
      if (extra.empty()) own.insert(own.end(), {"--served-model-name", served});
      check_engine_command_line(own);
    } catch (const Error& e) {
      throw Error(std::string("serve: ") + e.what());
    }
    try {
      engine_drain =
          std::max(engine_drain, check_engine_command_line(engine_args(role, EnginePorts{})));
    } catch (const Error& e) {
      throw Error(std::string("serve: --engine-arg: ") + e.what());
    }
  }
  // The gateway's address, and the engines' (each on a port of its own choosing): one in use or
  // mistyped, found once every engine has loaded, would have cost every load.
  net::check_listen_address("--host", o.host, "--port", static_cast<uint16_t>(o.port));
  net::check_listen_address("--engine-host", o.engine_host, "--engine-host", 0);
  // Last, every flag checked: a make-model preset is written now, gigabytes for some, and a typo
  // must cost none of it.
  if (model != o.model) preset_model_folder(o.model);
  std::vector<std::unique_ptr<EngineChild>> children;
  gateway::Topology g;
  g.host = o.host;
  g.port = static_cast<uint16_t>(o.port);
  g.mode = mode;
  g.access_log = o.access_log;
  g.api_keys = o.api_keys;
  g.admin_api_key = o.admin_api_key;
  g.metrics_api_key = o.metrics_api_key;
  g.served_model_name = served;
  g.policy = o.policy;
  g.engine_api_key = engine_api_key;
  g.max_tokens_limit = o.max_tokens.limit;
  g.default_max_tokens = o.max_tokens.default_value;
  g.priority = classes;
  g.shutdown_timeout = shutdown_drain(o.shutdown_timeout);
  // As over a --config file: a flag given replaces the setting, the others keep the topology's
  // own (a stream's idle bound of 120 s, not --upstream-timeout's 300 s default).
  apply_gateway_failure_flags(g, o.gateway_failure, cmd, /*only_given=*/true);
  // As `tandem gateway` without --config: every flag, given or by default (each replica copies g).
  apply_gateway_capacity_flags(g, o.gateway_capacity, cmd, /*only_given=*/false);
  // The gateway tokenizes once with the model's own tokenizer and sends ids; simulated engines
  // use the default DeepSeek-V3 tokenizer, so the gateway does too (real prompt lengths for
  // its scheduling instead of estimates).
  const bool sim = model.rfind("sim:", 0) == 0;
  if (!o.no_gateway_tokenizer) g.model = sim ? default_tokenizer().string() : model;
  // Its chats without max_tokens get the engines' default (the folder a simulated engine lacks
  // has none); read before any engine starts, so a bad file fails at once.
  const EngineGenerationConfig generation =
      load_generation_config(o.generation_config, sim ? std::string() : model);
  g.generation_max_tokens = generation.sampling.max_tokens;
  g.generation_max_tokens_cap = generation.sampling.max_tokens_cap;
  // A tokens-in chat becomes a completion, whose answer the engine does not read for reasoning:
  // with a reasoning parser the engines get chats as chats (the gateway still tokenizes to route).
  if (!o.reasoning_parser.empty()) g.prefill.tokens_in = g.decode.tokens_in = false;
  // Engines start one after another: each has its ports by the time the next one starts.
  auto start_engine = [&](const std::string& role) {
    EngineChild::Options child;
    child.name = role == "prefill" ? "prefill engine" : "decode engine";
    child.kv_events = o.kv_events;
    child.start_timeout = std::chrono::seconds(o.engine_start_timeout_s);
    child.hang_timeout = std::chrono::seconds(o.engine_hang_seconds);
    // A hung engine accepts the connection (the kernel does) and never answers: each probe waits
    // at most half the hang timeout, and they start a third of it apart, so that two fail within
    // it (EngineChild kills on two at least: one slow answer under load is no hang).
    const auto probe_wait = std::min<std::chrono::milliseconds>(child.hang_timeout / 2, kProbeWait);
    child.probe_interval = std::min<std::chrono::milliseconds>(child.hang_timeout / 3, kProbeWait);
    child.probe = engine_health_probe(engine_address, probe_wait);
    children.push_back(std::make_unique<EngineChild>(
        std::move(child),
        [&engine_args, role](const EnginePorts& ports) { return engine_args(role, ports); },
        stop_signals));
    return endpoint(*children.back(), engine_address, role == "prefill");
  };
  for (int i = 0; i < prefills; ++i) g.prefill.endpoints.push_back(start_engine("prefill"));
  for (int i = 0; i < o.decode; ++i)
    g.decode.endpoints.push_back(
        start_engine(mode == gateway::PdMode::kAggregated ? "both" : "decode"));
  // Gateway replicas share the port (SO_REUSEPORT) and the process (its file descriptor limit)
  // and nothing else: each follows the engines' KV events and load reports itself. Each takes its
  // share of the engines' in-flight limits and of the connection cap, so together they send no
  // engine more, and hold no more connections, than one gateway would (plus one per extra
  // replica); they count each client address's connections together.
  std::vector<std::unique_ptr<gateway::Gateway>> gateways;
  // An admin change through the replica a connection reached applies to every replica.
  std::shared_ptr<gateway::AdminReplicas> admin_replicas;
  // A scrape reaches one replica (on a keep-alive connection always the same one) and shows every
  // replica's series, each with its gateway_replica label (sum over it for totals).
  std::shared_ptr<metrics::RegistryGroup> metrics_replicas;
  std::shared_ptr<net::ConnectionsPerAddress> connections_per_address;
  if (o.gateways > 1) {
    admin_replicas = std::make_shared<gateway::AdminReplicas>(static_cast<size_t>(o.gateways));
    metrics_replicas = std::make_shared<metrics::RegistryGroup>();
    g.reuse_port = true;
    share_among_gateway_replicas(g, o.gateways, net::descriptor_limit());
    if (g.max_connections_per_address > 0)
      connections_per_address =
          std::make_shared<net::ConnectionsPerAddress>(g.max_connections_per_address);
  }
  for (int i = 0; i < o.gateways; ++i) {
    gateway::Topology replica = g;
    replica.access_log = replica_access_log(g.access_log, i);
    // Each replica counts for itself, its series told apart by their gateway_replica label.
    if (o.gateways > 1) replica.metrics_replica = std::to_string(i);
    gateways.push_back(std::make_unique<gateway::Gateway>(
        replica, std::string(), admin_replicas, metrics_replicas, connections_per_address));
    gateways.back()->start();
    g.port = gateways.front()->port();  // the others join the first one's port
  }
  // Engines are listening (their first lines said so) and the gateways' endpoints start healthy:
  // once the gateways answer, so does the printed URL.
  for (int i = 0; i < o.gateways; ++i) wait_healthy(o.host, g.port);
  starting.reset();  // before the first line: whoever read it may stop the stack in order
  std::printf(
      "tandem serve: listening on http://%s:%u (gateway%s, mode %s, %d prefill + %d decode "
      "engines of %s)\n",
      net::url_host(o.host).c_str(), static_cast<unsigned>(g.port),
      o.gateways > 1 ? (" x" + std::to_string(o.gateways) + " replicas").c_str() : "",
      o.mode.c_str(), prefills, o.decode, model.c_str());
  for (size_t i = 0; i < children.size(); ++i) {
    const bool prefill = i < static_cast<size_t>(prefills);
    const gateway::Endpoint& e =
        prefill ? g.prefill.endpoints[i] : g.decode.endpoints[i - static_cast<size_t>(prefills)];
    std::printf("tandem serve: %s engine http://%s:%u (pid %d", prefill ? "prefill" : "decode",
                net::url_host(e.host).c_str(), static_cast<unsigned>(e.port),
                static_cast<int>(children[i]->pid()));
    if (prefill) std::printf(", KV transfer port %u", static_cast<unsigned>(e.bootstrap_port));
    std::printf(")\n");
  }
  std::fflush(stdout);
  // Until a stop signal: engines that die are restarted (engine_child.h).
  int sig = 0;
  for (;;) {
    if (auto s = stop_signals.wait_for(std::chrono::milliseconds(200))) {
      sig = *s;
      break;
    }
    for (auto& c : children) c->supervise(EngineChild::Clock::now());
  }
  // Every replica refuses new requests before any drains, and they drain together: one drain,
  // not one per replica.
  std::vector<gateway::Gateway*> replicas;
  for (auto& gw : gateways) replicas.push_back(gw.get());
  stop_gateways(replicas, g.shutdown_timeout, stop_signals, "tandem serve", sig);
  stop_engines(children, engine_stop_grace(engine_drain), stop_signals, "tandem serve");
  children.clear();
}

}  // namespace

void add_serve_command(CLI::App& app) {
  auto o = std::make_shared<ServeOptions>();
  auto* cmd = app.add_subcommand(
      "serve", "One command for a whole stack: a gateway plus prefill and decode engines");
  cmd->add_option("--model", o->model,
                  "model folder, a make-model preset (its checkpoint is written to ~/.cache/tandem "
                  "on first use), or sim:PRESET for simulated engines")
      ->capture_default_str();
  cmd->add_option("--host", o->host, "the gateway's address")->capture_default_str();
  cmd->add_option("--engine-host", o->engine_host,
                  "the address the engines listen on (HTTP, KV transfer, KV events); loopback "
                  "unless engines of other hosts must reach them")
      ->capture_default_str();
  cmd->add_option("--engine-start-timeout", o->engine_start_timeout_s,
                  "seconds an engine may take to start (load its model) and name its ports; one "
                  "that takes longer is killed: serve fails at its first start, or tries again "
                  "after the restart back-off")
      ->capture_default_str()
      ->check(CLI::Range(1, 7 * 24 * 3600));
  cmd->add_option("--engine-hang-seconds", o->engine_hang_seconds,
                  "seconds a running engine's /health may go unanswered (it is stopped or frozen: "
                  "its HTTP server does not answer; a busy or draining engine still answers) "
                  "before serve kills it (SIGKILL) and restarts it on its ports, as it restarts "
                  "an engine that died; 0: never")
      ->capture_default_str()
      ->check(CLI::Range(0, 7 * 24 * 3600));
  cmd->add_option("--port", o->port, "gateway port (0: any free port)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--mode", o->mode, "aggregated, sequential (vllm) or parallel (sglang)")
      ->capture_default_str();
  // Bounded as --gateways is: a typo (1000 for 10) would start engine after engine.
  cmd->add_option("--prefill", o->prefill, "prefill engines (none with --mode aggregated)")
      ->capture_default_str()
      ->check(CLI::Range(0, kMaxEngines));
  cmd->add_option("--decode", o->decode, "decode engines (with --mode aggregated: engines)")
      ->capture_default_str()
      ->check(CLI::Range(1, kMaxEngines));
  cmd->add_option("--expert-parallel", o->expert_parallel,
                  "rank processes per engine, its routed experts spread over them (see `tandem "
                  "engine --expert-parallel`)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  cmd->add_option("--speculative-tokens", o->speculative_tokens,
                  "MTP draft tokens per step for every engine (see `tandem engine "
                  "--speculative-tokens`)")
      ->capture_default_str()
      ->check(CLI::Range(0, 8));
  cmd->add_option("--reasoning-parser", o->reasoning_parser,
                  "deepseek_r1 or qwen3: every engine reads chat answers' reasoning apart (see "
                  "`tandem engine --reasoning-parser`)")
      ->check(CLI::IsMember({"deepseek_r1", "qwen3"}));
  cmd->add_flag("--batch-invariant", o->batch_invariant,
                "batch-invariant numerics in every engine (see `tandem engine --batch-invariant`)");
  cmd->add_option("--engine-arg", o->engine_args,
                  "an argument for every engine, e.g. --engine-arg=--kv-cache-gb "
                  "--engine-arg=0.25 (repeatable); the engines drain nothing at the stop (the "
                  "gateway has) unless given --shutdown-timeout this way, which serve then waits "
                  "for (plus 10 s) before it kills them");
  cmd->add_option("--access-log", o->access_log,
                  "gateway access log: a file (replica k > 0 of --gateways writes FILE.k), or - "
                  "for stdout");
  cmd->add_option("--gateways", o->gateways,
                  "gateway replicas behind the one port (SO_REUSEPORT), in one process: each "
                  "takes its share of the engines' in-flight limits, of --max-connections "
                  "(without it, of three quarters of the file descriptor limit) and of "
                  "--max-queued-body-bytes (bounds of the whole stack, divided rounding up); "
                  "--max-connections-per-address bounds an address across all of them; "
                  "--max-queue and --http-threads are each replica's own; an admin change "
                  "through one applies to all")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  cmd->add_option("--priority-classes", o->priority_classes,
                  "priority classes file (YAML: classes, default, api_keys; docs/gateway.md); "
                  "engines then schedule by priority");
  cmd->add_flag("--kv-events", o->kv_events,
                "engines publish KV events and the gateway's prefix index follows them (for "
                "the cache-aware policies: tandem, kv_router)");
  cmd->add_option("--policy", o->policy,
                  "gateway scheduling policy: tandem, least_load, round_robin, cache_aware, "
                  "kv_router")
      ->capture_default_str();
  cmd->add_option("--api-key", o->api_keys, "accepted client API key (repeatable; none: open)");
  add_max_tokens_flags(*cmd, o->max_tokens);  // for the gateway and every engine
  add_generation_config_flags(*cmd, o->generation_config);
  cmd->add_option("--admin-api-key", o->admin_api_key, "enables the gateway's /admin/* API");
  cmd->add_option("--metrics-api-key", o->metrics_api_key,
                  "required as a Bearer token on the gateway's /metrics (default: open)");
  cmd->add_flag("--no-gateway-tokenizer", o->no_gateway_tokenizer,
                "pass request bodies through instead of tokenizing in the gateway");
  add_gateway_capacity_flags(*cmd, o->gateway_capacity);  // checked as the command line is read
  // Its engines are child processes with HTTP servers of their own: say which one this is.
  cmd->get_option("--http-threads")
      ->description(
          "the gateway's HTTP io threads (each replica's own); the engines take theirs as "
          "--engine-arg=--http-threads --engine-arg=N");
  // Checked as the command line is read; applied only when given (see run).
  add_gateway_failure_flags(*cmd, o->gateway_failure, UpstreamTimeoutUnset::kTopologyDefaults);
  add_shutdown_timeout_flag(*cmd, o->shutdown_timeout);
  cmd->callback([o, cmd] { run(*o, *cmd); });
}

}  // namespace tandem::cli
