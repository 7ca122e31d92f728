#pragma once
// Answers real models wrote with tool calls, as their users posted them (the source of each is
// named), with what they mean: the content and the calls (name, JSON arguments).
#include <string>
#include <utility>
#include <vector>

#include "api/tool_calls.h"

namespace tandem::api::testing {

struct ToolCallRecording {
  const char* model;
  const char* source;  // where the output was posted
  ToolCallFormat format;
  std::string output;
  std::string content;
  std::vector<std::pair<std::string, std::string>> calls;
};

inline const std::vector<ToolCallRecording> kToolCallRecordings = {};

}  // namespace tandem::api::testing
