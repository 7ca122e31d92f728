#pragma once
// The byte pipe under KV transfer: framed messages over a connection between a decode engine (it
// always connects) and a prefill engine (it listens). The transfer protocol (kv_transfer.h) only
// sees this interface, so a UCX or shared-memory transport can replace TCP without touching it.
//
// Calls block the calling thread; every send and receive is bounded by the transport's I/O
// timeout and throws tandem::Error on timeout, a closed peer or a malformed frame.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "util/shared_memory.h"

namespace tandem::engine {

enum class KvFrameType : uint32_t {
  kPull = 1,      // decode -> prefill: read a held transfer (vLLM-style, JSON)
  kRegister = 2,  // decode -> prefill: wait for a bootstrap room's KV (SGLang-style, JSON)
  kAccept = 3,    // prefill -> decode: request valid, layers follow (JSON)
  kLayer = 4,     // prefill -> decode: one layer of the requested tokens (binary)
  kDone = 5,      // prefill -> decode: all layers sent (JSON)
  kError = 6,     // either way: the transfer failed (JSON {"message"})
  kAuth = 7,      // either way, before the request: the shared-secret handshake (JSON)
  kProgress = 8,  // prefill -> decode, before a room's kAccept: its prompt is still being
                  // computed (JSON {"computed_tokens"}); one with a count that grew (within the
                  // prompt) restarts the decode side's timeout, others do not; a pull gets none
  kAbandon = 9,   // decode -> prefill, instead of kRegister: the room's decode leg ended before it
                  // registered (JSON {"room", "prompt_hash", "prompt_tokens", "reason"}); kDone
};

inline const char* kv_frame_type_name(KvFrameType t) {
  switch (t) {
    case KvFrameType::kPull:
      return "pull";
    case KvFrameType::kRegister:
      return "register";
    case KvFrameType::kAccept:
      return "accept";
    case KvFrameType::kLayer:
      return "layer";
    case KvFrameType::kDone:
      return "done";
    case KvFrameType::kError:
      return "error";
    case KvFrameType::kAuth:
      return "auth";
    case KvFrameType::kProgress:
      return "progress";
    case KvFrameType::kAbandon:
      return "abandon";
  }
  return "unknown";
}

struct KvFrame {
  KvFrameType type = KvFrameType::kError;
  std::vector<std::byte> payload;
};

// The first piece of a frame that KvConnection::receive reads (see there).
inline constexpr size_t kKvReceivePiece = 64 << 10;

class KvConnection {
 public:
  virtual ~KvConnection() = default;
  // Sends one frame whose payload is the concatenation of `parts` (gathered, not copied). Parts
  // that lie in the listener's send_memory may still be read by the peer after this returns:
  // they must stay unchanged until the next frame without such parts was sent (the transport
  // waits for the peer's copies there) or the connection is gone (the peer then fails before
  // that next frame, so a protocol that ends with one never uses what it read).
  virtual void send(KvFrameType type, std::span<const std::span<const std::byte>> parts) = 0;
  // A frame in two calls, so that its payload can land where it belongs (KV straight into cache
  // blocks): the header first (its type; `size` gets the payload's bytes, over `max_payload` is
  // an error: a hostile or corrupt peer), then exactly that many bytes scattered over `parts`,
  // in one call or in several that take them in order.
  virtual KvFrameType receive_header(uint64_t& size, size_t max_payload) = 0;
  virtual void receive_payload(std::span<const std::span<std::byte>> parts) = 0;

