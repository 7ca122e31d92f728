// SSE framing and parsing without a network.
#include "net/sse.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace tandem::net {
namespace {

TEST(Sse, EventFraming) {
  EXPECT_EQ(sse_event(R"({"a":1})"), "data: {\"a\":1}\n\n");
  EXPECT_EQ(sse_event("one\ntwo"), "data: one\ndata: two\n\n");
  EXPECT_EQ(sse_event(""), "data: \n\n");
  EXPECT_EQ(kSseDone, "data: [DONE]\n\n");
}

TEST(Sse, ParserRoundTripsAnySplit) {
  std::vector<std::string> sent = {R"({"x":"a b"})", "multi\nline\ndata", "", "[DONE]"};
  std::string stream = ": a comment\n\n";
  for (const auto& s : sent) stream += sse_event(s);
  // Every split point into two pieces, and byte by byte.
  for (size_t cut = 0; cut <= stream.size(); ++cut) {
    SseParser parser;
    auto events = parser.feed(std::string_view(stream).substr(0, cut));
    auto rest = parser.feed(std::string_view(stream).substr(cut));
    events.insert(events.end(), rest.begin(), rest.end());
    EXPECT_EQ(events, sent) << "cut at " << cut;
  }
  SseParser parser;
  std::vector<std::string> events;
  for (char c : stream) {
    for (auto& e : parser.feed(std::string_view(&c, 1))) events.push_back(e);
  }
  EXPECT_EQ(events, sent);
  EXPECT_TRUE(SseParser::is_done(events.back()));
}

// The callback form hands out views into the bytes being fed: what an event keeps from an earlier
// piece must survive that piece's buffer being reused (overwritten here) before the event ends.
TEST(Sse, EventsSplitAcrossPiecesSurviveTheirBuffers) {
  std::vector<std::string> sent = {R"({"x":"a b"})", "multi\nline", "[DONE]"};
  std::string stream;
  for (const auto& s : sent) stream += sse_event(s);
  for (size_t cut = 0; cut <= stream.size(); ++cut) {
    SseParser parser;
    std::vector<std::string> events;
    auto keep = [&events](std::string_view data) { events.emplace_back(data); };
    std::string piece = stream.substr(0, cut);
    parser.feed(piece, keep);
    piece.assign(piece.size(), 'x');  // the caller's buffer is reused
    piece = stream.substr(cut);
    parser.feed(piece, keep);
    EXPECT_EQ(events, sent) << "cut at " << cut;
  }
}

TEST(Sse, ParserHandlesCrlfAndOtherFields) {
  SseParser parser;
  auto events = parser.feed("event: x\r\nid: 7\r\ndata:no-space\r\ndata:  two\r\n\r\ndata: b\n");
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0], "no-space\n two");
  EXPECT_TRUE(parser.feed("").empty());
  events = parser.feed("\n");
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0], "b");
}

}  // namespace
}  // namespace tandem::net
