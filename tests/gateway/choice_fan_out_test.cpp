// Several choices in the P/D modes: one request per choice (split_choices), their answers merged
// into the one the client asked for (ChoiceMerger), whole or streamed, and every failure ending
// the client's answer once and letting go of the other choices' requests.
#include "gateway/choice_fan_out.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "api/error.h"
#include "net/sse.h"

namespace tandem::gateway {
namespace {

using nlohmann::json;

// The split of `body` as a client that sent body.dump() has it.
ChoiceRequests split_of(std::string_view path, const json& body) {
  return split_choices(path, body, body.dump());
}

std::vector<json> parsed(const ChoiceRequests& split) {
  std::vector<json> out;
  for (const auto& b : split.bodies) out.push_back(json::parse(b));
  return out;
}

TEST(SplitChoices, NChoicesBecomeOneRequestEachWithTheEnginesSeeds) {
  const json body = {{"model", "m"}, {"prompt", "hi"}, {"n", 3}, {"best_of", 3}, {"seed", 5}};
  const ChoiceRequests split = split_of("/v1/completions", body);
  const auto bodies = parsed(split);
  ASSERT_EQ(bodies.size(), 3u);
  EXPECT_EQ(split.repeats, 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(bodies[i]["prompt"], "hi");
    EXPECT_EQ(bodies[i]["seed"], 5 + i) << "choice " << i;  // an engine seeds choice i so
    EXPECT_FALSE(bodies[i].contains("n"));
    EXPECT_FALSE(bodies[i].contains("best_of"));
    EXPECT_EQ(bodies[i]["model"], "m");
  }
  // A negative seed wraps as the engine reads it (an unsigned 64-bit number).
  const auto negative = parsed(
      split_of("/v1/chat/completions", {{"messages", json::array()}, {"n", 2}, {"seed", -1}}));
  ASSERT_EQ(negative.size(), 2u);
  EXPECT_EQ(negative[0]["seed"], -1);
  EXPECT_EQ(negative[1]["seed"].get<uint64_t>(), 0u);
}

TEST(SplitChoices, AListOfPromptsBecomesOneRequestPerPrompt) {
  const json body = {{"prompt", {"a", "b c"}}, {"max_tokens", 4}};
  const ChoiceRequests split = split_of("/v1/completions", body);
  const auto bodies = parsed(split);
  ASSERT_EQ(bodies.size(), 2u);
  EXPECT_EQ(split.repeats, 1u);
  EXPECT_EQ(bodies[0]["prompt"], "a");
  EXPECT_EQ(bodies[1]["prompt"], "b c");
  EXPECT_EQ(bodies[1]["max_tokens"], 4);
  EXPECT_FALSE(bodies[1].contains("seed"));
  const auto ids = parsed(split_of("/v1/completions", {{"prompt", {{1, 2}, {3}}}}));
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_EQ(ids[1]["prompt"], json::array({3}));
}

// n choices of each prompt of a list, as OpenAI, vLLM and one engine order them: prompt-major
// (choice k answers prompt k / n), choice k seeded seed + k % n as the engine and vLLM seed it
// (each prompt with the request's seed, counted up over its own n choices only), so a seeded
// prompt answers the same alone or in a list.
TEST(SplitChoices, NChoicesOfEachPromptOfAListArePromptMajor) {
  const json body = {{"prompt", {"a", "b c", "d"}}, {"n", 2}, {"seed", 9}, {"max_tokens", 4}};
  const ChoiceRequests split = split_of("/v1/completions", body);
  const auto bodies = parsed(split);
  ASSERT_EQ(bodies.size(), 6u);
  EXPECT_EQ(split.repeats, 2u);  // bodies 2p and 2p + 1 share prompt p
  const std::vector<std::string> prompts = {"a", "a", "b c", "b c", "d", "d"};
  for (size_t k = 0; k < 6; ++k) {
    SCOPED_TRACE(k);
    EXPECT_EQ(bodies[k]["prompt"], prompts[k]);
    EXPECT_EQ(bodies[k]["seed"], 9 + k % 2);
    EXPECT_EQ(bodies[k]["max_tokens"], 4);
    EXPECT_FALSE(bodies[k].contains("n"));
  }
  // n times the prompts is what is bounded.
  try {
    split_of("/v1/completions", {{"prompt", json(43, "p")}, {"n", 3}});
    FAIL() << "expected an error";
  } catch (const api::ApiError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, "n");
    EXPECT_NE(e.message.find("got 129"), std::string::npos) << e.message;
  }
  EXPECT_EQ(split_of("/v1/completions", {{"prompt", json(64, "p")}, {"n", 2}}).bodies.size(),
            kMaxFanOut);
}

TEST(SplitChoices, OneChoiceOrWhatTheEngineMustRefuseIsNotSplit) {
  for (const json& body : {json{{"prompt", "x"}}, json{{"prompt", "x"}, {"n", 1}},
                           json{{"prompt", {1, 2, 3}}},          // one prompt of ids
                           json{{"prompt", {"only"}}},           // a list of one
                           json{{"prompt", "x"}, {"n", 0}},      // the engine names 'n'
                           json{{"prompt", "x"}, {"n", 200}},    // too many: the engine says so
                           json{{"prompt", "x"}, {"n", "two"}},  // not a number
                           json{{"prompt", "x"}, {"n", 2}, {"best_of", 3}}})
    EXPECT_TRUE(split_of("/v1/completions", body).bodies.empty()) << body.dump();
  // best_of is no chat parameter, even equal to n: the engine refuses it (dropped, it was
  // answered through P/D and refused by an engine).
  const json chat = {{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"n", 2}};
  json best_of = chat;
  best_of["best_of"] = 2;
  EXPECT_TRUE(split_of("/v1/chat/completions", best_of).bodies.empty());
  best_of["best_of"] = nullptr;  // as absent, for an engine too
  EXPECT_EQ(split_of("/v1/chat/completions", best_of).bodies.size(), 2u);
  // Chat has no list of prompts; other routes are not split.
  EXPECT_TRUE(split_of("/v1/chat/completions", {{"prompt", {"a", "b"}}}).bodies.empty());
  EXPECT_TRUE(split_of("/v1/embeddings", {{"input", "x"}, {"n", 2}}).bodies.empty());
}

// An integer field given as a whole float (what the openai npm client sends for a computed
// number) counts as the engine reads it (api::whole_number): "n": 2.0 is two choices, "n": 1.0 and
// "best_of": 1.0 with a list of prompts one per prompt, and a seed of 42.0 seeds choice i 42 + i.
TEST(SplitChoices, WholeFloatsAreTheirIntegersAsTheEngineReadsThem) {
  const auto two = parsed(split_of("/v1/completions", {{"prompt", "x"}, {"n", 2.0}}));
  EXPECT_EQ(two.size(), 2u);
  const auto seeded =
      parsed(split_of("/v1/completions", {{"prompt", "x"}, {"n", 2}, {"seed", 42.0}}));
  ASSERT_EQ(seeded.size(), 2u);
  EXPECT_EQ(seeded[0]["seed"].get<double>(), 42.0);
  EXPECT_EQ(seeded[1]["seed"].get<double>(), 43.0);
  // A choice's seed stays within int64, which the engine takes: the same 64 bits counted up.
  for (const int64_t first : {int64_t{-3}, INT64_MAX}) {
    const auto edge =
        parsed(split_of("/v1/completions", {{"prompt", "x"}, {"n", 2}, {"seed", first}}));
    ASSERT_EQ(edge.size(), 2u);
    EXPECT_TRUE(edge[1]["seed"].is_number_integer() && !edge[1]["seed"].is_number_unsigned())
        << edge[1]["seed"];
    EXPECT_EQ(static_cast<uint64_t>(edge[1]["seed"].get<int64_t>()),
              static_cast<uint64_t>(first) + 1);
  }
  const auto prompts =
      parsed(split_of("/v1/completions", {{"prompt", {"a", "b"}}, {"n", 1.0}, {"best_of", 1.0}}));
  ASSERT_EQ(prompts.size(), 2u);
  EXPECT_EQ(prompts[0]["prompt"], "a");
  EXPECT_EQ(prompts[1]["prompt"], "b");
  // Not whole, or past int64: not split, and the engine refuses it naming the field.
  for (const json& n : {json(2.5), json(1e30), json(9223372036854775808ull)})
    EXPECT_TRUE(split_of("/v1/completions", {{"prompt", "x"}, {"n", n}}).bodies.empty())
        << n.dump();
}

// An engine reads objects in their key order (it shows tools to the model, and generates a
// schema's properties, in it): each choice's body keeps the client's, where a body dumped from
// nlohmann::json had its keys sorted.
TEST(SplitChoices, EachChoiceKeepsTheClientsKeyOrder) {
  const std::string text =
      R"({"prompt":["a","b"],"n":2,"seed":7,"response_format":{"type":"json_schema",)"
      R"("json_schema":{"name":"s","schema":{"type":"object","properties":{"zeta":{},"alpha":{}}}}}})";
  const ChoiceRequests split = split_choices("/v1/completions", json::parse(text), text);
  ASSERT_EQ(split.bodies.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    const std::string& b = split.bodies[i];
    EXPECT_LT(b.find("\"zeta\""), b.find("\"alpha\"")) << b;
    const json one = json::parse(b);
    EXPECT_EQ(one["prompt"], i < 2 ? "a" : "b");
    EXPECT_EQ(one["seed"], 7 + i % 2);  // each prompt from the request's seed
    EXPECT_EQ(one["response_format"], json::parse(text)["response_format"]);
  }
}

TEST(SplitChoices, MoreThanTheLimitIsTheClientsError) {
  json prompts = json::array();
  for (size_t i = 0; i <= kMaxFanOut; ++i) prompts.push_back("p");
  try {
    split_of("/v1/completions", {{"prompt", prompts}});
    FAIL() << "expected an error";
  } catch (const api::ApiError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, "prompt");
  }
}

