#pragma once
// Copies a list of memory ranges with streaming stores (stream_copy), the second half of the
// bytes on a helper thread it keeps: two cores move a large copy ~1.3x as fast as one on this
// VM. The shared-memory KV transport copies each arriving layer with it.
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <thread>
#include <vector>

namespace tandem {

struct CopyRange {
  std::byte* to;
  const std::byte* from;
  size_t bytes;
};

class SplitCopier {
 public:
  // Lists of fewer than `split_min` bytes are copied by the caller alone.
  explicit SplitCopier(size_t split_min) : split_min_(split_min) {}
  SplitCopier(const SplitCopier&) = delete;
  SplitCopier& operator=(const SplitCopier&) = delete;
  ~SplitCopier();

  // Returns once every range is copied. Thread-safe: a caller that finds the helper busy with
  // another's copy copies alone.
  void run(std::vector<CopyRange> ranges);

 private:
  void loop();

  const size_t split_min_;
  std::mutex busy_;  // held by the caller whose copy the helper shares
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::vector<CopyRange> job_;  // the helper's half
  bool has_job_ = false, stop_ = false;
  std::thread thread_;  // started by the first split copy
};

}  // namespace tandem
