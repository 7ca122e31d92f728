// The gateway's tokenizer reuse: the ids it computes are the engine's own, the tokens-in body it
// sends makes the engine run the same request, and the engine's completion answers translate back
// into exactly what the engine sends for the chat request itself. Requests that cannot be
// translated pass through.
#include "gateway/tokens_in.h"

#include <gtest/gtest.h>

#include "model/make_model.h"
#include "text/oracle_support.h"
#include "util/hash.h"

namespace tandem::gateway {
namespace {

using api::ApiError;
using api::ApiKind;
using api::ApiRequest;
using api::ModelLimits;
using api::RequestOutput;
using api::ResponseBuilder;
using nlohmann::json;

const char kModel[] = "tiny";

// One tiny-v3 checkpoint folder (config.json and the DeepSeek-V3 tokenizer files, written by
// make_model as `tandem make-model` does) for the whole suite.
class TokensInTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::filesystem::path(test::temp_path("tokens-in-model").replace_extension());
    model::MakeModelOptions o;
    o.preset = "tiny-v3";
    o.out = *dir_;
    o.tokenizer_dir = test::lenml_model("deepseek_v3");
    config_ = new model::ModelConfig(model::make_model(o));
    engine_tok_ = new text::Tokenizer(text::Tokenizer::from_dir(*dir_));
    engine_template_ = new text::ChatTemplate(engine_tok_->chat_template());
    gateway_ = new PromptTokenizer(*dir_, kModel);
  }
  static void TearDownTestSuite() {
    delete gateway_;
    delete engine_template_;
    delete engine_tok_;
    delete config_;
    std::filesystem::remove_all(*dir_);
    delete dir_;
  }

  // What a CPU engine serving the folder as `kModel` uses (CpuExecutor's limits).
  static ModelLimits engine_limits() {
    return {.model_name = kModel,
            .max_model_len = config_->max_position_embeddings,
            .vocab_size = config_->vocab_size};
  }
  static ApiRequest engine_chat(const json& body) {
    return api::parse_chat(body, *engine_tok_, engine_template_, engine_limits());
  }
  static ApiRequest engine_completion(const json& body) {
    return api::parse_completion(body, *engine_tok_, engine_limits());
  }

  inline static std::filesystem::path* dir_ = nullptr;
  inline static model::ModelConfig* config_ = nullptr;
  inline static text::Tokenizer* engine_tok_ = nullptr;
  inline static text::ChatTemplate* engine_template_ = nullptr;
  inline static PromptTokenizer* gateway_ = nullptr;
};

// The engine runs the tokens-in request exactly as it would run the client's request.
void expect_same_request(const ApiRequest& a, const ApiRequest& b) {
  EXPECT_EQ(a.prompts, b.prompts);
  EXPECT_EQ(a.model, b.model);
  EXPECT_EQ(a.n, b.n);
  EXPECT_EQ(a.stream, b.stream);
  EXPECT_EQ(a.include_usage, b.include_usage);
  EXPECT_EQ(a.logprobs, b.logprobs);
  EXPECT_EQ(a.priority, b.priority);
  EXPECT_EQ(a.sampling.temperature, b.sampling.temperature);
  EXPECT_EQ(a.sampling.top_k, b.sampling.top_k);
  EXPECT_EQ(a.sampling.top_p, b.sampling.top_p);
  EXPECT_EQ(a.sampling.min_p, b.sampling.min_p);
  EXPECT_EQ(a.sampling.repetition_penalty, b.sampling.repetition_penalty);
  EXPECT_EQ(a.sampling.presence_penalty, b.sampling.presence_penalty);
  EXPECT_EQ(a.sampling.frequency_penalty, b.sampling.frequency_penalty);
  EXPECT_EQ(a.sampling.seed, b.sampling.seed);
  EXPECT_EQ(a.sampling.max_tokens, b.sampling.max_tokens);
  EXPECT_EQ(a.sampling.stop_token_ids, b.sampling.stop_token_ids);
  EXPECT_EQ(a.sampling.stop, b.sampling.stop);
  EXPECT_EQ(a.sampling.ignore_eos, b.sampling.ignore_eos);
  EXPECT_EQ(a.disagg.remote_decode, b.disagg.remote_decode);
  EXPECT_EQ(a.disagg.has_bootstrap, b.disagg.has_bootstrap);
  EXPECT_EQ(a.disagg.bootstrap_host, b.disagg.bootstrap_host);
  EXPECT_EQ(a.disagg.bootstrap_port, b.disagg.bootstrap_port);
  EXPECT_EQ(a.disagg.bootstrap_room, b.disagg.bootstrap_room);
}