// Each choice carries the client's whole body: 128 of a large one are refused before any copy.
TEST(SplitChoices, ChoicesWhoseBodiesTogetherPassTheByteLimitAreTheClientsError) {
  const json body = {{"prompt", "p"}, {"user", std::string(1 << 20, 'x')}};
  EXPECT_EQ(split_of("/v1/completions", {{"prompt", "p"}, {"n", 64}, {"user", "x"}}).bodies.size(),
            64u);
  json n64 = body;
  n64["n"] = 64;  // 64 MiB and a little more
  try {
    split_of("/v1/completions", n64);
    FAIL() << "expected an error";
  } catch (const api::ApiError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, "n");
    EXPECT_NE(e.message.find("more than 64 MiB in all"), std::string::npos) << e.message;
  }
  json n32 = body;
  n32["n"] = 32;
  EXPECT_EQ(split_of("/v1/completions", n32).bodies.size(), 32u);
}

TEST(SplitChoices, TheCheapLookNeverMissesARequestWithSeveralChoices) {
  EXPECT_TRUE(may_ask_several_choices(R"({"prompt": "x", "n": 2})"));
  EXPECT_TRUE(may_ask_several_choices(R"({"prompt" : [ "a", "b"]})"));
  EXPECT_TRUE(may_ask_several_choices(R"({"prompt":[[1,2],[3]]})"));
  EXPECT_FALSE(may_ask_several_choices(R"({"prompt": [1, 2, 3], "max_tokens": 5})"));
  EXPECT_FALSE(may_ask_several_choices(R"({"messages": [{"role": "user", "content": "x"}]})"));
}

