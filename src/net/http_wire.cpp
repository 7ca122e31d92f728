#include "net/http_wire.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cstdio>
#include <ctime>
#include <limits>

namespace tandem::net::detail {

namespace {

constexpr std::string_view kCrlf = "\r\n";
// A chunk-size line longer than this is not a chunk header (extensions are bounded too).
constexpr size_t kMaxChunkLine = 4096;

bool is_token_char(unsigned char c) {
  static constexpr auto kTable = [] {
    std::array<bool, 256> t{};
    for (int c = '0'; c <= '9'; ++c) t[c] = true;
    for (int c = 'a'; c <= 'z'; ++c) t[c] = true;
    for (int c = 'A'; c <= 'Z'; ++c) t[c] = true;
    for (char c : std::string_view("!#$%&'*+-.^_`|~")) t[static_cast<unsigned char>(c)] = true;
    return t;
  }();
  return kTable[c];
}

bool is_token(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (!is_token_char(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

// Field values: visible ASCII, SP, HTAB and obs-text. No other control bytes: a CR or LF here
// would be a bare line break, a NUL truncates values in C code downstream.
bool is_value_char(unsigned char c) {
  return c == '\t' || (c >= 0x20 && c != 0x7f);
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

Parse fail(ParseError& error, int status, std::string message) {
  error.status = status;
  error.message = std::move(message);
  return Parse::kError;
}

// A printable excerpt of hostile input for an error message.
std::string excerpt(std::string_view s) {
  std::string out;
  for (char c : s.substr(0, 40)) {
    unsigned char u = static_cast<unsigned char>(c);
    out += (u >= 0x20 && u < 0x7f) ? c : '?';
  }
  if (s.size() > 40) out += "...";
  return out;
}

// RFC 9112 2.3: HTTP-version = "HTTP/" DIGIT "." DIGIT, as major * 10 + minor ("HTTP/1.1" ->
// 11); -1 when it is not one.
int parse_version(std::string_view s) {
  auto digit = [](char c) { return c >= '0' && c <= '9'; };
  if (s.size() != 8 || s.substr(0, 5) != "HTTP/" || !digit(s[5]) || s[6] != '.' || !digit(s[7])) {
    return -1;
  }
  return (s[5] - '0') * 10 + (s[7] - '0');
}

// RFC 9112 2.3: a message of a later HTTP/1 minor version is read as the highest one known, 1.1.
int http1_version(int version) {
  return std::min(version, 11);
}

bool parse_decimal(std::string_view s, uint64_t& out) {
  if (s.empty() || s.size() > 19) return false;  // 19 digits cannot overflow 64 bits
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  out = v;
  return true;
}

// Calls f(token) for each comma-separated element of a list value.
template <class F>
void for_each_token(std::string_view value, F f) {
  while (!value.empty()) {
    size_t comma = value.find(',');
    std::string_view item = trim(value.substr(0, comma));
    if (!item.empty()) f(item);
    if (comma == std::string_view::npos) break;
    value.remove_prefix(comma + 1);
  }
}

// Splits the field lines of a head (after the start line, before the blank line) into `fields`.
Parse parse_fields(std::string_view lines, std::vector<HeadField>& fields, ParseError& error) {
  fields.clear();
  while (!lines.empty()) {
    size_t end = lines.find(kCrlf);
    std::string_view line = lines.substr(0, end);
    lines.remove_prefix(end == std::string_view::npos ? lines.size() : end + 2);
    if (line.front() == ' ' || line.front() == '\t') {
      return fail(error, 400, "malformed HTTP header: obsolete line folding is not accepted");
    }
    size_t colon = line.find(':');
    if (colon == std::string_view::npos) {
      return fail(error, 400, "malformed HTTP header line '" + excerpt(line) + "': no colon");
    }
    std::string_view name = line.substr(0, colon);
    if (!is_token(name)) {
      return fail(error, 400, "malformed HTTP header name '" + excerpt(name) + "'");
    }
    std::string_view value = trim(line.substr(colon + 1));
    for (char c : value) {
      if (!is_value_char(static_cast<unsigned char>(c))) {
        return fail(error, 400,
                    "HTTP header '" + std::string(name) + "' has a control character in its value");
      }
    }
    fields.push_back({name, value});
  }
  return Parse::kDone;
}

// Framing and connection fields shared by requests and responses.
Parse derive_framing(MessageHead& head, bool request, ParseError& error) {
  bool chunked = false;  // the last coding so far is chunked
  bool misplaced_chunked = false;
  bool unknown_coding = false;
  bool has_te = false;
  bool has_length = false;
  bool close = false;
  bool keep_alive = false;
  for (const HeadField& f : head.fields) {
    if (iequals(f.name, "Content-Length")) {
      uint64_t n = 0;
      if (!parse_decimal(f.value, n)) {
        return fail(error, 400, "malformed Content-Length '" + excerpt(f.value) + "'");
      }
      if (has_length && n != head.content_length) {
        return fail(error, 400, "conflicting Content-Length fields");
      }
      has_length = true;
      head.content_length = n;
    } else if (iequals(f.name, "Transfer-Encoding")) {
      has_te = true;
      // The codings of every Transfer-Encoding field, in order (one list, RFC 9110 5.3).
      for_each_token(f.value, [&](std::string_view coding) {
        if (chunked) misplaced_chunked = true;  // a coding after chunked, chunked again included
        chunked = iequals(coding, "chunked");
        if (!chunked) unknown_coding = true;
      });
    } else if (iequals(f.name, "Connection")) {
      for_each_token(f.value, [&](std::string_view option) {
        if (iequals(option, "close")) close = true;
        if (iequals(option, "keep-alive")) keep_alive = true;
      });
    } else if (request && iequals(f.name, "Expect")) {
      head.expect_continue = iequals(f.value, "100-continue") && head.version >= 11;
    }
  }
  if (has_te && has_length) {
    // RFC 9112 6.3: a sign of request smuggling; refuse rather than pick one.
    return fail(error, 400, "both Content-Length and Transfer-Encoding are present");
  }
  if (has_te && head.version < 11) {
    return fail(error, 400, "Transfer-Encoding in an HTTP/1.0 message");
  }
  if (has_te && (misplaced_chunked || !chunked)) {
    // RFC 9112 6.3: without chunked last, once, where the body ends cannot be known.
    return fail(error, 400, "chunked must be the final transfer coding, once");
  }
  if (unknown_coding) {
    // Before chunked, a coding we would have to decode (and do not): RFC 9112 6.1.
    return fail(error, 501, "Transfer-Encoding: only chunked is supported");
  }
  head.keep_alive = head.version >= 11 ? !close : keep_alive && !close;
  if (has_te) {
    head.body = BodyKind::kChunked;
  } else if (has_length) {
    head.body = head.content_length > 0 ? BodyKind::kLength : BodyKind::kNone;
  } else {
    head.body = request ? BodyKind::kNone : BodyKind::kUntilClose;
  }
  return Parse::kDone;
}

// Clears a head for the next message, keeping its fields' capacity.
void reset_head(MessageHead& head) {
  std::vector<HeadField> fields = std::move(head.fields);
  head = MessageHead();
  head.fields = std::move(fields);
}

}  // namespace

size_t HeadParser::find_end(std::string_view in, size_t from, ParseError& error, bool& failed) {
  failed = false;
  size_t start = std::max(scanned_, from + 3) - 3;
  size_t pos = in.find("\r\n\r\n", start);
  // A line ended by LF alone is refused as soon as it arrives: waiting for the CRLF that never
  // comes held the connection until its timeout, and a parser that accepts bare LF would split
  // the head differently from ours.
  const size_t limit = pos == std::string_view::npos ? in.size() : pos + 4;
  for (size_t lf = in.find('\n', std::max(lf_scanned_, from)); lf < limit;
       lf = in.find('\n', lf + 1)) {
    if (lf == from || in[lf - 1] != '\r') {
      failed = true;
      fail(error, 400, "bare LF line ending (lines must end with CRLF)");
      return 0;
    }
  }
  lf_scanned_ = limit;
  // Blank lines before a request count against the limit: else they could come without end.
  if (pos == std::string_view::npos) {
    scanned_ = in.size();
    if (in.size() > max_) {
      failed = true;
      fail(error, 431, "the request header is larger than " + std::to_string(max_) + " bytes");
    }
    return 0;
  }
  if (pos + 4 > max_) {
    failed = true;
    fail(error, 431, "the request header is larger than " + std::to_string(max_) + " bytes");
    return 0;
  }
  return pos + 4;
}

namespace {

// A request line's method must be a short token: what the longest registered methods need.
constexpr size_t kMaxMethod = 32;

// The request line (without its CRLF) into head.method, head.target and head.version.
Parse parse_request_line(std::string_view line, MessageHead& head, ParseError& error) {
  size_t sp1 = line.find(' ');
  size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos) {
    return fail(error, 400, "malformed HTTP request line '" + excerpt(line) + "'");
  }
  head.method = line.substr(0, sp1);
  head.target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  if (!is_token(head.method) || head.method.size() > kMaxMethod) {
    return fail(error, 400, "malformed HTTP method '" + excerpt(head.method) + "'");
  }
  if (head.target.empty()) return fail(error, 400, "empty HTTP request target");
  for (char c : head.target) {
    unsigned char u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u == 0x7f) {
      return fail(error, 400, "the HTTP request target has a space or control character");
    }
  }
  // RFC 9112 section 3.2.2: a server must accept the absolute form (what clients send to a
  // proxy); the resource is what follows the authority, "/" where no path does (RFC 3986 6.2.3).
  const std::string_view target = head.target;
  for (std::string_view scheme : {"http://", "https://"}) {
    if (target.size() < scheme.size() || !iequals(target.substr(0, scheme.size()), scheme))
      continue;
    const size_t end = target.find_first_of("/?", scheme.size());
    if (end == std::string_view::npos) {
      head.target = "/";
    } else {
      head.target = target.substr(end);
      head.empty_path = target[end] == '?';
    }
    break;
  }
  const std::string_view version = line.substr(sp2 + 1);
  const int parsed = parse_version(version);
  if (parsed < 0) {
    return fail(error, 400, "malformed HTTP version '" + excerpt(version) + "'");
  }
  if (parsed / 10 != 1) {
    // RFC 9110 15.6.6.
    return fail(error, 505,
                "HTTP version '" + excerpt(version) + "' is not supported (this server speaks " +
                    "HTTP/1.1 and HTTP/1.0)");
  }
  head.version = http1_version(parsed);
  return Parse::kDone;
}

bool is_hex_digit(char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

// RFC 3986 2.3 unreserved and 2.2 sub-delims.
bool is_unreserved(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '.' || c == '_' || c == '~';
}
constexpr std::string_view kSubDelims = "!$&'()*+,;=";
bool is_sub_delim(char c) {
  return kSubDelims.find(c) != std::string_view::npos;
}

// RFC 3986 3.2.2 reg-name: *( unreserved / pct-encoded / sub-delims ), which covers IPv4address.
bool is_reg_name(std::string_view s) {
  for (size_t i = 0; i < s.size(); ++i) {
    if (is_unreserved(s[i]) || is_sub_delim(s[i])) continue;
    if (s[i] != '%' || i + 2 >= s.size() || !is_hex_digit(s[i + 1]) || !is_hex_digit(s[i + 2]))
      return false;
    i += 2;
  }
  return true;
}

// RFC 3986 3.2.2 IP-literal without its brackets: IPv6address or IPvFuture.
bool is_ip_literal(std::string_view s) {
  if (!s.empty() && (s[0] == 'v' || s[0] == 'V')) {
    // IPvFuture = "v" 1*HEXDIG "." 1*( unreserved / sub-delims / ":" )
    size_t dot = s.find('.');
    if (dot == std::string_view::npos || dot == 1 || dot + 1 == s.size()) return false;
    for (char c : s.substr(1, dot - 1)) {
      if (!is_hex_digit(c)) return false;
    }
    for (char c : s.substr(dot + 1)) {
      if (!is_unreserved(c) && !is_sub_delim(c) && c != ':') return false;
    }
    return true;
  }
  // A zone: RFC 6874's "%25" ZoneID, or "%" ZoneID as Tandem's client sends a topology's
  // link-local engine (url_host); ZoneID = 1*( unreserved / pct-encoded ), reg-name's alphabet.
  const size_t percent = s.find('%');
  if (percent != std::string_view::npos) {
    const std::string_view zone = s.substr(percent + 1);
    if (zone.empty() || zone.find_first_of(kSubDelims) != std::string_view::npos ||
        !is_reg_name(zone)) {
      return false;
    }
    s = s.substr(0, percent);
  }
  // inet_pton reads exactly the IPv6address forms of RFC 4291 2.2, which RFC 3986 spells out.
  char text[INET6_ADDRSTRLEN] = {};
  if (s.size() >= sizeof text) return false;
  s.copy(text, s.size());
  in6_addr address{};
  return ::inet_pton(AF_INET6, text, &address) == 1;
}

// RFC 9110 7.2: Host = uri-host [ ":" port ], port = *DIGIT. An empty value is allowed (RFC 9112
// 3.2: what a client sends for a target without an authority).
bool is_host_value(std::string_view value) {
  std::string_view host;
  if (!value.empty() && value[0] == '[') {
    const size_t close = value.find(']');
    if (close == std::string_view::npos || !is_ip_literal(value.substr(1, close - 1))) return false;
    host = value.substr(0, close + 1);
  } else {
    host = value.substr(0, value.find(':'));
    if (!is_reg_name(host)) return false;
  }
  std::string_view rest = value.substr(host.size());
  if (rest.empty()) return true;
  if (rest[0] != ':') return false;
  for (char c : rest.substr(1)) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

// RFC 9112 3.2: a request carries at most one Host field, with a valid value, and an HTTP/1.1
// request exactly one.
Parse check_host(const MessageHead& head, ParseError& error) {
  int hosts = 0;
  for (const HeadField& f : head.fields) {
    if (!iequals(f.name, "Host")) continue;
    if (++hosts > 1) return fail(error, 400, "more than one Host header");
    if (!is_host_value(f.value)) {
      return fail(error, 400,
                  "malformed Host header '" + excerpt(f.value) + "' (expected host[:port])");
    }
  }
  if (hosts == 0 && head.version >= 11) {
    return fail(error, 400, "an HTTP/1.1 request needs a Host header");
  }
  return Parse::kDone;
}

}  // namespace

Parse HeadParser::check_start(std::string_view partial, ParseError& error) {
  // A lone CR may be the start of a blank line before the request (skipped once complete).
  if (start_checked_ || partial.empty() || partial == "\r") return Parse::kNeedMore;
  if (partial.front() == 0x16) {
    return fail(error, 400, "this port speaks plain HTTP, not TLS (use http://, not https://)");
  }
  // Searched from where the last call stopped, so a line sent a byte at a time costs linear time.
  size_t line_end = partial.find(kCrlf, line_scanned_ > 0 ? line_scanned_ - 1 : 0);
  line_scanned_ = partial.size();
  if (line_end != std::string_view::npos) {
    start_checked_ = true;
    MessageHead scratch;
    return parse_request_line(partial.substr(0, line_end), scratch, error) == Parse::kDone
               ? Parse::kNeedMore
               : Parse::kError;
  }
  std::string_view method = partial.substr(0, std::min(partial.find(' '), kMaxMethod + 1));
  for (char c : method) {
    if (!is_token_char(static_cast<unsigned char>(c))) {
      return fail(error, 400,
                  "not an HTTP request: it starts with '" + excerpt(partial.substr(0, 16)) + "'");
    }
  }
  if (method.size() > kMaxMethod) {
    return fail(error, 400, "malformed HTTP method '" + excerpt(method) + "...'");
  }
  return Parse::kNeedMore;
}

Parse HeadParser::request(std::string_view in, MessageHead& head, ParseError& error) {
  // Skipped once: rescanned on every call, a stream of blank lines cost quadratic time.
  size_t from = skipped_;
  while (in.substr(from, 2) == kCrlf) from += 2;
  skipped_ = from;
  bool failed = false;
  size_t end = find_end(in, from, error, failed);
  if (failed) return Parse::kError;
  if (end == 0) return check_start(in.substr(from), error);
  reset_head(head);
  head.head_bytes = end;
  std::string_view text = in.substr(from, end - from - 2);  // ends with the last line's CRLF
  size_t line_end = text.find(kCrlf);
  if (parse_request_line(text.substr(0, line_end), head, error) != Parse::kDone) {
    return Parse::kError;
  }
  if (parse_fields(text.substr(line_end + 2), head.fields, error) != Parse::kDone) {
    return Parse::kError;
  }
  if (derive_framing(head, true, error) != Parse::kDone) return Parse::kError;
  return check_host(head, error);
}

Parse HeadParser::response(std::string_view in, bool head_request, MessageHead& head,
                           ParseError& error) {
  bool failed = false;
  size_t end = find_end(in, 0, error, failed);
  if (failed) {
    if (error.status == 431) {
      error.message = "the response header is larger than " + std::to_string(max_) + " bytes";
    }
    error.status = 502;
    return Parse::kError;
  }
  if (end == 0) return Parse::kNeedMore;
  reset_head(head);
  head.head_bytes = end;
  std::string_view text = in.substr(0, end - 2);
  size_t line_end = text.find(kCrlf);
  std::string_view line = text.substr(0, line_end);
  // "HTTP/1.1 200 OK"; the reason phrase may be empty or missing.
  const int version = parse_version(line.substr(0, 8));
  head.version = http1_version(version);
  uint64_t status = 0;
  if (version / 10 != 1 || line.size() < 12 || line[8] != ' ' ||
      !parse_decimal(line.substr(9, 3), status) || status < 100 ||
      (line.size() > 12 && line[12] != ' ')) {
    return fail(error, 502, "malformed HTTP status line '" + excerpt(line) + "'");
  }
  head.status = static_cast<int>(status);
  if (parse_fields(text.substr(line_end + 2), head.fields, error) != Parse::kDone ||
      derive_framing(head, false, error) != Parse::kDone) {
    error.status = 502;
    return Parse::kError;
  }
  if (head_request || !status_has_body(head.status)) head.body = BodyKind::kNone;
  // A body that ends with the connection leaves nothing to reuse.
  if (head.body == BodyKind::kUntilClose) head.keep_alive = false;
  return Parse::kDone;
}

void BodyParser::start(const MessageHead& head, uint64_t max_bytes, size_t max_trailer_bytes) {
  max_ = max_bytes;
  max_trailer_ = max_trailer_bytes;
  received_ = 0;
  trailer_bytes_ = 0;
  remaining_ = head.content_length;
  switch (head.body) {
    case BodyKind::kNone:
      state_ = State::kDone;
      break;
    case BodyKind::kLength:
      state_ = State::kLength;
      break;
    case BodyKind::kChunked:
      state_ = State::kChunkSize;
      break;
    case BodyKind::kUntilClose:
      state_ = State::kUntilClose;
      break;
  }
}

Parse BodyParser::feed(std::string_view in, size_t& used, std::string& out, ParseError& error) {
  used = 0;
  auto too_large = [&] {
    return fail(error, 413, "the request body is larger than " + std::to_string(max_) + " bytes");
  };
  for (;;) {
    std::string_view rest = in.substr(used);
    switch (state_) {
      case State::kDone:
        return Parse::kDone;
      case State::kUntilClose:
        if (received_ + rest.size() > max_) return too_large();
        out.append(rest);
        received_ += rest.size();
        used = in.size();
        return Parse::kNeedMore;
      case State::kLength:
      case State::kChunkData: {
        size_t take = static_cast<size_t>(std::min<uint64_t>(remaining_, rest.size()));
        out.append(rest.data(), take);
        used += take;
        received_ += take;
        remaining_ -= take;
        if (remaining_ > 0) return Parse::kNeedMore;
        state_ = state_ == State::kLength ? State::kDone : State::kChunkEnd;
        break;
      }
      case State::kChunkSize: {
        size_t end = rest.find('\n');
        if (end == std::string_view::npos) {
          if (rest.size() > kMaxChunkLine) return fail(error, 400, "chunk header too long");
          return Parse::kNeedMore;
        }
        if (end == 0 || rest[end - 1] != '\r') {
          return fail(error, 400, "bare LF line ending in a chunk header");
        }
        --end;  // the line ends before its CR
        if (end > kMaxChunkLine) return fail(error, 400, "chunk header too long");
        std::string_view line = rest.substr(0, end);
        uint64_t size = 0;
        auto [p, ec] = std::from_chars(line.data(), line.data() + line.size(), size, 16);
        size_t digits = static_cast<size_t>(p - line.data());
        // Leading zeros are no part of the size (1*HEXDIG), so not of the 15-digit bound either.
        size_t zeros = std::min(line.find_first_not_of('0'), digits);
        if (ec != std::errc() || digits == 0 || digits - zeros > 15) {
          return fail(error, 400, "malformed chunk size '" + excerpt(line) + "'");
        }
        std::string_view ext = trim(line.substr(digits));
        if (!ext.empty() && ext[0] != ';') {
          return fail(error, 400, "malformed chunk size '" + excerpt(line) + "'");
        }
        for (char c : ext) {
          if (!is_value_char(static_cast<unsigned char>(c))) {
            return fail(error, 400, "control character in a chunk extension");
          }
        }
        used += end + 2;
        if (size == 0) {
          state_ = State::kTrailer;
        } else {
          if (size > max_ - received_) return too_large();
          remaining_ = size;
          state_ = State::kChunkData;
        }
        break;
      }
      case State::kChunkEnd:
        if (!rest.empty() && rest[0] != '\r') {
          return fail(error, 400, "chunk data not followed by CRLF");
        }
        if (rest.size() < 2) return Parse::kNeedMore;
        if (rest.substr(0, 2) != kCrlf) return fail(error, 400, "chunk data not followed by CRLF");
        used += 2;
        state_ = State::kChunkSize;
        break;
      case State::kTrailer: {
        size_t end = rest.find('\n');
        if (end != std::string_view::npos) {
          if (end == 0 || rest[end - 1] != '\r') {
            return fail(error, 400, "bare LF line ending in a chunked trailer");
          }
          --end;
        }
        if (end == std::string_view::npos || trailer_bytes_ + end > max_trailer_) {
          if (trailer_bytes_ + rest.size() > max_trailer_) {
            return fail(error, 431, "the chunked trailer section is too large");
          }
          return Parse::kNeedMore;
        }
        // Trailer fields are read and dropped: nothing in Tandem uses them.
        std::string_view line = rest.substr(0, end);
        for (char c : line) {
          if (!is_value_char(static_cast<unsigned char>(c))) {
            return fail(error, 400, "control character in a chunked trailer");
          }
        }
        used += end + 2;
        trailer_bytes_ += end + 2;
        if (end == 0) state_ = State::kDone;
        break;
      }
    }
  }
}

bool status_has_body(int status) {
  return status >= 200 && status != 204 && status != 304;
}

std::string_view http_date() {
  static constexpr const char* kDays[] = {"Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"};
  static constexpr const char* kMonths[] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun",
                                            "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};
  // Formatted once per second per thread: it is in every response head. Names spelled out
  // because strftime's follow the locale.
  thread_local std::time_t cached_at = -1;
  thread_local char cached[40];
  thread_local size_t length = 0;
  std::time_t now = std::time(nullptr);
  if (now != cached_at) {
    std::tm tm{};
    gmtime_r(&now, &tm);
    int n = std::snprintf(cached, sizeof cached, "%s, %02d %s %04d %02d:%02d:%02d GMT",
                          kDays[tm.tm_wday % 7], tm.tm_mday, kMonths[tm.tm_mon % 12],
                          tm.tm_year + 1900, tm.tm_hour, tm.tm_min, tm.tm_sec);
    length = n > 0 ? static_cast<size_t>(n) : 0;
    cached_at = now;
  }
  return {cached, length};
}

namespace {

void append_number(std::string& out, uint64_t n, int base = 10) {
  char digits[24];
  auto [end, ec] = std::to_chars(digits, digits + sizeof digits, n, base);
  out.append(digits, end);
}

void append_field(std::string& out, std::string_view name, std::string_view value) {
  out += name;
  out += ": ";
  out += value;
  out += kCrlf;
}

}  // namespace

void append_response_head(std::string& out, int status, std::string_view content_type,
                          const Headers& extra, BodyKind framing, uint64_t length,
                          std::string_view connection) {
  out += "HTTP/1.1 ";
  append_number(out, static_cast<uint64_t>(status));
  out += ' ';
  out += status_reason(status);
  out += kCrlf;
  append_field(out, "Date", http_date());
  if (!content_type.empty()) append_field(out, "Content-Type", content_type);
  for (const auto& [name, value] : extra) {
    if (iequals(name, "Content-Length") || iequals(name, "Transfer-Encoding") ||
        iequals(name, "Connection") || iequals(name, "Content-Type") || iequals(name, "Date")) {
      continue;
    }
    append_field(out, name, value);
  }
  if (framing == BodyKind::kLength) {
    out += "Content-Length: ";
    append_number(out, length);
    out += kCrlf;
  } else if (framing == BodyKind::kChunked) {
    out += "Transfer-Encoding: chunked\r\n";
  }
  if (!connection.empty()) append_field(out, "Connection", connection);
  out += kCrlf;
}

void append_chunk(std::string& out, std::string_view piece) {
  if (piece.empty()) return;
  append_number(out, piece.size(), 16);
  out += kCrlf;
  out += piece;
  out += kCrlf;
}

void append_request(std::string& out, std::string_view method, std::string_view target,
                    std::string_view host, uint16_t port, const Headers& headers,
                    std::string_view body) {
  out += method;
  out += ' ';
  out += target;
  out += " HTTP/1.1\r\nHost: ";
  out += url_host(host);  // an IPv6 literal in brackets (RFC 9110 7.2)
  out += ':';
  append_number(out, port);
  out += kCrlf;
  for (const auto& [name, value] : headers) {
    // The framing and Host are the client's business.
    if (iequals(name, "Host") || iequals(name, "Content-Length") ||
        iequals(name, "Transfer-Encoding") || iequals(name, "Connection")) {
      continue;
    }
    append_field(out, name, value);
  }
  if (!body.empty() && !headers.contains("Content-Type")) {
    append_field(out, "Content-Type", "application/json");
  }
  // Methods that usually carry a body announce an empty one; GET and friends do not.
  bool bodiless = method == "GET" || method == "HEAD" || method == "DELETE" ||
                  method == "OPTIONS" || method == "TRACE";
  if (!body.empty() || !bodiless) {
    out += "Content-Length: ";
    append_number(out, body.size());
    out += kCrlf;
  }
  out += kCrlf;
  out += body;
}

bool idempotent_method(std::string_view method) {
  return method == "GET" || method == "HEAD" || method == "OPTIONS" || method == "TRACE" ||
         method == "PUT" || method == "DELETE";
}

void decode_unreserved_escapes(std::string& path) {
  auto hex_value = [](char c) { return c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10; };
  size_t out = 0;
  for (size_t in = 0; in < path.size(); ++in) {
    if (path[in] == '%' && in + 2 < path.size() && is_hex_digit(path[in + 1]) &&
        is_hex_digit(path[in + 2])) {
      const char decoded =
          static_cast<char>(hex_value(path[in + 1]) * 16 + hex_value(path[in + 2]));
      if (is_unreserved(decoded)) {
        path[out++] = decoded;
        in += 2;
        continue;
      }
    }
    path[out++] = path[in];
  }
  path.resize(out);
}

void copy_fields(const MessageHead& head, Headers& out) {
  out.reserve(out.size() + head.fields.size());
  for (const HeadField& f : head.fields) out.add(std::string(f.name), std::string(f.value));
}

}  // namespace tandem::net::detail
