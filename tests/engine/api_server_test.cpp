// The engine's HTTP front (api_server.h) around its requests' lives. A stopping engine drains,
// as the gateway does and as vLLM (uvicorn) does: new generation requests get 503 and /health 503
// at once, while the requests in flight finish whole; a prefill's KV held for a decode engine's
// pull may still be taken; a second stop signal ends the drain. Before, `tandem engine` closed
// every connection at the first SIGTERM.
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <future>
#include <map>
#include <mutex>
#include <source_location>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "api/load_report.h"
#include "api/prefill_work.h"
#include "engine/api_server.h"
#include "engine/engine_process.h"
#include "engine/sim_engine_fixture.h"
#include "net/http_client.h"
#include "util/bounded_wait.h"
#include "util/file.h"
#include "util/loopback_socket.h"

namespace tandem::engine {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;
using testing::get_within;
using testing::kHangGuard;
using testing::repeat_until;

// Steps `engine` until `done` is ready (looking again every millisecond while it has nothing to
// do: the answer is being written by the server's threads). A hang is reported at `where`, the
// test's line.
template <class T>
void run_engine_until(Engine& engine, const std::future<T>& done,
                      const std::source_location& where = std::source_location::current()) {
  repeat_until(
      [&] {
        if (done.wait_for(0s) == std::future_status::ready) return true;
        if (!engine.run_once()) done.wait_for(1ms);
        return false;
      },
      kHangGuard, "the answer did not come while the engine stepped", where);
}

// Work a test runs on threads of its own (a client, a stop that drains), joined by the fixture
// once it has stopped the server, which cuts what they wait for. A std::async future is waited on
// where the test's scope ends instead, before the fixture's stop: a test that failed early waited
// there for its clients' own timeouts, or for a drain of an hour.
class Background {
 public:
  ~Background() { join(); }
  template <class Work>
  auto run(Work work) -> std::future<decltype(work())> {
    std::packaged_task<decltype(work())()> task(std::move(work));
    auto done = task.get_future();
    threads_.emplace_back(std::move(task));
    return done;
  }
  void join() {
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

 private:
  std::vector<std::thread> threads_;
};

// POSTs `body` to `target` of the server on `port`, on a thread of `background`.
std::future<net::HttpClientResponse> post_in_background(Background& background, uint16_t port,
                                                        const std::string& target, const json& body,
                                                        const net::Headers& headers = {}) {
  return background.run([port, target, text = body.dump(), headers] {
    return net::http_request("127.0.0.1", port, "POST", target, text, headers, 120s);
  });
}

// An API server over an engine in process (simulated tiny model, virtual time) that is never
// started: it runs a step only when the test calls run_once, so a request stays in flight for as
// long as the test wants.
class EngineDrain : public ::testing::Test {
 protected:
  EngineDrain()
      : engine_(test::sim_engine(EngineConfig{}, test::deepseek_v3_tokenizer(), registry_)),
        server_(*engine_, registry_, test::loopback_server_options(), {},
                {2, [this](const net::HttpRequest& req, net::Reply& reply) {
                   if (req.headers.get("x-hold").empty()) return;
                   held_.set_value(&reply);
                   released_.wait();
                 }}) {
    server_.start();
  }
  ~EngineDrain() override {
    // A failed test may leave a stop of its own draining, and its held preparation waiting: the
    // stops would wait for them (an hour; forever).
    server_.end_drain();
    try {
      release_.set_value();
    } catch (const std::future_error&) {
      // released by the test
    }
    server_.stop();
    background_.join();
    engine_->stop();
  }

  template <class T>
  void run_until(const std::future<T>& done,
                 const std::source_location& where = std::source_location::current()) {
    run_engine_until(*engine_, done, where);
  }

  // Runs one engine step, once a request is there to step: a stream's first token.
  void step_once(const std::future<void>& until,
                 const std::source_location& where = std::source_location::current()) {
    repeat_until(
        [&] {
          if (engine_->run_once()) return true;
          until.wait_for(1ms);
          return false;
        },
        kHangGuard, "no request reached the engine to step", where);
  }

  net::HttpClientResponse post(const std::string& target, const json& body) {
    return net::http_request("127.0.0.1", server_.port(), "POST", target, body.dump());
  }

