#pragma once
// A scripted HTTP peer for client tests: what a misbehaving engine does on the wire (answers
// early, closes unanswered, resets) written out as a function over a raw socket.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <linux/sockios.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <string>
#include <string_view>
#include <thread>

namespace tandem::net {

// A listening socket on 127.0.0.1 at a free port (written to `port`); `receive_buffer` > 0 fixes
// the receive buffer of the connections it accepts.
inline int listen_on_loopback(uint16_t& port, int receive_buffer = 0) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (receive_buffer > 0)
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof receive_buffer);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, 4) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &length) != 0)
    ADD_FAILURE() << "cannot listen: " << std::strerror(errno);
  port = ntohs(a.sin_port);
  return fd;
}

// A server on 127.0.0.1 that plays a script: `serve(fd, n)` runs for the n-th connection (from
// 0), one connection at a time on the server's thread, and the connection closes when it returns.
class ScriptedServer {
 public:
  // A script may close the connection itself (setting fd to -1), to say when it did.
  using Script = std::function<void(int& fd, int connection)>;
  explicit ScriptedServer(Script serve) : serve_(std::move(serve)) {
    // A small receive buffer, fixed (no autotuning): a client's large request stays mostly
    // unsent until the script reads it, as with a busy engine across a network.
    listener_ = listen_on_loopback(port_, 65536);
    thread_ = std::thread([this] {
      for (int n = 0;; ++n) {
        int fd = ::accept(listener_, nullptr, nullptr);
        if (fd < 0) return;  // the listener was shut down
        serve_(fd, n);
        if (fd >= 0) ::close(fd);
      }
    });
  }
  // The client must be gone first: a script may be waiting for its next request.
  ~ScriptedServer() {
    ::shutdown(listener_, SHUT_RDWR);
    thread_.join();
    ::close(listener_);
  }
  uint16_t port() const { return port_; }

  // Reads one request head (what is past it stays in `buffer`); empty when the connection ended.
  static std::string read_head(int fd, std::string& buffer) {
    char chunk[4096];
    size_t end;
    while ((end = buffer.find("\r\n\r\n")) == std::string::npos) {
      const ssize_t n = ::recv(fd, chunk, sizeof chunk, 0);
      if (n <= 0) return {};
      buffer.append(chunk, static_cast<size_t>(n));
    }
    std::string head = buffer.substr(0, end + 4);
    buffer.erase(0, end + 4);
    return head;
  }
  static size_t content_length(const std::string& head) {
    const size_t at = head.find("Content-Length: ");
    return at == std::string::npos ? 0 : std::stoul(head.substr(at + 16));
  }
  // Reads `bytes` of body (the start of it may be in `buffer`); false when the connection ended
  // first.
  static bool read_body(int fd, std::string& buffer, size_t bytes) {
    const size_t buffered = std::min(bytes, buffer.size());
    buffer.erase(0, buffered);
    bytes -= buffered;
    char chunk[65536];
    while (bytes > 0) {
      const ssize_t n = ::recv(fd, chunk, std::min(bytes, sizeof chunk), 0);
      if (n <= 0) return false;
      bytes -= static_cast<size_t>(n);
    }
    return true;
  }
  static void write(int fd, std::string_view bytes) {
    while (!bytes.empty()) {
      const ssize_t n = ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (n <= 0) return;
      bytes.remove_prefix(static_cast<size_t>(n));
    }
  }
  // Waits until the client's kernel acknowledged all that was written on `fd`, a FIN after
  // shutdown(SHUT_WR) included: it is then in the client's socket, and what the client reads or
  // peeks next sees it, however late the client's thread runs. False if not within 10 s.
  static bool wait_acknowledged(int fd) {
    for (int i = 0; i < 10000; ++i) {
      int unacknowledged = 0;
      if (::ioctl(fd, SIOCOUTQ, &unacknowledged) != 0) return false;
      if (unacknowledged == 0) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return false;
  }

 private:
  Script serve_;
  int listener_ = -1;
  uint16_t port_ = 0;
  std::thread thread_;
};

// A 200 answer with `body`, as an engine's.
inline void answer(int fd, std::string_view body) {
  ScriptedServer::write(fd, "HTTP/1.1 200 OK\r\nContent-Length: " + std::to_string(body.size()) +
                                "\r\n\r\n" + std::string(body));
}

// Reads one whole request (head and Content-Length body); false when the connection ended first.
inline bool read_request(int fd, std::string& buffer, std::string* head_out = nullptr) {
  const std::string head = ScriptedServer::read_head(fd, buffer);
  if (head.empty()) return false;
  if (head_out) *head_out = head;
  return ScriptedServer::read_body(fd, buffer, ScriptedServer::content_length(head));
}

// An engine that answers each request "answer N" (N counts requests over all connections; with
// `name_connection`, "answer N on connection C"), except the `unanswered`th: read whole on the
// first connection, which it then closes without answering, as at a keep-alive timeout.
inline ScriptedServer::Script closes_first_connection_at(int unanswered, std::atomic<int>& requests,
                                                         bool name_connection = false) {
  return [unanswered, &requests, name_connection](int& fd, int connection) {
    std::string buffer;
    while (read_request(fd, buffer)) {
      ++requests;
      if (connection == 0 && requests == unanswered) return;
      answer(fd, "answer " + std::to_string(requests.load()) +
                     (name_connection ? " on connection " + std::to_string(connection) : ""));
    }
  };
}

}  // namespace tandem::net
