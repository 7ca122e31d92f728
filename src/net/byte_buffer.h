#pragma once
// The read buffer of a connection: bytes arrive at the end, the parser consumes them from the
// front. It grows to the largest message head seen and then stays, so steady-state reads do not
// allocate.
#include <cstddef>
#include <cstring>
#include <memory>
#include <string_view>

namespace tandem::net::detail {

class ByteBuffer {
 public:
  std::string_view view() const { return {data_.get() + begin_, end_ - begin_}; }
  size_t size() const { return end_ - begin_; }
  bool empty() const { return begin_ == end_; }

  // Room for at least `n` more bytes after the unread ones; returns where to write them.
  char* prepare(size_t n) {
    if (cap_ - end_ >= n) return data_.get() + end_;
    const size_t unread = size();
    if (cap_ >= unread + n && begin_ > 0) {
      // Moving the unread bytes to the front is cheaper than growing.
      std::memmove(data_.get(), data_.get() + begin_, unread);
    } else {
      size_t cap = cap_ ? cap_ : 4096;
      while (cap < unread + n) cap *= 2;
      auto data = std::make_unique<char[]>(cap);
      if (unread) std::memcpy(data.get(), data_.get() + begin_, unread);
      data_ = std::move(data);
      cap_ = cap;
    }
    begin_ = 0;
    end_ = unread;
    return data_.get() + end_;
  }
  // Free bytes after the unread ones (what prepare(0) left).
  size_t room() const { return cap_ - end_; }
  void commit(size_t n) { end_ += n; }
  void consume(size_t n) {
    begin_ += n;
    if (begin_ == end_) begin_ = end_ = 0;
  }
  void clear() { begin_ = end_ = 0; }
  // Gives the memory back when nothing is unread (a connection going idle: thousands of idle
  // keep-alive connections would otherwise hold a read buffer each).
  void release_if_empty() {
    if (!empty()) return;
    data_.reset();
    cap_ = begin_ = end_ = 0;
  }

 private:
  std::unique_ptr<char[]> data_;
  size_t cap_ = 0;
  size_t begin_ = 0;
  size_t end_ = 0;
};

}  // namespace tandem::net::detail
