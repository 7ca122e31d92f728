#pragma once
// How the shared-memory transport describes a frame whose payload the receiver copies straight
// from the sender's segment: the payload in order as pieces, each either at an offset of that
// segment or inline (its bytes follow the description in the ring). Kept apart from the
// transport so that the checks a receiver makes on a peer's description are tested alone.
#include <cstdint>
#include <span>
#include <string>

namespace tandem::engine {

struct ShmPiece {
  static constexpr uint64_t kInline = ~uint64_t(0);
  uint64_t offset = kInline;  // in the sender's segment, or kInline
  uint64_t length = 0;
};

// The most pieces one frame may have (a layer of a 1M-token prompt in blocks of 16 tokens).
inline constexpr uint64_t kMaxShmPieces = uint64_t(1) << 16;

// Empty when `pieces` describe exactly `frame_bytes` of payload, every segment piece inside the
// `segment_bytes` the receiver mapped; else what is wrong (a corrupt or hostile peer).
std::string check_shm_pieces(std::span<const ShmPiece> pieces, uint64_t frame_bytes,
                             uint64_t segment_bytes);

}  // namespace tandem::engine
