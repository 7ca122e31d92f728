#include "net/sse.h"

namespace tandem::net {

std::string sse_event(std::string_view data) {
  std::string event;
  event.reserve(data.size() + 8);
  size_t begin = 0;
  for (;;) {
    size_t end = data.find('\n', begin);
    std::string_view line = data.substr(begin, end == std::string_view::npos ? end : end - begin);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    event += "data: ";
    event += line;
    event += '\n';
    if (end == std::string_view::npos) break;
    begin = end + 1;
  }
  event += '\n';
  return event;
}

bool SseWriter::start(Headers headers) {
  // Proxies must not cache or buffer a token stream.
  if (!headers.contains("Cache-Control")) headers.add("Cache-Control", "no-cache");
  return exchange_->start_stream(200, "text/event-stream", std::move(headers));
}

bool SseWriter::send(std::string_view data) {
  return exchange_->write(sse_event(data));
}

bool SseWriter::done() {
  return exchange_->write(kSseDone) && exchange_->end();
}

std::vector<std::string> SseParser::feed(std::string_view bytes) {
  std::vector<std::string> events;
  feed(bytes, [&events](std::string_view data) { events.emplace_back(data); });
  return events;
}

void SseParser::feed(std::string_view bytes,
                     const std::function<void(std::string_view)>& on_event) {
  for (;;) {
    const size_t newline = bytes.find('\n');
    if (newline == std::string_view::npos) {
      line_ += bytes;
      // The next bytes may not stay alive: keep a copy of a data line read from these.
      if (!view_.empty()) {
        data_.assign(view_);
        view_ = {};
      }
      return;
    }
    std::string_view line;
    const bool in_bytes = line_.empty();  // the whole line lies in `bytes`
    if (in_bytes) {
      line = bytes.substr(0, newline);
    } else {
      line_ += bytes.substr(0, newline);
      line = line_;
    }
    bytes.remove_prefix(newline + 1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) {
      if (has_data_) on_event(view_.empty() ? std::string_view(data_) : view_);
      data_.clear();
      view_ = {};
      has_data_ = false;
    } else if (line.substr(0, 5) == "data:") {
      std::string_view value = line.substr(5);
      if (!value.empty() && value.front() == ' ') value.remove_prefix(1);
      if (!has_data_ && in_bytes && !value.empty()) {
        view_ = value;  // the common case: one data line, relayed without a copy
      } else {
        if (!view_.empty()) {
          data_.assign(view_);
          view_ = {};
        }
        if (has_data_) data_ += '\n';
        data_ += value;
      }
      has_data_ = true;
    }
    line_.clear();
  }
}

}  // namespace tandem::net