  metrics::Registry registry_;
  std::unique_ptr<Engine> engine_;
  // The preparation of one request with the header X-Hold waits until release_ is set; held_
  // says it is there, with its reply.
  std::promise<net::Reply*> held_;
  std::promise<void> release_;
  std::shared_future<void> released_ = release_.get_future().share();
  ApiServer server_;
  Background background_;
};

// The message of an OpenAI error body.
std::string error_message(const std::string& body) {
  const json j = json::parse(body, nullptr, false);
  return j.contains("error") ? j["error"].value("message", "") : "";
}

TEST_F(EngineDrain, NewRequestsAreRefusedWhileTheOneInFlightFinishesWhole) {
  // A stream in flight: its first token is out, seven more to come.
  const json streamed = {{"prompt", "The quick brown fox"},
                         {"max_tokens", 8},
                         {"ignore_eos", true},
                         {"stream", true},
                         {"stream_options", {{"include_usage", true}}}};
  std::promise<void> first_piece;
  auto first = first_piece.get_future();
  std::string events;
  auto answer = std::async(std::launch::async, [&] {
    return net::http_request_stream(
        "127.0.0.1", server_.port(), "POST", "/v1/completions", streamed.dump(), {},
        [&, said = false](std::string_view piece) mutable {
          events += piece;
          if (!std::exchange(said, true)) first_piece.set_value();
          return true;
        },
        120s);
  });
  step_once(first);
  get_within(first, kHangGuard, "the stream's first token did not come");

  // The stop begins: refusals first, then a drain far longer than this test.
  server_.refuse_new_requests();
  auto stopped = background_.run([&] { server_.stop(std::chrono::hours(1)); });
  for (const std::string target : {"/v1/completions", "/v1/chat/completions", "/generate"}) {
    const json body = target == "/v1/chat/completions"
                          ? json{{"messages", {{{"role", "user"}, {"content", "hi"}}}}}
                      : target == "/generate" ? json{{"input_ids", {1, 2, 3}}}
                                              : json{{"prompt", "hi"}};
    const auto refused = post(target, body);
    EXPECT_EQ(refused.status, 503) << target << ": " << refused.body;
    EXPECT_EQ(error_message(refused.body), "the engine is shutting down") << refused.body;
    EXPECT_EQ(json::parse(refused.body)["error"]["type"], "server_error") << refused.body;
  }
  const auto health = net::http_request("127.0.0.1", server_.port(), "GET", "/health");
  EXPECT_EQ(health.status, 503) << "load balancers and gateways must take the engine out";
  EXPECT_EQ(error_message(health.body), "the engine is shutting down") << health.body;
  // Cheap routes, which start no engine work, still answer.
  EXPECT_EQ(post("/tokenize", {{"prompt", "hi"}}).status, 200);
  EXPECT_EQ(net::http_request("127.0.0.1", server_.port(), "GET", "/v1/models").status, 200);
  // The engine has not stepped since: the stream cannot have ended, nor the drain.
  EXPECT_EQ(stopped.wait_for(0s), std::future_status::timeout);

  run_until(answer);
  EXPECT_EQ(answer.get().status, 200);
  get_within(stopped, kHangGuard, "the drain did not end once the answer was out");
  // Every token, the usage and the end of the stream reached the client.
  std::istringstream lines(events);
  std::string finish, last;
  int64_t completion_tokens = -1;
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("data: ", 0) != 0) continue;
    last = line;
    if (line == "data: [DONE]") continue;
    const json chunk = json::parse(line.substr(6));
    if (!chunk["choices"].empty() && chunk["choices"][0]["finish_reason"].is_string())
      finish = chunk["choices"][0]["finish_reason"];
    if (chunk.contains("usage") && chunk["usage"].is_object())
      completion_tokens = chunk["usage"]["completion_tokens"];
  }
  EXPECT_EQ(finish, "length") << events;
  EXPECT_EQ(completion_tokens, 8) << events;
  EXPECT_EQ(last, "data: [DONE]") << events;
}

