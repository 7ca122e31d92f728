#pragma once
// The gateway's access log: one JSON line per request, written by a thread of its own so that a
// slow disk or a full pipe never stalls the scheduling thread that finishes requests. Lines are
// written in the order they were added, in batches.
//
// Nothing a reader or a client does can make it hold unbounded memory or the process: lines
// waiting to be written are capped in bytes (past the cap new lines are dropped), a pipe, FIFO,
// terminal or socket is written without blocking, and at destruction the writer gets a deadline
// to write what is queued, after which the rest is given up. Every line not written (dropped at
// the cap, lost to a failed write, or left at the deadline) is counted, and said on stderr at
// most once per interval.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "util/metrics.h"

namespace tandem::gateway {

struct AccessLogLimits {
  // Bytes of serialized lines waiting to be written (including the batch being written).
  size_t max_queued_bytes = size_t{64} << 20;
  // How long destruction waits for a reader that does not read before giving up the rest.
  std::chrono::milliseconds shutdown_deadline{2000};
};

class AccessLog {
 public:
  using Limits = AccessLogLimits;

  // `path`: a file opened for appending, or "-" for standard output. `dropped` (may be null)
  // counts the lines not written. Throws tandem::Error naming the file when it cannot be opened.
  explicit AccessLog(const std::string& path, metrics::IntCounter* dropped = nullptr,
                     Limits limits = Limits{});
  ~AccessLog();  // writes what is queued until the deadline, then stops the writer
  AccessLog(const AccessLog&) = delete;
  AccessLog& operator=(const AccessLog&) = delete;

  // Serializes one line (invalid UTF-8 replaced, not thrown) and queues it, or drops it when the
  // queue is at its cap.
  void add(const nlohmann::json& line);

  // Lines not written so far (those `dropped` counted).
  uint64_t dropped_lines() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::gateway
