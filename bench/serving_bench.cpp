// Serving benchmark for one running engine: closed-loop clients at each concurrency level send
// streaming /v1/completions requests (random token-id prompts, fixed output length, ignore_eos)
// and the program reports output tokens/s, TTFT and TPOT per level. With --sim-preset it also
// prints what the latency model predicts for pure decode at that batch size, so the ratio shows
// what the engine's own scheduling, HTTP and streaming cost on top of the modelled hardware.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "engine/executor/sim_latency.h"
#include "net/http_client.h"

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

struct Result {
  double ttft = 0, e2e = 0;
  int64_t tokens = 0;
  bool ok = false;
};

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

Result one_request(const std::string& host, uint16_t port, const std::vector<int32_t>& prompt,
                   int64_t max_tokens) {
  json body = {{"prompt", prompt}, {"max_tokens", max_tokens},
               {"temperature", 0}, {"ignore_eos", true},
               {"stream", true},   {"stream_options", {{"include_usage", true}}}};
  Result r;
  const auto t0 = Clock::now();
  std::string pending;

  auto on_body = [&](std::string_view piece) {
    pending.append(piece);
    size_t end;
    while ((end = pending.find("\n\n")) != std::string::npos) {
      std::string event = pending.substr(0, end);
      pending.erase(0, end + 2);
      if (event.rfind("data: ", 0) != 0) continue;
      std::string data = event.substr(6);
      if (data == "[DONE]") {
        r.ok = true;
        continue;
      }
      auto j = json::parse(data, nullptr, false);
      if (!j.is_object()) continue;
      if (r.ttft == 0 && j.contains("choices") && !j["choices"].empty()) r.ttft = seconds_since(t0);
      if (j.contains("usage") && j["usage"].is_object())
        r.tokens = j["usage"]["completion_tokens"].get<int64_t>();
    }
    return true;
  };
  auto resp = tandem::net::http_request_stream(host, port, "POST", "/v1/completions", body.dump(),
                                               {}, on_body, std::chrono::seconds(600));
  r.e2e = seconds_since(t0);
  if (resp.status != 200) r.ok = false;
  return r;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5))];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Serving benchmark: output tokens/s and TTFT versus concurrency"};
  std::string host = "127.0.0.1", sim_preset, levels_arg = "1,2,4,8,16,32,64";
  int port = 8000;
  int64_t prompt_tokens = 256, max_tokens = 64, requests_per_client = 2, vocab = 100000;
  app.add_option("--host", host);
  app.add_option("--port", port)->required();
  app.add_option("--concurrency", levels_arg, "comma-separated levels");
  app.add_option("--prompt-tokens", prompt_tokens);
  app.add_option("--max-tokens", max_tokens);
  app.add_option("--requests-per-client", requests_per_client);
  app.add_option("--vocab", vocab, "prompt ids are drawn below this");
  app.add_option("--sim-preset", sim_preset, "the engine's latency model, for the ideal column");
  CLI11_PARSE(app, argc, argv);

  std::vector<int> levels;
  std::stringstream ss(levels_arg);
  for (std::string item; std::getline(ss, item, ',');) levels.push_back(std::stoi(item));
  std::optional<tandem::engine::SimLatencyModel> model;
  if (!sim_preset.empty()) model = tandem::engine::SimLatencyModel::preset(sim_preset);

  std::printf("%5s %6s %10s %12s %9s %9s %9s %10s%s\n", "conc", "reqs", "out_tok", "out_tok/s",
              "ttft_p50", "ttft_p99", "tpot_ms", "e2e_p50", model ? "   ideal_tok/s  ratio" : "");
  std::mt19937 rng(1234);
  {
    // One request first, not counted: the CPU executor compiles its kernels on first use.
    std::vector<int32_t> warm(static_cast<size_t>(prompt_tokens));
    for (auto& t : warm) t = static_cast<int32_t>(rng() % vocab);
    one_request(host, static_cast<uint16_t>(port), warm, 2);
  }
  for (int c : levels) {
    std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(c * requests_per_client));
    for (auto& p : prompts) {
      p.resize(static_cast<size_t>(prompt_tokens));
      for (auto& t : p) t = static_cast<int32_t>(rng() % vocab);
    }
    std::vector<Result> results(prompts.size());
    const auto t0 = Clock::now();
    std::vector<std::thread> clients;
    for (int k = 0; k < c; ++k)
      clients.emplace_back([&, k] {
        for (int64_t i = 0; i < requests_per_client; ++i) {
          const size_t idx = static_cast<size_t>(k * requests_per_client + i);
          results[idx] = one_request(host, static_cast<uint16_t>(port), prompts[idx], max_tokens);
        }
      });
    for (auto& t : clients) t.join();
    const double wall = seconds_since(t0);
    int64_t tokens = 0, failed = 0;
    std::vector<double> ttft, tpot, e2e;
    for (const auto& r : results) {
      if (!r.ok) ++failed;
      tokens += r.tokens;
      ttft.push_back(r.ttft);
      e2e.push_back(r.e2e);
      if (r.tokens > 1) tpot.push_back((r.e2e - r.ttft) / double(r.tokens - 1));
    }
    double mean_tpot = 0;
    for (double v : tpot) mean_tpot += v / tpot.size();
    std::printf("%5d %6zu %10lld %12.1f %9.3f %9.3f %9.2f %10.3f", c, results.size(),
                static_cast<long long>(tokens), tokens / wall, percentile(ttft, 0.5),
                percentile(ttft, 0.99), mean_tpot * 1e3, percentile(e2e, 0.5));
    if (model) {
      tandem::engine::StepShape decode;
      decode.decode_seqs = c;
      decode.decode_tokens = c;
      decode.decode_context_tokens = c * (prompt_tokens + max_tokens / 2);
      const double ideal = c / model->step_seconds(decode);
      std::printf(" %13.1f %6.2f", ideal, tokens / wall / ideal);
    }
    if (failed) std::printf("  (%lld failed)", static_cast<long long>(failed));
    std::printf("\n");
    std::fflush(stdout);
  }
  return 0;
}