std::vector<json> chat_bodies() {
  return {
      json{{"model", kModel}, {"messages", {{{"role", "user"}, {"content", "Hello! 你好，世界"}}}}},
      json{{"messages",
            {{{"role", "system"}, {"content", "You are terse."}},
             {{"role", "user"}, {"content", "What is 2+2?"}},
             {{"role", "assistant"}, {"content", "4"}},
             {{"role", "user"},
              {"content",
               {{{"type", "text"}, {"text", "And 3+3"}}, {{"type", "text"}, {"text", "?"}}}}}}},
           {"max_completion_tokens", 7},
           {"temperature", 0.5},
           {"top_p", 0.9},
           {"top_k", 20},
           {"seed", 11},
           {"stop", {"\n\n", "END"}},
           {"n", 2},
           {"stream", true},
           {"stream_options", {{"include_usage", true}}},
           {"logprobs", false},
           {"user", "u-1"},
           {"priority", 3}},
      json{{"messages", {{{"role", "user"}, {"content", "Continue"}}}},
           {"add_generation_prompt", false},
           {"max_tokens", 5},
           {"presence_penalty", 0.25},
           {"stop_token_ids", {1, 2}},
           {"ignore_eos", true},
           {"tools", nullptr},
           {"bootstrap_host", "10.0.0.1"},
           {"bootstrap_port", 8998},
           {"bootstrap_room", "12345"}},
  };
}

TEST_F(TokensInTest, ChatIdsAreTheEngines) {
  for (const json& body : chat_bodies()) {
    SCOPED_TRACE(body.dump());
    // The engines said their length (their GET /v1/models): the chat default comes from it.
    const auto t =
        gateway_->tokenize("/v1/chat/completions", body, config_->max_position_embeddings);
    ASSERT_TRUE(t.has_value());
    const ApiRequest engine = engine_chat(body);
    EXPECT_EQ(t->client_kind, ApiKind::kChat);
    EXPECT_EQ(t->ids, engine.prompts.at(0));
    EXPECT_EQ(t->max_tokens, engine.sampling.max_tokens);
    EXPECT_EQ(t->n, engine.n);
    EXPECT_EQ(t->stream, engine.stream);

    // The tokens-in body is a completion that the engine runs as it would run the chat.
    const json sent = tokens_in_body(body, *t);
    EXPECT_FALSE(sent.contains("messages"));
    EXPECT_FALSE(sent.contains("max_completion_tokens"));
    EXPECT_FALSE(sent.contains("add_generation_prompt"));
    EXPECT_FALSE(sent.contains("tools"));
    EXPECT_FALSE(sent.contains("logprobs"));
    EXPECT_EQ(sent["prompt"], json(t->ids));
    if (body.contains("user")) {
      EXPECT_EQ(sent["user"], body["user"]);
    }
    expect_same_request(engine_completion(sent), engine);
  }
}

