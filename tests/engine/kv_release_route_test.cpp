// POST /v1/kv_transfer/release, over HTTP, on engines in process (the simulated tiny model, its
// engine thread running): a gateway whose sequential request ended before any decode engine took
// the prompt's KV tells the prefill engine that answered to let go of it. The prefill engine kept
// it for --kv-transfer-timeout (120 s by default) whatever happened to the request, so clients
// leaving under load filled its KV memory. A decode engine's pull of a released transfer then
// fails as one of an expired transfer (kv_transfer_expired); a release is idempotent; bad bodies
// and engines that hold no KV for decode engines get a 400 OpenAI error naming the field.
// (kv_transfer_test.cpp covers a release that comes while a decode engine pulls the transfer.)
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <future>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "api/error.h"
#include "engine/api_server.h"
#include "engine/generation_api.h"
#include "engine/sim_engine_fixture.h"
#include "net/http_client.h"
#include "util/bounded_wait.h"

namespace tandem::engine {
namespace {

using nlohmann::json;
using testing::get_within;
using testing::kHangGuard;
using testing::repeat_until;

// An engine of `role` (KV transfer over TCP on the loopback unless it has no `transfer`) on the
// simulated tiny model, its thread and HTTP server started, with `api_key` when given.
class ServedEngine {
 public:
  ServedEngine(EngineRole role, std::optional<KvTransferConfig> transfer,
               const std::string& api_key = {}, RequestPreparation preparation = {})
      : engine_(test::sim_engine(
            [&] {
              EngineConfig c;
              c.role = role;
              c.transfer = std::move(transfer);
              return c;
            }(),
            test::deepseek_v3_tokenizer(), registry_)),
        server_(*engine_, registry_, test::loopback_server_options(),
                api_key.empty() ? std::vector<std::string>{} : std::vector{api_key},
                std::move(preparation)) {
    engine_->start();
    server_.start();
  }
  ~ServedEngine() {
    server_.stop();
    engine_->stop();
  }

  net::HttpClientResponse post(const std::string& target, const std::string& body,
                               const std::string& key = {}) {
    net::Headers h;
    if (!key.empty()) h.set("Authorization", "Bearer " + key);
    return net::http_request("127.0.0.1", server_.port(), "POST", target, body, h);
  }
  int64_t held_blocks() const { return engine_->transfer()->held_blocks(); }
  uint16_t port() const { return server_.port(); }

