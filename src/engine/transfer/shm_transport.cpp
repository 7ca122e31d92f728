// KvTransport over shared memory on one host (see make_shm_transport in kv_transport.h).
#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "engine/transfer/kv_frame.h"
#include "engine/transfer/kv_transport.h"
#include "engine/transfer/shm_peer_segments.h"
#include "engine/transfer/shm_pieces.h"
#include "engine/transfer/shm_ring.h"
#include "util/error.h"
#include "util/little_endian.h"
#include "util/shared_memory.h"
#include "util/split_copier.h"

namespace tandem::engine {
namespace {

using Clock = std::chrono::steady_clock;

using namespace shm;  // the segment's layout and the socket's name (shm_ring.h)

// A sender publishes what it wrote every this many bytes (and at the end of a frame), so the
// receiver copies while it writes without a wake-up per block.
constexpr size_t kChunk = 128 << 10;
// Frames from this size on go in place when they can; parts outside the segment (a layer's
// header) travel inline, up to this many bytes.
constexpr size_t kInPlaceMin = 4 << 10, kInlineMax = 64 << 10;
// The second word of an in-place frame's header (zero in every other frame).
constexpr uint32_t kInPlaceFlag = 1;
// Copies from this size on are split with a second thread.
constexpr size_t kSplitMin = 4 << 20;
// How often a wait outside the ring (connecting, the handshake) asks whether to give up.
constexpr auto kGiveUpPoll = std::chrono::milliseconds(50);
// A listener waits this long at most for an accepted peer's hello (a decode engine sends it right
// after connecting), for this many peers at once; past that, the one waiting longest is dropped.
constexpr auto kHelloWait = std::chrono::milliseconds(1000);
constexpr size_t kMaxPendingHellos = 64;

// The user whose processes may share memory with this one (TcpTransportOptions::shm_user).
uid_t shm_user_of(const TcpTransportOptions& options) {
  return options.shm_user >= 0 ? uid_t(options.shm_user) : ::geteuid();
}

bool is_this_host(const std::string& host) {
  if (host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0) return true;
  bool found = false;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return false;
  for (ifaddrs* a = list; a && !found; a = a->ifa_next) {
    if (!a->ifa_addr) continue;
    char buf[INET6_ADDRSTRLEN] = {};
    if (a->ifa_addr->sa_family == AF_INET)
      inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr, buf,
                sizeof buf);
    else if (a->ifa_addr->sa_family == AF_INET6)
      inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(a->ifa_addr)->sin6_addr, buf,
                sizeof buf);
    found = host == buf;
  }
  freeifaddrs(list);
  return found;
}

enum class Received { kByte, kNotYet, kFailed };

// One byte (and maybe a descriptor) on a Unix socket if it is there now, without waiting.
Received receive_byte_now(int fd, char& byte, int* passed_fd) {
  if (passed_fd) *passed_fd = -1;
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = control;
  m.msg_controllen = sizeof control;
  const ssize_t n = ::recvmsg(fd, &m, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK))
    return Received::kNotYet;
  // Every descriptor that came is ours to close: the one asked for goes to the caller, any
  // other (a peer sending what was not asked for) is closed here rather than leaked.
  int got = -1;
  for (cmsghdr* c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
      for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); ++i) {
        int fd = -1;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        if (got < 0 && passed_fd)
          got = fd;
        else
          ::close(fd);
      }
  if (n != 1) {
    if (got >= 0) ::close(got);
    return Received::kFailed;
  }
  if (passed_fd) *passed_fd = got;
  return Received::kByte;
}

// Waits for one byte (and maybe a descriptor) on a Unix socket until `deadline`, or until
// `give_up` (asked every kGiveUpPoll) says to stop.
bool receive_byte(int fd, char& byte, int* passed_fd, Clock::time_point deadline,
                  const KvTransport::GiveUp& give_up = {}) {
  if (passed_fd) *passed_fd = -1;
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0 || (give_up && give_up())) return false;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, int(std::min<int64_t>(left, kGiveUpPoll.count()))) <= 0) continue;
    switch (receive_byte_now(fd, byte, passed_fd)) {
      case Received::kByte:
        return true;
      case Received::kFailed:
        return false;
      case Received::kNotYet:
        break;
    }
  }
}