// A second stop signal (end_drain) ends a drain that waits for a request in flight: the stop
// returns, and the connection closes (the engine, stopped after, aborts the request).
TEST_F(EngineDrain, EndingTheDrainStopsWithARequestStillInFlight) {
  std::promise<void> first_piece;
  auto first = first_piece.get_future();
  auto answer = std::async(std::launch::async, [&] {
    return net::http_request_stream(
        "127.0.0.1", server_.port(), "POST", "/v1/completions",
        json{{"prompt", "hi"}, {"max_tokens", 8}, {"ignore_eos", true}, {"stream", true}}.dump(),
        {},
        [&, said = false](std::string_view) mutable {
          if (!std::exchange(said, true)) first_piece.set_value();
          return true;
        },
        120s);
  });
  step_once(first);
  get_within(first, kHangGuard, "the stream's first token did not come");
  auto stopped = background_.run([&] { server_.stop(std::chrono::hours(1)); });
  server_.end_drain();
  get_within(stopped, kHangGuard, "end_drain did not end the drain");
  try {
    get_within(answer, kHangGuard, "the stream was not cut when the server stopped");
    ADD_FAILURE() << "the stream ended whole, but the engine never stepped";
  } catch (const std::exception&) {
    // cut: what a drain's end does to the requests left
  }
}

// A generation request waiting to be prepared counts in /load as a waiting sequence with its
// prefill work (estimated from its body): the engine has not been given it yet, so its own report
// left it out, and a gateway polling then saw an idle engine and sent it more. Once answered,
// nothing of it is left counted.
TEST_F(EngineDrain, LoadCountsARequestWaitingToBePrepared) {
  const json body = {{"prompt", "The quick brown fox jumps over the lazy dog"}, {"max_tokens", 4}};
  net::Headers hold;
  hold.add("X-Hold", "1");
  auto held = post_in_background(background_, server_.port(), "/v1/completions", body, hold);
  auto there = held_.get_future();
  get_within(there, kHangGuard, "the request never reached its preparation");
  auto load = [&] {
    return api::parse_load_report(
        net::http_request("127.0.0.1", server_.port(), "GET", "/load").body);
  };
  const api::LoadReport waiting = load();
  EXPECT_EQ(waiting.waiting, 1);
  const int64_t estimate = static_cast<int64_t>(body.dump().size()) / ApiServer::kBodyBytesPerToken;
  EXPECT_EQ(waiting.prefill_tokens, estimate);
  EXPECT_EQ(waiting.prefill_pairs, api::causal_pairs(0, estimate));
  release_.set_value();
  run_until(held);
  EXPECT_EQ(held.get().status, 200);
  const api::LoadReport after = load();
  EXPECT_EQ(after.waiting, 0);
  EXPECT_EQ(after.prefill_tokens, 0);
  EXPECT_EQ(after.prefill_pairs, 0);
}

// A server with one preparation thread, where a request with the header X-Hold: <name> waits
// before its preparation until the test releases that name: requests posted while the thread is
// held are then prepared one after the other, in one pass of the thread.
class OnePreparationThread : public ::testing::Test {
 protected:
  struct Hold {
    std::promise<void> there;
    std::promise<void> release;
  };

  OnePreparationThread()
      : engine_(test::sim_engine(EngineConfig{}, test::deepseek_v3_tokenizer(), registry_)),
        server_(*engine_, registry_, test::loopback_server_options(), {},
                {1, [this](const net::HttpRequest& req, net::Reply&) {
                   const std::string name = req.headers.get("x-hold");
                   if (name.empty()) return;
                   Hold& hold = holds_.at(name);
                   hold.there.set_value();
                   hold.release.get_future().wait();
                 }}) {
    holds_["first"];
    holds_["second"];
    server_.start();
  }
  ~OnePreparationThread() override {
    // A failed test may leave a hold closed: the preparation thread would wait on it forever.
    for (auto& [name, hold] : holds_) {
      try {
        hold.release.set_value();
      } catch (const std::future_error&) {
        // released by the test
      }
    }
    server_.stop();
    background_.join();
    engine_->stop();
  }

