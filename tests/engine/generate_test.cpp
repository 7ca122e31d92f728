// The generate loop end to end on a tiny-v3 checkpoint: sampled ids always have text (the LM
// head is padded past the tokenizer), stop strings cut the text and the stream, max_tokens ends
// the run, and the streamed pieces add up to the result.
#include "engine/generate.h"

#include <algorithm>
#include <filesystem>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "engine/tiny_model_fixture.h"
#include "util/file.h"

namespace tandem::engine {
namespace {

constexpr char kBf16[] = "bf16";
using Generate = test::TinyModelTest<kBf16>;

TEST_F(Generate, SampledIdsAlwaysHaveText) {
  // At a high temperature the draw is close to uniform over 129280 rows, of which 465 past the
  // tokenizer's 128815 ids have no text; 1000 draws would hit one with probability ~97%.
  SamplingParams p;
  p.temperature = 50;
  p.max_tokens = 1000;
  p.seed = 5;
  p.ignore_eos = true;
  auto r = generate(*model_, *tok_, tok_->encode("hello", true), p);
  ASSERT_EQ(r.tokens.size(), 1000u);
  for (auto id : r.tokens) ASSERT_TRUE(tok_->id_to_token(id).has_value()) << id;
  EXPECT_EQ(r.finish_reason, "length");
}

TEST_F(Generate, StreamAddsUpAndStopStringsCut) {
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = 40;
  p.ignore_eos = true;
  const auto prompt = tok_->encode("The quick brown fox", true);
  auto full = generate(*model_, *tok_, prompt, p);
  ASSERT_GE(full.text.size(), 6u);
  // Stop on a string from the middle of the greedy text: the result ends right before it.
  const std::string stop = full.text.substr(full.text.size() / 2, 3);
  p.stop = {stop};
  std::string streamed;
  auto cut = generate(*model_, *tok_, prompt, p, [&](std::string_view s) { streamed += s; });
  EXPECT_EQ(cut.finish_reason, "stop");
  EXPECT_EQ(cut.text, full.text.substr(0, full.text.find(stop)));
  EXPECT_EQ(streamed, cut.text);
}

// min_tokens: a stop string in the text of the first min_tokens tokens does not end the answer;
// one after it does.
TEST_F(Generate, MinTokensHoldsStopStringsOff) {
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = 40;
  p.ignore_eos = true;
  const auto prompt = tok_->encode("The quick brown fox", true);
  const auto full = generate(*model_, *tok_, prompt, p);
  p.max_tokens = 10;
  const auto first10 = generate(*model_, *tok_, prompt, p);
  ASSERT_GE(first10.text.size(), 4u);
  const std::string stop = first10.text.substr(0, 2);
  p.max_tokens = 40;
  p.stop = {stop};
  EXPECT_EQ(generate(*model_, *tok_, prompt, p).text, "");  // without min_tokens: cut at once
  p.min_tokens = 10;
  const auto held = generate(*model_, *tok_, prompt, p);
  const size_t hit = full.text.find(stop, first10.text.size() - (stop.size() - 1));
  EXPECT_EQ(held.text, hit == std::string::npos ? full.text : full.text.substr(0, hit));
  EXPECT_EQ(held.finish_reason, hit == std::string::npos ? "length" : "stop");
  EXPECT_GE(held.text.size(), first10.text.size() - (stop.size() - 1));
}

// config.json's eos_token_id may list several ids (transformers' Union[int, List[int]]): each
// of them ends the answer, the last as much as the first.
TEST_F(Generate, EveryEosIdTheConfigListsEndsTheAnswer) {
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = 8;
  p.ignore_eos = true;
  const auto prompt = tok_->encode("The quick brown fox", true);
  const auto full = generate(*model_, *tok_, prompt, p);
  ASSERT_GE(full.tokens.size(), 3u);
  const std::vector<int64_t> eos = {model_->config().eos_token_ids.at(0), full.tokens[2]};
  const auto ends =
      std::find_first_of(full.tokens.begin(), full.tokens.end(), eos.begin(), eos.end());
  ASSERT_EQ(*ends, full.tokens[2]);  // the listed id, not the first, ends it

  const auto dir = test::temp_path("generate-eos-list").replace_extension();
  std::filesystem::copy(*dir_, dir, std::filesystem::copy_options::recursive);
  auto config = nlohmann::json::parse(read_file(dir / "config.json"));
  config["eos_token_id"] = eos;
  write_file_atomically(dir / "config.json", config.dump());
  const auto listed = model::DeepSeekModel::load(dir);
  p.ignore_eos = false;
  const auto r = generate(listed, *tok_, prompt, p);
  std::filesystem::remove_all(dir);
  EXPECT_EQ(r.tokens, std::vector<int32_t>(full.tokens.begin(), ends + 1));
  EXPECT_EQ(r.finish_reason, "stop");
}

// What `tandem generate` printed: the answer (stdout) and the line of statistics (stderr).
struct Printed {
  std::string text, stats;
};

Printed tandem_generate(const std::filesystem::path& model, const std::string& args) {
  const auto out = test::temp_path("generate-stdout"), err = test::temp_path("generate-stderr");
  const int rc = test::run_command(std::string(TANDEM_BINARY) + " generate --model " +
                                   test::quote(model) + " --prompt 'The quick brown fox' " + args +
                                   " >" + test::quote(out) + " 2>" + test::quote(err));
  Printed p{read_file(out), read_file(err)};
  std::filesystem::remove(out);
  std::filesystem::remove(err);
  EXPECT_EQ(rc, 0) << p.stats;
  return p;
}

// tandem generate takes the checkpoint's generation_config.json as the engine does (vLLM's
// --generation-config auto): its sampling defaults where no flag is given and its eos_token_id
// ends the answer. It sampled at temperature 1 and stopped on config.json's EOS only, so the same
// checkpoint answered differently from `tandem generate` and from the engine.
TEST_F(Generate, TheCommandTakesTheGenerationConfigAsTheEngineDoes) {
  SamplingParams greedy;
  greedy.temperature = 0;
  greedy.max_tokens = 8;
  greedy.ignore_eos = true;
  const auto prompt = tok_->encode("The quick brown fox", true);
  const auto full = generate(*model_, *tok_, prompt, greedy);
  ASSERT_EQ(full.tokens.size(), 8u);
  size_t k = 2;  // the first id from the third on that did not come before it
  while (k < full.tokens.size() && std::find(full.tokens.begin(), full.tokens.begin() + k,
                                             full.tokens[k]) != full.tokens.begin() + k)
    ++k;
  ASSERT_LT(k, full.tokens.size());
  const std::vector<int32_t> eos = {static_cast<int32_t>(model_->config().eos_token_ids.at(0)),
                                    full.tokens[k]};
  greedy.ignore_eos = false;
  const auto expected = generate(*model_, *tok_, prompt, greedy, {}, eos);
  ASSERT_EQ(expected.tokens.size(), k + 1);
  ASSERT_EQ(expected.finish_reason, "stop");

  const auto dir = test::temp_path("generate-generation-config").replace_extension();
  std::filesystem::copy(*dir_, dir, std::filesystem::copy_options::recursive);
  write_file_atomically(dir / "generation_config.json",
                        nlohmann::json{{"temperature", 0.0}, {"eos_token_id", eos}}.dump());
  const Printed configured = tandem_generate(dir, "--max-tokens 8");
  EXPECT_EQ(configured.text, expected.text + "\n");
  EXPECT_NE(configured.stats.find("finish: stop;"), std::string::npos) << configured.stats;
  EXPECT_NE(configured.stats.find("decode: " + std::to_string(k + 1) + " tokens"),
            std::string::npos)
      << configured.stats;
  EXPECT_NE(configured.stats.find("temperature 0.0"), std::string::npos) << configured.stats;

  // A flag wins over the config; --generation-config vllm takes vLLM's neutral defaults (EOS ids
  // still the model's): both sample at temperature 1 as a checkpoint without the file does.
  write_file_atomically(dir / "generation_config.json",
                        nlohmann::json{{"temperature", 0.0}, {"top_k", 1}}.dump());
  std::filesystem::copy(*dir_, dir.string() + "-none", std::filesystem::copy_options::recursive);
  std::filesystem::remove(dir.string() + "-none/generation_config.json");
  const std::string sampled = "--max-tokens 12 --ignore-eos --seed 7";
  const Printed neutral = tandem_generate(dir.string() + "-none", sampled);
  EXPECT_EQ(tandem_generate(dir, sampled + " --temperature 1 --top-k 0").text, neutral.text);
  EXPECT_EQ(tandem_generate(dir, sampled + " --generation-config vllm").text, neutral.text);
  const Printed from_config = tandem_generate(dir, sampled);  // greedy, as the config says
  EXPECT_EQ(from_config.text, tandem_generate(dir, sampled + " --temperature 0").text);
  EXPECT_NE(from_config.text, neutral.text);

  // max_new_tokens is the length when --max-tokens is not given.
  write_file_atomically(dir / "generation_config.json",
                        nlohmann::json{{"temperature", 0.0}, {"max_new_tokens", 3}}.dump());
  const Printed capped = tandem_generate(dir, "--ignore-eos");
  EXPECT_NE(capped.stats.find("finish: length; prefill: "), std::string::npos) << capped.stats;
  EXPECT_NE(capped.stats.find("decode: 3 tokens"), std::string::npos) << capped.stats;
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(dir.string() + "-none");
}

}  // namespace
}  // namespace tandem::engine