bool send_byte(int fd, char byte, int passed_fd) {
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  if (passed_fd >= 0) {
    m.msg_control = control;
    m.msg_controllen = sizeof control;
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &passed_fd, sizeof(int));
  }
  return ::sendmsg(fd, &m, MSG_NOSIGNAL) == 1;
}

// A descriptor closed with its last owner.
struct OwnedFd {
  int fd = -1;
  explicit OwnedFd(int f) : fd(f) {}
  OwnedFd(const OwnedFd&) = delete;
  OwnedFd& operator=(const OwnedFd&) = delete;
  ~OwnedFd() {
    if (fd >= 0) ::close(fd);
  }
};

// A read-only descriptor of the segment behind `memory` (a peer given it cannot map it writable),
// with the mapping's view; empty where there is none (no /proc: no in-place frames).
struct SendMemory {
  SharedView view;
  std::shared_ptr<const OwnedFd> read_only;
  explicit operator bool() const { return read_only != nullptr; }
  static SendMemory of(SharedView memory) {
    if (!memory) return {};
    const std::string path = "/proc/self/fd/" + std::to_string(memory.fd);
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return {};
    return {memory, std::make_shared<const OwnedFd>(fd)};
  }
};

// What a connection needs for in-place frames: as a sender, the segment its peer may read
// (empty: not allowed); as a receiver, where its peers' mappings live.
struct InPlace {
  SendMemory send_memory;
  std::shared_ptr<PeerSegments> peers;  // null: this side did not offer to read in place
  std::shared_ptr<SplitCopier> copier;
  pid_t peer_pid = 0;
};

class ShmConnection : public KvConnection {
 public:
  // `client`: the connecting side, which writes the to-server ring.
  ShmConnection(int socket, SharedSegment segment, bool client, std::chrono::milliseconds timeout,
                std::string peer, InPlace in_place)
      : socket_(socket),
        segment_(std::move(segment)),
        timeout_(timeout),
        peer_(std::move(peer)),
        in_place_(std::move(in_place)) {
    auto* base = segment_.data();
    auto* to_server = reinterpret_cast<RingHead*>(base + kToServerHead);
    auto* to_client = reinterpret_cast<RingHead*>(base + kToClientHead);
    std::byte* server_bytes = base + kToServerData;
    std::byte* client_bytes = base + kToClientData;
    out_ = client ? Ring{to_server, server_bytes, kToServerBytes}
                  : Ring{to_client, client_bytes, kToClientBytes};
    in_ = client ? Ring{to_client, client_bytes, kToClientBytes}
                 : Ring{to_server, server_bytes, kToServerBytes};
  }
  ~ShmConnection() override { ::close(socket_); }

  void send(KvFrameType type, std::span<const std::span<const std::byte>> parts) override {
    uint64_t total = 0;
    for (auto p : parts) total += p.size();
    const auto deadline = start("sending");
    // The ring takes a frame whether or not anyone will read it: without this, a frame that fits
    // "succeeds" after the peer left (a prefill engine would count a transfer to a cancelled
    // decode leg as sent). The socket tells, at the cost of one system call per frame. The
    // connection is not broken by it: nothing was written, and what the peer said before it left
    // (why it refused us) can still be read.
    if (peer_gone())
      throw Error("KV transfer with " + peer_ + ": " + what_ +
                  " failed: connection closed by peer");
    if (in_place_.send_memory && total >= kInPlaceMin &&
        send_in_place(type, parts, total, deadline))
      return;
    await_copies(deadline);
    const auto header = kv_frame_header(type, total);
    write(header.data(), header.size(), deadline);
    for (auto p : parts) write(p.data(), p.size(), deadline);
    publish();
  }

  KvFrameType receive_header(uint64_t& size, size_t max_payload) override {
    std::array<std::byte, kKvFrameHeaderBytes> header{};
    read(header.data(), header.size(), start("receiving"));
    in_place_frame_ = in_place_.peers && get_le(header.data() + 4, 4) == kInPlaceFlag;
    if (in_place_frame_) put_le(header.data() + 4, 0, 4);
    const KvFrameType type = parse_kv_frame_header(header.data(), size, max_payload, peer_);
    frame_bytes_ = frame_left_ = size;
    described_ = false;
    return type;
  }

