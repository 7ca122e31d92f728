#pragma once
// A std::vector whose resize() and size constructor leave trivial elements uninitialised, for
// buffers a kernel then writes entirely: an LM head's logits are 129K floats per row, and zeroing
// them first costs a pass over memory as large as the one that computes them.
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace tandem::util {

template <typename T, typename Base = std::allocator<T>>
class DefaultInitAllocator : public Base {
  using Traits = std::allocator_traits<Base>;

 public:
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U, typename Traits::template rebind_alloc<U>>;
  };
  using Base::Base;

  // Default-initialises (no zeroing for trivial types) where a vector would value-initialise.
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    Traits::construct(static_cast<Base&>(*this), p, std::forward<Args>(args)...);
  }
};

template <typename T>
using UninitializedVector = std::vector<T, DefaultInitAllocator<T>>;

}  // namespace tandem::util
