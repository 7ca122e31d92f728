#pragma once
// Server-sent events as the OpenAI streaming API uses them: `data: <json>\n\n` per event and
// `data: [DONE]\n\n` at the end. The writer side works on an Exchange; the parser is for
// clients (the gateway reading an engine's stream, tests).
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "net/http_server.h"

namespace tandem::net {

// One event: "data: <data>\n\n". Data with line breaks becomes one data line per line, which a
// receiver joins back with "\n" (the SSE rule), so any text round-trips.
std::string sse_event(std::string_view data);

inline constexpr std::string_view kSseDone = "data: [DONE]\n\n";

// Streams events on an exchange. Every call may come from any thread (see Exchange) and returns
// false once the client is gone; stop producing then.
class SseWriter {
 public:
  explicit SseWriter(std::shared_ptr<Exchange> exchange) : exchange_(std::move(exchange)) {}

  // 200 with Content-Type text/event-stream and Cache-Control no-cache, plus `headers`.
  bool start(Headers headers = {});
  // One event carrying `data` (usually one JSON object).
  bool send(std::string_view data);
  // Sends the [DONE] marker and ends the response.
  bool done();
  // Ends the response without [DONE] (the OpenAI API sends an error event, then stops).
  bool end() { return exchange_->end(); }
  bool closed() const { return exchange_->closed(); }
  Exchange& exchange() { return *exchange_; }

 private:
  std::shared_ptr<Exchange> exchange_;
};

// Splits a received event stream into the data of its events. Understands data lines (joined
// with "\n"), comment lines (':') and LF or CRLF line ends; other fields (event, id, retry) are
// skipped, which is all the OpenAI API uses. A lone CR as line end is not supported.
class SseParser {
 public:
  // Feeds the next bytes (any split); returns the data of the events they complete, in order.
  std::vector<std::string> feed(std::string_view bytes);
  // The same, calling `on_event` with each event's data instead: an event whose one data line
  // lies wholly in `bytes` is a view into it (no copy), valid during the call only.
  void feed(std::string_view bytes, const std::function<void(std::string_view)>& on_event);

  static bool is_done(std::string_view data) { return data == "[DONE]"; }
  // Bytes of an event that has not ended yet were fed (a stream cut now leaves it half-sent).
  bool mid_event() const { return !line_.empty() || has_data_; }
  // Between feeds: the bytes held of the event not ended yet (its incomplete line and the data of
  // its lines so far). A sender that never ends an event grows it without end: callers that read
  // streams they do not trust bound it.
  size_t pending_bytes() const { return line_.size() + data_.size(); }

 private:
  std::string line_;  // the incomplete last line
  std::string data_;  // the data of the event being read, when not `view_`
  // The event's data as a view into the bytes being fed (its one data line so far), or empty.
  std::string_view view_;
  bool has_data_ = false;
};

}  // namespace tandem::net
