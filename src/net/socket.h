#pragma once
// Thin helpers over BSD sockets, shared by the HTTP stack and the KV transfer transport (one
// socket story for the project: no second networking library).
#include <sys/socket.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::net::detail {

struct Address {
  sockaddr_storage storage{};
  socklen_t length = 0;
};

// host:port when host is a numeric IPv4 or IPv6 address (no lookup); nullopt for a name.
std::optional<Address> numeric_address(const std::string& host, uint16_t port);

// The addresses of host:port, numeric hosts without a lookup. Names go through getaddrinfo,
// which blocks: callers on an event loop look names up on another thread.
// Returns an empty list and sets `error` on failure.
std::vector<Address> resolve(const std::string& host, uint16_t port, bool passive,
                             std::string& error);

// Where a listener binds, and the flags that chose it: its errors name them.
struct ListenAddress {
  std::string host;
  uint16_t port = 0;
  std::string_view host_flag = "--host";
  std::string_view port_flag = "--port";
};

// A non-blocking, close-on-exec TCP listener bound to `at` (the HTTP server's, the KV transfer's
// and the test bind of net::check_listen_address: one wording for all). Throws tandem::Error
// naming the address and a flag: host_flag for a host that does not resolve, is not this
// machine's or is of a family it lacks (:: without IPv6), port_flag for a port in use or
// privileged. `reuse_port`: SO_REUSEPORT, so several
// listeners (gateway replicas) share the port and the kernel spreads new connections over them.
int listen_tcp(const ListenAddress& at, uint16_t& bound_port, bool reuse_port = false);

// A non-blocking TCP socket with a connect to `address` started. Returns the fd (connected or
// in progress) or -1 with errno set.
int start_connect(const Address& address);

// The peer's IP and port; IPv4 clients of a dual-stack socket are reported as a.b.c.d.
void peer_of(int fd, std::string& address, unsigned short& port);

// Tokens go out one small write at a time; Nagle would hold them back.
void set_no_delay(int fd);

// Sends `out` from `written` on (advancing it) on a non-blocking socket until all of it is sent,
// the socket would block, or it fails. Returns 0 when all is sent, EAGAIN when the rest must
// wait for the socket to be writable, else the errno of the failure.
int send_pending(int fd, const std::string& out, size_t& written);

// Whether an idle keep-alive connection can take a request: the peer has neither closed it nor
// sent anything unasked (a peek that would block). Checked right before reuse, since the close
// of an idle connection may not have been seen yet.
bool idle_connection_usable(int fd);

}  // namespace tandem::net::detail
