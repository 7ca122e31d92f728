#include "bench/driver.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "bench/stream_measure.h"
#include "net/async_http_client.h"
#include "net/http_client.h"
#include "util/error.h"
#include "util/json.h"

namespace tandem::bench {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

double seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// Seconds of the monotonic clock, as StreamMeasurement takes them.
double since(Clock::time_point origin, Clock::time_point t) {
  return seconds(t - origin);
}

}  // namespace

bool is_chat_endpoint(const std::string& endpoint) {
  return endpoint.find("chat") != std::string::npos;
}

std::string request_body(const BenchRequest& request, const DriverOptions& options) {
  json body;
  const ReleaseJsonOnExit release_body{body};  // the prompt's ids, freed cheaply
  if (!options.model.empty()) body["model"] = options.model;
  const bool chat = is_chat_endpoint(options.endpoint);
  if (chat) {
    body["messages"] = json::array({{{"role", "user"}, {"content", request.prompt_text}}});
    body["max_completion_tokens"] = request.output_len;
  } else {
    if (options.prompt_format == PromptFormat::kTokenIds) {
      json ids = json::array();
      if (options.bos_id) ids.push_back(*options.bos_id);
      for (int32_t id : request.prompt_ids) ids.push_back(id);
      body["prompt"] = std::move(ids);
    } else
      body["prompt"] = request.prompt_text;
    body["max_tokens"] = request.output_len;
  }
  if (options.temperature) body["temperature"] = *options.temperature;
  if (options.top_p) body["top_p"] = *options.top_p;
  if (options.top_k) body["top_k"] = *options.top_k;
  if (options.min_p) body["min_p"] = *options.min_p;
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  if (options.ignore_eos) body["ignore_eos"] = true;
  return body.dump();
}

int64_t sent_prompt_tokens(const BenchRequest& request, const DriverOptions& options) {
  return static_cast<int64_t>(request.prompt_ids.size()) +
         (options.bos_id && options.count_bos ? 1 : 0);
}

DriverRun run_workload(const std::vector<BenchRequest>& requests, const DriverOptions& options) {
  // Checked before the first send: a time the clock cannot count would overflow the cast below
  // (and be sent at once), and one earlier than the request before it would be sent late.
  for (size_t i = 0; i < requests.size(); ++i) {
    const double at = requests[i].arrival_s;
    if (!(at >= 0 && at <= kMaxArrivalSeconds))
      throw Error("request " + std::to_string(i) + ": arrival time " + std::to_string(at) +
                  " s is not a time from the start (0.." +
                  std::to_string(int64_t(kMaxArrivalSeconds)) + " s)");
    if (i > 0 && at < requests[i - 1].arrival_s)
      throw Error("request " + std::to_string(i) + ": arrival time " + std::to_string(at) +
                  " s is before the " + std::to_string(requests[i - 1].arrival_s) +
                  " s of the request before it; requests are sent in order");
  }
  DriverRun run;
  run.results.resize(requests.size());
  net::AsyncHttpClient client;
  std::mutex mutex;
  std::condition_variable cv;
  size_t in_flight = 0, done = 0;
  std::vector<std::unique_ptr<StreamMeasurement>> flights(requests.size());

  const Clock::time_point origin = Clock::now();
  Clock::time_point last_end = origin;
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto due = origin + std::chrono::duration_cast<Clock::duration>(
                                  std::chrono::duration<double>(requests[i].arrival_s));
    std::this_thread::sleep_until(due);
    {
      std::unique_lock lock(mutex);
      if (options.max_concurrency)
        cv.wait(lock, [&] { return static_cast<int64_t>(in_flight) < *options.max_concurrency; });
      ++in_flight;
    }
    net::AsyncHttpRequest r;
    r.host = options.host;
    r.port = options.port;
    r.method = "POST";
    r.target = options.endpoint;
    r.body = request_body(requests[i], options);
    r.headers.set("Content-Type", "application/json");
    if (!options.api_key.empty()) r.headers.set("Authorization", "Bearer " + options.api_key);
    r.timeout = options.timeout;
    flights[i] = std::make_unique<StreamMeasurement>(
        since(origin, Clock::now()), sent_prompt_tokens(requests[i], options), options.tokenizer);
    StreamMeasurement* flight = flights[i].get();
    net::AsyncHttpHandlers h;
    h.on_head = [flight](int status, const net::Headers&) { flight->head(status); };
    h.on_body = [flight, origin](std::string_view piece) {
      flight->body(piece, since(origin, Clock::now()));
      return true;
    };
    h.on_done = [&, flight, i](const std::string& error) {
      const auto now = Clock::now();
      RequestResult res = flight->done(error, since(origin, now), 0);
      size_t finished;
      {
        std::lock_guard lock(mutex);
        run.results[i] = std::move(res);
        --in_flight;
        finished = ++done;
        if (now > last_end) last_end = now;
      }
      cv.notify_all();
      if (options.progress) options.progress(finished, requests.size());
    };
    client.start(std::move(r), std::move(h));
  }
  {
    std::unique_lock lock(mutex);
    cv.wait(lock, [&] { return done == requests.size(); });
  }
  // The last on_done may still be notifying: let it end before its mutex and cv go.
  client.shutdown();
  run.duration_s = seconds(last_end - origin);
  return run;
}

std::optional<double> metric_sum(std::string_view metrics_text, std::string_view name) {
  double sum = 0;
  bool any = false;
  std::istringstream in{std::string(metrics_text)};
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    const std::string_view sample(line.data(), std::min(line.find_first_of("{ "), line.size()));
    if (sample != name && !(sample.starts_with(name) && sample.substr(name.size()) == "_total"))
      continue;
    try {
      sum += std::stod(line.substr(line.rfind(' ') + 1));
      any = true;
    } catch (const std::exception&) {
    }
  }
  if (!any) return std::nullopt;
  return sum;
}

std::optional<PrefixCacheCounters> parse_prefix_cache_counters(std::string_view metrics_text) {
  const auto queries = metric_sum(metrics_text, "vllm:prefix_cache_queries");
  const auto hits = metric_sum(metrics_text, "vllm:prefix_cache_hits");
  if (!queries && !hits) return std::nullopt;
  return PrefixCacheCounters{queries.value_or(0), hits.value_or(0)};
}

std::optional<PrefixCacheCounters> read_prefix_cache_counters(const std::string& host,
                                                              uint16_t port) {
  try {
    auto r = net::http_request(host, port, "GET", "/metrics", {}, {}, std::chrono::seconds(5));
    if (r.status != 200) return std::nullopt;
    return parse_prefix_cache_counters(r.body);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

}  // namespace tandem::bench
