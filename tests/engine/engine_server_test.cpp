// `tandem engine` end to end on a tiny-v3 checkpoint: the official OpenAI client (chat and
// completions, streaming and not, token-id prompts, stop strings, abort mid-stream), greedy
// outputs equal to the single-sequence generate loop, prefix-cache hits, preemption under a tiny
// KV budget with every request still answered correctly, and HTTP errors for bad requests.
#include <gtest/gtest.h>

#include <fstream>
#include <future>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "api/block_hash.h"
#include "api/error.h"
#include "api/prefill_work.h"
#include "engine/engine_http.h"
#include "engine/engine_process.h"
#include "engine/executor/sim_latency.h"
#include "engine/generate.h"
#include "engine/generation_api.h"
#include "engine/kept_reply.h"
#include "engine/scheduler/sequence.h"
#include "engine/sim_engine_fixture.h"
#include "engine/tiny_model_fixture.h"
#include "model/model_test_support.h"
#include "net/http_client.h"
#include "text/chat_template.h"
#include "text/oracle_support.h"
#include "util/file.h"
#include "util/npy.h"

namespace tandem::engine {
namespace {

using nlohmann::json;

constexpr char kF32[] = "f32";

// Whether `text` is JSON valid under `schema`, as the jsonschema package judges it.
bool schema_valid(const json& schema, const json& text) {
  if (!text.is_string()) return false;
  const auto in = tandem::test::temp_path("schema-in"), out = tandem::test::temp_path("schema-out");
  write_file_atomically(in, json{{"schema", {{{"schema", schema}, {"answers", {text}}}}}}.dump());
  const int rc = tandem::test::run_command(
      "/usr/bin/python3 " +
      tandem::test::quote(tandem::test::oracle_dir() / "structured_output_oracle.py") + " < " +
      tandem::test::quote(in) + " > " + tandem::test::quote(out));
  const json verdict = rc == 0 ? json::parse(read_file(out)) : json();
  std::filesystem::remove(in);
  std::filesystem::remove(out);
  if (rc != 0) {
    ADD_FAILURE() << "the schema oracle failed (python3-jsonschema)";
    return false;
  }
  const json& result = verdict["schema"][0][0];
  if (!result.is_null()) ADD_FAILURE() << "invalid: " << result;
  return result.is_null();
}

// What the official client got from the structured-output and tool cases of
// openai_client_check.js, whatever the model family: schema-valid JSON (python3-jsonschema
// judges), a guided choice, a call forced by name and a "required" one streamed, parsed.
void expect_structured_answers(const json& r) {
  ASSERT_TRUE(r.contains("json_schema"));
  EXPECT_EQ(r["json_schema"]["finish"], "stop") << r["json_schema"].dump();
  EXPECT_TRUE(schema_valid(r["json_schema"]["schema"], r["json_schema"]["content"]))
      << r["json_schema"].dump();
  EXPECT_TRUE(r["guided_choice"]["content"] == "sunny" || r["guided_choice"]["content"] == "rainy")
      << r["guided_choice"].dump();
  // A call forced by name: parsed, its arguments follow the parameters, and it ends as "stop".
  const json& named = r["tool_named"];
  EXPECT_EQ(named["finish"], "stop") << named.dump();
  EXPECT_TRUE(named["content"].is_null()) << named.dump();
  ASSERT_EQ(named["calls"].size(), 1u) << named.dump();
  EXPECT_EQ(named["calls"][0]["name"], "get_weather");
  EXPECT_EQ(named["calls"][0]["type"], "function");
  EXPECT_TRUE(schema_valid({{"type", "object"},
                            {"properties", {{"city", {{"type", "string"}, {"maxLength", 12}}}}},
                            {"required", {"city"}}},
                           named["calls"][0]["arguments"].dump()))
      << named.dump();
  const json& required = r["tool_required_stream"];
  EXPECT_EQ(required["finish"], "tool_calls") << required.dump();
  ASSERT_EQ(required["calls"].size(), 1u) << required.dump();  // parallel_tool_calls false
  EXPECT_EQ(required["calls"][0]["name"], "get_weather");
  EXPECT_TRUE(required["calls"][0]["arguments"]["city"].is_string()) << required.dump();
}

// float32 weights: batched and single-sequence runs then agree far below greedy near-ties.
class EngineServer : public test::TinyModelTest<kF32> {
 protected:
  static std::vector<std::string> engine_args(std::vector<std::string> extra = {}) {
    std::vector<std::string> a = {
        TANDEM_BINARY, "engine", "--model",   dir_->string(), "--served-model-name",
        "tiny",        "--host", "127.0.0.1", "--port",       "0"};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }

  static std::string greedy(const std::vector<int32_t>& prompt, int64_t max_tokens) {
    SamplingParams p;
    p.temperature = 0;
    p.max_tokens = max_tokens;
    p.ignore_eos = true;
    return generate(*model_, *tok_, prompt, p).text;
  }

