#include "api/sampling.h"

#include <cmath>

#include "util/error.h"

namespace tandem::api {

void SamplingParams::validate() const {
  auto fail = [](const std::string& m) { throw Error(m); };
  if (!(temperature >= 0) || !std::isfinite(temperature)) fail("temperature must be >= 0");
  if (top_k < -1) fail("top_k must be -1, 0 (off) or positive");
  if (!(top_p > 0 && top_p <= 1)) fail("top_p must be in (0, 1]");
  if (!(min_p >= 0 && min_p <= 1)) fail("min_p must be in [0, 1]");
  if (!(repetition_penalty > 0) || !std::isfinite(repetition_penalty))
    fail("repetition_penalty must be > 0");
  if (!(presence_penalty >= -2 && presence_penalty <= 2))
    fail("presence_penalty must be in [-2, 2]");
  if (!(frequency_penalty >= -2 && frequency_penalty <= 2))
    fail("frequency_penalty must be in [-2, 2]");
  if (max_tokens < 1) fail("max_tokens must be at least 1, got " + std::to_string(max_tokens));
  if (min_tokens < 0) fail("min_tokens must be at least 0, got " + std::to_string(min_tokens));
  if (min_tokens > max_tokens)
    fail("min_tokens must be at most max_tokens (" + std::to_string(max_tokens) + "), got " +
         std::to_string(min_tokens));
  if (stop.size() > kMaxStopStrings)
    fail("at most " + std::to_string(kMaxStopStrings) + " stop strings are accepted, got " +
         std::to_string(stop.size()));
  if (stop_token_ids.size() > kMaxStopTokenIds)
    fail("at most " + std::to_string(kMaxStopTokenIds) + " stop_token_ids are accepted, got " +
         std::to_string(stop_token_ids.size()));
  for (const auto& s : stop) {
    if (s.empty()) fail("stop strings must not be empty");
    if (s.size() > kMaxStopStringBytes)
      fail("stop strings must be at most " + std::to_string(kMaxStopStringBytes) +
           " bytes long, got one of " + std::to_string(s.size()));
  }
  for (size_t i = 0; i < logit_bias.size(); ++i) {
    const auto [id, bias] = logit_bias[i];
    if (id < 0) fail("logit_bias token ids must be >= 0, got " + std::to_string(id));
    if (i > 0 && id <= logit_bias[i - 1].first) fail("logit_bias token ids must ascend, once each");
    if (!(bias >= -100 && bias <= 100))
      fail("logit_bias values must be in [-100, 100], got " + std::to_string(bias));
  }
}

}  // namespace tandem::api
