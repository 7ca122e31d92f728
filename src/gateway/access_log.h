#pragma once
// The gateway's access log: one JSON line per request, written by a thread of its own so that a
// slow disk or a full pipe never stalls the scheduling thread that finishes requests. Lines are
// written in the order they were added, in batches (one flush per batch), and every line added
// before the log is destroyed is written.
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

namespace tandem::gateway {

class AccessLog {
 public:
  // `path`: a file opened for appending, or "-" for standard output. Throws tandem::Error naming
  // the file when it cannot be opened.
  explicit AccessLog(const std::string& path);
  ~AccessLog();  // writes what is queued, then stops the writer
  AccessLog(const AccessLog&) = delete;
  AccessLog& operator=(const AccessLog&) = delete;

  // Queues one line; the writer serializes it (invalid UTF-8 replaced, not thrown).
  void add(nlohmann::json line);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::gateway
