#pragma once
// The reasoning a thinking model writes before its answer (DeepSeek-R1's and Qwen3's
// <think>...</think>), read apart from the answer as vLLM's --reasoning-parser deepseek_r1 / qwen3
// do: a chat answer's message.reasoning_content and delta.reasoning_content. One parser serves
// streamed and whole answers: a whole answer is the fold of its stream, so both agree.
#include <optional>
#include <string>
#include <string_view>

namespace tandem::api {

enum class ReasoningFormat { kNone, kDeepSeekR1, kQwen3 };

// What ends the reasoning in both formats (a token of its own in their tokenizers).
inline constexpr std::string_view kReasoningEnd = "</think>";

// "deepseek_r1" or "qwen3" (vLLM's names); nullopt for any other.
std::optional<ReasoningFormat> reasoning_format_named(std::string_view name);
std::string_view reasoning_format_name(ReasoningFormat format);

// Whether the prompt already closed the answer's reasoning: it ends with </think> (and white
// space). Qwen3's template with enable_thinking false ends it with "<think>\n\n</think>\n\n",
// DeepSeek-V3.1's non-thinking one with "</think>": the whole answer is content. A </think>
// further back closes an earlier turn's reasoning (Qwen3 shows it after a tool result), not this
// answer's. `continued_at`: where a continued final message (continue_final_message) starts in
// the prompt; its last <think> or </think> decides (as vLLM's parsers scan the prompt's ids from
// the end), and without either the prompt before it decides by the rule above.
bool prompt_ends_reasoning(std::string_view prompt, size_t continued_at = std::string_view::npos);
// Whether the prompt leaves the answer inside an open think block: by the same rule, its last
// marker is <think> (templates that always open one, as QwQ's and Qwen3-Thinking-2507's).
bool prompt_opens_reasoning(std::string_view prompt, size_t continued_at = std::string_view::npos);
// The answer's text that a continued final message (from `continued_at` on) already wrote: with
// a reasoning format, what follows its last </think> (all of it without one), since its
// reasoning is not the answer; without a format, all of it. Empty when none is continued (npos).
std::string_view answer_written(std::string_view prompt, size_t continued_at,
                                ReasoningFormat format);

// What became certain of the answer after one update.
struct ReasoningDelta {
  std::string reasoning, content;
};

class ReasoningParser {
 public:
  // An answer that never closes its reasoning is all reasoning (cut off while thinking), as
  // vLLM's deepseek_r1 and qwen3 (thinking on) read it. `all_content`: the prompt ended the
  // reasoning (prompt_ends_reasoning, or qwen3 with enable_thinking false), so none comes.
  explicit ReasoningParser(bool all_content);

  // The next text of the answer. Text that may still turn out to be a marker is held back.
  ReasoningDelta feed(std::string_view text);
  // The answer ended: what was held back.
  ReasoningDelta finish();

 private:
  enum class State { kStart, kReasoning, kContent };
  // Moves through pending_, appending to `out`; returns false when more text is needed.
  bool step(ReasoningDelta& out);

  State state_;
  std::string pending_;
};

}  // namespace tandem::api
