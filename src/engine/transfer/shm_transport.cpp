// KvTransport over shared memory on one host (see make_shm_transport in kv_transport.h).
#include <arpa/inet.h>
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
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "engine/transfer/kv_frame.h"
#include "engine/transfer/kv_transport.h"
#include "util/error.h"
#include "util/shared_memory.h"

namespace tandem::engine {
namespace {

using Clock = std::chrono::steady_clock;

// Bytes of the ring each way: KV flows prefill -> decode (the server's), requests the other way.
// Small enough to stay in cache and to cost few page faults on a new connection's segment.
constexpr size_t kToServerBytes = 1 << 20;
constexpr size_t kToClientBytes = 2 << 20;
// A sender publishes what it wrote every this many bytes (and at the end of a frame), so the
// receiver copies while it writes without a wake-up per block.
constexpr size_t kChunk = 128 << 10;
constexpr char kHello = 'S', kWelcome = 'A';

struct alignas(64) RingHead {
  std::atomic<uint64_t> written{0};           // bytes ever written (the producer's)
  alignas(64) std::atomic<uint64_t> read{0};  // bytes ever read (the consumer's)
  alignas(64) std::atomic<uint32_t> data{0};  // futex words: bumped after writing / reading
  std::atomic<uint32_t> space{0};
  // Sides asleep on `data` / `space`: a wake-up (a system call) only when someone sleeps.
  std::atomic<uint32_t> data_sleepers{0}, space_sleepers{0};
};

// The abstract Unix socket a listener on host:port also accepts on.
sockaddr_un socket_address(const std::string& host, uint16_t port, socklen_t& length) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const std::string name = "tandem-kv-" + host + "-" + std::to_string(port);
  const size_t n = std::min(name.size(), sizeof(a.sun_path) - 2);
  std::memcpy(a.sun_path + 1, name.data(), n);  // sun_path[0] = 0: the abstract namespace
  length = socklen_t(offsetof(sockaddr_un, sun_path) + 1 + n);
  return a;
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

// Waits for one byte (and maybe a descriptor) on a Unix socket until `deadline`.
bool receive_byte(int fd, char& byte, int* passed_fd, Clock::time_point deadline) {
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, int(std::min<int64_t>(left, 1 << 30))) <= 0) continue;
    iovec iov{&byte, 1};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr m{};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = control;
    m.msg_controllen = sizeof control;
    const ssize_t n = ::recvmsg(fd, &m, MSG_CMSG_CLOEXEC);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n != 1) return false;
    if (passed_fd) {
      *passed_fd = -1;
      for (cmsghdr* c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
          std::memcpy(passed_fd, CMSG_DATA(c), sizeof(int));
    }
    return true;
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

class ShmConnection : public KvConnection {
 public:
  // `client`: the connecting side, which writes the to-server ring.
  ShmConnection(int socket, SharedSegment segment, bool client, std::chrono::milliseconds timeout,
                std::string peer)
      : socket_(socket), segment_(std::move(segment)), timeout_(timeout), peer_(std::move(peer)) {
    auto* base = segment_.data();
    auto* to_server = reinterpret_cast<RingHead*>(base);
    auto* to_client = reinterpret_cast<RingHead*>(base + sizeof(RingHead));
    std::byte* server_bytes = base + 2 * sizeof(RingHead);
    std::byte* client_bytes = server_bytes + kToServerBytes;
    out_ = client ? Ring{to_server, server_bytes, kToServerBytes}
                  : Ring{to_client, client_bytes, kToClientBytes};
    in_ = client ? Ring{to_client, client_bytes, kToClientBytes}
                 : Ring{to_server, server_bytes, kToServerBytes};
  }
  ~ShmConnection() override { ::close(socket_); }

  static size_t segment_bytes() { return 2 * sizeof(RingHead) + kToServerBytes + kToClientBytes; }

  void send(KvFrameType type, std::span<const std::span<const std::byte>> parts) override {
    uint64_t total = 0;
    for (auto p : parts) total += p.size();
    const auto header = kv_frame_header(type, total);
    const auto deadline = start("sending");
    write(header.data(), header.size(), deadline);
    for (auto p : parts) write(p.data(), p.size(), deadline);
    publish();
  }

  KvFrameType receive_header(uint64_t& size, size_t max_payload) override {
    std::array<std::byte, kKvFrameHeaderBytes> header{};
    read(header.data(), header.size(), start("receiving"));
    return parse_kv_frame_header(header.data(), size, max_payload, peer_);
  }

  void receive_payload(std::span<const std::span<std::byte>> parts) override {
    const auto deadline = start("receiving");
    for (auto p : parts) read(p.data(), p.size(), deadline);
  }

  void shutdown() override {
    stopped_ = true;
    ::shutdown(socket_, SHUT_RDWR);  // the peer sees it, and our own waits below check the flag
    wake_all(in_.head->data);
    wake_all(out_.head->space);
    wake_all(out_.head->data);
    wake_all(in_.head->space);
  }

  void set_timeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }
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
    return Clock::now() + timeout_;
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
      char c;
      const ssize_t n = ::recv(socket_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
        fail(std::string(what_) + " failed: connection closed by peer");
      if (Clock::now() >= deadline)
        fail(std::string("timed out ") + what_ + " after " + std::to_string(timeout_.count()) +
             " ms");
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
      const uint64_t free = out_.capacity - (written - h.read.load(std::memory_order_acquire));
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

  const int socket_;
  SharedSegment segment_;
  std::chrono::milliseconds timeout_;
  const std::string peer_;
  Ring out_, in_;
  const char* what_ = "";
  size_t unpublished_ = 0;  // bytes written to the ring, not yet visible to the reader
  std::atomic<bool> stopped_{false};
  bool broken_ = false;
};

// Accepts on the TCP listener and on the Unix socket, each in a thread of its own; accept()
// hands out whichever connection comes first.
class ShmListener : public KvListener {
 public:
  ShmListener(std::unique_ptr<KvListener> tcp, const std::string& host,
              std::chrono::milliseconds timeout)
      : tcp_(std::move(tcp)), timeout_(timeout) {
    unix_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    socklen_t length = 0;
    const sockaddr_un a = socket_address(host, tcp_->port(), length);
    if (unix_fd_ >= 0 && (::bind(unix_fd_, reinterpret_cast<const sockaddr*>(&a), length) != 0 ||
                          ::listen(unix_fd_, SOMAXCONN) != 0)) {
      // Another listener of this host already has the name: this one serves TCP only.
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
  void push(std::unique_ptr<KvConnection> c) {
    {
      std::lock_guard lock(mutex_);
      if (closed_) return;
      queue_.push_back(std::move(c));
    }
    ready_.notify_one();
  }

  void accept_unix() {
    for (;;) {
      {
        std::lock_guard lock(mutex_);
        if (closed_) return;
      }
      pollfd p{unix_fd_, POLLIN, 0};
      if (::poll(&p, 1, 200) <= 0) continue;
      const int fd = ::accept4(unix_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED)
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      // The client's hello carries the segment; a stranger that sends nothing is dropped
      // after a second, so it cannot stall this loop for long.
      char hello = 0;
      int segment_fd = -1;
      const auto deadline = Clock::now() + std::min<std::chrono::milliseconds>(
                                               timeout_, std::chrono::milliseconds(1000));
      if (!receive_byte(fd, hello, &segment_fd, deadline) || hello != kHello || segment_fd < 0) {
        if (segment_fd >= 0) ::close(segment_fd);
        ::close(fd);
        continue;
      }
      try {
        SharedSegment segment = SharedSegment::attach(segment_fd);
        if (segment.size() < ShmConnection::segment_bytes() || !send_byte(fd, kWelcome, -1))
          throw Error("bad segment");
        push(std::make_unique<ShmConnection>(fd, std::move(segment), false, timeout_,
                                             "shared memory (local peer)"));
      } catch (const std::exception&) {
        ::close(fd);
      }
    }
  }

  std::unique_ptr<KvListener> tcp_;
  const std::chrono::milliseconds timeout_;
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

  std::unique_ptr<KvListener> listen(const std::string& host, uint16_t port) override {
    return std::make_unique<ShmListener>(tcp_->listen(host, port), host, options_.io_timeout);
  }

  std::unique_ptr<KvConnection> connect(const std::string& host, uint16_t port) override {
    if (is_this_host(host))
      for (const std::string& name : {host, std::string("0.0.0.0")})
        if (auto c = connect_local(name, port)) return c;
    return tcp_->connect(host, port);
  }

 private:
  // nullptr when no local listener has that name (then TCP).
  std::unique_ptr<KvConnection> connect_local(const std::string& host, uint16_t port) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return nullptr;
    socklen_t length = 0;
    const sockaddr_un a = socket_address(host, port, length);
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&a), length) != 0) {
      ::close(fd);
      return nullptr;
    }
    SharedSegment segment;
    try {
      segment = SharedSegment::create(ShmConnection::segment_bytes(), "tandem-kv");
    } catch (const Error&) {
      ::close(fd);  // no shared memory here (memfd refused): TCP still works
      return nullptr;
    }
    char welcome = 0;
    if (!send_byte(fd, kHello, segment.fd()) ||
        !receive_byte(fd, welcome, nullptr, Clock::now() + options_.io_timeout) ||
        welcome != kWelcome) {
      ::close(fd);
      throw Error("KV transfer: the shared-memory handshake with " + host + ":" +
                  std::to_string(port) + " failed");
    }
    return std::make_unique<ShmConnection>(fd, std::move(segment), true, options_.io_timeout,
                                           "shared memory to " + host + ":" + std::to_string(port));
  }

  TcpTransportOptions options_;
  std::unique_ptr<KvTransport> tcp_;
};

}  // namespace

std::unique_ptr<KvTransport> make_shm_transport(const TcpTransportOptions& options) {
  return std::make_unique<ShmTransport>(options);
}

}  // namespace tandem::engine