// The room the engines leave: their KV cache or --max-model-len may hold far less than the
// model's context (config.json), and a default computed from the context is one they refuse.
TEST_F(TokensInTest, ChatDefaultMaxTokensIsTheRoomTheEnginesLeave) {
  const json body = chat_bodies()[0];
  const int64_t engines = 512;
  ASSERT_GT(config_->max_position_embeddings, engines);
  const auto t = gateway_->tokenize("/v1/chat/completions", body, engines);
  ASSERT_TRUE(t.has_value());
  // The folder's template was applied: it opens with BOS and ends with the assistant's turn.
  ASSERT_GT(t->ids.size(), 2u);
  EXPECT_EQ(t->ids.front(), engine_tok_->bos_id());
  EXPECT_EQ(engine_tok_->id_to_token(t->ids.back()), "<｜Assistant｜>");
  EXPECT_EQ(t->max_tokens, engines - int64_t(t->ids.size()));
  // Completions would default to 16: the body says the chat's budget.
  EXPECT_EQ(tokens_in_body(body, *t)["max_tokens"], t->max_tokens);
  // Before any engine said its length the chat passes through (its engine applies the default),
  // although config.json has the model's context.
  EXPECT_FALSE(gateway_->tokenize("/v1/chat/completions", body).has_value());
  // Explicit budgets are judged by the engines' length, as they judge them.
  json explicit_budget = body;
  explicit_budget["max_tokens"] = engines;
  try {
    gateway_->tokenize("/v1/chat/completions", explicit_budget, engines);
    ADD_FAILURE() << "max_tokens past the engines' length was accepted";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, "max_tokens");
    EXPECT_NE(e.message.find("maximum context length is 512 tokens"), std::string::npos)
        << e.message;
  }
  explicit_budget["max_tokens"] = 8;
  EXPECT_EQ(gateway_->tokenize("/v1/chat/completions", explicit_budget)->max_tokens, 8);
}

// The engines' generation config (max_new_tokens, their --generation-config): a chat without
// max_tokens gets what an engine gives it, not the room, and a cap applies as the engine's does.
TEST_F(TokensInTest, MaxTokensFollowTheEnginesGenerationConfig) {
  const int64_t engines = 512;
  for (const auto& [fallback, cap] :
       std::vector<std::pair<int64_t, int64_t>>{{100, 0}, {100000, 0}, {0, 50}, {100, 50}}) {
    SCOPED_TRACE("max_new_tokens " + std::to_string(fallback) + ", cap " + std::to_string(cap));
    PromptTokenizer gateway(*dir_, kModel);
    gateway.use_generation_max_tokens(fallback, cap);
    ModelLimits limits = engine_limits();
    limits.max_model_len = engines;
    limits.sampling.max_tokens = fallback;
    limits.sampling.max_tokens_cap = cap;
    json without = chat_bodies()[0];
    json asked = without;
    asked["max_tokens"] = 300;
    for (const json& body : {without, asked}) {
      const auto t = gateway.tokenize("/v1/chat/completions", body, engines);
      ASSERT_TRUE(t.has_value());
      const ApiRequest engine = api::parse_chat(body, *engine_tok_, engine_template_, limits);
      EXPECT_EQ(t->max_tokens, engine.sampling.max_tokens) << body.dump();
      EXPECT_EQ(engine_completion(tokens_in_body(body, *t)).sampling.max_tokens,
                engine.sampling.max_tokens);
    }
    const int64_t room =
        engines - int64_t(gateway.tokenize("/v1/chat/completions", without, engines)->ids.size());
    const int64_t expected = fallback > 0 ? std::min(fallback, room) : room;
    EXPECT_EQ(gateway.tokenize("/v1/chat/completions", without, engines)->max_tokens,
              cap > 0 ? std::min(expected, cap) : expected);
  }
}

// The template sees messages in the client's key order (Python dicts), as the engine's parser
// reads them from the request's text: Qwen3's prints a call's arguments with tojson, so the
// gateway's ids are the engine's only so.
TEST(TokensIn, ChatIdsFollowTheClientsKeyOrderAsTheEngines) {
  const std::filesystem::path qwen3 = test::lenml_model("qwen3");
  const text::Tokenizer engine_tok = text::Tokenizer::from_dir(qwen3);
  const text::ChatTemplate engine_template(engine_tok.chat_template());
  const ModelLimits limits{.model_name = "q",
                           .max_model_len = 4096,
                           .vocab_size = static_cast<int64_t>(engine_tok.vocab_size())};
  const std::string raw = R"({"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"},
    {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
      "function": {"name": "f", "arguments": {"zeta": 1, "alpha": 2}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "ok"}]})";
  const json body = json::parse(raw);
  const ApiRequest engine = api::parse_chat(body, engine_tok, &engine_template, limits, raw);
  const PromptTokenizer gateway(qwen3, "q", 4096);
  const auto t = gateway.tokenize("/v1/chat/completions", body, 0, raw);
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->ids, engine.prompts.at(0));
  // Without the text the keys are sorted: another prompt.
  EXPECT_NE(gateway.tokenize("/v1/chat/completions", body)->ids, engine.prompts.at(0));
}

