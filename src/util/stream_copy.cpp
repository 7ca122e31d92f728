#include "util/stream_copy.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tandem {

void stream_copy(void* to, const void* from, size_t bytes) {
  auto* d = static_cast<char*>(to);
  const auto* s = static_cast<const char*>(from);
#if defined(__x86_64__)
  // Streaming stores need an aligned destination: the head up to 16 bytes by memcpy.
  const size_t head = std::min(bytes, size_t(-reinterpret_cast<uintptr_t>(d) & 15));
  std::memcpy(d, s, head);
  size_t i = head;
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + i, s + i, bytes - i);
  _mm_sfence();
#else
  std::memcpy(d, s, bytes);
#endif
}

}  // namespace tandem
