// Prefill/decode disaggregation end to end: `tandem engine --role prefill` and `--role decode` as
// separate processes, driven the way gateways drive them, in both dialects:
//   sequential (vLLM NixlConnector shapes): prefill leg with kv_transfer_params.do_remote_decode,
//     its answer's kv_transfer_params forwarded verbatim to the decode leg, which pulls;
//   parallel (SGLang shapes): both legs at once with bootstrap_host/port/room, prefill pushes.
// Greedy answers must equal one `--role both` engine's; transfers must move exactly the bytes the
// model's cache holds for the tokens the decode engine lacks; every failure must reach the
// affected leg as an OpenAI error, and no KV block may stay in use on either side.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <future>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "api/error.h"
#include "engine/engine.h"
#include "engine/engine_http.h"
#include "engine/engine_process.h"
#include "engine/fake_kv_transfers.h"
#include "engine/sim_engine_fixture.h"
#include "engine/tiny_model_fixture.h"
#include "model/model_test_support.h"
#include "text/oracle_support.h"
#include "util/loopback_socket.h"

namespace tandem::engine {
namespace {

using nlohmann::json;
using testing::EngineProcess;
using testing::eventually;
using testing::get_json;
using testing::metric;
using testing::post_json;

constexpr char kF32[] = "f32";
constexpr char kBf16[] = "bf16";

using test::tokens;

json parse(const net::HttpClientResponse& r) {
  EXPECT_EQ(r.status, 200) << r.body;
  return r.status == 200 ? json::parse(r.body) : json();
}

std::string text_of(const json& answer) {
  if (answer.is_null()) return "<error>";
  const json& c = answer["choices"][0];
  return c.contains("text") ? c["text"].get<std::string>()
                            : c["message"]["content"].get<std::string>();
}

// The message of an OpenAI error answer.
std::string error_message(const net::HttpClientResponse& r) {
  try {
    return json::parse(r.body)["error"]["message"].get<std::string>();
  } catch (const std::exception&) {
    return "not an OpenAI error: " + r.body;
  }
}

// An engine process plus the port of its KV transfer server (0 without one).
struct Engine {
  std::unique_ptr<EngineProcess> process;
  uint16_t kv_port = 0;
  uint16_t port() const { return process->port(); }
};

// Engines on a tiny-v3 checkpoint of the given dtype and the two P/D flows through them.
template <const char* Dtype>
class PdTest : public test::TinyModelTest<Dtype> {
 protected:
  static Engine start(const std::string& role, std::vector<std::string> extra = {},
                      const std::string& model = {}) {
    std::vector<std::string> a = {TANDEM_BINARY, "engine", "--model",
                                  model.empty() ? PdTest::dir_->string() : model};
    a.insert(a.end(),
             {"--served-model-name", "tiny", "--host", "127.0.0.1", "--port", "0", "--role", role});
    if (std::find(extra.begin(), extra.end(), "--num-kv-blocks") == extra.end())
      a.insert(a.end(), {"--num-kv-blocks", "256"});
    if (role == "prefill") a.insert(a.end(), {"--kv-transfer-port", "0"});
    a.insert(a.end(), extra.begin(), extra.end());
    Engine e;
    e.process = std::make_unique<EngineProcess>(a);
    const std::string line = e.process->next_line();
    const auto at = line.find("KV transfer on ");
    if (at != std::string::npos) {
      const auto colon = line.find(':', at + 15);
      e.kv_port = static_cast<uint16_t>(std::stoi(line.substr(colon + 1)));
    }
    return e;
  }

  // The sequential flow as vLLM's proxy runs it: prefill leg (max_tokens 1, no stream), then the
  // original body plus the prefill's kv_transfer_params to the decode engine.
  static json sequential(const Engine& p, const Engine& d, const json& body,
                         const std::string& path = "/v1/completions") {
    json pre = body;
    pre["kv_transfer_params"] = {{"do_remote_decode", true},    {"do_remote_prefill", false},
                                 {"remote_engine_id", nullptr}, {"remote_block_ids", nullptr},
                                 {"remote_host", nullptr},      {"remote_port", nullptr}};
    pre["max_tokens"] = 1;
    pre["stream"] = false;
    const json answer = parse(post_json(p.port(), path, pre));
    if (answer.is_null()) return answer;
    EXPECT_EQ(answer["usage"]["completion_tokens"], 1);
    json dec = body;
    dec["kv_transfer_params"] = answer["kv_transfer_params"];
    return parse(post_json(d.port(), path, dec));
  }

  // The parallel flow as SGLang's router runs it: the same body, with the room, to both legs at
  // once; the client gets the decode leg's answer.
  static json parallel(const Engine& p, const Engine& d, json body, uint64_t room,
                       const std::string& path = "/v1/completions") {
    body["bootstrap_host"] = "127.0.0.1";
    body["bootstrap_port"] = p.kv_port;
    body["bootstrap_room"] = room;
    auto prefill = std::async(std::launch::async, [&] { return post_json(p.port(), path, body); });
    const json answer = parse(post_json(d.port(), path, body));
    const auto pre = prefill.get();
    EXPECT_EQ(pre.status, 200) << pre.body;
    return answer;
  }
};

class Disaggregation : public PdTest<kF32> {
 protected:
  // Prompts of the given lengths through both flows answer as the single engine does.
  static void expect_both_flows_match(const Engine& single, const Engine& p, const Engine& d,
                                      std::initializer_list<int> lengths, int base, uint64_t room) {
    for (int n : lengths) {
      for (bool seq : {true, false}) {
        const json body = {{"prompt", tokens(n, base += 31)},
                           {"max_tokens", 10},
                           {"temperature", 0},
                           {"ignore_eos", true}};
        const json want = parse(post_json(single.port(), "/v1/completions", body));
        const json got = seq ? sequential(p, d, body) : parallel(p, d, body, ++room);
        EXPECT_EQ(text_of(got), text_of(want)) << (seq ? "sequential" : "parallel") << " n=" << n;
      }
    }
  }

  // Nothing left in use: no block referenced (cached ones are free), nothing held for transfer.
  static void expect_no_leak(const Engine& e) {
    EXPECT_TRUE(eventually([&] {
      return metric(e.port(), "tandem:kv_transfer_held_blocks") == 0 &&
             metric(e.port(), "vllm:kv_cache_usage_perc") == 0;
    })) << "blocks still in use on port "
        << e.port() << ": " << get_json(e.port(), "/load").dump();
  }