// An assistant turn's reasoning, under either name clients send it (reasoning_content, DeepSeek's
// API and SGLang; reasoning, vLLM's), is rendered by the gateway as the engine renders it: Qwen3's
// template writes it in the turn's <think> block (it reads reasoning_content, which vLLM also sets
// from reasoning). Under the name `reasoning` both dropped it.
TEST(TokensIn, AnAssistantTurnsReasoningIsRenderedAsTheEnginesUnderEitherName) {
  const std::filesystem::path qwen3 = test::lenml_model("qwen3");
  const text::Tokenizer engine_tok = text::Tokenizer::from_dir(qwen3);
  const text::ChatTemplate engine_template(engine_tok.chat_templates());
  const ModelLimits limits{.model_name = "q",
                           .max_model_len = 4096,
                           .vocab_size = static_cast<int64_t>(engine_tok.vocab_size())};
  const PromptTokenizer gateway(qwen3, "q", 4096);
  for (const char* name : {"reasoning_content", "reasoning"}) {
    SCOPED_TRACE(name);
    const std::string raw = std::string(R"({"max_tokens": 4, "messages": [
      {"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": null, ")") +
                            name + R"(": "Look it up.",
       "tool_calls": [{"id": "c1", "type": "function",
                       "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "18C"}]})";
    const json body = json::parse(raw);
    const ApiRequest engine = api::parse_chat(body, engine_tok, &engine_template, limits, raw);
    const auto t = gateway.tokenize("/v1/chat/completions", body, 0, raw);
    ASSERT_TRUE(t.has_value());
    EXPECT_EQ(t->ids, engine.prompts.at(0));
    EXPECT_NE(engine_tok.decode(t->ids, false).find("<think>\nLook it up.\n</think>"),
              std::string::npos)
        << engine_tok.decode(t->ids, false);
  }
}

TEST_F(TokensInTest, CompletionIdsAreTheEngines) {
  const std::vector<json> bodies = {
      json{{"prompt", "The quick brown fox"}, {"max_tokens", 8}},
      json{{"model", kModel},
           {"prompt", "多语言 text with émojis 🙂"},
           {"n", 2},
           {"seed", 5},
           {"logprobs", 2},
           {"stream", true}},
      json{{"prompt", {0, 100, 2000}}, {"echo", false}},
      json{{"prompt", "Prefill me"},
           {"max_tokens", 1},
           {"kv_transfer_params", {{"do_remote_decode", true}}}},
  };
  for (const json& body : bodies) {
    SCOPED_TRACE(body.dump());
    const auto t = gateway_->tokenize("/v1/completions", body);
    ASSERT_TRUE(t.has_value());
    const ApiRequest engine = engine_completion(body);
    EXPECT_EQ(t->client_kind, ApiKind::kCompletion);
    EXPECT_EQ(t->ids, engine.prompts.at(0));
    EXPECT_EQ(t->max_tokens, engine.sampling.max_tokens);
    const json sent = tokens_in_body(body, *t);
    json expected = body;
    expected["prompt"] = t->ids;
    EXPECT_EQ(sent, expected);  // only the prompt changes
    const ApiRequest again = engine_completion(sent);
    expect_same_request(again, engine);
    EXPECT_EQ(again.disagg.remote_decode, body.contains("kv_transfer_params"));
  }
}

TEST_F(TokensInTest, PassThrough) {
  auto chat = [](json extra) {
    json body = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}};
    body.update(extra);
    return body;
  };
  const std::vector<json> chats = {
      chat({{"logprobs", true}}),
      chat({{"top_logprobs", 2}}),
      chat({{"tools",
             {{{"type", "function"},
               {"function", {{"name", "f"}, {"parameters", json::object()}}}}}}}),
      chat({{"tool_choice", "auto"}}),
      chat({{"response_format", {{"type", "json_object"}}}}),
      chat({{"echo", true}}),
      chat({{"chat_template", "{{ messages }}"}}),
      json{{"messages",
            {{{"role", "user"},
              {"content",
               {{{"type", "text"}, {"text", "what is this?"}},
                {{"type", "image_url"}, {"image_url", {{"url", "http://x/y.png"}}}}}}}}}},
  };
  for (const json& body : chats) {
    SCOPED_TRACE(body.dump());
    EXPECT_FALSE(gateway_->tokenize("/v1/chat/completions", body).has_value());
  }
  const std::vector<json> completions = {
      json{{"prompt", {"a batch", "of two"}}},
      json{{"prompt", {{1, 2}, {3}}}},
      json{{"prompt", "hello"}, {"echo", true}},
      json{{"prompt", "hello"}, {"add_special_tokens", false}},
  };
  for (const json& body : completions) {
    SCOPED_TRACE(body.dump());
    EXPECT_FALSE(gateway_->tokenize("/v1/completions", body).has_value());
  }
  EXPECT_FALSE(gateway_->tokenize("/generate", json{{"text", "hi"}}).has_value());
  EXPECT_FALSE(gateway_->tokenize("/v1/embeddings", json{{"input", "hi"}}).has_value());
}

TEST_F(TokensInTest, ClientErrorsAreTheEngines) {
  auto error_of = [](std::string_view path, const json& body) {
    try {
      gateway_->tokenize(path, body, config_->max_position_embeddings);
    } catch (const ApiError& e) {
      return e;
    }
    ADD_FAILURE() << "no ApiError for " << body.dump();
    return ApiError{};
  };
  ApiError e = error_of("/v1/chat/completions", json{{"messages", json::array()}});
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.param, "messages");
  e = error_of("/v1/completions", json{{"prompt", "x"}, {"max_tokens", "many"}});
  EXPECT_EQ(e.param, "max_tokens");
  EXPECT_NE(e.message.find("max_tokens"), std::string::npos);
  e = error_of("/v1/completions", json{{"prompt", "x"}, {"model", "other"}});
  EXPECT_EQ(e.status, 404);
  e = error_of("/v1/completions", json{{"max_tokens", 3}});
  EXPECT_EQ(e.param, "prompt");
  e = error_of("/v1/chat/completions", json::array());
  EXPECT_EQ(e.status, 400);
  e = error_of("/v1/completions", json{{"prompt", "x"}, {"max_tokens", 1 << 30}});
  EXPECT_EQ(e.param, "max_tokens");  // beyond the context length of config.json
}

