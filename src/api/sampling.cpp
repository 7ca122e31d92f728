#include "api/sampling.h"

#include <cmath>
#include <sstream>

#include "util/error.h"

namespace tandem::api {

namespace {

std::string shown(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

}  // namespace

void SamplingParams::validate(const std::string& max_tokens_name,
                              const std::string& min_tokens_name) const {
  auto fail = [](const std::string& param, const std::string& message) {
    throw InvalidSamplingParam(param, message);
  };
  if (!(temperature >= 0) || !std::isfinite(temperature))
    fail("temperature", "'temperature' must be >= 0, got " + shown(temperature));
  if (top_k < -1)
    fail("top_k", "'top_k' must be -1, 0 (off) or positive, got " + std::to_string(top_k));
  if (!(top_p > 0 && top_p <= 1)) fail("top_p", "'top_p' must be in (0, 1], got " + shown(top_p));
  if (!(min_p >= 0 && min_p <= 1)) fail("min_p", "'min_p' must be in [0, 1], got " + shown(min_p));
  if (!(repetition_penalty > 0) || !std::isfinite(repetition_penalty))
    fail("repetition_penalty",
         "'repetition_penalty' must be > 0, got " + shown(repetition_penalty));
  if (!(presence_penalty >= -2 && presence_penalty <= 2))
    fail("presence_penalty",
         "'presence_penalty' must be in [-2, 2], got " + shown(presence_penalty));
  if (!(frequency_penalty >= -2 && frequency_penalty <= 2))
    fail("frequency_penalty",
         "'frequency_penalty' must be in [-2, 2], got " + shown(frequency_penalty));
  if (max_tokens < 1)
    fail(max_tokens_name,
         "'" + max_tokens_name + "' must be at least 1, got " + std::to_string(max_tokens));
  if (min_tokens < 0)
    fail(min_tokens_name,
         "'" + min_tokens_name + "' must be at least 0, got " + std::to_string(min_tokens));
  if (min_tokens > max_tokens)
    fail(min_tokens_name, "'" + min_tokens_name + "' must be at most '" + max_tokens_name + "' (" +
                              std::to_string(max_tokens) + "), got " + std::to_string(min_tokens));
  if (stop.size() > kMaxStopStrings)
    fail("stop", "'stop': at most " + std::to_string(kMaxStopStrings) +
                     " stop strings are accepted, got " + std::to_string(stop.size()));
  if (stop_token_ids.size() > kMaxStopTokenIds)
    fail("stop_token_ids", "'stop_token_ids': at most " + std::to_string(kMaxStopTokenIds) +
                               " stop_token_ids are accepted, got " +
                               std::to_string(stop_token_ids.size()));
  for (const auto& s : stop) {
    if (s.empty()) fail("stop", "'stop': stop strings must not be empty");
    if (s.size() > kMaxStopStringBytes)
      fail("stop", "'stop': stop strings must be at most " + std::to_string(kMaxStopStringBytes) +
                       " bytes long, got one of " + std::to_string(s.size()));
  }
  for (size_t i = 0; i < allowed_token_ids.size(); ++i) {
    if (allowed_token_ids[i] < 0)
      fail("allowed_token_ids", "'allowed_token_ids': token ids must be >= 0, got " +
                                    std::to_string(allowed_token_ids[i]));
    if (i > 0 && allowed_token_ids[i] <= allowed_token_ids[i - 1])
      fail("allowed_token_ids", "'allowed_token_ids': token ids must ascend, once each");
  }
  if (bad_words_token_ids.size() > kMaxBadWords)
    fail("bad_words", "'bad_words': too many bad words after tokenization: " +
                          std::to_string(bad_words_token_ids.size()) + ", at most " +
                          std::to_string(kMaxBadWords));
  size_t bad_tokens = 0;
  for (const auto& word : bad_words_token_ids) {
    if (word.empty()) fail("bad_words", "'bad_words': entries must be at least one token");
    for (int32_t id : word)
      if (id < 0)
        fail("bad_words", "'bad_words': token ids must be >= 0, got " + std::to_string(id));
    bad_tokens += word.size();
  }
  if (bad_tokens > kMaxBadWordsTotalTokens)
    fail("bad_words", "'bad_words': at most " + std::to_string(kMaxBadWordsTotalTokens) +
                          " tokens in all are accepted, got " + std::to_string(bad_tokens));
  for (size_t i = 0; i < logit_bias.size(); ++i) {
    const auto [id, bias] = logit_bias[i];
    if (id < 0)
      fail("logit_bias", "'logit_bias': token ids must be >= 0, got " + std::to_string(id));
    if (i > 0 && id <= logit_bias[i - 1].first)
      fail("logit_bias", "'logit_bias': token ids must ascend, once each");
    if (!(bias >= -100 && bias <= 100))
      fail("logit_bias",
           "'logit_bias': values must be in [-100, 100], got " + std::to_string(bias));
  }
}

}  // namespace tandem::api
