#include "bench/stream_measure.h"

#include <nlohmann/json.hpp>

#include "util/json.h"

namespace tandem::bench {

using nlohmann::json;

StreamMeasurement::StreamMeasurement(double sent_s, int64_t prompt_tokens) : sent_s_(sent_s) {
  result_.prompt_tokens = prompt_tokens;
}

void StreamMeasurement::head(int status) {
  status_ = status;
}

void StreamMeasurement::body(std::string_view piece, double now_s) {
  if (status_ != 200) {
    if (error_body_.size() < 4096) error_body_ += piece;
    return;
  }
  for (const auto& data : parser_.feed(piece)) on_event(data, now_s);
}

// vLLM's client counts any data event with a non-empty `choices` as a token chunk, and takes the
// output token count from the `usage` one.
void StreamMeasurement::on_event(const std::string& data, double now_s) {
  if (net::SseParser::is_done(data)) return;
  json j;
  try {
    j = parse_untrusted_json(data);
  } catch (const std::exception&) {
    return;  // not JSON: not a chunk the metrics count
  }
  if (!j.is_object()) return;
  if (auto e = j.find("error"); e != j.end()) {
    result_.error = "error event: " + e->dump();
    return;
  }
  if (auto c = j.find("choices"); c != j.end() && c->is_array() && !c->empty()) {
    if (!first_chunk_) {
      first_chunk_ = true;
      result_.ttft_s = now_s - sent_s_;
    } else {
      result_.itl_s.push_back(now_s - last_chunk_s_);
    }
    last_chunk_s_ = now_s;
    ++chunks_;
  }
  if (auto u = j.find("usage"); u != j.end() && u->is_object())
    if (auto t = u->find("completion_tokens"); t != u->end() && t->is_number_integer())
      usage_tokens_ = t->get<int64_t>();
}

RequestResult StreamMeasurement::done(const std::string& transport_error, double now_s,
                                      double origin_s) {
  RequestResult res = std::move(result_);
  if (!transport_error.empty()) {
    res.error = transport_error;
  } else if (status_ != 200) {
    res.error = "HTTP " + std::to_string(status_) + ": " + error_body_;
  } else if (res.error.empty() && !first_chunk_) {
    res.error = "the stream ended without any token";
  }
  res.success = res.error.empty();
  res.start_s = sent_s_ - origin_s;
  res.latency_s = (first_chunk_ ? last_chunk_s_ : now_s) - sent_s_;
  res.output_tokens = usage_tokens_ >= 0 ? usage_tokens_ : chunks_;
  return res;
}

}  // namespace tandem::bench