// vLLM's cache_salt: kept in the tokens-in body for the engine, and hashed as the engine hashes
// it (util/hash.h's hash_bytes, its generation API) for the gateway's prefix matching; a salt the
// engine would refuse is refused naming the field.
TEST_F(TokensInTest, CacheSaltIsKeptAndHashedAsTheEngineHashesIt) {
  const json chat = {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                     {"max_tokens", 3},
                     {"cache_salt", "tenant-a"}};
  const json completion = {{"prompt", "hi"}, {"cache_salt", "tenant-a"}};
  for (const auto& [path, body] :
       {std::pair{"/v1/chat/completions", chat}, std::pair{"/v1/completions", completion}}) {
    SCOPED_TRACE(path);
    const auto t = gateway_->tokenize(path, body);
    ASSERT_TRUE(t.has_value());
    EXPECT_EQ(t->cache_salt, hash_bytes("tenant-a"));
    const json sent = tokens_in_body(body, *t);
    EXPECT_EQ(engine_completion(sent).cache_salt, "tenant-a");
  }
  EXPECT_FALSE(gateway_->tokenize("/v1/completions", json{{"prompt", "hi"}})->cache_salt);
  try {
    gateway_->tokenize("/v1/completions", json{{"prompt", "hi"}, {"cache_salt", ""}});
    ADD_FAILURE() << "an empty cache_salt was accepted";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, "cache_salt");
  }
}

