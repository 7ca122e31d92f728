// HugePageBuffer: its own mapping, aligned and zeroed, advised for huge pages where the rule
// says (read back from the kernel's VmFlags), and given back when destroyed.
#include "util/huge_pages.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstdint>
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

}  // namespace
}  // namespace tandem::util