 private:
  metrics::Registry registry_;
  std::unique_ptr<Engine> engine_;
  ApiServer server_;
};

KvTransferConfig prefill_transfer() {
  KvTransferConfig t;
  t.engine_id = "prefill-under-test";
  t.listen_host = "127.0.0.1";
  t.port = 0;
  t.advertise_host = "127.0.0.1";
  t.transport = KvTransportKind::kTcp;
  t.timeout_s = 600;  // past any test: only a pull or a release frees a hold
  return t;
}

KvTransferConfig decode_transfer() {
  KvTransferConfig t;
  t.engine_id = "decode-under-test";
  t.port = -1;
  t.transport = KvTransportKind::kTcp;
  return t;
}

constexpr char kKey[] = "key-1";
constexpr char kRelease[] = "/v1/kv_transfer/release";

const json kPrompt = {{"prompt", "The capital of France is a city that"}, {"max_tokens", 4}};

// The prefill leg of the sequential flow, as the gateway sends it: its answer's
// kv_transfer_params.
json prefilled(ServedEngine& prefill) {
  json leg = kPrompt;
  leg["kv_transfer_params"] = {{"do_remote_decode", true}};
  const auto answer = prefill.post("/v1/completions", leg.dump(), kKey);
  EXPECT_EQ(answer.status, 200) << answer.body;
  return json::parse(answer.body, nullptr, false).value("kv_transfer_params", json());
}

json release_body(const json& params) {
  return {{"kv_transfer_params", params}};
}

struct OpenAiError {
  std::string message, param, code;
};
OpenAiError error_of(const net::HttpClientResponse& r) {
  const json e = json::parse(r.body, nullptr, false);
  if (!e.is_object() || !e.contains("error")) return {"not an OpenAI error: " + r.body, "", ""};
  const json& error = e["error"];
  auto text = [&](const char* key) {
    return error.contains(key) && error[key].is_string() ? error[key].get<std::string>() : "";
  };
  return {text("message"), text("param"), text("code")};
}

TEST(KvReleaseRoute, AReleasedHoldIsFreedAndCanNoLongerBePulled) {
  ServedEngine prefill(EngineRole::kPrefill, prefill_transfer(), kKey);
  ServedEngine decode(EngineRole::kDecode, decode_transfer());
  const json params = prefilled(prefill);
  ASSERT_TRUE(params.is_object());
  ASSERT_GT(prefill.held_blocks(), 0);

  const auto released = prefill.post(kRelease, release_body(params).dump(), kKey);
  EXPECT_EQ(released.status, 200) << released.body;
  EXPECT_EQ(json::parse(released.body), json({{"released", true}}));
  EXPECT_EQ(prefill.held_blocks(), 0);

  // Idempotent: the second release finds nothing held.
  const auto again = prefill.post(kRelease, release_body(params).dump(), kKey);
  EXPECT_EQ(again.status, 200) << again.body;
  EXPECT_EQ(json::parse(again.body), json({{"released", false}}));

  // The decode leg that comes anyway finds the KV gone, as after the hold's expiry.
  json leg = kPrompt;
  leg["kv_transfer_params"] = params;
  const auto decoded = decode.post("/v1/completions", leg.dump());
  EXPECT_EQ(decoded.status, 502) << decoded.body;
  EXPECT_EQ(error_of(decoded).code, "kv_transfer_expired") << decoded.body;
}

TEST(KvReleaseRoute, ATransferNotHeldHereIsReleasedFalse) {
  ServedEngine prefill(EngineRole::kPrefill, prefill_transfer(), kKey);
  const json params = prefilled(prefill);
  ASSERT_TRUE(params.is_object());
  const int64_t held = prefill.held_blocks();

  json unknown = params;
  unknown["remote_request_id"] = "prefill-under-test-00000000000000000000000000000000";
  json other_engine = params;
  other_engine["remote_engine_id"] = "another-prefill";  // its id, this engine's transfer id
  for (const json& p : {unknown, other_engine}) {
    const auto r = prefill.post(kRelease, release_body(p).dump(), kKey);
    EXPECT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(json::parse(r.body), json({{"released", false}})) << p;
  }
  EXPECT_EQ(prefill.held_blocks(), held);  // the real hold is untouched
}

TEST(KvReleaseRoute, BadBodiesAre400NamingTheField) {
  ServedEngine prefill(EngineRole::kPrefill, prefill_transfer(), kKey);
  const json params = prefilled(prefill);
  ASSERT_TRUE(params.is_object());
  const int64_t held = prefill.held_blocks();

  json no_id = params;
  no_id.erase("remote_request_id");
  json id_not_text = params;
  id_not_text["remote_request_id"] = 7;
  json not_an_answer = params;
  not_an_answer["do_remote_prefill"] = false;
  const std::pair<std::string, std::string> bad[] = {
      {"{}", "kv_transfer_params"},
      {R"({"kv_transfer_params": "x"})", "kv_transfer_params"},
      {release_body(no_id).dump(), "kv_transfer_params"},
      {release_body(id_not_text).dump(), "kv_transfer_params"},
      {release_body(not_an_answer).dump(), "kv_transfer_params"},
      {"[1, 2]", ""},
      {"not json", ""},
  };
  for (const auto& [body, field] : bad) {
    const auto r = prefill.post(kRelease, body, kKey);
    EXPECT_EQ(r.status, 400) << body << ": " << r.body;
    const OpenAiError e = error_of(r);
    EXPECT_EQ(e.param, field) << body << ": " << r.body;
    if (body == release_body(no_id).dump()) {
      EXPECT_NE(e.message.find("remote_request_id"), std::string::npos) << e.message;
    }
  }
  EXPECT_EQ(prefill.held_blocks(), held);
}

TEST(KvReleaseRoute, NeedsTheApiKeyAsTheOtherRoutesDo) {
  ServedEngine prefill(EngineRole::kPrefill, prefill_transfer(), kKey);
  const json params = prefilled(prefill);
  ASSERT_TRUE(params.is_object());
  const int64_t held = prefill.held_blocks();
  const auto r = prefill.post(kRelease, release_body(params).dump());
  EXPECT_EQ(r.status, 401) << r.body;
  EXPECT_EQ(prefill.held_blocks(), held);
}

// A decode engine and one without KV transfer hold no KV for decode engines: a release sent
// there is a gateway's mistake, said as such.
TEST(KvReleaseRoute, AnEngineThatHoldsNoKvForDecodeEnginesSaysSo) {
  ServedEngine decode(EngineRole::kDecode, decode_transfer());
  ServedEngine plain(EngineRole::kBoth, std::nullopt);
  const std::string body =
      release_body({{"do_remote_prefill", true}, {"remote_request_id", "x"}}).dump();
  const auto to_decode = decode.post(kRelease, body);
  EXPECT_EQ(to_decode.status, 400) << to_decode.body;
  EXPECT_NE(error_of(to_decode).message.find("--role decode"), std::string::npos) << to_decode.body;
  const auto to_plain = plain.post(kRelease, body);
  EXPECT_EQ(to_plain.status, 400) << to_plain.body;
  EXPECT_NE(error_of(to_plain).message.find("no KV transfer"), std::string::npos) << to_plain.body;
}

// Holds the preparation of requests that carry X-Hold until the test lets them go, so that their
// client can leave before they are prepared.
class PreparationGate {
 public:
  RequestPreparation hook() {
    return {1, [this](const net::HttpRequest& req, net::Reply& reply) {
              if (req.headers.get("x-hold").empty()) return;
              held_.set_value(&reply);
              released_.wait();
            }};
  }
  // The reply of the request being held, once it reached its preparation.
  net::Reply* held() {
    auto there = held_.get_future();
    return get_within(there, kHangGuard, "the request never reached its preparation");
  }
  void release() {
    if (!let_go_) release_.set_value();
    let_go_ = true;
  }