TEST(TokensIn, WithoutAConfigTheEnginesJudgeTheLength) {
  // A tokenizer folder without config.json: no context length known.
  const PromptTokenizer tok(test::lenml_model("deepseek_v3"));
  EXPECT_EQ(tok.max_model_len(), 0);
  const json chat = {{"model", "any"}, {"messages", {{{"role", "user"}, {"content", "hi"}}}}};
  // The chat default for max tokens needs the length: passed through.
  EXPECT_FALSE(tok.tokenize("/v1/chat/completions", chat).has_value());
  json with_max = chat;
  with_max["max_tokens"] = 1 << 30;
  const auto t = tok.tokenize("/v1/chat/completions", with_max);
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->max_tokens, 1 << 30);
  // Any model name is accepted when none was configured.
  EXPECT_TRUE(tok.tokenize("/v1/completions", json{{"model", "x"}, {"prompt", "hi"}}).has_value());
  // An explicit length is used.
  const PromptTokenizer limited(test::lenml_model("deepseek_v3"), "", 64);
  EXPECT_EQ(limited.tokenize("/v1/chat/completions", chat)->max_tokens,
            64 - int64_t(limited.tokenize("/v1/chat/completions", chat)->ids.size()));
}

// --- Responses ---------------------------------------------------------------------------

struct Step {
  size_t index;
  RequestOutput out;
};

RequestOutput output(std::string text, std::vector<int32_t> tokens, int64_t completion_tokens,
                     std::string finish = {}) {
  RequestOutput o;
  o.text = std::move(text);
  o.tokens = std::move(tokens);
  o.prompt_tokens = 9;
  o.completion_tokens = completion_tokens;
  o.cached_tokens = 4;
  o.finished = !finish.empty();
  o.finish_reason = std::move(finish);
  return o;
}

// Two choices, interleaved; choice 1 ends with text in its final output, choice 0 on its own.
std::vector<Step> two_choices() {
  return {{0, output("Hel", {10, 11}, 2)},   {1, output("Wor", {20}, 1)},
          {0, output("lo", {12}, 3)},        {1, output("ld!", {21, 22}, 3, "stop")},
          {0, output(" 世界", {13, 14}, 5)}, {0, output("", {15}, 6, "length")}};
}

json without_id(json j) {
  j.erase("id");
  j.erase("created");
  return j;
}

// Runs the outputs through the engine's ResponseBuilder as the chat request and as the
// tokens-in completion, translating the latter; returns the stream events of both (data
// payloads, "[DONE]" last) and their final bodies.
struct Answers {
  std::vector<std::string> chat_events, translated_events;
  std::string chat_body, translated_body;
};

Answers run(const ApiRequest& chat_request, const ApiRequest& completion_request,
            const text::Tokenizer& tok, const std::vector<Step>& steps,
            const std::string& role = "assistant") {
  ResponseBuilder chat(chat_request, tok, "chatcmpl-1", 100);
  ResponseBuilder completion(completion_request, tok, "cmpl-2", 200);
  ResponseTranslator translator(ApiKind::kChat, role);
  Answers r;
  for (const Step& s : steps) {
    for (const json& c : chat.on_output(s.index, s.out)) r.chat_events.push_back(c.dump());
    for (const json& c : completion.on_output(s.index, s.out))
      for (auto& e : translator.event(c.dump())) r.translated_events.push_back(std::move(e));
  }
  EXPECT_TRUE(chat.all_finished());
  if (chat_request.stream) {
    if (auto u = chat.usage_chunk()) r.chat_events.push_back(u->dump());
    if (auto u = completion.usage_chunk())
      for (auto& e : translator.event(u->dump())) r.translated_events.push_back(std::move(e));
    r.chat_events.push_back("[DONE]");
    for (auto& e : translator.event("[DONE]")) r.translated_events.push_back(std::move(e));
  } else {
    r.chat_body = chat.final_body().dump();
    r.translated_body = translator.body(completion.final_body().dump());
  }
  return r;
}

