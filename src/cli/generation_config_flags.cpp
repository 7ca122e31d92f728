#include "cli/generation_config_flags.h"

#include <algorithm>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "model/generation_config.h"
#include "util/error.h"
#include "util/json.h"
#include "util/json_fields.h"

namespace tandem::cli {
namespace {

// A request's message ("'top_p' must be in (0, 1], got 2", "'stop': stop strings must not be
// empty") without the name that the field form puts first.
std::string without_name(const api::InvalidSamplingParam& e) {
  const std::string what = e.what();
  for (const std::string& named : {"'" + e.param + "': ", "'" + e.param + "' "})
    if (what.starts_with(named)) return what.substr(named.size());
  return "is invalid: " + what;
}

}  // namespace

std::string sampling_flag_error(const api::InvalidSamplingParam& e) {
  // The flags are the fields' names in kebab case, --stop-token-id (repeated) aside.
  std::string flag = e.param == "stop_token_ids" ? "stop-token-id" : e.param;
  std::replace(flag.begin(), flag.end(), '_', '-');
  return "--" + flag + ": " + without_name(e);
}

void add_generation_config_flags(CLI::App& cmd, GenerationConfigFlags& flags) {
  cmd.add_option("--generation-config", flags.source,
                 "where requests' sampling defaults (temperature, top_p, top_k, min_p, "
                 "repetition_penalty; max_new_tokens as a chat's max_tokens when it gives none, as "
                 "a cap on every request's from a folder or the override) and further EOS ids "
                 "come from, as vLLM's flag: auto (the model's generation_config.json, else its "
                 "config.json), vllm (vLLM's neutral defaults; EOS ids still the model's), or a "
                 "folder holding generation_config.json")
      ->capture_default_str();
  cmd.add_option("--override-generation-config", flags.overrides,
                 "a JSON object of those sampling defaults applied over the generation config, "
                 "e.g. '{\"temperature\": 0.5}' (vLLM's flag)");
}

std::vector<std::string> generation_config_args(const GenerationConfigFlags& flags) {
  std::vector<std::string> args;
  if (flags.source != "auto") args.insert(args.end(), {"--generation-config", flags.source});
  if (!flags.overrides.empty())
    args.insert(args.end(), {"--override-generation-config", flags.overrides});
  return args;
}

EngineGenerationConfig load_generation_config(const GenerationConfigFlags& flags,
                                              const std::string& model_dir) {
  model::GenerationConfig g;
  if (flags.source == "auto" || flags.source == "vllm") {
    if (!model_dir.empty()) g = model::read_generation_config(model_dir);
  } else {
    if (!std::filesystem::is_directory(flags.source))
      throw Error(
          "--generation-config: expected auto, vllm or a folder holding "
          "generation_config.json; '" +
          flags.source + "' is none of them");
    g = model::read_generation_config(flags.source);
    if (g.origin.empty())
      throw Error("--generation-config " + flags.source +
                  ": the folder holds neither generation_config.json nor config.json");
  }
  const bool folder = flags.source != "auto" && flags.source != "vllm";
  const std::vector<int32_t> eos = g.eos_token_ids;
  if (flags.source == "vllm") g = model::GenerationConfig{};  // the sampling defaults only
  std::string origin = g.origin;
  model::GenerationConfig overrides;  // the flag's own keys
  if (!flags.overrides.empty()) {
    const std::string flag = "--override-generation-config";
    const nlohmann::json doc = parse_json_document(flags.overrides, flag);
    model::override_generation_config(g, doc, flag);
    model::override_generation_config(overrides, doc, flag);
    origin += (origin.empty() ? "" : " and ") + flag;
  }

  // The defaults as they will apply are checked, not each file's (a value the override replaces,
  // or that vllm drops, is never used): their messages name where the values came from, in the
  // form of every field's (util/json_fields.h). The values were read and typed already, so these
  // Fields hold no object; only their messages are used.
  const nlohmann::json read_already = nlohmann::json::object();
  const Fields fields = Fields::lenient(read_already, origin);

  EngineGenerationConfig out;
  out.eos_token_ids = eos;
  api::SamplingDefaults& d = out.sampling;
  d.temperature = g.temperature.value_or(d.temperature);
  d.top_k = g.top_k.value_or(d.top_k);
  d.top_p = g.top_p.value_or(d.top_p);
  d.min_p = g.min_p.value_or(d.min_p);
  d.repetition_penalty = g.repetition_penalty.value_or(d.repetition_penalty);
  if (g.max_new_tokens && *g.max_new_tokens < 1)
    fields.fail("max_new_tokens", "must be at least 1, got " + std::to_string(*g.max_new_tokens));
  // As vLLM's get_max_tokens: the model's max_new_tokens only fills in a missing max_tokens; a
  // folder's, or the override's, caps every request.
  d.max_tokens = g.max_new_tokens.value_or(0);
  d.max_tokens_cap = (folder ? g.max_new_tokens : overrides.max_new_tokens).value_or(0);
  std::string set;
  auto note = [&](const char* name, const auto& value) {
    if (value)
      set += (set.empty() ? "" : ", ") + std::string(name) + " " + nlohmann::json(*value).dump();
  };
  note("temperature", g.temperature);
  note("top_k", g.top_k);
  note("top_p", g.top_p);
  note("min_p", g.min_p);
  note("repetition_penalty", g.repetition_penalty);
  note("max_new_tokens", g.max_new_tokens);
  // Checked as a request's would be, so that a bad default is one error at start, not a 400 on
  // every request that leaves the field out.
  api::SamplingParams p;
  p.temperature = d.temperature;
  p.top_k = d.top_k;
  p.top_p = d.top_p;
  p.min_p = d.min_p;
  p.repetition_penalty = d.repetition_penalty;
  try {
    p.validate();
  } catch (const api::InvalidSamplingParam& e) {
    fields.fail(e.param, without_name(e));
  }
  if (!set.empty())
    out.note = "requests' sampling defaults from " + origin + ": " + set +
               " (--generation-config vllm for vLLM's neutral ones)";
  return out;
}

}  // namespace tandem::cli
