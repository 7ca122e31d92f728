#include "gateway/request_record.h"

#include <atomic>
#include <memory>
#include <utility>

#include <nlohmann/json.hpp>

#include "api/error.h"
#include "gateway/access_log.h"
#include "util/utf8.h"

namespace tandem::gateway {

using nlohmann::json;

namespace {

// A client's reply that counts the response body bytes it takes (those a call it refused never
// sent are not counted). Thread-safe as the reply it wraps.
class BodyCountingReply final : public ClientReply {
 public:
  explicit BodyCountingReply(std::shared_ptr<ClientReply> reply) : reply_(std::move(reply)) {}
  std::shared_ptr<const std::atomic<uint64_t>> counter() const { return bytes_; }

  bool respond(int status, std::string body, std::string content_type) override {
    const size_t size = body.size();  // before the body is moved on
    return count(size, reply_->respond(status, std::move(body), std::move(content_type)));
  }
  // Written here as the gateway's server writes one (gateway.cpp's error_response), and handed
  // on as an answer: the body is made once, and counted as the one the client is given.
  bool send_error(int status, std::string_view message, std::string_view type,
                  std::string_view code) override {
    return respond_with_headers(api::openai_error_response(status, message, type, code));
  }
  bool respond_with_headers(net::HttpResponse response) override {
    const size_t size = response.body.size();
    return count(size, reply_->respond_with_headers(std::move(response)));
  }
  bool start_stream(int status, std::string content_type) override {
    return reply_->start_stream(status, std::move(content_type));
  }
  bool write(std::string_view chunk) override { return count(chunk.size(), reply_->write(chunk)); }
  bool end() override { return reply_->end(); }
  void abort() override { reply_->abort(); }
  void on_close(std::function<void()> callback) override { reply_->on_close(std::move(callback)); }

 private:
  bool count(size_t bytes, bool taken) {
    if (taken) bytes_->fetch_add(bytes, std::memory_order_relaxed);
    return taken;
  }

