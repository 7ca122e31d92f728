#pragma once
// A chat request's messages in the shape its chat template reads them.
#include <nlohmann/json.hpp>

#include "text/chat_template.h"

namespace tandem::api {

// Each message as sent, with its content given in `format`, as vLLM gives it:
//  - kString: text parts joined with "\n" into one string (templates that print content).
//  - kOpenAI: a list of {"type": "text", "text": ...} parts, a string content becoming one part
//    and a null one none (templates that loop over content, e.g. multimodal ones). A tool
//    message's content is one string still (its texts joined): tool branches print it.
// A null content stays null in the string format, as transformers and SGLang pass it (vLLM
// passes "", which DeepSeek-V3's template takes for a message without tool calls). Throws
// ApiError naming `messages` for a message without a string role or with content other than a
// string, null or a list of text parts.
nlohmann::ordered_json template_messages(const nlohmann::json& messages,
                                         text::ContentFormat format);

}  // namespace tandem::api
