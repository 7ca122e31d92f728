#pragma once
// Tokenizer for Jinja2 template source, following jinja2.lexer with the settings transformers
// uses (trim_blocks, lstrip_blocks, default delimiters, keep_trailing_newline=False).
#include <string>
#include <vector>

namespace tandem::text::jinja {

enum class TokenType {
  kData,           // literal template text
  kVariableBegin,  // {{
  kVariableEnd,    // }}
  kBlockBegin,     // {%
  kBlockEnd,       // %}
  kName,
  kString,  // value holds the unescaped text
  kInteger,
  kFloat,
  kOperator,  // value holds the operator text
  kEnd,
};

struct Token {
  TokenType type;
  std::string value;
  int line;
};

// Throws tandem::Error naming the line on a lexical error.
std::vector<Token> tokenize(const std::string& source);

// Formats "chat template line N: message".
std::string line_message(int line, const std::string& message);

}  // namespace tandem::text::jinja
