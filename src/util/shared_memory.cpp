#include "util/shared_memory.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>

#include "util/error.h"

namespace tandem {
namespace {

std::string os_error() {
  return std::strerror(errno);
}

}  // namespace

SharedSegment SharedSegment::create(size_t bytes, const std::string& name) {
  const int fd =
      static_cast<int>(syscall(SYS_memfd_create, name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (fd < 0) throw Error("shared memory: memfd_create failed: " + os_error());
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    const std::string why = os_error();
    close(fd);
    throw Error("shared memory: cannot size a segment of " + std::to_string(bytes) +
                " bytes: " + why);
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const std::string why = os_error();
    close(fd);
    throw Error("shared memory: cannot map " + std::to_string(bytes) + " bytes: " + why);
  }
  return SharedSegment(fd, static_cast<std::byte*>(p), bytes);
}

SharedSegment SharedSegment::attach(int fd, SharedAccess access) {
  struct stat st {};
  std::string problem;
  if (fstat(fd, &st) != 0 || st.st_size <= 0)
    problem = "is not a segment";
  else if (const int seals = fcntl(fd, F_GET_SEALS); seals < 0 || (seals & F_SEAL_SHRINK) == 0)
    // F_GET_SEALS fails (-1, every bit set) on a file that is not a memfd: a regular file's
    // owner can truncate it under the mapping as surely as an unsealed memfd's.
    problem = seals < 0 ? "is not a sealed segment (not a memfd: its owner could truncate it "
                          "under this mapping)"
                        : "is not a sealed segment (its owner could shrink it under this mapping)";
  if (!problem.empty()) {
    close(fd);
    throw Error("shared memory: descriptor " + std::to_string(fd) + " " + problem);
  }
  const auto bytes = static_cast<size_t>(st.st_size);
  const int protection = access == SharedAccess::kReadOnly ? PROT_READ : PROT_READ | PROT_WRITE;
  void* p = mmap(nullptr, bytes, protection, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    close(fd);
    throw Error("shared memory: cannot map descriptor " + std::to_string(fd));
  }
  return SharedSegment(fd, static_cast<std::byte*>(p), bytes);
}

SharedSegment::SharedSegment(SharedSegment&& other) noexcept
    : fd_(other.fd_), data_(other.data_), size_(other.size_) {
  other.fd_ = -1;
  other.data_ = nullptr;
  other.size_ = 0;
}

SharedSegment& SharedSegment::operator=(SharedSegment&& other) noexcept {
  if (this != &other) {
    this->~SharedSegment();
    new (this) SharedSegment(std::move(other));
  }
  return *this;
}

SharedSegment::~SharedSegment() {
  if (data_) munmap(data_, size_);
  if (fd_ >= 0) close(fd_);
  data_ = nullptr;
  fd_ = -1;
}

void SharableBuffer::Unmap::operator()(std::byte* p) const {
  munmap(p, size);
}

SharableBuffer::SharableBuffer(size_t bytes, const std::string& name) : size_(bytes) {
  try {
    segment_ = SharedSegment::create(bytes, name);
    data_ = segment_.data();
  } catch (const Error& e) {
    // Anonymous pages, like the segment's, are zero until first written: a zero-filled new[]
    // made every byte of a cache sized for the whole machine resident at start-up.
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      throw Error("cannot allocate " + std::to_string(bytes) + " bytes for " + name + ": " +
                  os_error() + " (and no shared segment: " + e.what() + ")");
    private_ = std::unique_ptr<std::byte, Unmap>(static_cast<std::byte*>(p), Unmap{bytes});
    data_ = private_.get();
  }
}

void wait_while_equal(std::atomic<uint32_t>& word, uint32_t expected, int timeout_ms) {
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));
  timespec t{timeout_ms / 1000, (timeout_ms % 1000) * 1000000L};
  // Not FUTEX_PRIVATE: the word is in memory other processes map.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, expected, &t, nullptr, 0);
}

void wake_all(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr,
          0);
}

void SharedBarrier::arrive_and_wait(uint32_t parties,
                                    const std::function<void(uint32_t waiting_at)>& poll) {
  const uint32_t gen = generation.load(std::memory_order_acquire);
  if (arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == parties) {
    arrived.store(0, std::memory_order_relaxed);
    generation.fetch_add(1, std::memory_order_acq_rel);
    wake_all(generation);
    return;
  }
  // A short spin catches peers that arrive within microseconds (the common case when every rank
  // has work); then sleep, since on a machine with fewer cores than ranks a spinner takes the
  // core its peer needs.
  constexpr int kSpins = 2000;
  for (int i = 0; i < kSpins; ++i) {
    if (generation.load(std::memory_order_acquire) != gen) return;
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  while (generation.load(std::memory_order_acquire) == gen) {
    wait_while_equal(generation, gen, 20);
    if (generation.load(std::memory_order_acquire) != gen) return;
    if (poll) poll(gen);
  }
}

}  // namespace tandem
