#pragma once
// A receiver's read-only mappings of its peers' shared-memory segments (the prefill engines'
// KV caches the shared-memory transport copies from), kept across connections, one per transfer,
// so that their pages stay mapped; a mapping is dropped once its peer process has exited (it
// would keep that memory alive) or, beyond kMaxMappedPeers, when least recently used.
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "util/shared_memory.h"

namespace tandem::engine {

class PeerSegments {
 public:
  static constexpr size_t kMaxMappedPeers = 16;

  PeerSegments() = default;
  PeerSegments(const PeerSegments&) = delete;
  PeerSegments& operator=(const PeerSegments&) = delete;
  ~PeerSegments();

  // The mapping of the segment behind `fd` (taken), which the process `owner` sent. Throws
  // tandem::Error when it is not a sealed segment.
  std::shared_ptr<const SharedSegment> get(int fd, pid_t owner);
  // Drops the mappings whose owner has exited (connections still reading one keep it).
  void forget_exited();

 private:
  struct Entry {
    std::shared_ptr<const SharedSegment> segment;
    pid_t owner;
    int pidfd;  // readable once `owner` has exited; -1 where the kernel has no pidfd_open
    uint64_t used;
  };
  using Map = std::map<std::pair<dev_t, ino_t>, Entry>;

  static bool exited(const Entry& e);
  Map::iterator erase(Map::iterator it);

  std::mutex mutex_;
  Map entries_;
  uint64_t clock_ = 0;
};

}  // namespace tandem::engine