  // Bytes one token's KV takes over all layers: measured from a first transfer with nothing
  // cached on the decode side (prompt of n tokens moves n - 1 tokens).
  static double received(const Engine& d) {
    return metric(d.port(), "tandem:kv_transfer_bytes_total", "direction=\"received\"");
  }
};

TEST_F(Disaggregation, BothDialectsGiveTheSameAnswersAsOneEngine) {
  Engine single = start("both");
  Engine p = start("prefill");
  Engine d = start("decode");
  ASSERT_NE(p.kv_port, 0);
  uint64_t room = 1000;
  int base = 100;
  // Lengths around the block size (16): one token (nothing to move), partial, exact, multiple.
  for (int n : {1, 2, 15, 16, 17, 33, 100}) {
    for (bool seq : {true, false}) {
      const json body = {{"prompt", tokens(n, base += 53)},
                         {"max_tokens", 12},
                         {"temperature", 0},
                         {"ignore_eos", true}};
      const json want = parse(post_json(single.port(), "/v1/completions", body));
      const json got = seq ? sequential(p, d, body) : parallel(p, d, body, ++room);
      EXPECT_EQ(text_of(got), text_of(want)) << (seq ? "sequential" : "parallel") << " n=" << n;
      if (!got.is_null()) {
        EXPECT_EQ(got["usage"]["prompt_tokens"], n);
      }
    }
  }
  // Text prompts and chat: the decode leg reuses the prefill's token ids (sequential) or
  // tokenizes the same body itself (parallel); streaming decode legs too.
  const json chat = {{"messages", {{{"role", "user"}, {"content", "Tell me about the sea."}}}},
                     {"max_tokens", 10},
                     {"temperature", 0}};
  const std::string want_chat =
      text_of(parse(post_json(single.port(), "/v1/chat/completions", chat)));
  EXPECT_EQ(text_of(sequential(p, d, chat, "/v1/chat/completions")), want_chat);
  EXPECT_EQ(text_of(parallel(p, d, chat, ++room, "/v1/chat/completions")), want_chat);
  // SGLang's own endpoint, as its router sends it: /generate with input_ids.
  const json gen = {{"input_ids", tokens(40, 12345)},
                    {"sampling_params", {{"max_new_tokens", 8}, {"temperature", 0}}}};
  const json want_gen = parse(post_json(single.port(), "/generate", gen));
  EXPECT_EQ(parallel(p, d, gen, ++room, "/generate")["output_ids"], want_gen["output_ids"]);
  // vLLM's allowed_token_ids and bad_words travel in the body each leg parses: both flows answer
  // as one engine, with allowed ids alone (the ids from the answer's logprobs).
  const std::set<int32_t> allowed = {1000, 1037, 1074};
  const json masked = {{"prompt", tokens(20, 777)},
                       {"max_tokens", 8},
                       {"temperature", 0},
                       {"ignore_eos", true},
                       {"allowed_token_ids", allowed},
                       {"bad_words", {"x", "the"}},
                       {"return_tokens_as_token_ids", true},
                       {"logprobs", 0}};
  const json want_masked = parse(post_json(single.port(), "/v1/completions", masked));
  for (bool seq : {true, false}) {
    const json got = seq ? sequential(p, d, masked) : parallel(p, d, masked, ++room);
    EXPECT_EQ(text_of(got), text_of(want_masked)) << (seq ? "sequential" : "parallel");
    if (got.is_null()) continue;
    const json& shown = got["choices"][0]["logprobs"]["tokens"];
    EXPECT_EQ(shown.size(), 8u);
    for (const auto& t : shown)
      EXPECT_TRUE(allowed.count(std::stoi(t.get<std::string>().substr(9)))) << t;
  }
  json streamed = {{"prompt", "The quick brown fox jumps over the lazy dog and"},
                   {"max_tokens", 8},
                   {"temperature", 0}};
  const std::string want_text =
      text_of(parse(post_json(single.port(), "/v1/completions", streamed)));
  streamed["stream"] = true;
  streamed["bootstrap_host"] = "127.0.0.1";
  streamed["bootstrap_port"] = std::to_string(p.kv_port);  // Omni Proxy sends a string
  streamed["bootstrap_room"] = std::to_string(++room);
  auto pre = std::async(std::launch::async,
                        [&] { return post_json(p.port(), "/v1/completions", streamed); });
  const auto sse = post_json(d.port(), "/v1/completions", streamed);
  EXPECT_EQ(pre.get().status, 200);
  ASSERT_EQ(sse.status, 200) << sse.body;
  std::string joined;
  std::istringstream in(sse.body);
  for (std::string line; std::getline(in, line);)
    if (line.rfind("data: {", 0) == 0)
      joined += json::parse(line.substr(6))["choices"][0]["text"].get<std::string>();
  EXPECT_EQ(joined, want_text);

  EXPECT_EQ(metric(d.port(), "tandem:kv_transfers_total", "result=\"error\""), 0);
  EXPECT_EQ(metric(p.port(), "tandem:kv_transfer_expired_total"), 0);
  // Engines on one host move KV through shared memory (the default transport).
  EXPECT_GT(metric(d.port(), "tandem:kv_transfer_connections_total", "transport=\"shm\""), 0);
  EXPECT_EQ(metric(d.port(), "tandem:kv_transfer_connections_total", "transport=\"tcp\""), 0);
  // Layers of the longer prompts went in place: copied once, from the prefill engine's cache.
  EXPECT_GT(metric(p.port(), "tandem:kv_transfer_in_place_bytes_total"), 0);
  expect_no_leak(p);
  expect_no_leak(d);
}

// A prefill leg computes one token, so a client's min_tokens past one is capped there (the decode
// leg generates the rest and holds EOS back as asked): each parallel leg gets the client's body,
// and the prefill engine refused every request with min_tokens >= 2 ("'min_tokens' must be at
// most 'max_tokens' (1)"), SGLang's min_new_tokens too.
TEST_F(Disaggregation, MinTokensPastOneAreServedByTheParallelFlowAsByOneEngine) {
  Engine single = start("both");
  Engine p = start("prefill");
  Engine d = start("decode");
  uint64_t room = 3000;
  const json completion = {
      {"prompt", tokens(20, 4242)}, {"max_tokens", 6}, {"min_tokens", 4}, {"temperature", 0}};
  EXPECT_EQ(text_of(parallel(p, d, completion, ++room)),
            text_of(parse(post_json(single.port(), "/v1/completions", completion))));
  const json chat = {{"messages", {{{"role", "user"}, {"content", "Tell me about the sea."}}}},
                     {"max_completion_tokens", 5},
                     {"min_tokens", 5},
                     {"temperature", 0}};
  EXPECT_EQ(text_of(parallel(p, d, chat, ++room, "/v1/chat/completions")),
            text_of(parse(post_json(single.port(), "/v1/chat/completions", chat))));
  const json gen = {
      {"input_ids", tokens(30, 999)},
      {"sampling_params", {{"max_new_tokens", 6}, {"min_new_tokens", 3}, {"temperature", 0}}}};
  EXPECT_EQ(parallel(p, d, gen, ++room, "/generate")["output_ids"],
            parse(post_json(single.port(), "/generate", gen))["output_ids"]);
  expect_no_leak(p);
  expect_no_leak(d);
}

// Prompt logprobs need the prompt's logits, which only an engine that runs the prompt has: a
// sequential prefill leg's answer carries them in kv_transfer_params, and the decode engine
// answers with them as one engine would (echo with logprobs, prompt_logprobs, a chat's). A decode
// leg handed none (a prefill leg sent without them, or the parallel flow, whose prefill engine
// hands over KV alone) computes its prompt again over the received KV; no block leaks.
TEST_F(Disaggregation, PromptLogprobsTravelWithTheKvOrAreComputedAgainByTheDecodeEngine) {
  Engine single = start("both");
  Engine p = start("prefill");
  Engine d = start("decode");
  uint64_t room = 5000;
  for (int n : {1, 2, 17, 40}) {
    SCOPED_TRACE("prompt of " + std::to_string(n));
    const json body = {{"prompt", tokens(n, 700 + n)}, {"max_tokens", 4}, {"temperature", 0},
                       {"ignore_eos", true},           {"echo", true},    {"logprobs", 1},
                       {"prompt_logprobs", 2}};
    const json want = parse(post_json(single.port(), "/v1/completions", body));
    ASSERT_EQ(want["choices"][0]["prompt_logprobs"].size(), size_t(n));
    json without = body;  // the prefill leg asks for no prompt logprobs: its answer has none
    without.erase("prompt_logprobs");
    without.erase("echo");
    for (const char* flow : {"sequential", "sequential, prefill without them", "parallel"}) {
      SCOPED_TRACE(flow);
      json got;
      if (flow == std::string("parallel")) {
        got = parallel(p, d, body, ++room);
      } else if (flow == std::string("sequential")) {
        got = sequential(p, d, body);
      } else {
        json pre = without;
        pre["kv_transfer_params"] = {{"do_remote_decode", true}, {"do_remote_prefill", false}};
        pre["max_tokens"] = 1;
        const json answer = parse(post_json(p.port(), "/v1/completions", pre));
        ASSERT_FALSE(answer.is_null());
        EXPECT_FALSE(answer["kv_transfer_params"].contains("prompt_logprobs"));
        json dec = body;
        dec["kv_transfer_params"] = answer["kv_transfer_params"];
        got = parse(post_json(d.port(), "/v1/completions", dec));
      }
      ASSERT_FALSE(got.is_null());
      EXPECT_EQ(got["choices"][0]["prompt_logprobs"], want["choices"][0]["prompt_logprobs"]);
      // The echoed prompt's part as one engine scores it; the generated tokens are the same,
      // their logprobs computed by other steps (equal to the last bit only with
      // --batch-invariant).
      const json& lp = got["choices"][0]["logprobs"];
      const json& want_lp = want["choices"][0]["logprobs"];
      EXPECT_EQ(lp["tokens"], want_lp["tokens"]);
      ASSERT_EQ(lp["tokens"].size(), size_t(n + 4));
      for (const char* key : {"token_logprobs", "top_logprobs", "text_offset"})
        for (int i = 0; i < n; ++i) EXPECT_EQ(lp[key][i], want_lp[key][i]) << key << " " << i;
    }
  }
  const json chat = {{"messages", {{{"role", "user"}, {"content", "Tell me about the sea."}}}},
                     {"max_tokens", 3},
                     {"temperature", 0},
                     {"prompt_logprobs", 1}};
  const json want_chat = parse(post_json(single.port(), "/v1/chat/completions", chat));
  ASSERT_TRUE(want_chat["prompt_logprobs"].is_array());
  EXPECT_EQ(sequential(p, d, chat, "/v1/chat/completions")["prompt_logprobs"],
            want_chat["prompt_logprobs"]);
  EXPECT_EQ(parallel(p, d, chat, ++room, "/v1/chat/completions")["prompt_logprobs"],
            want_chat["prompt_logprobs"]);
  expect_no_leak(p);
  expect_no_leak(d);
}

// A second family with another cache: Qwen3-MoE's grouped-query K/V moves between engines in
// both dialects and answers as one engine does; the layout in the transfer header keeps it from
// landing in a DeepSeek engine's latent cache.
TEST_F(Disaggregation, Qwen3MoeEnginesMoveTheirKvCacheAndAnswerAsOneEngine) {
  test::TempDir qwen3("pd-qwen3");
  ASSERT_EQ(test::run_command(std::string(TANDEM_BINARY) +
                              " make-model --preset tiny-qwen3-moe --dtype f32 --out " +
                              test::quote(qwen3.path()) + " >/dev/null 2>&1"),
            0);
  const std::string q = qwen3.path().string();
  Engine single = start("both", {}, q);
  Engine p = start("prefill", {}, q);
  Engine d = start("decode", {}, q);
  uint64_t room = 7000;
  int base = 900;
  for (int n : {1, 15, 16, 17, 60}) {
    for (bool seq : {true, false}) {
      const json body = {{"prompt", tokens(n, base += 37)},
                         {"max_tokens", 10},
                         {"temperature", 0},
                         {"ignore_eos", true}};
      const json want = parse(post_json(single.port(), "/v1/completions", body));
      const json got = seq ? sequential(p, d, body) : parallel(p, d, body, ++room);
      EXPECT_EQ(text_of(got), text_of(want)) << (seq ? "sequential" : "parallel") << " n=" << n;
    }
  }
  // The prefix cache of the grouped-query cache: a repeated prompt is served from it, same text.
  const json repeat = {{"prompt", tokens(70, 4321)}, {"max_tokens", 6}, {"temperature", 0}};
  const json first = parse(post_json(single.port(), "/v1/completions", repeat));
  const json again = parse(post_json(single.port(), "/v1/completions", repeat));
  EXPECT_EQ(text_of(again), text_of(first));
  EXPECT_GE(again["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 64)
      << again.dump();
  // Chat through Qwen3's own template, and a structured output on the decode leg.
  const json chat = {{"messages", {{{"role", "user"}, {"content", "Tell me about the sea."}}}},
                     {"max_tokens", 10},
                     {"temperature", 0},
                     {"guided_choice", {"calm", "rough", "grey"}}};
  const std::string want_chat =
      text_of(parse(post_json(single.port(), "/v1/chat/completions", chat)));
  EXPECT_TRUE(want_chat == "calm" || want_chat == "rough" || want_chat == "grey") << want_chat;
  EXPECT_EQ(text_of(sequential(p, d, chat, "/v1/chat/completions")), want_chat);
  EXPECT_EQ(text_of(parallel(p, d, chat, ++room, "/v1/chat/completions")), want_chat);
  EXPECT_EQ(metric(d.port(), "tandem:kv_transfers_total", "result=\"error\""), 0);
  EXPECT_GT(received(d), 0);
  expect_no_leak(p);
  expect_no_leak(d);

  // A DeepSeek decode engine refuses a Qwen3 prefill's KV, naming the layout.
  Engine deepseek = start("decode");
  json pre = {{"prompt", tokens(40, 77)}, {"max_tokens", 1}};
  pre["kv_transfer_params"] = {{"do_remote_decode", true}};
  json dec = {{"prompt", tokens(40, 77)}, {"max_tokens", 4}};
  dec["kv_transfer_params"] =
      parse(post_json(p.port(), "/v1/completions", pre))["kv_transfer_params"];
  const auto r = post_json(deepseek.port(), "/v1/completions", dec);
  EXPECT_EQ(r.status, 502) << r.body;
  EXPECT_NE(error_message(r).find("mismatch"), std::string::npos) << r.body;
  expect_no_leak(deepseek);
}

TEST_F(Disaggregation, ExpertParallelEnginesOnBothLegsGiveTheSameAnswers) {
  // KV leaves a prefill engine's shared-memory cache layer by layer while its ranks compute, and
  // lands in a decode engine's; both dialects.
  Engine single = start("both");
  Engine p = start("prefill", {"--expert-parallel", "2"});
  Engine d = start("decode", {"--expert-parallel", "2"});
  expect_both_flows_match(single, p, d, {1, 17, 40}, 700, 5000);
  EXPECT_EQ(metric(d.port(), "tandem:kv_transfers_total", "result=\"error\""), 0);
  expect_no_leak(p);
  expect_no_leak(d);
}

TEST_F(Disaggregation, SpeculatingEnginesMoveTheMtpLayerAndAnswerAsOneEngine) {
  // The decode engine's drafts need the MTP module's cache of the whole prompt: it travels as
  // one more layer. Greedy answers stay those of one plain engine, in both dialects.
  Engine single = start("both");
  Engine p = start("prefill", {"--speculative-tokens", "2"});
  Engine d = start("decode", {"--speculative-tokens", "2"});
  expect_both_flows_match(single, p, d, {1, 17, 40}, 1700, 7000);
  const auto& c = model_->config();
  const double token_bytes = double(c.kv_lora_rank + c.qk_rope_head_dim) * sizeof(float);
  const double before = received(d);
  sequential(p, d, {{"prompt", tokens(40, 3100)}, {"max_tokens", 3}, {"temperature", 0}});
  EXPECT_EQ(received(d) - before, 39 * double(c.num_hidden_layers + 1) * token_bytes);
  EXPECT_GT(metric(d.port(), "vllm:spec_decode_num_drafts_total"), 0);
  // A plain prefill engine's layout lacks the layer: refused, naming it.
  Engine plain = start("prefill");
  json pre = {{"prompt", tokens(20, 50)},
              {"max_tokens", 1},
              {"kv_transfer_params", {{"do_remote_decode", true}}}};
  json dec = {{"prompt", tokens(20, 50)}, {"max_tokens", 3}};
  dec["kv_transfer_params"] =
      parse(post_json(plain.port(), "/v1/completions", pre))["kv_transfer_params"];
  const auto r = post_json(d.port(), "/v1/completions", dec);
  EXPECT_EQ(r.status, 502);
  EXPECT_NE(r.body.find("MTP layer"), std::string::npos) << r.body;
  expect_no_leak(p);
  expect_no_leak(d);
}

TEST_F(Disaggregation, TcpTransportStillServesEnginesOnOneHost) {
  Engine single = start("both");
  Engine p = start("prefill", {"--kv-transport", "tcp"});
  Engine d = start("decode", {"--kv-transport", "tcp"});
  expect_both_flows_match(single, p, d, {40}, 4321, 9000);
  EXPECT_EQ(metric(d.port(), "tandem:kv_transfer_connections_total", "transport=\"tcp\""), 2);
  EXPECT_EQ(metric(p.port(), "tandem:kv_transfer_in_place_bytes_total"), 0);
  expect_no_leak(p);
  expect_no_leak(d);
}

TEST_F(Disaggregation, DecodeWithACachedPrefixPullsOnlyTheMissingBlocks) {
  Engine single = start("both");
  Engine p = start("prefill");
  Engine d = start("decode");
  auto ask = [&](const std::vector<int32_t>& prompt, bool seq, uint64_t room) {
    const json body = {
        {"prompt", prompt}, {"max_tokens", 6}, {"temperature", 0}, {"ignore_eos", true}};
    const json want = parse(post_json(single.port(), "/v1/completions", body));
    const double before = received(d);
    const json got = seq ? sequential(p, d, body) : parallel(p, d, body, room);
    EXPECT_EQ(text_of(got), text_of(want));
    return received(d) - before;
  };
  // Nothing cached: a 33-token prompt moves 32 tokens.
  const double per_token = ask(tokens(33, 7000), true, 0) / 32;
  ASSERT_GT(per_token, 0);
  // Cache 4 blocks (64 tokens) of a prefix on the decode engine with a plain request.
  const std::vector<int32_t> prefix = tokens(64, 9000);
  json warm = {{"prompt", prefix}, {"max_tokens", 1}, {"temperature", 0}};
  parse(post_json(d.port(), "/v1/completions", warm));
  auto with_tail = [&](int tail, int base) {
    auto t = prefix;
    for (int32_t x : tokens(tail, base)) t.push_back(x);
    return t;
  };
  // 64 cached + 30 new tokens: the decode engine needs tokens [64, 93): 29 tokens.
  EXPECT_EQ(ask(with_tail(30, 3000), true, 0), 29 * per_token);
  EXPECT_EQ(ask(with_tail(20, 4000), false, 77), 19 * per_token);
  EXPECT_GT(metric(d.port(), "vllm:prefix_cache_hits_total"), 0);
  expect_no_leak(p);
  expect_no_leak(d);
}

TEST_F(Disaggregation, SimulatedDeepSeekV3MovesItsCacheBytes) {
  // sim:deepseek-v3-h800 caches 61 layers x 576 BF16 values = 70,272 bytes per token.
  const std::vector<std::string> sim = {"--sim-time-scale", "0", "--num-kv-blocks", "2048"};
  Engine single = start("both", sim, "sim:deepseek-v3-h800");
  Engine p = start("prefill", sim, "sim:deepseek-v3-h800");
  Engine d = start("decode", sim, "sim:deepseek-v3-h800");
  for (bool seq : {true, false}) {
    const int n = seq ? 1000 : 517;
    const json body = {{"prompt", tokens(n, seq ? 20000 : 30000)}, {"max_tokens", 5}};
    const json want = parse(post_json(single.port(), "/v1/completions", body));
    const double before = received(d);
    const double sent_before =
        metric(p.port(), "tandem:kv_transfer_bytes_total", "direction=\"sent\"");
    const json got = seq ? sequential(p, d, body) : parallel(p, d, body, 5);
    EXPECT_EQ(text_of(got), text_of(want));
    EXPECT_EQ(received(d) - before, double(n - 1) * 61 * 1152);
    EXPECT_TRUE(eventually([&] {
      return metric(p.port(), "tandem:kv_transfer_bytes_total", "direction=\"sent\"") -
                 sent_before ==
             double(n - 1) * 61 * 1152;
    }));
  }
  expect_no_leak(p);
  expect_no_leak(d);
}

TEST_F(Disaggregation, ManyRequestsInFlightInBothDialects) {
  Engine single = start("both");
  Engine p = start("prefill");
  Engine d = start("decode");
  const int n = 16;
  std::vector<json> bodies;
  std::vector<std::string> want;
  for (int i = 0; i < n; ++i) {
    bodies.push_back({{"prompt", tokens(3 + (i * 37) % 120, 40000 + 311 * i)},
                      {"max_tokens", 4 + i % 5},
                      {"temperature", 0},
                      {"ignore_eos", true}});
    want.push_back(text_of(parse(post_json(single.port(), "/v1/completions", bodies[i]))));
  }
  std::vector<std::future<json>> got;
  for (int i = 0; i < n; ++i)
    got.push_back(std::async(std::launch::async, [&, i] {
      return i % 2 ? sequential(p, d, bodies[i]) : parallel(p, d, bodies[i], 500 + i);
    }));
  for (int i = 0; i < n; ++i) EXPECT_EQ(text_of(got[i].get()), want[i]) << "request " << i;
  expect_no_leak(p);
  expect_no_leak(d);
}

// ------------------------------------------------------------------------------ failures

TEST_F(Disaggregation, UnpulledKvIsFreedAfterTheTimeoutAndCannotBePulledLater) {
  Engine p = start("prefill", {"--kv-transfer-timeout", "1"});
  Engine d = start("decode");
  json pre = {{"prompt", tokens(40, 100)},
              {"max_tokens", 1},
              {"kv_transfer_params", {{"do_remote_decode", true}}}};
  const json answer = parse(post_json(p.port(), "/v1/completions", pre));
  ASSERT_TRUE(answer.contains("kv_transfer_params"));
  EXPECT_EQ(answer["kv_transfer_params"]["remote_block_ids"].size(), 3u);  // 40 tokens, 16 each
  EXPECT_TRUE(
      eventually([&] { return metric(p.port(), "tandem:kv_transfer_expired_total") == 1; }));
  expect_no_leak(p);
  json dec = {{"prompt", tokens(40, 100)},
              {"max_tokens", 4},
              {"kv_transfer_params", answer["kv_transfer_params"]}};
  const auto r = post_json(d.port(), "/v1/completions", dec);
  EXPECT_EQ(r.status, 502);
  EXPECT_NE(error_message(r).find("unknown transfer"), std::string::npos) << r.body;
  expect_no_leak(d);
}

TEST_F(Disaggregation, WrongTransferParamsFailTheDecodeLegAndLeakNothing) {
  Engine single = start("both");
  Engine p = start("prefill");
  Engine d = start("decode");
  const json body = {
      {"prompt", tokens(50, 300)}, {"max_tokens", 5}, {"temperature", 0}, {"ignore_eos", true}};
  json pre = body;
  pre["max_tokens"] = 1;
  pre["kv_transfer_params"] = {{"do_remote_decode", true}};
  auto hold = [&] {
    return parse(post_json(p.port(), "/v1/completions", pre))["kv_transfer_params"];
  };
  const json params = hold();
  auto decode_with = [&](const json& kv) {
    json dec = body;
    dec["kv_transfer_params"] = kv;
    return post_json(d.port(), "/v1/completions", dec);
  };
  struct Case {
    const char* field;
    json value;
    const char* error;
    bool prefill_fault;  // an engine not there; the others answered a refusal (no engine's fault)
  };
  const std::vector<Case> cases = {
      {"remote_request_id", "no-such-transfer", "unknown transfer", false},
      {"remote_block_ids", {7, 8, 9, 10}, "remote_block_ids do not match", false},
      {"remote_engine_id", "someone-else", "is not this prefill engine", false},
      {"remote_port", 1, "cannot connect", true},
      // Another prompt than the one held: refused, or its KV would enter the decode engine's
      // prefix cache under the wrong tokens.
      {"prompt_token_ids", tokens(50, 301), "is not the prompt of transfer", false},
  };
  for (const auto& c : cases) {
    // A pull refused for its blocks has the decode engine release them, and that release of
    // nothing is not refused for its blocks (a7bddee): the hold goes, so that case has its own.
    json kv = std::string(c.field) == "remote_block_ids" ? hold() : params;
    kv[c.field] = c.value;
    const auto r = decode_with(kv);
    EXPECT_EQ(r.status, 502) << c.field;
    EXPECT_NE(error_message(r).find(c.error), std::string::npos) << c.field << ": " << r.body;
    // A prefill engine that is not there is its failure, which the decode engine only reports
    // (a gateway must not count it against the decode engine); a refusal it answered is no
    // engine's failure, and the code does not blame it.
    EXPECT_EQ(api::openai_error_code(r.body) == api::kKvTransferFailedCode, c.prefill_fault)
        << c.field << ": " << r.body;
    // A transfer the prefill engine does not hold, or another engine's (as after a restart at
    // its address, with a new id), is KV gone: a gateway prefills it again.
    EXPECT_EQ(
        api::openai_error_code(r.body) == api::kKvTransferExpiredCode,
        std::string(c.field) == "remote_request_id" || std::string(c.field) == "remote_engine_id")
        << c.field << ": " << r.body;
  }
  // Malformed parameters are the client's fault: 400 naming the field.
  json bad = params;
  bad.erase("remote_host");
  const auto r = decode_with(bad);
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("remote_host"), std::string::npos) << r.body;
  // Role checks: a prefill leg to a decode engine and the reverse are refused.
  EXPECT_EQ(post_json(d.port(), "/v1/completions", pre).status, 400);
  // The refused attempt with another prompt let the hold go from its decode engine: its gateway
  // prefills the prompt again, and nothing pulls the hold any more. (The refusals of another
  // transfer or engine left it.) The right parameters then find it gone.
  EXPECT_TRUE(eventually([&] { return metric(p.port(), "tandem:kv_transfer_held_blocks") == 0; }));
  const auto gone = decode_with(params);
  EXPECT_EQ(gone.status, 502) << gone.body;
  EXPECT_EQ(api::openai_error_code(gone.body), api::kKvTransferExpiredCode) << gone.body;
  const auto again = post_json(p.port(), "/v1/completions",
                               json{{"prompt", tokens(5, 1)}, {"kv_transfer_params", params}});
  EXPECT_EQ(again.status, 400) << again.body;
  expect_no_leak(p);
  expect_no_leak(d);
}

TEST_F(Disaggregation, MismatchedBlockSizeIsRefusedOnBothLegs) {
  // The timeout ends the sequential leg's hold, so it is what this test waits; it must also leave
  // the decode legs time to reach the prefill engine (the pull, the parallel leg's registration)
  // however slowly a loaded machine sends them.
  Engine p = start("prefill", {"--kv-transfer-timeout", "5"});
  Engine d = start("decode", {"--block-size", "32"});
  const json body = {{"prompt", tokens(40, 500)}, {"max_tokens", 4}};
  // Sequential: the decode leg learns it from the pull; the prefill's hold expires.
  json pre = body;
  pre["max_tokens"] = 1;
  pre["kv_transfer_params"] = {{"do_remote_decode", true}};
  json dec = body;
  dec["kv_transfer_params"] =
      parse(post_json(p.port(), "/v1/completions", pre))["kv_transfer_params"];
  auto r = post_json(d.port(), "/v1/completions", dec);
  EXPECT_EQ(r.status, 502);
  EXPECT_NE(error_message(r).find("block_size mismatch"), std::string::npos) << r.body;
  // Parallel: both legs fail at once.
  json par = body;
  par["bootstrap_host"] = "127.0.0.1";
  par["bootstrap_port"] = p.kv_port;
  par["bootstrap_room"] = 42;
  auto prefill =
      std::async(std::launch::async, [&] { return post_json(p.port(), "/v1/completions", par); });
  r = post_json(d.port(), "/v1/completions", par);
  EXPECT_EQ(r.status, 502);
  EXPECT_NE(error_message(r).find("block_size mismatch"), std::string::npos) << r.body;
  const auto pr = prefill.get();
  EXPECT_EQ(pr.status, 502);
  EXPECT_NE(error_message(pr).find("block_size mismatch"), std::string::npos) << pr.body;
  expect_no_leak(p);
  expect_no_leak(d);
}

TEST_F(Disaggregation, ARoomMissingOneLegFailsTheOtherWithinTheTimeout) {
  Engine p = start("prefill", {"--kv-transfer-timeout", "1"});
  // The decode engine waits far longer than the prefill engine (its I/O timeout): each leg's
  // error then comes from the engine that saw the other leg missing, however late a loaded
  // machine delivers the prefill engine's word.
  Engine d = start("decode", {"--kv-transfer-timeout", "15"});
  json body = {{"prompt", tokens(30, 800)},
               {"max_tokens", 4},
               {"bootstrap_host", "127.0.0.1"},
               {"bootstrap_port", p.kv_port},
               {"bootstrap_room", 7}};
  // Only the prefill leg: nobody registers the room.
  auto r = post_json(p.port(), "/v1/completions", body);
  EXPECT_EQ(r.status, 502);
  EXPECT_NE(error_message(r).find("no decode engine registered"), std::string::npos) << r.body;
  // Only the decode leg: no prefill request for the room arrives.
  body["bootstrap_room"] = 8;
  r = post_json(d.port(), "/v1/completions", body);
  EXPECT_EQ(r.status, 502);
  EXPECT_NE(error_message(r).find("no prefill request with bootstrap_room"), std::string::npos)
      << r.body;
  // The prefill engine answered (the missing leg is nobody's failure of the two): no code
  // blames it.
  EXPECT_NE(api::openai_error_code(r.body), api::kKvTransferFailedCode) << r.body;
  expect_no_leak(p);
  expect_no_leak(d);
}

TEST_F(Disaggregation, DuplicateRoomsAreRefused) {
  Engine single = start("both");
  Engine p = start("prefill");
  Engine d = start("decode");
  json body = {{"prompt", tokens(30, 900)},
               {"max_tokens", 4},
               {"temperature", 0},
               {"ignore_eos", true},
               {"bootstrap_host", "127.0.0.1"},
               {"bootstrap_port", p.kv_port},
               {"bootstrap_room", 99}};
  json plain = body;
  plain.erase("bootstrap_host");
  plain.erase("bootstrap_port");
  plain.erase("bootstrap_room");
  const std::string want = text_of(parse(post_json(single.port(), "/v1/completions", plain)));
  // Two prefill legs for one room: the second is refused up front while the first waits for
  // its decode engine.
  auto prefill =
      std::async(std::launch::async, [&] { return post_json(p.port(), "/v1/completions", body); });
  ASSERT_TRUE(eventually([&] { return metric(p.port(), "vllm:prompt_tokens_total") > 0; }));
  const auto dup = post_json(p.port(), "/v1/completions", body);
  EXPECT_EQ(dup.status, 400);
  EXPECT_NE(error_message(dup).find("already in use"), std::string::npos) << dup.body;
  EXPECT_EQ(text_of(parse(post_json(d.port(), "/v1/completions", body))), want);
  EXPECT_EQ(prefill.get().status, 200);
  // Two decode legs for one room: whichever registers second is refused.
  body["bootstrap_room"] = 100;
  auto a =
      std::async(std::launch::async, [&] { return post_json(d.port(), "/v1/completions", body); });
  auto b =
      std::async(std::launch::async, [&] { return post_json(d.port(), "/v1/completions", body); });
  ASSERT_TRUE(eventually(
      [&] { return metric(d.port(), "tandem:kv_transfers_total", "result=\"error\"") == 1; }));
  EXPECT_EQ(post_json(p.port(), "/v1/completions", body).status, 200);
  auto ra = a.get(), rb = b.get();
  if (ra.status != 200) std::swap(ra, rb);
  EXPECT_EQ(ra.status, 200) << ra.body;
  EXPECT_EQ(text_of(json::parse(ra.body)), want);
  EXPECT_EQ(rb.status, 502);
  EXPECT_NE(error_message(rb).find("duplicate"), std::string::npos) << rb.body;
  expect_no_leak(p);
  expect_no_leak(d);
}

TEST_F(Disaggregation, PrefillDyingMidTransferFailsTheDecodeLegPromptly) {
  // A simulated prefill slowed 20x: its one 2000-token step takes seconds, and layers reach the
  // decode engine one by one while it runs. Kill it once some have arrived.
  Engine p = start("prefill", {"--sim-time-scale", "20", "--num-kv-blocks", "1024"},
                   "sim:deepseek-v3-h800");
  Engine d =
      start("decode", {"--sim-time-scale", "0", "--num-kv-blocks", "1024"}, "sim:deepseek-v3-h800");
  json body = {{"prompt", tokens(2000, 100)},
               {"max_tokens", 4},
               {"bootstrap_host", "127.0.0.1"},
               {"bootstrap_port", p.kv_port},
               {"bootstrap_room", 3}};
  auto prefill =
      std::async(std::launch::async, [&] { return post_json(p.port(), "/v1/completions", body); });
  auto decode =
      std::async(std::launch::async, [&] { return post_json(d.port(), "/v1/completions", body); });
  ASSERT_TRUE(eventually([&] { return received(d) > 0; }));
  p.process->kill_now();
  const auto r = decode.get();
  EXPECT_EQ(r.status, 502);
  EXPECT_NE(error_message(r).find("KV transfer from the prefill engine"), std::string::npos)
      << r.body;
  EXPECT_LT(received(d), 1999.0 * 61 * 1152);
  try {
    prefill.get();  // the leg to the dead engine fails; only the decode side matters here
  } catch (const std::exception&) {
  }
  expect_no_leak(d);
}

TEST_F(Disaggregation, ADecodeCacheFullOfReceivedKvStillServesEveryRequest) {
  // 10 blocks of 16 tokens; each 65-token prompt plus 8 new tokens needs 5. Received KV holds
  // its blocks while it waits to be scheduled: requests must still all finish, one after another.
  Engine single = start("both");
  Engine p = start("prefill");
  Engine d = start("decode", {"--num-kv-blocks", "10"});
  std::vector<json> bodies;
  for (int i = 0; i < 4; ++i)
    bodies.push_back({{"prompt", tokens(65, 20000 + 1000 * i)},
                      {"max_tokens", 8},
                      {"temperature", 0},
                      {"ignore_eos", true}});
  std::vector<std::future<json>> got;
  for (int i = 0; i < 4; ++i)
    got.push_back(std::async(std::launch::async, [&, i] {
      return i % 2 ? sequential(p, d, bodies[i]) : parallel(p, d, bodies[i], 900 + i);
    }));
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(text_of(got[i].get()),
              text_of(parse(post_json(single.port(), "/v1/completions", bodies[i]))))
        << "request " << i;
  expect_no_leak(p);
  expect_no_leak(d);
}

TEST_F(Disaggregation, EnginesStopCleanlyWithTransfersInFlight) {
  // No drain: the legs in flight here never finish, and a stop is to end them at once.
  Engine p = start("prefill", {"--shutdown-timeout", "0"});
  Engine d = start("decode", {"--shutdown-timeout", "0"});
  json body = {{"prompt", tokens(30, 700)},
               {"max_tokens", 4},
               {"bootstrap_host", "127.0.0.1"},
               {"bootstrap_port", p.kv_port},
               {"bootstrap_room", 11}};
  // A decode leg waiting in its room, and a prefill leg of another room waiting for its decode.
  json other = body;
  other["bootstrap_room"] = 12;
  auto decode =
      std::async(std::launch::async, [&] { return post_json(d.port(), "/v1/completions", body); });
  auto prefill =
      std::async(std::launch::async, [&] { return post_json(p.port(), "/v1/completions", other); });
  ASSERT_TRUE(
      eventually([&] { return metric(d.port(), "tandem:num_requests_waiting_for_kv") == 1; }));
  ASSERT_TRUE(eventually([&] { return metric(p.port(), "vllm:prompt_tokens_total") > 0; }));
  EXPECT_EQ(d.process->stop(), 0);  // SIGTERM: a clean exit, not a crash
  EXPECT_EQ(p.process->stop(), 0);
  for (auto* leg : {&decode, &prefill}) {
    try {
      const auto r = leg->get();
      EXPECT_NE(r.status, 200) << r.body;  // aborted, or the connection closed
    } catch (const std::exception&) {
    }
  }
}

TEST_F(Disaggregation, ARefusedDecodeLegReleasesThePrefillBlocksAtOnce) {
  // vLLM's stranded-blocks bug (vllm#41269): a decode leg refused before it pulls must not leave
  // the prefill engine holding the KV until its timeout (120 s here).
  Engine p = start("prefill");
  Engine d = start("decode");
  json pre = {{"prompt", tokens(40, 100)},
              {"max_tokens", 1},
              {"kv_transfer_params", {{"do_remote_decode", true}}}};
  const json params = parse(post_json(p.port(), "/v1/completions", pre))["kv_transfer_params"];
  ASSERT_TRUE(eventually([&] { return metric(p.port(), "tandem:kv_transfer_held_blocks") == 3; }));
  json dec = {{"prompt", tokens(40, 100)}, {"max_tokens", -1}, {"kv_transfer_params", params}};
  EXPECT_EQ(post_json(d.port(), "/v1/completions", dec).status, 400);
  expect_no_leak(p);
  EXPECT_EQ(metric(p.port(), "tandem:kv_transfer_expired_total"), 0);
}

TEST_F(Disaggregation, ADecodeLegThatEndsBeforeItsPullReleasesThePrefillBlocksAtOnce) {
  // The decode engine has no room for the prompt while another request holds its cache, and
  // gives up after its 1 s transfer timeout: the prefill engine must not hold the KV for its own
  // 600 s. Simulated engines, the decode one slowed so that the other request stays (~25 s: far
  // past the 1 s timeout however late a loaded machine sends this test's requests; stopping the
  // engine ends it).
  Engine p = start("prefill", {"--kv-transfer-timeout", "600"}, "sim:tiny");
  Engine d = start(
      "decode", {"--num-kv-blocks", "8", "--kv-transfer-timeout", "1", "--sim-time-scale", "200"},
      "sim:tiny");
  json pre = {{"prompt", tokens(100, 100)},
              {"max_tokens", 1},
              {"kv_transfer_params", {{"do_remote_decode", true}}}};
  const json params = parse(post_json(p.port(), "/v1/completions", pre))["kv_transfer_params"];
  ASSERT_TRUE(eventually([&] { return metric(p.port(), "tandem:kv_transfer_held_blocks") == 7; }));
  auto other = std::async(std::launch::async, [&] {
    return post_json(d.port(), "/v1/completions",
                     {{"prompt", tokens(60, 300)}, {"max_tokens", 60}, {"ignore_eos", true}});
  });
  ASSERT_TRUE(eventually([&] { return metric(d.port(), "vllm:num_requests_running") == 1; }));
  json dec = {{"prompt", tokens(100, 100)}, {"max_tokens", 4}, {"kv_transfer_params", params}};
  const auto r = post_json(d.port(), "/v1/completions", dec);
  EXPECT_EQ(r.status, 503) << r.body;
  EXPECT_TRUE(eventually([&] { return metric(p.port(), "tandem:kv_transfer_held_blocks") == 0; }));
  EXPECT_EQ(metric(p.port(), "tandem:kv_transfer_expired_total"), 0);
  EXPECT_EQ(d.process->stop(), 0);
  try {
    other.get();
  } catch (const std::exception&) {
  }
}

TEST_F(Disaggregation, ADecodeLegThatEndsBeforeItRegistersItsRoomFailsThePrefillLegAtOnce) {
  // The same in parallel mode: the decode leg gives up without registering the room, and the
  // prefill leg, computed and waiting for a decode engine, must not hold the KV (and its answer)
  // for its 600 s: it fails now, naming why.
  Engine p = start("prefill", {"--kv-transfer-timeout", "600"}, "sim:tiny");
  Engine d = start(
      "decode", {"--num-kv-blocks", "8", "--kv-transfer-timeout", "1", "--sim-time-scale", "200"},
      "sim:tiny");
  const json body = {{"prompt", tokens(100, 100)},
                     {"max_tokens", 4},
                     {"bootstrap_host", "127.0.0.1"},
                     {"bootstrap_port", p.kv_port},
                     {"bootstrap_room", 21}};
  auto prefill =
      std::async(std::launch::async, [&] { return post_json(p.port(), "/v1/completions", body); });
  ASSERT_TRUE(eventually([&] { return metric(p.port(), "tandem:kv_transfer_held_blocks") == 7; }));
  auto other = std::async(std::launch::async, [&] {
    return post_json(d.port(), "/v1/completions",
                     {{"prompt", tokens(60, 300)}, {"max_tokens", 60}, {"ignore_eos", true}});
  });
  ASSERT_TRUE(eventually([&] { return metric(d.port(), "vllm:num_requests_running") == 1; }));
  const auto r = post_json(d.port(), "/v1/completions", body);
  EXPECT_EQ(r.status, 503) << r.body;
  EXPECT_TRUE(eventually([&] { return metric(p.port(), "tandem:kv_transfer_held_blocks") == 0; }));
  // The blocks are freed before the answer is written: stopping the engine at once could cut an
  // answer on its way (a loaded machine did). The stop ends the wait if the room was not
  // abandoned.
  prefill.wait_for(std::chrono::seconds(30));
  EXPECT_EQ(p.process->stop(), 0);
  try {
    const auto pr = prefill.get();
    EXPECT_EQ(pr.status, 502);
    EXPECT_NE(error_message(pr).find(
                  "the decode request of bootstrap_room 21 ended before it registered: no free "
                  "KV blocks"),
              std::string::npos)
        << pr.body;
    // Its code tells a gateway that the prefill engine is not at fault.
    EXPECT_EQ(api::openai_error_code(pr.body), std::optional<std::string>("room_abandoned"))
        << pr.body;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "the prefill leg got no answer: " << e.what();
  }
  EXPECT_EQ(d.process->stop(), 0);
  try {
    other.get();
  } catch (const std::exception&) {
  }
}

TEST_F(Disaggregation, ARoomDecodeLegRefusedByTheApiAbandonsItsRoomAtOnce) {
  // A decode leg the API refuses (here its parser: max_tokens past the context, which the
  // prefill leg did not ask for) never reaches the engine, so nothing there abandoned its room:
  // the prefill leg held its KV and its answer for the whole 600 s timeout, then failed without
  // the code that tells a gateway that the prefill engine was not at fault.
  Engine p = start("prefill", {"--kv-transfer-timeout", "600"}, "sim:tiny");
  Engine d = start("decode", {}, "sim:tiny");
  json body = {{"prompt", tokens(100, 100)},
               {"max_tokens", 4},
               {"bootstrap_host", "127.0.0.1"},
               {"bootstrap_port", p.kv_port},
               {"bootstrap_room", 23}};
  auto prefill =
      std::async(std::launch::async, [&] { return post_json(p.port(), "/v1/completions", body); });
  ASSERT_TRUE(eventually([&] { return metric(p.port(), "tandem:kv_transfer_held_blocks") == 7; }));
  body["max_tokens"] = 100000000;
  EXPECT_EQ(post_json(d.port(), "/v1/completions", body).status, 400);
  EXPECT_TRUE(eventually([&] { return metric(p.port(), "tandem:kv_transfer_held_blocks") == 0; }));
  EXPECT_EQ(p.process->stop(), 0);  // ends the prefill leg's wait if the room was not abandoned
  try {
    const auto pr = prefill.get();
    EXPECT_EQ(pr.status, 502);
    EXPECT_NE(error_message(pr).find("the decode request of bootstrap_room 23 was refused: "),
              std::string::npos)
        << pr.body;
    EXPECT_EQ(api::openai_error_code(pr.body), std::optional<std::string>("room_abandoned"))
        << pr.body;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "the prefill leg got no answer: " << e.what();
  }
  EXPECT_EQ(d.process->stop(), 0);
}

TEST_F(Disaggregation, APrefillLegWhoseDecodeLegAbandonsTheRoomMidPrefillCountsAsAnAbort) {
  // The decode leg gives up (here the API refuses it; a client that leaves does the same) while
  // the prefill leg still computes its prompt: the prefill leg ends at once with the error that
  // tells a gateway it is not at fault, and counts as vLLM counts a request given up, "abort"
  // (as the decode engine counts its own). It counted as "error", so every client that left
  // during a parallel prefill raised the engine's error rate.
  // A prompt of 2000 tokens, 16 a step: its prefill runs for many steps.
  Engine p = start(
      "prefill",
      {"--kv-transfer-timeout", "600", "--sim-time-scale", "500", "--max-num-batched-tokens", "16"},
      "sim:tiny");
  Engine d = start("decode", {}, "sim:tiny");
  json body = {{"prompt", tokens(2000, 100)},
               {"max_tokens", 4},
               {"bootstrap_host", "127.0.0.1"},
               {"bootstrap_port", p.kv_port},
               {"bootstrap_room", 25}};
  auto prefill =
      std::async(std::launch::async, [&] { return post_json(p.port(), "/v1/completions", body); });
  ASSERT_TRUE(eventually([&] { return metric(p.port(), "vllm:num_requests_running") == 1; }));
  body["max_tokens"] = 100000000;
  EXPECT_EQ(post_json(d.port(), "/v1/completions", body).status, 400);
  const auto pr = prefill.get();
  EXPECT_EQ(pr.status, 502) << pr.body;
  EXPECT_EQ(api::openai_error_code(pr.body), std::optional<std::string>("room_abandoned"))
      << pr.body;
  // Still running when abandoned: had it finished first, it would count as "length".
  EXPECT_EQ(metric(p.port(), "vllm:request_success_total", "finished_reason=\"length\""), 0);
  EXPECT_EQ(metric(p.port(), "vllm:request_success_total", "finished_reason=\"abort\""), 1);
  EXPECT_EQ(metric(p.port(), "vllm:request_success_total", "finished_reason=\"error\""), 0);
  EXPECT_TRUE(eventually([&] { return metric(p.port(), "vllm:kv_cache_usage_perc") == 0; }));
  EXPECT_EQ(p.process->stop(), 0);
  EXPECT_EQ(d.process->stop(), 0);
}

TEST_F(Disaggregation, AParkedRoomPrefillLegWhoseClientLeavesLetsItsKvGoAtOnce) {
  // The prefill leg is computed and waits for its room's decode engine, which never comes; its
  // client (a gateway cancelling the request) closes the connection. The engine had ended the
  // sequence, so the abort found nothing to end, and the KV stayed held for the 600 s timeout.
  Engine p = start("prefill", {"--kv-transfer-timeout", "600"}, "sim:tiny");
  const std::string text = json{
      {"prompt", tokens(100, 100)},
      {"max_tokens", 4},
      {"bootstrap_host", "127.0.0.1"},
      {"bootstrap_port", p.kv_port},
      {"bootstrap_room", 24}}.dump();
  const std::string request =
      "POST /v1/completions HTTP/1.1\r\nHost: prefill\r\nContent-Type: application/json\r\n"
      "Content-Length: " +
      std::to_string(text.size()) + "\r\n\r\n" + text;
  const int fd = tandem::testing::connect_loopback(p.port());
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::send(fd, request.data(), request.size(), MSG_NOSIGNAL), ssize_t(request.size()));
  const bool parked =
      eventually([&] { return metric(p.port(), "tandem:kv_transfer_held_blocks") == 7; });
  ::close(fd);  // the client leaves
  ASSERT_TRUE(parked);
  expect_no_leak(p);
  EXPECT_EQ(p.process->stop(), 0);
}

// An engine in process (simulated executor) whose KV transfers are a test::FakeKvTransfers.
std::unique_ptr<tandem::engine::Engine> engine_with_fake_transfers(
    EngineRole role, const text::Tokenizer& tok, metrics::Registry& registry,
    std::shared_ptr<test::FakeKvTransfers::Log> log, test::FakeKvTransfers** fake) {
  EngineConfig config;
  config.role = role;
  config.transfer = KvTransferConfig{};
  config.make_transfers = [log, fake](Executor&, KvTransfers::Post post) {
    auto t = std::make_unique<test::FakeKvTransfers>(std::move(post), log, /*serving=*/true);
    *fake = t.get();
    return t;
  };
  return test::sim_engine(config, tok, registry);
}

// A decode leg of 40 prompt tokens from `base` waiting for its KV from "prefill-0" (for a pull:
// transfer t0 of blocks 0..2; for a room: room 9).
EngineRequest decode_leg(const std::string& id, int base, KvTransferSpec::Mode mode) {
  EngineRequest r;
  r.id = id;
  r.prompt = tokens(40, base);
  r.sampling.max_tokens = 4;
  KvTransferSpec& kt = r.kv_transfer;
  kt.mode = mode;
  kt.host = "127.0.0.1";
  kt.port = 1;
  kt.engine_id = "prefill-0";
  kt.transfer_id = "t0";
  kt.remote_blocks = {0, 1, 2};
  kt.room = 9;
  return r;
}

// Stopping a decode engine whose legs still wait for their prompt's KV (a pull in flight, a
// room it has not joined): the legs end "abort" and nothing reaches the transfers once they have
// ended. Ending such a leg used to ask the destroyed transfers to release the prefill engine's
// blocks (a use after free at every shutdown with a fetch in flight; the simulator crashed at
// the end of every P/D run that left one).
TEST_F(Disaggregation, StoppingADecodeEngineWithLegsWaitingForKvTouchesNoEndedTransfers) {
  auto log = std::make_shared<test::FakeKvTransfers::Log>();
  metrics::Registry registry;
  test::FakeKvTransfers* fake = nullptr;
  auto engine = engine_with_fake_transfers(EngineRole::kDecode, *tok_, registry, log, &fake);
  std::vector<RequestOutput> outs(2);
  for (int i = 0; i < 2; ++i) {
    EngineRequest r = decode_leg(
        "leg" + std::to_string(i), 100 + 50 * i,
        i == 0 ? KvTransferSpec::Mode::kDecodeByPull : KvTransferSpec::Mode::kDecodeByRoom);
    r.on_output = [&outs, i](const RequestOutput& o) {
      if (o.finished) outs[size_t(i)] = o;
    };
    engine->submit(std::move(r));
  }
  for (int i = 0; i < 10 && engine->has_work(); ++i) engine->run_once();
  ASSERT_EQ(std::count(log->begin(), log->end(), "fetch"), 2) << "both legs wait for KV";
  engine->stop();
  for (const auto& o : outs) {
    EXPECT_TRUE(o.finished);
    EXPECT_EQ(o.finish_reason, "abort");
  }
  const auto ended = std::find(log->begin(), log->end(), "ended");
  ASSERT_NE(ended, log->end());
  EXPECT_EQ(std::vector<std::string>(ended + 1, log->end()), std::vector<std::string>{});
}

// A decode leg in `mode` whose client leaves while its fetch is still connecting: nothing tells
// the prefill engine while the cancelled fetch runs, and `told` does, once, when it ends. Returns
// the engine's KV usage then (the engine is stopped after).
double cancel_while_fetching(const text::Tokenizer& tok, KvTransferSpec::Mode mode,
                             const std::string& told) {
  auto log = std::make_shared<test::FakeKvTransfers::Log>();
  metrics::Registry registry;
  test::FakeKvTransfers* fake = nullptr;
  auto engine = engine_with_fake_transfers(EngineRole::kDecode, tok, registry, log, &fake);
  engine->submit(decode_leg("leg", 100, mode));
  for (int i = 0; i < 10 && fake->fetches.empty(); ++i) engine->run_once();
  EXPECT_EQ(fake->fetches.size(), 1u);
  if (fake->fetches.empty()) return -1;
  engine->abort("leg");
  for (int i = 0; i < 10 && std::count(log->begin(), log->end(), "cancel_fetch") == 0; ++i)
    engine->run_once();
  EXPECT_EQ(std::count(log->begin(), log->end(), "cancel_fetch"), 1);
  EXPECT_EQ(std::count(log->begin(), log->end(), told), 0) << "the fetch still runs";
  fake->post([done = fake->fetches[0]] { done({false, "cancelled", 0}); });
  for (int i = 0; i < 10 && engine->has_work(); ++i) engine->run_once();
  EXPECT_EQ(std::count(log->begin(), log->end(), told), 1);
  const double kv_usage = engine->load().kv_usage;
  engine->stop();
  return kv_usage;
}

// A pull: the prefill engine never got it, so only this engine can let go of its hold, once the
// cancelled fetch ends (its request was already gone; the blocks stayed held until their
// expiry).
TEST_F(Disaggregation, ACancelledPullReleasesThePrefillBlocksWhenItEnds) {
  cancel_while_fetching(*tok_, KvTransferSpec::Mode::kDecodeByPull, "release_remote");
}

// A room: the registration never reached the prefill engine, so the room's prefill leg waited
// for it until its timeout. The leg abandons the room once the cancelled fetch ends, as one that
// never fetched does.
TEST_F(Disaggregation, ACancelledRoomFetchAbandonsTheRoomWhenItEnds) {
  EXPECT_EQ(cancel_while_fetching(*tok_, KvTransferSpec::Mode::kDecodeByRoom, "abandon_room"), 0);
}

// A prefill engine in process with fake transfers: what the engine does with a request id whose
// blocks stay parked after its request finished.
class ParkedIds : public Disaggregation {
 protected:
  ParkedIds()
      : engine_(engine_with_fake_transfers(EngineRole::kPrefill, *tok_, registry_, log_, &fake_)) {}