void expect_same_events(const std::vector<std::string>& want, const std::vector<std::string>& got) {
  ASSERT_EQ(want.size(), got.size());
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE("event " + std::to_string(i));
    if (want[i] == "[DONE]") {
      EXPECT_EQ(got[i], "[DONE]");
      continue;
    }
    const json w = json::parse(want[i]), g = json::parse(got[i]);
    EXPECT_EQ(without_id(w), without_id(g));
    EXPECT_EQ(g["id"], "chatcmpl-2");  // the engine's id, named as a chat's
  }
}

TEST_F(TokensInTest, TranslatedAnswersAreTheEnginesChatAnswers) {
  for (const bool stream : {false, true}) {
    // 0: no usage; 1: include_usage; 2: and vLLM's continuous_usage_stats (usage in every chunk,
    // the role chunk with no completion tokens).
    for (const int usage : {0, 1, 2}) {
      if (usage && !stream) continue;  // stream_options without stream is a 400 (vLLM's)
      // Without a generation prompt the answer's role is the last message's (vLLM's).
      for (const bool generation_prompt : {true, false}) {
        SCOPED_TRACE(std::string(stream ? "stream" : "whole") + " usage " + std::to_string(usage) +
                     (generation_prompt ? "" : " no generation prompt"));
        json body = {{"model", kModel},
                     {"messages", {{{"role", "user"}, {"content", "Say hello"}}}},
                     {"n", 2},
                     {"max_tokens", 6},
                     {"stream", stream}};
        if (usage) body["stream_options"] = {{"include_usage", true}};
        if (usage == 2) body["stream_options"]["continuous_usage_stats"] = true;
        if (!generation_prompt) body["add_generation_prompt"] = false;
        const auto t = gateway_->tokenize("/v1/chat/completions", body);
        ASSERT_TRUE(t.has_value());
        const ApiRequest chat_request = engine_chat(body);
        const ApiRequest completion_request = engine_completion(tokens_in_body(body, *t));
        const Answers r =
            run(chat_request, completion_request, *engine_tok_, two_choices(), t->response_role);
        if (!stream) {
          const json want = json::parse(r.chat_body), got = json::parse(r.translated_body);
          EXPECT_EQ(without_id(want), without_id(got));
          EXPECT_EQ(got["object"], "chat.completion");
          EXPECT_EQ(got["choices"][0]["message"]["content"], "Hello 世界");
          EXPECT_EQ(got["choices"][0]["message"]["role"], generation_prompt ? "assistant" : "user");
          EXPECT_EQ(got["choices"][1]["finish_reason"], "stop");
          EXPECT_EQ(got["usage"]["prompt_tokens"], 9);
          continue;
        }
        // 2 role chunks, 5 content chunks, 2 finish chunks, [usage], [DONE].
        EXPECT_EQ(r.chat_events.size(), usage ? 11u : 10u);
        expect_same_events(r.chat_events, r.translated_events);
      }
    }
  }
}

TEST_F(TokensInTest, EmptyUpdatesKeepEachChoicesEvents) {
  // An update without text (a token held back mid-character): the chat answer opens the choice
  // with its role at once, the completion answer says nothing yet, so only the interleaving of
  // choices may differ; each choice's own events are the same.
  json body = {{"messages", {{{"role", "user"}, {"content", "x"}}}},
               {"n", 2},
               {"max_tokens", 6},
               {"stream", true}};
  const auto t = gateway_->tokenize("/v1/chat/completions", body);
  ASSERT_TRUE(t.has_value());
  const std::vector<Step> steps = {{0, output("", {200}, 1)},
                                   {1, output("a", {20}, 1)},
                                   {0, output("é", {201}, 2)},
                                   {1, output("", {21}, 2, "stop")},
                                   {0, output("", {202}, 3, "length")}};
  const Answers r =
      run(engine_chat(body), engine_completion(tokens_in_body(body, *t)), *engine_tok_, steps);
  auto of_choice = [](const std::vector<std::string>& events, int index) {
    std::vector<std::string> out;
    for (const auto& e : events)
      if (e != "[DONE]" && json::parse(e)["choices"][0]["index"] == index) out.push_back(e);
    return out;
  };
  for (int i : {0, 1}) {
    SCOPED_TRACE("choice " + std::to_string(i));
    expect_same_events(of_choice(r.chat_events, i), of_choice(r.translated_events, i));
  }
  EXPECT_EQ(r.chat_events.size(), r.translated_events.size());
}