// The client's side, as the server's exchange behaves: an answer that ended drops its close
// callback.
class Client final : public net::Reply {
 public:
  bool respond(int s, std::string b, std::string) override {
    if (complete) return false;
    status = s;
    body = std::move(b);
    complete = true;
    close = nullptr;
    return true;
  }
  bool send_error(int s, std::string_view message, std::string_view, std::string_view) override {
    return respond(s, api::openai_error_body(message), "application/json");
  }
  bool respond_with_headers(net::HttpResponse r) override {
    retry_after = r.headers.get("Retry-After");
    return respond(r.status, std::move(r.body), std::move(r.content_type));
  }
  bool start_stream(int s, std::string) override {
    status = s;
    return true;
  }
  bool write(std::string_view chunk) override {
    streamed += chunk;
    return !complete;
  }
  bool end() override {
    complete = true;
    close = nullptr;
    return true;
  }
  void abort() override { aborted = true; }
  void on_close(std::function<void()> callback) override { close = std::move(callback); }
  void leave() {
    if (auto c = std::move(close)) c();
  }

  int status = 0;
  std::string body, streamed;
  std::string retry_after;  // of an answer with header fields
  bool complete = false, aborted = false;
  std::function<void()> close;
};

std::string answer(const std::string& id, const std::string& text, int prompt, int completion) {
  return json{{"id", id},
              {"object", "text_completion"},
              {"choices", {{{"index", 0}, {"text", text}, {"finish_reason", "length"}}}},
              {"usage",
               {{"prompt_tokens", prompt},
                {"completion_tokens", completion},
                {"total_tokens", prompt + completion},
                {"prompt_tokens_details", {{"cached_tokens", prompt / 2}}},
                {"completion_tokens_details", {{"reasoning_tokens", completion - 1}}}}}}
      .dump();
}

