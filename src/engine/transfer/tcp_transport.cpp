// KvTransport over TCP with Boost.Asio. Each connection owns an io_context that only the thread
// calling send/receive runs, with run_for(timeout): blocking calls with a deadline, and a
// shutdown() from another thread is posted into that context so the socket is never touched by
// two threads at once.
#include <array>
#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>

#include "engine/transfer/kv_transport.h"
#include "util/error.h"
#include "util/little_endian.h"

namespace tandem::engine {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using boost::system::error_code;

constexpr size_t kHeaderBytes = 16;

std::string endpoint_text(const tcp::socket& s) {
  error_code ec;
  auto ep = s.remote_endpoint(ec);
  if (ec) return "unknown peer";
  return ep.address().to_string() + ":" + std::to_string(ep.port());
}

class TcpConnection : public KvConnection {
 public:
  TcpConnection(std::unique_ptr<asio::io_context> ctx, tcp::socket socket,
                std::chrono::milliseconds timeout)
      : ctx_(std::move(ctx)), socket_(std::move(socket)), timeout_(timeout) {
    error_code ec;
    socket_.set_option(tcp::no_delay(true), ec);
    peer_ = endpoint_text(socket_);
  }
  ~TcpConnection() override {
    error_code ec;
    socket_.close(ec);
  }

  void send(KvFrameType type, std::span<const std::span<const std::byte>> parts) override {
    uint64_t total = 0;
    for (auto p : parts) total += p.size();
    std::array<std::byte, kHeaderBytes> header{};
    put_le(header.data(), static_cast<uint32_t>(type), 4);
    put_le(header.data() + 8, total, 8);
    std::vector<asio::const_buffer> buffers;
    buffers.reserve(parts.size() + 1);
    buffers.emplace_back(header.data(), header.size());
    for (auto p : parts)
      if (!p.empty()) buffers.emplace_back(p.data(), p.size());
    run([&](auto done) { asio::async_write(socket_, buffers, done); }, "sending");
  }

  KvFrameType receive_header(uint64_t& size, size_t max_payload) override {
    std::array<std::byte, kHeaderBytes> header{};
    run([&](auto done) { asio::async_read(socket_, asio::buffer(header), done); }, "receiving");
    const uint64_t type = get_le(header.data(), 4);
    size = get_le(header.data() + 8, 8);
    if (type < 1 || type > 6 || get_le(header.data() + 4, 4) != 0)
      throw Error("KV transfer from " + peer_ + ": not a Tandem KV frame (type " +
                  std::to_string(type) + ")");
    if (size > max_payload)
      throw Error("KV transfer from " + peer_ + ": frame of " + std::to_string(size) +
                  " bytes exceeds the limit of " + std::to_string(max_payload));
    return static_cast<KvFrameType>(type);
  }

  void receive_payload(std::span<const std::span<std::byte>> parts) override {
    std::vector<asio::mutable_buffer> buffers;
    buffers.reserve(parts.size());
    for (auto p : parts)
      if (!p.empty()) buffers.emplace_back(p.data(), p.size());
    if (!buffers.empty())
      run([&](auto done) { asio::async_read(socket_, buffers, done); }, "receiving");
  }

  void shutdown() override {
    stopped_ = true;
    asio::post(*ctx_, [this] {
      error_code ec;
      socket_.shutdown(tcp::socket::shutdown_both, ec);
      socket_.close(ec);
    });
  }

  std::string peer() const override { return peer_; }

 private:
  // Starts one async operation and runs the context until it completes or the timeout passes.
  template <typename Start>
  void run(Start start, const char* what) {
    if (stopped_) throw Error("KV transfer with " + peer_ + ": connection shut down");
    error_code result = asio::error::would_block;
    bool finished = false;
    ctx_->restart();
    start([&](error_code ec, size_t) {
      result = ec;
      finished = true;
    });
    ctx_->run_for(timeout_);
    if (!finished) {
      error_code ec;
      socket_.close(ec);
      ctx_->restart();
      ctx_->run();  // lets the cancelled operation complete
      throw Error("KV transfer with " + peer_ + ": timed out " + what + " after " +
                  std::to_string(timeout_.count()) + " ms");
    }
    if (result) {
      if (stopped_) throw Error("KV transfer with " + peer_ + ": connection shut down");
      throw Error("KV transfer with " + peer_ + ": " + what + " failed: " +
                  (result == asio::error::eof ? std::string("connection closed by peer")
                                              : result.message()));
    }
  }

