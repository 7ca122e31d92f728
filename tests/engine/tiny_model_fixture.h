#pragma once
// A test suite over one tiny-v3 checkpoint written by `tandem make-model` (in the given dtype)
// before the suite's first test, loaded once, and removed after its last test.
#include <filesystem>
#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "model/deepseek.h"
#include "text/oracle_support.h"
#include "text/tokenizer.h"

namespace tandem::test {

template <const char* Dtype>
class TinyModelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<std::filesystem::path>(
        temp_path(std::string("tiny-model-") + Dtype).replace_extension());
    const std::string cmd = std::string(TANDEM_BINARY) + " make-model --preset tiny-v3 --dtype " +
                            Dtype + " --out " + quote(*dir_) + " >/dev/null 2>&1";
    ASSERT_EQ(run_command(cmd), 0);
    model_ = std::make_unique<model::DeepSeekModel>(model::DeepSeekModel::load(*dir_));
    tok_ = std::make_unique<text::Tokenizer>(text::Tokenizer::from_dir(*dir_));
  }
  static void TearDownTestSuite() {
    model_.reset();
    tok_.reset();
    std::filesystem::remove_all(*dir_);
    dir_.reset();
  }

  inline static std::unique_ptr<std::filesystem::path> dir_;
  inline static std::unique_ptr<model::DeepSeekModel> model_;
  inline static std::unique_ptr<text::Tokenizer> tok_;
};

}  // namespace tandem::test