  void receive_payload(std::span<const std::span<std::byte>> parts) override {
    const auto deadline = start("receiving");
    if (in_place_frame_) return receive_in_place(parts, deadline);
    for (auto p : parts) read(p.data(), p.size(), deadline);
  }

  uint64_t bytes_sent_in_place() const override { return bytes_in_place_; }

  // The socket carries no frames once connected (only the sender's segment, towards the
  // client): it ends when the peer closes the connection or its process ends.
  bool peer_gone() override { return socket_peer_gone(socket_); }

  void shutdown() override {
    stopped_ = true;
    ::shutdown(socket_, SHUT_RDWR);  // the peer sees it, and our own waits below check the flag
    wake_all(in_.head->data);
    wake_all(out_.head->space);
    wake_all(out_.head->data);
    wake_all(in_.head->space);
    wake_all(out_.head->copied);
  }

  void set_timeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }
  void set_deadline(Clock::time_point deadline) override { deadline_ = deadline; }
  std::string peer() const override { return peer_; }
  const char* kind() const override { return "shm"; }

 private:
  struct Ring {
    RingHead* head = nullptr;
    std::byte* bytes = nullptr;
    size_t capacity = 0;
  };

  Clock::time_point start(const char* what) {
    what_ = what;
    if (stopped_ || broken_) throw Error("KV transfer with " + peer_ + ": connection shut down");
    const auto now = Clock::now();
    const auto deadline = kv_call_deadline(now, timeout_, deadline_);
    wait_ms_ = kv_wait_ms(now, deadline);
    // wait() sees the deadline only when the ring is empty (or full): a peer that keeps it
    // otherwise would hold a step of many calls past it.
    if (now >= deadline_) timed_out();
    return deadline;
  }

  [[noreturn]] void timed_out() {
    fail(std::string("timed out ") + what_ + " after " + std::to_string(wait_ms_) + " ms");
  }

  [[noreturn]] void fail(const std::string& why) {
    broken_ = true;
    throw Error("KV transfer with " + peer_ + ": " + why);
  }

  // Blocks while `word` == seen: a short spin, then futex sleeps; every sleep checks our own
  // shutdown, the peer's socket (closed when its process ends) and the deadline.
  void wait(std::atomic<uint32_t>& word, std::atomic<uint32_t>& sleepers, uint32_t seen,
            Clock::time_point deadline) {
    for (int i = 0; i < 2000; ++i) {
      if (word.load(std::memory_order_acquire) != seen) return;
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
    while (word.load(std::memory_order_acquire) == seen) {
      if (stopped_) fail("connection shut down");
      if (peer_gone()) {
        // A sender publishes its last frame and then closes: when that happened between the
        // check above and the peek, the frame is in the ring and must still be read.
        if (word.load(std::memory_order_acquire) != seen) return;
        fail(std::string(what_) + " failed: connection closed by peer");
      }
      if (Clock::now() >= deadline) timed_out();
      sleepers.fetch_add(1, std::memory_order_seq_cst);
      if (word.load(std::memory_order_seq_cst) == seen) wait_while_equal(word, seen, 20);
      sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  // Bumps `word` and wakes the other side if it sleeps on it.
  static void signal(std::atomic<uint32_t>& word, std::atomic<uint32_t>& sleepers) {
    word.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_seq_cst) > 0) wake_all(word);
  }

  // Makes what write() copied visible to the reader.
  void publish() {
    if (unpublished_ == 0) return;
    RingHead& h = *out_.head;
    h.written.store(h.written.load(std::memory_order_relaxed) + unpublished_,
                    std::memory_order_release);
    unpublished_ = 0;
    signal(h.data, h.data_sleepers);
  }

  void write(const std::byte* p, size_t n, Clock::time_point deadline) {
    RingHead& h = *out_.head;
    while (n > 0) {
      const uint32_t seen = h.space.load(std::memory_order_acquire);
      const uint64_t written = h.written.load(std::memory_order_relaxed) + unpublished_;
      const uint64_t unread = written - h.read.load(std::memory_order_acquire);
      if (unread > out_.capacity)
        fail("corrupt shared-memory ring: the peer claims to have read past what was written");
      const uint64_t free = out_.capacity - unread;
      if (free == 0) {
        publish();
        wait(h.space, h.space_sleepers, seen, deadline);
        continue;
      }
      const size_t take = std::min({n, size_t(free), kChunk - unpublished_});
      const size_t at = size_t(written % out_.capacity);
      const size_t first = std::min(take, out_.capacity - at);
      std::memcpy(out_.bytes + at, p, first);
      std::memcpy(out_.bytes, p + first, take - first);
      unpublished_ += take;
      if (unpublished_ >= kChunk) publish();
      p += take;
      n -= take;
    }
  }

  void read(std::byte* p, size_t n, Clock::time_point deadline) {
    RingHead& h = *in_.head;
    while (n > 0) {
      const uint32_t seen = h.data.load(std::memory_order_acquire);
      const uint64_t read = h.read.load(std::memory_order_relaxed);
      const uint64_t ready = h.written.load(std::memory_order_acquire) - read;
      if (ready == 0) {
        wait(h.data, h.data_sleepers, seen, deadline);
        continue;
      }
      // The counters live in memory the peer writes: a hostile or corrupt one could claim more
      // than the ring holds, and the copy below would read past it.
      if (ready > in_.capacity)
        fail("corrupt shared-memory ring: the peer claims " + std::to_string(ready) +
             " bytes ready in a ring of " + std::to_string(in_.capacity));
      const size_t take = std::min(n, size_t(ready));
      const size_t at = size_t(read % in_.capacity);
      const size_t first = std::min(take, in_.capacity - at);
      std::memcpy(p, in_.bytes + at, first);
      std::memcpy(p + first, in_.bytes, take - first);
      h.read.store(read + take, std::memory_order_release);
      signal(h.space, h.space_sleepers);
      p += take;
      n -= take;
    }
  }

  // The frame as a description of its parts (kv_frame_header with kInPlaceFlag, the piece count,
  // the pieces, the inline parts' bytes). The receiver copies the segment's parts later: the
  // next frame that is not in place waits for that (await_copies). False (nothing sent) when the
  // parts outside the segment are too many bytes for this.
  bool send_in_place(KvFrameType type, std::span<const std::span<const std::byte>> parts,
                     uint64_t total, Clock::time_point deadline) {
    const SharedView& memory = in_place_.send_memory.view;
    std::vector<ShmPiece> pieces;
    size_t inline_bytes = 0;
    for (auto p : parts) {
      if (p.empty()) continue;
      if (!memory.contains(p.data(), p.size())) {
        inline_bytes += p.size();
        if (inline_bytes > kInlineMax) return false;
        pieces.push_back({ShmPiece::kInline, p.size()});
        continue;
      }
      const auto offset = uint64_t(p.data() - memory.data);
      if (!pieces.empty() && pieces.back().offset != ShmPiece::kInline &&
          pieces.back().offset + pieces.back().length == offset)
        pieces.back().length += p.size();  // neighbouring blocks: one piece
      else
        pieces.push_back({offset, p.size()});
    }
    if (pieces.size() > kMaxShmPieces) return false;
    if (!segment_sent_) {
      if (!send_byte(socket_, kSegment, in_place_.send_memory.read_only->fd))
        fail(std::string(what_) + " failed: connection closed by peer");
      segment_sent_ = true;
    }
    auto header = kv_frame_header(type, total);
    put_le(header.data() + 4, kInPlaceFlag, 4);
    write(header.data(), header.size(), deadline);
    std::byte word[16];
    put_le(word, pieces.size(), 8);
    write(word, 8, deadline);
    for (const ShmPiece& piece : pieces) {
      put_le(word, piece.offset, 8);
      put_le(word + 8, piece.length, 8);
      write(word, 16, deadline);
    }
    for (auto p : parts)
      if (!p.empty() && !memory.contains(p.data(), p.size())) write(p.data(), p.size(), deadline);
    ++frames_in_place_;
    publish();
    bytes_in_place_ += total - inline_bytes;
    return true;
  }

  // Until the receiver has copied every in-place frame sent so far.
  void await_copies(Clock::time_point deadline) {
    RingHead& h = *out_.head;
    for (uint32_t seen; (seen = h.copied.load(std::memory_order_acquire)) != frames_in_place_;)
      wait(h.copied, h.copied_sleepers, seen, deadline);
  }

  // The next bytes of an in-place frame (see send_in_place), scattered over `parts`: the first
  // call reads the frame's description, each copies as much of the frame as `parts` hold, and
  // the one that completes it tells the sender (a frame may be taken in several calls, as
  // KvConnection::receive takes a large one).
  void receive_in_place(std::span<const std::span<std::byte>> parts, Clock::time_point deadline) {
    uint64_t capacity = 0;
    for (auto p : parts) capacity += p.size();
    if (capacity > frame_left_)
      fail("receiving " + std::to_string(capacity) + " bytes of a frame of " +
           std::to_string(frame_bytes_) + " with " + std::to_string(frame_left_) + " left");
    if (!described_) describe_in_place_frame(deadline);
    std::vector<CopyRange> copies;
    for (auto p : parts) {
      for (size_t at = 0; at < p.size();) {
        const ShmPiece& piece = pieces_[piece_];
        const size_t n = size_t(std::min<uint64_t>(piece.length - piece_done_, p.size() - at));
        std::byte* to = p.data() + at;
        if (piece.offset == ShmPiece::kInline)
          read(to, n, deadline);
        else
          copies.push_back({to, peer_segment_->data() + piece.offset + piece_done_, n});
        at += n;
        piece_done_ += n;
        if (piece_done_ == piece.length) ++piece_, piece_done_ = 0;
      }
    }
    in_place_.copier->run(std::move(copies));
    frame_left_ -= capacity;
    if (frame_left_ > 0) return;
    in_place_frame_ = false;
    signal(in_.head->copied, in_.head->copied_sleepers);
  }

  // An in-place frame's description (the piece count and the pieces) into pieces_, checked
  // against the frame and the sender's segment, which comes over the socket with the first such
  // frame of a connection.
  void describe_in_place_frame(Clock::time_point deadline) {
    std::byte word[16];
    read(word, 8, deadline);
    const uint64_t count = get_le(word, 8);
    if (count > kMaxShmPieces)
      fail("in-place frame of " + std::to_string(count) + " pieces (at most " +
           std::to_string(kMaxShmPieces) + ")");
    std::vector<ShmPiece> pieces(count);
    for (ShmPiece& piece : pieces) {
      read(word, 16, deadline);
      piece = {get_le(word, 8), get_le(word + 8, 8)};
    }
    if (!peer_segment_) {
      char byte = 0;
      int fd = -1;
      if (!receive_byte(socket_, byte, &fd, deadline) || byte != kSegment || fd < 0) {
        if (fd >= 0) ::close(fd);
        fail("an in-place frame came without the sender's segment");
      }
      try {
        peer_segment_ = in_place_.peers->get(fd, in_place_.peer_pid);
      } catch (const Error& e) {
        fail(std::string("the sender's segment: ") + e.what());
      }
    }
    if (const std::string why = check_shm_pieces(pieces, frame_bytes_, peer_segment_->size());
        !why.empty())
      fail("in-place frame: " + why);
    // Empty pieces take no bytes: without them, each piece left gives the next byte.
    std::erase_if(pieces, [](const ShmPiece& p) { return p.length == 0; });
    pieces_ = std::move(pieces);
    piece_ = 0;
    piece_done_ = 0;
    described_ = true;
  }

  const int socket_;
  SharedSegment segment_;
  std::chrono::milliseconds timeout_;
  Clock::time_point deadline_ = Clock::time_point::max();
  const std::string peer_;
  Ring out_, in_;
  const char* what_ = "";
  int64_t wait_ms_ = 0;     // the bound of the call under way (its timeout error says it)
  size_t unpublished_ = 0;  // bytes written to the ring, not yet visible to the reader
  std::atomic<bool> stopped_{false};
  bool broken_ = false;
  const InPlace in_place_;
  bool segment_sent_ = false;                          // sender: the descriptor went over
  uint32_t frames_in_place_ = 0;                       // sender: in-place frames so far
  std::atomic<uint64_t> bytes_in_place_{0};            // sender: their bytes, inline ones not
  std::shared_ptr<const SharedSegment> peer_segment_;  // receiver: the sender's, once it came
  bool in_place_frame_ = false;                        // receiver: the frame being received is
  uint64_t frame_bytes_ = 0;                           // receiver: its payload bytes
  uint64_t frame_left_ = 0;                            // receiver: of them, not received yet
  bool described_ = false;        // receiver: the in-place frame's description was read
  std::vector<ShmPiece> pieces_;  // into these
  size_t piece_ = 0;              // of them, the one the next byte comes from
  uint64_t piece_done_ = 0;       // and its bytes received so far
};

