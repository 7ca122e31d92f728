#include "engine/transfer/shm_peer_segments.h"

#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>

#include "util/error.h"

namespace tandem::engine {

PeerSegments::~PeerSegments() {
  for (auto& [key, e] : entries_)
    if (e.pidfd >= 0) ::close(e.pidfd);
}

std::shared_ptr<const SharedSegment> PeerSegments::get(int fd, pid_t owner) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    throw Error("the sender's segment cannot be examined");
  }
  std::lock_guard lock(mutex_);
  const auto key = std::make_pair(st.st_dev, st.st_ino);
  if (auto it = entries_.find(key); it != entries_.end()) {
    ::close(fd);
    it->second.used = ++clock_;
    return it->second.segment;
  }
  auto segment =
      std::make_shared<const SharedSegment>(SharedSegment::attach(fd, SharedAccess::kReadOnly));
  if (entries_.size() >= kMaxMappedPeers) {
    auto oldest = entries_.begin();
    for (auto it = entries_.begin(); it != entries_.end(); ++it)
      if (it->second.used < oldest->second.used) oldest = it;
    erase(oldest);
  }
#ifdef SYS_pidfd_open
  const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, owner, 0));
#else
  const int pidfd = -1;
#endif
  entries_.emplace(key, Entry{segment, owner, pidfd, ++clock_});
  return segment;
}

void PeerSegments::forget_exited() {
  std::lock_guard lock(mutex_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (exited(it->second))
      it = erase(it);
    else
      ++it;
  }
}

bool PeerSegments::exited(const Entry& e) {
  if (e.pidfd < 0) return ::kill(e.owner, 0) != 0 && errno == ESRCH;
  pollfd p{e.pidfd, POLLIN, 0};
  return ::poll(&p, 1, 0) > 0;
}

PeerSegments::Map::iterator PeerSegments::erase(Map::iterator it) {
  if (it->second.pidfd >= 0) ::close(it->second.pidfd);
  return entries_.erase(it);
}

}  // namespace tandem::engine
