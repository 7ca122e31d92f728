// A model's generation config as vLLM reads it for serving: the published DeepSeek-V3 and
// Qwen3-30B-A3B generation_config.json files (as their Hugging Face repositories ship them),
// config.json when there is none, transformers' defaults dropped as its to_diff_dict drops them,
// --override-generation-config, and errors that name the file and the field.
#include "model/generation_config.h"

#include <fstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "text/oracle_support.h"
#include "util/error.h"

namespace tandem::model {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using json = nlohmann::json;

// A folder holding these files (name, text).
std::filesystem::path folder(const std::vector<std::pair<std::string, std::string>>& files) {
  const auto dir = test::scratch_path("generation-config", "");
  std::filesystem::create_directories(dir);
  for (const auto& [name, text] : files) std::ofstream(dir / name) << text;
  return dir;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(GenerationConfig, DeepSeekV3sPublishedFileSetsTemperatureAndTopP) {
  const auto dir = folder({{"generation_config.json", R"({
  "_from_model_config": true,
  "bos_token_id": 0,
  "eos_token_id": 1,
  "do_sample": true,
  "temperature": 0.6,
  "top_p": 0.95,
  "transformers_version": "4.46.3"
})"},
                           {"config.json", R"({"eos_token_id": 7, "temperature": 0.1})"}});
  const GenerationConfig c = read_generation_config(dir);
  EXPECT_EQ(c.temperature, 0.6);
  EXPECT_EQ(c.top_p, 0.95);
  EXPECT_FALSE(c.top_k);
  EXPECT_FALSE(c.min_p);
  EXPECT_FALSE(c.repetition_penalty);
  EXPECT_FALSE(c.max_new_tokens);
  EXPECT_EQ(c.eos_token_ids, std::vector<int32_t>{1});  // generation_config.json's alone
  EXPECT_EQ(c.origin, (dir / "generation_config.json").string());
}

TEST(GenerationConfig, Qwen3sPublishedFileListsTwoEosIdsAndTopK) {
  const auto dir = folder({{"generation_config.json", R"({
  "bos_token_id": 151643,
  "do_sample": true,
  "eos_token_id": [
    151645,
    151643
  ],
  "pad_token_id": 151643,
  "temperature": 0.6,
  "top_k": 20,
  "top_p": 0.95,
  "transformers_version": "4.51.0"
})"}});
  const GenerationConfig c = read_generation_config(dir);
  EXPECT_EQ(c.temperature, 0.6);
  EXPECT_EQ(c.top_k, 20);
  EXPECT_EQ(c.top_p, 0.95);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int32_t>{151645, 151643}));
}

// transformers' GenerationConfig.from_model_config, which vLLM falls back to.
TEST(GenerationConfig, WithoutTheFileConfigJsonIsRead) {
  const auto dir = folder({{"config.json", R"({"eos_token_id": 2, "repetition_penalty": 1.1,
                                               "hidden_size": 64})"}});
  const GenerationConfig c = read_generation_config(dir);
  EXPECT_EQ(c.eos_token_ids, std::vector<int32_t>{2});
  EXPECT_EQ(c.repetition_penalty, 1.1);
  EXPECT_EQ(c.origin, (dir / "config.json").string());
  EXPECT_TRUE(read_generation_config(folder({})).origin.empty());
}

// vLLM reads the file through GenerationConfig.to_diff_dict, which leaves out what equals
// transformers' defaults: top_k 50 is no default there (its sampler's top_k stays off).
TEST(GenerationConfig, ValuesEqualToTransformersDefaultsAndNullsAreNoDefaults) {
  const GenerationConfig c = read_generation_config(folder({{"generation_config.json", R"({
    "top_k": 50, "temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.0,
    "min_p": null, "max_new_tokens": 512})"}}));
  EXPECT_FALSE(c.top_k);
  EXPECT_FALSE(c.temperature);
  EXPECT_FALSE(c.top_p);
  EXPECT_FALSE(c.repetition_penalty);
  EXPECT_FALSE(c.min_p);
  EXPECT_EQ(c.max_new_tokens, 512);
}

TEST(GenerationConfig, OverridesApplyOverTheFileAndAreTakenAsGiven) {
  GenerationConfig c = read_generation_config(
      folder({{"generation_config.json", R"({"temperature": 0.6, "top_p": 0.95})"}}));
  override_generation_config(c, json::parse(R"({"temperature": 0.2, "top_k": 50})"), "--flag");
  EXPECT_EQ(c.temperature, 0.2);
  EXPECT_EQ(c.top_p, 0.95);
  EXPECT_EQ(c.top_k, 50);  // vLLM updates with the overrides after the diff
  override_generation_config(c, json::parse(R"({"top_p": null})"), "--flag");
  EXPECT_FALSE(c.top_p);  // a null unsets the key, as vLLM keeps only what is not None
  EXPECT_EQ(c.temperature, 0.2);
}

TEST(GenerationConfig, MalformedFieldsAreErrorsNamingTheFileAndTheField) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"temperature": "hot"})", "field 'temperature' must be a number"},
      {R"({"top_k": 2.5})", "field 'top_k' must be an integer"},
      {R"({"eos_token_id": [1, "x"]})", "field 'eos_token_id' must be an integer"},
      {R"({"eos_token_id": -3})", "field 'eos_token_id' must hold token ids >= 0"},
      {R"({"eos_token_id": 99999999999})", "field 'eos_token_id' is 99999999999, above"},
      {R"([1, 2])", "expected a JSON object"},
      {R"({"temperature": )", "generation_config.json"},
  };
  for (const auto& [text, expected] : cases) {
    const auto dir = folder({{"generation_config.json", text}});
    EXPECT_THAT(error_of([&] { read_generation_config(dir); }),
                AllOf(HasSubstr((dir / "generation_config.json").string()), HasSubstr(expected)))
        << text;
  }
  GenerationConfig c;
  EXPECT_THAT(error_of([&] {
                override_generation_config(c, json::parse(R"({"temprature": 0.5})"), "--flag");
              }),
              AllOf(HasSubstr("--flag: field 'temprature' is not a generation setting"),
                    HasSubstr("temperature")));
  EXPECT_THAT(error_of([&] { override_generation_config(c, json::array(), "--flag"); }),
              HasSubstr("--flag: expected a JSON object"));
}

}  // namespace
}  // namespace tandem::model
