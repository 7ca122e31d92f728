// GET /v1/models, which our engines and the gateway write and the gateway reads for the engines'
// longest sequence: what we write reads back, lists as vLLM and SGLang write them are read, and
// anything else says nothing rather than a wrong length.
#include "api/model_list.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "api/error.h"
#include "net/http.h"

namespace tandem::api {
namespace {

using nlohmann::json;

TEST(ModelList, WhatAnEngineWritesReadsBack) {
  const json list = json::parse(model_list_json({"deepseek-v3", 1700000000, 2048}));
  EXPECT_EQ(list["object"], "list");
  ASSERT_EQ(list["data"].size(), 1u);
  EXPECT_EQ(list["data"][0]["id"], "deepseek-v3");
  EXPECT_EQ(list["data"][0]["object"], "model");
  EXPECT_EQ(list["data"][0]["created"], 1700000000);
  EXPECT_EQ(max_model_len_of(list.dump()), 2048);
  // Without a length the field is left out, and nothing is read back.
  const json unsaid = json::parse(model_list_json({"m", 1, 0}));
  EXPECT_FALSE(unsaid["data"][0].contains("max_model_len"));
  EXPECT_EQ(max_model_len_of(unsaid.dump()), std::nullopt);
}

// GET /v1/models/{id} answers the model object alone, at the id as it is and percent-encoded: the
// openai Python client sends "Qwen/Qwen3-8B" as it is, its Node client as Qwen%2FQwen3-8B.
TEST(ModelList, OneModelIsRetrievedAtItsIdAsItIsAndEncoded) {
  const json m = json::parse(model_json({"Qwen/Qwen3-8B", 1700000000, 4096}));
  EXPECT_EQ(m["id"], "Qwen/Qwen3-8B");
  EXPECT_EQ(m["object"], "model");
  EXPECT_EQ(m["max_model_len"], 4096);
  EXPECT_EQ(m, json::parse(model_list_json({"Qwen/Qwen3-8B", 1700000000, 4096}))["data"][0]);
  for (const char* path : {"/v1/models/Qwen/Qwen3-8B", "/v1/models/Qwen%2FQwen3-8B",
                           "/v1/models/Qwen%2fQwen3-8B", "/v1/models/Qwen%2FQwen3%2D8B"}) {
    const net::HttpResponse r = model_retrieval(path, {"Qwen/Qwen3-8B", 1700000000, 4096});
    EXPECT_EQ(r.status, 200) << path << ": " << r.body;
    EXPECT_EQ(json::parse(r.body), m) << path;
  }
}

// The id is decoded once, as servers read a path parameter: a lower-case escape or one of a
// character encodeURIComponent keeps (Python's quote(safe="") escapes ':') names the model too,
// and "%2541" is "%41", not "A". Only the model's id answers 200; another is model_not_found
// naming it as decoded.
TEST(ModelList, TheRetrievedIdIsThePathPercentDecodedOnce) {
  EXPECT_EQ(retrieved_model_id("/v1/models/deepseek-ai/DeepSeek-V3"), "deepseek-ai/DeepSeek-V3");
  EXPECT_EQ(retrieved_model_id("/v1/models/deepseek-ai%2FDeepSeek-V3"), "deepseek-ai/DeepSeek-V3");
  EXPECT_EQ(retrieved_model_id("/v1/models/sim%3atiny"), "sim:tiny");
  EXPECT_EQ(retrieved_model_id("/v1/models/a%2541"), "a%41");
  EXPECT_EQ(retrieved_model_id("/v1/models/a%zz%4"), "a%zz%4");  // malformed: kept as sent
  EXPECT_EQ(retrieved_model_id("/v1/models/v1.5/..."), "v1.5/...");
  EXPECT_EQ(model_retrieval("/v1/models/sim%3atiny", {"sim:tiny", 1, 0}).status, 200);
  EXPECT_EQ(model_retrieval("/v1/models/a%2541", {"aA", 1, 0}).status, 404);
  const net::HttpResponse other = model_retrieval("/v1/models/Qwen%2FOther", {"Qwen/Q", 1, 0});
  EXPECT_EQ(other.status, 404);
  EXPECT_EQ(openai_error_code(other.body), "model_not_found") << other.body;
  EXPECT_EQ(openai_error_message(other.body), "The model `Qwen/Other` does not exist.");
}

// A "." or ".." segment is for relaying alone: a proxy or engine on the way would resolve
// /v1/models/../completions into another route, so the gateway relays no such id. A server
// answers its own model's id whatever it is: `tandem engine --model ./Qwen3-8B` serves
// "./Qwen3-8B", which the Node client sends as .%2FQwen3-8B; another id with a dot segment is
// model_not_found, as any other.
TEST(ModelList, AnIdWithADotSegmentIsNotRelayedButAServedIdAnswersAsItIs) {
  for (const char* path :
       {"/v1/models/..", "/v1/models/.", "/v1/models/../completions", "/v1/models/Qwen/./Qwen3-8B",
        "/v1/models/Qwen/..", "/v1/models/Qwen%2F..%2Fx", "/v1/models/%2E%2E",
        "/v1/models/.%2FQwen3-8B"}) {
    const std::string id = retrieved_model_id(path);
    EXPECT_TRUE(has_dot_segment(id)) << path;
    EXPECT_EQ(model_retrieval(path, {id, 1, 0}).status, 200) << path;
    const net::HttpResponse r = model_retrieval(path, {"Qwen/Qwen3-8B", 1, 0});
    EXPECT_EQ(r.status, 404) << path;
    EXPECT_EQ(openai_error_code(r.body), "model_not_found") << path << ": " << r.body;
  }
  EXPECT_EQ(retrieved_model_id("/v1/models/.%2FQwen3-8B"), "./Qwen3-8B");
  const json m = json::parse(model_retrieval("/v1/models/.%2FQwen3-8B", {"./Qwen3-8B", 1, 0}).body);
  EXPECT_EQ(m["id"], "./Qwen3-8B");
  for (const char* id : {"deepseek-ai/DeepSeek-V3", "v1.5/...", ".hidden/m", "m/..x", "a./b"})
    EXPECT_FALSE(has_dot_segment(id)) << id;
  // Only ".." climbs out of /v1/models/.
  for (const char* id : {"..", "x/../y", "../Qwen3-8B", "x/.."})
    EXPECT_TRUE(has_parent_segment(id));
  for (const char* id : {".", "./Qwen3-8B", "x/./y", "v1.5/...", "m/..x"})
    EXPECT_FALSE(has_parent_segment(id)) << id;
}

// A model name that is no UTF-8 (refused at startup, but the list must not depend on that) is
// written with U+FFFD for its bad bytes, as the completion path writes text, not thrown as a 500.
TEST(ModelList, AModelNameThatIsNoUtf8IsWrittenWithReplacements) {
  const json list = json::parse(model_list_json({"m\xff", 1, 0}));
  EXPECT_EQ(list["data"][0]["id"], "m\xef\xbf\xbd");
  EXPECT_EQ(list["data"][0]["root"], "m\xef\xbf\xbd");
  EXPECT_EQ(first_model_id(list.dump()), "m\xef\xbf\xbd");
}

TEST(ModelList, ReadsVllmsAndSglangsLists) {
  // vLLM's ModelCard: root, parent and a permission list beside max_model_len.
  const char* vllm = R"({"object":"list","data":[{"id":"Qwen/Qwen3-8B","object":"model",
    "created":1733000000,"owned_by":"vllm","root":"Qwen/Qwen3-8B","parent":null,
    "max_model_len":8192,"permission":[{"id":"modelperm-1","object":"model_permission",
    "created":1733000000,"allow_create_engine":false,"allow_sampling":true,
    "allow_logprobs":true,"allow_search_indices":false,"allow_view":true,
    "allow_fine_tuning":false,"organization":"*","group":null,"is_blocking":false}]}]})";
  EXPECT_EQ(max_model_len_of(vllm), 8192);
  const char* sglang = R"({"object":"list","data":[{"id":"deepseek-ai/DeepSeek-V3",
    "object":"model","created":1733000000,"owned_by":"sglang",
    "root":"deepseek-ai/DeepSeek-V3","max_model_len":163840}]})";
  EXPECT_EQ(max_model_len_of(sglang), 163840);
  // A base model and a LoRA adapter on it: the least length holds for both.
  const char* several = R"({"object":"list","data":[{"id":"base","max_model_len":4096},
    {"id":"adapter","parent":"base","max_model_len":2048},{"id":"other"}]})";
  EXPECT_EQ(max_model_len_of(several), 2048);
}

TEST(ModelList, AnythingElseSaysNoLength) {
  for (const char* body :
       {"", "not json", "[]", R"({"data":{}})", R"({"object":"list"})", R"({"data":[1,"x",null]})",
        R"({"data":[{"max_model_len":0}]})", R"({"data":[{"max_model_len":-5}]})",
        R"({"data":[{"max_model_len":"4096"}]})", R"({"data":[{"max_model_len":4096.5}]})",
        R"({"data":[{"max_model_len":18446744073709551615}]})"}) {
    EXPECT_EQ(max_model_len_of(body), std::nullopt) << body;
  }
}

}  // namespace
}  // namespace tandem::api
