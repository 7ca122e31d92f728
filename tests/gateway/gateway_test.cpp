// `tandem gateway` end to end: engines and gateways as separate processes on the tiny model, in
// the three modes (aggregated, sequential as vLLM's proxy, parallel as SGLang's router). The
// official `openai` npm client talks to each gateway (completions and chat, streamed and not,
// token-id prompts, several choices, stop strings, abort mid-stream, a 400), answers must equal the
// single-sequence generate loop, and no engine may keep a KV block afterwards.
#include <gtest/gtest.h>

#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <future>

#include <nlohmann/json.hpp>

#include "engine/engine_http.h"
#include "engine/engine_process.h"
#include "engine/generate.h"
#include "engine/tiny_model_fixture.h"
#include "engine/transfer/kv_transport.h"
#include "model/model_test_support.h"
#include "text/chat_template.h"
#include "text/oracle_support.h"
#include "util/error.h"
#include "util/file.h"

namespace tandem::gateway {
namespace {

using nlohmann::json;
using testing::EngineProcess;
using testing::eventually;
using testing::metric;
using testing::post_json;
using testing::read_serve_engines;

constexpr char kF32[] = "f32";

class GatewayStack : public test::TinyModelTest<kF32> {
 protected:
  static std::unique_ptr<EngineProcess> engine(const std::string& role, uint16_t* kv_port,
                                               const std::vector<std::string>& extra = {}) {
    std::vector<std::string> a = {TANDEM_BINARY,
                                  "engine",
                                  "--model",
                                  dir_->string(),
                                  "--served-model-name",
                                  "tiny",
                                  "--host",
                                  "127.0.0.1",
                                  "--port",
                                  "0",
                                  "--num-kv-blocks",
                                  "256",
                                  "--role",
                                  role};
    if (role == "prefill") a.insert(a.end(), {"--kv-transfer-port", "0"});
    a.insert(a.end(), extra.begin(), extra.end());
    auto e = std::make_unique<EngineProcess>(a);
    const std::string line = e->next_line();
    if (kv_port) {
      const auto at = line.find("KV transfer on ");
      *kv_port = at == std::string::npos
                     ? 0
                     : static_cast<uint16_t>(std::stoi(line.substr(line.find(':', at + 15) + 1)));
    }
    return e;
  }

  static std::unique_ptr<EngineProcess> gateway(const std::string& mode,
                                                std::vector<std::string> endpoints) {
    std::vector<std::string> a = {TANDEM_BINARY, "gateway", "--host", "127.0.0.1",
                                  "--port",      "0",       "--mode", mode};
    a.insert(a.end(), endpoints.begin(), endpoints.end());
    return std::make_unique<EngineProcess>(a);
  }

  static std::string endpoint(const EngineProcess& e, uint16_t bootstrap = 0) {
    std::string s = "127.0.0.1:" + std::to_string(e.port());
    if (bootstrap) {
      s += '@';  // two appends: GCC 12 warns (-Wrestrict) about "@" + std::to_string(...)
      s += std::to_string(bootstrap);
    }
    return s;
  }

  static std::string greedy(const std::vector<int32_t>& prompt, int64_t max_tokens) {
    engine::SamplingParams p;
    p.temperature = 0;
    p.max_tokens = max_tokens;
    p.ignore_eos = true;
    return engine::generate(*model_, *tok_, prompt, p).text;
  }

