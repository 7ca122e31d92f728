#pragma once
// Memory shared by processes on one host (an expert-parallel engine's ranks, a prefill and a
// decode engine moving KV), and the ways they wait for each other in it.
//
// A segment is an anonymous memfd: it has no name in /dev/shm, children inherit its descriptor
// (or receive it over a Unix socket),
// and the kernel frees it when the last process mapping it exits, however it exits (kill -9
// included), so no segment is ever left behind. Its size is sealed at creation: a process it is
// shared with cannot shrink it under another's mapping (which would fault on the lost pages).
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace tandem {

// A segment as the rest of a process reaches it: its descriptor and its mapping (not owned).
struct SharedView {
  int fd = -1;
  const std::byte* data = nullptr;
  size_t size = 0;
  explicit operator bool() const { return fd >= 0; }
  bool contains(const void* p, size_t n) const {
    const auto* b = static_cast<const std::byte*>(p);
    return fd >= 0 && b >= data && n <= size && size_t(b - data) <= size - n;
  }
};

enum class SharedAccess { kReadWrite, kReadOnly };

class SharedSegment {
 public:
  // A new zero-filled segment of `bytes` (pages are allocated as they are first written). The
  // descriptor is close-on-exec; a child that should inherit it clears that flag.
  static SharedSegment create(size_t bytes, const std::string& name);
  // Maps the segment behind an inherited or received descriptor (takes ownership of it). Throws
  // tandem::Error, closing it, when it is not a segment whose size is sealed.
  static SharedSegment attach(int fd, SharedAccess access = SharedAccess::kReadWrite);

  SharedSegment() = default;
  SharedSegment(SharedSegment&& other) noexcept;
  SharedSegment& operator=(SharedSegment&& other) noexcept;
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;
  ~SharedSegment();

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  int fd() const { return fd_; }
  SharedView view() const { return {fd_, data_, size_}; }

 private:
  SharedSegment(int fd, std::byte* data, size_t size) : fd_(fd), data_(data), size_(size) {}
  int fd_ = -1;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

// `bytes` zero-filled bytes in a segment of their own (pages allocated as first written), or in
// private anonymous memory (also allocated as first written) where the system refuses memfd (a
// sandbox); shared() is empty then. Throws tandem::Error naming `name` when neither can be
// mapped. For memory another process on this host may be given to read (an engine's KV cache).
class SharableBuffer {
 public:
  SharableBuffer() = default;
  SharableBuffer(size_t bytes, const std::string& name);
  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  SharedView shared() const { return segment_.view(); }

 private:
  struct Unmap {
    size_t size;  // unique_ptr value-initializes it; a default member initializer would not compile
    void operator()(std::byte* p) const;
  };
  SharedSegment segment_;
  std::unique_ptr<std::byte, Unmap> private_;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

// Blocks while *word == expected, for at most timeout_ms (process-shared futex; returns early on
// a wake, a change or a signal).
void wait_while_equal(std::atomic<uint32_t>& word, uint32_t expected, int timeout_ms);
void wake_all(std::atomic<uint32_t>& word);

// A reusable barrier for `parties` processes, living in a shared segment (zero-initialised is
// ready). Waiters spin briefly, then sleep on a futex; every 20 ms asleep they call `poll` with
// the generation they wait at, which may already have completed (the last party can arrive just
// before the call: the live generation is then the next wait's); `poll` throws to give up (a
// peer died, the engine is aborting).
struct alignas(64) SharedBarrier {
  std::atomic<uint32_t> arrived{0};
  std::atomic<uint32_t> generation{0};
  void arrive_and_wait(uint32_t parties, const std::function<void(uint32_t waiting_at)>& poll);
};

}  // namespace tandem
