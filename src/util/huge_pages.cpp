#include "util/huge_pages.h"

#include <sys/mman.h>

#include <algorithm>
#include <new>
#include <utility>

namespace tandem::util {

namespace {
constexpr size_t kHugePage = size_t{2} << 20;  // x86-64 and arm64 (4 KB base pages) PMD size
constexpr size_t kPage = 4096;

size_t round_up(size_t n, size_t to) {
  return (n + to - 1) / to * to;
}
}  // namespace

HugePageBuffer::HugePageBuffer(size_t bytes) : size_(bytes) {
  const size_t whole = bytes / kHugePage * kHugePage;
  const size_t tail = bytes - whole;
  const bool round_tail = tail > 0 && kHugePage - tail <= bytes / 8;
  const size_t advised = round_tail ? whole + kHugePage : whole;
  mapped_ = std::max(round_up(bytes, kPage), advised);
  // Mapped with a huge page of slack, then trimmed to a 2 MB boundary at the front.
  const size_t reserve = mapped_ + kHugePage;
  void* p = mmap(nullptr, reserve, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  auto* base = static_cast<uint8_t*>(p);
  const uintptr_t address = reinterpret_cast<uintptr_t>(base);
  data_ = base + (round_up(address, kHugePage) - address);
  if (data_ > base) munmap(base, static_cast<size_t>(data_ - base));
  const size_t after = reserve - static_cast<size_t>(data_ - base) - mapped_;
  if (after > 0) munmap(data_ + mapped_, after);
  // A hint: where THP is off the memory is as usable on small pages.
  if (advised > 0) madvise(data_, advised, MADV_HUGEPAGE);
}

HugePageBuffer::~HugePageBuffer() {
  if (data_) munmap(data_, mapped_);
}

HugePageBuffer::HugePageBuffer(HugePageBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_(std::exchange(other.mapped_, 0)) {}

HugePageBuffer& HugePageBuffer::operator=(HugePageBuffer&& other) noexcept {
  if (this != &other) {
    HugePageBuffer old(std::move(*this));
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_ = std::exchange(other.mapped_, 0);
  }
  return *this;
}

}  // namespace tandem::util
