#include "util/split_copier.h"

#include "util/stream_copy.h"

namespace tandem {
namespace {

void copy_all(const std::vector<CopyRange>& ranges) {
  for (const CopyRange& r : ranges) stream_copy(r.to, r.from, r.bytes);
}

}  // namespace

SplitCopier::~SplitCopier() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void SplitCopier::run(std::vector<CopyRange> ranges) {
  size_t total = 0;
  for (const CopyRange& r : ranges) total += r.bytes;
  std::unique_lock busy(busy_, std::try_to_lock);
  if (total < split_min_ || !busy.owns_lock()) return copy_all(ranges);
  std::vector<CopyRange> theirs;  // the second half by bytes, a range cut where it falls
  size_t mine = 0;
  for (size_t i = 0; i < ranges.size(); ++i) {
    if (mine + ranges[i].bytes <= total / 2) {
      mine += ranges[i].bytes;
      continue;
    }
    const size_t keep = total / 2 - mine;
    theirs.push_back({ranges[i].to + keep, ranges[i].from + keep, ranges[i].bytes - keep});
    theirs.insert(theirs.end(), ranges.begin() + std::ptrdiff_t(i) + 1, ranges.end());
    ranges[i].bytes = keep;
    ranges.resize(i + 1);
    break;
  }
  {
    std::lock_guard lock(mutex_);
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    job_ = std::move(theirs);
    has_job_ = true;
  }
  wake_.notify_all();
  copy_all(ranges);
  std::unique_lock lock(mutex_);
  done_.wait(lock, [&] { return !has_job_; });
}

void SplitCopier::loop() {
  std::unique_lock lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return stop_ || has_job_; });
    if (stop_) return;
    const std::vector<CopyRange> job = std::move(job_);
    lock.unlock();
    copy_all(job);
    lock.lock();
    has_job_ = false;
    done_.notify_all();
  }
}

}  // namespace tandem
