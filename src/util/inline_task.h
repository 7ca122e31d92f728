#pragma once
// A move-only `void()` callable that keeps closures of up to kInlineBytes inside itself. The
// gateway posts a few tasks to its scheduling thread per request; std::function keeps anything
// over 16 bytes (a `this` plus a shared_ptr already is 24) on the heap, so each post cost an
// extra allocation on the posting thread and a cross-thread free on the scheduler. Larger
// closures still work: they go to the heap.
#include <cstddef>
#include <cstdio>
#include <exception>
#include <new>
#include <type_traits>
#include <utility>

namespace tandem::util {

class InlineTask {
 public:
  static constexpr size_t kInlineBytes = 64;

  InlineTask() = default;
  InlineTask(std::nullptr_t) {}  // NOLINT: as std::function, an empty task

  template <typename F, typename = std::enable_if_t<!std::is_same_v<std::decay_t<F>, InlineTask> &&
                                                    std::is_invocable_r_v<void, std::decay_t<F>&>>>
  InlineTask(F&& f) {  // NOLINT: implicit, as std::function
    using Fn = std::decay_t<F>;
    if constexpr (sizeof(Fn) <= kInlineBytes && alignof(Fn) <= alignof(std::max_align_t) &&
                  std::is_nothrow_move_constructible_v<Fn>) {
      ::new (static_cast<void*>(storage_)) Fn(std::forward<F>(f));
      ops_ = &kInlineOps<Fn>;
    } else {
      *reinterpret_cast<Fn**>(storage_) = new Fn(std::forward<F>(f));
      ops_ = &kHeapOps<Fn>;
    }
  }

  InlineTask(InlineTask&& o) noexcept : ops_(o.ops_) {
    if (ops_) ops_->move(storage_, o.storage_);
    o.ops_ = nullptr;
  }
  InlineTask& operator=(InlineTask&& o) noexcept {
    if (this != &o) {
      reset();
      ops_ = o.ops_;
      if (ops_) ops_->move(storage_, o.storage_);
      o.ops_ = nullptr;
    }
    return *this;
  }
  InlineTask(const InlineTask&) = delete;
  InlineTask& operator=(const InlineTask&) = delete;
  ~InlineTask() { reset(); }

  explicit operator bool() const { return ops_ != nullptr; }
  void operator()() { ops_->call(storage_); }

 private:
  struct Ops {
    void (*call)(void* self);
    void (*move)(void* to, void* from);  // move-constructs into `to`, destroys `from`
    void (*destroy)(void* self);
  };

  template <typename Fn>
  static constexpr Ops kInlineOps = {
      [](void* s) { (*static_cast<Fn*>(s))(); },
      [](void* to, void* from) {
        ::new (to) Fn(std::move(*static_cast<Fn*>(from)));
        static_cast<Fn*>(from)->~Fn();
      },
      [](void* s) { static_cast<Fn*>(s)->~Fn(); },
  };
  template <typename Fn>
  static constexpr Ops kHeapOps = {
      [](void* s) { (**static_cast<Fn**>(s))(); },
      [](void* to, void* from) { *static_cast<Fn**>(to) = *static_cast<Fn**>(from); },
      [](void* s) { delete *static_cast<Fn**>(s); },
  };

  void reset() {
    if (ops_) ops_->destroy(storage_);
    ops_ = nullptr;
  }

  alignas(std::max_align_t) unsigned char storage_[kInlineBytes];
  const Ops* ops_ = nullptr;
};

// Runs `task`; one that throws is reported on stderr ("<who> failed: <why>") and dropped,
// so the thread running it goes on with its other tasks (an exception leaving a thread ends the
// process).
inline void run_reported(InlineTask& task, const char* who) {
  try {
    task();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s failed: %s\n", who, e.what());
  } catch (...) {
    std::fprintf(stderr, "%s failed: an unknown error\n", who);
  }
}

}  // namespace tandem::util