TEST(ResponseTranslator, CompletionsAndForeignPayloadsPassUnchanged) {
  ResponseTranslator completion(ApiKind::kCompletion);
  const std::string chunk =
      R"({"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"a"}]})";
  EXPECT_EQ(completion.body(chunk), chunk);
  EXPECT_EQ(completion.event(chunk), std::vector<std::string>{chunk});

  ResponseTranslator chat(ApiKind::kChat);
  const std::string error = R"({"error":{"message":"boom","type":"server_error"}})";
  EXPECT_EQ(chat.body(error), error);
  EXPECT_EQ(chat.event(error), std::vector<std::string>{error});
  EXPECT_EQ(chat.event("not json"), std::vector<std::string>{"not json"});
  EXPECT_EQ(chat.event("[DONE]"), std::vector<std::string>{"[DONE]"});
}

// The gateway asks an aggregated engine for a usage chunk the client did not ask for (it says
// what the engine reused): the chunk is dropped, every other event passes.
TEST(ResponseTranslator, DropsTheUsageChunkOnlyWhenTheGatewayAskedForIt) {
  const std::string token =
      R"({"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"[]"}]})";
  const std::string usage =
      R"({"id":"cmpl-1","object":"text_completion","choices":[],"usage":{"prompt_tokens":5,)"
      R"("prompt_tokens_details":{"cached_tokens":0}}})";
  EXPECT_TRUE(is_usage_chunk(usage));
  EXPECT_FALSE(is_usage_chunk(token));
  EXPECT_FALSE(is_usage_chunk("[DONE]"));
  for (ApiKind kind : {ApiKind::kCompletion, ApiKind::kChat}) {
    ResponseTranslator kept(kind);
    EXPECT_EQ(kept.event(usage).size(), 1u);
    ResponseTranslator dropping(kind);
    dropping.drop_usage_chunks();
    EXPECT_TRUE(dropping.event(usage).empty());
    EXPECT_FALSE(dropping.event(token).empty());
    EXPECT_EQ(dropping.event("[DONE]"), std::vector<std::string>{"[DONE]"});
  }
}

TEST(ResponseTranslator, KeepsOtherEnginesFields) {
  // vLLM adds stop_reason per choice and kv_transfer_params / system_fingerprint at the top.
  ResponseTranslator chat(ApiKind::kChat);
  const json got = json::parse(chat.body(
      R"({"id":"x-7","object":"text_completion","created":5,"model":"m","system_fingerprint":null,
          "kv_transfer_params":{"a":1},
          "choices":[{"index":0,"text":"hi","logprobs":null,"finish_reason":"stop",
                      "stop_reason":"END"}],
          "usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}})"));
  EXPECT_EQ(got["id"], "x-7");  // not an engine completion id: kept as it is
  EXPECT_EQ(got["kv_transfer_params"]["a"], 1);
  EXPECT_EQ(got["choices"][0]["stop_reason"], "END");
  EXPECT_EQ(got["choices"][0]["message"], json({{"role", "assistant"}, {"content", "hi"}}));
  EXPECT_EQ(got["model"], "m");

  const auto events = chat.event(
      R"({"id":"cmpl-9","object":"text_completion","created":5,"model":"m",
          "choices":[{"index":0,"text":"","finish_reason":"length","stop_reason":null}]})");
  ASSERT_EQ(events.size(), 2u);  // role, finish (no empty content chunk)
  const json finish = json::parse(events[1]);
  EXPECT_EQ(finish["choices"][0]["delta"], json::object());
  EXPECT_EQ(finish["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(finish["id"], "chatcmpl-9");
}

}  // namespace
}  // namespace tandem::gateway