  // Submits a prefill leg; its final output lands in `out` (finished stays false until then).
  void submit(const std::string& id, int base, KvTransferSpec::Mode mode, RequestOutput& out) {
    EngineRequest r;
    r.id = id;
    r.prompt = tokens(40, base);
    r.sampling.max_tokens = 1;
    r.kv_transfer.mode = mode;
    r.kv_transfer.room = 7;
    r.on_output = [&out](const RequestOutput& o) {
      if (o.finished) out = o;
    };
    engine_->submit(std::move(r));
  }
  // Runs the engine (virtual time, this thread) until nothing is left to do.
  void run() {
    for (int i = 0; i < 1000 && engine_->has_work(); ++i) engine_->run_once();
  }
  std::string refusal(const std::string& id) {
    try {
      submit(id, 900, KvTransferSpec::Mode::kNone, accepted_);
    } catch (const Error& e) {
      return e.what();
    }
    return "(accepted)";
  }

  metrics::Registry registry_;
  RequestOutput accepted_;  // of the request refusal() submitted when it was accepted
  std::shared_ptr<test::FakeKvTransfers::Log> log_ = std::make_shared<test::FakeKvTransfers::Log>();
  test::FakeKvTransfers* fake_ = nullptr;
  std::unique_ptr<tandem::engine::Engine> engine_;  // after registry_, log_ and fake_: built
                                                    // from them
};

// The cache keeps parked blocks under the request id and the transfer frees them by it: a new
// request with the id of a parked one got the parked blocks in its block table, and lost its
// own blocks when the transfer let go. The id stays taken until then, in both dialects.
TEST_F(ParkedIds, AnIdIsTakenUntilItsParkedBlocksAreFreed) {
  RequestOutput pulled;
  submit("r", 100, KvTransferSpec::Mode::kPrefillForPull, pulled);
  run();
  ASSERT_TRUE(pulled.finished) << "the prefill leg did not finish";
  EXPECT_EQ(pulled.kv_blocks.size(), 3u);  // 40 tokens, 16 a block
  ASSERT_EQ(fake_->hold_releases.size(), 1u);
  EXPECT_NE(refusal("r").find("request id 'r' is already in use"), std::string::npos);
  fake_->post(std::move(fake_->hold_releases[0]));  // pulled
  run();
  EXPECT_EQ(engine_->load().kv_usage, 0);
  RequestOutput again;
  submit("r", 200, KvTransferSpec::Mode::kNone, again);
  run();
  EXPECT_EQ(again.finish_reason, "length") << again.error;

  // A room's prefill: its answer waits for the room's transfer, and so does its id.
  RequestOutput roomed;
  submit("q", 300, KvTransferSpec::Mode::kPrefillForRoom, roomed);
  run();
  EXPECT_FALSE(roomed.finished);
  ASSERT_EQ(fake_->rooms.size(), 1u);
  EXPECT_NE(refusal("q").find("request id 'q' is already in use"), std::string::npos);
  fake_->post([done = fake_->rooms[0]] { done(true, "", false); });
  run();
  EXPECT_EQ(roomed.finish_reason, "length") << roomed.error;
  EXPECT_EQ(refusal("q"), "(accepted)");
  run();
  EXPECT_EQ(accepted_.finish_reason, "length") << accepted_.error;
  EXPECT_EQ(engine_->load().kv_usage, 0);
}

// An abort of a room's prefill leg whose answer waits for the room's transfer (its client left,
// a gateway cancelled it): the engine had ended the sequence, so the abort found nothing to end
// and the blocks stayed until a decode engine came or the room's timeout passed. It gives the
// room up now; the answer is "abort" once the room ended, and the blocks and the id are free.
TEST_F(ParkedIds, AnAbortedRoomPrefillGivesItsRoomUpAtOnce) {
  RequestOutput roomed;
  submit("q", 300, KvTransferSpec::Mode::kPrefillForRoom, roomed);
  run();
  ASSERT_FALSE(roomed.finished);
  ASSERT_EQ(fake_->rooms.size(), 1u);
  EXPECT_EQ(std::count(log_->begin(), log_->end(), "room_failed"), 0);
  engine_->abort("q");
  run();
  EXPECT_EQ(std::count(log_->begin(), log_->end(), "room_failed"), 1);
  engine_->abort("q");  // told once
  run();
  EXPECT_EQ(std::count(log_->begin(), log_->end(), "room_failed"), 1);
  EXPECT_FALSE(roomed.finished) << "answered when the room ends";
  // As KvTransferAgent::room_failed ends a room no decode engine registered: at once.
  fake_->post(
      [done = fake_->rooms[0]] { done(false, "the prefill request was cancelled", false); });
  run();
  EXPECT_TRUE(roomed.finished);
  EXPECT_EQ(roomed.finish_reason, "abort");
  EXPECT_EQ(roomed.error, "");
  EXPECT_EQ(engine_->load().kv_usage, 0);
  EXPECT_EQ(refusal("q"), "(accepted)");
  run();
}

// Batch-invariant numerics (--batch-invariant) in BF16, where plain kernels differ between a
// token computed alone and inside a larger step: prompts of 1-100 tokens give the same greedy
// text alone, again from the prefix cache, chunked among concurrent requests, with speculation,
// and through both P/D flows, every logprob to the last bit.
class BatchInvariance : public PdTest<kBf16> {};

TEST_F(BatchInvariance, EveryPathGivesTheSameGreedyText) {
  Engine single = start("both", {"--batch-invariant"});
  Engine chunked = start("both", {"--batch-invariant", "--max-num-batched-tokens", "8"});
  Engine spec = start("both", {"--batch-invariant", "--speculative-tokens", "2"});
  Engine p = start("prefill", {"--batch-invariant"});
  Engine d = start("decode", {"--batch-invariant"});
  const std::vector<int> lengths = {1, 2, 3, 5, 8, 13, 16, 21, 34, 55, 89, 100};
  auto body_of = [](int n) {
    return json{{"prompt", tokens(n, 300 + 17 * n)},
                {"max_tokens", 8},
                {"temperature", 0},
                {"ignore_eos", true},
                {"logprobs", 0}};
  };
  // The text and every token's logprob, to the last bit.
  auto answer = [](const json& a) {
    return a.is_null() ? "<error>"
                       : text_of(a) + a["choices"][0]["logprobs"]["token_logprobs"].dump();
  };
  std::map<int, std::string> want;
  for (int n : lengths)
    want[n] = answer(parse(post_json(single.port(), "/v1/completions", body_of(n))));
  // All at once into the chunked engine: prefill chunks and decodes share its steps.
  std::map<int, std::future<json>> mixed;
  for (int n : lengths)
    mixed[n] = std::async(std::launch::async, [&, n] {
      return parse(post_json(chunked.port(), "/v1/completions", body_of(n)));
    });
  uint64_t room = 900;
  for (int n : lengths) {
    const json body = body_of(n);
    EXPECT_EQ(answer(parse(post_json(single.port(), "/v1/completions", body))), want[n])
        << "prefix-cache hit, n=" << n;
    EXPECT_EQ(answer(mixed[n].get()), want[n]) << "chunked, n=" << n;
    EXPECT_EQ(answer(parse(post_json(spec.port(), "/v1/completions", body))), want[n])
        << "speculative, n=" << n;
    EXPECT_EQ(answer(sequential(p, d, body)), want[n]) << "sequential P/D, n=" << n;
    EXPECT_EQ(answer(parallel(p, d, body, ++room)), want[n]) << "parallel P/D, n=" << n;
  }
  EXPECT_GT(metric(single.port(), "vllm:prefix_cache_hits_total"), 0);
  // The example: the P/D pair and the single engine agree on it too.
  const json fox = {{"prompt", "The quick brown fox jumps over the lazy dog. The quick brown fox"},
                    {"max_tokens", 8},
                    {"temperature", 0},
                    {"logprobs", 1}};
  const json alone = parse(post_json(single.port(), "/v1/completions", fox));
  const json pd = sequential(p, d, fox);
  EXPECT_EQ(text_of(pd), text_of(alone));
  EXPECT_EQ(pd["choices"][0]["logprobs"]["token_logprobs"],
            alone["choices"][0]["logprobs"]["token_logprobs"]);
}

}  // namespace
}  // namespace tandem::engine