  static json get_json(uint16_t port, const std::string& target) {
    return testing::get_json(port, target);
  }
  static bool wait_idle(uint16_t port) { return testing::wait_idle(port); }
  static double metric(uint16_t port, const std::string& name) {
    return testing::metric(port, name);
  }
};

TEST_F(EngineServer, OfficialOpenAIClient) {
  testing::EngineProcess engine(engine_args());
  const std::string prompt = "The quick brown fox";
  const auto ids = tok_->encode(prompt, true);
  const json r = testing::run_openai_client(engine.port(), prompt, ids);
  ASSERT_TRUE(r.contains("completion")) << r.dump();

  EXPECT_EQ(r["models"], json::array({"tiny"}));
  const std::string expected = greedy(ids, 12);
  EXPECT_EQ(r["completion"]["text"], expected);
  EXPECT_EQ(r["completion"]["finish"], "length");
  EXPECT_EQ(r["completion"]["usage"]["completion_tokens"], 12);
  EXPECT_EQ(r["completion"]["usage"]["prompt_tokens"], ids.size());
  EXPECT_EQ(r["completion_stream"]["text"], expected);
  EXPECT_EQ(r["completion_stream"]["finish"], "length");
  EXPECT_EQ(r["completion_stream"]["usage"]["completion_tokens"], 12);
  EXPECT_GE(r["completion_stream"]["chunks"].get<int>(), 2);
  EXPECT_EQ(r["completion_ids"]["text"], expected);

  // Chat: the template's prompt, greedy, streamed and not.
  nlohmann::ordered_json ctx = {{"messages", {{{"role", "user"}, {"content", prompt}}}},
                                {"add_generation_prompt", true},
                                {"bos_token", tok_->bos_token()},
                                {"eos_token", tok_->eos_token()}};
  const auto chat_ids = tok_->encode(text::ChatTemplate(tok_->chat_template()).render(ctx), false);
  const std::string chat_expected = greedy(chat_ids, 10);
  EXPECT_EQ(r["chat"]["content"], chat_expected);
  EXPECT_EQ(r["chat"]["role"], "assistant");
  EXPECT_EQ(r["chat"]["usage"]["prompt_tokens"], chat_ids.size());
  EXPECT_EQ(r["chat"]["logprobs"], 10);
  EXPECT_EQ(r["chat"]["top"], 2);
  EXPECT_EQ(r["chat_stream"]["content"], chat_expected);
  EXPECT_EQ(r["chat_stream"]["role"], "assistant");
  EXPECT_EQ(r["chat_stream"]["finish"], "length");

  const auto hello = tok_->encode("Hello world", true);
  testing::expect_several_choices_and_echo(r, prompt, ids.size(), hello.size(), greedy(ids, 6),
                                           greedy(hello, 6));

  ASSERT_TRUE(r.contains("stop"));
  const std::string stop = r["stop"]["stop"];
  EXPECT_EQ(r["stop"]["text"], expected.substr(0, expected.find(stop)));
  EXPECT_EQ(r["stop"]["finish"], "stop");

  // Every piece held back until the end: one logprob entry per token, streamed as whole.
  ASSERT_TRUE(r.contains("held_logprobs")) << "the greedy text is too long for a stop string";
  const json& held = r["held_logprobs"];
  EXPECT_EQ(held["whole_text"], greedy(ids, 6));
  EXPECT_EQ(held["text"], held["whole_text"]);
  EXPECT_EQ(held["whole_tokens"], 6);
  EXPECT_EQ(held["whole"], 6);
  EXPECT_EQ(held["stream_tokens"], 6);
  EXPECT_EQ(held["stream"], 6) << held.dump();

  ASSERT_TRUE(r.contains("logit_bias"));
  const int32_t forced = r["logit_bias"]["token"];
  const std::vector<int32_t> four(4, forced);
  EXPECT_EQ(r["logit_bias"]["text"], tok_->decode(four, true));
  EXPECT_EQ(r["tools_auto"]["finish"], "length");
  EXPECT_EQ(r["tools_auto"]["calls"], 0);
  EXPECT_TRUE(r["tools_auto"]["content"].is_string());
  // Any JSON object: a random model writes strings without end, so logit_bias makes closing
  // quotes and braces likely (the grammar still decides where they may go), and the answers
  // must parse whatever the seed.
  json close_bias = json::object();
  for (const char* t : {"\"", "}", "\",", "\"}"})
    for (int32_t id : tok_->encode(t, false)) close_bias[std::to_string(id)] = 12;
  for (int seed = 0; seed < 4; ++seed) {
    const auto res = testing::post_json(engine.port(), "/v1/completions",
                                        json{{"prompt", prompt},
                                             {"max_tokens", 300},
                                             {"seed", seed},
                                             {"logit_bias", close_bias},
                                             {"response_format", {{"type", "json_object"}}}});
    ASSERT_EQ(res.status, 200) << res.body;
    const json answer = json::parse(res.body)["choices"][0];
    EXPECT_EQ(answer["finish_reason"], "stop") << answer.dump();
    EXPECT_TRUE(schema_valid({{"type", "object"}}, answer["text"])) << answer.dump();
  }
  expect_structured_answers(r);
  EXPECT_EQ(r["functions"]["status"], 400);
  EXPECT_EQ(r["functions"]["param"], "functions");

  // The client aborts after its second chunk; events already read in the same packet may still
  // be counted. What matters is that the engine frees the request (below).
  EXPECT_GE(r["abort"]["chunks"].get<int>(), 2);
  EXPECT_TRUE(wait_idle(engine.port())) << "the aborted request still holds the engine";
  EXPECT_EQ(metric(engine.port(), "vllm:kv_cache_usage_perc"), 0.0);
  EXPECT_EQ(r["bad_request"]["status"], 400);
  EXPECT_EQ(r["bad_request"]["type"], "invalid_request_error");
  EXPECT_EQ(engine.stop(), 0);
}

TEST_F(EngineServer, SharedPrefixHitsTheCache) {
  testing::EngineProcess engine(engine_args({"--block-size", "16"}));
  std::vector<int32_t> shared;
  for (int i = 0; i < 64; ++i) shared.push_back(1000 + i);
  auto ask = [&](int32_t last) {
    auto p = shared;
    p.push_back(last);
    json body = {{"prompt", p}, {"max_tokens", 2}, {"temperature", 0}};
    auto resp =
        net::http_request("127.0.0.1", engine.port(), "POST", "/v1/completions", body.dump());
    EXPECT_EQ(resp.status, 200) << resp.body;
    return json::parse(resp.body);
  };
  auto first = ask(5);
  EXPECT_EQ(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  auto second = ask(6);
  EXPECT_EQ(second["usage"]["prompt_tokens_details"]["cached_tokens"], 64);
  EXPECT_EQ(metric(engine.port(), "vllm:prefix_cache_hits_total"), 64);
  EXPECT_EQ(metric(engine.port(), "vllm:prefix_cache_queries_total"), 130);
  EXPECT_DOUBLE_EQ(metric(engine.port(), "vllm:gpu_prefix_cache_hit_rate"), 64.0 / 130.0);
}

TEST_F(EngineServer, TinyKvBudgetPreemptsAndStillAnswersEveryRequestCorrectly) {
  // 10 blocks of 8 tokens = 80 token slots; each request needs up to 30 + 24 = 54 tokens, so
  // only one fits at a time once they grow: the scheduler must preempt and recompute.
  testing::EngineProcess engine(engine_args(
      {"--block-size", "8", "--num-kv-blocks", "10", "--max-num-batched-tokens", "64"}));
  const int n = 6;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < n; ++i) {
    std::vector<int32_t> p;
    for (int k = 0; k < 30; ++k) p.push_back(500 + 37 * i + k);
    prompts.push_back(p);
  }
  std::vector<std::future<json>> answers;
  for (int i = 0; i < n; ++i)
    answers.push_back(std::async(std::launch::async, [&, i] {
      json body = {
          {"prompt", prompts[i]}, {"max_tokens", 24}, {"temperature", 0}, {"ignore_eos", true}};
      auto resp = net::http_request("127.0.0.1", engine.port(), "POST", "/v1/completions",
                                    body.dump(), {}, std::chrono::seconds(300));
      EXPECT_EQ(resp.status, 200) << resp.body;
      return json::parse(resp.body);
    }));
  for (int i = 0; i < n; ++i) {
    json a = answers[i].get();
    EXPECT_EQ(a["choices"][0]["text"], greedy(prompts[i], 24)) << "request " << i;
    EXPECT_EQ(a["usage"]["completion_tokens"], 24);
  }
  EXPECT_GT(metric(engine.port(), "vllm:num_preemptions_total"), 0);
  EXPECT_TRUE(wait_idle(engine.port()));
  EXPECT_EQ(get_json(engine.port(), "/load")["free_blocks"], 10);
  // A request that could never fit is refused up front instead of looping forever: the cache's
  // 80 tokens are this engine's longest sequence, in vLLM's words.
  json huge = {{"prompt", std::vector<int32_t>(70, 1000)}, {"max_tokens", 20}};
  auto resp = net::http_request("127.0.0.1", engine.port(), "POST", "/v1/completions", huge.dump());
  EXPECT_EQ(resp.status, 400);
  EXPECT_NE(resp.body.find("maximum context length is 80 tokens"), std::string::npos) << resp.body;
  // Streamed too: a 400 before any stream, not a 200 whose first event is the error.
  huge["stream"] = true;
  resp = net::http_request("127.0.0.1", engine.port(), "POST", "/v1/completions", huge.dump());
  EXPECT_EQ(resp.status, 400) << resp.body;
  EXPECT_NE(resp.body.find("maximum context length is 80 tokens"), std::string::npos) << resp.body;
}

// The second family through the official client: a Qwen3-MoE engine (hermes tool-call markup,
// Qwen3's template and tokenizer) returns parsed tool_calls and schema-valid JSON too.
TEST(EngineServerQwen3, OfficialClientGetsToolCallsAndSchemaValidJson) {
  test::TempDir dir("engine-qwen3");
  ASSERT_EQ(test::run_command(std::string(TANDEM_BINARY) +
                              " make-model --preset tiny-qwen3-moe --dtype f32 --out " +
                              test::quote(dir.path()) + " >/dev/null 2>&1"),
            0);
  testing::EngineProcess engine({TANDEM_BINARY, "engine", "--model", dir.path().string(),
                                 "--served-model-name", "tiny", "--host", "127.0.0.1", "--port",
                                 "0"});
  const auto tok = text::Tokenizer::from_dir(dir.path());
  const std::string prompt = "The quick brown fox";
  const json r = testing::run_openai_client(engine.port(), prompt, tok.encode(prompt, false));
  ASSERT_TRUE(r.contains("completion")) << r.dump();
  EXPECT_EQ(r["models"], json::array({"tiny"}));
  EXPECT_EQ(r["completion"]["text"], r["completion_stream"]["text"]);
  EXPECT_EQ(r["chat"]["content"], r["chat_stream"]["content"]);
  expect_structured_answers(r);
  EXPECT_EQ(engine.stop(), 0);
}

// --reasoning-parser qwen3 through the official client: the reasoning it reads whole is the one it
// folds from the stream (under reasoning_content and reasoning alike), and it is the text an engine
// without the parser answers to the same request, read apart as vLLM's qwen3 parser reads it; with
// enable_thinking false (Qwen3's template closes the reasoning in the prompt) the answer is
// content.
TEST(EngineServerQwen3, OfficialClientReadsReasoningApart) {
  test::TempDir dir("engine-qwen3-reasoning");
  ASSERT_EQ(test::run_command(std::string(TANDEM_BINARY) +
                              " make-model --preset tiny-qwen3-moe --dtype f32 --out " +
                              test::quote(dir.path()) + " >/dev/null 2>&1"),
            0);
  const std::string prompt = "The quick brown fox";
  std::vector<std::string> args = {TANDEM_BINARY,
                                   "engine",
                                   "--model",
                                   dir.path().string(),
                                   "--served-model-name",
                                   "tiny",
                                   "--host",
                                   "127.0.0.1",
                                   "--port",
                                   "0"};
  std::map<bool, std::string> plain;  // thinking -> the answer without a parser
  {
    testing::EngineProcess engine(args);
    for (bool thinking : {true, false}) {
      const auto res =
          testing::post_json(engine.port(), "/v1/chat/completions",
                             {{"model", "tiny"},
                              {"messages", {{{"role", "user"}, {"content", prompt}}}},
                              {"temperature", 0},
                              {"max_tokens", 12},
                              {"ignore_eos", true},
                              {"chat_template_kwargs", {{"enable_thinking", thinking}}}});
      ASSERT_EQ(res.status, 200) << res.body;
      plain[thinking] = json::parse(res.body)["choices"][0]["message"]["content"];
    }
    EXPECT_EQ(engine.stop(), 0);
  }
  args.insert(args.end(), {"--reasoning-parser", "qwen3"});
  testing::EngineProcess engine(args);
  const auto out_path = test::temp_path("openai-reasoning");
  ASSERT_EQ(test::run_command(
                "node " + test::quote(test::oracle_dir() / "openai_reasoning_check.js") + " " +
                test::quote("http://127.0.0.1:" + std::to_string(engine.port()) + "/v1") +
                " tiny " + test::quote(prompt) + " > " + test::quote(out_path)),
            0);
  const json r = json::parse(read_file(out_path));
  std::filesystem::remove(out_path);
  for (const char* mode : {"thinking", "not_thinking"}) {
    SCOPED_TRACE(mode);
    const json& whole = r[mode]["whole"];
    const json& stream = r[mode]["stream"];
    EXPECT_EQ(whole["reasoning"], stream["reasoning"]) << r.dump();
    EXPECT_EQ(whole["reasoning_alias"], whole["reasoning"]);
    EXPECT_EQ(stream["reasoning_alias"], stream["reasoning"]);
    EXPECT_EQ(whole["content"], stream["content"]);
    EXPECT_EQ(whole["finish"], "length");
  }
  // A random model writes no think markers (checked): its whole answer is reasoning, cut off.
  const std::string& text = plain[true];
  ASSERT_EQ(text.find("think>"), std::string::npos) << text;
  EXPECT_EQ(r["thinking"]["whole"]["reasoning"], text);
  EXPECT_TRUE(r["thinking"]["whole"]["content"].is_null());
  EXPECT_TRUE(r["not_thinking"]["whole"]["reasoning"].is_null());
  EXPECT_EQ(r["not_thinking"]["whole"]["content"], plain[false]);
  EXPECT_EQ(engine.stop(), 0);
}

// Constrained decoding with speculation: drafts are proposed without the grammar and verified
// under its mask, so answers still match (Python's re judges) while drafts are verified.
TEST_F(EngineServer, GuidedRegexHoldsWithSpeculativeDecoding) {
  testing::EngineProcess engine(engine_args({"--speculative-tokens", "2"}));
  const std::string pattern = "[a-z]{3,8}( [a-z]{2,6}){2}\\.";
  json texts = json::array();
  for (int seed = 1; seed <= 4; ++seed) {
    const auto res = testing::post_json(engine.port(), "/v1/completions",
                                        json{{"prompt", "Hello " + std::to_string(seed)},
                                             {"max_tokens", 60},
                                             {"temperature", 0.9},
                                             {"seed", seed},
                                             {"guided_regex", pattern}});
    ASSERT_EQ(res.status, 200) << res.body;
    const json choice = json::parse(res.body)["choices"][0];
    EXPECT_EQ(choice["finish_reason"], "stop") << choice.dump();
    texts.push_back(choice["text"]);
  }
  EXPECT_GT(metric(engine.port(), "vllm:spec_decode_num_draft_tokens_total"), 0);
  const auto in = tandem::test::temp_path("regex-in"), out = tandem::test::temp_path("regex-out");
  write_file_atomically(
      in, json{{"ascii", true}, {"regex", {{{"pattern", pattern}, {"texts", texts}}}}}.dump());
  ASSERT_EQ(tandem::test::run_command(
                "/usr/bin/python3 " +
                tandem::test::quote(tandem::test::oracle_dir() / "structured_output_oracle.py") +
                " < " + tandem::test::quote(in) + " > " + tandem::test::quote(out)),
            0);
  const json verdict = json::parse(read_file(out));
  std::filesystem::remove(in);
  std::filesystem::remove(out);
  for (size_t i = 0; i < texts.size(); ++i)
    EXPECT_TRUE(verdict["regex"][0][i].get<bool>()) << texts[i];
  EXPECT_EQ(engine.stop(), 0);
}

// A sequence keeps its prompt once, at the start of its tokens, and the request it keeps holds no
// second copy: with two, n choices of long prompts took ~550 times their body (8 prompts of
// 100,000 tokens, n 128: 1.4 GB for 2.4 MB).
TEST(EngineSequence, KeepsItsPromptOnceInItsTokens) {
  EngineRequest request;
  request.id = "a";
  request.prompt = {5, 6, 7};
  const auto seq = Sequence::of(std::move(request));
  EXPECT_EQ(seq->tokens, (std::vector<int32_t>{5, 6, 7}));
  EXPECT_EQ(seq->num_prompt, 3);
  EXPECT_EQ(seq->request.id, "a");
  EXPECT_EQ(seq->request.prompt.capacity(), 0u);
}

// The generated ids of each choice of a completion answer, read from its logprobs with
// return_tokens_as_token_ids ("token_id:N").
std::vector<std::vector<int32_t>> answer_ids(const json& answer) {
  std::vector<std::vector<int32_t>> out;
  for (const auto& c : answer["choices"]) {
    auto& ids = out.emplace_back();
    for (const auto& t : c["logprobs"]["tokens"])
      ids.push_back(std::stoi(t.get<std::string>().substr(std::string("token_id:").size())));
  }
  return out;
}

// vLLM's allowed_token_ids and bad_words through an engine that speculates with its MTP module:
// every token of every choice (n > 1, sampled and greedy) is an allowed id, and no choice holds a
// bad word's ids (as vLLM tokenizes it: bare and after a space) though the unconstrained greedy
// answer does.
TEST_F(EngineServer, AllowedTokenIdsAndBadWordsHoldInTheAnswersTokens) {
  testing::EngineProcess engine(engine_args({"--speculative-tokens", "2"}));
  auto complete = [&](json body) {
    body["prompt"] = "The quick brown fox";
    body["logprobs"] = 1;
    body["return_tokens_as_token_ids"] = true;
    body["ignore_eos"] = true;
    const auto res = testing::post_json(engine.port(), "/v1/completions", body);
    EXPECT_EQ(res.status, 200) << res.body;
    return res.status == 200 ? answer_ids(json::parse(res.body))
                             : std::vector<std::vector<int32_t>>{};
  };
  const std::vector<int32_t> free_ids = complete({{"max_tokens", 24}, {"temperature", 0}}).at(0);
  ASSERT_EQ(free_ids.size(), 24u);

  // Allowed: ids the free answer did not choose first, so the mask decides.
  std::set<int32_t> allowed;
  for (int32_t id = 1000; allowed.size() < 4; id += 37)
    if (id != free_ids[0]) allowed.insert(id);
  for (const json& sampling : {json{{"temperature", 0}}, json{{"temperature", 1.0}, {"seed", 3}},
                               json{{"temperature", 1.5}}}) {
    json body = sampling;
    body["max_tokens"] = 16;
    body["n"] = 3;
    body["allowed_token_ids"] = allowed;
    const auto choices = complete(body);
    ASSERT_EQ(choices.size(), 3u) << sampling.dump();
    for (const auto& ids : choices) {
      EXPECT_EQ(ids.size(), 16u);
      for (int32_t id : ids) EXPECT_TRUE(allowed.count(id)) << sampling.dump() << " drew " << id;
    }
  }

  // Bad words: the text of a token of the free greedy answer, whose ids (the bare word's or the
  // spaced one's, vLLM's rule) include that token alone.
  std::string word;
  std::vector<std::vector<int32_t>> banned;
  for (int32_t t : free_ids) {
    std::string text = tok_->decode(std::vector<int32_t>{t}, false);
    text.erase(0, std::min(text.size(), text.find_first_not_of(' ')));
    if (text.empty()) continue;
    const auto bare = tok_->encode(text, false), spaced = tok_->encode(" " + text, false);
    std::vector<std::vector<int32_t>> seqs = {bare};
    if (!spaced.empty() && spaced[0] != bare[0] && spaced.size() == bare.size())
      seqs.push_back(spaced);
    for (const auto& s : seqs)
      if (s == std::vector<int32_t>{t}) {
        word = tok_->decode(std::vector<int32_t>{t}, false);
        banned = seqs;
      }
    if (!word.empty()) break;
  }
  ASSERT_FALSE(word.empty()) << "no token of the free answer is a one-token word";
  for (const json& sampling : {json{{"temperature", 0}}, json{{"temperature", 0.8}, {"seed", 9}}}) {
    json body = sampling;
    body["max_tokens"] = 24;
    body["n"] = 2;
    body["bad_words"] = {word};
    const auto choices = complete(body);
    ASSERT_EQ(choices.size(), 2u);
    for (const auto& ids : choices)
      for (const auto& b : banned)
        EXPECT_EQ(std::search(ids.begin(), ids.end(), b.begin(), b.end()), ids.end())
            << "'" << word << "' in " << json(ids).dump();
    if (sampling["temperature"] == 0) {
      EXPECT_NE(choices[0], free_ids);
    }
  }
  EXPECT_GT(metric(engine.port(), "vllm:spec_decode_num_draft_tokens_total"), 0);
  EXPECT_EQ(engine.stop(), 0);
}

// A seeded prompt answers the same alone or at any place in a list of prompts, as in vLLM: each
// prompt of a list is sampled with the request's seed, and only its own n choices count up from
// it (choice j gets seed + j). Counting the choices across the list gave the second prompt other
// answers than it got alone.
TEST_F(EngineServer, ASeededPromptAnswersTheSameAloneOrInAList) {
  testing::EngineProcess engine(engine_args({"--batch-invariant"}));
  auto complete = [&](const json& prompt) {
    const auto res = testing::post_json(engine.port(), "/v1/completions",
                                        json{{"prompt", prompt},
                                             {"n", 2},
                                             {"seed", 5},
                                             {"temperature", 1.0},
                                             {"max_tokens", 12},
                                             {"ignore_eos", true},
                                             {"logprobs", 1},
                                             {"return_tokens_as_token_ids", true}});
    EXPECT_EQ(res.status, 200) << res.body;
    return res.status == 200 ? answer_ids(json::parse(res.body))
                             : std::vector<std::vector<int32_t>>{};
  };
  const auto hello = complete("hello"), world = complete("world");
  ASSERT_EQ(hello.size(), 2u);
  ASSERT_EQ(world.size(), 2u);
  EXPECT_NE(hello[0], hello[1]);  // the choices of one prompt have seeds of their own
  const auto both = complete(json::array({"hello", "world"}));
  const auto reversed = complete(json::array({"world", "hello"}));
  ASSERT_EQ(both.size(), 4u);
  ASSERT_EQ(reversed.size(), 4u);
  for (size_t j = 0; j < 2; ++j) {
    SCOPED_TRACE(j);
    EXPECT_EQ(both[j], hello[j]);
    EXPECT_EQ(both[2 + j], world[j]);
    EXPECT_EQ(reversed[j], world[j]);
    EXPECT_EQ(reversed[2 + j], hello[j]);
  }
  EXPECT_EQ(engine.stop(), 0);
}

// Response ids are named as vLLM names them, from the client's X-Request-Id when it sends one.
TEST_F(EngineServer, ResponseIdsCarryTheirPrefixAndTheClientsRequestId) {
  testing::EngineProcess engine(engine_args());
  auto id_of = [&](const std::string& path, const json& body, const std::string& request_id) {
    net::Headers h;
    if (!request_id.empty()) h.set("X-Request-Id", request_id);
    const auto r = net::http_request("127.0.0.1", engine.port(), "POST", path, body.dump(), h,
                                     std::chrono::seconds(60));
    EXPECT_EQ(r.status, 200) << r.body;
    return json::parse(r.body).value("id", std::string());
  };
  const json completion = {{"prompt", "hi"}, {"max_tokens", 2}};
  const json chat = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 2}};
  EXPECT_EQ(id_of("/v1/completions", completion, "abc"), "cmpl-abc");
  EXPECT_EQ(id_of("/v1/chat/completions", chat, "abc"), "chatcmpl-abc");
  EXPECT_EQ(id_of("/v1/completions", completion, "cmpl-xyz"), "cmpl-xyz");
  EXPECT_EQ(id_of("/v1/chat/completions", chat, "").rfind("chatcmpl-", 0), 0u);
  // An id that is not a plain token of at most 256 characters is replaced, as the gateway does:
  // it would be repeated in every streamed chunk (60 KB of header per token).
  const std::string huge(60000, 'x');
  const std::string replaced = id_of("/v1/completions", completion, huge);
  EXPECT_EQ(replaced.rfind("cmpl-", 0), 0u);
  EXPECT_LT(replaced.size(), 64u);
  EXPECT_EQ(id_of("/v1/completions", completion, std::string(256, 'y')),
            "cmpl-" + std::string(256, 'y'));
  EXPECT_EQ(id_of("/v1/completions", completion, "a b").find(' '), std::string::npos);
  EXPECT_EQ(engine.stop(), 0);
}

