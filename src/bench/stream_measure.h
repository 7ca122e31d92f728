#pragma once
// One streamed completion as a benchmark client measures it, the way vLLM's benchmark client
// does (bench/metrics.h): TTFT at the first data event carrying choices, one inter-token gap per
// later such event, latency at the last one, output tokens from the usage chunk. Without a usage
// count (or with 0) the generated text is re-tokenized with the benchmark's tokenizer, special
// tokens not added, as vLLM's calculate_metrics does; with no tokenizer the chunks are counted.
// Times are seconds on any one monotonic clock: the HTTP driver's wall clock, or the cluster
// simulator's virtual one. Not thread-safe: one caller at a time.
#include <cstdint>
#include <string>
#include <string_view>

#include "bench/metrics.h"
#include "net/sse.h"
#include "text/tokenizer.h"

namespace tandem::bench {

class StreamMeasurement {
 public:
  // The request was sent at `sent_s` with a prompt of `prompt_tokens` tokens. `tokenizer` (may be
  // null; must outlive this) counts the output when the server sends no usage count.
  StreamMeasurement(double sent_s, int64_t prompt_tokens,
                    const text::Tokenizer* tokenizer = nullptr);

  void head(int status);
  // A piece of the response body arrived at `now_s`.
  void body(std::string_view piece, double now_s);
  // The response ended at `now_s` (`transport_error` empty: normally). start_s is counted from
  // `origin_s`, the start of the run.
  RequestResult done(const std::string& transport_error, double now_s, double origin_s);

 private:
  void on_event(const std::string& data, double now_s);

  RequestResult result_;
  double sent_s_ = 0, last_chunk_s_ = 0;
  bool first_chunk_ = false;
  int status_ = 0;
  std::string error_body_;
  net::SseParser parser_;
  int64_t usage_tokens_ = -1;
  int64_t chunks_ = 0;
  const text::Tokenizer* tokenizer_ = nullptr;
  std::string generated_text_;  // what the chunks carried, re-tokenized without a usage count
};

}  // namespace tandem::bench
