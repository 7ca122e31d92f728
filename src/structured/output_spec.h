#pragma once
// What a request asks its answer to be (OpenAI's response_format, vLLM's guided_* and
// structured_outputs, SGLang's json_schema/regex), and its compilation into a grammar over bytes.
#include <memory>
#include <string>

#include "structured/grammar.h"

namespace tandem::structured {

struct OutputSpec {
  enum class Kind { kJsonObject, kJsonSchema, kRegex, kChoice, kToolCalls };
  Kind kind = Kind::kJsonObject;
  // kJsonSchema: the schema as JSON text; kRegex: the pattern; kChoice: a JSON list of strings;
  // kToolCalls: the markup and functions of forced tool calls (structured/tool_call_grammar.h).
  std::string text;
  // The request field it came from, for errors and logs.
  std::string field;
  // Its grammar, compiled where the request was parsed (off the engine's thread, which only looks
  // it up or takes this); null: the engine compiles it.
  std::shared_ptr<const Grammar> compiled = nullptr;
  // kJsonSchema: vLLM's disable_additional_properties (structured/json_schema.h).
  bool disable_additional_properties = false;

  // One string per distinct spec: the cache key of its grammar.
  std::string key() const;
};

// The grammar of answers that satisfy `spec`. Throws tandem::Error saying what is not supported
// or malformed (a schema keyword, a regex construct), for a 400 that names spec.field.
std::shared_ptr<const Grammar> compile(const OutputSpec& spec);

}  // namespace tandem::structured
