// HugePageBuffer: its own mapping, aligned and zeroed, advised for huge pages where the rule
// says (read back from the kernel's VmFlags), and given back when destroyed. HugePageArena: buffers
// carved back to back from shared mappings that live as long as any of their slices.
#include "util/huge_pages.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>

#include <gtest/gtest.h>

namespace tandem::util {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

// The VmFlags of the mapping that holds `address` (/proc/self/smaps), empty when none does.
std::string vm_flags_at(const void* address) {
  const auto at = reinterpret_cast<uintptr_t>(address);
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    uintptr_t begin = 0, end = 0;
    char dash = 0;
    std::istringstream header(line);
    if (header >> std::hex >> begin >> dash >> end && dash == '-') {
      inside = begin <= at && at < end;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return "";
}

bool advised_huge(const void* address) {
  return vm_flags_at(address).find(" hg") != std::string::npos;
}

bool mapped(const void* address) {
  unsigned char resident = 0;
  return mincore(const_cast<void*>(address), 4096, &resident) == 0 || errno != ENOMEM;
}

TEST(HugePageBuffer, IsAlignedZeroedAndWritableOverItsWholeSize) {
  HugePageBuffer b(5 * kMiB + 123);
  ASSERT_TRUE(b);
  EXPECT_EQ(b.size(), 5 * kMiB + 123);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.get()) % (2 * kMiB), 0u);
  for (size_t i = 0; i < b.size(); i += 4093) ASSERT_EQ(b.get()[i], 0) << i;
  EXPECT_EQ(b.get()[b.size() - 1], 0);
  b.get()[b.size() - 1] = 7;
  EXPECT_EQ(b.get()[b.size() - 1], 7);
}

TEST(HugePageBuffer, WholeHugePagesAreAdvisedAndAWastefulTailIsNot) {
  if (!std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled"))
    GTEST_SKIP() << "this kernel has no transparent huge pages";
  // 3 MiB: the 1 MiB tail would waste 1 MiB, more than an eighth of 3 MiB.
  HugePageBuffer b(3 * kMiB);
  EXPECT_TRUE(advised_huge(b.get()));
  EXPECT_TRUE(advised_huge(b.get() + 2 * kMiB - 1));
  EXPECT_FALSE(advised_huge(b.get() + 2 * kMiB));
  // 31.9 MiB: rounding the tail up wastes 0.1 MiB, within an eighth: advised to the end.
  HugePageBuffer c(32 * kMiB - kMiB / 10);
  EXPECT_TRUE(advised_huge(c.get() + c.size() - 1));
  // 5.5 MiB (a DeepSeek-V2-Lite BF16 expert matrix): wastes 0.5 MiB, within an eighth.
  HugePageBuffer e(5 * kMiB + kMiB / 2);
  EXPECT_TRUE(advised_huge(e.get() + e.size() - 1));
  // 2.75 MiB (the same matrix in INT8): would waste 1.25 MiB, more than an eighth.
  HugePageBuffer f(2 * kMiB + 3 * kMiB / 4);
  EXPECT_FALSE(advised_huge(f.get() + f.size() - 1));
  // Below one huge page and wasteful to round up: small pages only.
  HugePageBuffer d(kMiB);
  EXPECT_FALSE(advised_huge(d.get()));
}

TEST(HugePageBuffer, IsGivenBackWhenDestroyedAndMovesWithItsOwnership) {
  uint8_t* address = nullptr;
  {
    HugePageBuffer a(4 * kMiB);
    address = a.get();
    HugePageBuffer b(std::move(a));
    EXPECT_FALSE(a);  // NOLINT(bugprone-use-after-move): the moved-from state is specified
    EXPECT_EQ(b.get(), address);
    HugePageBuffer c;
    c = std::move(b);
    EXPECT_EQ(c.get(), address);
    EXPECT_TRUE(mapped(address));
  }
  EXPECT_FALSE(mapped(address));
}

TEST(HugePageArena, CarvesZeroedSlicesBackToBackOnCacheLines) {
  HugePageArena arena(8 * kMiB);
  HugePageSlice a = arena.allocate(3 * kMiB + 1);
  HugePageSlice b = arena.allocate(100);
  HugePageSlice c = arena.allocate(64);
  ASSERT_TRUE(a && b && c);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.get()) % (2 * kMiB), 0u);
  EXPECT_EQ(b.get(), a.get() + 3 * kMiB + 64);  // the next cache line after a's last byte
  EXPECT_EQ(c.get(), b.get() + 128);
  EXPECT_EQ(a.size(), 3 * kMiB + 1);
  EXPECT_EQ(b.size(), 100u);
  for (size_t i = 0; i < a.size(); i += 4093) ASSERT_EQ(a.get()[i], 0) << i;
  for (size_t i = 0; i < b.size(); ++i) ASSERT_EQ(b.get()[i], 0) << i;
  a.get()[a.size() - 1] = 1;
  b.get()[0] = 2;
  EXPECT_EQ(a.get()[a.size() - 1], 1);
  EXPECT_EQ(b.get()[0], 2);
}

