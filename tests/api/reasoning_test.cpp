// Reasoning read apart from the answer (--reasoning-parser deepseek_r1 / qwen3): the rules of
// vLLM's parsers on whole answers, every answer also streamed in random splits (a stream must
// fold to the whole answer), the prompts of Qwen3's real template, and the chat bodies and chunks
// the response builder renders, with tool calls read in the content alone.
#include "api/reasoning.h"

#include <gtest/gtest.h>

#include <random>

#include "api/api_test_support.h"
#include "api/request.h"
#include "api/response.h"
#include "text/chat_template.h"

namespace tandem::api {
namespace {

using nlohmann::json;

using api_test::qwen3;
using api_test::qwen3_template;

ReasoningDelta parse_whole(std::string_view answer, bool all_content) {
  ReasoningParser p(all_content);
  ReasoningDelta d = p.feed(answer);
  ReasoningDelta rest = p.finish();
  d.reasoning += rest.reasoning;
  d.content += rest.content;
  return d;
}

// Whole, then in 50 random splits: the same reasoning and content.
ReasoningDelta parse_every_way(std::string_view answer, bool all_content = false) {
  const ReasoningDelta whole = parse_whole(answer, all_content);
  for (uint32_t seed = 0; seed < 50; ++seed) {
    SCOPED_TRACE("split seed " + std::to_string(seed));
    std::mt19937 rng(seed);
    ReasoningParser p(all_content);
    ReasoningDelta folded;
    for (size_t at = 0; at < answer.size();) {
      const size_t n = std::uniform_int_distribution<size_t>(0, 9)(rng);
      const ReasoningDelta d = p.feed(answer.substr(at, n));
      folded.reasoning += d.reasoning;
      folded.content += d.content;
      if (!d.content.empty()) {
        EXPECT_EQ(folded.reasoning, whole.reasoning) << "content comes after all reasoning";
      }
      at += n;
    }
    const ReasoningDelta d = p.finish();
    folded.reasoning += d.reasoning;
    folded.content += d.content;
    EXPECT_EQ(folded.reasoning, whole.reasoning);
    EXPECT_EQ(folded.content, whole.content);
  }
  return whole;
}

// vLLM's extract_reasoning: an opening <think> is dropped, the text before the first </think> is
// reasoning and the rest content as written; without </think> all of it is reasoning.
TEST(Reasoning, ThinkBlocksSplitAsVllmSplitsThem) {
  struct Case {
    std::string answer, reasoning, content;
  };
  const std::vector<Case> cases = {
      // R1's template ends the prompt with <think>\n: the answer starts inside its reasoning.
      {"Let me think.\n</think>\n\nThe answer is 4.", "Let me think.\n", "\n\nThe answer is 4."},
      // Qwen3 (and R1's first template): the model opens it.
      {"<think>\nHmm.\n</think>\n\nHi!", "\nHmm.\n", "\n\nHi!"},
      {"\n<think>x</think>", "x", ""},
      {"<think>\n\n</think>\n\nHi", "\n\n", "\n\nHi"},
      // Cut off while thinking: all reasoning, markers held back included.
      {"<think>still thinking", "still thinking", ""},
      {"still thinking </thi", "still thinking </thi", ""},
      {"<thi", "<thi", ""},
      {"", "", ""},
      // The first </think> ends it; what follows is content as written.
      {"a</think>b</think>c<think>d", "a", "b</think>c<think>d"},
      // Only an opening marker at the start opens: a later one is reasoning text.
      {"x<think>y</think>z", "x<think>y", "z"},
      {"<think><think>y</think>", "<think>y", ""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.answer);
    const ReasoningDelta d = parse_every_way(c.answer);
    EXPECT_EQ(d.reasoning, c.reasoning);
    EXPECT_EQ(d.content, c.content);
  }
  // The prompt closed the reasoning: everything is content, markers included.
  const ReasoningDelta d = parse_every_way("<think>a</think>b", true);
  EXPECT_EQ(d.reasoning, "");
  EXPECT_EQ(d.content, "<think>a</think>b");
}

TEST(Reasoning, FormatsAreNamedAsVllmNamesThem) {
  EXPECT_EQ(reasoning_format_named("deepseek_r1"), ReasoningFormat::kDeepSeekR1);
  EXPECT_EQ(reasoning_format_named("qwen3"), ReasoningFormat::kQwen3);
  EXPECT_FALSE(reasoning_format_named("deepseek-r1"));
  EXPECT_EQ(reasoning_format_name(ReasoningFormat::kQwen3), "qwen3");
}

// Qwen3's own template: enable_thinking false writes an empty think block into the prompt (the
// answer is content); thinking on, the model opens it. A </think> of an earlier turn (shown after
// a tool result) does not end this answer's reasoning.
TEST(Reasoning, QwenThinkingSwitchAndEarlierTurnsAsItsTemplateWritesThem) {
  const ModelLimits limits{.model_name = "m",
                           .max_model_len = 4096,
                           .vocab_size = 151936,
                           .reasoning = ReasoningFormat::kQwen3};
  auto parse = [&](json body) {
    body["model"] = "m";
    if (!body.contains("messages")) body["messages"] = {{{"role", "user"}, {"content", "hi"}}};
    return parse_chat(body, qwen3(), &qwen3_template(), limits);
  };
  const ApiRequest on = parse(json::object());
  EXPECT_EQ(on.reasoning, ReasoningFormat::kQwen3);
  EXPECT_FALSE(on.reasoning_all_content);
  const ApiRequest off = parse({{"chat_template_kwargs", {{"enable_thinking", false}}}});
  EXPECT_TRUE(off.reasoning_all_content);
  EXPECT_TRUE(prompt_ends_reasoning(qwen3().decode(off.prompts[0], false)));
  const ApiRequest after_tool =
      parse({{"messages",
              {{{"role", "user"}, {"content", "weather?"}},
               {{"role", "assistant"},
                {"content", "<think>\nlook it up\n</think>\n\n"},
                {"tool_calls",
                 {{{"id", "c1"},
                   {"type", "function"},
                   {"function", {{"name", "w"}, {"arguments", "{}"}}}}}}},
               {{"role", "tool"}, {"tool_call_id", "c1"}, {"content", "sunny"}}}}});
  const std::string prompt = qwen3().decode(after_tool.prompts[0], false);
  ASSERT_NE(prompt.find("</think>"), std::string::npos) << prompt;  // the earlier turn's
  EXPECT_FALSE(after_tool.reasoning_all_content);
  // A forced call or schema holds after the reasoning, as vLLM applies it once its parser's end
  // token (</think>) was generated: the answer is read apart. With the reasoning ended by the
  // prompt it holds from the first token, and the answer is content.
  const auto think_end = qwen3().token_to_id("</think>");
  ASSERT_TRUE(think_end);
  const json tool = {{"type", "function"},
                     {"function", {{"name", "w"}, {"parameters", {{"type", "object"}}}}}};
  for (const json& constrained :
       {json{{"response_format", {{"type", "json_object"}}}},
        json{{"tools", json::array({tool})}, {"tool_choice", "required"}}}) {
    SCOPED_TRACE(constrained.dump());
    const ApiRequest forced = parse(constrained);
    ASSERT_TRUE(forced.sampling.structured_output);
    EXPECT_FALSE(forced.reasoning_all_content);
    EXPECT_EQ(forced.sampling.reasoning_end_token, think_end);
    json thinking_off = constrained;
    thinking_off["chat_template_kwargs"] = {{"enable_thinking", false}};
    const ApiRequest forced_off = parse(thinking_off);
    EXPECT_TRUE(forced_off.reasoning_all_content);
    EXPECT_FALSE(forced_off.sampling.reasoning_end_token);
  }
  EXPECT_FALSE(on.sampling.reasoning_end_token);  // nothing to constrain
  // Without a reasoning parser nothing is read apart.
  const ModelLimits plain{.model_name = "m", .max_model_len = 4096, .vocab_size = 151936};
  json body = {{"model", "m"}, {"messages", {{{"role", "user"}, {"content", "hi"}}}}};
  EXPECT_EQ(parse_chat(body, qwen3(), &qwen3_template(), plain).reasoning, ReasoningFormat::kNone);
  body["response_format"] = {{"type", "json_object"}};
  EXPECT_FALSE(parse_chat(body, qwen3(), &qwen3_template(), plain).sampling.reasoning_end_token);
}

// continue_final_message: the answer goes on from the client's final message, so that message's
// last <think> or </think> decides whether its reasoning is still open (vLLM's parsers scan the
// prompt's ids from the end); without either, what the template wrote before it does (Qwen3's
// writes a final message's reasoning_content as a closed think block in front of its content).
TEST(Reasoning, AContinuedFinalMessageThatClosedItsReasoningIsConstrainedFromItsFirstToken) {
  const ModelLimits limits{.model_name = "m",
                           .max_model_len = 4096,
                           .vocab_size = 151936,
                           .reasoning = ReasoningFormat::kQwen3};
  const text::ChatTemplate verbatim(
      "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}");
  const auto think_end = qwen3().token_to_id("</think>");
  ASSERT_TRUE(think_end);
  auto parse = [&](const json& final_message, const text::ChatTemplate& tmpl) {
    json last = final_message;
    last["role"] = "assistant";
    const json body = {{"model", "m"},
                       {"messages", {{{"role", "user"}, {"content", "hi"}}, last}},
                       {"add_generation_prompt", false},
                       {"continue_final_message", true},
                       {"response_format", {{"type", "json_object"}}}};
    return parse_chat(body, qwen3(), &tmpl, limits);
  };
  struct Case {
    const text::ChatTemplate* tmpl;
    json message;
    bool closed;
  };
  // The closed one has written none of the answer (what a constrained answer needs: below).
  const std::vector<Case> cases = {
      {&verbatim, {{"content", "<think>x</think>"}}, true},
      {&verbatim, {{"content", "<think>x</think> <think>still thinking"}}, false},
      {&qwen3_template(), {{"content", "<think>still thinking"}}, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message.dump());
    const ApiRequest r = parse(c.message, *c.tmpl);
    SCOPED_TRACE(qwen3().decode(r.prompts[0], false));
    EXPECT_EQ(r.reasoning_all_content, c.closed);
    if (c.closed)
      EXPECT_FALSE(r.sampling.reasoning_end_token);
    else
      EXPECT_EQ(r.sampling.reasoning_end_token, think_end);
  }
}

// A grammar holds from the answer's first generated token, so a constrained answer cannot go on
// from answer text that a continued final message already wrote (after its reasoning closed, or
// without a reasoning parser at all): vLLM's grammar starts over after it, leaving a message of
// that text and a second whole answer. The request is refused, naming both fields; the same
// message continued unconstrained, or still thinking, is served.
TEST(Reasoning, AConstrainedAnswerIsRefusedWhereTheContinuedMessageAlreadyWroteSomeOfIt) {
  const ModelLimits qwen3_parser{.model_name = "m",
                                 .max_model_len = 4096,
                                 .vocab_size = 151936,
                                 .reasoning = ReasoningFormat::kQwen3};
  const ModelLimits no_parser{.model_name = "m", .max_model_len = 4096, .vocab_size = 151936};
  const text::ChatTemplate verbatim(
      "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}");
  const json tool = {{"type", "function"},
                     {"function", {{"name", "w"}, {"parameters", {{"type", "object"}}}}}};
  const json json_object = {{"response_format", {{"type", "json_object"}}}};
  const json forced_call = {{"tools", json::array({tool})}, {"tool_choice", "required"}};
  auto body_of = [](const json& final_message, const json& constraint) {
    json last = final_message;
    last["role"] = "assistant";
    json body = {{"model", "m"},
                 {"messages", {{{"role", "user"}, {"content", "hi"}}, last}},
                 {"add_generation_prompt", false},
                 {"continue_final_message", true}};
    body.update(constraint);
    return body;
  };
  struct Case {
    const text::ChatTemplate* tmpl;
    const ModelLimits* limits;
    json message;
  };
  const std::vector<Case> written = {
      {&verbatim, &qwen3_parser, {{"content", "<think>x</think>\n\n{\"a\": "}}},
      {&qwen3_template(), &qwen3_parser, {{"content", "{\"a\": "}, {"reasoning_content", "x"}}},
      {&verbatim, &no_parser, {{"content", "{\"a\": "}}},
      {&verbatim, &no_parser, {{"content", "<think>x</think>"}}},  // no parser: all answer
  };
  for (const Case& c : written)
    for (const json& constraint : {json_object, forced_call}) {
      SCOPED_TRACE(c.message.dump() + " " + constraint.dump());
      const json body = body_of(c.message, constraint);
      const ApiError e = api_test::error_of([&] { parse_chat(body, qwen3(), c.tmpl, *c.limits); });
      EXPECT_EQ(e.status, 400);
      EXPECT_EQ(e.param, "continue_final_message");
      const std::string field = constraint.contains("tools") ? "tool_choice" : "response_format";
      EXPECT_NE(e.message.find("'" + field + "'"), std::string::npos) << e.message;
      // Its reasoning may stay only where a parser reads it apart.
      EXPECT_EQ(e.message.find("reasoning may stay") != std::string::npos,
                c.limits->reasoning != ReasoningFormat::kNone)
          << e.message;
      // Unconstrained, the same message is continued.
      const ApiRequest unconstrained =
          parse_chat(body_of(c.message, json::object()), qwen3(), c.tmpl, *c.limits);
      EXPECT_FALSE(unconstrained.sampling.structured_output);
    }
  // Still thinking, the grammar waits for the </think> the model writes: nothing was written.
  const ApiRequest thinking =
      parse_chat(body_of({{"content", "<think>x"}}, json_object), qwen3(), &verbatim, qwen3_parser);
  EXPECT_EQ(thinking.sampling.reasoning_end_token, qwen3().token_to_id("</think>"));
}

// A ChatML template whose generation prompt ends with `after_assistant` after the assistant's
// header.
text::ChatTemplate chatml(const std::string& after_assistant) {
  return text::ChatTemplate(
      "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
      "{% if add_generation_prompt %}<|im_start|>assistant\n" +
      after_assistant + "{% endif %}");
}

// enable_thinking false with a template that opens the think block anyway (Qwen3-Thinking-2507's,
// QwQ's): the reasoning is open, so the grammar waits for </think> and the answer is split there,
// as vLLM's qwen3 parser splits an answer that writes </think>, thinking off or not.
TEST(Reasoning, AThinkBlockTheTemplateOpensAnywayStaysOpenWithThinkingSwitchedOff) {
  const ModelLimits limits{.model_name = "m",
                           .max_model_len = 4096,
                           .vocab_size = 151936,
                           .reasoning = ReasoningFormat::kQwen3};
  const text::ChatTemplate always_thinks = chatml("<think>\n");
  const json body = {{"model", "m"},
                     {"messages", {{{"role", "user"}, {"content", "hi"}}}},
                     {"chat_template_kwargs", {{"enable_thinking", false}}},
                     {"response_format", {{"type", "json_object"}}}};
  const ApiRequest r = parse_chat(body, qwen3(), &always_thinks, limits);
  EXPECT_FALSE(r.reasoning_all_content);
  EXPECT_EQ(r.sampling.reasoning_end_token, qwen3().token_to_id("</think>"));
  // vLLM's qwen3 parser splits at the </think> the answer writes, thinking off or not: the JSON
  // the grammar held is the content, and the text before it the reasoning.
  const ReasoningDelta answer = parse_every_way("r</think>{\"a\": 1}", r.reasoning_all_content);
  EXPECT_EQ(answer.reasoning, "r");
  EXPECT_EQ(answer.content, "{\"a\": 1}");
}

// A template without think markers (Qwen3-Instruct-2507's, a --chat-template override) never
// closes the reasoning in the prompt: with enable_thinking false the answer is content, whole and
// streamed, as vLLM's qwen3 parser reads it; thinking on, an answer without </think> is reasoning.
TEST(Reasoning, AnAnswerWithThinkingSwitchedOffIsContentWhenTheTemplateWritesNoThinkMarkers) {
  const ModelLimits limits{.model_name = "m",
                           .max_model_len = 4096,
                           .vocab_size = 151936,
                           .reasoning = ReasoningFormat::kQwen3};
  const text::ChatTemplate no_markers = chatml("");
  json body = {{"model", "m"},
               {"messages", {{{"role", "user"}, {"content", "hi"}}}},
               {"chat_template_kwargs", {{"enable_thinking", false}}}};
  const ApiRequest off = parse_chat(body, qwen3(), &no_markers, limits);
  EXPECT_FALSE(prompt_ends_reasoning(qwen3().decode(off.prompts[0], false)));
  EXPECT_TRUE(off.reasoning_all_content);
  EXPECT_EQ(parse_every_way("Hello!", off.reasoning_all_content).content, "Hello!");
  // Read as content, a constrained answer is constrained from its first token: waiting for a
  // </think> that a model told not to think never writes would leave it unconstrained.
  body["response_format"] = {{"type", "json_object"}};
  const ApiRequest constrained = parse_chat(body, qwen3(), &no_markers, limits);
  EXPECT_TRUE(constrained.reasoning_all_content);
  EXPECT_FALSE(constrained.sampling.reasoning_end_token);
  body["chat_template_kwargs"] = {{"enable_thinking", true}};
  const ApiRequest on = parse_chat(body, qwen3(), &no_markers, limits);
  EXPECT_FALSE(on.reasoning_all_content);
  EXPECT_EQ(on.sampling.reasoning_end_token, qwen3().token_to_id("</think>"));
}

struct Rendered {
  json message;                            // whole
  std::string reasoning, content, finish;  // streamed, folded
  std::vector<std::string> names, arguments;
  bool reasoning_under_both_names = true;
};

// One answer through the response builder, whole or streamed in pieces of `step` bytes.
Rendered render(ApiRequest request, const std::string& answer, bool stream, size_t step) {
  request.kind = ApiKind::kChat;
  request.model = "m";
  request.prompts = {{1}};
  request.stream = stream;
  ResponseBuilder b(request, qwen3(), "chatcmpl-1", 0);
  Rendered r;
  for (size_t at = 0; at < answer.size() || at == 0; at += step) {
    RequestOutput o;
    o.text = answer.substr(at, step);
    o.tokens = {1};
    o.finished = at + step >= answer.size();
    o.finish_reason = "stop";
    for (const json& c : b.on_output(0, o)) {
      const json& choice = c["choices"][0];
      if (!choice["finish_reason"].is_null()) r.finish = choice["finish_reason"];
      const json& delta = choice["delta"];
      if (delta.contains("reasoning_content")) {
        r.reasoning += delta["reasoning_content"].get<std::string>();
        r.reasoning_under_both_names &= delta["reasoning"] == delta["reasoning_content"];
      }
      if (delta.contains("content")) r.content += delta["content"].get<std::string>();
      for (const json& call : delta.value("tool_calls", json::array())) {
        const size_t k = call["index"];
        if (k >= r.arguments.size()) r.arguments.resize(k + 1), r.names.resize(k + 1);
        if (call["function"].contains("name")) r.names[k] = call["function"]["name"];
        r.arguments[k] += call["function"]["arguments"].get<std::string>();
      }
    }
  }
  if (!stream) r.message = b.final_body()["choices"][0]["message"];
  if (!stream) r.finish = b.final_body()["choices"][0]["finish_reason"];
  return r;
}

// The chat answer: message.reasoning_content (and reasoning, vLLM's newer name) beside content,
// null for a part the answer lacks; streamed, delta.reasoning_content pieces that add up to the
// same. Tool calls are read in the content after the reasoning only.
TEST(Reasoning, ChatAnswersCarryReasoningWholeAndStreamed) {
  ApiRequest request;
  request.reasoning = ReasoningFormat::kDeepSeekR1;
  const std::string answer = "<think>\nThe user greets.\n</think>\n\nHello!";
  for (size_t step : {1, 3, 7, 100}) {
    SCOPED_TRACE(step);
    const Rendered whole = render(request, answer, false, step);
    EXPECT_EQ(whole.message["reasoning_content"], "\nThe user greets.\n");
    EXPECT_EQ(whole.message["reasoning"], "\nThe user greets.\n");
    EXPECT_EQ(whole.message["content"], "\n\nHello!");
    EXPECT_EQ(whole.finish, "stop");
    const Rendered streamed = render(request, answer, true, step);
    EXPECT_EQ(streamed.reasoning, "\nThe user greets.\n");
    EXPECT_EQ(streamed.content, "\n\nHello!");
    EXPECT_TRUE(streamed.reasoning_under_both_names);
    EXPECT_EQ(streamed.finish, "stop");
  }
  // Cut off while thinking: no content.
  const Rendered cut = render(request, "<think>\nstill", false, 4);
  EXPECT_EQ(cut.message["reasoning_content"], "\nstill");
  EXPECT_TRUE(cut.message["content"].is_null());
  // The prompt ended the reasoning: no reasoning, content as written.
  request.reasoning_all_content = true;
  const Rendered off = render(request, "Hello", false, 2);
  EXPECT_TRUE(off.message["reasoning_content"].is_null());
  EXPECT_EQ(off.message["content"], "Hello");

  // With tools: a call written while thinking is reasoning; the one after </think> is the call.
  ApiRequest tools;
  tools.reasoning = ReasoningFormat::kQwen3;
  tools.tool_calls = ToolCallFormat::kHermes;
  const std::string call =
      "<tool_call>\n{\"name\": \"w\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
  const std::string with_call = "<think>\nMaybe " + call + "?\n</think>\n\n" + call;
  for (bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "streamed" : "whole");
    const Rendered r = render(tools, with_call, stream, 5);
    const std::string reasoning = "\nMaybe " + call + "?\n";
    if (!stream) {
      EXPECT_EQ(r.message["reasoning_content"], reasoning);
      EXPECT_TRUE(r.message["content"].is_null());
      ASSERT_EQ(r.message["tool_calls"].size(), 1u);
      EXPECT_EQ(r.message["tool_calls"][0]["function"]["arguments"], R"({"city": "Paris"})");
    } else {
      EXPECT_EQ(r.reasoning, reasoning);
      EXPECT_EQ(r.content, "");
      ASSERT_EQ(r.arguments.size(), 1u);
      EXPECT_EQ(r.names[0], "w");
      EXPECT_EQ(r.arguments[0], R"({"city": "Paris"})");
    }
    EXPECT_EQ(r.finish, "tool_calls");
  }
}

}  // namespace
}  // namespace tandem::api