  // The official client through `port`; checks what engine_server_test checks on one engine.
  void check_with_openai_client(uint16_t port) {
    const std::string prompt = "The quick brown fox jumps over the lazy dog";
    const auto ids = tok_->encode(prompt, true);
    const json r = testing::run_openai_client(port, prompt, ids);
    ASSERT_TRUE(r.contains("completion")) << r.dump();
    EXPECT_EQ(r["models"], json::array({"tiny"}));
    const std::string expected = greedy(ids, 12);
    EXPECT_EQ(r["completion"]["text"], expected);
    EXPECT_EQ(r["completion"]["usage"]["completion_tokens"], 12);
    EXPECT_EQ(r["completion"]["usage"]["prompt_tokens"], ids.size());
    EXPECT_EQ(r["completion_stream"]["text"], expected);
    EXPECT_EQ(r["completion_stream"]["usage"]["completion_tokens"], 12);
    EXPECT_EQ(r["completion_ids"]["text"], expected);
    nlohmann::ordered_json ctx = {{"messages", {{{"role", "user"}, {"content", prompt}}}},
                                  {"add_generation_prompt", true},
                                  {"bos_token", tok_->bos_token()},
                                  {"eos_token", tok_->eos_token()}};
    const auto chat_ids =
        tok_->encode(text::ChatTemplate(tok_->chat_template()).render(ctx), false);
    const std::string chat_expected = greedy(chat_ids, 10);
    EXPECT_EQ(r["chat"]["content"], chat_expected);
    EXPECT_EQ(r["chat_stream"]["content"], chat_expected);
    // Several choices (n, a list of prompts), which the P/D modes send as a request per choice:
    // what one engine answers, in order, with one id and the usage of one request.
    const json& several = r["several"];
    const auto hello = tok_->encode("Hello world", true);
    const std::string first = greedy(ids, 6), second = greedy(hello, 6);
    EXPECT_EQ(several["n"]["texts"], json::array({first, first, first}));
    EXPECT_EQ(several["n"]["indexes"], json::array({0, 1, 2}));
    EXPECT_EQ(several["n"]["usage"]["prompt_tokens"], ids.size());  // the prompt counted once
    EXPECT_EQ(several["n"]["usage"]["completion_tokens"], 18);
    EXPECT_EQ(several["list"]["texts"], json::array({first, second}));
    EXPECT_EQ(several["list"]["indexes"], json::array({0, 1}));
    EXPECT_EQ(several["list"]["usage"]["prompt_tokens"], ids.size() + hello.size());
    EXPECT_EQ(several["list_stream"]["texts"], json::array({first, second}));
    EXPECT_EQ(several["list_stream"]["ids"], 1);
    EXPECT_EQ(several["list_stream"]["usage"]["completion_tokens"], 12);
    EXPECT_EQ(several["list_stream"]["usage"]["prompt_tokens"], ids.size() + hello.size());
    EXPECT_EQ(several["chat_stream"]["contents"], json::array({chat_expected, chat_expected}));
    // n choices of each prompt of a list and echo: as one engine (and vLLM) answers.
    testing::expect_several_choices_and_echo(r, prompt, ids.size(), hello.size(), first, second);
    ASSERT_TRUE(r.contains("stop"));
    const std::string stop = r["stop"]["stop"];
    EXPECT_EQ(r["stop"]["text"], expected.substr(0, expected.find(stop)));
    // The client aborts after its second chunk; events it had already read in the same
    // packet may still arrive (the gateway relays bytes, not events). The engines must end
    // idle either way (checked by the caller).
    EXPECT_GE(r["abort"]["chunks"].get<int>(), 2);
    EXPECT_EQ(r["bad_request"]["status"], 400);
  }

  static void expect_idle(const EngineProcess& e) {
    EXPECT_TRUE(eventually([&] {
      return metric(e.port(), "vllm:kv_cache_usage_perc") == 0 &&
             metric(e.port(), "vllm:num_requests_running") == 0 &&
             metric(e.port(), "tandem:kv_transfer_held_blocks") == 0;
    })) << "engine on port "
        << e.port() << " still holds requests or blocks: usage "
        << metric(e.port(), "vllm:kv_cache_usage_perc") << ", running "
        << metric(e.port(), "vllm:num_requests_running") << ", waiting "
        << metric(e.port(), "vllm:num_requests_waiting") << ", held "
        << metric(e.port(), "tandem:kv_transfer_held_blocks") << ", waiting for KV "
        << metric(e.port(), "tandem:num_requests_waiting_for_kv");
  }
};

TEST_F(GatewayStack, EveryModeServesTheOpenAIClientLikeOneEngine) {
  uint16_t kv_port = 0;
  auto single = engine("both", nullptr);
  auto prefill = engine("prefill", &kv_port);
  auto decode = engine("decode", nullptr);
  ASSERT_NE(kv_port, 0);
  for (const auto& [mode, pools] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"aggregated", {"--decode", endpoint(*single)}},
           {"sequential", {"--prefill", endpoint(*prefill), "--decode", endpoint(*decode)}},
           {"parallel", {"--prefill", endpoint(*prefill, kv_port), "--decode", endpoint(*decode)}}})
    for (const bool tokenize : {false, true}) {
      // With a model folder the gateway tokenizes and sends token ids (chat answers are
      // translated back); without, bodies pass through. The client cannot tell the difference.
      SCOPED_TRACE(mode + (tokenize ? " (gateway tokenizes)" : ""));
      std::vector<std::string> endpoints = pools;
      // Tandem engines speak every dialect: this variant also names the peers' dialects.
      if (tokenize) {
        endpoints.insert(endpoints.end(),
                         {"--model", dir_->string(), "--served-model-name", "tiny"});
        if (mode != "aggregated")
          endpoints.insert(endpoints.end(),
                           {"--dialect", mode == "sequential" ? "vllm" : "sglang"});
      }
      auto gw = gateway(mode, endpoints);
      check_with_openai_client(gw->port());
      // A refused field is named in OpenAI's "param", whether the gateway (tokenizing) or the
      // engine refuses it.
      const auto bad =
          post_json(gw->port(), "/v1/completions", {{"prompt", "x"}, {"max_tokens", "many"}});
      EXPECT_EQ(bad.status, 400);
      EXPECT_EQ(json::parse(bad.body)["error"]["param"], "max_tokens") << bad.body;
      // Concurrent requests of mixed lengths through the gateway.
      std::vector<std::future<std::string>> got;
      std::vector<std::vector<int32_t>> prompts;
      for (int i = 0; i < 8; ++i) {
        std::vector<int32_t> p;
        for (int k = 0; k < 5 + 13 * i; ++k) p.push_back(1000 + 37 * i + k);
        prompts.push_back(p);
      }
      for (int i = 0; i < 8; ++i)
        got.push_back(std::async(std::launch::async, [&, i] {
          const json body = {
              {"prompt", prompts[i]}, {"max_tokens", 6}, {"temperature", 0}, {"ignore_eos", true}};
          const auto r = post_json(gw->port(), "/v1/completions", body);
          EXPECT_EQ(r.status, 200) << r.body;
          return r.status == 200 ? json::parse(r.body)["choices"][0]["text"].get<std::string>()
                                 : std::string("<error>");
        }));
      for (int i = 0; i < 8; ++i) EXPECT_EQ(got[i].get(), greedy(prompts[i], 6)) << "request " << i;
      expect_idle(*single);
      expect_idle(*prefill);
      expect_idle(*decode);
    }
}

