#include "api/reasoning.h"

#include <algorithm>

namespace tandem::api {
namespace {

constexpr std::string_view kOpen = "<think>";
constexpr std::string_view kClose = kReasoningEnd;

bool is_space(char c) {
  return c == ' ' || c == '\n' || c == '\t' || c == '\r';
}

// The length of the longest end of `text` that `marker` starts with (shorter than the marker):
// the bytes that may still become it.
size_t held_prefix(std::string_view text, std::string_view marker) {
  for (size_t n = std::min(text.size(), marker.size() - 1); n > 0; --n)
    if (marker.substr(0, n) == text.substr(text.size() - n)) return n;
  return 0;
}

}  // namespace

std::optional<ReasoningFormat> reasoning_format_named(std::string_view name) {
  if (name == "deepseek_r1") return ReasoningFormat::kDeepSeekR1;
  if (name == "qwen3") return ReasoningFormat::kQwen3;
  return std::nullopt;
}

std::string_view reasoning_format_name(ReasoningFormat format) {
  switch (format) {
    case ReasoningFormat::kDeepSeekR1:
      return "deepseek_r1";
    case ReasoningFormat::kQwen3:
      return "qwen3";
    case ReasoningFormat::kNone:
      break;
  }
  return "none";
}

namespace {

// The marker that last decided the reasoning's state in the prompt: a continued final message's
// own last <think> or </think>, else the one the prompt before it ends with (and white space).
enum class LastMarker { kNone, kOpen, kClose };

LastMarker last_marker(std::string_view prompt, size_t continued_at) {
  const std::string_view continued =
      continued_at < prompt.size() ? prompt.substr(continued_at) : std::string_view();
  const size_t open = continued.rfind(kOpen), close = continued.rfind(kClose);
  if (close != std::string_view::npos)
    return open == std::string_view::npos || close > open ? LastMarker::kClose : LastMarker::kOpen;
  if (open != std::string_view::npos) return LastMarker::kOpen;
  size_t e = std::min(continued_at, prompt.size());
  while (e > 0 && is_space(prompt[e - 1])) --e;
  const std::string_view before = prompt.substr(0, e);
  if (before.ends_with(kClose)) return LastMarker::kClose;
  if (before.ends_with(kOpen)) return LastMarker::kOpen;
  return LastMarker::kNone;
}

}  // namespace

bool prompt_ends_reasoning(std::string_view prompt, size_t continued_at) {
  return last_marker(prompt, continued_at) == LastMarker::kClose;
}

bool prompt_opens_reasoning(std::string_view prompt, size_t continued_at) {
  return last_marker(prompt, continued_at) == LastMarker::kOpen;
}

std::string_view answer_written(std::string_view prompt, size_t continued_at,
                                ReasoningFormat format) {
  if (continued_at >= prompt.size()) return {};
  std::string_view written = prompt.substr(continued_at);
  const size_t close = written.rfind(kClose);
  if (format != ReasoningFormat::kNone && close != std::string_view::npos)
    written.remove_prefix(close + kClose.size());
  return written;
}

ReasoningParser::ReasoningParser(bool all_content)
    : state_(all_content ? State::kContent : State::kStart) {}

bool ReasoningParser::step(ReasoningDelta& out) {
  switch (state_) {
    case State::kStart: {
      // The answer may open its reasoning itself (R1's first template, Qwen3 up to 2507) or start
      // inside it (templates that end the prompt with <think>): an opening marker, after white
      // space only, is dropped with that white space.
      size_t b = 0;
      while (b < pending_.size() && is_space(pending_[b])) ++b;
      const std::string_view rest = std::string_view(pending_).substr(b);
      if (rest.substr(0, kOpen.size()) == kOpen) {
        pending_.erase(0, b + kOpen.size());
        state_ = State::kReasoning;
        return true;
      }
      if (kOpen.substr(0, rest.size()) == rest) return false;  // may still become it
      state_ = State::kReasoning;
      return true;
    }
    case State::kReasoning: {
      const size_t at = pending_.find(kClose);
      if (at == std::string::npos) {
        const size_t keep = held_prefix(pending_, kClose);
        out.reasoning += pending_.substr(0, pending_.size() - keep);
        pending_.erase(0, pending_.size() - keep);
        return false;
      }
      out.reasoning += pending_.substr(0, at);
      pending_.erase(0, at + kClose.size());
      state_ = State::kContent;
      return true;
    }
    case State::kContent:
      out.content += pending_;
      pending_.clear();
      return false;
  }
  return false;
}

ReasoningDelta ReasoningParser::feed(std::string_view text) {
  ReasoningDelta out;
  pending_ += text;
  while (step(out)) {
  }
  return out;
}

ReasoningDelta ReasoningParser::finish() {
  ReasoningDelta out;
  // Held back as a possible marker that never came: reasoning (the answer never left it).
  if (state_ == State::kContent)
    out.content = std::move(pending_);
  else
    out.reasoning = std::move(pending_);
  pending_.clear();
  return out;
}

}  // namespace tandem::api
