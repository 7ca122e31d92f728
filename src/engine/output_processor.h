#pragma once
// Turns one request's generated ids into streamed text and decides when the request ends: stop
// token ids (the tokenizer's EOS and the model's further EOS ids unless ignore_eos), stop strings
// (the text ends before the first match, or after it with include_stop_str_in_output; bytes that
// could still grow into a stop string are held back until the next token decides) and max_tokens.
// `tandem generate` and the serving engine share it (generate's EOS ids are config.json's, the
// engine's the generation config's: the same for DeepSeek's checkpoints).
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "text/detokenizer.h"
#include "text/tokenizer.h"

namespace tandem::engine {

struct OutputDelta {
  std::string text;  // text that became final with this token
  bool finished = false;
  std::string finish_reason;  // "stop" or "length" once finished
  // For a "stop": the stop string matched, or the id stopped on and whether it was an EOS id
  // (api::RequestOutput's fields of the same names).
  std::optional<std::string> stop_string;
  std::optional<int32_t> stop_token;
  bool stop_at_eos = false;
};

class OutputProcessor {
 public:
  // `eos_ids`: the ids that end a sequence unless ignore_eos (eos_ids() below). Only the
  // tokenizer's EOS is reported as the EOS (stop_at_eos); the others as stop ids, as vLLM adds a
  // generation config's further EOS ids to stop_token_ids.
  OutputProcessor(const text::Tokenizer& tokenizer, const SamplingParams& params,
                  const std::vector<int32_t>& eos_ids);

  // Adds one generated id. A stop id is counted as generated but adds no text (its text with
  // include_stop_str_in_output, as vLLM).
  OutputDelta push(int32_t id);
  bool finished() const { return finished_; }
  int64_t num_tokens() const { return num_tokens_; }
  const std::string& text() const { return text_; }

 private:
  text::IncrementalDetokenizer detok_;
  std::vector<int32_t> stop_ids_;  // end_token_ids(): sorted
  std::optional<int32_t> eos_;     // the tokenizer's EOS; none with ignore_eos
  std::vector<std::string> stop_strings_;
  bool include_stop_ = false;  // include_stop_str_in_output
  int64_t max_tokens_;
  int64_t min_tokens_;
  size_t stop_search_from_ = 0;  // where the text not searched for stop strings yet begins
  std::string text_;
  size_t emitted_ = 0;
  int64_t num_tokens_ = 0;
  bool finished_ = false;
};

// The end-of-sequence ids to stop on: the tokenizer's EOS and the generation config's
// (model::GenerationConfig::eos_token_ids), deduplicated.
std::vector<int32_t> eos_ids(const text::Tokenizer& tokenizer,
                             std::span<const int32_t> generation_eos);

}  // namespace tandem::engine
