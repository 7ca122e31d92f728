#include "text/chat_template.h"

#include "text/jinja/ast.h"
#include "text/jinja/interpreter.h"
#include "text/jinja/value.h"
#include "util/error.h"

namespace tandem::text {

struct ChatTemplate::Impl {
  jinja::Body body;
};

ChatTemplate::ChatTemplate(const std::string& source) : impl_(std::make_unique<Impl>()) {
  try {
    impl_->body = jinja::parse_template(source);
  } catch (const jinja::RuntimeError& e) {
    // Only invalid UTF-8 in the source gets here; everything else already names its line.
    throw Error("chat template: " + e.message);
  }
}

ChatTemplate::~ChatTemplate() = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;

std::string ChatTemplate::render(const nlohmann::ordered_json& context) const {
  return jinja::render_template(impl_->body, context);
}

}  // namespace tandem::text
