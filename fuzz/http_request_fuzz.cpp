// Fuzzes the HTTP/1.1 message parsers (net/http_wire.h) the way the server's connections drive
// them: a byte stream of pipelined requests arrives in pieces; each head is parsed from a growing
// buffer, its fields copied, its body (Content-Length or chunked, trailers included) de-framed,
// and the next request starts after it. The first input byte picks the piece size and, with its
// top bit, parses responses instead (what the clients read from engines). Errors are the parsers'
// own results (Parse::kError), never exceptions: any exception, crash or sanitizer report is a
// finding, and so is a broken invariant (a head longer than its input, a body longer than its
// Content-Length).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "net/http.h"
#include "net/http_wire.h"

namespace {

using tandem::net::Headers;
using namespace tandem::net::detail;

constexpr size_t kMaxHead = 8 << 10;  // small, so the 431 path is reached too
constexpr uint64_t kMaxBody = 64 << 10;

void check(bool ok) {
  if (!ok) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t control = data[0];
  const bool responses = control & 0x80;
  const bool head_request = control & 0x40;
  // 0: everything at once; else 1..63 bytes per read.
  const size_t piece = control & 0x3f;
  const std::string_view input(reinterpret_cast<const char*>(data + 1), size - 1);

  HeadParser heads(kMaxHead);
  BodyParser body;
  MessageHead head;
  ParseError error;
  std::string buffer, out;
  size_t arrived = 0;
  bool in_body = false;
  auto receive = [&] {
    const size_t n = piece == 0 ? input.size() - arrived : std::min(piece, input.size() - arrived);
    buffer.append(input.substr(arrived, n));
    arrived += n;
    return n > 0;
  };
  receive();
  for (int messages = 0; messages < 1000; ++messages) {
    if (!in_body) {
      const Parse r = responses ? heads.response(buffer, head_request, head, error)
                                : heads.request(buffer, head, error);
      if (r == Parse::kError) return 0;
      if (r == Parse::kNeedMore) {
        if (!receive()) return 0;
        --messages;
        continue;
      }
      check(head.head_bytes > 0 && head.head_bytes <= buffer.size());
      Headers fields;
      copy_fields(head, fields);
      buffer.erase(0, head.head_bytes);
      heads.reset();
      if (head.body == BodyKind::kLength && head.content_length > kMaxBody) return 0;  // 413
      body.start(head, kMaxBody, kMaxHead);
      out.clear();
      in_body = true;
    }
    size_t used = 0;
    const Parse r = body.feed(buffer, used, out, error);
    check(used <= buffer.size());
    buffer.erase(0, used);
    check(out.size() == body.received() && body.received() <= kMaxBody);
    if (r == Parse::kError) return 0;
    if (r == Parse::kNeedMore) {
      if (!receive()) return 0;  // EOF: the connection ends (a body until close is complete)
      --messages;
      continue;
    }
    if (head.body == BodyKind::kLength) check(out.size() == head.content_length);
    if (head.body == BodyKind::kNone) check(out.empty());
    in_body = false;
  }
  return 0;
}
