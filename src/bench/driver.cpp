#include "bench/driver.h"

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "net/async_http_client.h"
#include "net/http_client.h"
#include "net/sse.h"
#include "util/error.h"

namespace tandem::bench {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

double seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// One request in flight: its measurements, filled on the client thread.
struct Flight {
  RequestResult result;
  Clock::time_point sent;
  Clock::time_point last_chunk;
  bool first_chunk = false;
  int status = 0;
  std::string error_body;
  net::SseParser parser;
  int64_t usage_tokens = -1;
  int64_t chunks = 0;
};

// A streamed chunk: vLLM's client counts any data event with a non-empty `choices` as a token
// chunk, and takes the output token count from the `usage` one.
void on_event(Flight& f, const std::string& data, Clock::time_point now) {
  if (net::SseParser::is_done(data)) return;
  json j;
  try {
    j = json::parse(data);
  } catch (const std::exception&) {
    return;  // not JSON: not a chunk the metrics count
  }
  if (!j.is_object()) return;
  if (auto e = j.find("error"); e != j.end()) {
    f.result.error = "error event: " + e->dump();
    return;
  }
  if (auto c = j.find("choices"); c != j.end() && c->is_array() && !c->empty()) {
    if (!f.first_chunk) {
      f.first_chunk = true;
      f.result.ttft_s = seconds(now - f.sent);
    } else {
      f.result.itl_s.push_back(seconds(now - f.last_chunk));
    }
    f.last_chunk = now;
    ++f.chunks;
  }
  if (auto u = j.find("usage"); u != j.end() && u->is_object())
    if (auto t = u->find("completion_tokens"); t != u->end() && t->is_number_integer())
      f.usage_tokens = t->get<int64_t>();
}

}  // namespace

std::string request_body(const BenchRequest& request, const DriverOptions& options) {
  json body;
  if (!options.model.empty()) body["model"] = options.model;
  const bool chat = options.endpoint.find("chat") != std::string::npos;
  if (chat) {
    body["messages"] = json::array({{{"role", "user"}, {"content", request.prompt_text}}});
    body["max_completion_tokens"] = request.output_len;
  } else {
    if (options.prompt_format == PromptFormat::kTokenIds)
      body["prompt"] = request.prompt_ids;
    else
      body["prompt"] = request.prompt_text;
    body["max_tokens"] = request.output_len;
  }
  body["temperature"] = 0.0;
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  if (options.ignore_eos) body["ignore_eos"] = true;
  return body.dump();
}

DriverRun run_workload(const std::vector<BenchRequest>& requests, const DriverOptions& options) {
  DriverRun run;
  run.results.resize(requests.size());
  net::AsyncHttpClient client;
  std::mutex mutex;
  std::condition_variable cv;
  size_t in_flight = 0, done = 0;
  std::vector<std::unique_ptr<Flight>> flights(requests.size());

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
    auto f = std::make_unique<Flight>();
    Flight* flight = f.get();
    flights[i] = std::move(f);
    flight->result.prompt_tokens = static_cast<int64_t>(requests[i].prompt_ids.size());

    net::AsyncHttpRequest r;
    r.host = options.host;
    r.port = options.port;
    r.method = "POST";
    r.target = options.endpoint;
    r.body = request_body(requests[i], options);
    r.headers.set("Content-Type", "application/json");
    if (!options.api_key.empty()) r.headers.set("Authorization", "Bearer " + options.api_key);
    r.timeout = options.timeout;
    net::AsyncHttpHandlers h;
    h.on_head = [flight](int status, const net::Headers&) { flight->status = status; };
    h.on_body = [flight](std::string_view piece) {
      const auto now = Clock::now();
      if (flight->status != 200) {
        if (flight->error_body.size() < 4096) flight->error_body += piece;
        return true;
      }
      for (const auto& data : flight->parser.feed(piece)) on_event(*flight, data, now);
      return true;
    };
    h.on_done = [&, flight, i](const std::string& error) {
      const auto now = Clock::now();
      RequestResult& res = flight->result;
      if (!error.empty()) {
        res.error = error;
      } else if (flight->status != 200) {
        res.error = "HTTP " + std::to_string(flight->status) + ": " + flight->error_body;
      } else if (res.error.empty() && !flight->first_chunk) {
        res.error = "the stream ended without any token";
      }
      res.success = res.error.empty();
      res.start_s = seconds(flight->sent - origin);
      res.latency_s = seconds((flight->first_chunk ? flight->last_chunk : now) - flight->sent);
      res.output_tokens = flight->usage_tokens >= 0 ? flight->usage_tokens : flight->chunks;
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
    flight->sent = Clock::now();
    client.start(std::move(r), std::move(h));
  }
  {
    std::unique_lock lock(mutex);
    cv.wait(lock, [&] { return done == requests.size(); });
  }
  run.duration_s = seconds(last_end - origin);
  return run;
}

std::optional<PrefixCacheCounters> read_prefix_cache_counters(const std::string& host,
                                                              uint16_t port) {
  std::string text;
  try {
    auto r = net::http_request(host, port, "GET", "/metrics", {}, {}, std::chrono::seconds(5));
    if (r.status != 200) return std::nullopt;
    text = std::move(r.body);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  PrefixCacheCounters c;
  bool any = false;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    double* into = nullptr;
    if (line.rfind("vllm:prefix_cache_queries", 0) == 0)
      into = &c.queries;
    else if (line.rfind("vllm:prefix_cache_hits", 0) == 0)
      into = &c.hits;
    if (!into || line.find("_created") != std::string::npos) continue;
    try {
      *into += std::stod(line.substr(line.rfind(' ') + 1));
      any = true;
    } catch (const std::exception&) {
    }
  }
  if (!any) return std::nullopt;
  return c;
}

}  // namespace tandem::bench