// Whose process is at the other end of a Unix socket.
ucred peer_credentials(int fd) {
  ucred c{};
  socklen_t length = sizeof c;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &c, &length) != 0) c.pid = 0, c.uid = uid_t(-1);
  return c;
}

// Accepts on the TCP listener and on the Unix socket, each in a thread of its own; accept()
// hands out whichever connection comes first.
class ShmListener : public KvListener {
 public:
  ShmListener(std::unique_ptr<KvListener> tcp, const std::string& host,
              const TcpTransportOptions& options, SharedView send_memory)
      : tcp_(std::move(tcp)),
        timeout_(options.io_timeout),
        user_(shm_user_of(options)),
        send_memory_(SendMemory::of(send_memory)) {
    unix_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    socklen_t length = 0;
    const sockaddr_un a = socket_address(host, tcp_->port(), length);
    if (unix_fd_ >= 0 && (::bind(unix_fd_, reinterpret_cast<const sockaddr*>(&a), length) != 0 ||
                          ::listen(unix_fd_, SOMAXCONN) != 0)) {
      // Abstract names vanish with their process, and the TCP port is ours: another process
      // holds the name on purpose. Engines of this user do not connect to it (they check the
      // listener's user, and leave a name that refuses connections for TCP), but the operator
      // should know why transfers here use TCP.
      std::fprintf(stderr,
                   "tandem engine: warning: another process holds the shared-memory KV socket "
                   "'@%s' (%s); KV transfers to this engine use TCP\n",
                   a.sun_path + 1, std::strerror(errno));
      ::close(unix_fd_);
      unix_fd_ = -1;
    }
    tcp_thread_ = std::thread([this] {
      while (auto c = tcp_->accept()) push(std::move(c));
    });
    if (unix_fd_ >= 0) unix_thread_ = std::thread([this] { accept_unix(); });
  }
  ~ShmListener() override {
    close();
    tcp_thread_.join();
    if (unix_thread_.joinable()) unix_thread_.join();
    if (unix_fd_ >= 0) ::close(unix_fd_);
  }