TEST_F(EngineServer, BadRequestsGetOpenAIErrors) {
  testing::EngineProcess engine(engine_args({"--max-body-bytes", "4096"}));
  auto post = [&](const std::string& target, const std::string& body) {
    return net::http_request("127.0.0.1", engine.port(), "POST", target, body);
  };
  auto check = [](const net::HttpClientResponse& r, int status) {
    EXPECT_EQ(r.status, status) << r.body;
    auto j = json::parse(r.body, nullptr, false);
    ASSERT_TRUE(j.is_object()) << r.body;
    EXPECT_TRUE(j["error"]["message"].is_string()) << r.body;
  };
  check(post("/v1/completions", "{not json"), 400);
  check(post("/v1/completions", std::string(100, '[')), 400);
  check(post("/v1/completions", R"({"prompt": "x", "max_tokens": "many"})"), 400);
  // The field is named as OpenAI names it: "param".
  EXPECT_EQ(json::parse(post("/v1/completions", R"({"prompt": "x", "max_tokens": "many"})")
                            .body)["error"]["param"],
            "max_tokens");
  EXPECT_EQ(json::parse(post("/v1/completions", "{not json").body)["error"]["param"], nullptr);
  check(post("/v1/completions", R"({"prompt": [1, 2, 99999999]})"), 400);
  check(post("/v1/chat/completions", R"({"messages": "hello"})"), 400);
  check(post("/v1/completions", R"({"prompt": "x", "model": "gpt-4"})"), 404);
  check(post("/v1/completions", "{\"prompt\": \"" + std::string(8000, 'a') + "\"}"), 413);
  check(post("/generate", R"({"input_ids": [1], "sampling_params": 3})"), 400);
  check(net::http_request("127.0.0.1", engine.port(), "GET", "/v1/nothing"), 404);
  check(net::http_request("127.0.0.1", engine.port(), "GET", "/v1/completions"), 405);
  // The engine is still serving.
  auto ok =
      post("/generate", R"({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})");
  EXPECT_EQ(ok.status, 200) << ok.body;
  EXPECT_EQ(json::parse(ok.body)["meta_info"]["completion_tokens"], 2);
}

