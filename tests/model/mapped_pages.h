#pragma once
// Which pages of a checkpoint's mapping this process holds: how tests see that the binder gave
// back the mapped rows it converted or packed (release_pages, MADV_DONTNEED).
//
// The measure is the page table's present bit (/proc/self/pagemap), not mincore: for a file
// mapping mincore says whether the file's pages are in the page cache, which they stay after the
// process drops its own mapping of them, so it cannot see a release.
#include <fcntl.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

namespace tandem::test {

// The pages wholly inside [data, data + bytes): their first index and how many. A page shared
// with a neighbouring tensor is left out: reading the neighbour may keep it.
struct PageSpan {
  uintptr_t first = 0;
  int64_t count = 0;
};

inline PageSpan whole_pages(const void* data, size_t bytes) {
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t first = (begin + page - 1) / page, end = (begin + bytes) / page;
  return {first, end > first ? static_cast<int64_t>(end - first) : 0};
}

// How many of those pages this process has mapped in: bit 63 (present) of each page's entry in
// /proc/self/pagemap, which a process may read of itself. A page given back (MADV_DONTNEED) is
// not present until it is read again.
inline int64_t present_pages(const void* data, size_t bytes) {
  const PageSpan span = whole_pages(data, bytes);
  const int fd = ::open("/proc/self/pagemap", O_RDONLY);
  EXPECT_GE(fd, 0) << "opening /proc/self/pagemap: " << std::strerror(errno);
  int64_t present = 0;
  for (int64_t i = 0; fd >= 0 && i < span.count; ++i) {
    uint64_t entry = 0;
    const auto at = static_cast<off_t>((span.first + i) * sizeof entry);
    if (::pread(fd, &entry, sizeof entry, at) != sizeof entry) {
      ADD_FAILURE() << "reading /proc/self/pagemap at " << at << ": " << std::strerror(errno);
      break;
    }
    present += static_cast<int64_t>(entry >> 63);
  }
  if (fd >= 0) ::close(fd);
  return present;
}

}  // namespace tandem::test