 private:
  std::promise<net::Reply*> held_;
  std::promise<void> release_;
  std::shared_future<void> released_ = release_.get_future().share();
  bool let_go_ = false;
};

// Lets the held preparation go at the end of a test that failed early, before the engine's
// server waits for it to stop (declared after the engines).
struct ReleaseAtEnd {
  PreparationGate& gate;
  ~ReleaseAtEnd() { gate.release(); }
};

// Sends POST `target` with `body` to `port` (marked X-Hold, with `key` when given), waits until
// `gate` holds it in its preparation, and leaves: the request's client is gone when it is
// prepared.
void send_and_leave(uint16_t port, const std::string& target, const std::string& body,
                    PreparationGate& gate, const std::string& key = {}) {
  const std::string request =
      "POST " + target + " HTTP/1.1\r\nHost: engine\r\nX-Hold: 1\r\n" +
      (key.empty() ? "" : "Authorization: Bearer " + key + "\r\n") +
      "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
      "\r\n\r\n" + body;
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address), 0);
  ASSERT_EQ(::send(fd, request.data(), request.size(), MSG_NOSIGNAL), ssize_t(request.size()));
  net::Reply* reply = gate.held();
  std::promise<void> gone;
  reply->on_close([&] { gone.set_value(); });
  ::close(fd);
  auto left = gone.get_future();
  get_within(left, kHangGuard, "the client's leaving was not seen");
}

// A decode leg whose client (the gateway, cancelling it) leaves while the leg waits to be
// prepared is never submitted, so its engine neither pulled nor released the prefill engine's KV,
// which stayed held until its timeout. Dropped, the leg now tells the prefill engine to let go.
TEST(KvReleaseRoute, ADecodeLegDroppedBeforeItsPreparationLetsGoOfItsKv) {
  PreparationGate gate;
  ServedEngine prefill(EngineRole::kPrefill, prefill_transfer(), kKey);
  ServedEngine decode(EngineRole::kDecode, decode_transfer(), {}, gate.hook());
  ReleaseAtEnd release_at_end{gate};
  const json params = prefilled(prefill);
  ASSERT_TRUE(params.is_object());
  ASSERT_GT(prefill.held_blocks(), 0);

  json leg = kPrompt;
  leg["kv_transfer_params"] = params;
  send_and_leave(decode.port(), "/v1/completions", leg.dump(), gate);  // the gateway gives it up
  gate.release();
  repeat_until([&] { return prefill.held_blocks() == 0; }, kHangGuard,
               "the prefill engine still holds the KV of the dropped decode leg");
}

// The gateway bounds its release call by timeouts.connect_ms; a release that waited longer on a
// busy preparation thread found its client gone and was dropped unread, so the hold stayed until
// --kv-transfer-timeout. A release needs no answer: it is done all the same.
TEST(KvReleaseRoute, AReleaseWhoseCallerLeftBeforeItsPreparationStillFreesTheKv) {
  PreparationGate gate;
  ServedEngine prefill(EngineRole::kPrefill, prefill_transfer(), kKey, gate.hook());
  ReleaseAtEnd release_at_end{gate};
  const json params = prefilled(prefill);
  ASSERT_TRUE(params.is_object());
  ASSERT_GT(prefill.held_blocks(), 0);

  send_and_leave(prefill.port(), kRelease, release_body(params).dump(), gate, kKey);
  gate.release();
  repeat_until([&] { return prefill.held_blocks() == 0; }, kHangGuard,
               "the release whose caller left freed nothing");
}