std::string chunk(const std::string& id, const std::string& text) {
  return net::sse_event(
      json{{"id", id}, {"object", "text_completion"}, {"choices", {{{"index", 0}, {"text", text}}}}}
          .dump());
}

std::string usage_chunk(const std::string& id, int prompt, int completion) {
  return net::sse_event(json{{"id", id},
                             {"choices", json::array()},
                             {"usage",
                              {{"prompt_tokens", prompt},
                               {"completion_tokens", completion},
                               {"total_tokens", prompt + completion}}}}
                            .dump());
}

// The data of a client's stream, event by event.
std::vector<std::string> events(const std::string& streamed) {
  net::SseParser parser;
  return parser.feed(streamed);
}

TEST(ChoiceMerger, WholeAnswersMergeInChoiceOrderWithTheRepeatedPromptCountedOnce) {
  auto client = std::make_shared<Client>();
  auto merger = ChoiceMerger::create(client, 2, /*repeats=*/2);
  auto first = merger->reply(0), second = merger->reply(1);
  EXPECT_TRUE(second->respond(200, answer("cmpl-r-1", "world", 10, 3), "application/json"));
  EXPECT_FALSE(client->complete);
  EXPECT_TRUE(first->respond(200, answer("cmpl-r-0", "hello", 10, 4), "application/json"));
  ASSERT_TRUE(client->complete);
  EXPECT_EQ(client->status, 200);
  const json merged = json::parse(client->body);
  ASSERT_EQ(merged["choices"].size(), 2u);
  EXPECT_EQ(merged["choices"][0]["index"], 0);
  EXPECT_EQ(merged["choices"][0]["text"], "hello");
  EXPECT_EQ(merged["choices"][1]["index"], 1);
  EXPECT_EQ(merged["choices"][1]["text"], "world");
  EXPECT_EQ(merged["id"], "cmpl-r");
  EXPECT_EQ(merged["usage"]["prompt_tokens"], 10);
  EXPECT_EQ(merged["usage"]["completion_tokens"], 7);
  EXPECT_EQ(merged["usage"]["total_tokens"], 17);
  EXPECT_EQ(merged["usage"]["prompt_tokens_details"]["cached_tokens"], 5);
  // Details the engines report are summed too; only the prompt's are counted once.
  EXPECT_EQ(merged["usage"]["completion_tokens_details"]["reasoning_tokens"], 5);
  EXPECT_TRUE(merger->ended());
}

