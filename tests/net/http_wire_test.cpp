// The HTTP/1.1 wire code on its own: what the head and body parsers accept, what they refuse and
// with which status, fed whole and byte by byte; and what the serialisers write.
#include "net/http_wire.h"

#include <gtest/gtest.h>

#include <string>
#include <string_view>

namespace tandem::net::detail {
namespace {

struct Result {
  Parse parse = Parse::kNeedMore;
  ParseError error;
  MessageHead head;
};

Result parse_request(std::string_view bytes, size_t max_head = 4096) {
  HeadParser parser(max_head);
  Result r;
  r.parse = parser.request(bytes, r.head, r.error);
  return r;
}

// A request head, then its body de-framed; returns the status of the first refusal or 0.
int request_status(std::string_view bytes, uint64_t max_body = 1024, std::string* body = nullptr) {
  Result r = parse_request(bytes);
  if (r.parse == Parse::kError) return r.error.status;
  if (r.parse == Parse::kNeedMore) return -1;
  BodyParser b;
  b.start(r.head, max_body, 1024);
  std::string out;
  size_t used = 0;
  Parse p = b.feed(bytes.substr(r.head.head_bytes), used, out, r.error);
  if (p == Parse::kError) return r.error.status;
  if (p == Parse::kNeedMore) return -1;
  if (body) *body = out;
  return 0;
}

TEST(HttpWire, ParsesARequestHead) {
  Result r = parse_request(
      "POST /v1/completions?a=1 HTTP/1.1\r\nHost: x\r\nX-Pad:  spaced value \t\r\n"
      "Content-Length: 5\r\n\r\nhello");
  ASSERT_EQ(r.parse, Parse::kDone) << r.error.message;
  EXPECT_EQ(r.head.method, "POST");
  EXPECT_EQ(r.head.target, "/v1/completions?a=1");
  EXPECT_EQ(r.head.version, 11);
  ASSERT_EQ(r.head.fields.size(), 3u);
  EXPECT_EQ(r.head.fields[1].name, "X-Pad");
  EXPECT_EQ(r.head.fields[1].value, "spaced value");
  EXPECT_EQ(r.head.body, BodyKind::kLength);
  EXPECT_EQ(r.head.content_length, 5u);
  EXPECT_TRUE(r.head.keep_alive);
  std::string body;
  EXPECT_EQ(
      request_status("POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nhello", 1024, &body),
      0);
  EXPECT_EQ(body, "hello");
}

// A client that talks to the gateway as to a proxy names the whole URL: the resource is its path.
TEST(HttpWire, AnAbsoluteFormTargetIsItsPathAndQuery) {
  for (const auto& [line, target] : std::vector<std::pair<std::string, std::string>>{
           {"POST http://gw:8080/v1/completions?a=1 HTTP/1.1", "/v1/completions?a=1"},
           {"GET HTTPS://gw/health HTTP/1.1", "/health"},
           {"GET http://gw HTTP/1.1", "/"},
           {"GET /http://x HTTP/1.1", "/http://x"}}) {
    const std::string bytes = line + "\r\nHost: gw\r\n\r\n";  // the head views it
    Result r = parse_request(bytes);
    ASSERT_EQ(r.parse, Parse::kDone) << line << ": " << r.error.message;
    EXPECT_EQ(r.head.target, target) << line;
  }
  // RFC 3986 6.2.3: an empty path is "/", also before a query.
  Result r = parse_request("GET http://gw:80?a=1 HTTP/1.1\r\nHost: gw\r\n\r\n");
  ASSERT_EQ(r.parse, Parse::kDone) << r.error.message;
  EXPECT_TRUE(r.head.empty_path);
  EXPECT_EQ(r.head.target, "?a=1");
  EXPECT_FALSE(parse_request("GET http://gw/?a=1 HTTP/1.1\r\nHost: gw\r\n\r\n").head.empty_path);
}

// RFC 3986 6.2.2.2: an escape of an unreserved character means that character, so a path is
// routed with those decoded; any other escape is data the path would read differently decoded
// (%2F a segment break), so it stays, and nothing is decoded twice.
TEST(HttpWire, APathsEscapesOfUnreservedCharactersAreDecoded) {
  for (const auto& [path, normal] : std::vector<std::pair<std::string, std::string>>{
           {"/v1/%6dodels", "/v1/models"},
           {"/%41%5a%61%7A%30%39%2d%2E%5f%7e", "/AZaz09-._~"},
           {"/v1%2Fmodels", "/v1%2Fmodels"},
           {"/a%2fb%20c%25d%3F%C3%A4", "/a%2fb%20c%25d%3F%C3%A4"},
           {"/%2541", "/%2541"},
           {"/%%41", "/%A"},
           {"/a%4", "/a%4"},
           {"/a%", "/a%"},
           {"/%zz%4g", "/%zz%4g"},
           {"/plain", "/plain"}}) {
    std::string decoded = path;
    decode_unreserved_escapes(decoded);
    EXPECT_EQ(decoded, normal) << path;
  }
}

TEST(HttpWire, KeepAliveFollowsVersionAndConnection) {
  EXPECT_TRUE(parse_request("GET / HTTP/1.1\r\nHost: h\r\n\r\n").head.keep_alive);
  EXPECT_FALSE(
      parse_request("GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n").head.keep_alive);
  EXPECT_FALSE(parse_request("GET / HTTP/1.0\r\n\r\n").head.keep_alive);
  EXPECT_TRUE(parse_request("GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n").head.keep_alive);
  EXPECT_FALSE(parse_request("GET / HTTP/1.1\r\nHost: h\r\nConnection: upgrade, CLOSE\r\n\r\n")
                   .head.keep_alive);
  EXPECT_TRUE(parse_request(
                  "POST / HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n")
                  .head.expect_continue);
  EXPECT_FALSE(parse_request("POST / HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n")
                   .head.expect_continue);
}

// RFC 9112 2.3: a later minor version of HTTP/1 is read as HTTP/1.1, the highest this server
// speaks; RFC 9110 15.6.6: another major version is 505, whether the head is complete or not.
TEST(HttpWire, ALaterHttp1MinorVersionIsHttp11AndAnotherMajorIs505) {
  for (std::string_view version : {"HTTP/1.2", "HTTP/1.9"}) {
    Result r = parse_request("GET /x " + std::string(version) + "\r\nHost: h\r\n\r\n");
    ASSERT_EQ(r.parse, Parse::kDone) << version << ": " << r.error.message;
    EXPECT_EQ(r.head.version, 11) << version;
    EXPECT_TRUE(r.head.keep_alive) << version;
    EXPECT_EQ(parse_request("GET /x " + std::string(version) + "\r\n\r\n").error.status, 400)
        << version << " needs a Host as HTTP/1.1 does";
  }
  for (std::string_view version : {"HTTP/2.0", "HTTP/3.0", "HTTP/0.9", "HTTP/9.9"}) {
    for (std::string_view rest : {"\r\nHost: h\r\n\r\n", "\r\nHost: h"}) {
      Result r = parse_request("GET /x " + std::string(version) + std::string(rest));
      ASSERT_EQ(r.parse, Parse::kError) << version;
      EXPECT_EQ(r.error.status, 505) << version;
      EXPECT_NE(r.error.message.find(version), std::string::npos) << r.error.message;
    }
  }
  HeadParser parser(4096);
  MessageHead head;
  ParseError error;
  ASSERT_EQ(parser.response("HTTP/1.2 200 OK\r\nContent-Length: 0\r\n\r\n", false, head, error),
            Parse::kDone);
  EXPECT_EQ(head.version, 11);
  EXPECT_TRUE(head.keep_alive);
}

TEST(HttpWire, SkipsBlankLinesBeforeTheRequestLine) {
  Result r = parse_request("\r\n\r\nGET /x HTTP/1.1\r\nHost: h\r\n\r\n");
  ASSERT_EQ(r.parse, Parse::kDone);
  EXPECT_EQ(r.head.target, "/x");
  EXPECT_EQ(r.head.head_bytes, 4 + 15u + 2 + 9 + 2);
}

// Blank lines are skipped once (not rescanned on every read) and count against the head limit:
// a client cannot send them without end.
TEST(HttpWire, BlankLinesBeforeARequestCountAgainstTheLimit) {
  const std::string request = "GET /x HTTP/1.1\r\nHost: h\r\n\r\n";
  std::string in;
  for (int i = 0; i < 100; ++i) in += "\r\n";
  HeadParser parser(4096);
  MessageHead head;
  ParseError error;
  // Arriving in pieces, a pair at a time, then the request.
  for (size_t n = 2; n <= in.size(); n += 2) {
    ASSERT_EQ(parser.request(std::string_view(in).substr(0, n), head, error), Parse::kNeedMore);
  }
  in += request;
  ASSERT_EQ(parser.request(in, head, error), Parse::kDone);
  EXPECT_EQ(head.head_bytes, in.size());

  std::string flood;
  for (int i = 0; i < 2049; ++i) flood += "\r\n";
  Result over = parse_request(flood, 4096);
  ASSERT_EQ(over.parse, Parse::kError);
  EXPECT_EQ(over.error.status, 431);
  over = parse_request(flood.substr(0, 4080) + request, 4096);  // fits without them
  ASSERT_EQ(over.parse, Parse::kError);
  EXPECT_EQ(over.error.status, 431);
}

// A line ended by LF alone is refused as soon as it arrives, in a head (whole or not yet), a chunk
// header or a trailer; before, the parser waited for a CRLF that never came.
TEST(HttpWire, BareLineFeedsAreRefusedAtOnce) {
  for (std::string_view bad : {"GET /x HTTP/1.1\nHost: h\n\n", "GET /x HTTP/1.1\nHost: h\n",
                               "GET /x HTTP/1.1\r\nHost: h\nX: y\r\n\r\n", "\r\n\nGET /x",
                               "GET /x HTTP/1.1\r\nHost: h\r\n\n"}) {
    Result r = parse_request(bad);
    ASSERT_EQ(r.parse, Parse::kError) << bad;
    EXPECT_EQ(r.error.status, 400) << bad;
    EXPECT_EQ(r.error.message, "bare LF line ending (lines must end with CRLF)") << bad;
  }
  const std::string head = "POST /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n";
  for (std::string_view bad : {"5\nhello", "5\r\nhello\n", "0\r\nX: y\n"}) {
    EXPECT_EQ(request_status(head + std::string(bad)), 400) << bad;
  }
  MessageHead response;
  ParseError error;
  HeadParser parser(4096);
  EXPECT_EQ(parser.response("HTTP/1.1 200 OK\nContent-Length: 2\n\nok", false, response, error),
            Parse::kError);
  EXPECT_EQ(error.status, 502);
}

TEST(HttpWire, IncompleteHeadNeedsMoreWhateverTheSplit) {
  const std::string full = "GET /x HTTP/1.1\r\nHost: a\r\nX-Y: z\r\n\r\n";
  HeadParser parser(4096);
  MessageHead head;
  ParseError error;
  for (size_t n = 0; n < full.size(); ++n) {
    ASSERT_EQ(parser.request(std::string_view(full).substr(0, n), head, error), Parse::kNeedMore)
        << n;
  }
  ASSERT_EQ(parser.request(full, head, error), Parse::kDone);
  EXPECT_EQ(head.fields.size(), 2u);
  EXPECT_EQ(head.head_bytes, full.size());
}

TEST(HttpWire, RefusesMalformedRequestHeads) {
  for (std::string_view bad : {
           "GARBAGE\r\n\r\n",
           "GET /x\r\n\r\n",
           "GET /x HTTP/1.10\r\nHost: h\r\n\r\n",
           "GET /x http/1.1\r\nHost: h\r\n\r\n",
           "GET /x HTTP/2\r\nHost: h\r\n\r\n",
           "GET /x HTTP/1.1 extra\r\n\r\n",
           "G(T /x HTTP/1.1\r\nHost: h\r\n\r\n",
           "GET /a\x01 HTTP/1.1\r\nHost: h\r\n\r\n",
           "GET  /x HTTP/1.1\r\nHost: h\r\n\r\n",
           "GET /x HTTP/1.1\r\nHost: h\r\nBad Header\r\n\r\n",
           "GET /x HTTP/1.1\r\nHost: h\r\nName : value\r\n\r\n",
           "GET /x HTTP/1.1\r\nHost: h\r\n: value\r\n\r\n",
           "GET /x HTTP/1.1\r\nHost: h\r\nA: 1\r\n folded\r\n\r\n",  // obs-fold
           "GET /x HTTP/1.1\r\nHost: h\r\nA: bare\nB: lf\r\n\r\n",   // a bare LF inside the head
           "GET /x HTTP/1.1\r\nHost: h\r\nA: bare\rcr\r\n\r\n",      // a bare CR
           "GET /x\nHTTP/1.1\r\nHost: h\r\n\r\n",
       }) {
    Result r = parse_request(bad);
    EXPECT_EQ(r.parse, Parse::kError) << bad;
    EXPECT_EQ(r.error.status, 400) << bad;
    EXPECT_FALSE(r.error.message.empty());
  }
  static constexpr char kNul[] = "GET /x HTTP/1.1\r\nHost: h\r\nA: x\0y\r\n\r\n";
  EXPECT_EQ(parse_request(std::string_view(kNul, sizeof kNul - 1)).error.status, 400);
}

TEST(HttpWire, RefusesAmbiguousFraming) {
  // Request smuggling needs two parsers that disagree on where a message ends.
  EXPECT_EQ(request_status(
                "POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n"),
            400);
  EXPECT_EQ(request_status("POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n"
                           "Transfer-Encoding: chunked\r\n\r\n"),
            400);
  EXPECT_EQ(request_status("POST /x HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n"), 400);
  for (std::string_view length :
       {"abc", "-1", "+5", "0x10", "1 2", "99999999999999999999", "", "5, 5"}) {
    EXPECT_EQ(request_status("POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: " +
                             std::string(length) + "\r\n\r\n"),
              400)
        << length;
  }
  // Equal repeated values are one length.
  std::string body;
  EXPECT_EQ(request_status(
                "POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok",
                1024, &body),
            0);
  EXPECT_EQ(body, "ok");
  // Codings we would have to decode, before a final chunked, are not implemented.
  EXPECT_EQ(
      request_status("POST /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"),
      501);
  EXPECT_EQ(request_status("POST /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip\r\n"
                           "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
            501);
}

// RFC 9112 6.3: a request whose last transfer coding is not chunked, or that has chunked twice,
// has no knowable end: 400, whatever the codings (not 501, which says "try without").
TEST(HttpWire, ChunkedMustBeTheFinalCodingOnce) {
  for (std::string_view te :
       {"chunked, chunked", "chunked, identity", "identity", "gzip", "xchunked",
        "chunked\r\nTransfer-Encoding: chunked", "chunked\r\nTransfer-Encoding: gzip"}) {
    Result r = parse_request(
        "POST /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: " + std::string(te) + "\r\n\r\n");
    ASSERT_EQ(r.parse, Parse::kError) << te;
    EXPECT_EQ(r.error.status, 400) << te;
    EXPECT_EQ(r.error.message, "chunked must be the final transfer coding, once") << te;
  }
  EXPECT_EQ(request_status("POST /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: Chunked\r\n\r\n"
                           "0\r\n\r\n"),
            0);
}

// RFC 9112 3.2: a request with more than one Host field, or a Host that is no uri-host [":" port]
// (RFC 3986 3.2.2: an IP literal in brackets, or a reg-name of unreserved characters,
// percent-escapes and sub-delims), is refused with 400 whatever its version; an HTTP/1.0 request
// may still leave Host out. An IPv6 literal may name a zone, as RFC 6874 writes it ("%25en0") or
// as Tandem's own client sends a topology's link-local engine ("%eth0").
TEST(HttpWire, AHostThatIsNoHostAndPortOrComesTwiceIsRefused) {
  for (std::string_view host :
       {"example.com", "example.com:8080", "127.0.0.1:80", "[::1]:8000", "[2001:db8::7]",
        "[::ffff:192.0.2.1]", "[fe80::1%25en0]", "[fe80::1%eth0]:8000", "[v1.fe80::a+en1]:9",
        "ex%41mple.com", "a-b_c~d.e", "!$&'()*+,;=", "x:", ""}) {
    for (std::string_view version : {"HTTP/1.1", "HTTP/1.0"}) {
      const std::string request =
          "GET / " + std::string(version) + "\r\nHost: " + std::string(host) + "\r\n\r\n";
      Result r = parse_request(request);
      EXPECT_EQ(r.parse, Parse::kDone) << request << r.error.message;
    }
  }
  for (std::string_view host : {"exa mple.com",
                                "a:b:c/d",
                                "a/b",
                                "host:80:81",
                                "host:8x",
                                "user@host",
                                "h?q",
                                "h#f",
                                "ex%4",
                                "ex%zzample",
                                "[::1",
                                "::1",
                                "[::1]x",
                                "[::1]:8x",
                                "[::g]",
                                "[1:2:3:4:5:6:7:8:9]",
                                "[fe80::1%]",
                                "[fe80::1%e/0]",
                                "[::1%25]x",
                                "[v1.]",
                                "[vx.a]",
                                "[v1a]",
                                "\xc3\xa4.example",
                                "a\\b",
                                "<h>"}) {
    for (std::string_view version : {"HTTP/1.1", "HTTP/1.0"}) {
      const std::string request =
          "GET / " + std::string(version) + "\r\nHost: " + std::string(host) + "\r\n\r\n";
      Result r = parse_request(request);
      ASSERT_EQ(r.parse, Parse::kError) << request;
      EXPECT_EQ(r.error.status, 400) << request;
      EXPECT_NE(r.error.message.find("Host"), std::string::npos) << r.error.message;
    }
  }
  for (std::string_view version : {"HTTP/1.1", "HTTP/1.0"}) {
    const std::string request =
        "GET / " + std::string(version) + "\r\nHost: a\r\nX: y\r\nhost: a\r\n\r\n";
    Result r = parse_request(request);
    ASSERT_EQ(r.parse, Parse::kError) << request;
    EXPECT_EQ(r.error.status, 400) << request;
    EXPECT_EQ(r.error.message, "more than one Host header") << request;
  }
  EXPECT_EQ(parse_request("GET / HTTP/1.0\r\n\r\n").parse, Parse::kDone);
  EXPECT_EQ(parse_request("GET / HTTP/1.1\r\n\r\n").error.status, 400);
}

TEST(HttpWire, HeadLimitIs431) {
  std::string big = "GET /x HTTP/1.1\r\nHost: h\r\nX: " + std::string(5000, 'a') + "\r\n\r\n";
  Result r = parse_request(big, 4096);
  EXPECT_EQ(r.parse, Parse::kError);
  EXPECT_EQ(r.error.status, 431);
  // Without the end of the head in sight: refused as soon as the limit is passed.
  r = parse_request(std::string_view(big).substr(0, 4200), 4096);
  EXPECT_EQ(r.error.status, 431);
  r = parse_request(std::string_view(big).substr(0, 4000), 4096);
  EXPECT_EQ(r.parse, Parse::kNeedMore);
}

TEST(HttpWire, ChunkedBodies) {
  std::string body;
  EXPECT_EQ(request_status("POST /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
                           "5\r\nhello\r\n1;ext=1\r\n \r\nA\r\n0123456789\r\n0\r\nTrail: x\r\n\r\n",
                           1024, &body),
            0);
  EXPECT_EQ(body, "hello 0123456789");
  // Fed one byte at a time, the same body comes out.
  const std::string wire = "5\r\nhello\r\n10\r\n0123456789abcdef\r\n0\r\n\r\n";
  BodyParser b;
  MessageHead head;
  head.body = BodyKind::kChunked;
  b.start(head, 1024, 1024);
  std::string out;
  ParseError error;
  std::string pending;
  Parse p = Parse::kNeedMore;
  for (char c : wire) {
    pending += c;
    size_t used = 0;
    p = b.feed(pending, used, out, error);
    ASSERT_NE(p, Parse::kError) << error.message;
    pending.erase(0, used);
  }
  EXPECT_EQ(p, Parse::kDone);
  EXPECT_EQ(out, "hello0123456789abcdef");
}

// RFC 9112 7.1: chunk-size = 1*HEXDIG, so leading zeros say nothing about its size; only the
// digits after them count against the bound (15, which no body limit comes near).
TEST(HttpWire, LeadingZerosOfAChunkSizeDoNotCount) {
  const std::string head = "POST /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n";
  std::string body;
  EXPECT_EQ(request_status(head + "0000000000000002\r\nok\r\n" + std::string(40, '0') +
                               "3;x=y\r\n!!!\r\n" + std::string(30, '0') + "\r\n\r\n",
                           1024, &body),
            0);
  EXPECT_EQ(body, "ok!!!");
  EXPECT_EQ(request_status(head + "000" + std::string(16, 'f') + "\r\n", UINT64_MAX), 400);
}

TEST(HttpWire, RefusesBadChunks) {
  const std::string head = "POST /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n";
  for (std::string_view bad : {
           "x\r\n",                               // not hex
           "-5\r\nhello\r\n",                     // a sign
           "0x5\r\nhello\r\n",                    // a prefix
           "5 x\r\nhello\r\n",                    // junk after the size
           "fffffffffffffffff\r\n",               // overflows
           "5\r\nhelloXX0\r\n\r\n",               // data not followed by CRLF
           "5\r\nhello\r\n0\r\nBad\x01\r\n\r\n",  // a control byte in a trailer
       }) {
    EXPECT_EQ(request_status(head + std::string(bad)), 400) << bad;
  }
  // A chunk header that never ends is refused once it is implausibly long.
  EXPECT_EQ(request_status(head + std::string(5000, '1')), 400);
}

TEST(HttpWire, BodyLimitIs413) {
  EXPECT_EQ(request_status("POST /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
                           "258\r\n" +
                               std::string(600, 'b') + "\r\n258\r\n" + std::string(600, 'b') +
                               "\r\n0\r\n\r\n",
                           1024),
            413);
  // One chunk declaring more than the limit is refused before its data arrives.
  EXPECT_EQ(
      request_status("POST /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\nffffff\r\n",
                     1024),
      413);
  EXPECT_EQ(request_status("POST /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
                           "400\r\n" +
                               std::string(1024, 'c') + "\r\n0\r\n\r\n",
                           1024),
            0);
}

TEST(HttpWire, ParsesResponses) {
  HeadParser parser(4096);
  MessageHead head;
  ParseError error;
  ASSERT_EQ(parser.response("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", false, head, error),
            Parse::kDone);
  EXPECT_EQ(head.status, 200);
  EXPECT_EQ(head.body, BodyKind::kLength);
  EXPECT_TRUE(head.keep_alive);
  parser.reset();
  // No framing: the body runs to the end of the connection, which cannot be reused.
  ASSERT_EQ(parser.response("HTTP/1.1 200 OK\r\n\r\n", false, head, error), Parse::kDone);
  EXPECT_EQ(head.body, BodyKind::kUntilClose);
  EXPECT_FALSE(head.keep_alive);
  parser.reset();
  // No reason phrase; 204 and HEAD answers have no body whatever they declare.
  ASSERT_EQ(parser.response("HTTP/1.1 204\r\n\r\n", false, head, error), Parse::kDone);
  EXPECT_EQ(head.body, BodyKind::kNone);
  EXPECT_TRUE(head.keep_alive);
  parser.reset();
  ASSERT_EQ(parser.response("HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n", true, head, error),
            Parse::kDone);
  EXPECT_EQ(head.body, BodyKind::kNone);
  for (std::string_view bad :
       {"HTTP/1.1 2000 OK\r\n\r\n", "HTTP/1.1 20 OK\r\n\r\n", "HTTX/1.1 200 OK\r\n\r\n",
        "HTTP/1.1 099 Hm\r\n\r\n", "HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n"}) {
    parser.reset();
    EXPECT_EQ(parser.response(bad, false, head, error), Parse::kError) << bad;
  }
}

TEST(HttpWire, SerialisesRequestsAndResponses) {
  std::string out;
  Headers h;
  h.add("X-A", "1");
  h.add("Host", "ignored");
  h.add("Content-Length", "99");
  append_request(out, "POST", "/v1/x", "127.0.0.1", 8000, h, "{}");
  EXPECT_EQ(out,
            "POST /v1/x HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nX-A: 1\r\n"
            "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}");
  out.clear();
  append_request(out, "GET", "/", "::1", 80, {}, "");
  EXPECT_EQ(out, "GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n");

  out.clear();
  Headers extra;
  extra.add("Allow", "GET");
  extra.add("Connection", "keep-alive");  // the server's business: dropped
  append_response_head(out, 405, "application/json", extra, BodyKind::kLength, 12, "close");
  EXPECT_EQ(out.rfind("HTTP/1.1 405 Method Not Allowed\r\nDate: ", 0), 0u) << out;
  EXPECT_NE(out.find("\r\nContent-Type: application/json\r\nAllow: GET\r\nContent-Length: 12\r\n"
                     "Connection: close\r\n\r\n"),
            std::string::npos)
      << out;
  EXPECT_EQ(out.find("keep-alive"), std::string::npos);
  out.clear();
  append_chunk(out, "");
  EXPECT_EQ(out, "");
  append_chunk(out, std::string(26, 'z'));
  EXPECT_EQ(out, "1a\r\n" + std::string(26, 'z') + "\r\n");
}

}  // namespace
}  // namespace tandem::net::detail
