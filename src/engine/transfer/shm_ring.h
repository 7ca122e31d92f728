#pragma once
// The shared-memory transport's segment and socket: what both engines on one host agree on (and
// what a test posing as a peer writes). The connecting side creates the segment, passes its
// descriptor over the listener's abstract Unix socket, and both map it:
//   [RingHead to-server][RingHead to-client][to-server bytes][to-client bytes]
// Each ring's counters count bytes ever written and read; the reader's `written - read` never
// exceeds the ring's bytes unless the peer is corrupt or hostile, which the reader checks.
#include <sys/un.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace tandem::engine::shm {

// Bytes of the ring each way: KV flows prefill -> decode (the server's), requests the other way.
// Small enough to stay in cache and to cost few page faults on a new connection's segment.
inline constexpr size_t kToServerBytes = 1 << 20;
inline constexpr size_t kToClientBytes = 2 << 20;

// Hello without / with the offer to copy large frames from the sender's segment; the segment's
// descriptor comes with a kSegment byte.
inline constexpr char kHello = 'S', kHelloInPlace = 'P', kWelcome = 'A', kSegment = 'M';

struct alignas(64) RingHead {
  std::atomic<uint64_t> written{0};           // bytes ever written (the producer's)
  alignas(64) std::atomic<uint64_t> read{0};  // bytes ever read (the consumer's)
  alignas(64) std::atomic<uint32_t> data{0};  // futex words: bumped after writing / reading
  std::atomic<uint32_t> space{0};
  // Sides asleep on `data` / `space`: a wake-up (a system call) only when someone sleeps.
  std::atomic<uint32_t> data_sleepers{0}, space_sleepers{0};
  // In-place frames the consumer has finished copying (futex word), and the producer asleep on it.
  alignas(64) std::atomic<uint32_t> copied{0};
  std::atomic<uint32_t> copied_sleepers{0};
};

inline constexpr size_t kToServerHead = 0, kToClientHead = sizeof(RingHead);
inline constexpr size_t kToServerData = 2 * sizeof(RingHead);
inline constexpr size_t kToClientData = kToServerData + kToServerBytes;
inline constexpr size_t kSegmentBytes = kToClientData + kToClientBytes;

// The abstract Unix socket a listener on host:port also accepts on.
inline sockaddr_un socket_address(const std::string& host, uint16_t port, socklen_t& length) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const std::string name = "tandem-kv-" + host + "-" + std::to_string(port);
  const size_t n = std::min(name.size(), sizeof(a.sun_path) - 2);
  std::memcpy(a.sun_path + 1, name.data(), n);  // sun_path[0] = 0: the abstract namespace
  length = socklen_t(offsetof(sockaddr_un, sun_path) + 1 + n);
  return a;
}

}  // namespace tandem::engine::shm
