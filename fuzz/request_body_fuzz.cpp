// Fuzzes the request-body contract parser (api/request.h) as the engine's generation API and the
// gateway's tokens-in path run it on a client's body: the untrusted-JSON reader, then
// parse_completion, parse_chat (with the DeepSeek-V3 chat template) or parse_generate, chosen by
// the first input byte, with the real DeepSeek-V3 tokenizer. The documented errors are ApiError
// (a bad field) and tandem::Error (malformed JSON, a template error); anything else escaping is a
// finding.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include <nlohmann/json.hpp>

#include "api/request.h"
#include "fuzz_tokenizer.h"
#include "text/chat_template.h"
#include "util/error.h"
#include "util/json.h"

namespace {

const tandem::text::ChatTemplate* chat_template() {
  static const std::optional<tandem::text::ChatTemplate> t =
      tandem::fuzz::tokenizer().chat_template().empty()
          ? std::nullopt
          : std::optional<tandem::text::ChatTemplate>(tandem::fuzz::tokenizer().chat_template());
  return t ? &*t : nullptr;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)chat_template();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  using namespace tandem::api;
  const ModelLimits limits{"fuzz", 4096, 129280};
  const auto& tok = tandem::fuzz::tokenizer();
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  nlohmann::json body;
  const tandem::ReleaseJsonOnExit release{body};
  try {
    body = tandem::parse_untrusted_json(text);
    switch (data[0] % 3) {
      case 0:
        (void)parse_completion(body, tok, limits);
        break;
      case 1:
        (void)parse_chat(body, tok, chat_template(), limits);
        break;
      default:
        (void)parse_generate(body, tok, limits);
        break;
    }
  } catch (const ApiError&) {
  } catch (const tandem::Error&) {
  }
  return 0;
}
