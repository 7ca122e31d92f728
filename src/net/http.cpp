#include "net/http.h"

#include <unistd.h>

#include <algorithm>

#include <nlohmann/json.hpp>

#include "net/socket.h"
#include "util/error.h"

namespace tandem::net {

namespace {

char lower(char c) {
  return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c;
}

bool is_token_char(char c) {
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) return true;
  return std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

void check_field(std::string_view name, std::string_view value) {
  if (name.empty() || !std::all_of(name.begin(), name.end(), is_token_char)) {
    throw Error("HTTP header name '" + std::string(name) + "' is not a token (RFC 9110 5.1)");
  }
  // A plain loop: find_first_of scans the value once per character of the set (a memchr call
  // per byte), which showed in the gateway's profile for every header of every upstream answer.
  if (std::any_of(value.begin(), value.end(),
                  [](char c) { return c == '\r' || c == '\n' || c == '\0'; })) {
    throw Error("HTTP header '" + std::string(name) + "' has a value with CR, LF or NUL");
  }
}

}  // namespace

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (lower(a[i]) != lower(b[i])) return false;
  }
  return true;
}

void Headers::add(std::string name, std::string value) {
  check_field(name, value);
  fields_.emplace_back(std::move(name), std::move(value));
}

void Headers::set(std::string name, std::string value) {
  check_field(name, value);
  remove(name);
  fields_.emplace_back(std::move(name), std::move(value));
}

size_t Headers::remove(std::string_view name) {
  return std::erase_if(fields_, [&](const Field& f) { return iequals(f.first, name); });
}

const std::string* Headers::find(std::string_view name) const {
  for (const Field& f : fields_) {
    if (iequals(f.first, name)) return &f.second;
  }
  return nullptr;
}

std::string Headers::get(std::string_view name, std::string_view fallback) const {
  const std::string* value = find(name);
  return value ? *value : std::string(fallback);
}

std::string url_host(std::string_view host) {
  if (host.find(':') == std::string_view::npos) return std::string(host);
  // Appended, not "[" + host + "]": GCC 12 warns (-Wrestrict) on that inlined concatenation.
  std::string out;
  out.reserve(host.size() + 2);
  out += '[';
  out += host;
  out += ']';
  return out;
}

void check_socket_host(std::string_view flag, std::string_view host) {
  if (host.find('[') != std::string_view::npos || host.find(']') != std::string_view::npos)
    throw Error(std::string(flag) + " '" + std::string(host) +
                "': an address without brackets, e.g. " + std::string(flag) +
                " ::1 for IPv6 loopback");
}

void check_listen_address(std::string_view host_flag, const std::string& host,
                          std::string_view port_flag, uint16_t port) {
  uint16_t bound = 0;
  ::close(detail::listen_tcp({host, port, host_flag, port_flag}, bound));
}

std::string_view status_reason(int status) {
  switch (status) {
    case 100:
      return "Continue";
    case 101:
      return "Switching Protocols";
    case 200:
      return "OK";
    case 201:
      return "Created";
    case 202:
      return "Accepted";
    case 204:
      return "No Content";
    case 206:
      return "Partial Content";
    case 301:
      return "Moved Permanently";
    case 302:
      return "Found";
    case 304:
      return "Not Modified";
    case 307:
      return "Temporary Redirect";
    case 308:
      return "Permanent Redirect";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 403:
      return "Forbidden";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 408:
      return "Request Timeout";
    case 409:
      return "Conflict";
    case 411:
      return "Length Required";
    case 413:
      return "Content Too Large";
    case 414:
      return "URI Too Long";
    case 415:
      return "Unsupported Media Type";
    case 417:
      return "Expectation Failed";
    case 422:
      return "Unprocessable Content";
    case 429:
      return "Too Many Requests";
    case 431:
      return "Request Header Fields Too Large";
    case 499:
      return "Client Closed Request";
    case 500:
      return "Internal Server Error";
    case 501:
      return "Not Implemented";
    case 502:
      return "Bad Gateway";
    case 503:
      return "Service Unavailable";
    case 504:
      return "Gateway Timeout";
    case 505:
      return "HTTP Version Not Supported";
    default:
      return "Unknown";
  }
}

HttpResponse plain_error_response(int status, std::string_view message, std::string_view,
                                  std::string_view) {
  HttpResponse r;
  r.status = status;
  r.content_type = "text/plain; charset=utf-8";
  r.body = std::string(message) + "\n";
  return r;
}

std::string percent_decoded(std::string_view text) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '%' && i + 2 < text.size() && hex(text[i + 1]) >= 0 && hex(text[i + 2]) >= 0) {
      out += static_cast<char>(hex(text[i + 1]) * 16 + hex(text[i + 2]));
      i += 2;
    } else {
      out += text[i];
    }
  }
  return out;
}

std::optional<std::string> query_param(std::string_view query, std::string_view key) {
  while (!query.empty()) {
    const size_t amp = query.find('&');
    const std::string_view pair = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    const size_t eq = pair.find('=');
    if (pair.substr(0, eq) != key) continue;
    // '+' is a space before the escapes are decoded: "%2B" is a '+'.
    std::string raw(eq == std::string_view::npos ? "" : pair.substr(eq + 1));
    std::replace(raw.begin(), raw.end(), '+', ' ');
    return percent_decoded(raw);
  }
  return std::nullopt;
}

}  // namespace tandem::net