TEST(ChoiceMerger, StreamsInterleaveWithIndexesOneIdOneUsageChunkAndOneDone) {
  auto client = std::make_shared<Client>();
  auto merger = ChoiceMerger::create(client, 2, /*repeats=*/1);
  auto a = merger->reply(0), b = merger->reply(1);
  ASSERT_TRUE(b->start_stream(200, "text/event-stream"));
  ASSERT_TRUE(a->start_stream(200, "text/event-stream"));
  // Bytes arrive in any split, events of the two choices interleaved.
  const std::string b1 = chunk("cmpl-x-1", "B1");
  ASSERT_TRUE(b->write(b1.substr(0, 7)));
  ASSERT_TRUE(a->write(chunk("cmpl-x-0", "A1")));
  ASSERT_TRUE(b->write(b1.substr(7) + chunk("cmpl-x-1", "B2") + usage_chunk("cmpl-x-1", 3, 2)));
  ASSERT_TRUE(b->write(std::string(net::kSseDone)));
  ASSERT_TRUE(b->end());
  EXPECT_FALSE(client->complete);
  ASSERT_TRUE(a->write(usage_chunk("cmpl-x-0", 4, 1) + std::string(net::kSseDone)));
  ASSERT_TRUE(a->end());
  ASSERT_TRUE(client->complete);
  const auto got = events(client->streamed);
  ASSERT_EQ(got.size(), 5u) << client->streamed;
  std::vector<std::pair<int, std::string>> texts;
  for (size_t k = 0; k < 3; ++k) {
    const json e = json::parse(got[k]);
    EXPECT_EQ(e["id"], "cmpl-x") << got[k];
    texts.emplace_back(e["choices"][0]["index"].get<int>(), e["choices"][0]["text"]);
  }
  // B1 was not whole before A1 came.
  EXPECT_EQ(texts, (std::vector<std::pair<int, std::string>>{{0, "A1"}, {1, "B1"}, {1, "B2"}}));
  const json usage = json::parse(got[3]);
  EXPECT_EQ(usage["id"], "cmpl-x");
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["prompt_tokens"], 7);
  EXPECT_EQ(usage["usage"]["completion_tokens"], 3);
  EXPECT_EQ(usage["usage"]["total_tokens"], 10);
  EXPECT_FALSE(usage["usage"].contains("prompt_tokens_details"));  // none reported, none made up
  EXPECT_TRUE(net::SseParser::is_done(got[4]));
}

