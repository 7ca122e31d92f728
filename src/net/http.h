#pragma once
// Plain HTTP message types shared by the server (net/http_server.h) and the client
// (net/http_client.h), and the OpenAI error body every HTTP error of Tandem carries.
// Nothing of the wire code or the event loop here: this header is included by engine and gateway
// code that should compile fast.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tandem::net {

// Header fields in arrival order. Names compare case-insensitively (RFC 9110 section 5.1);
// values are kept as received, without surrounding whitespace.
class Headers {
 public:
  using Field = std::pair<std::string, std::string>;

  // Appends a field. Names must be HTTP tokens and values must not contain CR, LF or NUL;
  // anything else throws tandem::Error (it would let a value inject header lines).
  void add(std::string name, std::string value);
  // Replaces every field of this name by one field.
  void set(std::string name, std::string value);
  // Removes every field of this name; returns how many were removed.
  size_t remove(std::string_view name);
  // Room for `n` fields without reallocating (a parser knows the count up front).
  void reserve(size_t n) { fields_.reserve(n); }

  // The first field of this name, or nullptr.
  const std::string* find(std::string_view name) const;
  // The first field of this name, or `fallback`.
  std::string get(std::string_view name, std::string_view fallback = {}) const;
  bool contains(std::string_view name) const { return find(name) != nullptr; }

  const std::vector<Field>& fields() const { return fields_; }
  size_t size() const { return fields_.size(); }
  bool empty() const { return fields_.empty(); }
  auto begin() const { return fields_.begin(); }
  auto end() const { return fields_.end(); }

 private:
  std::vector<Field> fields_;
};

// ASCII case-insensitive equality, as header names and tokens compare.
bool iequals(std::string_view a, std::string_view b);

struct HttpRequest {
  std::string method;  // as sent, e.g. "POST" (methods are case-sensitive)
  std::string target;  // the request target as sent, e.g. "/v1/models?x=1"
  std::string path;    // target up to '?', escapes of unreserved characters decoded (RFC 3986
                       // 6.2.2.2: /v1/%6dodels is /v1/models), other escapes kept
  std::string query;   // after '?', without it; empty if none
  int version = 11;    // 10 or 11
  Headers headers;
  std::string body;            // chunked bodies arrive de-chunked
  std::string remote_address;  // peer IP address, e.g. "127.0.0.1" or "::1"
  unsigned short remote_port = 0;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  // Extra fields. Content-Length, Transfer-Encoding, Connection and Date are the server's
  // business and are ignored here, except that a whole response's `Connection: close` has the
  // server close the connection after it; Content-Type comes from `content_type` (empty: none).
  Headers headers;
};

// A host as a URL or a Host header names it: an IPv6 address in brackets ("::1" -> "[::1]"),
// others as they are.
std::string url_host(std::string_view host);
// A listen address as a socket takes it (::1, not [::1]: brackets belong to URLs); throws
// tandem::Error naming `flag` for one in brackets, which no resolver takes.
void check_socket_host(std::string_view flag, std::string_view host);
// Whether a server could listen on host:port, told before the work that comes before its start
// (a model's load, a stack's engines): throws tandem::Error naming `host_flag` for a host that
// does not resolve or is not this machine's, `port_flag` for a port in use or privileged. A test
// bind, not a reservation: the port is free again when this returns.
void check_listen_address(std::string_view host_flag, const std::string& host,
                          std::string_view port_flag, uint16_t port);

// The reason phrase of a status code ("Not Found"), or "Unknown" for codes without one.
std::string_view status_reason(int status);

// `text` with each %XX escape decoded, once ("%2541" is "%41"); a malformed escape is kept as it
// is.
std::string percent_decoded(std::string_view text);
// The value of `key` in a query string ("a=1&b=x%20y"), percent-decoded ('+' is a space); nullopt
// when absent. A malformed escape is kept as it is.
std::optional<std::string> query_param(std::string_view query, std::string_view key);

// How a server words an error response: its own (unknown path, wrong method, a malformed or
// oversized request, a handler that gave up) and Exchange::send_error's. `type` and `code` are
// what the caller named, empty when it named none. The network layer knows no API's error schema:
// its default, plain_error_response, sends the message as text/plain; the engine and the gateway
// install the OpenAI error JSON (api/error.h).
using ErrorFormatter = HttpResponse (*)(int status, std::string_view message, std::string_view type,
                                        std::string_view code);
HttpResponse plain_error_response(int status, std::string_view message, std::string_view type,
                                  std::string_view code);

}  // namespace tandem::net