  std::unique_ptr<KvConnection> accept() override {
    std::unique_lock lock(mutex_);
    ready_.wait(lock, [&] { return closed_ || !queue_.empty(); });
    if (closed_) return nullptr;
    auto c = std::move(queue_.front());
    queue_.pop_front();
    return c;
  }

  uint16_t port() const override { return tcp_->port(); }

  void close() override {
    {
      std::lock_guard lock(mutex_);
      if (closed_) return;
      closed_ = true;
    }
    tcp_->close();
    if (unix_fd_ >= 0) ::shutdown(unix_fd_, SHUT_RDWR);
    ready_.notify_all();
  }

 private:
  // An accepted peer whose hello has not come yet.
  struct Pending {
    int fd;
    pid_t pid;
    Clock::time_point deadline;
  };

  void push(std::unique_ptr<KvConnection> c) {
    {
      std::lock_guard lock(mutex_);
      if (closed_) return;
      queue_.push_back(std::move(c));
    }
    ready_.notify_one();
  }

  // One thread waits for new peers and for the hellos of those accepted, all at once: a peer that
  // connects and says nothing holds up nobody (it is dropped after kHelloWait, or sooner when
  // kMaxPendingHellos others wait).
  void accept_unix() {
    std::deque<Pending> pending;  // in the order accepted: the first one's deadline is the next
    std::vector<pollfd> polls;
    for (;;) {
      {
        std::lock_guard lock(mutex_);
        if (closed_) break;
      }
      polls.assign(1, pollfd{unix_fd_, POLLIN, 0});
      for (const Pending& p : pending) polls.push_back({p.fd, POLLIN, 0});
      auto wait = std::chrono::milliseconds(200);  // how often the loop sees close()
      if (!pending.empty())
        wait = std::clamp(std::chrono::duration_cast<std::chrono::milliseconds>(
                              pending.front().deadline - Clock::now()) +
                              std::chrono::milliseconds(1),
                          std::chrono::milliseconds(0), wait);
      if (::poll(polls.data(), polls.size(), int(wait.count())) < 0 && errno != EINTR)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));  // out of memory: no spin
      const auto now = Clock::now();
      std::deque<Pending> still;
      for (size_t i = 0; i < pending.size(); ++i) {
        const Pending& p = pending[i];
        if (polls[i + 1].revents != 0 && greet(p.fd, p.pid)) continue;
        if (now >= p.deadline) {
          ::close(p.fd);  // a stranger that said nothing
          continue;
        }
        still.push_back(p);
      }
      pending.swap(still);
      if (polls[0].revents != 0) accept_new(pending);
    }
    for (const Pending& p : pending) ::close(p.fd);
  }

  // The peers waiting in the backlog (a round's worth): each is greeted at once when its hello
  // is there (a decode engine sends it right after connecting), else it waits in `pending`.
  void accept_new(std::deque<Pending>& pending) {
    for (size_t i = 0; i < kMaxPendingHellos; ++i) {
      const int fd = ::accept4(unix_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
          std::this_thread::sleep_for(std::chrono::milliseconds(10));  // out of descriptors
        return;
      }
      // Only a process of this user may share a segment with this one (it could read and write
      // this one's memory anyway). A client of another user takes TCP by itself (connect_local
      // ignores a listener of another user), so only a hostile one arrives here: it is dropped
      // before it can send a segment, which is never mapped.
      const ucred peer = peer_credentials(fd);
      if (peer.uid != user_) {
        ::close(fd);
        continue;
      }
      if (greet(fd, peer.pid)) continue;
      if (pending.size() >= kMaxPendingHellos) {
        ::close(pending.front().fd);
        pending.pop_front();
      }
      pending.push_back(
          {fd, peer.pid, Clock::now() + std::min<std::chrono::milliseconds>(timeout_, kHelloWait)});
    }
  }

  // The hello of an accepted peer, if it is there: false while it is not (the peer keeps its
  // place); else true, the peer welcomed and its connection queued, or dropped.
  bool greet(int fd, pid_t pid) {
    char hello = 0;
    int segment_fd = -1;
    const Received got = receive_byte_now(fd, hello, &segment_fd);
    if (got == Received::kNotYet) return false;
    if (got == Received::kFailed || (hello != kHello && hello != kHelloInPlace) || segment_fd < 0) {
      if (segment_fd >= 0) ::close(segment_fd);
      ::close(fd);
      return true;
    }
    std::unique_ptr<KvConnection> connection;
    try {
      SharedSegment segment = SharedSegment::attach(segment_fd);
      // The socket's buffer is empty: the welcome goes at once.
      if (segment.size() < kSegmentBytes || !send_byte(fd, kWelcome, -1))
        throw Error("bad segment");
      InPlace in_place;
      if (hello == kHelloInPlace) in_place.send_memory = send_memory_;
      // Named by process: the per-address limits of KV transfer count each peer on its own.
      connection = std::make_unique<ShmConnection>(
          fd, std::move(segment), false, timeout_,
          "shared memory (local peer, pid " + std::to_string(pid) + ")", std::move(in_place));
    } catch (const std::exception&) {
      ::close(fd);
      return true;
    }
    push(std::move(connection));
    return true;
  }

  std::unique_ptr<KvListener> tcp_;
  const std::chrono::milliseconds timeout_;
  const uid_t user_;
  const SendMemory send_memory_;
  int unix_fd_ = -1;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::unique_ptr<KvConnection>> queue_;
  bool closed_ = false;
  std::thread tcp_thread_, unix_thread_;
};