// Two prompts (10 and 6 tokens), n = 2: four choices, each reporting its own prompt's tokens;
// the client's usage counts each prompt once (vLLM: the sum of the prompts' lengths), whole or
// streamed, and the streamed chunks carry their choice's index k.
TEST(ChoiceMerger, NChoicesOfSeveralPromptsCountEachPromptOnce) {
  const int prompt_of[4] = {10, 10, 6, 6};
  // Appended, not "t" + ...: GCC 12 warns (-Wrestrict) about that.
  auto named = [](const char* prefix, size_t k) {
    std::string s = prefix;
    s += std::to_string(k);
    return s;
  };
  {
    auto client = std::make_shared<Client>();
    auto merger = ChoiceMerger::create(client, 4, /*repeats=*/2);
    for (const size_t k : {2u, 0u, 3u, 1u})
      ASSERT_TRUE(merger->reply(k)->respond(
          200, answer(named("cmpl-r-", k), named("t", k), prompt_of[k], 2), "application/json"));
    ASSERT_TRUE(client->complete);
    const json merged = json::parse(client->body);
    ASSERT_EQ(merged["choices"].size(), 4u);
    for (size_t k = 0; k < 4; ++k) {
      EXPECT_EQ(merged["choices"][k]["index"], k);
      EXPECT_EQ(merged["choices"][k]["text"], named("t", k));
    }
    EXPECT_EQ(merged["usage"]["prompt_tokens"], 16);
    EXPECT_EQ(merged["usage"]["completion_tokens"], 8);
    EXPECT_EQ(merged["usage"]["total_tokens"], 24);
    EXPECT_EQ(merged["usage"]["prompt_tokens_details"]["cached_tokens"], 8);  // 5 and 3
  }
  auto client = std::make_shared<Client>();
  auto merger = ChoiceMerger::create(client, 4, /*repeats=*/2);
  for (const size_t k : {3u, 1u, 0u, 2u}) {
    auto part = merger->reply(k);
    const std::string id = named("cmpl-s-", k);
    ASSERT_TRUE(part->start_stream(200, "text/event-stream"));
    ASSERT_TRUE(part->write(chunk(id, named("t", k)) + usage_chunk(id, prompt_of[k], 3) +
                            std::string(net::kSseDone)));
    ASSERT_TRUE(part->end());
  }
  ASSERT_TRUE(client->complete);
  const auto got = events(client->streamed);
  ASSERT_EQ(got.size(), 6u) << client->streamed;
  for (size_t e = 0; e < 4; ++e) {
    const json event = json::parse(got[e]);
    EXPECT_EQ(event["id"], "cmpl-s");
    const std::string text = event["choices"][0]["text"];
    EXPECT_EQ(event["choices"][0]["index"], std::stoi(text.substr(1))) << got[e];
  }
  const json usage = json::parse(got[4]);
  EXPECT_EQ(usage["usage"]["prompt_tokens"], 16);
  EXPECT_EQ(usage["usage"]["completion_tokens"], 12);
  EXPECT_EQ(usage["usage"]["total_tokens"], 28);
  EXPECT_TRUE(net::SseParser::is_done(got[5]));
}

TEST(ChoiceMerger, AChoiceRefusedBeforeAnyAnswerIsTheAnswerAndTheOthersAreLetGo) {
  auto client = std::make_shared<Client>();
  auto merger = ChoiceMerger::create(client, 3, 1);
  auto a = merger->reply(0), b = merger->reply(1), c = merger->reply(2);
  int a_closed = 0, b_closed = 0;
  a->on_close([&] { ++a_closed; });
  b->on_close([&] { ++b_closed; });
  ASSERT_TRUE(b->respond(400, api::openai_error_body("bad field"), "application/json"));
  EXPECT_EQ(client->status, 400);
  EXPECT_EQ(api::openai_error_message(client->body), "bad field");
  EXPECT_EQ(a_closed, 1);  // let go
  EXPECT_EQ(b_closed, 0);  // its own request ended with the error
  EXPECT_TRUE(merger->ended());
  // The let-go choices' requests end with the failure that let them go, not as a client leaving.
  const auto failure = merger->failure();
  ASSERT_TRUE(failure.has_value());
  EXPECT_EQ(failure->status, 400);
  EXPECT_EQ(failure->choice, 1u);
  // What the others send now goes nowhere; a choice not started yet is told at once.
  EXPECT_FALSE(a->respond(200, answer("cmpl-r-0", "late", 1, 1), "application/json"));
  int c_closed = 0;
  c->on_close([&] { ++c_closed; });
  EXPECT_EQ(c_closed, 1);
  client->leave();  // already complete: nothing runs twice
  EXPECT_EQ(a_closed, 1);
}

