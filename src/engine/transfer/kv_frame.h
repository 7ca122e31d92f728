#pragma once
// The 16-byte header every KV transport puts before a frame's payload: [u32 type][u32 zero]
// [u64 payload bytes], little-endian. One definition for TCP and shared memory.
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "engine/transfer/kv_transport.h"
#include "util/error.h"
#include "util/little_endian.h"

namespace tandem::engine {

inline constexpr size_t kKvFrameHeaderBytes = 16;

inline std::array<std::byte, kKvFrameHeaderBytes> kv_frame_header(KvFrameType type,
                                                                  uint64_t payload) {
  std::array<std::byte, kKvFrameHeaderBytes> h{};
  put_le(h.data(), static_cast<uint32_t>(type), 4);
  put_le(h.data() + 8, payload, 8);
  return h;
}

// The frame type and payload size of a header from `peer`; throws tandem::Error when the bytes
// are not a Tandem frame header or the payload exceeds `max_payload`.
inline KvFrameType parse_kv_frame_header(const std::byte* h, uint64_t& size, size_t max_payload,
                                         const std::string& peer) {
  const uint64_t type = get_le(h, 4);
  size = get_le(h + 8, 8);
  if (type < 1 || type > static_cast<uint64_t>(KvFrameType::kAbandon) || get_le(h + 4, 4) != 0)
    throw Error("KV transfer from " + peer + ": not a Tandem KV frame (type " +
                std::to_string(type) + ")");
  if (size > max_payload)
    throw Error("KV transfer from " + peer + ": frame of " + std::to_string(size) +
                " bytes exceeds the limit of " + std::to_string(max_payload));
  return static_cast<KvFrameType>(type);
}

// The milliseconds a call bounded by `deadline` could wait from `start`: what a timeout error
// says it waited (its timeout, or less when KvConnection::set_deadline cut it short).
inline int64_t kv_wait_ms(std::chrono::steady_clock::time_point start,
                          std::chrono::steady_clock::time_point deadline) {
  if (deadline <= start) return 0;
  return std::chrono::duration_cast<std::chrono::milliseconds>(deadline - start).count();
}

}  // namespace tandem::engine