// A reply whose client left before the answer: nothing can be sent any more.
class GoneReply final : public net::Reply {
 public:
  bool respond(int, std::string, std::string) override { return !(answered = true); }
  bool send_error(int, std::string_view, std::string_view, std::string_view) override {
    return !(answered = true);
  }
  bool start_stream(int, std::string) override { return false; }
  bool write(std::string_view) override { return false; }
  bool end() override { return !(answered = true); }
  void abort() override { answered = true; }
  void on_close(std::function<void()>) override {}
  bool answered = false;
};

// The gateway gave a prefill leg up (its client left) after the engine had computed the prompt
// and held its KV, before the answer went out: nobody learns the transfer id, so neither a pull
// nor a release would ever come, and the KV stayed held until --kv-transfer-timeout. An answer
// that cannot be sent now frees it.
TEST(KvReleaseRoute, APrefillAnswerThatCannotBeSentLetsGoOfItsKv) {
  metrics::Registry registry;
  EngineConfig config;
  config.role = EngineRole::kPrefill;
  config.transfer = prefill_transfer();
  const auto engine = test::sim_engine(config, test::deepseek_v3_tokenizer(), registry);
  GenerationApi api(*engine, [](std::function<void()> task) { task(); });
  json leg = kPrompt;
  leg["kv_transfer_params"] = {{"do_remote_decode", true}};
  net::HttpRequest req;
  req.method = "POST";
  req.body = leg.dump();
  auto reply = std::make_shared<GoneReply>();
  api.handle(api::ApiKind::kCompletion, req, reply);
  for (int i = 0; i < 100 && !reply->answered; ++i) engine->run_once();
  ASSERT_TRUE(reply->answered);
  EXPECT_EQ(engine->transfer()->held_blocks(), 0);
  engine->run_once();  // the hold's release, posted to the engine, frees the blocks
  EXPECT_EQ(engine->load().free_blocks, engine->load().total_blocks);
}

// A reply that keeps the status and body it was given.
class RecordingReply final : public net::Reply {
 public:
  bool respond(int s, std::string b, std::string) override {
    status = s;
    body = std::move(b);
    return true;
  }
  bool send_error(int s, std::string_view message, std::string_view, std::string_view) override {
    status = s;
    body = std::string(message);
    return true;
  }
  bool start_stream(int, std::string) override { return false; }
  bool write(std::string_view) override { return false; }
  bool end() override { return true; }
  void abort() override {}
  void on_close(std::function<void()>) override {}
  int status = 0;
  std::string body;
};

// A refused request (the engine stopping, its client gone before its preparation) is read only
// for a transfer it names: what it names is still let go of, and every refusal is a 503 saying
// why, whether the body names a transfer, is no JSON, or the engine has no KV transfer. (The
// body is no longer parsed where it cannot name a transfer this engine can let go of: a cost,
// which no answer shows.)
TEST(KvReleaseRoute, ARefusedRequestIsA503AndARefusedDecodeLegStillLetsGoOfItsKv) {
  ServedEngine prefill(EngineRole::kPrefill, prefill_transfer(), kKey);
  const json params = prefilled(prefill);
  ASSERT_TRUE(params.is_object());
  ASSERT_GT(prefill.held_blocks(), 0);

  json leg = kPrompt;
  leg["kv_transfer_params"] = params;
  for (const bool with_transfer : {false, true}) {
    metrics::Registry registry;
    EngineConfig config;
    config.role = with_transfer ? EngineRole::kDecode : EngineRole::kBoth;
    if (with_transfer) config.transfer = decode_transfer();
    const auto engine = test::sim_engine(config, test::deepseek_v3_tokenizer(), registry);
    GenerationApi api(*engine, [](std::function<void()> task) { task(); });
    for (const std::string& body : {kPrompt.dump(), std::string("not json \"bootstrap_room\""),
                                    std::string("{\"prompt\": [1, 2")}) {
      net::HttpRequest req;
      req.method = "POST";
      req.body = body;
      RecordingReply reply;
      api.refuse(api::ApiKind::kCompletion, req, reply, "the engine is shutting down");
      EXPECT_EQ(reply.status, 503) << body;
      EXPECT_EQ(reply.body, "the engine is shutting down") << body;
    }
    EXPECT_GT(prefill.held_blocks(), 0) << "nothing named the transfer";
    net::HttpRequest req;
    req.method = "POST";
    req.body = leg.dump();
    RecordingReply reply;
    api.refuse(api::ApiKind::kCompletion, req, reply, "its client left before it was prepared");
    EXPECT_EQ(reply.status, 503);
    if (!with_transfer) {
      EXPECT_GT(prefill.held_blocks(), 0) << "an engine without KV transfer pulls nothing";
      continue;
    }
    repeat_until([&] { return prefill.held_blocks() == 0; }, kHangGuard,
                 "the prefill engine still holds the KV of the refused decode leg");
  }
}

}  // namespace
}  // namespace tandem::engine