// /expert_load counts what the model routed: the same counts as the single-sequence generate
// loop's forward passes over the same tokens, top-k routes per token in every MoE layer, and the
// same numbers in the dumped snapshots.
TEST_F(EngineServer, ExpertLoadCountsTheRoutesTheForwardPassesTook) {
  const std::filesystem::path dump = test::temp_path("expert-load-dump");
  testing::EngineProcess engine(
      engine_args({"--expert-load-window", "8", "--expert-load-dump", dump.string()}));
  const json idle = get_json(engine.port(), "/expert_load");
  EXPECT_EQ(idle["steps"], 0);
  EXPECT_EQ(idle["layer_ids"], json::array({1, 2}));  // tiny-v3: layer 0 is dense
  std::vector<int32_t> prompt;
  for (int k = 0; k < 20; ++k) prompt.push_back(700 + 13 * k);
  const int64_t max_tokens = 16;
  json body = {
      {"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}, {"ignore_eos", true}};
  auto resp = testing::post_json(engine.port(), "/v1/completions", body);
  ASSERT_EQ(resp.status, 200) << resp.body;
  ASSERT_TRUE(wait_idle(engine.port()));

  const auto before = model_->expert_counts();
  greedy(prompt, max_tokens);
  const auto after = model_->expert_counts();
  const json load = get_json(engine.port(), "/expert_load");
  // One prefill step, then a step per generated token but the last (never fed back).
  EXPECT_EQ(load["steps"], max_tokens);
  const int64_t tokens = int64_t(prompt.size()) + max_tokens - 1;
  const int64_t top_k = model_->config().num_experts_per_tok;
  for (int i = 0; i < 2; ++i) {
    const int64_t layer = load["layer_ids"][i];
    int64_t routed = 0;
    for (int64_t e = 0; e < 8; ++e) {
      EXPECT_EQ(load["cumulative"][i][e].get<int64_t>(),
                int64_t(after[layer][e] - before[layer][e]))
          << "layer " << layer << " expert " << e;
      routed += load["cumulative"][i][e].get<int64_t>();
    }
    EXPECT_EQ(routed, tokens * top_k) << "layer " << layer;
  }
  // The window is the last 8 steps: decode steps only, one token each.
  EXPECT_EQ(load["window_steps"], 8);
  int64_t window_routes = 0;
  for (const auto& row : load["window"])
    for (const auto& v : row) window_routes += v.get<int64_t>();
  EXPECT_EQ(window_routes, 2 * 8 * top_k);
  EXPECT_GE(metric(engine.port(), "tandem:expert_load_imbalance"), 1.0);

  // Snapshots every 8 steps, the cumulative counts at exit.
  EXPECT_EQ(engine.stop(), 0);
  const NpyArray last = read_npy(dump / "expert_load_00000016.npy");
  EXPECT_EQ(last.shape, (std::vector<int64_t>{2, 8}));
  for (int64_t i = 0; i < 16; ++i)
    EXPECT_EQ(last.values[i], load["window"][i / 8][i % 8].get<int64_t>());
  const NpyArray total = read_npy(dump / "expert_load_cumulative.npy");
  for (int64_t i = 0; i < 16; ++i)
    EXPECT_EQ(total.values[i], load["cumulative"][i / 8][i % 8].get<int64_t>());
  EXPECT_TRUE(std::filesystem::exists(dump / "expert_load_00000008.json"));
  std::filesystem::remove_all(dump);
}

// A simulated expert-parallel engine reports the routes its skew model drew for its group (it
// stands for one of 4 data-parallel ranks with similar batches).
TEST_F(EngineServer, SimulatedExpertParallelEngineReportsItsRoutes) {
  testing::EngineProcess engine({TANDEM_BINARY, "engine", "--model", "sim:tiny", "--host",
                                 "127.0.0.1", "--port", "0", "--sim-time-scale", "0",
                                 "--sim-expert-parallel", "4", "--sim-routing-skew", "1.2"});
  json body = {{"prompt", std::vector<int32_t>(10, 1000)}, {"max_tokens", 5}, {"ignore_eos", true}};
  auto resp = testing::post_json(engine.port(), "/v1/completions", body);
  ASSERT_EQ(resp.status, 200) << resp.body;
  ASSERT_TRUE(wait_idle(engine.port()));
  const json load = get_json(engine.port(), "/expert_load");
  EXPECT_EQ(load["layer_ids"], json::array({1}));  // the tiny model's one MoE layer
  int64_t routes = 0;
  for (const auto& v : load["cumulative"][0]) routes += v.get<int64_t>();
  EXPECT_EQ(routes, (10 + 5 - 1) * 2 * 4);  // every computed token, top-2, on each of 4 ranks
}

TEST_F(EngineServer, SimulatedExecutorServesTheSameApi) {
  testing::EngineProcess engine({TANDEM_BINARY, "engine", "--model", "sim:tiny", "--host",
                                 "127.0.0.1", "--port", "0", "--num-kv-blocks", "64"});
  EXPECT_EQ(get_json(engine.port(), "/v1/models")["data"][0]["id"], "sim:tiny");
  // The openai client's models.retrieve: GET /v1/models/{id}, the id as it is or encoded as
  // encodeURIComponent writes it; another id is 404 model_not_found, as a request naming it is
  // (and as the gateway answers it).
  for (const char* path : {"/v1/models/sim:tiny", "/v1/models/sim%3Atiny"}) {
    SCOPED_TRACE(path);
    const json model = get_json(engine.port(), path);
    EXPECT_EQ(model["id"], "sim:tiny");
    EXPECT_EQ(model["object"], "model");
    EXPECT_GT(model["max_model_len"].get<int64_t>(), 0);
  }
  const auto other = net::http_request("127.0.0.1", engine.port(), "GET", "/v1/models/other");
  EXPECT_EQ(other.status, 404);
  EXPECT_EQ(api::openai_error_code(other.body), std::optional<std::string>("model_not_found"))
      << other.body;
  EXPECT_NE(other.body.find("The model `other` does not exist."), std::string::npos) << other.body;
  const auto unknown = net::http_request("127.0.0.1", engine.port(), "POST", "/v1/completions",
                                         R"({"model": "other", "prompt": "x"})");
  EXPECT_EQ(unknown.status, 404);
  EXPECT_EQ(api::openai_error_code(unknown.body), std::optional<std::string>("model_not_found"));
  auto ask = [&](const std::string& prompt) {
    json body = {{"prompt", prompt}, {"max_tokens", 20}, {"stop", json::array()}};
    auto resp =
        net::http_request("127.0.0.1", engine.port(), "POST", "/v1/completions", body.dump());
    EXPECT_EQ(resp.status, 200) << resp.body;
    return json::parse(resp.body);
  };
  const std::string long_prompt =
      "Hello there, this prompt is long enough to fill a few blocks of sixteen tokens each, so the "
      "second request can find them in the cache.";
  auto a = ask(long_prompt), b = ask(long_prompt), c = ask("Something else");
  // Deterministic tokens: the same prompt continues the same way; generation runs to max_tokens.
  EXPECT_EQ(a["choices"][0]["text"], b["choices"][0]["text"]);
  EXPECT_NE(a["choices"][0]["text"], c["choices"][0]["text"]);
  EXPECT_EQ(a["usage"]["completion_tokens"], 20);
  EXPECT_EQ(a["choices"][0]["finish_reason"], "length");
  // The second identical prompt found the first one's full blocks.
  EXPECT_GT(metric(engine.port(), "vllm:prefix_cache_hits_total"), 0);
  // Chat works through the DeepSeek-V3 tokenizer's template.
  json chat = {
      {"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 5}, {"stream", true}};
  std::string events;
  auto resp = net::http_request_stream("127.0.0.1", engine.port(), "POST", "/v1/chat/completions",
                                       chat.dump(), {}, [&](std::string_view piece) {
                                         events.append(piece);
                                         return true;
                                       });
  EXPECT_EQ(resp.status, 200);
  EXPECT_NE(events.find("chat.completion.chunk"), std::string::npos);
  EXPECT_NE(events.find("data: [DONE]"), std::string::npos);
  // Token masks, as structured outputs, need a model: refused, not ignored.
  for (const auto& [name, value] : std::vector<std::pair<std::string, json>>{
           {"allowed_token_ids", {5, 6}}, {"bad_words", {"hello"}}}) {
    const auto refused = testing::post_json(
        engine.port(), "/v1/completions", json{{"prompt", "hi"}, {"max_tokens", 3}, {name, value}});
    EXPECT_EQ(refused.status, 400) << refused.body;
    EXPECT_NE(refused.body.find(name), std::string::npos) << refused.body;
  }
}

// An engine with an API key answers only callers that carry it, except its health probe and
// Prometheus metrics; and a request past the operator's max_tokens limit is refused naming it.
TEST_F(EngineServer, AnApiKeyGuardsEveryRouteButHealthAndMetrics) {
  testing::EngineProcess engine({TANDEM_BINARY, "engine", "--model", "sim:tiny", "--host",
                                 "127.0.0.1", "--port", "0", "--num-kv-blocks", "64", "--api-key",
                                 "k1", "--max-tokens-limit", "8"});
  const json body = {{"prompt", "hi"}, {"max_tokens", 4}};
  for (const auto& [method, path] :
       std::vector<std::pair<std::string, std::string>>{{"GET", "/v1/models"},
                                                        {"GET", "/v1/models/sim:tiny"},
                                                        {"GET", "/v1/models/other"},
                                                        {"GET", "/load"},
                                                        {"POST", "/v1/completions"}}) {
    auto r = net::http_request("127.0.0.1", engine.port(), method, path,
                               method == "POST" ? body.dump() : "");
    EXPECT_EQ(r.status, 401) << path;
    EXPECT_EQ(json::parse(r.body)["error"]["code"], "invalid_api_key") << r.body;
  }
  net::Headers wrong, right;
  wrong.set("Authorization", "Bearer k2");
  right.set("Authorization", "Bearer k1");
  EXPECT_EQ(
      net::http_request("127.0.0.1", engine.port(), "POST", "/v1/completions", body.dump(), wrong)
          .status,
      401);
  auto ok =
      net::http_request("127.0.0.1", engine.port(), "POST", "/v1/completions", body.dump(), right);
  EXPECT_EQ(ok.status, 200) << ok.body;
  EXPECT_EQ(net::http_request("127.0.0.1", engine.port(), "GET", "/health").status, 200);
  EXPECT_EQ(net::http_request("127.0.0.1", engine.port(), "GET", "/metrics").status, 200);
  EXPECT_EQ(net::http_request("127.0.0.1", engine.port(), "HEAD", "/health").status, 200);
  const json too_many = {{"prompt", "hi"}, {"max_tokens", 9}};
  auto refused = net::http_request("127.0.0.1", engine.port(), "POST", "/v1/completions",
                                   too_many.dump(), right);
  EXPECT_EQ(refused.status, 400);
  EXPECT_NE(refused.body.find("above this server's limit of 8"), std::string::npos) << refused.body;
  // Omitted, max_tokens is the API's default within the limit.
  auto chat = net::http_request(
      "127.0.0.1", engine.port(), "POST", "/v1/chat/completions",
      json{{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"ignore_eos", true}}.dump(),
      right);
  ASSERT_EQ(chat.status, 200) << chat.body;
  EXPECT_EQ(json::parse(chat.body)["usage"]["completion_tokens"], 8);
}

// A request waiting behind the running one counts only the part of its prompt the prefix cache
// does not hold: a cached continuation is little work, and a router must see it so. One sequence
// runs at a time in 96-token steps; the 1024-token prompt leaves 1024 - 96k tokens (64 modulo
// 96), the waiting 80-token one holds 64 cached tokens (16 to compute), so the queue is 80
// modulo 96 (counting all 80 would make it 48). The engine is slowed so that a 96-token step
// takes ~2 s: the second request has the first one's ten full steps (~18 s, however late a
// loaded machine sends it) to arrive while one runs; stopping the engine ends both.
TEST_F(EngineServer, LoadCountsAWaitingRequestWithoutItsCachedPrefix) {
  testing::EngineProcess engine({TANDEM_BINARY, "engine", "--model", "sim:tiny", "--host",
                                 "127.0.0.1", "--port", "0", "--max-num-batched-tokens", "96",
                                 "--max-num-seqs", "1", "--block-size", "16", "--sim-time-scale",
                                 "500"});
  std::vector<int32_t> shared, running, continuation;
  for (int i = 0; i < 64; ++i) shared.push_back(2000 + i);
  for (int i = 0; i < 1024; ++i) running.push_back(1000 + (i % 900));
  continuation = shared;
  for (int i = 0; i < 16; ++i) continuation.push_back(3000 + i);
  auto post = [&](const std::vector<int32_t>& prompt) {
    json body = {{"prompt", prompt}, {"max_tokens", 1}, {"ignore_eos", true}};
    return net::http_request("127.0.0.1", engine.port(), "POST", "/v1/completions", body.dump());
  };
  ASSERT_EQ(post(shared).status, 200);  // now cached (one 64-token step)
  auto first = std::async(std::launch::async, [&] { return post(running); });
  // The first one runs (not a report left from the warm-up's step): it is held, and a full step
  // runs.
  ASSERT_TRUE(testing::eventually([&] {
    const json l = get_json(engine.port(), "/load");
    return l["tokens_in_flight"] >= 1024 && !l["step"].is_null() && l["step"]["tokens"] == 96;
  }));
  auto second = std::async(std::launch::async, [&] { return post(continuation); });
  json seen;
  ASSERT_TRUE(testing::eventually([&] {
    seen = get_json(engine.port(), "/load");
    // Both are in (tokens held), the second waits, and a full step of the first one runs.
    return seen["tokens_in_flight"] >= 1024 + 80 && seen["waiting"] == 1 &&
           !seen["step"].is_null() && seen["step"]["tokens"] == 96;
  })) << seen.dump();
  EXPECT_EQ(seen["prefill_tokens"].get<int64_t>() % 96, 80) << seen.dump();
  // Neither would finish for ~20 s: stopping the engine ends them (an error or a closed
  // connection, whichever comes).
  EXPECT_EQ(engine.stop(), 0);
  for (auto* answer : {&first, &second}) {
    try {
      answer->get();
    } catch (const std::exception&) {
    }
  }
}

// /load tells a gateway what runs now and what is queued behind it, and how long steps took:
// a 512-token prompt prefilled in 64-token chunks shows as one 64-token step running with the
// rest of the prompt queued (a multiple of the chunk), then as 8 recorded prefill steps.
TEST_F(EngineServer, LoadReportsTheRunningStepQueuedPrefillAndStepDurations) {
  std::vector<int32_t> prompt;
  for (int i = 0; i < 512; ++i) prompt.push_back(1000 + i);
  const json body = {{"prompt", prompt}, {"max_tokens", 2}, {"ignore_eos", true}};
  {
    // While it runs: an engine slowed so that a 64-token step takes ~1.6 s and the prompt's
    // eight ~13 s, so that a poll lands in one however late a loaded machine sends it; stopping
    // the engine ends the request.
    testing::EngineProcess engine({TANDEM_BINARY, "engine", "--model", "sim:tiny", "--host",
                                   "127.0.0.1", "--port", "0", "--max-num-batched-tokens", "64",
                                   "--sim-time-scale", "500", "--no-enable-prefix-caching"});
    const json idle = get_json(engine.port(), "/load");
    EXPECT_TRUE(idle["step"].is_null());
    EXPECT_EQ(idle["prefill_tokens"], 0);
    EXPECT_EQ(idle["prefill_pairs"], 0);
    auto answer = std::async(std::launch::async, [&] {
      return net::http_request("127.0.0.1", engine.port(), "POST", "/v1/completions", body.dump());
    });
    json seen;
    EXPECT_TRUE(testing::eventually([&] {
      seen = get_json(engine.port(), "/load");
      return !seen["step"].is_null() && seen["step"]["tokens"] == 64;
    }));
    EXPECT_EQ(seen["step"]["seqs"], 1);
    EXPECT_GE(seen["step"]["running_for_s"].get<double>(), 0.0);
    const int64_t queued = seen["prefill_tokens"];
    EXPECT_LE(queued, 512 - 64);
    EXPECT_EQ((512 - 64 - queued) % 64, 0) << seen.dump();
    // Attention pairs: the queue is the prompt's tail, the running step the 64 tokens before it.
    EXPECT_EQ(seen["prefill_pairs"], api::causal_pairs(512 - queued, 512)) << seen.dump();
    EXPECT_EQ(seen["step"]["prefill_pairs"], api::causal_pairs(512 - queued - 64, 512 - queued))
        << seen.dump();
    EXPECT_EQ(engine.stop(), 0);
    try {
      answer.get();
    } catch (const std::exception&) {
    }
  }
  // Once done: the same request on an engine at the model's own speed, awaited to its end.
  testing::EngineProcess engine({TANDEM_BINARY, "engine", "--model", "sim:tiny", "--host",
                                 "127.0.0.1", "--port", "0", "--max-num-batched-tokens", "64",
                                 "--no-enable-prefix-caching"});
  const auto answer =
      net::http_request("127.0.0.1", engine.port(), "POST", "/v1/completions", body.dump());
  EXPECT_EQ(answer.status, 200) << answer.body;
  ASSERT_TRUE(wait_idle(engine.port()));
  const json done = get_json(engine.port(), "/load");
  EXPECT_EQ(done["prefill_tokens"], 0);
  EXPECT_EQ(done["prefill_pairs"], 0);
  EXPECT_TRUE(done["step"].is_null());
  // [index, seqs, tokens, seconds, prefill_pairs], oldest first
  const json& steps = done["recent_steps"];
  ASSERT_GE(steps.size(), 9u) << done.dump();
  int prefill_steps = 0;
  int64_t pairs = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    if (i > 0) {
      EXPECT_EQ(steps[i][0].get<int64_t>(), steps[i - 1][0].get<int64_t>() + 1);
    }
    EXPECT_EQ(steps[i][1], 1);
    EXPECT_GT(steps[i][3].get<double>(), 0.0);
    if (steps[i][2] == 64) {  // the k-th chunk computes positions [64k, 64k + 64)
      EXPECT_EQ(steps[i][4], api::causal_pairs(64 * prefill_steps, 64 * prefill_steps + 64));
      ++prefill_steps;
    } else {
      EXPECT_EQ(steps[i][4], 0);  // a decode step
    }
    pairs += steps[i][4].get<int64_t>();
  }
  EXPECT_EQ(prefill_steps, 8);
  EXPECT_EQ(pairs, 512 * 513 / 2);
}

TEST_F(EngineServer, SimFitModelFromTheCpuExecutorDrivesASimEngine) {
  const auto out = test::temp_path("sim-fit");
  ASSERT_EQ(
      test::run_command(std::string(TANDEM_BINARY) + " sim-fit --model " + test::quote(*dir_) +
                        " --out " + test::quote(out) + " --name tiny-cpu > /dev/null 2>&1"),
      0);
  const auto fitted = SimLatencyModel::load(out);
  EXPECT_EQ(fitted.name(), "tiny-cpu");
  // Every measured step took time, so the fitted model must predict some for every kind of step.
  StepShape prefill, decode;
  prefill.prefills.push_back({64, 0});
  decode.decode_seqs = decode.decode_tokens = 4;
  decode.decode_context_tokens = 4 * 128;
  EXPECT_GT(fitted.step_seconds(prefill), 0);
  EXPECT_GT(fitted.step_seconds(decode), 0);

  testing::EngineProcess engine({TANDEM_BINARY, "engine", "--model", "sim:" + out.string(),
                                 "--host", "127.0.0.1", "--port", "0", "--num-kv-blocks", "64",
                                 "--max-model-len", "1024"});
  json body = {{"prompt", "hello"}, {"max_tokens", 4}};
  auto resp = net::http_request("127.0.0.1", engine.port(), "POST", "/v1/completions", body.dump());
  EXPECT_EQ(resp.status, 200) << resp.body;
  EXPECT_EQ(json::parse(resp.body)["usage"]["completion_tokens"], 4);
  engine.stop();
  std::filesystem::remove(out);
}

TEST_F(EngineServer, KvEventsMatchTheCache) {
  const std::string config =
      R"({"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",)"
      R"( "replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv@test"})";
  testing::EngineProcess engine({TANDEM_BINARY, "engine", "--model", "sim:tiny", "--host",
                                 "127.0.0.1", "--port", "0", "--block-size", "4", "--num-kv-blocks",
                                 "10", "--kv-events-config", config});
  const std::string replay = testing::read_kv_events_line(engine).replay;

  // Four requests of 10 prompt tokens and 3 new ones: 12 computed tokens = 3 full blocks each,
  // 12 blocks in all for a cache of 10, so the last request evicts two of the first one's.
  std::set<uint64_t> computed_hashes;
  std::vector<uint64_t> last_hashes;
  for (int i = 0; i < 4; ++i) {
    std::vector<int32_t> prompt;
    for (int k = 0; k < 10; ++k) prompt.push_back(100 * (i + 1) + k);
    json body = {{"input_ids", prompt}, {"sampling_params", {{"max_new_tokens", 3}}}};
    auto resp = net::http_request("127.0.0.1", engine.port(), "POST", "/generate", body.dump());
    ASSERT_EQ(resp.status, 200) << resp.body;
    auto out = json::parse(resp.body)["output_ids"].get<std::vector<int32_t>>();
    ASSERT_EQ(out.size(), 3u);
    auto seq = prompt;
    seq.insert(seq.end(), out.begin(), out.end() - 1);  // the last sampled token is never computed
    last_hashes = api::block_hashes(seq, 4);
    computed_hashes.insert(last_hashes.begin(), last_hashes.end());
  }
  // The answer leaves during the engine's step, the /load snapshot is written at its end: wait
  // for the snapshot that shows the last request finished before reading the cache size.
  ASSERT_TRUE(wait_idle(engine.port()));
  const int64_t cached = get_json(engine.port(), "/load")["cached_blocks"];

  // Replay every batch from sequence 0 with the independent decoder; the last batch may still be
  // on its way to the publisher thread, so retry until the events explain the cache.
  std::set<uint64_t> state;
  int stored = 0, removed = 0;
  for (int attempt = 0; attempt < 50; ++attempt) {
    const auto path = test::temp_path("kv-replay");
    const std::string cmd =
        "/usr/bin/python3 " + test::quote(test::oracle_dir() / "kv_events_subscriber.py") +
        " replay --replay " + test::quote(replay) + " --start 0 > " + test::quote(path);
    ASSERT_EQ(test::run_command(cmd), 0);
    std::ifstream in(path);
    state.clear();
    stored = removed = 0;
    for (std::string l; std::getline(in, l);) {
      json j = json::parse(l);
      if (!j.contains("batch")) continue;
      for (const auto& ev : j["batch"]["events"]) {
        if (ev["type"] == "BlockStored") {
          EXPECT_TRUE(ev["hashes_match_tokens"].get<bool>()) << ev.dump();
          EXPECT_EQ(ev["block_size"], 4);
          for (uint64_t h : ev["block_hashes"]) {
            EXPECT_TRUE(computed_hashes.count(h)) << "stored a block no request computed";
            state.insert(h);
            ++stored;
          }
        } else if (ev["type"] == "BlockRemoved") {
          for (uint64_t h : ev["block_hashes"]) {
            EXPECT_TRUE(state.erase(h)) << "removed a block that was never stored";
            ++removed;
          }
        }
      }
    }
    std::filesystem::remove(path);
    if (static_cast<int64_t>(state.size()) == cached) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(static_cast<int64_t>(state.size()), cached);
  EXPECT_EQ(stored, 12);
  EXPECT_GT(removed, 0);  // the cache is smaller than what the requests computed
  for (auto h : last_hashes)
    EXPECT_TRUE(state.count(h)) << "the newest blocks must still be cached";
}

using testing::KeptReply;

// An engine in process on the simulated tiny model, run by the test's own calls to run_once.
using test::sim_engine;

// `body` handed to the API as a POST, the engine run until its reply is done (100 steps at most).
std::shared_ptr<KeptReply> handled(GenerationApi& api, Engine& engine, api::ApiKind kind,
                                   const json& body) {
  net::HttpRequest req;
  req.method = "POST";
  req.body = body.dump();
  auto reply = std::make_shared<KeptReply>();
  api.handle(kind, req, reply);
  for (int i = 0; i < 100 && !reply->done; ++i) engine.run_once();
  return reply;
}

// `created` is when each request came (as OpenAI and vLLM), read from the API's clock as the
// request is handled, not the time the engine started.
TEST_F(EngineServer, EachResponseIsCreatedWhenItsRequestCame) {
  metrics::Registry registry;
  const std::unique_ptr<Engine> owned = sim_engine(EngineConfig{}, *tok_, registry);
  Engine& engine = *owned;
  int64_t unix_now = 1'700'000'000;
  GenerationApi api(
      engine, [](std::function<void()> task) { task(); }, {}, [&] { return unix_now; });
  auto answer = [&](api::ApiKind kind, const json& body) {
    const auto reply = handled(api, engine, kind, body);
    EXPECT_TRUE(reply->done);
    EXPECT_EQ(reply->status, 200) << reply->body;
    return reply->body;
  };
  const json completion = {{"prompt", "hi"}, {"max_tokens", 2}};
  const json chat = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 2}};
  unix_now += 5;
  EXPECT_EQ(json::parse(answer(api::ApiKind::kCompletion, completion))["created"], unix_now);
  unix_now += 7;
  EXPECT_EQ(json::parse(answer(api::ApiKind::kChat, chat))["created"], unix_now);
  // Every streamed chunk carries its own request's time.
  unix_now += 3;
  json streamed = chat;
  streamed["stream"] = true;
  const std::string events = answer(api::ApiKind::kChat, streamed);
  int chunks = 0;
  std::istringstream lines(events);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("data: {", 0) != 0) continue;
    EXPECT_EQ(json::parse(line.substr(6))["created"], unix_now) << line;
    ++chunks;
  }
  EXPECT_GT(chunks, 0) << events;
  engine.stop();
}

