#include "text/chat_template.h"

#include "text/jinja/ast.h"
#include "text/jinja/interpreter.h"
#include "text/jinja/value.h"
#include "util/error.h"

namespace tandem::text {
namespace {

const NamedChatTemplate* named(const std::vector<NamedChatTemplate>& templates,
                               const std::string& name) {
  for (const auto& t : templates)
    if (t.name == name) return &t;
  return nullptr;
}

jinja::Body parse(const std::string& source) {
  try {
    return jinja::parse_template(source);
  } catch (const jinja::RuntimeError& e) {
    // Only invalid UTF-8 in the source gets here; everything else already names its line.
    throw Error("chat template: " + e.message);
  }
}

}  // namespace

const NamedChatTemplate* pick_chat_template(const std::vector<NamedChatTemplate>& templates,
                                            bool with_tools) {
  if (with_tools)
    if (const auto* t = named(templates, "tool_use")) return t;
  if (const auto* t = named(templates, "default")) return t;
  return templates.size() == 1 ? &templates[0] : nullptr;
}

struct ChatTemplate::Impl {
  std::vector<NamedChatTemplate> templates;  // all the model has, for pick_chat_template
  struct Parsed {
    std::string name;
    jinja::Body body;
    ContentFormat content_format;
    bool tests_content_for_none;
    bool concatenates_tool_arguments;
  };
  std::vector<Parsed> parsed;  // those a request can select

  const Parsed* pick(bool with_tools) const {
    const NamedChatTemplate* t = pick_chat_template(templates, with_tools);
    if (!t) return nullptr;
    for (const auto& p : parsed)
      if (p.name == t->name) return &p;
    return nullptr;
  }
};

ChatTemplate::ChatTemplate(const std::string& source)
    : ChatTemplate(std::vector<NamedChatTemplate>{{"default", source}}) {}

ChatTemplate::ChatTemplate(const std::vector<NamedChatTemplate>& templates)
    : impl_(std::make_unique<Impl>()) {
  impl_->templates = templates;
  for (bool with_tools : {false, true}) {
    const NamedChatTemplate* t = pick_chat_template(templates, with_tools);
    if (!t) continue;
    bool done = false;
    for (const auto& p : impl_->parsed) done = done || p.name == t->name;
    if (done) continue;
    try {
      jinja::Body body = parse(t->source);
      const ContentFormat format = jinja::detect_content_format(body);
      const bool none = jinja::tests_content_for_none(body);
      const bool concatenates = jinja::concatenates_tool_arguments(body);
      impl_->parsed.push_back({t->name, std::move(body), format, none, concatenates});
    } catch (const Error& e) {
      if (templates.size() == 1) throw;
      throw Error("the '" + t->name + "' " + e.what());
    }
  }
}

ChatTemplate::~ChatTemplate() = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;

std::string ChatTemplate::render(const nlohmann::ordered_json& context) const {
  const bool with_tools =
      context.is_object() && context.contains("tools") && !context["tools"].is_null();
  const NamedChatTemplate* t = pick_chat_template(impl_->templates, with_tools);
  if (!t) {
    std::string names;
    for (const auto& n : impl_->templates) names += (names.empty() ? "'" : ", '") + n.name + "'";
    throw Error("the model has several chat templates (" + names + "), none named 'default'" +
                (with_tools ? " or 'tool_use'" : "") +
                ", so none applies to this request (transformers refuses it too)");
  }
  const Impl::Parsed* parsed = impl_->pick(with_tools);
  if (!parsed) throw Error("chat template '" + t->name + "' was not parsed");  // unreachable
  return jinja::render_template(parsed->body, context);
}

ContentFormat ChatTemplate::content_format(bool with_tools) const {
  const Impl::Parsed* parsed = impl_->pick(with_tools);
  return parsed ? parsed->content_format : ContentFormat::kString;
}

bool ChatTemplate::tests_content_for_none(bool with_tools) const {
  const Impl::Parsed* parsed = impl_->pick(with_tools);
  return parsed && parsed->tests_content_for_none;
}

bool ChatTemplate::concatenates_tool_arguments(bool with_tools) const {
  const Impl::Parsed* parsed = impl_->pick(with_tools);
  return parsed && parsed->concatenates_tool_arguments;
}

}  // namespace tandem::text
