#pragma once
// Answers real models wrote with tool calls, as their users posted them (the source of each is
// named, and whether it is a log or documentation), with what they mean: the
// content and the calls (name, JSON arguments).
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

inline const std::vector<ToolCallRecording> kToolCallRecordings = {
    {"deepseek-v3 through LiteLLM (a log)",
     "https://github.com/google/adk-python/issues/5024",
     ToolCallFormat::kDeepSeekV3,
     " <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>analysis_input\n```json\n{"
     "\"work_dir_name\":\"bf01a09edc0f4c4ca376bc03d153445b\"}\n```<｜tool▁call▁end｜><"
     "｜tool▁calls▁end｜>",
     "",
     {{"analysis_input", "{\"work_dir_name\":\"bf01a09edc0f4c4ca376bc03d153445b\"}"}}},
    {"DeepSeek-V3 (the run posted in sglang issue 4379, whole in SGLang PR 5224's docstring)",
     "https://github.com/sgl-project/sglang/issues/4379",
     ToolCallFormat::kDeepSeekV3,
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_current_weather\n```"
     "json\n{\"location\": "
     "\"Tokyo\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_current_"
     "weather\n```json\n{\"location\": "
     "\"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
     "<｜end▁of▁sentence｜>",
     {{"get_current_weather", "{\"location\": \"Tokyo\"}"},
      {"get_current_weather", "{\"location\": \"Paris\"}"}}},
    {"DeepSeek-V3-0324 degenerate output, the posted prefix (a log)",
     "https://github.com/sgl-project/sglang/pull/5224",
     ToolCallFormat::kDeepSeekV3,
     "<｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><"
     "｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><"
     "｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><"
     "｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><"
     "｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><"
     "｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><"
     "｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><"
     "｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜>MMMM",
     "<｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><"
     "｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><"
     "｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><"
     "｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><"
     "｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><"
     "｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><"
     "｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><"
     "｜tool▁calls▁begin｜><｜tool▁calls▁begin｜><｜tool▁calls▁begin｜>MMMM",
     {}},
    {"qwen/qwen3-4b in LM Studio (a log)",
     "https://github.com/lmstudio-ai/lmstudio-bug-tracker/issues/825",
     ToolCallFormat::kHermes,
     "<think>\n\n</think>\n\n<tool_call>\n{\"name\": \"search_products\", \"arguments\": "
     "{\"query\": \"Dell\", \"category\": \"electronics\", \"max_price\": 50}}\n</tool_call>",
     "<think>\n\n</think>\n\n",  // the text before the call as written (vLLM's content)
     {{"search_products",
       "{\"query\": \"Dell\", \"category\": \"electronics\", \"max_price\": 50}"}}},
    {"qwen3-30b-a3b-instruct-2507 in llama-box (a log)",
     "https://github.com/gpustack/llama-box/issues/61",
     ToolCallFormat::kHermes,
     "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": "
     "\"Paris\"}}\n</tool_call>",
     "",
     {{"get_weather", "{\"location\": \"Paris\"}"}}},
    {"Qwen3-Coder-30B-A3B with a hermes template (a log)",
     "https://github.com/gpustack/gpustack/issues/2660",
     ToolCallFormat::kHermes,
     "<tool_call>\n{\"name\": \"square_the_number\", \"arguments\": {\"input_num\": "
     "1024}}\n</tool_call>",
     "",
     {{"square_the_number", "{\"input_num\": 1024}"}}},
    {"Qwen2.5-7B-Instruct (Qwen's documentation, decoded with special tokens)",
     "https://qwen.readthedocs.io/en/v2.5/framework/function_call.html",
     ToolCallFormat::kHermes,
     "<tool_call>\n{\"name\": \"get_current_temperature\", \"arguments\": {\"location\": \"San "
     "Francisco, CA, USA\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_temperature_date\", "
     "\"arguments\": {\"location\": \"San Francisco, CA, USA\", \"date\": "
     "\"2024-10-01\"}}\n</tool_call><|im_end|>",
     "<|im_end|>",
     {{"get_current_temperature", "{\"location\": \"San Francisco, CA, USA\"}"},
      {"get_temperature_date",
       "{\"location\": \"San Francisco, CA, USA\", \"date\": \"2024-10-01\"}"}}},
    {"Qwen3 in HyperChat (a log posted as a paragraph: newlines folded to spaces)",
     "https://github.com/BigSweetPotatoStudio/HyperChat/issues/106",
     ToolCallFormat::kHermes,
     "<tool_call> {\"name\": \"SearXNG_searxng_web_search\", \"arguments\": {\"query\": \"latest "
     "technology news\", \"count\": 20}} </tool_call>",
     "",
     {{"SearXNG_searxng_web_search", "{\"query\": \"latest technology news\", \"count\": 20}"}}},
};

}  // namespace tandem::api::testing
