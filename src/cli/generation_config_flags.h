#pragma once
// vLLM's --generation-config and --override-generation-config, as `tandem engine` and
// `tandem serve` take them: where a served model's sampling defaults and further EOS ids come
// from (model/generation_config.h).
#include <cstdint>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "api/sampling.h"

namespace tandem::cli {

struct GenerationConfigFlags {
  std::string source = "auto";  // "auto", "vllm" or a folder
  std::string overrides;        // a JSON object; empty: none
};

void add_generation_config_flags(CLI::App& cmd, GenerationConfigFlags& flags);
// The flags as `tandem serve` passes them to each engine (none at their defaults).
std::vector<std::string> generation_config_args(const GenerationConfigFlags& flags);

struct EngineGenerationConfig {
  api::SamplingDefaults sampling;
  std::vector<int32_t> eos_token_ids;  // besides the tokenizer's EOS, maybe with it
  std::string note;  // what the defaults are and where they came from; empty: vLLM's own
};
// Reads and checks them. `model_dir`: the served model's folder; empty for a simulated model,
// which has none ("auto" then reads nothing). Throws tandem::Error naming the flag, the file and
// the field.
EngineGenerationConfig load_generation_config(const GenerationConfigFlags& flags,
                                              const std::string& model_dir);
// A sampling check's error (a request's, naming the field: "'top_p' must be in (0, 1], got 2")
// for sampling taken from flags of the same names: "--top-p: must be in (0, 1], got 2".
std::string sampling_flag_error(const api::InvalidSamplingParam& e);

}  // namespace tandem::cli
