#include "cli/generate_command.h"

#include <algorithm>
#include <cstdio>
#include <memory>

#include <nlohmann/json.hpp>

#include "cli/generation_config_flags.h"
#include "cli/number_checks.h"
#include "engine/generate.h"
#include "model/config.h"
#include "model/model_folder.h"
#include "model/qwen3_moe_config.h"
#include "text/chat_template.h"
#include "util/error.h"
#include "util/file.h"
#include "util/progress.h"

namespace tandem::cli {
namespace {

struct GenerateOptions {
  std::string model, prompt, chat_file;
  engine::SamplingParams sampling;
  uint64_t seed = 0;
  bool seed_set = false;
  GenerationConfigFlags generation_config;
  // The sampling flags given on the command line; the others come from the generation config.
  bool max_tokens_set = false, temperature_set = false, top_k_set = false, top_p_set = false,
       min_p_set = false, repetition_penalty_set = false;
};

constexpr int64_t kDefaultMaxTokens = 64;

// As the engine serves a request that leaves these fields out (vLLM's --generation-config auto):
// the generation config's sampling defaults where no flag sets them, its max_new_tokens as the
// length when --max-tokens is not given (within the context), and a folder's or the override's
// max_new_tokens as a cap on any.
void apply_generation_defaults(GenerateOptions& o, const api::SamplingDefaults& d,
                               int64_t prompt_tokens, int64_t context) {
  engine::SamplingParams& s = o.sampling;
  if (!o.temperature_set) s.temperature = d.temperature;
  if (!o.top_k_set) s.top_k = d.top_k;
  if (!o.top_p_set) s.top_p = d.top_p;
  if (!o.min_p_set) s.min_p = d.min_p;
  if (!o.repetition_penalty_set) s.repetition_penalty = d.repetition_penalty;
  if (!o.max_tokens_set && d.max_tokens > 0)
    s.max_tokens = std::max<int64_t>(1, std::min(d.max_tokens, context - prompt_tokens));
  if (d.max_tokens_cap > 0) s.max_tokens = std::min(s.max_tokens, d.max_tokens_cap);
}

std::vector<int32_t> prompt_ids(const GenerateOptions& o, const text::Tokenizer& tok) {
  if (o.chat_file.empty()) return tok.encode(o.prompt, true);
  nlohmann::ordered_json messages;
  try {
    messages = nlohmann::ordered_json::parse(read_file(o.chat_file));
  } catch (const nlohmann::json::exception& e) {
    throw Error(o.chat_file + ": malformed JSON: " + e.what());
  }
  if (!messages.is_array()) throw Error(o.chat_file + ": expected a list of messages");
  if (tok.chat_templates().empty())
    throw Error(o.model +
                ": the model has no chat template (chat_template.jinja or "
                "tokenizer_config.json's chat_template)");
  nlohmann::ordered_json ctx = {{"messages", messages},
                                {"add_generation_prompt", true},
                                {"bos_token", tok.bos_token()},
                                {"eos_token", tok.eos_token()}};
  return tok.encode(text::ChatTemplate(tok.chat_templates()).render(ctx), false);
}

void run(GenerateOptions& o) {
  if (o.seed_set) o.sampling.seed = o.seed;
  try {  // the flags first, before any file of the model is read
    o.sampling.validate();
  } catch (const api::InvalidSamplingParam& e) {
    throw Error(sampling_flag_error(e));
  }
  // generate runs the DeepSeek model alone; a Qwen3-MoE checkpoint is the engine's.
  if (model::architecture_of(o.model) == model::kQwen3MoeArchitecture)
    throw Error("--model: " + o.model + " is a Qwen3-MoE checkpoint (" +
                model::kQwen3MoeArchitecture +
                "); tandem generate runs DeepSeek checkpoints only (DeepseekV3ForCausalLM, "
                "DeepseekV2ForCausalLM). Serve Qwen3-MoE with `tandem engine --model " +
                o.model + "` (or `tandem serve --model " + o.model + "`) and send it requests");
  const EngineGenerationConfig generation = load_generation_config(o.generation_config, o.model);
  if (!generation.note.empty())
    std::fprintf(stderr, "tandem generate: %s\n", generation.note.c_str());
  const auto tok = text::Tokenizer::from_dir(o.model);
  const model::ModelConfig config = model::ModelConfig::load(o.model);
  model::check_tokenizer_fits(tok, o.model, config.vocab_size, o.model);
  std::unique_ptr<model::DeepSeekModel> model;
  {
    ProgressBar bar("loading " + o.model, "tensors");
    model::WeightLoadOptions load;
    load.mtp = false;  // generate does not speculate
    model = std::make_unique<model::DeepSeekModel>(model::DeepSeekModel::load(
        o.model, [&](size_t d, size_t t) { bar.update(d, t); }, load));
  }
  const auto ids = prompt_ids(o, tok);
  apply_generation_defaults(o, generation.sampling, static_cast<int64_t>(ids.size()),
                            config.max_position_embeddings);
  auto result = engine::generate(
      *model, tok, ids, o.sampling,
      [](std::string_view piece) {
        std::fwrite(piece.data(), 1, piece.size(), stdout);
        std::fflush(stdout);
      },
      generation.eos_token_ids);
  std::printf("\n");
  std::fflush(stdout);  // the statistics below go to stderr; keep them after the text
  const double prefill_rate = ids.size() / std::max(result.prefill_seconds, 1e-9);
  const double decode_rate = (result.tokens.size() - 1) / std::max(result.decode_seconds, 1e-9);
  std::fprintf(stderr,
               "finish: %s; prefill: %zu tokens in %.3f s (%.1f tokens/s); decode: %zu tokens in "
               "%.3f s (%.1f tokens/s)\n",
               result.finish_reason.c_str(), ids.size(), result.prefill_seconds, prefill_rate,
               result.tokens.size(), result.decode_seconds, decode_rate);
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto o = std::make_shared<GenerateOptions>();
  auto* cmd = app.add_subcommand("generate",
                                 "Generate text from a prompt with the CPU model (DeepSeek "
                                 "checkpoints; Qwen3-MoE is served with tandem engine)");
  cmd->add_option("--model", o->model,
                  "DeepSeek-V3/V2 model folder (config.json, safetensors, tokenizer)")
      ->required()
      ->check(CLI::ExistingDirectory);
  auto* prompt =
      cmd->add_option("--prompt", o->prompt, "prompt text (BOS added per the tokenizer config)");
  auto* chat = cmd->add_option("--chat-file", o->chat_file, "JSON list of chat messages")
                   ->check(CLI::ExistingFile);
  prompt->excludes(chat);
  auto& s = o->sampling;
  s.max_tokens = kDefaultMaxTokens;
  // Each flag marks itself given: the ones left out take the generation config's defaults.
  auto given = [](bool& set) { return [&set](const std::string&) { set = true; }; };
  cmd->add_option("--max-tokens", s.max_tokens,
                  "tokens to generate at most (default: the generation config's max_new_tokens, "
                  "else 64)")
      ->check(positive_number())
      ->each(given(o->max_tokens_set));
  cmd->add_option("--temperature", s.temperature,
                  "0 for greedy (default: the generation config's, else 1)")
      ->each(given(o->temperature_set));
  cmd->add_option("--top-k", s.top_k, "keep the k most likely tokens (0: off)")
      ->each(given(o->top_k_set));
  cmd->add_option("--top-p", s.top_p, "nucleus sampling mass")->each(given(o->top_p_set));
  cmd->add_option("--min-p", s.min_p, "drop tokens below min_p times the top probability")
      ->each(given(o->min_p_set));
  cmd->add_option("--repetition-penalty", s.repetition_penalty, "penalty for seen tokens (1: off)")
      ->each(given(o->repetition_penalty_set));
  cmd->add_option("--presence-penalty", s.presence_penalty, "OpenAI presence penalty");
  cmd->add_option("--frequency-penalty", s.frequency_penalty, "OpenAI frequency penalty");
  cmd->add_option("--seed", o->seed, "random seed")->each([o](const std::string&) {
    o->seed_set = true;
  });
  cmd->add_option("--stop", s.stop, "stop string (repeatable)");
  cmd->add_option("--stop-token-id", s.stop_token_ids, "stop token id (repeatable)");
  cmd->add_flag("--ignore-eos", s.ignore_eos, "keep generating after the end-of-sequence token");
  add_generation_config_flags(*cmd, o->generation_config);
  cmd->callback([o, prompt, chat] {
    if (!*prompt && !*chat)
      throw CLI::ValidationError("one of --prompt or --chat-file is required");
    run(*o);
  });
}

}  // namespace tandem::cli
