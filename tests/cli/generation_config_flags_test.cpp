// --generation-config and --override-generation-config as an engine reads them: the sampling
// defaults that apply, and every refusal in the form of a config field's message
// ("<origin>: field '<name>' <what>", util/json_fields.h) naming where the value came from.
#include "cli/generation_config_flags.h"

#include <fstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "model/model_test_support.h"
#include "util/error.h"

namespace tandem::cli {
namespace {

class GenerationConfigFlagsTest : public ::testing::Test {
 protected:
  // A folder holding generation_config.json with `text`; its path as messages name it.
  std::string folder_with(const std::string& text) {
    std::ofstream(dir_ / "generation_config.json") << text;
    return dir_.path().string();
  }
  std::string file() const { return (dir_ / "generation_config.json").string(); }

  static std::string error(const GenerationConfigFlags& flags, const std::string& model_dir = "") {
    try {
      load_generation_config(flags, model_dir);
    } catch (const Error& e) {
      return e.what();
    }
    return "(no error)";
  }

  test::TempDir dir_{"generation-config-flags"};
};

TEST_F(GenerationConfigFlagsTest, TheDefaultsThatApplyComeFromTheFolderAndTheOverride) {
  const std::string folder = folder_with(R"({"temperature": 0.6, "top_p": 0.95, "top_k": 20})");
  const EngineGenerationConfig c =
      load_generation_config({folder, R"({"temperature": 0.3, "max_new_tokens": 64})"}, "");
  EXPECT_EQ(c.sampling.temperature, 0.3);
  EXPECT_EQ(c.sampling.top_p, 0.95);
  EXPECT_EQ(c.sampling.top_k, 20);
  EXPECT_EQ(c.sampling.max_tokens, 64);
  EXPECT_EQ(c.sampling.max_tokens_cap, 64);
  EXPECT_THAT(c.note, ::testing::HasSubstr(file() + " and --override-generation-config"));
}

TEST_F(GenerationConfigFlagsTest, ADefaultOutOfRangeIsRefusedInTheFieldFormNamingItsOrigin) {
  EXPECT_EQ(error({folder_with(R"({"top_p": 2})"), ""}),
            file() + ": field 'top_p' must be in (0, 1], got 2");
  EXPECT_EQ(error({folder_with(R"({"repetition_penalty": 0})"), ""}),
            file() + ": field 'repetition_penalty' must be > 0, got 0");
  EXPECT_EQ(error({folder_with(R"({"max_new_tokens": 0})"), ""}),
            file() + ": field 'max_new_tokens' must be at least 1, got 0");
  EXPECT_EQ(error({"vllm", R"({"temperature": -1})"}),
            "--override-generation-config: field 'temperature' must be >= 0, got -1");
  EXPECT_EQ(error({"vllm", R"({"min_p": 1.5})"}),
            "--override-generation-config: field 'min_p' must be in [0, 1], got 1.5");
  // A value merged from the file and the override is named by both.
  EXPECT_EQ(error({folder_with(R"({"temperature": 0.5})"), R"({"top_k": -5})"}),
            file() +
                " and --override-generation-config: field 'top_k' must be -1, 0 (off) or "
                "positive, got -5");
}

// Only the defaults that apply are checked: a file's value that the override replaces, or that
// vllm drops, is never used.
TEST_F(GenerationConfigFlagsTest, AFileValueThatDoesNotApplyIsNotChecked) {
  const std::string folder = folder_with(R"({"top_p": 2, "max_new_tokens": 0})");
  EXPECT_EQ(error({folder, R"({"top_p": 0.5, "max_new_tokens": 8})"}), "(no error)");
  EXPECT_EQ(error({"vllm", ""}, folder), "(no error)");
  EXPECT_EQ(error({"auto", ""}, folder),
            file() + ": field 'max_new_tokens' must be at least 1, got 0");
}

}  // namespace
}  // namespace tandem::cli