  std::future<net::HttpClientResponse> post(const std::string& target, const json& body,
                                            const std::string& hold = "") {
    net::Headers headers;
    if (!hold.empty()) headers.add("X-Hold", hold);
    return post_in_background(background_, server_.port(), target, body, headers);
  }
  api::LoadReport load() {
    return api::parse_load_report(
        net::http_request("127.0.0.1", server_.port(), "GET", "/load").body);
  }
  template <class T>
  void run_until(const std::future<T>& done,
                 const std::source_location& where = std::source_location::current()) {
    run_engine_until(*engine_, done, where);
  }

  metrics::Registry registry_;
  std::unique_ptr<Engine> engine_;
  std::map<std::string, Hold> holds_;  // filled before the server starts, only read after
  ApiServer server_;
  Background background_;
};

// A request stops counting as unprepared in /load once it has been prepared and handed to the
// engine, which counts it from then. It counted until every request prepared in the same pass
// of its preparation thread was: answered meanwhile, it was still reported waiting, and while in
// the engine it counted twice.
TEST_F(OnePreparationThread, APreparedRequestNoLongerCountsWhileTheOthersOfItsPassArePrepared) {
  // The thread is held in a /tokenize (not counted) while two generation requests queue behind
  // it: released, it prepares them in one pass.
  auto tokenized = post("/tokenize", {{"prompt", "hi"}}, "first");
  auto first_there = holds_.at("first").there.get_future();
  get_within(first_there, kHangGuard, "the /tokenize never reached its preparation");
  const json quick = {{"prompt", "The quick brown fox"}, {"max_tokens", 1}};
  const json held = {{"prompt", "The quick brown fox jumps over the lazy dog, twice over"},
                     {"max_tokens", 1}};
  // Each is counted once taken, by the one io thread that answers /load too, and counted it is
  // posted to the preparation thread: waiting for the first to be counted before posting the
  // second fixes their order in the thread's pass (two connections race otherwise).
  auto answered = post("/v1/completions", quick);
  repeat_until([&] { return load().waiting >= 1; }, kHangGuard, "the first was never counted");
  auto second = post("/v1/completions", held, "second");
  repeat_until([&] { return load().waiting >= 2; }, kHangGuard, "the second was never counted");
  holds_.at("first").release.set_value();
  EXPECT_EQ(get_within(tokenized, kHangGuard, "the /tokenize was not answered").status, 200);
  // Once the held one is there, the quick one is prepared: it is submitted.
  auto second_there = holds_.at("second").there.get_future();
  get_within(second_there, kHangGuard, "the held request never reached its preparation");
  run_until(answered);
  EXPECT_EQ(answered.get().status, 200);

  const api::LoadReport report = load();
  const int64_t estimate = static_cast<int64_t>(held.dump().size()) / ApiServer::kBodyBytesPerToken;
  EXPECT_EQ(report.waiting, 1) << "only the request still being prepared";
  EXPECT_EQ(report.prefill_tokens, estimate);
  EXPECT_EQ(report.prefill_pairs, api::causal_pairs(0, estimate));

  holds_.at("second").release.set_value();
  run_until(second);
  EXPECT_EQ(second.get().status, 200);
  const api::LoadReport after = load();
  EXPECT_EQ(after.waiting, 0);
  EXPECT_EQ(after.prefill_tokens, 0);
}

// A request's preparation (parse, tokenization, chat template, grammar) runs on a thread of its
// own: while one is held there, /health and another client's request are answered. It ran on
// the single io thread, so one 8 MiB prompt or heavy schema stalled every stream and /health.
TEST_F(EngineDrain, ARequestBeingPreparedHoldsUpNoOtherClient) {
  const json body = {{"prompt", "The quick brown fox"}, {"max_tokens", 4}, {"ignore_eos", true}};
  net::Headers hold;
  hold.add("X-Hold", "1");
  auto slow = post_in_background(background_, server_.port(), "/v1/completions", body, hold);
  auto there = held_.get_future();
  get_within(there, kHangGuard, "the request never reached its preparation");
  EXPECT_EQ(net::http_request("127.0.0.1", server_.port(), "GET", "/health", {}, {}, 30s).status,
            200);
  auto other = post_in_background(background_, server_.port(), "/v1/completions", body);
  run_until(other);
  const auto answered = other.get();
  EXPECT_EQ(answered.status, 200) << answered.body;
  EXPECT_EQ(json::parse(answered.body)["usage"]["completion_tokens"], 4) << answered.body;
  EXPECT_EQ(slow.wait_for(0s), std::future_status::timeout) << "its preparation is held";
  release_.set_value();
  run_until(slow);
  const auto held = slow.get();
  EXPECT_EQ(held.status, 200) << held.body;
  EXPECT_EQ(json::parse(held.body)["usage"]["completion_tokens"], 4) << held.body;
}