  std::unique_ptr<asio::io_context> ctx_;
  tcp::socket socket_;
  std::chrono::milliseconds timeout_;
  std::atomic<bool> stopped_{false};
  std::string peer_;
};

class TcpListener : public KvListener {
 public:
  TcpListener(const std::string& host, uint16_t port, std::chrono::milliseconds timeout)
      : acceptor_(ctx_), timeout_(timeout) {
    error_code ec;
    tcp::resolver resolver(ctx_);
    auto results = resolver.resolve(host, std::to_string(port), tcp::resolver::passive, ec);
    if (ec || results.empty())
      throw Error("KV transfer: cannot resolve listen address '" + host + "'");
    const tcp::endpoint ep = *results.begin();
    acceptor_.open(ep.protocol());
    acceptor_.set_option(tcp::acceptor::reuse_address(true));
    acceptor_.bind(ep, ec);
    if (ec)
      throw Error("KV transfer: cannot listen on " + host + ":" + std::to_string(port) + ": " +
                  ec.message());
    acceptor_.listen(asio::socket_base::max_listen_connections);
    port_ = acceptor_.local_endpoint().port();
  }

  std::unique_ptr<KvConnection> accept() override {
    while (!closed_) {
      auto ctx = std::make_unique<asio::io_context>();
      tcp::socket socket(*ctx);
      error_code ec;
      {
        std::lock_guard lock(mutex_);
        if (closed_) break;
      }
      acceptor_.accept(socket, ec);  // close() unblocks it with an error
      if (closed_) break;
      if (ec) {
        // A client that gave up before we accepted it, or no file descriptors left: do not spin.
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      return std::make_unique<TcpConnection>(std::move(ctx), std::move(socket), timeout_);
    }
    return nullptr;
  }

  uint16_t port() const override { return port_; }

  void close() override {
    std::lock_guard lock(mutex_);
    if (closed_) return;
    closed_ = true;
    // shutdown() on the listening socket wakes a thread blocked in accept().
    ::shutdown(acceptor_.native_handle(), SHUT_RDWR);
  }

  ~TcpListener() override {
    close();
    error_code ec;
    acceptor_.close(ec);
  }

 private:
  asio::io_context ctx_;
  tcp::acceptor acceptor_;
  std::chrono::milliseconds timeout_;
  uint16_t port_ = 0;
  std::mutex mutex_;
  std::atomic<bool> closed_{false};
};

class TcpTransport : public KvTransport {
 public:
  explicit TcpTransport(const TcpTransportOptions& options) : options_(options) {}
  std::string name() const override { return "tcp"; }

  std::unique_ptr<KvListener> listen(const std::string& host, uint16_t port) override {
    return std::make_unique<TcpListener>(host, port, options_.io_timeout);
  }

  std::unique_ptr<KvConnection> connect(const std::string& host, uint16_t port) override {
    auto ctx = std::make_unique<asio::io_context>();
    tcp::socket socket(*ctx);
    const std::string where = host + ":" + std::to_string(port);
    tcp::resolver resolver(*ctx);
    error_code ec;
    auto results = resolver.resolve(host, std::to_string(port), ec);
    if (ec) throw Error("KV transfer: cannot resolve " + where + ": " + ec.message());
    error_code result = asio::error::would_block;
    bool finished = false;
    asio::async_connect(socket, results, [&](error_code e, const tcp::endpoint&) {
      result = e;
      finished = true;
    });
    ctx->run_for(options_.io_timeout);
    if (!finished) {
      socket.close(ec);
      ctx->restart();
      ctx->run();
      throw Error("KV transfer: connecting to " + where + " timed out");
    }
    if (result) throw Error("KV transfer: cannot connect to " + where + ": " + result.message());
    return std::make_unique<TcpConnection>(std::move(ctx), std::move(socket), options_.io_timeout);
  }

 private:
  TcpTransportOptions options_;
};

}  // namespace

std::unique_ptr<KvTransport> make_tcp_transport(const TcpTransportOptions& options) {
  return std::make_unique<TcpTransport>(options);
}

}  // namespace tandem::engine
