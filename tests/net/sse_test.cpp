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

// What the parser holds between feeds is the event not ended yet, whether its last line is
// incomplete or its data lines came whole but no blank line ended it; an ended event leaves
// nothing held, so a stream of any length in events of bounded size holds a bounded amount.
TEST(Sse, PendingBytesAreTheEventNotEndedYet) {
  SseParser parser;
  EXPECT_EQ(parser.pending_bytes(), 0u);
  ASSERT_EQ(parser.feed(sse_event("first")).size(), 1u);
  EXPECT_EQ(parser.pending_bytes(), 0u);
  const std::string endless(1000, 'x');
  EXPECT_TRUE(parser.feed("data: " + endless).empty());
  EXPECT_EQ(parser.pending_bytes(), 6 + endless.size());
  EXPECT_TRUE(parser.feed(endless).empty());
  EXPECT_EQ(parser.pending_bytes(), 6 + 2 * endless.size());
  // Its line ends, the event does not: its data is held (without the field name).
  EXPECT_TRUE(parser.feed("\ndata: more\n").empty());
  EXPECT_EQ(parser.pending_bytes(), 2 * endless.size() + 1 + 4);
  const auto events = parser.feed("\n");
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0], endless + endless + "\nmore");
  EXPECT_EQ(parser.pending_bytes(), 0u);
  EXPECT_FALSE(parser.mid_event());
}

}  // namespace
}  // namespace tandem::net