  std::shared_ptr<ClientReply> reply_;
  std::shared_ptr<std::atomic<uint64_t>> bytes_ = std::make_shared<std::atomic<uint64_t>>(0);
};

}  // namespace

void set_client(Request& r, const net::HttpRequest& req, std::shared_ptr<ClientReply> reply) {
  auto counted = std::make_shared<BodyCountingReply>(std::move(reply));
  r.body_bytes_sent = counted->counter();
  r.client_address = req.remote_address;
  r.reply = std::move(counted);
}

json access_log_line(const Request& r, const Topology& topo, int64_t completed_ns) {
  const int64_t received = *r.times.at(Phase::kReceived);
  // The model, the error and the engines' reasons quote what the client sent (an engine's 404
  // repeats the model): clipped, so that one request cannot make a line, or the dashboard's
  // recent lines, huge.
  json line = {{"time_unix_ms", r.received_unix_ms},
               {"request_id", r.id},
               {"method", r.method},
               {"path", r.path},
               {"status", r.outcome.status},
               {"mode", mode_name(topo.mode)},
               // What the client asked for, or got: an aggregated gateway without a tokenizer
               // relays bodies unparsed and learns it from the answer.
               {"stream", r.stream || r.streamed},
               {"attempts", r.attempt + 1},
               {"prompt_tokens", r.prompt_tokens},
               {"prompt_tokens_estimated", !r.tokens_known},
               {"phases", r.times.offsets()},
               {"e2e_seconds", static_cast<double>(completed_ns - received) * 1e-9}};
  // What nginx's $remote_addr and $body_bytes_sent say: who asked, and how much of an answer it
  // was given (a stream cut short, or a client gone, gets less than the engine sent).
  if (!r.client_address.empty()) line["client_address"] = r.client_address;
  line["body_bytes_sent"] = r.body_bytes_sent ? r.body_bytes_sent->load() : 0;
  if (!r.model.empty()) line["model"] = utf8::clip(r.model);
  if (!r.prefill_name.empty()) line["prefill"] = r.prefill_name;
  if (!r.decode_name.empty()) line["decode"] = r.decode_name;
  if (!r.retried_after.empty()) {
    json& retried = line["retried_after"] = json::array();
    for (const auto& why : r.retried_after) retried.push_back(utf8::clip(why));
  }
  if (r.output_events > 0) {
    line["output_events"] = r.output_events;
    line["ttft_seconds"] = static_cast<double>(r.first_token_ns - received) * 1e-9;
  }
  if (r.completion_tokens >= 0) line["completion_tokens"] = r.completion_tokens;
  if (r.reuse.available >= 0 || r.cached_tokens_reported >= 0)
    line["prefix_reuse"] = {{"available", r.reuse.available},
                            {"chosen", r.reuse.chosen},
                            {"delivered", r.cached_tokens_reported}};
  if (topo.priority.enabled())
    line["priority_class"] = topo.priority.classes[static_cast<size_t>(r.priority_class)].name;
  if (!r.outcome.error.empty()) line["error"] = utf8::clip(r.outcome.error);
  return line;
}

RequestRecorder::RequestRecorder(GatewayMetrics& metrics, AccessLog* log, const Topology& topology)
    : metrics_(metrics), log_(log), topo_(topology) {
  for (int p = 0; p < kPhaseCount; ++p)
    phase_histograms_[p] = &metrics_.phase_seconds.labels({phase_name(static_cast<Phase>(p))});
  by_class_.assign(topo_.priority.classes.size(), 0);
  for (const auto& c : topo_.priority.classes)
    class_ttft_.push_back(&metrics_.class_ttft.labels({c.name}));
}

void RequestRecorder::record(Request& r, int64_t now_ns) {
  // The relay is done with the request once it ended; the lock orders its last writes before
  // these reads.
  std::lock_guard lock(r.mutex);
  const int status = r.outcome.status;
  auto counter = status_counters_.find(status);
  if (counter == status_counters_.end())
    counter =
        status_counters_.emplace(status, &metrics_.requests.labels({std::to_string(status)})).first;
  counter->second->inc();
  const int64_t received = *r.times.at(Phase::kReceived);
  const std::optional<int64_t> stamped = r.times.at(Phase::kCompleted);
  const int64_t completed = stamped ? *stamped : now_ns;
  for (int p = 0; p < kPhaseCount; ++p)
    if (auto s = r.times.seconds_in(static_cast<Phase>(p))) phase_histograms_[p]->observe(*s);
  if (r.queued_s >= 0) metrics_.queue_time.observe(r.queued_s);  // once, all its waits
  // End-to-end latency is the successful requests' (docs/gateway.md). The token series are
  // every stream's that produced tokens, whatever its end: vLLM observes TTFT as the first token
  // comes, and a stream cut by its engine's death or left by its client (499) had its first
  // token and its gaps all the same (dropping them hid the slow streams that were cut).
  if (status == 200) metrics_.e2e.observe(static_cast<double>(completed - received) * 1e-9);
  {
    const int64_t events = r.output_events;
    if (events > 0) {
      const double ttft = static_cast<double>(r.first_token_ns - received) * 1e-9;
      metrics_.ttft.observe(ttft);
      if (!class_ttft_.empty()) class_ttft_[static_cast<size_t>(r.priority_class)]->observe(ttft);
    }
    if (events > 1)
      metrics_.tpot.observe(static_cast<double>(r.last_token_ns - r.first_token_ns) * 1e-9 /
                            static_cast<double>(events - 1));
    // Events that arrived together have gaps of 0, often most of them: observed in one go.
    uint64_t together = 0;
    for (double g : r.itl) {
      if (g == 0.0) {
        ++together;
      } else {
        metrics_.itl.observe(g);
        metrics_.tpot_gaps.observe(g);
      }
    }
    metrics_.itl.observe(0.0, together);
    metrics_.tpot_gaps.observe(0.0, together);
  }
  r.itl = {};
  ++requests_;
  ++by_status_[status];
  if (!by_class_.empty()) ++by_class_[static_cast<size_t>(r.priority_class)];
  if (status == 200) {
    PrefixReuse reuse = r.reuse;
    reuse.delivered = r.cached_tokens_reported;
    if (reuse.measured()) {
      reuse_.add(reuse, r.prompt_tokens);
      metrics_.prefix_reuse_requests.inc();
      metrics_.prefix_reuse_prompt_tokens.inc(static_cast<uint64_t>(r.prompt_tokens));
      metrics_.prefix_reuse_available.inc(static_cast<uint64_t>(reuse.available));
      metrics_.prefix_reuse_chosen.inc(static_cast<uint64_t>(reuse.chosen));
      metrics_.prefix_reuse_delivered.inc(static_cast<uint64_t>(reuse.delivered));
    }
    const std::string& computed_on =
        topo_.mode == PdMode::kAggregated ? r.decode_name : r.prefill_name;
    if (reuse.delivered >= 0 && !computed_on.empty()) {
      EngineReuse& e = engine_reuse_[computed_on];
      ++e.requests;
      e.prompt_tokens += r.prompt_tokens;
      e.delivered += reuse.delivered;
    }
  }
  const bool watched = now_ns < watched_until_ns_;
  if (!log_ && !watched) return;
  json line = access_log_line(r, topo_, completed);
  if (watched) {
    recent_.push_back(line);
    if (recent_.size() > kRecent) recent_.pop_front();
  }
  if (log_) log_->add(std::move(line));
}

json RequestRecorder::dashboard_json() const {
  json statuses = json::object();
  for (const auto& [status, n] : by_status_) statuses[std::to_string(status)] = n;
  json recent = json::array();
  for (const auto& line : recent_) recent.push_back(line);
  json totals = {{"requests", requests_},
                 {"by_status", std::move(statuses)},
                 {"prefix_reuse",
                  {{"requests", reuse_.requests},
                   {"prompt_tokens", reuse_.prompt_tokens},
                   {"available", reuse_.available},
                   {"chosen", reuse_.chosen},
                   {"delivered", reuse_.delivered}}}};
  if (!by_class_.empty()) {
    json classes = json::object();
    for (size_t i = 0; i < by_class_.size(); ++i)
      classes[topo_.priority.classes[i].name] = by_class_[i];
    totals["by_class"] = std::move(classes);
  }
  return {{"recent", std::move(recent)}, {"totals", std::move(totals)}};
}

json RequestRecorder::engine_reuse_json(const std::string& name) const {
  const auto it = engine_reuse_.find(name);
  if (it == engine_reuse_.end()) return nullptr;
  return {{"requests", it->second.requests},
          {"prompt_tokens", it->second.prompt_tokens},
          {"delivered", it->second.delivered}};
}

}  // namespace tandem::gateway
