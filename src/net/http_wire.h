#pragma once
// HTTP/1.1 on the wire (RFC 9112): the message-head and body parsers and the serialisers that the
// server and both clients share. Internal to src/net. The parsers work on bytes the caller owns
// and never allocate in steady state: a parsed head is a set of views into the caller's buffer,
// valid until the caller consumes those bytes.
//
// What is rejected, and why: anything that could make two parsers disagree about where a message
// ends (request smuggling) or that lets input grow without bound. Bare CR or LF, obs-fold
// continuation lines, whitespace before a field's colon, Content-Length values that are not plain
// digits or disagree, Content-Length together with Transfer-Encoding, codings other than chunked,
// chunk sizes that are not hex or overflow, heads over the size limit.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "net/http.h"

namespace tandem::net::detail {

enum class Parse { kNeedMore, kDone, kError };

// Why a message was refused: the status a server answers with and a message for its body.
struct ParseError {
  int status = 400;
  std::string message;
};

enum class BodyKind { kNone, kLength, kChunked, kUntilClose };

struct HeadField {
  std::string_view name;
  std::string_view value;
};

// A parsed message head. The views point into the parsed bytes.
struct MessageHead {
  std::string_view method;  // requests
  std::string_view target;  // requests, in origin form (its path and query), except:
  // requests: an absolute-form target with no path before its query ("http://h?q"); `target` holds
  // "?q", and the path is "/" (RFC 3986 6.2.3), which the buffer has nowhere to view.
  bool empty_path = false;
  int status = 0;    // responses
  int version = 11;  // 10 or 11 (a later HTTP/1 minor version reads as 11)
  std::vector<HeadField> fields;
  BodyKind body = BodyKind::kNone;
  uint64_t content_length = 0;  // kLength
  bool keep_alive = true;
  bool expect_continue = false;  // requests: "Expect: 100-continue" on HTTP/1.1
  size_t head_bytes = 0;         // bytes of the head, the blank line included
};

// Finds and parses one message head at the start of the bytes it is given. Keeps where the
// search for the blank line stopped, so feeding a growing buffer costs linear time in total.
class HeadParser {
 public:
  explicit HeadParser(size_t max_head_bytes) : max_(max_head_bytes) {}

  // kDone fills `head`; kError fills `error` (431 for a head over the limit, 505 for an HTTP
  // version other than 1.x, else 400 or 501).
  // Blank lines before a request line are skipped (RFC 9112 2.2) and counted in head_bytes and
  // against the limit.
  // Bytes that cannot start a request (a TLS handshake, a method that is no token, a bad request
  // line) are an error as soon as they arrive, before the head is complete.
  Parse request(std::string_view in, MessageHead& head, ParseError& error);
  // `head_request`: the response answers a HEAD request (no body whatever it declares).
  // Interim 1xx responses are returned like any other; the caller skips them.
  Parse response(std::string_view in, bool head_request, MessageHead& head, ParseError& error);
  // Before parsing the next message.
  void reset() {
    scanned_ = 0;
    skipped_ = 0;
    lf_scanned_ = 0;
    line_scanned_ = 0;
    start_checked_ = false;
  }

 private:
  // Judges the request line of an incomplete head as far as it arrived.
  Parse check_start(std::string_view partial, ParseError& error);
  // Offset just past the blank line ending the head, or 0 if it is not there yet.
  size_t find_end(std::string_view in, size_t from, ParseError& error, bool& failed);

  size_t max_;
  size_t scanned_ = 0;
  size_t lf_scanned_ = 0;       // find_end: bytes searched for a bare LF
  size_t skipped_ = 0;          // request: bytes of blank lines before the request line
  size_t line_scanned_ = 0;     // check_start: bytes of the first line searched for its end
  bool start_checked_ = false;  // check_start: the request line was complete and valid
};

// De-frames a body: Content-Length, chunked (trailers skipped), or until the connection closes.
class BodyParser {
 public:
  // `max_bytes`: the largest body accepted (413 past it); UINT64_MAX for none.
  void start(const MessageHead& head, uint64_t max_bytes, size_t max_trailer_bytes);
  // Parses what it can of `in`: appends body bytes to `out` and sets `used` to the bytes of `in`
  // it consumed. kDone once the body is complete (never for kUntilClose: the caller ends it at
  // EOF).
  Parse feed(std::string_view in, size_t& used, std::string& out, ParseError& error);
  bool done() const { return state_ == State::kDone; }
  // Bytes of body produced so far.
  uint64_t received() const { return received_; }

 private:
  enum class State { kLength, kUntilClose, kChunkSize, kChunkData, kChunkEnd, kTrailer, kDone };

  State state_ = State::kDone;
  uint64_t remaining_ = 0;
  uint64_t received_ = 0;
  uint64_t max_ = 0;
  size_t trailer_bytes_ = 0;
  size_t max_trailer_ = 0;
};

// --- serialisation: appended to the caller's buffer --------------------------------------------

// 1xx, 204 and 304 responses carry no body and no Content-Length (RFC 9110 8.6).
bool status_has_body(int status);

// The Date field value for now (RFC 9110 5.6.7), cached per thread for the current second.
std::string_view http_date();

// A response head. `framing` is Content-Length: <length> for kLength, Transfer-Encoding: chunked
// for kChunked, nothing for the rest; `connection` is the Connection value or empty. Fields of
// `extra` that are the server's business (framing, Connection, Date, Content-Type) are skipped.
void append_response_head(std::string& out, int status, std::string_view content_type,
                          const Headers& extra, BodyKind framing, uint64_t length,
                          std::string_view connection);
// One chunk of a chunked body (nothing for an empty piece: it would end the body).
void append_chunk(std::string& out, std::string_view piece);
inline constexpr std::string_view kLastChunk = "0\r\n\r\n";

// A request with Host (host:port), the caller's fields, Content-Type application/json when there
// is a body and no Content-Type, and Content-Length when there is a body or the method usually
// carries one.
void append_request(std::string& out, std::string_view method, std::string_view target,
                    std::string_view host, uint16_t port, const Headers& headers,
                    std::string_view body);

// RFC 9110 9.2.2: sending such a request twice has the effect of sending it once, so a client may
// send it again when it cannot know whether the first copy arrived.
bool idempotent_method(std::string_view method);

// RFC 3986 6.2.2.2: decodes the percent-escapes of unreserved characters (ALPHA, DIGIT, "-", ".",
// "_", "~") in a path, which mean the same decoded; others are data, kept as they are.
void decode_unreserved_escapes(std::string& path);

// Copies a parsed head's fields into Headers (names and values were validated by the parser).
void copy_fields(const MessageHead& head, Headers& out);

}  // namespace tandem::net::detail