TEST_F(GatewayStack, SampledChoicesThroughPdAreOneEnginesWithBatchInvariantNumerics) {
  // With batch-invariant numerics a prompt's logits do not depend on how it was computed (whole,
  // or its last token again on the decode engine), so seeded sampling through P/D must give what
  // one engine gives for the same request: choice i of n is seeded seed + i on both sides.
  const std::vector<std::string> invariant = {"--batch-invariant"};
  uint16_t kv_port = 0;
  auto single = engine("both", nullptr, invariant);
  auto prefill = engine("prefill", &kv_port, invariant);
  auto decode = engine("decode", nullptr, invariant);
  auto gw = gateway("parallel",
                    {"--prefill", endpoint(*prefill, kv_port), "--decode", endpoint(*decode)});
  const json sampled = {{"temperature", 1}, {"seed", 7}, {"max_tokens", 6}, {"ignore_eos", true}};
  auto texts = [](const net::HttpClientResponse& r) {
    EXPECT_EQ(r.status, 200) << r.body;
    std::vector<std::string> out;
    if (r.status != 200) return out;
    const json answer = json::parse(r.body);
    for (const auto& c : answer["choices"]) out.push_back(c["text"]);
    return out;
  };
  json n = sampled;
  n["prompt"] = "The quick brown fox";
  n["n"] = 3;
  const auto one_engine = texts(post_json(single->port(), "/v1/completions", n));
  ASSERT_EQ(one_engine.size(), 3u);
  EXPECT_NE(one_engine[0], one_engine[1]);  // sampled, seeded apart
  EXPECT_EQ(texts(post_json(gw->port(), "/v1/completions", n)), one_engine);
  json list = sampled;
  list["prompt"] = {"The quick brown fox", "Hello world"};
  EXPECT_EQ(texts(post_json(gw->port(), "/v1/completions", list)),
            texts(post_json(single->port(), "/v1/completions", list)));
  expect_idle(*prefill);
  expect_idle(*decode);
}

TEST_F(GatewayStack, UpstreamFailuresAreOpenAIErrors) {
  uint16_t kv_port = 0;
  auto prefill = engine("prefill", &kv_port);
  auto decode = engine("decode", nullptr);
  // A prefill engine that is not there: 502 naming it, nothing stuck on the decode engine.
  auto gw = gateway("sequential", {"--prefill", "127.0.0.1:1", "--decode", endpoint(*decode)});
  const json body = {{"prompt", "hello"}, {"max_tokens", 4}};
  auto r = post_json(gw->port(), "/v1/completions", body);
  EXPECT_EQ(r.status, 502);
  EXPECT_NE(r.body.find("prefill engine 127.0.0.1:1 failed"), std::string::npos) << r.body;
  // The parallel flow cancels the decode leg when the prefill leg fails.
  auto par = gateway("parallel", {"--prefill", "127.0.0.1:1@1", "--decode", endpoint(*decode)});
  r = post_json(par->port(), "/v1/completions", body);
  EXPECT_EQ(r.status, 502);
  expect_idle(*decode);
  // An engine's own client error passes through unchanged.
  auto ok = gateway("sequential", {"--prefill", endpoint(*prefill), "--decode", endpoint(*decode)});
  r = post_json(ok->port(), "/v1/completions", json{{"prompt", "hello"}, {"max_tokens", -1}});
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("invalid_request_error"), std::string::npos) << r.body;
  r = net::http_request("127.0.0.1", ok->port(), "POST", "/v1/completions", "{not json");
  EXPECT_EQ(r.status, 400);
}

