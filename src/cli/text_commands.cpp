#include "cli/text_commands.h"

#include <cstdio>
#include <memory>
#include <sstream>

#include <nlohmann/json.hpp>

#include "api/chat_messages.h"
#include "api/error.h"
#include "api/request.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "util/error.h"
#include "util/file.h"

namespace tandem::cli {
namespace {

using ordered_json = nlohmann::ordered_json;

ordered_json parse_json_file(const std::string& path) {
  try {
    return ordered_json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    throw Error(path + ": malformed JSON: " + e.what());
  }
}

// --tool-choice's value as a request's tool_choice: JSON object text as that object
// ({"type": "function", "function": {"name": ...}}), any other text as a string ("none").
ordered_json tool_choice_of(const std::string& flag) {
  if (flag.empty() || flag.front() != '{') return flag;
  try {
    return ordered_json::parse(flag);
  } catch (const nlohmann::json::exception& e) {
    throw Error("--tool-choice: malformed JSON: " + std::string(e.what()));
  }
}

// The chat file is either a list of messages or an object holding "messages" plus any extra
// template variables (e.g. "enable_thinking", "date_string"). Messages, tools and tool_choice are
// taken as the server takes them (api/chat_messages.h, api::read_tools), so the ids are the
// server's for the same chat, the description of tools the server adds for a template that shows
// none included.
ordered_json chat_context(const std::string& chat_file, const std::string& tools_file,
                          const std::string& tool_choice_flag, bool add_generation_prompt,
                          const text::Tokenizer& tok, const text::ChatTemplate& tmpl) {
  ordered_json doc = parse_json_file(chat_file);
  ordered_json ctx = ordered_json::object();
  if (doc.is_array()) {
    ctx["messages"] = doc;
  } else if (doc.is_object() && doc.contains("messages") && doc["messages"].is_array()) {
    ctx = doc;
  } else {
    throw Error(chat_file + ": expected a list of messages or an object with a \"messages\" list");
  }
  for (size_t i = 0; i < ctx["messages"].size(); ++i) {
    const auto& m = ctx["messages"][i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      throw Error(chat_file + ": messages[" + std::to_string(i) + "] needs a string \"role\"");
  }
  // Tools come from --tools or from the chat file's "tools" (a template variable like the others).
  const bool tools_in_chat = ctx.contains("tools") && !ctx["tools"].is_null();
  if (tools_in_chat && !tools_file.empty())
    throw Error(chat_file + ": has \"tools\" and --tools gives them too: give them in one place");
  const bool with_tools = tools_in_chat || !tools_file.empty();
  const std::string& tools_source = tools_in_chat ? chat_file : tools_file;
  // tool_choice comes from --tool-choice or from the chat file's "tool_choice", a field of the
  // request that the template never sees.
  nlohmann::json request = nlohmann::json::object();
  std::string choice_source = "--tool-choice";
  if (ctx.contains("tool_choice")) {
    if (!tool_choice_flag.empty())
      throw Error(chat_file +
                  ": has \"tool_choice\" and --tool-choice gives it too: give it in one place");
    request["tool_choice"] = nlohmann::json::parse(ctx["tool_choice"].dump());
    choice_source = chat_file;
    ctx.erase("tool_choice");
  } else if (!tool_choice_flag.empty()) {
    request["tool_choice"] = nlohmann::json::parse(tool_choice_of(tool_choice_flag).dump());
  }
  try {
    if (!tools_file.empty()) ctx["tools"] = parse_json_file(tools_file);
    if (with_tools) ctx["tools"] = api::template_tools(ctx["tools"]);
  } catch (const api::ApiError& e) {
    throw Error(tools_source + ": " + e.param + ": " + e.message);
  }
  try {
    ctx["messages"] = api::template_messages(ctx["messages"], tmpl, with_tools);
  } catch (const api::ApiError& e) {
    throw Error(chat_file + ": " + e.param + ": " + e.message);
  }
  // As the server reads them: the tool-call markup a choice other than "none" needs (refused for
  // a model whose calls could not be read back), forced calls checked, and for a template that
  // does not show tools, the system message that describes them.
  if (with_tools) request["tools"] = nlohmann::json::parse(ctx["tools"].dump());
  try {
    api::read_tools(request, tok, ctx["messages"], with_tools ? ctx["tools"] : ordered_json(),
                    tmpl.content_format(with_tools));
  } catch (const api::ApiError& e) {
    const bool of_choice = e.param.rfind("tool_choice", 0) == 0;
    throw Error((of_choice ? choice_source : tools_source) + ": " + e.param + ": " + e.message);
  }
  ctx["add_generation_prompt"] = add_generation_prompt;
  if (!ctx.contains("bos_token")) ctx["bos_token"] = tok.bos_token();
  if (!ctx.contains("eos_token")) ctx["eos_token"] = tok.eos_token();
  return ctx;
}

struct TokenizeOptions {
  std::string model, text, text_file, chat_file, tools_file, tool_choice;
  bool add_generation_prompt = false, json = false, no_special_tokens = false;
};

void run_tokenize(const TokenizeOptions& o) {
  const auto tok = text::Tokenizer::from_dir(o.model);
  std::string input, prompt;
  bool add_special = !o.no_special_tokens;
  if (!o.chat_file.empty()) {
    if (tok.chat_templates().empty())
      throw Error(o.model +
                  ": the model has no chat template (chat_template.jinja or "
                  "tokenizer_config.json's chat_template)");
    text::ChatTemplate tmpl(tok.chat_templates());
    prompt = tmpl.render(
        chat_context(o.chat_file, o.tools_file, o.tool_choice, o.add_generation_prompt, tok, tmpl));
    input = prompt;
    add_special = false;  // the template writes BOS itself, as apply_chat_template assumes
  } else if (!o.text_file.empty()) {
    input = read_file(o.text_file);
  } else {
    input = o.text;
  }
  const auto ids = tok.encode(input, add_special);
  if (o.json) {
    ordered_json out;
    if (!o.chat_file.empty()) out["prompt"] = prompt;
    out["ids"] = ids;
    std::printf("%s\n", out.dump().c_str());
    return;
  }
  if (!o.chat_file.empty()) std::printf("%s\n", prompt.c_str());
  std::string line;
  for (size_t i = 0; i < ids.size(); ++i) line += (i ? " " : "") + std::to_string(ids[i]);
  std::printf("%s\n", line.c_str());
}

std::vector<text::TokenId> parse_ids(const std::string& spec) {
  std::vector<text::TokenId> ids;
  std::string item;
  std::istringstream in(spec);
  while (in >> item) {
    std::istringstream parts(item);
    std::string part;
    while (std::getline(parts, part, ',')) {
      if (part.empty()) continue;
      size_t used = 0;
      long long v = 0;
      try {
        v = std::stoll(part, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != part.size() || v < 0 || v > INT32_MAX)
        throw Error("--ids: '" + part + "' is not a token id");
      ids.push_back(static_cast<text::TokenId>(v));
    }
  }
  return ids;
}

}  // namespace

void add_text_commands(CLI::App& app) {
  auto opts = std::make_shared<TokenizeOptions>();
  auto* tokenize = app.add_subcommand("tokenize", "Print the token ids of a text or a chat");
  tokenize->add_option("--model", opts->model, "Hugging Face model folder (tokenizer.json)")
      ->required()
      ->check(CLI::ExistingDirectory);
  auto* text = tokenize->add_option("--text", opts->text, "text to tokenize");
  auto* text_file =
      tokenize->add_option("--text-file", opts->text_file, "file whose text to tokenize")
          ->check(CLI::ExistingFile);
  auto* chat = tokenize
                   ->add_option("--chat-file", opts->chat_file,
                                "JSON list of messages (or {\"messages\": [...], extra kwargs})")
                   ->check(CLI::ExistingFile);
  text->excludes(text_file)->excludes(chat);
  text_file->excludes(chat);
  tokenize->add_flag("--add-generation-prompt", opts->add_generation_prompt,
                     "end the chat with the assistant's turn header");
  tokenize
      ->add_option("--tools", opts->tools_file,
                   "JSON list of tools for the chat template, checked and given to it as the "
                   "server gives them")
      ->check(CLI::ExistingFile)
      ->needs(chat);
  tokenize
      ->add_option("--tool-choice", opts->tool_choice,
                   "the chat's tool_choice, taken as the server takes it: none, auto (the default "
                   "with tools), required, or {\"type\": \"function\", \"function\": {\"name\": "
                   "NAME}}")
      ->needs(chat);
  tokenize->add_flag("--no-special-tokens", opts->no_special_tokens,
                     "do not add BOS/EOS (plain text only)");
  tokenize->add_flag("--json", opts->json,
                     "print {\"ids\": [...]} as JSON; with --chat-file {\"prompt\": ..., "
                     "\"ids\": [...]}, the rendered prompt too");
  tokenize->callback([opts, text, text_file, chat] {
    if (!*text && !*text_file && !*chat)
      throw CLI::ValidationError("one of --text, --text-file or --chat-file is required");
    run_tokenize(*opts);
  });

  auto dmodel = std::make_shared<std::string>();
  auto dids = std::make_shared<std::string>();
  auto dskip = std::make_shared<bool>(false);
  auto* detok = app.add_subcommand("detokenize", "Print the text of token ids");
  detok->add_option("--model", *dmodel, "Hugging Face model folder (tokenizer.json)")
      ->required()
      ->check(CLI::ExistingDirectory);
  detok->add_option("--ids", *dids, "token ids, separated by spaces or commas")->required();
  detok->add_flag("--skip-special-tokens", *dskip, "leave special tokens out");
  detok->callback([dmodel, dids, dskip] {
    const auto tok = text::Tokenizer::from_dir(*dmodel);
    std::printf("%s\n", tok.decode(parse_ids(*dids), *dskip).c_str());
  });
}

}  // namespace tandem::cli
