#pragma once
// The HTTP side of `tandem bench`: sends a workload to an OpenAI-compatible server (ours, vLLM,
// SGLang) at the requests' arrival times, streaming every answer, and measures each request the
// way vLLM's benchmark client does (bench/metrics.h): TTFT at the first chunk carrying choices,
// one inter-token gap per later chunk, latency at the last chunk, output tokens from the usage
// chunk (else the re-tokenized text). Hundreds of streams run on one client thread
// (net/async_http_client.h).
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "bench/metrics.h"
#include "bench/workload.h"

namespace tandem::bench {

enum class PromptFormat { kTokenIds, kText };

struct DriverOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 8000;
  std::string endpoint = "/v1/completions";  // or "/v1/chat/completions"
  std::string model;                         // sent as "model"; empty: omitted
  // Completions: the prompt as token ids (exact lengths) or as text that encodes to them. Chat
  // requests always send text.
  PromptFormat prompt_format = PromptFormat::kTokenIds;
  // The BOS id a server adds to a text prompt (vLLM's datasets count it in their lengths): put
  // first in token-id prompts, which servers take as given, and counted in every prompt's tokens,
  // so that both formats reach the server with the length the workload asked for. Unset for
  // traces, whose lengths are the ids sent.
  std::optional<int32_t> bos_id;
  // Whether the results count that BOS in a prompt's tokens: vLLM's random and sharegpt datasets
  // do (their prompt_len is the server's length), its prefix_repetition does not (prefix + suffix
  // tokens, though the server sees the BOS too).
  bool count_bos = true;
  // Counts a request's output from its text when the server sends no usage count (may be null:
  // then the chunks are counted). Must outlive the run.
  const text::Tokenizer* tokenizer = nullptr;
  bool ignore_eos = true;  // force the requested output lengths (vLLM's --ignore-eos)
  // Sampling parameters, sent when set. vLLM's client sends temperature 0 unless told otherwise.
  std::optional<double> temperature = 0.0, top_p, min_p;
  std::optional<int64_t> top_k;
  std::optional<int64_t> max_concurrency;  // at most this many requests in flight
  std::chrono::milliseconds timeout = std::chrono::minutes(10);  // per wait for the next piece
  std::string api_key;                                           // sent as a Bearer token when set
  // Called from the client thread after each request finished (done, total).
  std::function<void(size_t, size_t)> progress;
};

struct DriverRun {
  std::vector<RequestResult> results;  // in workload order
  double duration_s = 0;               // the start of the run to the last answer
};

// Whether requests to `endpoint` are chats (messages, max_completion_tokens) or completions.
bool is_chat_endpoint(const std::string& endpoint);

// The request body for one workload entry (exposed for tests and for inspection).
std::string request_body(const BenchRequest& request, const DriverOptions& options);
// A request's prompt tokens as the results count them: its ids, and the BOS when counted.
int64_t sent_prompt_tokens(const BenchRequest& request, const DriverOptions& options);

// Sends every request at its arrival_s after the start (later when max_concurrency holds it
// back) and waits for all answers. Failed requests are results with success false and the
// error (HTTP status and body, or the transport error). Throws tandem::Error, before sending
// anything, when an arrival time is not in 0..kMaxArrivalSeconds or is before the one of the
// request before it (requests are sent in workload order).
DriverRun run_workload(const std::vector<BenchRequest>& requests, const DriverOptions& options);

// Prefix-cache counters of a server's /metrics (vLLM's names: vllm:prefix_cache_queries and
// vllm:prefix_cache_hits, in tokens), summed over their label sets; nullopt when the server
// does not expose them or cannot be reached.
struct PrefixCacheCounters {
  double queries = 0, hits = 0;
};
std::optional<PrefixCacheCounters> read_prefix_cache_counters(const std::string& host,
                                                              uint16_t port);
// The same counters from a Prometheus text exposition.
std::optional<PrefixCacheCounters> parse_prefix_cache_counters(std::string_view metrics_text);
// The sum of a Prometheus text's samples of the metric `name` (or `name`_total), over every label
// set; nullopt when it has none.
std::optional<double> metric_sum(std::string_view metrics_text, std::string_view name);

}  // namespace tandem::bench