class ShmTransport : public KvTransport {
 public:
  explicit ShmTransport(const TcpTransportOptions& options)
      : options_(options), tcp_(make_tcp_transport(options)) {}
  std::string name() const override { return "shm"; }

  std::unique_ptr<KvListener> listen(const std::string& host, uint16_t port,
                                     SharedView send_memory) override {
    return std::make_unique<ShmListener>(tcp_->listen(host, port), host, options_, send_memory);
  }

  void forget_exited_peers() override { peers_->forget_exited(); }

  std::unique_ptr<KvConnection> connect(const std::string& host, uint16_t port,
                                        const GiveUp& give_up) override {
    if (is_this_host(host))
      for (const std::string& name : {host, std::string("0.0.0.0")})
        if (auto c = connect_local(name, port, give_up)) return c;
    return tcp_->connect(host, port, give_up);
  }

 private:
  // A connected Unix socket to the listener of that name, else -1 (then TCP). A name that refuses
  // connections (EAGAIN: its backlog is full) is left for TCP at once, not retried: any process
  // may hold an abstract name first and never accept (the engine then listens on TCP alone), and
  // an engine of ours that stalled is waited on over its TCP port as well, within the I/O timeout
  // and until `give_up`.
  static int connect_unix(const std::string& host, uint16_t port) {
    socklen_t length = 0;
    const sockaddr_un a = socket_address(host, port, length);
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    int r;
    do r = ::connect(fd, reinterpret_cast<const sockaddr*>(&a), length);
    while (r != 0 && errno == EINTR);
    if (r == 0) return fd;
    ::close(fd);
    return -1;
  }

