#pragma once
// A model's generation config as vLLM reads it for serving (its --generation-config auto): the
// sampling defaults a request that omits them gets, and the ids that end an answer besides the
// tokenizer's EOS. Hugging Face writes them to generation_config.json; a folder without one has
// them in config.json (transformers' GenerationConfig.from_model_config).
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace tandem::model {

struct GenerationConfig {
  // vLLM's get_diff_sampling_param keys: unset when absent, null, or equal to transformers'
  // default (vLLM reads the file through GenerationConfig.to_diff_dict, so a top_k of 50 is no
  // default there, nor here).
  std::optional<double> temperature, top_p, min_p, repetition_penalty;
  std::optional<int64_t> top_k, max_new_tokens;
  std::vector<int32_t> eos_token_ids;  // an integer or a list of them; may hold the tokenizer's
  std::string origin;                  // the file read; empty when there was none
};

// DIR/generation_config.json, else DIR/config.json, else nothing. Every message names the file
// and the field.
GenerationConfig read_generation_config(const std::filesystem::path& dir);

// vLLM's --override-generation-config: a JSON object of the sampling keys above, applied over
// `config` (the EOS ids are not among them); a key given as null unsets it. Throws tandem::Error
// naming `origin` and the field, and any key that is not one of them.
void override_generation_config(GenerationConfig& config, const nlohmann::json& overrides,
                                const std::string& origin);

}  // namespace tandem::model