  // The next frame whole. `payload` is reused: a caller receiving many frames keeps one buffer.
  KvFrameType receive(std::vector<std::byte>& payload, size_t max_payload) {
    uint64_t size = 0;
    const KvFrameType type = receive_header(size, max_payload);
    receive_payload_as_it_arrives(payload, size);
    return type;
  }
  // The payload of `size` bytes that a header announced, into `payload`, which grows as the bytes
  // arrive, in pieces (the first kKvReceivePiece, then as many as arrived so far), not to the size
  // the header states: a peer that states a large frame and sends nothing costs this side
  // nothing, and one that sends costs at most twice what it sent. Each piece is one
  // receive_payload call, bounded by the timeout of its own (and the deadline).
  void receive_payload_as_it_arrives(std::vector<std::byte>& payload, uint64_t size) {
    payload.clear();
    while (payload.size() < size) {
      const size_t had = payload.size();
      const size_t piece =
          static_cast<size_t>(std::min<uint64_t>(size - had, std::max(kKvReceivePiece, had)));
      payload.resize(had + piece);
      const std::span<std::byte> part(payload.data() + had, piece);
      receive_payload(std::span(&part, 1));
    }
  }
  KvFrame receive(size_t max_payload) {
    KvFrame f;
    f.type = receive(f.payload, max_payload);
    return f;
  }
  // The bound on each later send and receive (the transport's I/O timeout until then); the
  // calling thread's, like the calls it bounds.
  virtual void set_timeout(std::chrono::milliseconds timeout) = 0;
  // A bound on all later sends and receives together, on top of the timeout that bounds each:
  // none waits past `deadline` (time_point::max(): none, as at the start). The calling thread's,
  // like set_timeout. A protocol step of several calls (a handshake, a frame's header and
  // payload) is then bounded as a whole, not once per call.
  virtual void set_deadline(std::chrono::steady_clock::time_point deadline) = 0;
  // Thread-safe: makes blocked and later send/receive calls fail promptly.
  virtual void shutdown() = 0;
  // Without waiting: true once the peer closed the connection (or its process ended), as far as
  // this side can tell with nothing left to read. A side waiting for its peer's next frame learns
  // it from that receive; one that only sends (a prefill engine serving a registered room) asks
  // here, since a send may still succeed into a socket buffer or a ring nobody reads.
  virtual bool peer_gone() = 0;
  virtual std::string peer() const = 0;
  // What carries the bytes: "tcp" or "shm".
  virtual const char* kind() const = 0;
  // Payload bytes of frames sent so far that the peer copied straight from this side's memory
  // (the listener's send_memory; shared memory only).
  virtual uint64_t bytes_sent_in_place() const { return 0; }
};

// When one send or receive that starts at `now` must end: its timeout from now, or the deadline
// of the step it is part of when that comes first (set_timeout and set_deadline above). One rule
// for every transport.
inline std::chrono::steady_clock::time_point kv_call_deadline(
    std::chrono::steady_clock::time_point now, std::chrono::milliseconds timeout,
    std::chrono::steady_clock::time_point deadline) {
  return std::min(deadline, now + timeout);
}

class KvListener {
 public:
  virtual ~KvListener() = default;
  // The next incoming connection; nullptr once close() was called.
  virtual std::unique_ptr<KvConnection> accept() = 0;
  virtual uint16_t port() const = 0;
  virtual void close() = 0;  // thread-safe; unblocks accept()
};

class KvTransport {
 public:
  virtual ~KvTransport() = default;
  virtual std::string name() const = 0;
  // Port 0 picks a free port (see KvListener::port()). `send_memory`: the shared segment the
  // frames its connections send are mostly gathered from (the prefill engine's KV cache); a
  // transport that can (shared memory, to a peer of the same user, after the peer's request)
  // lets the peer copy those parts straight from it instead of through the wire.
  virtual std::unique_ptr<KvListener> listen(const std::string& host, uint16_t port,
                                             SharedView send_memory = {}) = 0;
  // Asked every few tens of milliseconds while connecting (and during a transport's own
  // handshake): true abandons the attempt with an error, so a cancelled transfer or an engine
  // shutting down does not wait out the I/O timeout for a peer that does not answer.
  using GiveUp = std::function<bool()>;
  virtual std::unique_ptr<KvConnection> connect(const std::string& host, uint16_t port,
                                                const GiveUp& give_up) = 0;
  std::unique_ptr<KvConnection> connect(const std::string& host, uint16_t port) {
    return connect(host, port, {});
  }
  // Lets go of what the transport keeps for peers whose process has ended (shared memory: their
  // mapped segments, which keep that memory alive). Thread-safe and cheap; KV transfer calls it
  // about once a second.
  virtual void forget_exited_peers() {}
};

struct TcpTransportOptions {
  std::chrono::milliseconds io_timeout{30000};  // connect, and each send or receive
  // Shared memory only: the user whose processes this one shares memory with (a listener or a
  // peer of any other user is refused); -1 is this process's effective user. Tests pose as
  // another user with it.
  int64_t shm_user = -1;
};

// Shared memory between engines on one host, TCP for the others. The listener takes TCP as
// make_tcp_transport does and also a Unix socket in the abstract namespace named after its
// address; connect() to an address of this host tries that socket first: the connecting side
// creates a memfd with one ring per direction and passes it over the socket, which then only
// tells each side that its peer is still there. Frames are the TCP ones, copied into the ring
// by the sender and out of it (scattered into cache blocks) by the receiver; waits sleep on
// futexes in the segment. Nothing outlives the two processes (the segment is a memfd).
//
// Large frames whose parts lie in the listener's send_memory take one copy instead of two: the
// listener passes that segment's descriptor over the socket (to a peer of its own user, with the
// first such frame, which the KV protocol sends only after the peer's request was accepted) and
// puts only the parts' offsets in the ring; the receiver copies them from its read-only mapping
// straight into its targets (streaming stores) and acknowledges; the sender's next frame
// that is not in place (the KV protocol's done frame) waits for that. The receiver keeps each
// peer's mapping across connections (its pages stay mapped) until that peer process exits.
std::unique_ptr<KvTransport> make_shm_transport(const TcpTransportOptions& options = {});

// TCP on the project's own sockets (net/socket.h, poll() for the timeouts); frames are [u32
// type][u32 zero][u64 payload bytes] little-endian + payload.
std::unique_ptr<KvTransport> make_tcp_transport(const TcpTransportOptions& options = {});

// KvConnection::peer_gone for a stream socket: the peer's end of stream (its FIN) or an error is
// there at once; a peer still there has either nothing for us (EAGAIN) or a frame not read yet.
bool socket_peer_gone(int fd);

}  // namespace tandem::engine
