#pragma once
// When a request body being read has taken too long: the server's policy, pure, on a clock the
// caller passes in (the connection's loop clock; a test's numbers).
//
// Two bounds, the earlier wins:
// - between reads: the next body bytes must arrive within `timeout` of the last ones (or of the
//   head, before the first), as nginx's client_body_timeout. A client that sends slowly but
//   steadily gets its whole body in, however long it takes; one that stops is found within
//   `timeout`.
// - in total: `timeout` after the body began, plus one second per `min_bytes_per_second` bytes
//   received, as Apache's mod_reqtimeout (body=..., MinRate=...). A client must keep an average
//   rate, so one that drips a byte per interval cannot hold a connection (and the body buffer it
//   reserved) for ever. Scaled by what arrived, not by the announced length: a chunked body has
//   none, and a large Content-Length must not buy time that the bytes never pay for.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>

namespace tandem::net::detail {

class BodyReadDeadline {
 public:
  // The body begins at `now_ms` (its head was read). `min_bytes_per_second` 0: no total bound.
  BodyReadDeadline(int64_t now_ms, std::chrono::milliseconds timeout, uint64_t min_bytes_per_second)
      : started_ms_(now_ms),
        last_progress_ms_(now_ms),
        timeout_ms_(timeout.count()),
        min_bytes_per_second_(min_bytes_per_second) {}

  // `bytes` more of the body were read at `now_ms` (0: a read that made no progress, which
  // extends nothing).
  void received(int64_t now_ms, uint64_t bytes) {
    if (bytes == 0) return;
    received_ += bytes;
    last_progress_ms_ = now_ms;
  }

  // The loop-clock time at which the body has timed out.
  int64_t due_ms() const {
    const int64_t between_reads = saturating_add(last_progress_ms_, timeout_ms_);
    if (min_bytes_per_second_ == 0) return between_reads;
    const uint64_t earned_ms = received_ / min_bytes_per_second_ * 1000 +
                               received_ % min_bytes_per_second_ * 1000 / min_bytes_per_second_;
    const int64_t total = saturating_add(
        saturating_add(started_ms_, timeout_ms_),
        static_cast<int64_t>(std::min<uint64_t>(earned_ms, std::numeric_limits<int64_t>::max())));
    return std::min(between_reads, total);
  }

 private:
  static int64_t saturating_add(int64_t a, int64_t b) {
    return b > std::numeric_limits<int64_t>::max() - a ? std::numeric_limits<int64_t>::max()
                                                       : a + b;
  }

  int64_t started_ms_;
  int64_t last_progress_ms_;
  int64_t timeout_ms_;
  uint64_t min_bytes_per_second_;
  uint64_t received_ = 0;
};

}  // namespace tandem::net::detail
