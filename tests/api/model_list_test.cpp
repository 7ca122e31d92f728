// GET /v1/models, which our engines and the gateway write and the gateway reads for the engines'
// longest sequence: what we write reads back, lists as vLLM and SGLang write them are read, and
// anything else says nothing rather than a wrong length.
#include "api/model_list.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

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

// GET /v1/models/{id} answers the model object alone, at the id as it is and, for a name with a
// character encodeURIComponent escapes ('/' in "Qwen/Qwen3-8B"), at the escaped path the openai
// client sends too.
TEST(ModelList, OneModelIsRetrievedAtItsIdAsItIsAndEncoded) {
  const json m = json::parse(model_json({"Qwen/Qwen3-8B", 1700000000, 4096}));
  EXPECT_EQ(m["id"], "Qwen/Qwen3-8B");
  EXPECT_EQ(m["object"], "model");
  EXPECT_EQ(m["max_model_len"], 4096);
  EXPECT_EQ(m, json::parse(model_list_json({"Qwen/Qwen3-8B", 1700000000, 4096}))["data"][0]);
  EXPECT_EQ(model_paths("Qwen/Qwen3-8B"),
            (std::vector<std::string>{"/v1/models/Qwen/Qwen3-8B", "/v1/models/Qwen%2FQwen3-8B"}));
  EXPECT_EQ(model_paths("deepseek-v3"), std::vector<std::string>{"/v1/models/deepseek-v3"});
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