TEST(HugePageArena, OpensAChunkWhenTheSliceDoesNotFitAndMapsAnOversizedOneOnItsOwn) {
  HugePageArena arena(4 * kMiB);
  HugePageSlice a = arena.allocate(3 * kMiB);
  HugePageSlice b = arena.allocate(2 * kMiB);  // does not fit after a: a new chunk
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.get()) % (2 * kMiB), 0u);
  HugePageSlice big = arena.allocate(9 * kMiB);  // larger than a chunk: a mapping of its own
  HugePageSlice c = arena.allocate(kMiB);        // still carved from b's chunk
  EXPECT_EQ(c.get(), b.get() + 2 * kMiB);
  EXPECT_EQ(big.size(), 9 * kMiB);
  big.get()[big.size() - 1] = 3;
  EXPECT_EQ(big.get()[big.size() - 1], 3);
}

TEST(HugePageArena, ChunksAreAdvisedForHugePagesToTheirEnd) {
  if (!std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled"))
    GTEST_SKIP() << "this kernel has no transparent huge pages";
  HugePageArena arena(8 * kMiB);
  // Three INT8 V2-Lite-width expert matrices (2.75 MiB each): on buffers of their own each
  // would end in 0.75 MiB of small pages; here only the chunk's last huge page is partly empty.
  HugePageSlice a = arena.allocate(2 * kMiB + 3 * kMiB / 4);
  HugePageSlice b = arena.allocate(2 * kMiB + 3 * kMiB / 4);
  EXPECT_TRUE(advised_huge(a.get() + a.size() - 1));
  EXPECT_TRUE(advised_huge(b.get() + b.size() - 1));
}

TEST(HugePageArena, SlicesOutliveTheArenaWhichGivesBackWhatWasNeverCarved) {
  uint8_t* first = nullptr;
  HugePageSlice kept;
  {
    HugePageArena arena(16 * kMiB);
    kept = arena.allocate(3 * kMiB);
    first = kept.get();
    kept.get()[0] = 9;
    EXPECT_TRUE(mapped(first + 8 * kMiB));  // the chunk's uncarved rest, still mapped
  }
  EXPECT_EQ(kept.get()[0], 9);
  EXPECT_TRUE(mapped(first + 3 * kMiB));   // the huge page a's last byte is in
  EXPECT_FALSE(mapped(first + 4 * kMiB));  // past it, given back
  kept = HugePageSlice();
  EXPECT_FALSE(mapped(first));  // the last slice gone: the mapping too
}

TEST(HugePageArena, ASliceOfItsOwnHoldsAWholeBuffer) {
  HugePageSlice s(HugePageBuffer(3 * kMiB));
  ASSERT_TRUE(s);
  EXPECT_EQ(s.size(), 3 * kMiB);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(s.get()) % (2 * kMiB), 0u);
}

TEST(HugePageArena, CountsTheBytesItHandedOut) {
  HugePageArena arena(4 * kMiB);
  arena.allocate(100);
  arena.allocate(3 * kMiB);
  arena.allocate(5 * kMiB);
  EXPECT_EQ(arena.carved(), 100 + 8 * kMiB);
}

TEST(AnonHugePageBytes, ReadsTheRollupsFieldAndZeroWhereAbsent) {
  const auto dir = std::filesystem::temp_directory_path();
  const auto rollup = dir / ("tandem-rollup-" + std::to_string(::getpid()));
  std::ofstream(rollup) << "55d0c0de0000-7ffc00000000 ---p 00000000 00:00 0 [rollup]\n"
                           "Rss:             9437184 kB\n"
                           "AnonHugePages:   8388608 kB\n"
                           "ShmemHugePages:        0 kB\n";
  EXPECT_EQ(anon_huge_page_bytes(rollup), size_t{8388608} * 1024);
  std::ofstream(rollup) << "Rss: 12 kB\n";
  EXPECT_EQ(anon_huge_page_bytes(rollup), 0u);
  std::filesystem::remove(rollup);
  EXPECT_EQ(anon_huge_page_bytes(rollup), 0u);
}

TEST(SmallPagesWarning, SpeaksOnlyWhenMoreThanATenthOfThePackedBytesCannotBeOnHugePages) {
  const size_t gb = size_t{1} << 30;
  EXPECT_EQ(small_pages_warning(10 * gb, 10 * gb), "");
  EXPECT_EQ(small_pages_warning(10 * gb, 9 * gb), "");
  EXPECT_EQ(small_pages_warning(0, 0), "");  // nothing packed (no AVX-512 BF16): nothing to say
  const std::string w = small_pages_warning(10 * gb, 6 * gb);
  EXPECT_NE(w.find("only 6.44 GB of the 10.74 GB of packed weights"), std::string::npos) << w;
  EXPECT_NE(w.find("transparent_hugepage/enabled"), std::string::npos) << w;
}

}  // namespace
}  // namespace tandem::util