// A choice refused with header fields (an engine's 429 or 503 with Retry-After, relayed) answers
// the client with them: the part dropped them, and the client of n > 1 lost the engine's
// Retry-After.
TEST(ChoiceMerger, AChoiceRefusedWithRetryAfterGivesItToTheClient) {
  auto client = std::make_shared<Client>();
  auto merger = ChoiceMerger::create(client, 2, 2);
  auto a = merger->reply(0), b = merger->reply(1);
  net::HttpResponse refusal;
  refusal.status = 429;
  refusal.body = api::openai_error_body("the engine's queue is full", "server_error");
  refusal.headers.set("Retry-After", "3");
  ASSERT_TRUE(b->respond_with_headers(refusal));
  EXPECT_EQ(client->status, 429);
  EXPECT_EQ(client->body, refusal.body);
  EXPECT_EQ(client->retry_after, "3");
  EXPECT_FALSE(a->respond_with_headers(refusal));  // the answer is given
}

// The merged stream ends as a failing engine ends its own (vLLM's, ours): the error event, then
// [DONE]. It had no [DONE], and one choice's stream did for the same failure.
TEST(ChoiceMerger, AChoiceThatFailsMidStreamEndsTheStreamWithItsErrorThenDone) {
  auto client = std::make_shared<Client>();
  auto merger = ChoiceMerger::create(client, 2, 1);
  auto a = merger->reply(0), b = merger->reply(1);
  int a_closed = 0;
  a->on_close([&] { ++a_closed; });
  ASSERT_TRUE(a->start_stream(200, "text/event-stream"));
  ASSERT_TRUE(b->start_stream(200, "text/event-stream"));
  ASSERT_TRUE(a->write(chunk("cmpl-y-0", "A1")));
  // The engine's own end of a failed stream (and the gateway's tail for a cut one): an error
  // event, then [DONE], which the client gets once. Nothing after the failed choice's error is
  // taken, its [DONE] neither (its relay records it as its error says).
  ASSERT_TRUE(b->write(net::sse_event(api::openai_error_body("engine died", "server_error"))));
  EXPECT_FALSE(b->write(net::kSseDone));
  EXPECT_FALSE(b->end());
  EXPECT_TRUE(client->complete);
  EXPECT_EQ(a_closed, 1);
  ASSERT_TRUE(merger->failure().has_value());
  EXPECT_EQ(merger->failure()->status, 502);  // after the stream's 200: the gateway's 502
  EXPECT_EQ(merger->failure()->choice, 1u);
  const auto got = events(client->streamed);
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(api::openai_error_message(got[1]), "engine died");
  EXPECT_EQ(got[2], "[DONE]");
  EXPECT_FALSE(a->write(chunk("cmpl-y-0", "A2")));
  // A stream that ends without [DONE] and without an error event is cut too.
  auto client2 = std::make_shared<Client>();
  auto merger2 = ChoiceMerger::create(client2, 2, 1);
  auto c = merger2->reply(0);
  ASSERT_TRUE(c->start_stream(200, "text/event-stream"));
  ASSERT_TRUE(c->write(chunk("cmpl-z-0", "C1")));
  ASSERT_TRUE(c->end());
  EXPECT_TRUE(client2->complete);
  const auto cut = events(client2->streamed);
  ASSERT_EQ(cut.size(), 3u);
  EXPECT_TRUE(api::openai_error_message(cut[1]).has_value());
  EXPECT_EQ(cut[2], "[DONE]");
}

// A choice whose stream failed (its error event) takes nothing more: an engine that goes on
// sending after its error is cut (its relay ends the call), and the client's stream, which ended
// with that error, gets none of it. The failed choice took and dropped every byte its engine sent.
TEST(ChoiceMerger, AChoiceThatFailedMidStreamTakesNothingMore) {
  auto client = std::make_shared<Client>();
  auto merger = ChoiceMerger::create(client, 2, 1);
  auto a = merger->reply(0), b = merger->reply(1);
  ASSERT_TRUE(a->start_stream(200, "text/event-stream"));
  ASSERT_TRUE(b->start_stream(200, "text/event-stream"));
  ASSERT_TRUE(b->write(chunk("cmpl-y-1", "B1")));
  // The error and what follows it in the same piece: the piece is taken, the rest dropped.
  ASSERT_TRUE(b->write(net::sse_event(api::openai_error_body("engine died", "server_error")) +
                       chunk("cmpl-y-1", "B2")));
  ASSERT_TRUE(client->complete);
  const std::string ended = client->streamed;
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(b->write(chunk("cmpl-y-1", "B3"))) << i;
  EXPECT_FALSE(b->write(net::kSseDone));
  EXPECT_FALSE(b->end());
  EXPECT_EQ(client->streamed, ended);
  const auto got = events(client->streamed);
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(api::openai_error_message(got[1]), "engine died");
  EXPECT_EQ(got[2], "[DONE]");
}

