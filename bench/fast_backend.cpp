// A backend that answers OpenAI completion requests at once, for measuring what a proxy in front
// of it costs (bench/gateway_overhead.sh). It runs on Tandem's own HTTP server, as the engines do,
// and does no work per request beyond the HTTP exchange: every answer is built once at start-up.
//
//   POST /v1/completions, /v1/chat/completions
//       without "stream": true: one small JSON completion (id, object, choices[0], usage);
//       with it: --tokens SSE events, one chunk each, then "data: [DONE]", all queued at once.
//   GET /health: 200.
//
// The first stdout line is "listening on http://127.0.0.1:PORT" (scripts start it with --port 0).
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/stop_signals.h"
#include "net/http_server.h"

namespace {

// Prebuilt answers of one endpoint.
struct Answers {
  std::string complete;             // the non-streaming body
  std::vector<std::string> events;  // the SSE events, "data: ...\n\n" each, [DONE] last
};

Answers completion_answers(int tokens) {
  Answers a;
  const std::string usage = R"("usage":{"prompt_tokens":8,"completion_tokens":)" +
                            std::to_string(tokens) + R"(,"total_tokens":)" +
                            std::to_string(8 + tokens) + "}";
  std::string text;
  for (int i = 0; i < tokens; ++i) text += " tok";
  a.complete = R"({"id":"cmpl-bench0000000000000000","object":"text_completion","created":0,)"
               R"("model":"bench","choices":[{"index":0,"text":")" +
               text + R"(","logprobs":null,"finish_reason":"length"}],)" + usage + "}";
  for (int i = 0; i < tokens; ++i) {
    const char* finish = i + 1 == tokens ? R"("length")" : "null";
    a.events.push_back(
        R"(data: {"id":"cmpl-bench0000000000000000","object":"text_completion","created":0,)"
        R"("model":"bench","choices":[{"index":0,"text":" tok","logprobs":null,"finish_reason":)" +
        std::string(finish) + "}]}\n\n");
  }
  a.events.push_back("data: [DONE]\n\n");
  return a;
}

Answers chat_answers(int tokens) {
  Answers a;
  const std::string usage = R"("usage":{"prompt_tokens":8,"completion_tokens":)" +
                            std::to_string(tokens) + R"(,"total_tokens":)" +
                            std::to_string(8 + tokens) + "}";
  std::string text;
  for (int i = 0; i < tokens; ++i) text += " tok";
  a.complete =
      R"({"id":"chatcmpl-bench0000000000000000","object":"chat.completion","created":0,)"
      R"("model":"bench","choices":[{"index":0,"message":{"role":"assistant","content":")" +
      text + R"("},"logprobs":null,"finish_reason":"length"}],)" + usage + "}";
  for (int i = 0; i < tokens; ++i) {
    const char* finish = i + 1 == tokens ? R"("length")" : "null";
    a.events.push_back(
        R"(data: {"id":"chatcmpl-bench0000000000000000","object":"chat.completion.chunk",)"
        R"("created":0,"model":"bench","choices":[{"index":0,"delta":{"content":" tok"},)"
        R"("logprobs":null,"finish_reason":)" +
        std::string(finish) + "}]}\n\n");
  }
  a.events.push_back("data: [DONE]\n\n");
  return a;
}

// A substring check, not a JSON parse: the backend should cost as little as possible per request,
// and the benchmark's bodies are written by the script.
bool wants_stream(std::string_view body) {
  return body.find("\"stream\":true") != std::string_view::npos ||
         body.find("\"stream\": true") != std::string_view::npos;
}

tandem::net::Handler answer_with(std::shared_ptr<const Answers> answers) {
  return [answers](const tandem::net::HttpRequest& req, std::shared_ptr<tandem::net::Exchange> ex) {
    if (!wants_stream(req.body)) {
      ex->respond(200, answers->complete);
      return;
    }
    ex->start_stream();
    for (const auto& event : answers->events) ex->write(event);
    ex->end();
  };
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Fast OpenAI-compatible backend: answers completions at once (proxy benchmarks)"};
  int port = 0, threads = 1, tokens = 16;
  app.add_option("--port", port, "port (0: any free port)")->check(CLI::Range(0, 65535));
  app.add_option("--threads", threads, "HTTP io threads")->check(CLI::Range(1, 64));
  app.add_option("--tokens", tokens, "tokens per completion (SSE events per stream)")
      ->check(CLI::Range(1, 100000));
  CLI11_PARSE(app, argc, argv);

  const tandem::cli::StopSignals stop_signals;  // before the io threads start
  tandem::net::HttpServerOptions options;
  options.host = "127.0.0.1";
  options.port = static_cast<uint16_t>(port);
  options.threads = threads;
  tandem::net::HttpServer server(options);
  server.route("GET", "/health",
               [](const tandem::net::HttpRequest&, std::shared_ptr<tandem::net::Exchange> ex) {
                 ex->respond(200, "", "text/plain");
               });
  server.route("POST", "/v1/completions",
               answer_with(std::make_shared<const Answers>(completion_answers(tokens))));
  server.route("POST", "/v1/chat/completions",
               answer_with(std::make_shared<const Answers>(chat_answers(tokens))));
  server.start();
  std::printf("listening on http://127.0.0.1:%u\n", static_cast<unsigned>(server.port()));
  std::fflush(stdout);
  stop_signals.wait();
  server.stop();
  return 0;
}
