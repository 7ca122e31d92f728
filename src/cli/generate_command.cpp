#include "cli/generate_command.h"

#include <cstdio>
#include <memory>

#include <nlohmann/json.hpp>

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
};

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
  // generate runs the DeepSeek model alone; a Qwen3-MoE checkpoint is the engine's.
  if (model::architecture_of(o.model) == model::kQwen3MoeArchitecture)
    throw Error("--model: " + o.model + " is a Qwen3-MoE checkpoint (" +
                model::kQwen3MoeArchitecture +
                "); tandem generate runs DeepSeek checkpoints only (DeepseekV3ForCausalLM, "
                "DeepseekV2ForCausalLM). Serve Qwen3-MoE with `tandem engine --model " +
                o.model + "` (or `tandem serve --model " + o.model + "`) and send it requests");
  if (o.seed_set) o.sampling.seed = o.seed;
  o.sampling.validate();
  const auto tok = text::Tokenizer::from_dir(o.model);
  model::check_tokenizer_fits(tok, o.model, model::ModelConfig::load(o.model).vocab_size, o.model);
  std::unique_ptr<model::DeepSeekModel> model;
  {
    ProgressBar bar("loading " + o.model, "tensors");
    model::WeightLoadOptions load;
    load.mtp = false;  // generate does not speculate
    model = std::make_unique<model::DeepSeekModel>(model::DeepSeekModel::load(
        o.model, [&](size_t d, size_t t) { bar.update(d, t); }, load));
  }
  const auto ids = prompt_ids(o, tok);
  auto result = engine::generate(*model, tok, ids, o.sampling, [](std::string_view piece) {
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
  });
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
  s.max_tokens = 64;
  cmd->add_option("--max-tokens", s.max_tokens, "tokens to generate at most")
      ->capture_default_str();
  cmd->add_option("--temperature", s.temperature, "0 for greedy")->capture_default_str();
  cmd->add_option("--top-k", s.top_k, "keep the k most likely tokens (0: off)");
  cmd->add_option("--top-p", s.top_p, "nucleus sampling mass");
  cmd->add_option("--min-p", s.min_p, "drop tokens below min_p times the top probability");
  cmd->add_option("--repetition-penalty", s.repetition_penalty, "penalty for seen tokens (1: off)");
  cmd->add_option("--presence-penalty", s.presence_penalty, "OpenAI presence penalty");
  cmd->add_option("--frequency-penalty", s.frequency_penalty, "OpenAI frequency penalty");
  cmd->add_option("--seed", o->seed, "random seed")->each([o](const std::string&) {
    o->seed_set = true;
  });
  cmd->add_option("--stop", s.stop, "stop string (repeatable)");
  cmd->add_option("--stop-token-id", s.stop_token_ids, "stop token id (repeatable)");
  cmd->add_flag("--ignore-eos", s.ignore_eos, "keep generating after the end-of-sequence token");
  cmd->callback([o, prompt, chat] {
    if (!*prompt && !*chat)
      throw CLI::ValidationError("one of --prompt or --chat-file is required");
    run(*o);
  });
}

}  // namespace tandem::cli
