// A chat request's messages as its template reads them, in each content format. The expected
// shapes are vLLM's (entrypoints/chat_utils.py: _parse_chat_message_content) except a null
// content in the string format, which stays null as transformers and SGLang pass it.
#include "api/chat_messages.h"

#include <gtest/gtest.h>

#include "api/error.h"

namespace tandem::api {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;
using text::ContentFormat;

const json kConversation = json::parse(R"([
  {"role": "system", "content": "Be brief."},
  {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
  {"role": "assistant", "content": null,
   "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
  {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "4"},
                                                      {"type": "text", "text": "2"}]},
  {"role": "user", "content": []}
])");

TEST(ChatMessages, TheStringFormatJoinsTextPartsWithNewlines) {
  const ordered_json m = template_messages(kConversation, ContentFormat::kString);
  ASSERT_EQ(m.size(), 5u);
  EXPECT_EQ(m[0]["content"], "Be brief.");
  EXPECT_EQ(m[1]["content"], "one\ntwo");
  EXPECT_TRUE(m[2]["content"].is_null());
  EXPECT_EQ(m[2]["tool_calls"][0]["id"], "c1");  // the rest of a message as sent
  EXPECT_EQ(m[3]["content"], "4\n2");
  EXPECT_EQ(m[3]["tool_call_id"], "c1");
  EXPECT_EQ(m[4]["content"], "");
}

TEST(ChatMessages, TheOpenAIFormatGivesEveryContentAsTextParts) {
  const ordered_json m = template_messages(kConversation, ContentFormat::kOpenAI);
  ASSERT_EQ(m.size(), 5u);
  EXPECT_EQ(m[0]["content"], ordered_json::parse(R"([{"type": "text", "text": "Be brief."}])"));
  EXPECT_EQ(m[1]["content"], ordered_json::parse(R"([{"type": "text", "text": "one"},
                                                     {"type": "text", "text": "two"}])"));
  EXPECT_EQ(m[2]["content"], ordered_json::array());
  // Tool results stay one string: templates print them.
  EXPECT_EQ(m[3]["content"], "4\n2");
  EXPECT_EQ(m[4]["content"], ordered_json::array());
}

TEST(ChatMessages, PartsKeepOnlyTheirTypeAndText) {
  const json messages = json::parse(
      R"([{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {}}]}])");
  EXPECT_EQ(template_messages(messages, ContentFormat::kOpenAI)[0]["content"],
            ordered_json::parse(R"([{"type": "text", "text": "x"}])"));
}

TEST(ChatMessages, BadMessagesAreRefusedNamingMessages) {
  for (const char* bad : {
           R"([{"content": "no role"}])",
           R"([{"role": 1, "content": "x"}])",
           R"([{"role": "user", "content": 5}])",
           R"([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}])",
           R"([{"role": "user", "content": [{"type": 3}]}])",
           R"([{"role": "user", "content": ["plain"]}])",
           R"(["not an object"])",
       })
    for (ContentFormat format : {ContentFormat::kString, ContentFormat::kOpenAI}) {
      try {
        template_messages(json::parse(bad), format);
        ADD_FAILURE() << "accepted " << bad;
      } catch (const ApiError& e) {
        EXPECT_EQ(e.status, 400) << bad;
        EXPECT_EQ(e.param, "messages") << bad;
      }
    }
}

}  // namespace
}  // namespace tandem::api
