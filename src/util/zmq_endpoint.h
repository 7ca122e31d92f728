#pragma once
// ZMQ's TCP sockets speak IPv4 unless ZMQ_IPV6 is set, and with it set an IPv4 bind reports an
// IPv4-mapped address (tcp://[::ffff:127.0.0.1]:PORT) that IPv4-only peers cannot use. So the
// engine's KV event sockets and the gateway's set it exactly for endpoints whose host is an IPv6
// literal in brackets (tcp://[::1]:5557, tcp://[::]:*).
#include <string_view>

namespace tandem {

inline bool zmq_endpoint_is_ipv6(std::string_view endpoint) {
  return endpoint.starts_with("tcp://[");
}

}  // namespace tandem