// A client field of the wrong type or null, read by the gateway itself (`stream`, which decides
// how it relays): as the engine reads it, null is absent (vLLM's Optional[bool]) and another
// type a 400 naming the field, counted and logged as any refusal. "stream": null was a 500
// carrying nlohmann's exception text, counted nowhere.
TEST_F(GatewayStack, ClientFieldsTheGatewayReadsAreTakenAsTheEngineTakesThem) {
  uint16_t kv_port = 0;
  auto prefill = engine("prefill", &kv_port);
  auto decode = engine("decode", nullptr);
  auto single = engine("both", nullptr);
  const json plain = {{"prompt", "hello"}, {"max_tokens", 4}, {"temperature", 0}};
  json null_stream = plain;
  null_stream["stream"] = nullptr;
  json text_stream = plain;
  text_stream["stream"] = "yes";
  const auto want = post_json(single->port(), "/v1/completions", plain);
  ASSERT_EQ(want.status, 200) << want.body;
  const auto engine_refusal = post_json(single->port(), "/v1/completions", text_stream);
  ASSERT_EQ(engine_refusal.status, 400) << engine_refusal.body;
  for (const auto& [mode, endpoints] :
       {std::pair{"sequential", std::vector<std::string>{"--prefill", endpoint(*prefill),
                                                         "--decode", endpoint(*decode)}},
        std::pair{"parallel", std::vector<std::string>{"--prefill", endpoint(*prefill, kv_port),
                                                       "--decode", endpoint(*decode)}}}) {
    SCOPED_TRACE(mode);
    auto gw = gateway(mode, endpoints);
    for (const char* path : {"/v1/completions", "/v1/chat/completions"}) {
      SCOPED_TRACE(path);
      json body = null_stream, refused = text_stream;
      if (std::string(path) == "/v1/chat/completions")
        for (json* b : {&body, &refused}) {
          b->erase("prompt");
          (*b)["messages"] = {{{"role", "user"}, {"content", "hello"}}};
        }
      const auto got = post_json(gw->port(), path, body);
      ASSERT_EQ(got.status, 200) << got.body;
      if (std::string(path) == "/v1/completions") {
        EXPECT_EQ(json::parse(got.body)["choices"][0]["text"],
                  json::parse(want.body)["choices"][0]["text"]);
      }
      const auto r = post_json(gw->port(), path, refused);
      EXPECT_EQ(r.status, 400) << r.body;
      EXPECT_EQ(json::parse(r.body)["error"], json::parse(engine_refusal.body)["error"]) << r.body;
    }
    // A request is counted when the gateway is done with it, which may be just after its
    // client read the answer.
    EXPECT_TRUE(eventually([&] {
      return metric(gw->port(), "tandem:gateway_requests_total", "status=\"400\"") == 2;
    })) << metric(gw->port(), "tandem:gateway_requests_total", "status=\"400\"");
    EXPECT_EQ(metric(gw->port(), "tandem:gateway_requests_total", "status=\"500\""), 0);
  }
  expect_idle(*prefill);
  expect_idle(*decode);
}

TEST_F(GatewayStack, ServeStartsAWholeStackInOneCommandAndStopsIt) {
  // Plain engines, and engines of two expert-parallel ranks each: the same text.
  for (const auto& [mode, ranks] : {std::pair{"sequential", "1"}, std::pair{"parallel", "2"}}) {
    SCOPED_TRACE(mode);
    EngineProcess serve({TANDEM_BINARY, "serve", "--model", dir_->string(), "--host", "127.0.0.1",
                         "--port", "0", "--mode", mode, "--expert-parallel", ranks,
                         "--engine-arg=--num-kv-blocks", "--engine-arg=256",
                         "--engine-arg=--served-model-name", "--engine-arg=tiny"});
    std::vector<uint16_t> engines;
    for (const auto& e : read_serve_engines(serve, 2)) engines.push_back(e.port);
    std::vector<int32_t> prompt;
    for (int k = 0; k < 40; ++k) prompt.push_back(3000 + 7 * k);
    const json body = {
        {"prompt", prompt}, {"max_tokens", 8}, {"temperature", 0}, {"ignore_eos", true}};
    const auto r = post_json(serve.port(), "/v1/completions", body);
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(json::parse(r.body)["choices"][0]["text"], greedy(prompt, 8));
    EXPECT_EQ(serve.stop(), 0);
    // Its engines went with it.
    for (uint16_t port : engines)
      EXPECT_THROW(
          net::http_request("127.0.0.1", port, "GET", "/health", {}, {}, std::chrono::seconds(2)),
          Error)
          << "engine on port " << port << " still running";
  }
}