TEST(ChoiceMerger, AClientThatLeavesLetsGoOfTheUnfinishedChoicesOnce) {
  auto client = std::make_shared<Client>();
  auto merger = ChoiceMerger::create(client, 3, 1);
  auto a = merger->reply(0), b = merger->reply(1), c = merger->reply(2);
  int closed[3] = {0, 0, 0};
  a->on_close([&] { ++closed[0]; });
  b->on_close([&] { ++closed[1]; });
  c->on_close([&] { ++closed[2]; });
  ASSERT_TRUE(a->respond(200, answer("cmpl-r-0", "done", 1, 1), "application/json"));
  client->leave();
  client->leave();
  EXPECT_EQ(closed[0], 0);  // answered already
  EXPECT_EQ(closed[1], 1);
  EXPECT_EQ(closed[2], 1);
  EXPECT_TRUE(merger->ended());
  EXPECT_FALSE(merger->failure().has_value());  // no choice failed: the client left
}

TEST(ChoiceMerger, EveryCloseCallbackOfAChoiceRunsOnce) {
  auto client = std::make_shared<Client>();
  auto merger = ChoiceMerger::create(client, 2, 1);
  auto a = merger->reply(0);
  int first = 0, second = 0;
  a->on_close([&] { ++first; });
  a->on_close(nullptr);  // nothing to run, and no harm
  a->on_close([&] { ++second; });
  client->leave();
  client->leave();
  EXPECT_EQ(first, 1);
  EXPECT_EQ(second, 1);
  a->on_close(nullptr);  // after the end too
}

TEST(ChoiceMerger, AStreamCannotStartAfterAChoiceWasAnsweredWhole) {
  auto client = std::make_shared<Client>();
  auto merger = ChoiceMerger::create(client, 2, 1);
  auto a = merger->reply(0), b = merger->reply(1);
  int b_closed = 0;
  b->on_close([&] { ++b_closed; });
  ASSERT_TRUE(a->respond(200, answer("cmpl-w-0", "whole", 1, 1), "application/json"));
  // The other engine streams: the client's answer cannot hold both, and must not drop choice 0.
  EXPECT_FALSE(b->start_stream(200, "text/event-stream"));
  EXPECT_TRUE(client->complete);
  EXPECT_EQ(client->status, 502);
  EXPECT_TRUE(client->streamed.empty());
  EXPECT_EQ(b_closed, 1);  // let go, with the failure of choice 0
  ASSERT_TRUE(merger->failure().has_value());
  EXPECT_EQ(merger->failure()->choice, 0u);
  EXPECT_FALSE(b->write(chunk("cmpl-w-1", "B1")));
}

TEST(ChoiceMerger, ACompleteAnswerHasNoFailure) {
  auto client = std::make_shared<Client>();
  auto merger = ChoiceMerger::create(client, 1, 1);
  EXPECT_FALSE(merger->failure().has_value());
  ASSERT_TRUE(merger->reply(0)->respond(200, answer("cmpl-c-0", "ok", 1, 1), "application/json"));
  EXPECT_EQ(client->status, 200);
  EXPECT_FALSE(merger->failure().has_value());
}

}  // namespace
}  // namespace tandem::gateway
