#pragma once
// Memory for large buffers that are streamed front to back (packed weights, bandwidth
// benchmarks), on transparent huge pages where the kernel gives them. On a VM every TLB miss is a
// two-level page walk; streaming 4 KB pages read 40-47 GB/s on the development VM where 2 MB pages
// read 54-56 GB/s (same loop, alternating runs).
#include <cstddef>
#include <cstdint>

namespace tandem::util {

// Zeroed anonymous memory of its own mapping (not the allocator's: given back to the system when
// destroyed), 2 MB aligned and advised for huge pages (MADV_HUGEPAGE: the default THP mode
// `madvise` gives them to such ranges only). The tail that does not fill a huge page is advised
// too when that wastes at most an eighth of the size (a huge page is resident whole once
// touched), else it stays on small pages. An eighth, not less: a DeepSeek-V2-Lite expert matrix
// (1408 x 2048 BF16, 5.5 MiB) has a 1.5 MiB tail, and with the tails on small pages a decode
// token's routed experts read at 29-50 GB/s where, tails advised, they read 59-62 (4 alternating
// rounds; 3% more resident memory on that checkpoint).
class HugePageBuffer {
 public:
  HugePageBuffer() = default;
  explicit HugePageBuffer(size_t bytes);  // throws std::bad_alloc when it cannot be mapped
  ~HugePageBuffer();
  HugePageBuffer(HugePageBuffer&& other) noexcept;
  HugePageBuffer& operator=(HugePageBuffer&& other) noexcept;
  HugePageBuffer(const HugePageBuffer&) = delete;
  HugePageBuffer& operator=(const HugePageBuffer&) = delete;

  uint8_t* get() const { return data_; }
  size_t size() const { return size_; }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  size_t mapped_ = 0;  // the mapping's length from data_
};

}  // namespace tandem::util