  // nullptr when no local listener of this user has that name (then TCP).
  std::unique_ptr<KvConnection> connect_local(const std::string& host, uint16_t port,
                                              const GiveUp& give_up) {
    const int fd = connect_unix(host, port);
    if (fd < 0) return nullptr;
    // Abstract socket names carry no permissions: any process may hold one. The segment and the
    // KV that comes back are trusted only from a process of this user (which could read this
    // one's memory anyway); another user's listener is ignored, and TCP reaches the engine.
    if (peer_credentials(fd).uid != shm_user_of(options_)) {
      ::close(fd);
      return nullptr;
    }
    SharedSegment segment;
    try {
      segment = SharedSegment::create(kSegmentBytes, "tandem-kv");
    } catch (const Error&) {
      ::close(fd);  // no shared memory here (memfd refused): TCP still works
      return nullptr;
    }
    peers_->forget_exited();
    char welcome = 0;
    if (!send_byte(fd, kHelloInPlace, segment.fd()) ||
        !receive_byte(fd, welcome, nullptr, Clock::now() + options_.io_timeout, give_up) ||
        welcome != kWelcome) {
      ::close(fd);
      throw Error("KV transfer: the shared-memory handshake with " + host + ":" +
                  std::to_string(port) + " failed");
    }
    return std::make_unique<ShmConnection>(fd, std::move(segment), true, options_.io_timeout,
                                           "shared memory to " + host + ":" + std::to_string(port),
                                           InPlace{{}, peers_, copier_, peer_credentials(fd).pid});
  }

