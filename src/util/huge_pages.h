#pragma once
// Memory for large buffers that are streamed front to back (packed weights, bandwidth
// benchmarks), on transparent huge pages where the kernel gives them. On a VM every TLB miss is a
// two-level page walk; streaming 4 KB pages read 40-47 GB/s on the development VM where 2 MB pages
// read 54-56 GB/s (same loop, alternating runs).
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

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
  // Gives back the whole huge pages past the first `bytes` (which stay as they are).
  void shrink_to(size_t bytes);

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  size_t mapped_ = 0;  // the mapping's length from data_
};

// A part of a mapping that a HugePageArena carved; the mapping lives while any of its parts does.
class HugePageSlice {
 public:
  HugePageSlice() = default;
  explicit HugePageSlice(HugePageBuffer whole);  // all of a buffer of its own
  uint8_t* get() const { return data_; }
  size_t size() const { return size_; }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  friend class HugePageArena;
  std::shared_ptr<const HugePageBuffer> owner_;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Buffers carved one after another out of large huge-page mappings (chunks), for many matrices
// of a few MB that are each read front to back: a buffer of its own leaves the part past its last
// whole huge page on small pages (or wastes most of a huge page on it), and an INT8
// DeepSeek-V2-Lite expert matrix (2.75 MiB) has 27% of its bytes there. In a chunk, buffers
// follow each other with no gap but 64-byte alignment, so all but the chunk's last huge page are
// filled, and the rest of the last chunk is given back when the arena is destroyed.
//
// Pages the kernel could not give as huge pages when first written (memory fragmented by the page
// cache) are collapsed into huge pages when the arena is destroyed (MADV_COLLAPSE, Linux 6.1+;
// elsewhere a no-op), so the load that owns the arena ends with its weights on huge pages where
// the kernel can find them. Not thread-safe: one loader owns one arena.
class HugePageArena {
 public:
  static constexpr size_t kDefaultChunk = size_t{64} << 20;
  explicit HugePageArena(size_t chunk_bytes = kDefaultChunk);
  ~HugePageArena();
  HugePageArena(const HugePageArena&) = delete;
  HugePageArena& operator=(const HugePageArena&) = delete;

  // `bytes` of zeroed memory, 64-byte aligned; larger than a chunk: a mapping of its own.
  HugePageSlice allocate(size_t bytes);
  // What allocate() handed out, in bytes.
  size_t carved() const { return carved_; }

 private:
  struct Chunk {
    std::shared_ptr<HugePageBuffer> buffer;
    size_t used = 0;
  };
  size_t chunk_bytes_;
  std::vector<Chunk> chunks_;   // every mapping made, shrunk and collapsed at destruction
  std::optional<size_t> open_;  // the chunk carved next
  size_t carved_ = 0;
};

// Anonymous memory of this process on transparent huge pages: the AnonHugePages field of
// `rollup` (the process's /proc/self/smaps_rollup), in bytes; 0 where the file or field is absent.
size_t anon_huge_page_bytes(const std::filesystem::path& rollup = "/proc/self/smaps_rollup");

// What to tell the user after a load when less than 90% of its `packed` bytes (the weights decode
// streams every token) can be on huge pages, `huge` being the process's bytes on them: on 4 KB
// pages the development VM streamed them 20-45% slower. Empty when there is nothing to say.
std::string small_pages_warning(size_t packed, size_t huge);

}  // namespace tandem::util
