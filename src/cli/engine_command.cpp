#include "cli/engine_command.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "api/api_key.h"
#include "api/reasoning.h"
#include "cli/cli11_errors.h"
#include "cli/gateway_capacity_flags.h"
#include "cli/gateway_shutdown.h"
#include "cli/generation_config_flags.h"
#include "cli/max_tokens_flags.h"
#include "cli/model_commands.h"
#include "cli/number_checks.h"
#include "cli/sim_executor_flags.h"
#include "cli/stop_signals.h"
#include "engine/api_server.h"
#include "engine/executor/cpu_executor.h"
#include "engine/executor/latency_probe.h"
#include "engine/executor/qwen3_executor.h"
#include "engine/executor/sim_executor.h"
#include "engine/expert_parallel/ep_executor.h"
#include "engine/expert_parallel/rank_process.h"
#include "engine/output_processor.h"
#include "kernels/cpu/ops.h"
#include "model/model_folder.h"
#include "net/http.h"
#include "placement/files.h"
#include "util/duration.h"
#include "util/error.h"
#include "util/file.h"
#include "util/huge_pages.h"
#include "util/progress.h"
#include "util/utf8.h"

namespace tandem::cli {
namespace {

struct EngineOptions {
  std::string model, tokenizer, served_model_name, host = "0.0.0.0";
  int port = 8000;
  int64_t block_size = 16, num_blocks = 0;
  double kv_cache_gb = 1.0;
  std::string kv_cache_dtype = "auto", mla_rescale = "multiply";
  int64_t expert_load_window = 1024;
  std::string expert_load_dump;
  int64_t max_num_seqs = 64, max_num_batched_tokens = 2048;
  std::string scheduling_policy = "fcfs";
  bool no_prefix_caching = false;
  std::string kv_events_config;
  int http_threads = 1;
  int64_t max_body_bytes = 8 << 20;
  size_t max_connections = 0;
  std::vector<std::string> allowed_origins = net::HttpServerOptions{}.allowed_origins;
  SimExecutorFlags sim;
  double sim_time_scale = 1.0;
  int expert_parallel = 1;
  double expert_parallel_stall_timeout = 300;
  std::string expert_placement;
  int64_t rebalance_interval = 0;
  int64_t max_model_len = 0;
  MaxTokensFlags max_tokens;
  GenerationConfigFlags generation_config;
  std::vector<std::string> api_keys;
  std::string role = "both";
  int kv_transfer_port = -2;  // -2: the role's default (prefill 8998, both any free, decode none)
  std::string kv_transfer_host, advertise_host, engine_id;
  double kv_transfer_timeout = 120;
  double kv_transfer_handshake_timeout = engine::KvTransferConfig{}.handshake_timeout_s;
  bool kv_transfer_checksum = false;
  std::string kv_transport = "shm";
  double shutdown_timeout = default_shutdown_timeout();
  std::string kv_transfer_secret, kv_transfer_secret_file;
  std::vector<std::string> kv_transfer_allow;
  int64_t speculative_tokens = 0;
  std::string reasoning_parser;
  bool batch_invariant = false;
  bool int8_lm_head = false;
};

const std::map<std::string, engine::KvTransportKind> kKvTransports = {
    {"shm", engine::KvTransportKind::kShm}, {"tcp", engine::KvTransportKind::kTcp}};

const std::map<std::string, std::optional<model::LatentType>> kKvCacheTypes = {
    {"auto", std::nullopt},
    {"float32", model::LatentType::kF32},
    {"bfloat16", model::LatentType::kBF16}};
const std::map<std::string, kernels::MlaRescale> kMlaRescales = {
    {"multiply", kernels::MlaRescale::kMultiply}, {"amla", kernels::MlaRescale::kAmla}};

// The address decode engines should connect to when we listen on every interface: the first
// non-loopback IPv4 address, else loopback.
// The flag, else the file, else the environment (kv_transfer.h); empty: no handshake.
std::string kv_transfer_secret(const EngineOptions& o) {
  if (!o.kv_transfer_secret.empty()) return o.kv_transfer_secret;
  if (!o.kv_transfer_secret_file.empty()) {
    std::string s = read_file(o.kv_transfer_secret_file);
    while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
    if (s.empty())
      throw Error("--kv-transfer-secret-file " + o.kv_transfer_secret_file + " holds no secret");
    return s;
  }
  const char* env = std::getenv(engine::kKvTransferSecretVariable);
  return env ? env : "";
}

std::string advertised_host(const std::string& listen_host) {
  if (listen_host != "0.0.0.0" && listen_host != "::" && !listen_host.empty()) return listen_host;
  std::string found = "127.0.0.1";
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return found;
  for (ifaddrs* a = list; a; a = a->ifa_next) {
    if (!a->ifa_addr || a->ifa_addr->sa_family != AF_INET) continue;
    char buf[INET_ADDRSTRLEN];
    const auto* in = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
    if (!inet_ntop(AF_INET, &in->sin_addr, buf, sizeof buf)) continue;
    if (std::string(buf).rfind("127.", 0) == 0) continue;
    found = buf;
    break;
  }
  freeifaddrs(list);
  return found;
}

struct SimFitOptions {
  std::string model, out, name = "fitted";
  double kv_cache_gb = 1.0;
};

constexpr std::string_view kSimPrefix = "sim:";

// The latent cache a real model's executor (one process or expert-parallel) gets.
engine::CpuExecutorOptions cache_options(const EngineOptions& o) {
  engine::CpuExecutorOptions co;
  co.block_size = o.block_size;
  co.num_blocks = o.num_blocks;
  co.kv_cache_bytes = o.kv_cache_gb * double(1ull << 30);
  co.kv_cache_type = kKvCacheTypes.at(o.kv_cache_dtype);
  co.speculative_tokens = o.speculative_tokens;
  return co;
}

// From config.json alone, before the weights load: a KV cache that can never fit this machine,
// or a --max-model-len past the model's context, is refused at once. A DeepSeek model's "auto"
// cache type follows its weights, not known yet; the check assumes the smaller one (BF16), so it
// refuses only what the check after loading refuses too, which stays the exact one. A tokenizer
// with ids past the model's vocabulary is refused too (its ids would index past the embedding).
void check_against_model_config(const EngineOptions& o, const text::Tokenizer& tokenizer) {
  const auto co = cache_options(o);
  const std::string tokenizer_dir = o.tokenizer.empty() ? o.model : o.tokenizer + " (--tokenizer)";
  int64_t context = 0;
  if (model::architecture_of(o.model) == model::kQwen3MoeArchitecture) {
    const auto c = model::Qwen3MoeConfig::load(o.model);
    model::check_tokenizer_fits(tokenizer, tokenizer_dir, c.vocab_size, o.model);
    context = c.max_position_embeddings;
    engine::kv_blocks_for(model::qwen3_cache_shape(c, o.block_size, co.kv_cache_type), co);
  } else {
    const auto c = model::ModelConfig::load(o.model);
    model::check_tokenizer_fits(tokenizer, tokenizer_dir, c.vocab_size, o.model);
    context = c.max_position_embeddings;
    engine::kv_blocks_for(model::deepseek_cache_shape(
                              c, o.block_size, co.kv_cache_type.value_or(model::LatentType::kBF16)),
                          co);
  }
  // As vLLM: a length past the model's context is refused, not believed.
  if (o.max_model_len > context)
    throw Error("--max-model-len " + std::to_string(o.max_model_len) +
                " exceeds the model's context of " + std::to_string(context) +
                " tokens (max_position_embeddings in config.json)");
}

// A simulated model's flags given for a model folder: refused, not dropped (a run that ignored
// one would measure something other than what was asked).
void refuse_sim_flags(const EngineOptions& o, const CLI::App& cmd) {
  std::vector<std::string> flags(o.sim.given.begin(), o.sim.given.end());
  if (cmd.count("--sim-time-scale") > 0) flags.push_back("--sim-time-scale");
  if (!flags.empty())
    throw Error(flags.front() + " applies to a simulated model (--model sim:PRESET); " + o.model +
                " is a model folder");
}

// The settings that need no model, its folder or its tokenizer: checked before anything loads
// (a typo must not cost a model load), and by `tandem serve` before it writes or starts anything.
void check_settings(const EngineOptions& o, const CLI::App& cmd) {
  api::check_api_keys(o.api_keys, "--api-key");
  net::check_socket_host("--host", o.host);
  net::check_socket_host("--kv-transfer-host", o.kv_transfer_host);
  // Given empty it would read as not given (the model's path served instead): refused.
  if (cmd.count("--served-model-name") > 0 && o.served_model_name.empty())
    throw Error("--served-model-name: expected a name, got ''");
  // The served name goes into /v1/models' JSON and /metrics' labels, which carry only UTF-8: a
  // name that is not would fail every listing (a 500) and spoil every scrape.
  if (const std::string& name = o.served_model_name.empty() ? o.model : o.served_model_name;
      !utf8::is_valid(name))
    throw Error(o.served_model_name.empty()
                    ? "--model " + utf8::to_valid_lossy(o.model) +
                          ": the served model name is the folder's path, which is not UTF-8; "
                          "give --served-model-name with a UTF-8 name"
                    : "--served-model-name: expected a UTF-8 name, got '" +
                          utf8::to_valid_lossy(name) + "'");
  const bool sim = o.model.rfind(kSimPrefix, 0) == 0;
  // Flags the engine would not use are refused, not dropped: a run that ignored one would
  // measure something other than what was asked.
  if (o.expert_parallel <= 1)
    for (const char* flag :
         {"--expert-placement", "--rebalance-interval", "--expert-parallel-stall-timeout"})
      if (cmd.count(flag) > 0)
        throw Error(
            std::string(flag) + " needs --expert-parallel N (a real model's ranks" +
            (sim ? "; a sim: model takes --sim-expert-parallel N and --sim-placement)" : ")"));
  if (o.scheduling_policy != "fcfs" && o.scheduling_policy != "priority")
    throw Error("--scheduling-policy: expected fcfs or priority, got '" + o.scheduling_policy +
                "'");
  if (!o.reasoning_parser.empty() && !api::reasoning_format_named(o.reasoning_parser))
    throw Error("--reasoning-parser: expected deepseek_r1 or qwen3, got '" + o.reasoning_parser +
                "'");
  // The generation config's own flags (a folder, an override); the model's file is read later.
  load_generation_config(o.generation_config, std::string());
  if (!o.kv_events_config.empty()) engine::KvEventsConfig::parse(o.kv_events_config);
  engine::parse_engine_role(o.role);
  // Not --kv-transfer-secret-file: it may be a pipe whose one secret is the engine's to read.
  engine::check_kv_peer_allow(o.kv_transfer_allow);
  if (sim && o.expert_parallel > 1)
    throw Error(
        "--expert-parallel runs a real model's experts; a sim: model takes "
        "--sim-expert-parallel");
  if (o.speculative_tokens > 0 && o.expert_parallel > 1)
    throw Error(
        "--speculative-tokens: speculative decoding runs a real model's MTP module in one "
        "process; not with --expert-parallel");
}

// The KV transfer listener's port: the flag's, else the role's default (a prefill engine 8998,
// both any free port, a decode engine none: -1).
int kv_transfer_port(const EngineOptions& o) {
  if (o.kv_transfer_port != -2) return o.kv_transfer_port;
  return o.role == "prefill" ? 8998 : o.role == "both" ? 0 : -1;
}

// The HTTP server and the KV transfer listener on one port: each test bind passed alone, and the
// second listener failed after the model's load.
void check_own_ports(const EngineOptions& o, const std::string& transfer_host) {
  const int port = kv_transfer_port(o);
  if (port <= 0 || port != o.port) return;
  auto any = [](const std::string& host) {
    return host.empty() || host == "0.0.0.0" || host == "::";
  };
  // Two addresses of this host may share a port; a wildcard overlaps every address.
  if (transfer_host != o.host && !any(transfer_host) && !any(o.host)) return;
  const std::string taken = o.kv_transfer_port == -2 ? " (a prefill engine's default)" : "";
  throw Error("--kv-transfer-port " + std::to_string(port) + taken + ": --port is " +
              std::to_string(o.port) +
              " too; the HTTP server and the KV transfer listener need a port each");
}

void run(const EngineOptions& o, const CLI::App& cmd) {
  const StopSignals stop_signals;  // before any thread starts
  std::optional<StopWhileStarting> starting(std::in_place, stop_signals, "tandem engine");
  check_settings(o, cmd);  // before minutes of loading
  if (o.model.rfind(kSimPrefix, 0) != 0) check_model_folder("--model", o.model);
  const std::string transfer_host = o.kv_transfer_host.empty() ? o.host : o.kv_transfer_host;
  check_own_ports(o, transfer_host);
  // Likewise the address: a port in use found after the load would have cost it.
  net::check_listen_address("--host", o.host, "--port", static_cast<uint16_t>(o.port));
  // The KV transfer listener opens after the load too: a second prefill engine on this host
  // would load its model and then find the default 8998 taken.
  if (const int port = kv_transfer_port(o); port > 0)
    net::check_listen_address("--kv-transfer-host", transfer_host, "--kv-transfer-port",
                              static_cast<uint16_t>(port));

  const bool sim = o.model.rfind(kSimPrefix, 0) == 0;
  std::string tokenizer_dir = o.tokenizer;
  if (tokenizer_dir.empty()) tokenizer_dir = sim ? default_tokenizer().string() : o.model;
  auto tokenizer =
      std::make_shared<const text::Tokenizer>(text::Tokenizer::from_dir(tokenizer_dir));

  engine::EngineConfig config;
  config.scheduler.max_num_seqs = o.max_num_seqs;
  config.scheduler.max_num_batched_tokens = o.max_num_batched_tokens;
  config.scheduler.priority = o.scheduling_policy == "priority";
  config.enable_prefix_caching = !o.no_prefix_caching;
  config.max_tokens_limit = o.max_tokens.limit;
  config.default_max_tokens = o.max_tokens.default_value;
  if (!o.reasoning_parser.empty())
    config.reasoning = *api::reasoning_format_named(o.reasoning_parser);
  const EngineGenerationConfig generation =
      load_generation_config(o.generation_config, sim ? std::string() : o.model);
  config.sampling_defaults = generation.sampling;
  if (!generation.note.empty())
    std::fprintf(stderr, "tandem engine: %s\n", generation.note.c_str());
  config.max_model_len = o.max_model_len;  // a sim: model's context is set by it instead
  config.expert_load_window = o.expert_load_window;
  config.rebalance_interval = o.rebalance_interval;
  config.expert_load_dump = o.expert_load_dump;
  config.kv_events_config = o.kv_events_config;
  config.role = engine::parse_engine_role(o.role);
  engine::KvTransferConfig transfer;
  transfer.engine_id = o.engine_id;
  transfer.listen_host = transfer_host;
  transfer.port = kv_transfer_port(o);
  transfer.advertise_host =
      o.advertise_host.empty() ? advertised_host(transfer.listen_host) : o.advertise_host;
  transfer.timeout_s = o.kv_transfer_timeout;
  transfer.handshake_timeout_s = o.kv_transfer_handshake_timeout;
  transfer.transport = kKvTransports.at(o.kv_transport);
  transfer.checksum = transfer.checksum || o.kv_transfer_checksum;
  transfer.secret = kv_transfer_secret(o);
  transfer.allow = o.kv_transfer_allow;
  config.transfer = transfer;
  if (!sim) check_against_model_config(o, *tokenizer);

  // Before the model loads: the kernels' numerics mode is process-wide.
  kernels::set_batch_invariant(o.batch_invariant);
  std::unique_ptr<engine::Executor> executor;
  std::vector<int32_t> eos;
  if (sim) {
    // A simulated model speculates with the acceptance model (--sim-mtp-acceptance).
    engine::SimExecutorOptions so =
        sim_executor_options(o.sim, o.model.substr(kSimPrefix.size()), o.speculative_tokens);
    so.block_size = o.block_size;
    so.num_blocks = o.num_blocks;
    so.time_scale = o.sim_time_scale;
    so.max_model_len = o.max_model_len;
    so.model_name = o.served_model_name.empty() ? o.model : o.served_model_name;
    executor = std::make_unique<engine::SimExecutor>(*tokenizer, so);
    eos = engine::eos_ids(*tokenizer, generation.eos_token_ids);
  } else if (model::architecture_of(o.model) == model::kQwen3MoeArchitecture) {
    refuse_sim_flags(o, cmd);
    if (o.expert_parallel > 1 || !o.expert_placement.empty())
      throw Error("--expert-parallel: expert parallelism runs DeepSeek-family models; " + o.model +
                  " is a Qwen3-MoE model");
    std::shared_ptr<model::Qwen3MoeModel> m;
    {
      ProgressBar bar("loading " + o.model, "tensors");
      m = std::make_shared<model::Qwen3MoeModel>(
          model::Qwen3MoeModel::load(o.model, [&](size_t d, size_t t) { bar.update(d, t); }));
    }
    eos = engine::eos_ids(*tokenizer, generation.eos_token_ids);
    executor = std::make_unique<engine::Qwen3Executor>(
        m, *tokenizer, o.served_model_name.empty() ? o.model : o.served_model_name,
        cache_options(o));
  } else if (o.expert_parallel > 1) {
    refuse_sim_flags(o, cmd);
    engine::ep::EpExecutorOptions eo;
    eo.ranks = o.expert_parallel;
    eo.model_dir = o.model;
    eo.model_name = o.served_model_name.empty() ? o.model : o.served_model_name;
    eo.mla_rescale = kMlaRescales.at(o.mla_rescale);
    eo.cache = cache_options(o);
    eo.max_tokens = o.max_num_batched_tokens;
    eo.max_items = o.max_num_seqs;
    eo.stall_timeout = milliseconds_of(o.expert_parallel_stall_timeout);
    if (!o.expert_placement.empty()) {
      // Errors name the flag and the file, whether reading it or fitting it to the model failed
      // (read_placement's start with the file's path).
      eo.placement_source = "--expert-placement " + o.expert_placement;
      try {
        eo.placement = placement::read_placement(o.expert_placement);
      } catch (const Error& e) {
        throw Error("--expert-placement " + std::string(e.what()));
      }
    }
    std::fprintf(stderr, "tandem engine: starting %d expert-parallel ranks\n", o.expert_parallel);
    executor = std::make_unique<engine::ep::EpExecutor>(eo, *tokenizer);
    eos = engine::eos_ids(*tokenizer, generation.eos_token_ids);
  } else {
    if (!o.expert_placement.empty()) throw Error("--expert-placement needs --expert-parallel N");
    if (o.speculative_tokens > 0)
      if (const std::string why = model::DeepSeekModel::missing_mtp(o.model); !why.empty())
        throw Error("--speculative-tokens " + std::to_string(o.speculative_tokens) +
                    ": speculative decoding drafts with the model's MTP module, and " + o.model +
                    " has none: " + why);
    refuse_sim_flags(o, cmd);
    std::shared_ptr<model::DeepSeekModel> m;
    {
      ProgressBar bar("loading " + o.model, "tensors");
      model::WeightLoadOptions load;
      load.int8_lm_head = o.int8_lm_head;
      load.mtp = o.speculative_tokens > 0;
      m = std::make_shared<model::DeepSeekModel>(model::DeepSeekModel::load(
          o.model, [&](size_t d, size_t t) { bar.update(d, t); }, load));
    }
    if (const std::string w =
            util::small_pages_warning(m->weights().packed_bytes, util::anon_huge_page_bytes());
        !w.empty())
      std::fprintf(stderr, "tandem engine: %s\n", w.c_str());
    m->set_mla_rescale(kMlaRescales.at(o.mla_rescale));
    eos = engine::eos_ids(*tokenizer, generation.eos_token_ids);
    executor = std::make_unique<engine::CpuExecutor>(
        m, *tokenizer, o.served_model_name.empty() ? o.model : o.served_model_name,
        cache_options(o));
  }

  metrics::Registry registry;
  engine::Engine engine(config, std::move(executor), tokenizer, eos, registry);
  net::HttpServerOptions http;
  http.host = o.host;
  http.port = static_cast<uint16_t>(o.port);
  http.threads = o.http_threads;
  http.max_body_bytes = static_cast<size_t>(o.max_body_bytes);
  http.max_connections = o.max_connections;
  http.allowed_origins = o.allowed_origins;
  std::vector<std::string> api_keys = o.api_keys;
  if (const char* key = std::getenv(engine::kEngineApiKeyVariable); api_keys.empty() && key && *key)
    api_keys.push_back(key);
  engine::ApiServer server(engine, registry, http, api_keys);
  engine.start();
  server.start();
  // Started: from the first line on, whoever read it may stop the engine in order.
  starting.reset();
  const auto& info = engine.executor_info();
  // The first line on stdout names the port (tests and scripts start engines on port 0), in a
  // URL that works as written: an IPv6 host in brackets.
  std::printf(
      "tandem engine: listening on http://%s:%u (model %s, %lld KV blocks of %lld tokens)\n",
      net::url_host(o.host).c_str(), static_cast<unsigned>(server.port()), info.model_name.c_str(),
      static_cast<long long>(info.num_blocks), static_cast<long long>(info.block_size));
  if (const auto* t = engine.transfer(); t && t->serving())
    std::printf("tandem engine: role %s, KV transfer on %s:%u (advertised as %s), engine id %s\n",
                engine::engine_role_name(engine.role()),
                net::url_host(t->config().listen_host).c_str(), static_cast<unsigned>(t->port()),
                t->config().advertise_host.c_str(), t->config().engine_id.c_str());
  else
    std::printf("tandem engine: role %s\n", engine::engine_role_name(engine.role()));
  if (!engine.kv_events_endpoint().empty())
    std::printf("tandem engine: KV events on %s (replay %s)\n", engine.kv_events_endpoint().c_str(),
                engine.kv_events_replay_endpoint().c_str());
  std::fflush(stdout);
  if (engine.max_model_len() < info.max_model_len)
    std::fprintf(
        stderr, "tandem engine: the longest sequence is %lld tokens (of the model's %lld): %s\n",
        static_cast<long long>(engine.max_model_len()), static_cast<long long>(info.max_model_len),
        o.max_model_len > 0 && o.max_model_len == engine.max_model_len()
            ? "--max-model-len"
            : "what the KV cache holds; --kv-cache-gb or --num-kv-blocks sets it");
  const int sig = stop_signals.wait();
  // As vLLM's: new requests are refused while those in flight finish, then the engine stops.
  stop_draining(
      shutdown_drain(o.shutdown_timeout), stop_signals, "tandem engine", sig,
      [&] { server.stop(shutdown_drain(o.shutdown_timeout)); }, [&] { server.end_drain(); });
  engine.stop();
}

void run_sim_fit(const SimFitOptions& o) {
  const auto tokenizer = text::Tokenizer::from_dir(o.model);
  std::shared_ptr<const model::DeepSeekModel> m;
  {
    ProgressBar bar("loading " + o.model, "tensors");
    m = std::make_shared<const model::DeepSeekModel>(
        model::DeepSeekModel::load(o.model, [&](size_t d, size_t t) { bar.update(d, t); }));
  }
  engine::CpuExecutorOptions co;
  co.kv_cache_bytes = o.kv_cache_gb * double(1ull << 30);
  engine::CpuExecutor executor(m, tokenizer, o.model, co);
  std::printf("%-34s %12s\n", "step", "measured_s");
  auto samples = engine::probe_step_latencies(executor, {}, [](const engine::LatencySample& s) {
    std::string shape;
    for (const auto& p : s.shape.prefills)
      shape += "prefill " + std::to_string(p.new_tokens) + " (+" +
               std::to_string(p.context_tokens) + " cached)";
    if (s.shape.decode_seqs)
      shape += "decode x" + std::to_string(s.shape.decode_seqs) + " ctx " +
               std::to_string(s.shape.decode_context_tokens / s.shape.decode_seqs);
    std::printf("%-34s %12.6f\n", shape.c_str(), s.seconds);
    std::fflush(stdout);
  });
  const auto fit = engine::fit_sim_latency(samples, o.name);
  fit.model.save(o.out);
  std::printf("fit: rms relative error %.1f%%, max %.1f%%; wrote %s (use --model sim:%s)\n",
              100 * fit.rms_relative_error, 100 * fit.max_relative_error, o.out.c_str(),
              o.out.c_str());
}

// The `engine` subcommand and its flags, writing into `o`; its callback is the caller's.
CLI::App* add_engine_subcommand(CLI::App& app, EngineOptions& o) {
  auto* cmd =
      app.add_subcommand("engine", "Serve a model over HTTP (OpenAI API, tokens-in /generate)");
  cmd->add_option("--model", o.model, "model folder, or sim:PRESET for a simulated executor")
      ->required();
  cmd->add_option(
      "--tokenizer", o.tokenizer,
      "tokenizer folder (default: the model folder; for sim: the DeepSeek-V3 tokenizer)");
  cmd->add_option("--served-model-name", o.served_model_name,
                  "model name in the API (default: --model)");
  cmd->add_option("--host", o.host, "address to listen on")->capture_default_str();
  cmd->add_option("--port", o.port, "port (0: any free port)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--block-size", o.block_size, "tokens per KV block")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--kv-cache-gb", o.kv_cache_gb, "memory for the KV cache (GiB)")
      ->capture_default_str()
      ->check(positive_number());
  cmd->add_option("--num-kv-blocks", o.num_blocks, "KV blocks (overrides --kv-cache-gb)")
      ->check(non_negative_number());
  cmd->add_option("--kv-cache-dtype", o.kv_cache_dtype,
                  "latent cache values: auto (float32 for float32 weights, else bfloat16), "
                  "float32 or bfloat16")
      ->capture_default_str()
      ->transform(CLI::IsMember(kKvCacheTypes));
  cmd->add_option("--expert-load-window", o.expert_load_window,
                  "steps in the sliding window of expert load statistics (GET /expert_load)")
      ->capture_default_str()
      ->check(positive_number());
  cmd->add_option("--expert-load-dump", o.expert_load_dump,
                  "folder for expert load snapshots: expert_load_<steps>.npy/.json every window "
                  "([MoE layers, experts] int64) and expert_load_cumulative.npy/.json at exit");
  cmd->add_option("--expert-parallel", o.expert_parallel,
                  "rank processes the routed experts are spread over (expert parallelism on this "
                  "host; attention runs data-parallel, MoE layers exchange tokens through shared "
                  "memory)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  cmd->add_option("--expert-parallel-stall-timeout", o.expert_parallel_stall_timeout,
                  "with --expert-parallel: seconds a step waits at one MoE exchange for a rank "
                  "that is alive but does not get there (stopped, frozen, deadlocked) before the "
                  "engine fails as it does when a rank dies; at start, a rank gets this long (at "
                  "least 60) plus the engine's own model load once per rank to say it is ready (0: "
                  "wait forever, e.g. to "
                  "debug a rank)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 604800.0));
  cmd->add_option("--expert-placement", o.expert_placement,
                  "where experts live with --expert-parallel (.json from `tandem place plan` or an "
                  "Omni .npy; redundant copies allowed); default: every expert once, in order");
  cmd->add_option("--rebalance-interval", o.rebalance_interval,
                  "with --expert-parallel: every this many steps, re-plan the placement from the "
                  "expert-load window (Omni planner, incremental) and switch to it live when it "
                  "moves any copy (0: only POST /admin/expert_placement)")
      ->capture_default_str()
      ->check(non_negative_number());
  cmd->add_option("--speculative-tokens", o.speculative_tokens,
                  "speculative decoding: draft tokens per step from the model's MTP module "
                  "(applied recursively past the first; a sim: model's acceptance model, "
                  "--sim-mtp-acceptance), verified in the next step (0: off)")
      ->capture_default_str()
      ->check(CLI::Range(0, 8));
  cmd->add_option("--reasoning-parser", o.reasoning_parser,
                  "read chat answers' <think> reasoning apart, as vLLM's --reasoning-parser: "
                  "deepseek_r1 or qwen3 (message.reasoning_content / reasoning, and the same in "
                  "stream deltas)");
  cmd->add_flag("--batch-invariant", o.batch_invariant,
                "batch-invariant numerics: a token's logits do not depend on the other tokens of "
                "its step, on how its prompt was chunked, or on whether its prefix came from the "
                "cache or a KV transfer (the same kernels and reduction order for any token "
                "count; slower prefill, see docs/benchmarks.md)");
  cmd->add_flag("--int8-lm-head", o.int8_lm_head,
                "quantize the LM head to INT8 at load (W8A8, per-row scales): half the bytes a "
                "decode token reads there, as llama.cpp's Q8_0 files have it; W8A8 checkpoints "
                "keep it in BF16");
  cmd->add_option("--mla-rescale", o.mla_rescale,
                  "decode attention's softmax rescale: multiply or amla (exponent add)")
      ->capture_default_str()
      ->transform(CLI::IsMember(kMlaRescales));
  cmd->add_option("--max-num-seqs", o.max_num_seqs, "running sequences at most")
      ->capture_default_str()
      ->check(positive_number());
  cmd->add_option("--max-num-batched-tokens", o.max_num_batched_tokens,
                  "new tokens per step (chunked prefill budget)")
      ->capture_default_str()
      ->check(positive_number());
  cmd->add_option("--scheduling-policy", o.scheduling_policy,
                  "fcfs, or priority: prefills, running or waiting, by the requests' priority "
                  "(lower first), then arrival")
      ->capture_default_str();
  cmd->add_flag("--no-enable-prefix-caching", o.no_prefix_caching,
                "turn automatic prefix caching off");
  cmd->add_option("--kv-events-config", o.kv_events_config, "vLLM-style KV events config (JSON)");
  cmd->add_option("--http-threads", o.http_threads, "HTTP io threads")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  add_shutdown_timeout_flag(*cmd, o.shutdown_timeout);
  cmd->add_option("--max-body-bytes", o.max_body_bytes, "largest request body accepted")
      ->capture_default_str()
      ->check(positive_number());
  add_max_connections_flag(*cmd, o.max_connections);  // the gateway's: one definition
  add_allowed_origins_flag(*cmd, o.allowed_origins);  // likewise
  cmd->add_option("--sim-time-scale", o.sim_time_scale,
                  "multiplies the simulated step times (0: do not sleep)")
      ->capture_default_str()
      ->check(non_negative_number());
  add_sim_executor_flags(*cmd, o.sim);
  cmd->add_option("--role", o.role, "prefill, decode or both (prefill/decode disaggregation)")
      ->capture_default_str()
      ->check(CLI::IsMember({"prefill", "decode", "both"}));
  cmd->add_option("--kv-transfer-port,--disaggregation-bootstrap-port", o.kv_transfer_port,
                  "KV transfer / bootstrap server port (default: 8998 for prefill, any free port "
                  "for both, none for decode; -1: none)")
      ->check(CLI::Range(-1, 65535));
  cmd->add_option("--kv-transfer-host", o.kv_transfer_host,
                  "address the KV transfer server listens on (default: --host)");
  cmd->add_option("--advertise-host", o.advertise_host,
                  "host decode engines reach this engine at (remote_host; default: --host, or "
                  "this machine's first non-loopback IPv4 address)");
  // Rounded to milliseconds (the transports' timeouts): less would be none, and a timeout of 0 ms
  // fails every transfer frame at once. At most the gateway's durations (about 24.8 days): past
  // int64 milliseconds the conversion would be undefined (1e300 was taken).
  check_seconds(cmd->add_option("--kv-transfer-timeout", o.kv_transfer_timeout,
                                "seconds KV waits to be taken, a room waits for its other leg, "
                                "and each transfer frame (one layer's KV) may take")
                    ->capture_default_str(),
                /*at_least_a_ms=*/true, 2147483.647);
  check_seconds(
      cmd->add_option(
             "--kv-transfer-handshake-timeout", o.kv_transfer_handshake_timeout,
             "seconds a prefill engine answers within before a decode engine gives it up "
             "as hung (connect, --kv-transfer-secret handshake and the answer to a pull, as "
             "a whole; each release of held KV too), and within which a connection to a "
             "prefill engine sends each frame until its request")
          ->capture_default_str(),
      /*at_least_a_ms=*/true, 2147483.647);
  cmd->add_option("--kv-transport", o.kv_transport,
                  "KV transfer transport: shm (shared memory with engines on this host, TCP with "
                  "others) or tcp")
      ->capture_default_str()
      ->transform(CLI::IsMember(kKvTransports));
  cmd->add_option("--kv-transfer-secret", o.kv_transfer_secret,
                  "shared secret of the KV transfer handshake (every engine of a deployment "
                  "the same; default: --kv-transfer-secret-file, else $" +
                      std::string(engine::kKvTransferSecretVariable) + ", else no handshake)");
  cmd->add_option("--kv-transfer-allow", o.kv_transfer_allow,
                  "a prefill host this decode engine may pull KV from: a name or address as "
                  "requests give it, or an IPv4 block like 10.0.0.0/8 (repeatable; default: any)");
  cmd->add_option("--kv-transfer-secret-file", o.kv_transfer_secret_file,
                  "a file holding the KV transfer secret (trailing whitespace ignored)");
  cmd->add_flag(
      "--kv-transfer-checksum", o.kv_transfer_checksum,
      "checksum every transferred layer (a decode engine asks its prefill engines for them and "
      "refuses layers without; always on in debug builds)");
  cmd->add_option("--engine-id", o.engine_id, "this engine's id in KV transfer (default: random)");
  cmd->add_option("--max-model-len", o.max_model_len,
                  "the longest sequence (prompt plus output) a request may ask for, at most the "
                  "model's context (default: the model's context, or a simulated model's "
                  "preset's; either way no longer than the KV cache holds)")
      ->check(non_negative_number());
  cmd->add_option("--api-key", o.api_keys,
                  "accepted API key (repeatable): every route but /health and /metrics needs one "
                  "as a Bearer token (default: $" +
                      std::string(engine::kEngineApiKeyVariable) + ", else open)");
  add_max_tokens_flags(*cmd, o.max_tokens);
  add_generation_config_flags(*cmd, o.generation_config);
  return cmd;
}

}  // namespace

void add_engine_command(CLI::App& app) {
  auto r = std::make_shared<engine::ep::RankProcessOptions>();
  auto* rank = app.add_subcommand("ep-rank", "(internal) one rank of an expert-parallel engine");
  rank->group("");  // started by `tandem engine --expert-parallel`, not by people
  rank->add_option("--fd", r->fd)->required();
  rank->add_option("--rank", r->rank)->required()->check(positive_number());
  rank->add_option("--model", r->model_dir)->required();
  rank->add_option("--mla-rescale", r->mla_rescale);
  rank->add_option("--threads", r->threads);
  rank->add_option("--batch-invariant", r->batch_invariant);
  rank->add_option("--parent", r->parent)->required();
  rank->callback([r] { std::exit(engine::ep::serve_rank(*r)); });

  auto f = std::make_shared<SimFitOptions>();
  auto* fit = app.add_subcommand(
      "sim-fit", "Measure the CPU executor on representative steps and fit a sim latency model");
  fit->add_option("--model", f->model, "model folder")->required()->check(CLI::ExistingDirectory);
  fit->add_option("--out", f->out, "where to write the latency model (JSON)")->required();
  fit->add_option("--name", f->name, "name stored in the model")->capture_default_str();
  fit->add_option("--kv-cache-gb", f->kv_cache_gb, "KV cache for the probes (GiB)")
      ->capture_default_str()
      ->check(positive_number());
  fit->callback([f] { run_sim_fit(*f); });

  auto o = std::make_shared<EngineOptions>();
  CLI::App* cmd = add_engine_subcommand(app, *o);
  cmd->callback([o, cmd] { run(*o, *cmd); });
}

std::chrono::milliseconds check_engine_command_line(std::span<const std::string> args) {
  CLI::App app;
  EngineOptions o;
  CLI::App* cmd = add_engine_subcommand(app, o);
  // As main() does for every command: the engine child would refuse "010" at its start.
  refuse_malformed_numbers(app);
  cmd->callback([&o, cmd] {
    check_settings(o, *cmd);
    if (o.model.rfind(kSimPrefix, 0) != 0) refuse_sim_flags(o, *cmd);
  });
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::ParseError& e) {
    // --help and --version end a parse with an "error" too; for an engine of serve they would end
    // it at once, naming no port.
    throw Error(e.get_exit_code() == 0 ? std::string("asks for the engine's help, which an engine "
                                                     "of serve cannot print")
                                       : cli11_error_text(e));
  }
  return shutdown_drain(o.shutdown_timeout);
}

}  // namespace tandem::cli
