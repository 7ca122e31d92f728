#pragma once
// When a request body being read has taken too long: the server's policy, pure, on a clock the
// caller passes in (the connection's loop clock; a test's numbers).
//
// Three bounds, the earliest wins:
// - between reads: the body must make progress within `timeout` of its last progress (or of the
//   head, before any), as nginx's client_body_timeout. A client that sends slowly but steadily
//   gets its whole body in; one that stops is found within `timeout`.
// - at a least rate: `timeout` after the body began, plus one second per `min_bytes_per_second`
//   bytes of body data received, as Apache's mod_reqtimeout (body=..., MinRate=...). A client
//   must keep an average rate, so one that drips a byte per interval cannot hold a connection for
//   ever. Scaled by what arrived, not by the announced length: a chunked body has none, and a
//   large Content-Length must not buy time that the bytes never pay for. Only data counts, as
//   only data counts toward max_body_bytes: chunk framing is the client's to inflate (a
//   chunk-size line may carry 4 KiB of extensions for one byte of data), so it moves the bound
//   between reads but earns no time.
// - in total: `most` after the body began (mod_reqtimeout's body=...-maxtimeout), so that what a
//   connection holds while its body arrives (the body's buffer) is held for a bounded time,
//   however much of the body was sent to earn time at the least rate. The server's `most` is
//   total_body_time(): its max_body_time, or the time its max_body_bytes takes at 28 KB/s if
//   that is longer, so that raising max_body_bytes does not refuse slow uploads of the larger
//   bodies it now takes.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>

namespace tandem::net::detail {

// The slowest upload rate a body of max_body_bytes is allowed for, in bytes per second: 28 KB/s,
// a slow mobile upload (the 5-minute default of HttpServerOptions::max_body_time is 8 MiB at it).
inline constexpr uint64_t kSlowestUploadBytesPerSecond = 28000;

// The total bound a server applies: `max_body_time`, or the time its largest body
// (`max_body_bytes`) takes at kSlowestUploadBytesPerSecond if that is longer, so that a server
// that takes larger bodies still takes them from slow clients (50 MiB at 125 KB/s takes 400 s,
// within 1872 s). `max_body_time` 0 (no total bound) stays 0.
inline std::chrono::milliseconds total_body_time(std::chrono::milliseconds max_body_time,
                                                 uint64_t max_body_bytes) {
  if (max_body_time.count() <= 0) return max_body_time;
  // Milliseconds, not bytes * 1000 / rate: no overflow for any max_body_bytes.
  const uint64_t scaled_ms = max_body_bytes / (kSlowestUploadBytesPerSecond / 1000);
  return std::max(max_body_time, std::chrono::milliseconds(static_cast<int64_t>(scaled_ms)));
}

class BodyReadDeadline {
 public:
  // The body begins at `now_ms` (its head was read). `min_bytes_per_second` 0: no least rate;
  // `most` 0: no total bound.
  BodyReadDeadline(int64_t now_ms, std::chrono::milliseconds timeout, uint64_t min_bytes_per_second,
                   std::chrono::milliseconds most)
      : started_ms_(now_ms),
        last_progress_ms_(now_ms),
        timeout_ms_(timeout.count()),
        min_bytes_per_second_(min_bytes_per_second),
        most_ms_(most.count()) {}

  // A read at `now_ms` took `wire_bytes` of the body as sent (its data and, when chunked, its
  // framing: chunk-size lines with their extensions, line ends, the trailer), `data_bytes` of them
  // the body's own. 0 wire bytes: a read that made no progress, which extends nothing.
  void received(int64_t now_ms, uint64_t wire_bytes, uint64_t data_bytes) {
    if (wire_bytes == 0) return;
    data_received_ += data_bytes;
    last_progress_ms_ = now_ms;
  }

  enum class Bound { kBetweenReads, kLeastRate, kTotal };
  struct Due {
    int64_t at_ms;  // loop-clock time
    Bound bound;    // which of the three it is, so that the answer can name it
  };

  // When the body has timed out, and by which bound: the earliest (on a tie, the first listed
  // above: a body that stopped is told so).
  Due due() const {
    Due due{saturating_add(last_progress_ms_, timeout_ms_), Bound::kBetweenReads};
    if (min_bytes_per_second_ > 0) {
      const uint64_t earned_ms =
          data_received_ / min_bytes_per_second_ * 1000 +
          data_received_ % min_bytes_per_second_ * 1000 / min_bytes_per_second_;
      const int64_t at = saturating_add(
          saturating_add(started_ms_, timeout_ms_),
          static_cast<int64_t>(std::min<uint64_t>(earned_ms, std::numeric_limits<int64_t>::max())));
      if (at < due.at_ms) due = {at, Bound::kLeastRate};
    }
    if (most_ms_ > 0) {
      const int64_t at = saturating_add(started_ms_, most_ms_);
      if (at < due.at_ms) due = {at, Bound::kTotal};
    }
    return due;
  }
  int64_t due_ms() const { return due().at_ms; }

 private:
  static int64_t saturating_add(int64_t a, int64_t b) {
    return b > std::numeric_limits<int64_t>::max() - a ? std::numeric_limits<int64_t>::max()
                                                       : a + b;
  }

  int64_t started_ms_;
  int64_t last_progress_ms_;
  int64_t timeout_ms_;
  uint64_t min_bytes_per_second_;
  int64_t most_ms_;
  uint64_t data_received_ = 0;
};

}  // namespace tandem::net::detail
