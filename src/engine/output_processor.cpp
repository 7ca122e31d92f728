#include "engine/output_processor.h"

#include <algorithm>

namespace tandem::engine {
namespace {

// Bytes at the end of `text` that could still grow into a stop string.
size_t stop_holdback(std::string_view text, const std::vector<std::string>& stops) {
  size_t hold = 0;
  for (const auto& s : stops)
    for (size_t k = std::min(s.size() - 1, text.size()); k > hold; --k)
      if (text.substr(text.size() - k) == std::string_view(s).substr(0, k)) {
        hold = k;
        break;
      }
  return hold;
}

}  // namespace

OutputProcessor::OutputProcessor(const text::Tokenizer& tokenizer, const SamplingParams& params,
                                 const std::vector<int32_t>& eos)
    : detok_(tokenizer, params.skip_special_tokens),
      stop_ids_(end_token_ids(params, eos)),
      eos_(params.ignore_eos ? std::nullopt : tokenizer.eos_id()),
      stop_strings_(params.stop),
      include_stop_(params.include_stop_str_in_output),
      max_tokens_(params.max_tokens),
      min_tokens_(params.min_tokens) {
  // An empty stop string would match everywhere; SamplingParams::validate rejects it, and the
  // engine validates before it gets here.
  std::erase_if(stop_strings_, [](const std::string& s) { return s.empty(); });
}

OutputDelta OutputProcessor::push(int32_t id) {
  OutputDelta delta;
  if (finished_) return delta;
  ++num_tokens_;
  const size_t before = emitted_;
  // Before min_tokens nothing but max_tokens ends the sequence (the sampler does not draw stop
  // ids then; a forced one counts as text). As in vLLM's detokenizer, a stop string must end in
  // the text of a token after the first min_tokens (it may start in theirs).
  const bool may_stop = num_tokens_ >= min_tokens_;
  const bool may_stop_on_text = num_tokens_ > min_tokens_;
  if (may_stop && std::binary_search(stop_ids_.begin(), stop_ids_.end(), id)) {
    if (include_stop_) text_ += detok_.push(id);
    finished_ = true;
    delta.finish_reason = "stop";
    delta.stop_token = id;
    // As vLLM, which checks the EOS before stop_token_ids: an id in both is the EOS.
    delta.stop_at_eos = eos_ == id;
  } else {
    text_ += detok_.push(id);
    size_t hit = std::string::npos;
    const std::string* matched = nullptr;
    if (may_stop_on_text)
      for (const auto& s : stop_strings_) {
        const size_t at = text_.find(
            s, stop_search_from_ > s.size() - 1 ? stop_search_from_ - (s.size() - 1) : 0);
        if (at < hit) {
          hit = at;
          matched = &s;
        }
      }
    // Text before it was searched already (or made within min_tokens): each step searches its
    // new text and the bytes a stop string may start in before it, not the whole answer again.
    stop_search_from_ = text_.size();
    if (matched) {
      text_.resize(include_stop_ ? hit + matched->size() : hit);
      finished_ = true;
      delta.finish_reason = "stop";
      delta.stop_string = *matched;
    } else if (num_tokens_ >= max_tokens_) {
      finished_ = true;
      delta.finish_reason = "length";
    }
  }
  const size_t final_end =
      finished_ ? text_.size() : text_.size() - stop_holdback(text_, stop_strings_);
  if (final_end > before) {
    delta.text = text_.substr(before, final_end - before);
    emitted_ = final_end;
  }
  delta.finished = finished_;
  return delta;
}

std::vector<int32_t> eos_ids(const text::Tokenizer& tokenizer,
                             std::span<const int32_t> generation_eos) {
  std::vector<int32_t> ids;
  if (auto eos = tokenizer.eos_id()) ids.push_back(*eos);
  for (int32_t id : generation_eos)
    if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
  return ids;
}

}  // namespace tandem::engine