// A client that leaves while its request waits to be prepared starts no engine work: nothing is
// submitted for nobody (one that leaves later has its engine requests aborted as they are
// submitted, as before).
TEST_F(EngineDrain, AClientThatLeavesBeforeItsRequestIsPreparedStartsNoEngineWork) {
  const std::string text =
      json{{"prompt", "The quick brown fox"}, {"max_tokens", 500}, {"ignore_eos", true}}.dump();
  const std::string request =
      "POST /v1/completions HTTP/1.1\r\nHost: engine\r\nX-Hold: 1\r\n"
      "Content-Type: application/json\r\nContent-Length: " +
      std::to_string(text.size()) + "\r\n\r\n" + text;
  const int fd = tandem::testing::connect_loopback(server_.port());
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::send(fd, request.data(), request.size(), MSG_NOSIGNAL), ssize_t(request.size()));
  auto there = held_.get_future();
  net::Reply* reply = get_within(there, kHangGuard, "the request never reached its preparation");
  std::promise<void> gone;
  reply->on_close([&] { gone.set_value(); });
  ::close(fd);  // the client leaves
  auto left = gone.get_future();
  get_within(left, kHangGuard, "the client's leaving was not seen");
  release_.set_value();
  // A drain returns once the held request is done with (its reply dropped) and the engine idle;
  // the engine steps meanwhile, so that a request submitted for nobody would end (aborted).
  auto stopped = background_.run([&] { server_.stop(std::chrono::hours(1)); });
  run_until(stopped);
  EXPECT_FALSE(engine_->has_work());
  // No request ended aborted: none was submitted for the client that had left.
  std::istringstream metrics(registry_.render());
  for (std::string line; std::getline(metrics, line);) {
    if (line.rfind("vllm:request_success_total{", 0) == 0) {
      EXPECT_EQ(line.substr(line.rfind(' ') + 1), "0") << line;
    }
  }
}

// `tandem engine` on SIGTERM, end to end: a prefill engine whose answered leg holds its KV for a
// decode engine's pull (that never comes) drains: /health answers 503 and new requests 503 while
// it waits for the pull, within --shutdown-timeout; a second SIGTERM ends the drain at once.
TEST(EngineDrainCommand, APrefillHoldWaitsForItsPullUntilASecondStopSignal) {
  testing::EngineProcess engine({TANDEM_BINARY, "engine", "--model", "sim:tiny", "--host",
                                 "127.0.0.1", "--port", "0", "--role", "prefill",
                                 "--kv-transfer-port", "0", "--kv-transfer-timeout", "600",
                                 "--shutdown-timeout", "600"});
  const json leg = {{"prompt", "The quick brown fox jumps over the lazy dog"},
                    {"max_tokens", 4},
                    {"kv_transfer_params", {{"do_remote_decode", true}}}};
  const auto answered =
      net::http_request("127.0.0.1", engine.port(), "POST", "/v1/completions", leg.dump());
  ASSERT_EQ(answered.status, 200) << answered.body;
  ASSERT_TRUE(json::parse(answered.body).contains("kv_transfer_params")) << answered.body;
  ::kill(engine.pid(), SIGTERM);
  // Load balancers see it go: /health turns 503 as soon as the signal is taken.
  net::HttpClientResponse health;
  for (int i = 0; i < 400; ++i) {
    health = net::http_request("127.0.0.1", engine.port(), "GET", "/health");
    if (health.status == 503) break;
    std::this_thread::sleep_for(25ms);
  }
  EXPECT_EQ(health.status, 503);
  EXPECT_EQ(
      net::http_request("127.0.0.1", engine.port(), "POST", "/v1/completions", leg.dump()).status,
      503);
  siginfo_t ended{};  // looked at, not reaped (WNOWAIT): stop() reaps it
  ::waitid(P_PID, static_cast<id_t>(engine.pid()), &ended, WEXITED | WNOHANG | WNOWAIT);
  EXPECT_EQ(ended.si_pid, 0) << "the hold has 600 s to be pulled";
  EXPECT_EQ(engine.stop(), 0);  // SIGTERM again: the drain ends at once
}