// As vLLM: a priority is refused by an engine that serves in arrival order (a client would
// believe it counted), and taken by one started with --scheduling-policy priority.
TEST_F(EngineServer, APriorityIsRefusedUnlessTheEngineSchedulesByPriority) {
  for (const bool by_priority : {false, true}) {
    EngineConfig config;
    config.scheduler.priority = by_priority;
    metrics::Registry registry;
    const std::unique_ptr<Engine> owned = sim_engine(config, *tok_, registry);
    Engine& engine = *owned;
    GenerationApi api(engine, [](std::function<void()> task) { task(); });
    auto status = [&](api::ApiKind kind, const json& body) {
      const auto reply = handled(api, engine, kind, body);
      EXPECT_TRUE(reply->done);
      if (reply->status == 400) {
        EXPECT_EQ(json::parse(reply->body)["error"]["param"], "priority") << reply->body;
      }
      return reply->status;
    };
    const json chat = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 2}};
    for (const int priority : {-1, 3}) {
      json urgent = chat;
      urgent["priority"] = priority;
      EXPECT_EQ(status(api::ApiKind::kChat, urgent), by_priority ? 200 : 400) << priority;
      EXPECT_EQ(status(api::ApiKind::kCompletion,
                       {{"prompt", "hi"}, {"max_tokens", 2}, {"priority", priority}}),
                by_priority ? 200 : 400);
    }
    json ordinary = chat;
    ordinary["priority"] = 0;
    EXPECT_EQ(status(api::ApiKind::kChat, ordinary), 200);
    EXPECT_EQ(status(api::ApiKind::kChat, chat), 200);
    engine.stop();
  }
}

// The engine validates requests with its generation config's defaults (--generation-config):
// --override-generation-config's max_new_tokens caps what a request asks for, as vLLM's does.
TEST_F(EngineServer, TheOverridesMaxNewTokensCapsAnswers) {
  EngineConfig config;
  config.sampling_defaults.max_tokens_cap = 3;
  metrics::Registry registry;
  const std::unique_ptr<Engine> owned = sim_engine(config, *tok_, registry);
  Engine& engine = *owned;
  GenerationApi api(engine, [](std::function<void()> task) { task(); });
  const auto reply = handled(api, engine, api::ApiKind::kCompletion,
                             {{"prompt", "hi"}, {"max_tokens", 10}, {"ignore_eos", true}});
  ASSERT_TRUE(reply->done);
  ASSERT_EQ(reply->status, 200) << reply->body;
  const json answer = json::parse(reply->body);
  EXPECT_EQ(answer["usage"]["completion_tokens"], 3);
  EXPECT_EQ(answer["choices"][0]["finish_reason"], "length");
  engine.stop();
}

}  // namespace
}  // namespace tandem::engine
