#include "net/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "net/http.h"
#include "util/error.h"

namespace tandem::net::detail {

std::optional<Address> numeric_address(const std::string& host, uint16_t port) {
  Address a;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&a.storage);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&a.storage);
  if (::inet_pton(AF_INET, host.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(port);
    a.length = sizeof(sockaddr_in);
    return a;
  }
  if (::inet_pton(AF_INET6, host.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(port);
    a.length = sizeof(sockaddr_in6);
    return a;
  }
  return std::nullopt;
}

std::vector<Address> resolve(const std::string& host, uint16_t port, bool passive,
                             std::string& error) {
  std::vector<Address> out;
  // Numeric hosts, the usual case for engines, without getaddrinfo's cost.
  if (std::optional<Address> numeric = numeric_address(host, port)) {
    out.push_back(*numeric);
    return out;
  }
  Address a;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* list = nullptr;
  std::string service = std::to_string(port);
  int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &list);
  if (rc != 0) {
    error = ::gai_strerror(rc);
    return out;
  }
  for (addrinfo* p = list; p; p = p->ai_next) {
    if (p->ai_addrlen > sizeof(a.storage)) continue;
    Address r;
    std::memcpy(&r.storage, p->ai_addr, p->ai_addrlen);
    r.length = p->ai_addrlen;
    out.push_back(r);
  }
  ::freeaddrinfo(list);
  if (out.empty()) error = "no address";
  return out;
}

int listen_tcp(const ListenAddress& at, uint16_t& bound_port, bool reuse_port) {
  const std::string where = url_host(at.host) + ":" + std::to_string(at.port);
  const std::string port_said = std::string(at.port_flag) + " " + std::to_string(at.port) + ": ";
  const std::string host_said = std::string(at.host_flag) + " '" + at.host + "': ";
  std::string error;
  // The first address: a name that resolves to several is bound at one.
  const std::vector<Address> addresses = resolve(at.host, at.port, true, error);
  if (addresses.empty()) throw Error(host_said + "cannot resolve it: " + error);
  const Address& a = addresses.front();
  const int fd = ::socket(a.storage.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    const int e = errno;
    // --host :: on a machine without IPv6 (or an IPv4 address without IPv4): the host's family.
    if (e == EAFNOSUPPORT)
      throw Error(host_said + "cannot listen on " + where + ": " + std::strerror(e));
    throw Error("cannot listen on " + where + ": " + std::strerror(e));
  }
  int one = 1;  // a closed connection's TIME_WAIT does not hold the port
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (reuse_port && ::setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one) != 0) {
    const int e = errno;
    ::close(fd);
    throw Error(port_said + "cannot share " + where + " (SO_REUSEPORT): " + std::strerror(e));
  }
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&a.storage), a.length) != 0 ||
      ::listen(fd, SOMAXCONN) != 0) {
    const int e = errno;
    ::close(fd);
    if (e == EADDRINUSE)
      throw Error(
          port_said + where +
          " is in use (another socket holds it: a listener, or a connection made from that port)");
    if (e == EACCES) throw Error(port_said + "cannot listen on " + where + ": " + std::strerror(e));
    throw Error(host_said + "cannot listen on " + where + ": " + std::strerror(e));
  }
  sockaddr_storage local{};
  socklen_t length = sizeof local;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length);
  bound_port = local.ss_family == AF_INET6
                   ? ntohs(reinterpret_cast<sockaddr_in6*>(&local)->sin6_port)
                   : ntohs(reinterpret_cast<sockaddr_in*>(&local)->sin_port);
  return fd;
}

int start_connect(const Address& address) {
  int fd = ::socket(address.storage.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&address.storage), address.length) != 0 &&
      errno != EINPROGRESS) {
    int e = errno;
    ::close(fd);
    errno = e;
    return -1;
  }
  set_no_delay(fd);
  return fd;
}

void peer_of(int fd, std::string& address, unsigned short& port) {
  sockaddr_storage peer{};
  socklen_t length = sizeof peer;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &length) != 0) return;
  char text[INET6_ADDRSTRLEN] = {};
  if (peer.ss_family == AF_INET) {
    auto* v4 = reinterpret_cast<sockaddr_in*>(&peer);
    ::inet_ntop(AF_INET, &v4->sin_addr, text, sizeof text);
    port = ntohs(v4->sin_port);
  } else if (peer.ss_family == AF_INET6) {
    auto* v6 = reinterpret_cast<sockaddr_in6*>(&peer);
    if (IN6_IS_ADDR_V4MAPPED(&v6->sin6_addr)) {
      ::inet_ntop(AF_INET, &v6->sin6_addr.s6_addr[12], text, sizeof text);
    } else {
      ::inet_ntop(AF_INET6, &v6->sin6_addr, text, sizeof text);
    }
    port = ntohs(v6->sin6_port);
  }
  address = text;
}

void set_no_delay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

int send_pending(int fd, const std::string& out, size_t& written) {
  while (written < out.size()) {
    const ssize_t n = ::send(fd, out.data() + written, out.size() - written, MSG_NOSIGNAL);
    if (n > 0) {
      written += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return EAGAIN;
    return n < 0 ? errno : EPIPE;  // a send of 0 bytes with bytes left: treat as broken
  }
  return 0;
}

bool idle_connection_usable(int fd) {
  char byte;
  const ssize_t n = ::recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

}  // namespace tandem::net::detail