// A decode engine's pull that comes within the prefill engine's drain (after its SIGTERM) takes
// the held KV: the decode leg is answered with the prefill's KV, and the prefill engine's drain
// then ends by itself, its engine idle, without a second signal or the 600 s.
TEST(EngineDrainCommand, APullWithinTheDrainTakesTheHeldKvAndTheDrainEndsByItself) {
  testing::EngineProcess prefill({TANDEM_BINARY, "engine", "--model", "sim:tiny", "--host",
                                  "127.0.0.1", "--port", "0", "--role", "prefill",
                                  "--kv-transfer-port", "0", "--kv-transfer-timeout", "600",
                                  "--shutdown-timeout", "600"});
  testing::EngineProcess decode({TANDEM_BINARY, "engine", "--model", "sim:tiny", "--host",
                                 "127.0.0.1", "--port", "0", "--role", "decode"});
  const json prompt = "The quick brown fox jumps over the lazy dog";
  const json leg = {
      {"prompt", prompt}, {"max_tokens", 1}, {"kv_transfer_params", {{"do_remote_decode", true}}}};
  const auto answered =
      net::http_request("127.0.0.1", prefill.port(), "POST", "/v1/completions", leg.dump());
  ASSERT_EQ(answered.status, 200) << answered.body;
  const json params = json::parse(answered.body)["kv_transfer_params"];
  ASSERT_TRUE(params.is_object()) << answered.body;

  ::kill(prefill.pid(), SIGTERM);
  net::HttpClientResponse health;
  for (int i = 0; i < 400; ++i) {
    health = net::http_request("127.0.0.1", prefill.port(), "GET", "/health");
    if (health.status == 503) break;
    std::this_thread::sleep_for(25ms);
  }
  ASSERT_EQ(health.status, 503) << "the drain has begun";

  const json decode_leg = {{"prompt", prompt}, {"max_tokens", 4}, {"kv_transfer_params", params}};
  const auto decoded = net::http_request("127.0.0.1", decode.port(), "POST", "/v1/completions",
                                         decode_leg.dump(), {}, 120s);
  ASSERT_EQ(decoded.status, 200) << decoded.body;
  EXPECT_EQ(json::parse(decoded.body)["usage"]["completion_tokens"], 4) << decoded.body;

  // Looked at, not reaped (WNOWAIT): stop() reaps it. Bounded: a drain that never ends fails.
  auto ended = std::async(std::launch::async, [pid = prefill.pid()] {
    siginfo_t info{};
    ::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOWAIT);
    return info;
  });
  if (ended.wait_for(120s) != std::future_status::ready) {
    ADD_FAILURE() << "the prefill engine's drain did not end once its hold was pulled";
    ::kill(prefill.pid(), SIGKILL);
  }
  const siginfo_t info = ended.get();
  EXPECT_EQ(info.si_code, CLD_EXITED);
  EXPECT_EQ(info.si_status, 0);
  EXPECT_EQ(prefill.stop(), 0);
}

// The same server's other routes.
using ApiServerRoutes = EngineDrain;

TEST_F(ApiServerRoutes, AnEngineThatPlacesNoExpertsAnswersAPlacementChangeWith404AsItsGet) {
  // Before the body is read: it was parsed first, and a valid one got a 400.
  for (const std::string body : {"{}", "not json"}) {
    const auto posted =
        net::http_request("127.0.0.1", server_.port(), "POST", "/admin/expert_placement", body);
    EXPECT_EQ(posted.status, 404) << posted.body;
    EXPECT_NE(posted.body.find("does not place experts"), std::string::npos) << posted.body;
  }
  EXPECT_EQ(net::http_request("127.0.0.1", server_.port(), "GET", "/admin/expert_placement").status,
            404);
}

}  // namespace
}  // namespace tandem::engine