  TcpTransportOptions options_;
  std::unique_ptr<KvTransport> tcp_;
  const std::shared_ptr<PeerSegments> peers_ = std::make_shared<PeerSegments>();
  const std::shared_ptr<SplitCopier> copier_ = std::make_shared<SplitCopier>(kSplitMin);
};

}  // namespace

std::string check_shm_pieces(std::span<const ShmPiece> pieces, uint64_t frame_bytes,
                             uint64_t segment_bytes) {
  if (pieces.size() > kMaxShmPieces)
    return std::to_string(pieces.size()) + " pieces (at most " + std::to_string(kMaxShmPieces) +
           ")";
  uint64_t total = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const ShmPiece& p = pieces[i];
    if (p.length > frame_bytes - total)
      return "piece " + std::to_string(i) + " runs past the frame's " +
             std::to_string(frame_bytes) + " bytes";
    total += p.length;
    if (p.offset != ShmPiece::kInline &&
        (p.offset > segment_bytes || p.length > segment_bytes - p.offset))
      return "piece " + std::to_string(i) + " (" + std::to_string(p.length) + " bytes at " +
             std::to_string(p.offset) + ") lies outside the sender's segment of " +
             std::to_string(segment_bytes) + " bytes";
  }
  if (total != frame_bytes)
    return "pieces of " + std::to_string(total) + " bytes for a frame of " +
           std::to_string(frame_bytes);
  return {};
}

std::unique_ptr<KvTransport> make_shm_transport(const TcpTransportOptions& options) {
  return std::make_unique<ShmTransport>(options);
}

}  // namespace tandem::engine
