// The gateway's reads of answer text it does not parse, checked against a JSON parser.
#include "gateway/answer_text.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "api/error.h"
#include "util/json.h"

namespace tandem::gateway {
namespace {

using nlohmann::json;

TEST(AnswerText, SplicedMembersJoinTheObject) {
  for (const std::string body : {R"({})", R"({"a":1})", "{ \"a\": [1, {\"b\": 2}] }\n", "{\n}"}) {
    const json spliced = json::parse(splice_fields(body, R"("room":7,"host":"h")"));
    json expected = json::parse(body);
    expected["room"] = 7;
    expected["host"] = "h";
    EXPECT_EQ(spliced, expected) << body;
  }
  EXPECT_EQ(splice_fields("not an object", R"("x":1)"), "not an object");
}

// An engine reads a body's objects in their key order (tools shown to the model, a schema's
// properties generated in it), and nlohmann::json sorts keys: what the gateway writes keeps the
// client's text for each member it did not change.
TEST(AnswerText, ABodyIsWrittenInTheClientsKeyOrderWhereTheGatewayLeftIt) {
  const std::string text =
      "\xEF\xBB\xBF { \"tools\" : [{\"zeta\": 1, \"alpha\": {\"y\": \"}\\\"]\", \"b\": 3}}],\n"
      " \"prompt\": [3, 1, 2], \"stream_options\": {\"z\": true, \"a\": 1}, \"n\": 2,"
      " \"k\\u0065y\": {\"z\": 0, \"a\": 0}, \"dup\": {\"z\": 1, \"a\": 1},"
      " \"dup\": {\"z\": 2, \"a\": 2}, \"s\": \"{\\\"z\\\": 1}\" }";
  json body = parse_untrusted_json(text);
  body["stream_options"]["a"] = 2;  // changed
  body["max_tokens"] = 1;           // added
  body.erase("n");                  // removed
  const std::string out = dump_in_client_order(body, text);
  EXPECT_EQ(json::parse(out), body) << out;  // what the document holds, no more, no less
  for (const char* kept :
       {R"("tools":[{"zeta": 1, "alpha": {"y": "}\"]", "b": 3}}])",  // as sent
        R"("key":{"z": 0, "a": 0})",                                 // its key escaped in the text
        R"("dup":{"z": 2, "a": 2})",  // the last of duplicate keys, as the parsers have it
        R"("stream_options":{"a":2,"z":true})",  // changed: written from the document
        R"("prompt":[3,1,2])",                   // no object, no order to keep
        R"("s":"{\"z\": 1}")"})                  // a string that only looks like one
    EXPECT_NE(out.find(kept), std::string::npos) << kept << " in " << out;
  // Text that is no object leaves the document alone.
  EXPECT_EQ(dump_in_client_order(body, "not json"), body.dump());
}

// An answer cut short can still end in '}': only a parse tells.
TEST(AnswerText, AWholeJsonObjectIsTellableFromOneCutShort) {
  EXPECT_TRUE(is_json_object(" {\"a\":{\"b\":1}}\n"));
  EXPECT_FALSE(is_json_object("{\"a\":{\"b\":1}"));
  EXPECT_TRUE(looks_like_json_object("{\"a\":{\"b\":1}"));
  EXPECT_FALSE(is_json_object("[1]"));
  EXPECT_FALSE(is_json_object(""));
}

TEST(AnswerText, AJsonObjectIsRecognisedByItsBraces) {
  EXPECT_TRUE(looks_like_json_object(" {\"a\":1}\n"));
  EXPECT_FALSE(looks_like_json_object("[1]"));
  EXPECT_FALSE(looks_like_json_object(""));
  EXPECT_FALSE(looks_like_json_object("this is not json {"));
}

TEST(AnswerText, CompletionTokensComeFromTheUsage) {
  const json answer = {{"id", "cmpl-1"},
                       {"choices", {{{"text", "completion_tokens"}, {"index", 0}}}},
                       {"usage", {{"prompt_tokens", 8}, {"completion_tokens", 123}}}};
  EXPECT_EQ(usage_completion_tokens(answer.dump()), 123);
  EXPECT_EQ(usage_completion_tokens(R"({"usage": {"completion_tokens": 45}})"), 45);
  EXPECT_EQ(usage_completion_tokens(R"({"choices":[]})"), -1);
  EXPECT_EQ(usage_completion_tokens(R"({"usage":{"completion_tokens":null}})"), -1);
}

// The reuse a P/D answer reports is rewritten where it is read: the JSON parser reads the new
// number (the whole old one replaced, however long), and nothing else of the text changes; text
// that reports none stays as it is.
TEST(AnswerText, CachedTokensAreRewrittenWhereTheyAreRead) {
  for (const int64_t cached : {int64_t{16}, int64_t{12345678901234567}}) {
    const json answer = {
        {"choices", {{{"text", "\"cached_tokens\": 7"}}}},
        {"usage", {{"prompt_tokens", 64}, {"prompt_tokens_details", {{"cached_tokens", cached}}}}}};
    for (const std::string& text : {answer.dump(), answer.dump(2)}) {
      const std::string rewritten = with_usage_cached_tokens(text, 48);
      json expected = answer;
      expected["usage"]["prompt_tokens_details"]["cached_tokens"] = 48;
      EXPECT_EQ(json::parse(rewritten), expected) << rewritten;
      EXPECT_EQ(usage_cached_tokens(rewritten), 48);
    }
  }
  for (const std::string text : {R"({"usage":{"prompt_tokens_details":null}})",
                                 R"({"usage":{"cached_tokens":null}})", R"({"choices":[]})", ""})
    EXPECT_EQ(with_usage_cached_tokens(text, 48), text);
}

TEST(AnswerText, ErrorEventsAndTokenEventsAreToldApart) {
  EXPECT_TRUE(is_error_event(api::openai_error_body("KV transfer failed", "server_error")));
  EXPECT_FALSE(carries_tokens(api::openai_error_body("KV transfer failed", "server_error")));
  const std::string chunk =
      R"({"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"error"}]})";
  EXPECT_FALSE(is_error_event(chunk));
  EXPECT_TRUE(carries_tokens(chunk));
  EXPECT_TRUE(carries_tokens(R"({"choices":[{"index":0,"text":"[] and []"}]})"));
  EXPECT_FALSE(carries_tokens("[DONE]"));
  EXPECT_FALSE(carries_tokens(R"({"id":"cmpl-1","choices":[],"usage":{"completion_tokens":3}})"));
}

}  // namespace
}  // namespace tandem::gateway
