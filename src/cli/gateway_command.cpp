#include "cli/gateway_command.h"

#include <cstdio>
#include <memory>

#include "cli/stop_signals.h"
#include "gateway/gateway.h"
#include "util/error.h"

namespace tandem::cli {
namespace {

struct GatewayCliOptions {
  std::string host = "0.0.0.0", mode = "aggregated";
  int port = 8080, http_threads = 2;
  std::vector<std::string> prefill, decode;
  double upstream_timeout = 600;
};

void run(const GatewayCliOptions& o) {
  const StopSignals stop_signals;  // before any thread starts

  gateway::GatewayOptions g;
  g.host = o.host;
  g.port = static_cast<uint16_t>(o.port);
  g.http_threads = o.http_threads;
  g.mode = gateway::parse_mode(o.mode);
  for (const auto& e : o.prefill) g.prefill.push_back(gateway::parse_endpoint(e));
  for (const auto& e : o.decode) g.decode.push_back(gateway::parse_endpoint(e));
  g.upstream_timeout = std::chrono::milliseconds(static_cast<int64_t>(o.upstream_timeout * 1000));
  gateway::Gateway gw(g);
  gw.start();
  // The first line on stdout names the port (scripts start gateways with --port 0).
  std::printf("tandem gateway: listening on http://%s:%u (mode %s, %zu prefill, %zu decode)\n",
              o.host.c_str(), static_cast<unsigned>(gw.port()), o.mode.c_str(), g.prefill.size(),
              g.decode.size());
  std::fflush(stdout);
  const int sig = stop_signals.wait();
  std::fprintf(stderr, "tandem gateway: stopping (signal %d)\n", sig);
  gw.stop();
}

}  // namespace

void add_gateway_command(CLI::App& app) {
  auto o = std::make_shared<GatewayCliOptions>();
  auto* cmd = app.add_subcommand(
      "gateway", "OpenAI endpoint in front of prefill and decode engines (P/D disaggregation)");
  cmd->add_option("--host", o->host, "address to listen on")->capture_default_str();
  cmd->add_option("--port", o->port, "port (0: any free port)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--mode", o->mode,
                  "aggregated, sequential (vLLM: prefill then decode pulls the KV) or parallel "
                  "(SGLang: both legs at once through a bootstrap room)")
      ->capture_default_str();
  cmd->add_option("--prefill", o->prefill,
                  "prefill engine HOST:PORT (parallel mode: HOST:PORT@KV_TRANSFER_PORT); "
                  "repeatable");
  cmd->add_option("--decode", o->decode, "decode engine HOST:PORT; repeatable")->required();
  cmd->add_option("--http-threads", o->http_threads, "HTTP io threads")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  cmd->add_option("--upstream-timeout", o->upstream_timeout,
                  "seconds an engine may take to connect, answer, or send the next piece")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->callback([o] { run(*o); });
}

}  // namespace tandem::cli
