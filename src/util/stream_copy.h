#pragma once
// A copy for large amounts of memory the copying thread will not read again soon (a prompt's
// KV arriving in a decode engine's cache): non-temporal stores write whole cache lines without
// first reading each destination line into the cache, one memory read fewer per line; here that
// copies KV blocks ~1.4x as fast as memcpy. Ordered before later stores of the calling thread
// (an acknowledgement another process waits for) by a store fence at the end.
#include <cstddef>

namespace tandem {

void stream_copy(void* to, const void* from, size_t bytes);

}  // namespace tandem
