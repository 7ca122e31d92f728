#include "util/huge_pages.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <new>
#include <utility>

#include "util/proc_fields.h"

namespace tandem::util {

namespace {
constexpr size_t kHugePage = size_t{2} << 20;  // x86-64 and arm64 (4 KB base pages) PMD size
constexpr size_t kPage = 4096;

size_t round_up(size_t n, size_t to) {
  return (n + to - 1) / to * to;
}

constexpr size_t kSliceAlignment = 64;  // a cache line: what oneDNN and the AVX-512 loads want

// Asks the kernel to put the whole huge pages of [data, data + bytes) on huge pages now, copying
// what it could not give as huge pages at fault time (a partial last one is left: it may reach
// past what was advised). Best effort: older kernels (EINVAL) and failed compaction (EAGAIN,
// ENOMEM) leave the pages as they were, which is correct, only slower to stream.
void collapse(uint8_t* data, size_t bytes) {
#ifdef MADV_COLLAPSE
  const size_t whole = bytes / kHugePage * kHugePage;
  if (whole > 0) madvise(data, whole, MADV_COLLAPSE);
#else
  (void)data;
  (void)bytes;
#endif
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

void HugePageBuffer::shrink_to(size_t bytes) {
  const size_t keep = std::max(round_up(bytes, kHugePage), kHugePage);  // never the whole mapping
  if (keep >= mapped_) return;
  munmap(data_ + keep, mapped_ - keep);
  mapped_ = keep;
  size_ = std::min(size_, keep);
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

HugePageSlice::HugePageSlice(HugePageBuffer whole)
    : owner_(std::make_shared<const HugePageBuffer>(std::move(whole))),
      data_(owner_->get()),
      size_(owner_->size()) {}

HugePageArena::HugePageArena(size_t chunk_bytes)
    : chunk_bytes_(round_up(std::max<size_t>(chunk_bytes, 1), kHugePage)) {}

HugePageArena::~HugePageArena() {
  for (Chunk& c : chunks_) {
    c.buffer->shrink_to(c.used);
    collapse(c.buffer->get(), c.used);
  }
}

HugePageSlice HugePageArena::allocate(size_t bytes) {
  bytes = std::max<size_t>(bytes, 1);
  Chunk* c = nullptr;
  if (bytes > chunk_bytes_) {
    chunks_.push_back({std::make_shared<HugePageBuffer>(bytes), 0});
    c = &chunks_.back();
  } else {
    if (!open_ || chunks_[*open_].used + bytes > chunk_bytes_) {
      chunks_.push_back({std::make_shared<HugePageBuffer>(chunk_bytes_), 0});
      open_ = chunks_.size() - 1;
    }
    c = &chunks_[*open_];
  }
  HugePageSlice slice;
  slice.owner_ = c->buffer;
  slice.data_ = c->buffer->get() + c->used;
  slice.size_ = bytes;
  c->used = round_up(c->used + bytes, kSliceAlignment);
  carved_ += bytes;
  return slice;
}

size_t anon_huge_page_bytes(const std::filesystem::path& rollup) {
  return proc_kb_field(rollup, "AnonHugePages");
}

std::string small_pages_warning(size_t packed, size_t huge) {
  if (packed == 0 || huge >= packed / 10 * 9) return "";
  char text[512];
  std::snprintf(text, sizeof text,
                "warning: only %.2f GB of the %.2f GB of packed weights are on transparent huge "
                "pages; decode streams weights on 4 KB pages up to 45%% slower. Check that "
                "/sys/kernel/mm/transparent_hugepage/enabled is [madvise] or [always] and that "
                "memory is not fragmented (free the page cache, or load earlier)",
                static_cast<double>(huge) / 1e9, static_cast<double>(packed) / 1e9);
  return text;
}

}  // namespace tandem::util
