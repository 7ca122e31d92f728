#include "bench/stream_measure.h"

#include <nlohmann/json.hpp>

#include "bench/workload.h"
#include "util/json.h"
#include "util/utf8.h"

namespace tandem::bench {

using nlohmann::json;

// Enough of an error body to say what went wrong; a result file holds one per failed request.
constexpr size_t kErrorBodyBytes = 4096;

StreamMeasurement::StreamMeasurement(double sent_s, int64_t prompt_tokens,
                                     const text::Tokenizer* tokenizer)
    : sent_s_(sent_s), tokenizer_(tokenizer) {
  result_.prompt_tokens = prompt_tokens;
}

void StreamMeasurement::head(int status) {
  status_ = status;
}

void StreamMeasurement::body(std::string_view piece, double now_s) {
  if (status_ != 200) {
    if (error_body_.size() < kErrorBodyBytes)
      error_body_ += piece.substr(0, kErrorBodyBytes - error_body_.size());
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
    // The text vLLM's client keeps to count the output when no usage count comes: a completion's
    // choices[0].text, a chat's delta content (or reasoning_content, which vLLM counts too).
    const json& choice = c->front();
    if (choice.is_object()) {
      const json* text = nullptr;
      if (auto t = choice.find("text"); t != choice.end()) text = &*t;
      if (auto d = choice.find("delta"); d != choice.end() && d->is_object()) {
        auto content = d->find("content");
        if (content == d->end() || !content->is_string() ||
            content->get_ref<const std::string&>().empty())
          content = d->find("reasoning_content");
        if (content != d->end()) text = &*content;
      }
      if (text && text->is_string()) generated_text_ += text->get_ref<const std::string&>();
    }
  }
  if (auto u = j.find("usage"); u != j.end() && u->is_object())
    if (auto t = u->find("completion_tokens"); t != u->end() && t->is_number_integer()) {
      // A count no request can have would make the run's token totals (and throughputs)
      // negative or absurd: the request fails instead, with the server's claim as its error.
      const int64_t n = t->is_number_unsigned() && t->get<uint64_t>() > uint64_t(INT64_MAX)
                            ? -1
                            : t->get<int64_t>();
      if (n < 0 || n > kMaxRequestTokens)
        result_.error = "usage.completion_tokens " + t->dump() +
                        " is not a token count (expected 0.." + std::to_string(kMaxRequestTokens) +
                        ")";
      else
        usage_tokens_ = n;
    }
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
  // The error goes into the result JSON, whose writer refuses bytes that are not UTF-8: a
  // server's error body (or anything a transport error quotes) may hold any bytes.
  res.error = utf8::to_valid_lossy(res.error);
  res.success = res.error.empty();
  res.start_s = sent_s_ - origin_s;
  res.latency_s = (first_chunk_ ? last_chunk_s_ : now_s) - sent_s_;
  // vLLM takes a usage count of 0 as none (`if not output_len`) and re-tokenizes the text; a chunk
  // may carry several tokens, so counting chunks is the fallback only without a tokenizer.
  if (usage_tokens_ > 0)
    res.output_tokens = usage_tokens_;
  else if (tokenizer_)
    res.output_tokens = static_cast<int64_t>(tokenizer_->encode(generated_text_, false).size());
  else
    res.output_tokens = chunks_;
  return res;
}

}  // namespace tandem::bench
