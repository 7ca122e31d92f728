#pragma once
// HTTP helpers for tests that drive `tandem engine` processes: JSON GETs, one metric's value,
// waiting (bounded) for an engine to go idle, the official client's run and checks of what it saw.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "net/http_client.h"
#include "text/oracle_support.h"

namespace tandem::testing {

inline nlohmann::json get_json(uint16_t port, const std::string& target) {
  auto r = net::http_request("127.0.0.1", port, "GET", target);
  EXPECT_EQ(r.status, 200) << target;
  return nlohmann::json::parse(r.body);
}

inline net::HttpClientResponse post_json(uint16_t port, const std::string& target,
                                         const nlohmann::json& body) {
  return net::http_request("127.0.0.1", port, "POST", target, body.dump(), {},
                           std::chrono::seconds(60));
}

// The value of the first sample of `name` (with any labels) whose line contains `labels`.
inline double metric(uint16_t port, const std::string& name, const std::string& labels = {}) {
  auto r = net::http_request("127.0.0.1", port, "GET", "/metrics");
  std::istringstream in(r.body);
  std::string line;
  while (std::getline(in, line))
    if ((line.rfind(name + "{", 0) == 0 || line.rfind(name + " ", 0) == 0) &&
        line.find(labels) != std::string::npos)
      return std::stod(line.substr(line.rfind(' ') + 1));
  return 0;  // counters of a label set not seen yet
}

// Polls until `done` holds (about 10 s at most): the test fails rather than hangs.
inline bool eventually(const std::function<bool()>& done) {
  for (int i = 0; i < 400; ++i) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  return false;
}

inline bool wait_idle(uint16_t port) {
  return eventually([&] {
    auto load = get_json(port, "/load");
    return load["running"] == 0 && load["waiting"] == 0;
  });
}

// Runs the official `openai` npm client (tests/oracle/openai_client_check.js) against the
// OpenAI API on `port` with model name "tiny" and returns what it saw, as JSON.
inline nlohmann::json run_openai_client(uint16_t port, const std::string& prompt,
                                        const std::vector<int32_t>& prompt_ids) {
  const auto out_path = test::temp_path("openai-client");
  const std::string cmd = "node " + test::quote(test::oracle_dir() / "openai_client_check.js") +
                          " " + test::quote("http://127.0.0.1:" + std::to_string(port) + "/v1") +
                          " tiny " + test::quote(prompt) + " " +
                          test::quote(nlohmann::json(prompt_ids).dump()) + " > " +
                          test::quote(out_path);
  EXPECT_EQ(test::run_command(cmd), 0);
  std::ifstream in(out_path);
  nlohmann::json r = nlohmann::json::parse(in, nullptr, false);
  std::filesystem::remove(out_path);
  return r.is_discarded() ? nlohmann::json::object() : r;
}

// What openai_client_check.js saw of several choices and of echo, as one engine answers it and a
// gateway in front of engines must too. `prompt` (of `prompt_tokens` tokens) and "Hello world"
// (of `hello_tokens`) greedily continue with `first` and `second` (6 tokens each).
inline void expect_several_choices_and_echo(const nlohmann::json& r, const std::string& prompt,
                                            size_t prompt_tokens, size_t hello_tokens,
                                            const std::string& first, const std::string& second) {
  using nlohmann::json;
  // n choices of each prompt of a list: prompt-major (vLLM's index = prompt_idx * n + j), each
  // echoing its own prompt; each prompt counted once in usage. Streamed too, with one id.
  const json& several = r["several"];
  EXPECT_EQ(several["n_list"]["texts"],
            json::array(
                {prompt + first, prompt + first, "Hello world" + second, "Hello world" + second}));
  EXPECT_EQ(several["n_list"]["indexes"], json::array({0, 1, 2, 3}));
  EXPECT_EQ(several["n_list"]["usage"]["prompt_tokens"], prompt_tokens + hello_tokens);
  EXPECT_EQ(several["n_list"]["usage"]["completion_tokens"], 24);
  EXPECT_EQ(several["n_list_stream"]["texts"], json::array({first, first, second, second}));
  EXPECT_EQ(several["n_list_stream"]["ids"], 1);
  EXPECT_EQ(several["n_list_stream"]["usage"]["prompt_tokens"], prompt_tokens + hello_tokens);
  EXPECT_EQ(several["n_list_stream"]["usage"]["completion_tokens"], 24);
  // echo with max_tokens 0, as vLLM: the prompts alone, finished by "length", nothing generated.
  for (const char* key : {"echo_only", "echo_only_stream"}) {
    SCOPED_TRACE(key);
    EXPECT_EQ(r[key]["texts"], json::array({prompt, "Hello world"}));
    EXPECT_EQ(r[key]["finishes"], json::array({"length", "length"}));
    EXPECT_EQ(r[key]["usage"]["completion_tokens"], 0);
    EXPECT_EQ(r[key]["usage"]["prompt_tokens"], prompt_tokens + hello_tokens);
  }
  // echo with logprobs: the prompt's tokens first, the first with null logprob and alternatives,
  // each later one with its own token among its alternatives; streamed as whole.
  const json& echoed = r["echo_logprobs"];
  ASSERT_EQ(echoed["tokens"].size(), prompt_tokens + 2) << echoed.dump();
  EXPECT_TRUE(echoed["token_logprobs"][0].is_null());
  EXPECT_TRUE(echoed["first_top"].is_null());
  ASSERT_TRUE(echoed["token_logprobs"][1].is_number());
  EXPECT_LT(echoed["token_logprobs"][1].get<double>(), 0);
  EXPECT_EQ(echoed["second_top"][echoed["tokens"][1].get<std::string>()],
            echoed["token_logprobs"][1]);
  EXPECT_EQ(r["echo_logprobs_stream"]["tokens"], echoed["tokens"]);
  EXPECT_EQ(r["echo_logprobs_stream"]["token_logprobs"], echoed["token_logprobs"]);
  // vLLM's prompt_logprobs: null, then {id: {logprob, rank, decoded_token}} per prompt token.
  const json& pl = r["prompt_logprobs"];
  ASSERT_EQ(pl.size(), prompt_tokens) << pl.dump();
  EXPECT_TRUE(pl[0].is_null());
  for (size_t p = 1; p < pl.size(); ++p) {
    ASSERT_TRUE(pl[p].is_object() && !pl[p].empty()) << p;
    for (const auto& [id, entry] : pl[p].items()) {
      EXPECT_LE(entry["logprob"].get<double>(), 0) << id;
      EXPECT_GE(entry["rank"].get<int64_t>(), 1) << id;
      EXPECT_TRUE(entry["decoded_token"].is_string()) << id;
    }
  }
  // The prompt's own token is among them, with the logprob echo gave it.
  bool own = false;
  for (const auto& [id, entry] : pl[1].items())
    own = own || (entry["decoded_token"] == echoed["tokens"][1] &&
                  entry["logprob"] == echoed["token_logprobs"][1]);
  EXPECT_TRUE(own) << pl[1].dump();
}

}  // namespace tandem::testing
