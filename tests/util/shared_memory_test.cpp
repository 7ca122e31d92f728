// Shared-memory segments: sealed sizes, read-only attachment, descriptors that are refused.
#include "util/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "util/error.h"
#include "util/error_of.h"

namespace tandem {
namespace {

using testing::error_of;
using ::testing::HasSubstr;

// A second descriptor of the same segment, as a peer would receive it.
int reopen(int fd, int flags) {
  return ::open(("/proc/self/fd/" + std::to_string(fd)).c_str(), flags | O_CLOEXEC);
}

TEST(SharedSegment, ItsSizeIsSealedSoNoSharerCanShrinkIt) {
  SharedSegment s = SharedSegment::create(1 << 16, "test-sealed");
  EXPECT_NE(::ftruncate(s.fd(), 4096), 0);
  EXPECT_NE(::ftruncate(s.fd(), 1 << 20), 0);
  std::memset(s.data(), 5, s.size());  // still fully usable
  SharedSegment other = SharedSegment::attach(::dup(s.fd()));
  EXPECT_EQ(other.size(), s.size());
  EXPECT_EQ(other.data()[(1 << 16) - 1], std::byte{5});
}

TEST(SharedSegment, AReadOnlyAttachmentSeesTheOwnersWritesAndCannotWrite) {
  SharedSegment s = SharedSegment::create(8192, "test-read-only");
  const int read_only = reopen(s.fd(), O_RDONLY);
  ASSERT_GE(read_only, 0);
  SharedSegment view = SharedSegment::attach(read_only, SharedAccess::kReadOnly);
  s.data()[100] = std::byte{42};
  EXPECT_EQ(view.data()[100], std::byte{42});
  // The pages are mapped without write permission.
  EXPECT_NE(::mprotect(view.data(), 4096, PROT_READ | PROT_WRITE), 0);
  // A read-only descriptor cannot be attached for writing.
  EXPECT_THAT(error_of([&] { SharedSegment::attach(reopen(s.fd(), O_RDONLY)); }),
              HasSubstr("cannot map"));
}

TEST(SharedSegment, DescriptorsThatAreNotSealedSegmentsAreRefused) {
  // A memfd whose owner could still shrink it under our mapping.
  const int unsealed = static_cast<int>(::syscall(SYS_memfd_create, "unsealed", MFD_CLOEXEC));
  ASSERT_GE(unsealed, 0);
  ASSERT_EQ(::ftruncate(unsealed, 4096), 0);
  EXPECT_THAT(error_of([&] { SharedSegment::attach(unsealed); }),
              HasSubstr("is not a sealed segment"));
  // A regular file, which has no seals at all (F_GET_SEALS fails with -1, all bits set): its
  // owner could truncate it and fault every later read of a read-write mapping (SIGBUS).
  char path[] = "/tmp/tandem-shm-test-XXXXXX";
  const int file = ::mkstemp(path);
  ASSERT_GE(file, 0);
  ::unlink(path);
  ASSERT_EQ(::ftruncate(file, 4096), 0);
  EXPECT_THAT(error_of([&] { SharedSegment::attach(file); }),
              HasSubstr("is not a sealed segment (not a memfd"));
  // An empty file.
  const int empty = static_cast<int>(::syscall(SYS_memfd_create, "empty", MFD_CLOEXEC));
  ASSERT_GE(empty, 0);
  EXPECT_THAT(error_of([&] { SharedSegment::attach(empty); }), HasSubstr("is not a segment"));
}

TEST(SharedView, ContainsOnlyRangesWhollyInside) {
  SharedSegment s = SharedSegment::create(4096, "test-view");
  const SharedView v = s.view();
  EXPECT_TRUE(v);
  EXPECT_TRUE(v.contains(s.data(), 4096));
  EXPECT_TRUE(v.contains(s.data() + 4000, 96));
  EXPECT_TRUE(v.contains(s.data() + 4096, 0));
  EXPECT_FALSE(v.contains(s.data() + 4000, 97));
  EXPECT_FALSE(v.contains(s.data() - 1, 1));
  EXPECT_FALSE(v.contains(s.data() + 1, ~size_t(0)));
  EXPECT_FALSE(SharedView{}.contains(s.data(), 1));
  EXPECT_FALSE(SharedView{});
}

// Resident pages of this process, from /proc/self/statm.
int64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * ::sysconf(_SC_PAGE_SIZE);
}

// Where memfd is refused, the buffer is private memory that is also allocated as it is written:
// it was a zero-filled new[], making all of a cache sized for the machine resident at once.
TEST(SharableBuffer, WithoutMemfdItsPrivateMemoryIsStillAllocatedAsWritten) {
  constexpr size_t kBytes = size_t{1} << 30;
  const int64_t before = resident_bytes();
  ASSERT_GT(before, 0);
  rlimit files{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &files), 0);
  rlimit none = files;
  none.rlim_cur = 0;  // memfd_create then fails (EMFILE), as in a sandbox that refuses it
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &none), 0);
  std::optional<SharableBuffer> buffer;
  std::string error;
  try {
    buffer.emplace(kBytes, "test-private");
  } catch (const Error& e) {
    error = e.what();
  }
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &files), 0);
  ASSERT_TRUE(buffer) << error;
  EXPECT_FALSE(buffer->shared());
  EXPECT_EQ(buffer->size(), kBytes);
  EXPECT_EQ(buffer->data()[0], std::byte{0});
  EXPECT_EQ(buffer->data()[kBytes - 1], std::byte{0});
  buffer->data()[kBytes / 2] = std::byte{7};
  EXPECT_LT(resident_bytes() - before, int64_t{64} << 20);
}

}  // namespace
}  // namespace tandem