// Engines whose KV cache holds less than the model's context (256 tokens here, of 163,840): the
// gateway learns their length from their GET /v1/models, reports it in its own, and a chat
// without max_tokens gets what the engines leave after the prompt, as one engine answers it. The
// gateway took the default from config.json's context, and every such chat was a 400 naming a
// max_tokens the client never sent.
TEST_F(GatewayStack, AChatWithoutMaxTokensGetsTheRoomTheEnginesLeave) {
  EngineProcess single({TANDEM_BINARY, "engine", "--model", dir_->string(), "--served-model-name",
                        "tiny", "--host", "127.0.0.1", "--port", "0", "--num-kv-blocks", "16"});
  EngineProcess serve({TANDEM_BINARY, "serve", "--model", dir_->string(), "--host", "127.0.0.1",
                       "--port", "0", "--mode", "parallel", "--engine-arg=--num-kv-blocks",
                       "--engine-arg=16", "--engine-arg=--served-model-name", "--engine-arg=tiny"});
  read_serve_engines(serve, 2);
  json models;
  const auto said = [&] {
    models = testing::get_json(serve.port(), "/v1/models");
    return models["data"][0].contains("max_model_len");
  };
  // Up to 30 s: a probe or the ask (1 s timeouts) slowed on a loaded machine is retried at the
  // next probe, 2 s later.
  EXPECT_TRUE(eventually(said) || eventually(said) || eventually(said)) << models.dump();
  EXPECT_EQ(models["data"][0]["max_model_len"], 256);
  const json chat = {{"model", "tiny"},
                     {"messages", {{{"role", "user"}, {"content", "Tell me a long story."}}}},
                     {"temperature", 0},
                     {"ignore_eos", true}};
  const auto want = post_json(single.port(), "/v1/chat/completions", chat);
  ASSERT_EQ(want.status, 200) << want.body;
  const auto got = post_json(serve.port(), "/v1/chat/completions", chat);
  ASSERT_EQ(got.status, 200) << got.body;
  const json w = json::parse(want.body), g = json::parse(got.body);
  EXPECT_EQ(
      g["usage"]["prompt_tokens"].get<int64_t>() + g["usage"]["completion_tokens"].get<int64_t>(),
      256);
  EXPECT_EQ(g["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(g["choices"][0]["message"]["content"], w["choices"][0]["message"]["content"]);
  EXPECT_EQ(serve.stop(), 0);
}

// vLLM's /tokenize and /detokenize, which clients call to fit a prompt to the context: the
// gateway relays them to an engine, whose tokenizer and template its generation requests run on
// (a chat's count is the prompt_tokens its completion reports), errors included.
TEST_F(GatewayStack, TokenizeAndDetokenizeAreAnEnginesAnswersThroughTheGateway) {
  EngineProcess serve({TANDEM_BINARY, "serve", "--model", dir_->string(), "--host", "127.0.0.1",
                       "--port", "0", "--mode", "sequential", "--engine-arg=--num-kv-blocks",
                       "--engine-arg=64", "--engine-arg=--served-model-name", "--engine-arg=tiny"});
  read_serve_engines(serve, 2);
  // One engine as serve starts its own (theirs take an API key only serve knows).
  EngineProcess single({TANDEM_BINARY, "engine", "--model", dir_->string(), "--served-model-name",
                        "tiny", "--host", "127.0.0.1", "--port", "0", "--num-kv-blocks", "64"});
  const json chat = {{"model", "tiny"},
                     {"messages", {{{"role", "user"}, {"content", "What is 2+2?"}}}}};
  const auto counted = post_json(serve.port(), "/tokenize", chat);
  ASSERT_EQ(counted.status, 200) << counted.body;
  EXPECT_EQ(counted.body, post_json(single.port(), "/tokenize", chat).body);
  const json c = json::parse(counted.body);
  EXPECT_EQ(c["count"], c["tokens"].size());
  EXPECT_EQ(c["max_model_len"],
            testing::get_json(single.port(), "/v1/models")["data"][0]["max_model_len"]);
  json ask = chat;
  ask["max_tokens"] = 1;
  const auto answered = post_json(serve.port(), "/v1/chat/completions", ask);
  ASSERT_EQ(answered.status, 200) << answered.body;
  EXPECT_EQ(json::parse(answered.body)["usage"]["prompt_tokens"], c["count"]);

  const std::string text = "The quick brown fox";
  const auto ids = tok_->encode(text, true);
  const auto prompt = post_json(serve.port(), "/tokenize", json{{"prompt", text}});
  ASSERT_EQ(prompt.status, 200) << prompt.body;
  EXPECT_EQ(json::parse(prompt.body)["tokens"], json(ids));
  const auto back = post_json(serve.port(), "/detokenize", json{{"tokens", ids}});
  ASSERT_EQ(back.status, 200) << back.body;
  EXPECT_EQ(json::parse(back.body)["prompt"], tok_->decode(ids, false));

  const auto bad = post_json(serve.port(), "/detokenize", json{{"tokens", {-1}}});
  EXPECT_EQ(bad.status, 400);
  EXPECT_EQ(json::parse(bad.body)["error"]["param"], "tokens") << bad.body;
  const auto other = post_json(serve.port(), "/tokenize", json{{"prompt", "x"}, {"model", "no"}});
  EXPECT_EQ(other.status, 404) << other.body;
  EXPECT_EQ(serve.stop(), 0);
}

// A Qwen3-MoE checkpoint behind `tandem serve` in both P/D modes: the gateway tokenizes chats with
// Qwen3's tokenizer and template (tokens-in), and the answers equal one engine's; a forced tool
// call (passed through to the engines) comes back parsed.
TEST_F(GatewayStack, ServeRunsQwen3MoeInBothPdModesAsOneEngineAnswers) {
  test::TempDir qwen3("serve-qwen3");
  ASSERT_EQ(test::run_command(std::string(TANDEM_BINARY) +
                              " make-model --preset tiny-qwen3-moe --dtype f32 --out " +
                              test::quote(qwen3.path()) + " >/dev/null 2>&1"),
            0);
  EngineProcess single({TANDEM_BINARY, "engine", "--model", qwen3.path().string(),
                        "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", "0",
                        "--num-kv-blocks", "256"});
  const json chat = {{"model", "tiny"},
                     {"messages", {{{"role", "user"}, {"content", "Name a colour of the sea."}}}},
                     {"max_tokens", 12},
                     {"temperature", 0}};
  const json tool = {
      {"model", "tiny"},
      {"messages", {{{"role", "user"}, {"content", "Weather in Paris?"}}}},
      {"max_tokens", 80},
      {"temperature", 0},
      {"tools",
       {{{"type", "function"},
         {"function",
          {{"name", "get_weather"},
           {"parameters",
            {{"type", "object"},
             {"properties", {{"city", {{"type", "string"}, {"maxLength", 8}}}}},
             {"required", {"city"}}}}}}}}},
      {"tool_choice", {{"type", "function"}, {"function", {{"name", "get_weather"}}}}}};
  auto answer = [](uint16_t port, const json& body) {
    const auto r = post_json(port, "/v1/chat/completions", body);
    EXPECT_EQ(r.status, 200) << r.body;
    return r.status == 200 ? json::parse(r.body)["choices"][0] : json();
  };
  const json want_chat = answer(single.port(), chat);
  const json want_tool = answer(single.port(), tool);
  ASSERT_EQ(want_tool["message"]["tool_calls"].size(), 1u) << want_tool.dump();
  for (const std::string mode : {"sequential", "parallel"}) {
    SCOPED_TRACE(mode);
    EngineProcess serve({TANDEM_BINARY, "serve", "--model", qwen3.path().string(), "--host",
                         "127.0.0.1", "--port", "0", "--mode", mode, "--engine-arg=--num-kv-blocks",
                         "--engine-arg=256", "--engine-arg=--served-model-name",
                         "--engine-arg=tiny"});
    for (int i = 0; i < 2; ++i) serve.next_line();  // the engines' lines
    EXPECT_EQ(answer(serve.port(), chat)["message"]["content"], want_chat["message"]["content"]);
    const json got = answer(serve.port(), tool);
    ASSERT_EQ(got["message"]["tool_calls"].size(), 1u) << got.dump();
    EXPECT_EQ(got["message"]["tool_calls"][0]["function"],
              want_tool["message"]["tool_calls"][0]["function"]);
    EXPECT_EQ(got["finish_reason"], "stop");
    EXPECT_EQ(serve.stop(), 0);
  }
}

// Many simulated engines behind one `tandem serve`: every request answered, every engine used
// (least-load spreads concurrent requests), one access-log line per request, nothing left in
// flight.
TEST(GatewayServe, ManySimulatedEnginesShareTheLoad) {
  for (const std::string mode : {"sequential", "parallel"}) {
    SCOPED_TRACE(mode);
    EngineProcess serve(
        {TANDEM_BINARY,     "serve",       "--model",  "sim:tiny", "--host",
         "127.0.0.1",       "--port",      "0",        "--mode",   mode,
         "--prefill",       "2",           "--decode", "3",        "--admin-api-key",
         "admin",           "--kv-events", "--policy", "tandem",   "--engine-arg=--num-kv-blocks",
         "--engine-arg=512"});
    for (int i = 0; i < 5; ++i) serve.next_line();  // the engines' lines
    std::vector<std::future<int>> got;
    for (int i = 0; i < 30; ++i)
      got.push_back(std::async(std::launch::async, [&, i] {
        const json body = {{"prompt", std::string(20 + 10 * i, 'a')},
                           {"max_tokens", 4 + i % 5},
                           {"stream", i % 2 == 0}};
        return post_json(serve.port(), "/v1/completions", body).status;
      }));
    for (auto& g : got) EXPECT_EQ(g.get(), 200);
    net::Headers admin;
    admin.set("Authorization", "Bearer admin");
    const json eps = json::parse(
        net::http_request("127.0.0.1", serve.port(), "GET", "/admin/endpoints", {}, admin)
            .body)["endpoints"];
    ASSERT_EQ(eps.size(), 5u);
    // --kv-events: the engines' cached blocks reach the gateway's prefix index.
    EXPECT_TRUE(eventually([&] {
      int64_t indexed = 0;
      const json now = json::parse(
          net::http_request("127.0.0.1", serve.port(), "GET", "/admin/endpoints", {}, admin)
              .body)["endpoints"];
      for (const auto& e : now) indexed += e.value("prefix_blocks", int64_t{0});
      return indexed > 0;
    })) << eps.dump();
    // Every engine's GET /load reaches the scheduler: its step durations became batch-time
    // observations, and the gateway's count of prefill work in flight returned to zero.
    EXPECT_TRUE(eventually([&] {
      const json now = json::parse(
          net::http_request("127.0.0.1", serve.port(), "GET", "/admin/endpoints", {}, admin)
              .body)["endpoints"];
      for (const auto& e : now)
        if (!e.contains("load") || e["load"]["batch_observations"] == 0 ||
            e["uncached_tokens_in_flight"] != 0)
          return false;
      return true;
    })) << eps.dump();
    for (const auto& e : eps) {
      const std::string labels = "pool=\"" + e["pool"].get<std::string>() + "\",endpoint=\"" +
                                 e["name"].get<std::string>() + "\"";
      EXPECT_GT(metric(serve.port(), "tandem:gateway_endpoint_requests_total", labels), 0)
          << e.dump();
      EXPECT_TRUE(eventually(
          [&] { return metric(serve.port(), "tandem:gateway_endpoint_in_flight", labels) == 0; }));
    }
    EXPECT_EQ(metric(serve.port(), "tandem:gateway_requests_total", "status=\"200\""), 30);
    // The transfers above ran between engines that share the secret serve made for them; a
    // stranger on a prefill engine's KV transfer port is refused, learning nothing of the model.
    int refused = 0;
    for (const auto& e : eps) {
      if (!e.contains("bootstrap_port")) continue;
      const auto transport = engine::make_tcp_transport({std::chrono::milliseconds(5000)});
      const auto conn = transport->connect("127.0.0.1", e["bootstrap_port"].get<uint16_t>());
      const std::string pull = R"({"transfer_id": "x", "block_ids": [0]})";
      const std::span<const std::byte> parts[] = {std::as_bytes(std::span(pull))};
      conn->send(engine::KvFrameType::kPull, parts);
      const engine::KvFrame answer = conn->receive(1 << 20);
      EXPECT_EQ(answer.type, engine::KvFrameType::kError);
      EXPECT_EQ(
          std::string(reinterpret_cast<const char*>(answer.payload.data()), answer.payload.size()),
          R"({"message":"KV transfer refused: not authenticated"})");
      ++refused;
    }
    EXPECT_EQ(refused, 2);
    EXPECT_EQ(serve.stop(), 0);
  }
}

// `tandem serve` reaps an engine killed with SIGKILL, restarts it on the same port, and the
// gateway serves through it again once its probe passes. Its engines answer only the gateway
// (serve hands them a key), and listen on loopback.
TEST(GatewayServe, AnEngineThatDiesIsRestartedOnItsPortAndServesAgain) {
  EngineProcess serve({TANDEM_BINARY, "serve", "--model", "sim:tiny", "--port", "0", "--mode",
                       "sequential", "--prefill", "1", "--decode", "1"});
  serve.next_line();  // the prefill engine
  const std::string decode = serve.next_line();
  const auto number_after = [](const std::string& line, const std::string& key) {
    const size_t at = line.find(key);
    return at == std::string::npos ? -1 : std::stoi(line.substr(at + key.size()));
  };
  const int port = number_after(decode, "http://127.0.0.1:");
  const pid_t pid = number_after(decode, "(pid ");
  ASSERT_GT(port, 0) << decode;
  ASSERT_GT(pid, 0) << decode;
  const json body = {{"prompt", "hello"}, {"max_tokens", 4}};
  EXPECT_EQ(post_json(serve.port(), "/v1/completions", body).status, 200);
  EXPECT_EQ(net::http_request("127.0.0.1", static_cast<uint16_t>(port), "GET", "/v1/models").status,
            401);

  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  std::string restarted = serve.next_line();  // "restarting (pid N)", then "restarted" once up
  EXPECT_NE(restarted.find("decode engine on port " + std::to_string(port) + " restarting"),
            std::string::npos)
      << restarted;
  restarted = serve.next_line();
  EXPECT_NE(restarted.find("decode engine on port " + std::to_string(port) + " restarted"),
            std::string::npos)
      << restarted;
  const pid_t new_pid = number_after(restarted, "(pid ");
  EXPECT_GT(new_pid, 0);
  EXPECT_NE(new_pid, pid);
  EXPECT_EQ(::kill(pid, 0), -1) << "the dead engine is still a zombie";
  EXPECT_EQ(errno, ESRCH);
  EXPECT_TRUE(
      eventually([&] { return post_json(serve.port(), "/v1/completions", body).status == 200; }));
  EXPECT_EQ(serve.stop(), 0);
}

// A terminal's Ctrl-C signals the foreground process group. serve's engines are in groups of
// their own, so it reaches serve alone, which drains its gateway before it stops them: with the
// engines in serve's group they stopped at once, and the drain's requests failed 502 on them.
TEST(GatewayServe, EnginesAreOutsideServesProcessGroup) {
  EngineProcess serve({TANDEM_BINARY, "serve", "--model", "sim:tiny", "--port", "0", "--mode",
                       "aggregated", "--prefill", "0", "--decode", "1"});
  const std::string decode = serve.next_line();
  const size_t at = decode.find("(pid ");
  ASSERT_NE(at, std::string::npos) << decode;
  const pid_t engine = std::stoi(decode.substr(at + 5));
  const pid_t serve_group = ::getpgid(serve.pid());
  ASSERT_GT(serve_group, 0);
  EXPECT_NE(::getpgid(engine), serve_group);
  EXPECT_EQ(::getpgid(engine), engine);
  EXPECT_EQ(serve.stop(), 0);
  EXPECT_EQ(::kill(engine, 0), -1) << "the engine outlived serve";
}

// The policy evaluation in small (bench/policy_comparison.sh replays a window of the Mooncake
// trace this way): 40 records of the trace's head through `tandem serve` with simulated
// DeepSeek-V3 engines (their step times scaled down 100x), the tandem policy fed by KV events and
// load reports, and `tandem bench` replaying at 100x speed. Every request completes, every prompt
// token arrives, the prefill engines find shared prefixes in their caches, and the gateway learns
// each engine's batch times.
TEST(GatewayServe, MooncakeReplayThroughTheTandemPolicy) {
  EngineProcess serve({TANDEM_BINARY,
                       "serve",
                       "--model",
                       "sim:deepseek-v3-h800",
                       "--host",
                       "127.0.0.1",
                       "--port",
                       "0",
                       "--mode",
                       "parallel",
                       "--prefill",
                       "2",
                       "--decode",
                       "2",
                       "--kv-events",
                       "--policy",
                       "tandem",
                       "--admin-api-key",
                       "admin",
                       "--engine-arg=--sim-time-scale=0.01",
                       "--engine-arg=--sim-kv-token-bytes=16"});
  std::vector<std::string> prefill_urls;
  for (const auto& e : read_serve_engines(serve, 4))
    if (e.role == "prefill") prefill_urls.push_back("http://" + e.address);
  ASSERT_EQ(prefill_urls.size(), 2u);
  const auto trace = std::filesystem::path(TANDEM_SOURCE_DIR) /
                     "tests/data/bench/mooncake_conversation_head200.jsonl";
  const auto result = test::temp_path("replay-result");
  std::string cmd =
      std::string(TANDEM_BINARY) +
      " bench --base-url http://127.0.0.1:" + std::to_string(serve.port()) +
      " --model deepseek-v3-h800 --dataset-name mooncake --dataset-path " + test::quote(trace) +
      " --trace-limit 40 --time-scale 0.01 --no-progress --result-file " + test::quote(result);
  for (const auto& url : prefill_urls) cmd += " --metrics-url " + url;
  ASSERT_EQ(test::run_command(cmd + " > /dev/null"), 0);
  const json r = json::parse(read_file(result));
  std::filesystem::remove(result);
  EXPECT_EQ(r["completed"], 40);
  EXPECT_EQ(r["failed"], 0);
  int64_t input_tokens = 0;
  std::ifstream in(trace);
  std::string line;
  for (int i = 0; i < 40 && std::getline(in, line); ++i)
    input_tokens += json::parse(line)["input_length"].get<int64_t>();
  EXPECT_EQ(r["total_input_tokens"], input_tokens);
  // Every record of the head starts with the same 512-token block (hash id 0): once one engine
  // has it, routing by the prefix index finds it again.
  ASSERT_TRUE(r["prefix_cache_hit_rate"].is_number()) << r.dump();
  EXPECT_GT(r["prefix_cache_hit_rate"].get<double>(), 0.0);
  EXPECT_LE(r["prefix_cache_hit_rate"].get<double>(), 1.0);
  net::Headers admin;
  admin.set("Authorization", "Bearer admin");
  const json eps = json::parse(
      net::http_request("127.0.0.1", serve.port(), "GET", "/admin/endpoints", {}, admin).body);
  EXPECT_EQ(eps["policy"], "tandem");
  for (const auto& e : eps["endpoints"]) {
    ASSERT_TRUE(e.contains("load")) << e.dump();
    EXPECT_GT(e["load"]["batch_observations"].get<int64_t>(), 0) << e.dump();
  }
  EXPECT_EQ(serve.stop(), 0);
}

}  // namespace
}  // namespace tandem::gateway
