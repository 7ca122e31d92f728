// Structured outputs against independent judges: texts the regex grammars accept or refuse,
// compared with Python's re (\d \w ASCII, \s Unicode); answers produced by random walks over
// the token masks of a real vocabulary (DeepSeek-V3's), validated by the jsonschema package. Every
// step of every walk checks that the mask leaves a token (or the answer is complete).
#include <gtest/gtest.h>
#include <pthread.h>

#include <cmath>
#include <cstdio>
#include <exception>
#include <functional>
#include <random>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "structured/json_schema.h"
#include "structured/matcher.h"
#include "structured/ordered_json.h"
#include "structured/output_spec.h"
#include "structured/regex.h"
#include "structured/token_constraint.h"
#include "structured/tool_call_grammar.h"
#include "text/oracle_support.h"
#include "util/error.h"
#include "util/file.h"

namespace tandem::structured {
namespace {

using nlohmann::json;

// Runs the Python oracle `script` (tests/oracle) on `input`; its answer.
json run_oracle(const std::string& script, const json& input) {
  const auto in = test::temp_path("oracle-in"), out = test::temp_path("oracle-out");
  write_file_atomically(in, input.dump());
  const int rc = test::run_command("/usr/bin/python3 " + test::quote(test::oracle_dir() / script) +
                                   " < " + test::quote(in) + " > " + test::quote(out));
  EXPECT_EQ(rc, 0) << script << " failed (it needs Debian's python3-jsonschema: "
                   << "scripts/install-deps.sh)";
  json result = rc == 0 ? json::parse(read_file(out)) : json();
  std::filesystem::remove(in);
  std::filesystem::remove(out);
  return result;
}

// The structured-output oracle's answer on `input`.
json oracle(const json& input) {
  return run_oracle("structured_output_oracle.py", input);
}

bool full_match(const std::shared_ptr<const Grammar>& g, const std::string& text) {
  GrammarMatcher m(g);
  return m.advance(text) && m.accepting();
}

// A text the grammar accepts, byte by byte at random (nullopt when it grew past max_bytes).
std::optional<std::string> random_sentence(const std::shared_ptr<const Grammar>& g,
                                           std::mt19937& rng, size_t max_bytes) {
  GrammarMatcher m(g);
  std::string text;
  while (text.size() < max_bytes) {
    if (m.accepting() && (!m.can_continue() || rng() % 3 == 0)) return text;
    const ByteSet next = m.next_bytes();
    std::vector<uint8_t> choices;
    for (int b = 0; b < 256; ++b)
      if (next.test(size_t(b))) choices.push_back(uint8_t(b));
    EXPECT_FALSE(choices.empty());
    if (choices.empty()) return std::nullopt;
    const char c = static_cast<char>(choices[rng() % choices.size()]);
    EXPECT_TRUE(m.advance(std::string(1, c)));
    text.push_back(c);
  }
  return std::nullopt;
}

// ASCII edits of a text (multi-byte characters are left whole, so it stays UTF-8).
std::string mutate(std::string text, std::mt19937& rng) {
  const std::string alphabet = "ab019-+._@ xe\\\n\xc3\xa9";
  const int edits = 1 + int(rng() % 2);
  for (int e = 0; e < edits; ++e) {
    std::vector<size_t> ascii;
    for (size_t i = 0; i < text.size(); ++i)
      if (static_cast<unsigned char>(text[i]) < 0x80) ascii.push_back(i);
    const size_t kind = rng() % 3;
    const size_t at = ascii.empty() ? text.size() : ascii[rng() % ascii.size()];
    const char c = alphabet[rng() % (alphabet.size() - 2)];
    if (kind == 0 || ascii.empty())
      text.insert(std::min(at, text.size()), 1, c);
    else if (kind == 1)
      text.erase(at, 1);
    else
      text[at] = c;
  }
  return text;
}

// Runs `f` on a thread with a 1 MiB stack (an eighth of the usual default), so that recursion
// that grows with the input crashes the test instead of passing on a roomy main thread.
void on_small_stack(const std::function<void()>& f) {
  struct Call {
    const std::function<void()>* f;
    std::exception_ptr error;
  } call{&f, nullptr};
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  // Sanitizers' frames are several times larger; the limits are judged on the plain build.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  pthread_attr_setstacksize(&attr, 16u << 20);
#else
  pthread_attr_setstacksize(&attr, 1u << 20);
#endif
  pthread_t thread;
  ASSERT_EQ(pthread_create(
                &thread, &attr,
                [](void* arg) -> void* {
                  auto* c = static_cast<Call*>(arg);
                  try {
                    (*c->f)();
                  } catch (...) {
                    c->error = std::current_exception();
                  }
                  return nullptr;
                },
                &call),
            0);
  pthread_join(thread, nullptr);
  pthread_attr_destroy(&attr);
  if (call.error) std::rethrow_exception(call.error);
}

std::string compile_error(OutputSpec::Kind kind, const std::string& text) {
  std::string error = "(compiled)";
  on_small_stack([&] {
    try {
      compile({kind, text, "f"});
    } catch (const Error& e) {
      error = e.what();
    }
  });
  return error;
}

// What compiling a JSON schema says: its error, or "(compiled)".
std::string schema_error(const json& schema) {
  return compile_error(OutputSpec::Kind::kJsonSchema, schema.dump());
}

std::string nested_groups(int depth) {
  return std::string(size_t(depth), '(') + "a" + std::string(size_t(depth), ')');
}

// (?:a|b(?:a|b(?:...)+)+)+ with `depth` groups: each a repeat of a choice holding a sequence,
// so that the tree (and the recursion that emits it) nests as deep as the groups.
std::string nested_choices(int depth) {
  std::string pattern = "a";
  for (int i = 0; i < depth; ++i) pattern = "(?:a|b" + pattern + ")+";
  return pattern;
}

// {"$ref": "#/$defs/a0"}, each a<i> a $ref to a<i+1>, the last a string.
std::string ref_chain(int length) {
  auto name = [](int i) {
    std::string n = "a";
    n += std::to_string(i);
    return n;
  };
  json defs = json::object();
  for (int i = 0; i < length; ++i) defs[name(i)] = {{"$ref", "#/$defs/" + name(i + 1)}};
  defs[name(length)] = {{"type", "string"}};
  return json{{"$defs", defs}, {"$ref", "#/$defs/a0"}}.dump();
}

// The compilers recurse once per level of nesting: past the limit they refuse the spec (a 400
// for the request) instead of running off the end of the thread's stack.
TEST(StructuredOutput, NestingPastTheLimitIsRefusedWhereTheLimitFitsASmallStack) {
  using K = OutputSpec::Kind;
  const int limit = Grammar::kMaxNesting;
  EXPECT_EQ(compile_error(K::kRegex, nested_groups(limit)), "(compiled)");
  EXPECT_EQ(compile_error(K::kRegex, nested_choices(limit)), "(compiled)");
  EXPECT_EQ(schema_error({{"type", "string"}, {"pattern", nested_choices(limit)}}), "(compiled)");
  EXPECT_EQ(compile_error(K::kJsonSchema, ref_chain(limit - 2)), "(compiled)");
  for (int depth : {limit + 1, 200'000}) {
    const std::string regex = compile_error(K::kRegex, nested_groups(depth));
    EXPECT_NE(regex.find("groups nest deeper than 1000 levels"), std::string::npos) << regex;
  }
  const std::string choices = compile_error(K::kRegex, nested_choices(limit + 1));
  EXPECT_NE(choices.find("groups nest deeper than 1000 levels"), std::string::npos) << choices;
  // (Chains of more than 4096 $defs are refused for the size of that object, below.)
  for (int length : {limit + 1, 4000}) {
    const std::string schema = compile_error(K::kJsonSchema, ref_chain(length));
    EXPECT_NE(schema.find("schemas nest deeper than 1000 levels"), std::string::npos) << schema;
  }
  // Sibling groups and a $ref used many times are not nesting.
  std::string siblings;
  for (int i = 0; i < 3 * limit; ++i) siblings += "(a)";
  EXPECT_EQ(compile_error(K::kRegex, siblings), "(compiled)");
}

// An object of many keys would cost the order-keeping parse quadratic time on the HTTP thread:
// past 4096 keys in one object the spec is refused (with the size), at 4096 it compiles.
TEST(StructuredOutput, ASchemaObjectOfMoreThan4096KeysIsRefusedNamingItsSize) {
  using K = OutputSpec::Kind;
  auto schema_with_defs = [](int n) {
    json defs = json::object();
    for (int i = 0; i < n; ++i) defs["d" + std::to_string(i)] = {{"type", "string"}};
    return json{{"$defs", defs}, {"type", "string"}}.dump();
  };
  EXPECT_EQ(compile_error(K::kJsonSchema, schema_with_defs(4096)), "(compiled)");
  const std::string error = compile_error(K::kJsonSchema, schema_with_defs(200'000));
  EXPECT_NE(error.find("an object of 200000 keys (at most 4096)"), std::string::npos) << error;
  const std::string tools = compile_error(
      K::kToolCalls,
      json::array(
          {{{"type", "function"},
            {"function", {{"name", "f"}, {"parameters", json::parse(schema_with_defs(5000))}}}}})
          .dump());
  EXPECT_NE(tools.find("an object of 5000 keys"), std::string::npos) << tools;
}

// Chains of rules longer than any stack: the left-recursion check and the matcher's expansion
// walk them without recursing.
TEST(StructuredOutput, LongChainsOfRulesAreCheckedAndMatchedWithoutRecursion) {
  on_small_stack([] {
    auto g = std::make_shared<Grammar>();
    Grammar::Symbol next = g->any_of({{g->byte('x')}});
    for (int i = 0; i < 50'000; ++i) next = g->any_of({{next}, {g->byte('y'), next}});
    g->finish(next);
    EXPECT_TRUE(full_match(g, "x"));
    EXPECT_TRUE(full_match(g, "yyx"));
    EXPECT_FALSE(full_match(g, "xy"));
  });
  // Optional parts one after another: each is entered without reading a byte, so reading 'b'
  // used to nest one expansion per part and fail the answer ("nests too deeply") mid-decoding.
  // (Each 'a' may be read by any part: a byte costs about 6000^2 / 2 rules entered, so a few in
  // one call pass GrammarMatcher::kMaxWork; see AnAmbiguousFormatFailsItsAnswer... below.)
  std::string optional_parts = "b";
  for (int i = 0; i < 6000; ++i) optional_parts += "a?";
  const auto g = compile({OutputSpec::Kind::kRegex, optional_parts, "f"});
  on_small_stack([&] {
    EXPECT_TRUE(full_match(g, "b"));
    EXPECT_TRUE(full_match(g, "ba"));
    EXPECT_FALSE(full_match(g, "bc"));
  });
}

// A recursive schema lets an answer nest as deep as it is long (a client's logit_bias can make
// the model write "[[[[..."): its parse stack grows with it, and dropping the frames it left
// behind must not recurse along it.
TEST(StructuredOutput, AnAnswerNestedAsDeepAsItIsLongIsMatched) {
  const auto g = compile({OutputSpec::Kind::kJsonSchema,
                          R"({"type": "array", "items": {"$ref": "#"}})", "guided_json"});
  on_small_stack([&] {
    GrammarMatcher m(g);
    for (int i = 0; i < 100; ++i) ASSERT_TRUE(m.advance(std::string(1000, '[')));
    EXPECT_TRUE(m.advance("[]]"));
    EXPECT_FALSE(m.accepting());
    EXPECT_FALSE(m.advance("}"));
  });
}

// Our verdicts (ours[i][j]: pattern i on input["regex"][i]["texts"][j]) against Python's re.
void expect_python_re_agrees(const std::vector<std::string>& patterns, const json& input,
                             const std::vector<std::vector<bool>>& ours) {
  const json judged = oracle(input);
  ASSERT_TRUE(judged.contains("regex"));
  for (size_t i = 0; i < patterns.size(); ++i)
    for (size_t j = 0; j < ours[i].size(); ++j)
      EXPECT_EQ(ours[i][j], judged["regex"][i][j].get<bool>())
          << "pattern " << patterns[i] << " text " << input["regex"][i]["texts"][j].dump();
}

TEST(StructuredOutput, RegexGrammarsAcceptExactlyWhatPythonsReFullmatches) {
  const std::vector<std::string> patterns = {
      R"([a-z]+@[a-z]+\.(com|org))",
      R"(\d{3}-\d{4})",
      R"((?:ab|cd)*e?)",
      R"([^0-9\s]{2,5}x)",
      ".{0,3}\xc3\xa9+",
      R"(\w+\s\W)",
      R"(a|b|cc|)",
      R"([\u00e0-\u00ff]{1,3}[-+]?\d+(\.\d+)?)",
      R"(-?(0|[1-9]\d*))",
      R"((a+b?)+c)",
      R"([\]\\-]x[.])",
      R"(^\x41\u00e9{2,}?z$)",
      R"(colou?r|gr[ae]y)",
      // Ambiguous: stacks at one position that return to different places (one stack, its
      // return frame a union), nested and split again.
      R"((\w+ ?){1,20}x)",
      R"((a|b|ab|ba){0,30}x?)",
      R"(((a|ab)(c|bcd)|a(bc)?d*)+)",
      R"(((ab|a)(b|)){2,4}c?)",
  };
  std::mt19937 rng(7);
  json input = {{"regex", json::array()}};
  std::vector<std::vector<bool>> ours;
  for (const auto& p : patterns) {
    SCOPED_TRACE(p);
    const auto g = compile({OutputSpec::Kind::kRegex, p, "guided_regex"});
    json texts = json::array();
    std::vector<bool> got;
    for (int i = 0; i < 40; ++i) {
      auto s = random_sentence(g, rng, 64);
      if (!s) continue;
      EXPECT_TRUE(full_match(g, *s));
      for (const std::string& t : {*s, mutate(*s, rng)}) {
        texts.push_back(t);
        got.push_back(full_match(g, t));
      }
    }
    ASSERT_GT(texts.size(), 10u);
    input["regex"].push_back({{"pattern", p}, {"texts", texts}});
    ours.push_back(got);
  }
  input["flavour"] = "tandem";  // \d \w ASCII, \s Unicode
  expect_python_re_agrees(patterns, input, ours);
}

const text::Tokenizer& deepseek_tokenizer() {
  static const auto tok = std::make_shared<const text::Tokenizer>(
      text::Tokenizer::from_dir(test::lenml_model("deepseek_v3")));
  return *tok;
}

struct Walks {
  std::vector<std::string> complete;
  int cut_off = 0;
};

// Answers sampled uniformly among the tokens each mask allows (ending with EOS half the time
// when the answer is complete), as a model with random weights would write them.
Walks random_walks(StructuredOutputs& outputs, const OutputSpec& spec, int walks, size_t max_tokens,
                   std::mt19937& rng) {
  const text::Tokenizer& tok = deepseek_tokenizer();
  const int32_t eos = *tok.eos_id();
  const std::vector<int32_t> ends = {eos};
  Walks w;
  std::vector<float> logits(tok.vocab_size());
  for (int i = 0; i < walks; ++i) {
    auto c = outputs.start(spec);
    std::string text;
    bool ended = false;
    for (size_t n = 0; n < max_tokens && !ended; ++n) {
      std::fill(logits.begin(), logits.end(), 0.0f);
      c->mask(logits, ends);
      std::vector<int32_t> allowed;
      for (size_t id = 0; id < logits.size(); ++id)
        if (logits[id] == 0.0f) allowed.push_back(static_cast<int32_t>(id));
      EXPECT_FALSE(allowed.empty()) << "the mask forbids every token after " << text;
      if (allowed.empty()) break;
      const bool eos_allowed = logits[size_t(eos)] == 0.0f;
      EXPECT_EQ(eos_allowed, c->complete());
      int32_t pick = allowed[rng() % allowed.size()];
      if (eos_allowed && rng() % 2 == 0) pick = eos;
      c->accept(pick, ends);
      if (pick == eos)
        ended = true;
      else
        text += tok.token_bytes(pick);
    }
    if (ended)
      w.complete.push_back(text);
    else
      ++w.cut_off;
  }
  return w;
}

TEST(StructuredOutput, AnswersSampledThroughTheMasksValidateAgainstTheirSchemas) {
  const std::vector<json> schemas = {
      json::parse(R"({"type": "object", "title": "Person",
        "properties": {"name": {"type": "string", "maxLength": 12, "description": "who"},
                       "age": {"type": "integer"},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                "maxItems": 3},
                       "ok": {"type": "boolean"}},
        "required": ["name", "age"], "additionalProperties": false})"),
      json::parse(R"({"type": "array", "items": {"enum": ["red", "green", 1, null]},
                      "minItems": 1, "maxItems": 4})"),
      json::parse(R"({"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 4},
                                {"type": "null"}]})"),
      json::parse(R"({"$defs": {"node": {"type": "object",
          "properties": {"v": {"type": "integer"},
                         "kids": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                  "maxItems": 2}},
          "required": ["v"]}}, "$ref": "#/$defs/node"})"),
      json::parse(R"({"type": "object", "properties": {"x": {"type": "number"},
          "y": {"type": ["number", "null"]}, "s": {"const": "fixed \"q\" é"}},
          "required": ["x", "y", "s"]})"),
      json::parse(R"({"type": "string", "minLength": 2, "maxLength": 6})"),
      json::parse(R"({"oneOf": [{"type": "integer"}, {"const": 0.5}, {"type": "string",
          "enum": ["a", "b"]}, {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}],
          "description": "oneOf whose schemas no value matches twice"})"),
      json::parse(R"({"type": ["integer", "null"], "enum": [1, null, 7], "title": "n"})"),
      json::parse(R"({"type": "object", "additionalProperties": {"type": "integer"}})"),
      // Nine objects that begin alike: one stack inside their shared field, split after it.
      [] {
        json variants = json::array();
        for (int k = 0; k < 9; ++k)
          variants.push_back({{"type", "object"},
                              {"properties",
                               {{"s", {{"type", "string"}, {"maxLength", 10}}},
                                {"v" + std::to_string(k), {{"type", "integer"}}}}},
                              {"required", {"s", "v" + std::to_string(k)}},
                              {"additionalProperties", false}});
        return json{{"anyOf", variants}};
      }(),
  };
  StructuredOutputs outputs(std::make_shared<const text::Tokenizer>(
      text::Tokenizer::from_dir(test::lenml_model("deepseek_v3"))));
  std::mt19937 rng(11);
  json input = {{"schema", json::array()}};
  for (const auto& schema : schemas) {
    SCOPED_TRACE(schema.dump());
    const Walks w = random_walks(
        outputs, {OutputSpec::Kind::kJsonSchema, schema.dump(), "response_format"}, 12, 200, rng);
    EXPECT_FALSE(w.complete.empty()) << "no walk finished";
    input["schema"].push_back({{"schema", schema}, {"answers", w.complete}});
  }
  const Walks objects =
      random_walks(outputs, {OutputSpec::Kind::kJsonObject, "", "response_format"}, 12, 200, rng);
  EXPECT_FALSE(objects.complete.empty());
  input["schema"].push_back({{"schema", {{"type", "object"}}}, {"answers", objects.complete}});

  const json judged = oracle(input);
  ASSERT_TRUE(judged.contains("schema"));
  size_t validated = 0;
  for (size_t i = 0; i < input["schema"].size(); ++i)
    for (size_t j = 0; j < input["schema"][i]["answers"].size(); ++j) {
      EXPECT_TRUE(judged["schema"][i][j].is_null())
          << input["schema"][i]["schema"].dump() << "\n  answer "
          << input["schema"][i]["answers"][j].dump() << "\n  " << judged["schema"][i][j];
      ++validated;
    }
  EXPECT_GT(validated, 40u);
}

// An ambiguous format (bounded repeats one after another) holds a parse stack per way of reading
// the answer so far, and a mask steps each at every node of the vocabulary's trie: one mask of
// '.{0,10000}.{0,10000}.{0,10000}' at byte 300 took 31 s of the engine's thread. Past
// GrammarMatcher::kMaxWork the call throws ConstraintError, which fails that request alone
// (Speculation.AFormatThatCannotGoOnFailsItsRequestAloneNotItsBatch). Formats that are not
// ambiguous stay well below it in their costliest states, however many choices or properties.
TEST(StructuredOutput, AnAmbiguousFormatFailsItsAnswerInsteadOfSlowingEveryMask) {
  using K = OutputSpec::Kind;
  StructuredOutputs outputs(std::make_shared<const text::Tokenizer>(
      text::Tokenizer::from_dir(test::lenml_model("deepseek_v3"))));
  std::vector<float> logits(deepseek_tokenizer().vocab_size());
  const std::vector<int32_t> ends = {*deepseek_tokenizer().eos_id()};
  int32_t a = -1;  // the token "a"
  for (int32_t id = 0; id < int32_t(logits.size()) && a < 0; ++id)
    if (deepseek_tokenizer().token_bytes(id) == "a") a = id;
  ASSERT_GE(a, 0);
  for (const std::string regex : {".{0,10000}.{0,10000}", ".{0,10000}.{0,10000}.{0,10000}"}) {
    SCOPED_TRACE(regex);
    auto c = outputs.start({K::kRegex, regex, "guided_regex"});
    for (int i = 0; i < 50; ++i) c->accept(a, ends);
    try {
      c->mask(logits, ends);
      ADD_FAILURE() << "the mask was computed";
    } catch (const ConstraintError& e) {
      EXPECT_NE(std::string(e.what()).find("too ambiguous"), std::string::npos) << e.what();
    }
  }

  const MaskVocabulary vocabulary(deepseek_tokenizer());
  std::vector<uint64_t> allowed((vocabulary.size() + 63) / 64);
  auto costliest_mask = [&](K kind, const std::string& text, const std::string& answer) {
    GrammarMatcher matcher(compile({kind, text, "f"}));
    size_t most = 0;
    for (size_t i = 0; i <= answer.size(); ++i) {
      if (i > 0) {
        EXPECT_TRUE(matcher.advance(answer.substr(i - 1, 1))) << answer.substr(0, i);
      }
      matcher.accepted_tokens(vocabulary.trie(), allowed);
      most = std::max(most, matcher.work());
    }
    return most;
  };
  json props = json::object();
  for (int i = 0; i < 4000; ++i) props["p" + std::to_string(i)] = {{"type", "integer"}};
  json choices = json::array();
  for (int i = 0; i < 20000; ++i) choices.push_back("choice number " + std::to_string(i));
  const std::pair<K, std::string> legitimate[][2] = {
      {{K::kJsonSchema, R"({"type": "string", "maxLength": 1000})"}, {K::kJsonSchema, "\"abc"}},
      {{K::kJsonObject, ""}, {K::kJsonObject, R"({"a": [1, "x)"}},
      {{K::kJsonSchema, json{{"type", "object"}, {"properties", props}}.dump()},
       {K::kJsonSchema, R"({ "p12": 5, "p3999": 1})"}},
      {{K::kChoice, choices.dump()}, {K::kChoice, "choice number 123"}},
      {{K::kRegex, R"(\w{0,20}\s?\w{0,20})"}, {K::kRegex, "abcdefghij klmnopqrst"}},
  };
  for (const auto& [spec, answer] : legitimate) {
    SCOPED_TRACE(spec.second.substr(0, 60));
    EXPECT_LT(costliest_mask(spec.first, spec.second, answer.second), GrammarMatcher::kMaxWork / 4);
  }
}

// A union of objects that begin alike is one parse stack while the answer is inside their shared
// first property, whose return frame is a union of the variants' (Pydantic models sharing
// "name"; tool schemas alike): following it costs about what one object costs, however many
// variants. With a stack per variant, 8 of them passed kMaxWork and 16 failed their answers.
TEST(StructuredOutput, AUnionOfObjectsThatBeginAlikeCostsAboutWhatOneObjectCosts) {
  const MaskVocabulary vocabulary(deepseek_tokenizer());
  auto costliest = [&](int count) {
    json variants = json::array();
    for (int k = 0; k < count; ++k)
      variants.push_back(
          {{"type", "object"},
           {"properties",
            {{"name", {{"type", "string"}}}, {"v" + std::to_string(k), {{"type", "integer"}}}}},
           {"required", {"name"}}});
    GrammarMatcher matcher(compile(
        {OutputSpec::Kind::kJsonSchema, json{{"anyOf", variants}}.dump(), "response_format"}));
    std::vector<uint64_t> allowed((vocabulary.size() + 63) / 64);
    const std::string answer = R"({"name": "hello world", "v0": 3})";
    size_t most = 0;
    for (size_t i = 0; i <= answer.size(); ++i) {
      if (i > 0) {
        EXPECT_TRUE(matcher.advance(answer.substr(i - 1, 1))) << answer.substr(0, i);
      }
      EXPECT_NO_THROW(matcher.accepted_tokens(vocabulary.trie(), allowed)) << answer.substr(0, i);
      most = std::max(most, matcher.work());
    }
    EXPECT_TRUE(matcher.accepting()) << count << " variants";
    return most;
  };
  const size_t one = costliest(1), many = costliest(256);
  std::printf("costliest mask: %zu units for one object, %zu for 256\n", one, many);
  EXPECT_LT(many, 2 * one);
}

// The linear order-keeping reader builds what nlohmann::ordered_json's parser builds (key order,
// the last of duplicate keys in the first one's place, numbers, escapes), and refuses what it
// refuses.
TEST(StructuredOutput, OrderedParsingMatchesNlohmannsOrderedParser) {
  for (const std::string text :
       {R"({"z": 1, "a": [true, null, -2, 3.5e3, 18446744073709551615], "m": {"y": "\u00e9\n"}})",
        R"({"b": 1, "a": 2, "b": {"c": 3}, "a": [4]})", R"([[], {}, "", 0])", "  7 ",
        "\xEF\xBB\xBF{\"bom\": 1}"}) {
    SCOPED_TRACE(text);
    const nlohmann::ordered_json ours = parse_ordered(text);
    const nlohmann::ordered_json theirs = nlohmann::ordered_json::parse(text);
    EXPECT_EQ(ours.dump(), theirs.dump());
  }
  for (const std::string bad : {"{\"a\": }", "[1,]", "{\"a\": 1} x", "\"\xff\""})
    EXPECT_THROW(parse_ordered(bad), Error) << bad;
  EXPECT_THROW(parse_ordered(std::string(100, '[') + std::string(100, ']')), Error);
  EXPECT_NO_THROW(parse_ordered(std::string(64, '[') + std::string(64, ']')));
}

// A spec compiled where its request was parsed carries its grammar: the engine takes it instead
// of compiling again on its own thread (a grammar near the size limit took ~1.8 s to compile).
// Here the text no longer compiles, so only the carried grammar can have been used.
TEST(StructuredOutput, AGrammarCompiledWhereTheRequestWasParsedIsNotCompiledAgain) {
  StructuredOutputs outputs(std::make_shared<const text::Tokenizer>(
      text::Tokenizer::from_dir(test::lenml_model("deepseek_v3"))));
  OutputSpec spec{OutputSpec::Kind::kChoice, R"(["yes"])", "guided_choice"};
  spec.compiled = compile(spec);
  spec.text = "[not json";
  auto c = outputs.start(spec);
  std::vector<float> logits(deepseek_tokenizer().vocab_size(), 0.0f);
  c->mask(logits, {});
  size_t allowed = 0;
  for (size_t id = 0; id < logits.size(); ++id)
    if (logits[id] == 0.0f) {
      ++allowed;
      EXPECT_EQ(std::string("yes").rfind(deepseek_tokenizer().token_bytes(int32_t(id)), 0), 0u);
    }
  EXPECT_GT(allowed, 0u);
}

TEST(StructuredOutput, ChoicesAreTheOnlyAnswers) {
  const auto g =
      compile({OutputSpec::Kind::kChoice, R"(["yes", "no", "not sure"])", "guided_choice"});
  for (const std::string t : {"yes", "no", "not sure"}) EXPECT_TRUE(full_match(g, t));
  for (const std::string t : {"ye", "yes ", "not", "maybe", ""}) EXPECT_FALSE(full_match(g, t));
}

// What cannot be enforced is refused with the keyword and where it is, never ignored.
TEST(StructuredOutput, UnsupportedSchemaKeywordsAndRegexConstructsAreNamed) {
  auto error = [](OutputSpec::Kind kind, const std::string& text) {
    try {
      compile({kind, text, "f"});
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(compiled)");
  };
  using K = OutputSpec::Kind;
  EXPECT_NE(error(K::kJsonSchema, R"({"type": "integer", "multipleOf": 2})").find("'multipleOf'"),
            std::string::npos);
  EXPECT_NE(
      error(K::kJsonSchema, R"({"properties": {"d": {"type": "array", "uniqueItems": true}}})")
          .find("#/properties/d: the keyword 'uniqueItems'"),
      std::string::npos);
  EXPECT_NE(error(K::kJsonSchema, R"({"minimum": 0})").find("'minimum'"), std::string::npos);
  EXPECT_NE(error(K::kJsonSchema, R"({"type": "object", "required": ["x"]})").find("required"),
            std::string::npos);
  EXPECT_NE(error(K::kJsonSchema, R"({"$ref": "#/$defs/missing"})").find("#/$defs/missing"),
            std::string::npos);
  EXPECT_NE(error(K::kJsonSchema, R"({"type": "strin"})").find("unknown type"), std::string::npos);
  EXPECT_NE(error(K::kJsonSchema, "{not json").find("JSON"), std::string::npos);
  EXPECT_NE(error(K::kRegex, R"((a)\1)").find("backreferences"), std::string::npos);
  EXPECT_NE(error(K::kRegex, R"(a(?=b))").find("offset"), std::string::npos);
  EXPECT_NE(error(K::kRegex, R"((a*)*)").find("may match nothing"), std::string::npos);
  EXPECT_NE(error(K::kRegex, R"(a{3,1})").find("below its minimum"), std::string::npos);
  EXPECT_NE(error(K::kRegex, "(ab").find("missing ')'"), std::string::npos);
  EXPECT_NE(error(K::kChoice, R"([])").find("non-empty"), std::string::npos);
}

// vLLM's disable_additional_properties (its guidance backend's process_for_additional_properties)
// closes each object schema that lists properties and leaves additionalProperties unsaid, at any
// depth: in properties, items, anyOf, $defs and additionalProperties. Listed properties are
// all an answer writes anyway; what changes is an object schema of no listed properties, which
// allowed any members.
TEST(StructuredOutput, DisablingAdditionalPropertiesClosesObjectSchemasThatListProperties) {
  using K = OutputSpec::Kind;
  auto grammar = [](const std::string& schema, bool closed) {
    OutputSpec spec{K::kJsonSchema, schema, "structured_outputs.json"};
    spec.disable_additional_properties = closed;
    return compile(spec);
  };
  const std::string empty = R"({"type": "object", "properties": {}, "required": []})";
  EXPECT_TRUE(full_match(grammar(empty, false), R"({"a": 1})"));
  EXPECT_TRUE(full_match(grammar(empty, true), "{}"));
  EXPECT_FALSE(full_match(grammar(empty, true), R"({"a": 1})"));
  EXPECT_FALSE(full_match(grammar(empty, true), R"({"": {}})"));
  const std::string nested = R"({"type": "object", "properties": {
      "inner": {"type": "object", "properties": {}},
      "list": {"type": "array", "items": {"properties": {}}},
      "either": {"anyOf": [{"type": "object", "properties": {}}, {"type": "string"}]},
      "ref": {"$ref": "#/$defs/d"},
      "map": {"type": "object", "properties": {}, "additionalProperties": {"properties": {}}},
      "loose": {"type": "object"}},
    "$defs": {"d": {"type": "object", "properties": {}}}})";
  const auto open = grammar(nested, false), closed = grammar(nested, true);
  for (const std::string answer :
       {R"({"inner": {"x": 1}})", R"({"list": [{}, {"x": 1}]})", R"({"either": {"x": 1}})",
        R"({"ref": {"x": 1}})", R"({"map": {"k": {"x": 1}}})"}) {
    EXPECT_TRUE(full_match(open, answer)) << answer;
    EXPECT_FALSE(full_match(closed, answer)) << answer;
  }
  for (const std::string answer :
       {R"({"inner": {}, "list": [{}, {}], "either": {}, "ref": {}, "map": {"k": {}}})",
        R"({"either": "s", "map": {"k": {}, "j": {}}})",
        // An additionalProperties given is kept, and vLLM closes no schema without properties.
        R"({"loose": {"x": {"y": 1}}})"})
    EXPECT_TRUE(full_match(closed, answer)) << answer;
  // Distinct grammars, so distinct cache keys.
  OutputSpec a{K::kJsonSchema, empty, "f"}, b = a;
  b.disable_additional_properties = true;
  EXPECT_NE(a.key(), b.key());
}

// anyOf, oneOf, const and enum compile to a grammar of their own: a constraint beside them would
// not be enforced, so it is refused by name (annotations and a 'type' every value has pass).
// Telling oneOf's schemas apart is bounded work: eight branches that each refer back to the root
// were 8^16 visits (six held an HTTP thread past 8 s and the engine's shutdown with it). Past the
// bound the schemas are taken as overlapping, so this is refused, and promptly.
TEST(StructuredOutput, TellingOneOfsSchemasApartIsBoundedWork) {
  json branches = json::array();
  for (int i = 0; i < 8; ++i) branches.push_back({{"$ref", "#"}});
  const std::string e =
      compile_error(OutputSpec::Kind::kJsonSchema, json{{"oneOf", branches}}.dump());
  EXPECT_NE(e, "(compiled)");
}

TEST(StructuredOutput, ConstraintsBesideAnyOfOneOfConstOrEnumAreRefusedByName) {
  using K = OutputSpec::Kind;
  const std::pair<std::string, std::string> refused[] = {
      {R"({"anyOf": [{"type": "string"}], "maxLength": 2})", "'maxLength' beside 'anyOf'"},
      {R"({"anyOf": [{"type": "object"}], "required": ["a"], "additionalProperties": false})",
       "'required' beside 'anyOf'"},
      {R"({"oneOf": [{"type": "string"}], "items": {"type": "string"}})", "'items' beside 'oneOf'"},
      {R"({"anyOf": [{"type": "string"}], "allOf": [{"type": "string"}]})",
       "'allOf' beside 'anyOf'"},
      {R"({"type": "string", "enum": ["a", 1]})", "#/enum/1: 1 is not of the schema's 'type'"},
      {R"({"type": ["string", "null"], "const": 2.5})", "#/const: 2.5 is not of the schema's"},
      {R"({"type": "integer", "enum": [1, 2.5]})", "#/enum/1: 2.5 is not of the schema's 'type'"},
      {R"({"enum": ["a", "b"], "minLength": 2})", "'minLength' beside 'enum'"},
      {R"({"const": [1], "maxItems": 0})", "'maxItems' beside 'const'"},
      // 5 matches both, so it is not valid under oneOf; the grammar of anyOf would allow it.
      {R"({"oneOf": [{"type": "integer"}, {"type": "number"}]})", "#/oneOf: 'oneOf'"},
      {R"({"oneOf": [{"type": "string"}, {"enum": [1, "x"]}]})", "schemas 0 and 1 may both"},
      {R"({"oneOf": [{"const": 1}, {"enum": [2, 1.0]}]})", "schemas 0 and 1 may both"},
      {R"({"oneOf": [{"type": "object", "required": []}, {"type": "object"}]})",
       "schemas 0 and 1 may both"},
      {R"({"oneOf": [{"type": "null"}, {"description": "anything"}]})", "schemas 0 and 1"},
      // An enum beside a const it does not hold would be a second constraint.
      {R"({"const": "cat", "enum": ["dog"]})", "'enum' beside 'const'"},
      // Objects whose required tags share a value may both match.
      {R"({"oneOf": [{"type": "object", "properties": {"t": {"enum": ["a", "b"]}}, "required": ["t"]},
                     {"type": "object", "properties": {"t": {"const": "b"}}, "required": ["t"]}]})",
       "schemas 0 and 1 may both"},
      // A tag that is not required tells nothing apart.
      {R"({"oneOf": [{"type": "object", "properties": {"t": {"const": "a"}}},
                     {"type": "object", "properties": {"t": {"const": "b"}}}]})",
       "schemas 0 and 1 may both"},
  };
  for (const auto& [schema, named] : refused) {
    const std::string e = compile_error(K::kJsonSchema, schema);
    EXPECT_NE(e.find(named), std::string::npos) << schema << "\n  " << e;
  }
  // Pydantic's optional fields and enums, and oneOf whose schemas no value matches twice.
  const std::string accepted[] = {
      R"({"anyOf": [{"type": "string"}, {"type": "null"}], "default": null, "title": "Name",
          "description": "who", "examples": ["x"], "$comment": "optional"})",
      R"({"enum": ["red", "green"], "title": "Color", "type": "string"})",
      R"({"type": ["integer", "null"], "enum": [1, null, 2.0]})",
      R"({"type": "number", "const": 3})",
      R"({"oneOf": [{"type": "string"}, {"type": "integer"}, {"type": ["null", "boolean"]}]})",
      R"({"oneOf": [{"const": 1}, {"enum": [2, "1"]}, {"type": "string", "enum": ["x"]}]})",
      R"({"oneOf": [{"type": "integer"}, {"const": 1.5}, {"$ref": "#/$defs/s"}],
          "$defs": {"s": {"type": "string"}}})",
      // Pydantic's one-value Literal: a const with an enum of it (and its type).
      R"({"type": "object", "properties": {"k": {"const": "cat", "enum": ["cat"], "type": "string",
          "title": "Pet Type"}}})",
      // A union tagged by a required property's values (Pydantic with a callable discriminator).
      R"({"oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}],
          "$defs": {"cat": {"type": "object", "properties": {"pet": {"const": "cat"},
                                                             "meows": {"type": "integer"}},
                            "required": ["pet"]},
                    "dog": {"type": "object", "properties": {"pet": {"enum": ["dog", "wolf"]}},
                            "required": ["pet"]}}})",
  };
  for (const auto& schema : accepted)
    EXPECT_EQ(compile_error(K::kJsonSchema, schema), "(compiled)") << schema;
}

// A $ref that reaches itself before any byte of its value would be left recursion in the grammar;
// the error names the cycle of $refs, not the grammar's rule numbers.
TEST(StructuredOutput, RefCyclesThatConsumeNothingAreNamed) {
  using K = OutputSpec::Kind;
  const std::pair<std::string, std::string> cycles[] = {
      {R"({"anyOf": [{"$ref": "#"}, {"type": "null"}]})", "'$ref' cycle: # -> # reaches itself"},
      {R"({"$defs": {"a": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/a"}]}},
          "$ref": "#/$defs/a"})",
       "'$ref' cycle: #/$defs/a -> #/$defs/a reaches itself without consuming input"},
      {R"({"$defs": {"a": {"allOf": [{"$ref": "#/$defs/b"}]},
                      "b": {"anyOf": [{"type": "null"}, {"$ref": "#/definitions/c"}]}},
          "definitions": {"c": {"$ref": "#/$defs/a"}},
          "type": "array", "items": {"$ref": "#/$defs/a"}})",
       "'$ref' cycle: #/$defs/a -> #/$defs/b -> #/definitions/c -> #/$defs/a"},
      // z is being compiled when x refers to it from inside an array, where recursion is fine;
      // z's own reference to x comes later and leads back to z without a byte.
      {R"({"$defs": {"z": {"anyOf": [{"type": "array", "items": {"$ref": "#/$defs/x"}},
                                      {"$ref": "#/$defs/x"}]},
                      "x": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/z"}]}},
          "$ref": "#/$defs/z"})",
       "'$ref' cycle: #/$defs/"},
  };
  for (const auto& [schema, named] : cycles) {
    const std::string e = compile_error(K::kJsonSchema, schema);
    EXPECT_NE(e.find(named), std::string::npos) << schema << "\n  " << e;
    EXPECT_EQ(e.find("rule"), std::string::npos) << e;
  }
  // Recursion past a byte of the value is fine.
  EXPECT_EQ(compile_error(K::kJsonSchema, R"({"anyOf": [{"type": "array", "items": {"$ref": "#"}},
                                                        {"type": "null"}]})"),
            "(compiled)");
}

// A schema every value of which must hold another value of it has no finite value: a grammar of
// it could only ever go on, so it is refused. Where only some branches recurse without end, the
// others are the answers.
TEST(StructuredOutput, ASchemaWithoutAFiniteValueIsRefused) {
  using K = OutputSpec::Kind;
  for (const std::string schema : {
           R"({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]})",
           R"({"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": 1}},
               "type": "object", "properties": {"x": {"$ref": "#/$defs/n"}}, "required": ["x"]})",
       }) {
    const std::string e = compile_error(K::kJsonSchema, schema);
    EXPECT_NE(e.find("schema #: the schema admits no finite value"), std::string::npos)
        << schema << "\n  " << e;
  }
  const auto g = compile({K::kJsonSchema, R"({"anyOf": [{"type": "null"}, {"$ref": "#/$defs/x"}],
      "$defs": {"x": {"type": "object", "properties": {"b": {"$ref": "#/$defs/x"}},
                      "required": ["b"]}}})",
                          "f"});
  EXPECT_TRUE(full_match(g, "null"));
  GrammarMatcher m(g);
  EXPECT_FALSE(m.advance("{")) << "an object of x could never end";
  // Optional recursion ends where the model leaves the property out.
  EXPECT_EQ(
      compile_error(K::kJsonSchema, R"({"type": "object", "properties": {"a": {"$ref": "#"}}})"),
      "(compiled)");
}

// Telling oneOf's schemas apart is linear in the document where it can be: each schema's values
// are read once (a $ref to a 49,000-value enum under 4000 properties took 138 s on the HTTP
// thread; a oneOf of 49,000 consts 45 s, and one of 120,000 was refused as overlapping when a
// per-oneOf bound ran out). What still compares pairs (object schemas told apart by different
// tags, not one discriminator) has one bound for the whole document: past it, a 400 naming it.
TEST(StructuredOutput, TellingOneOfsSchemasApartIsLinearOrRefusedPastOneBound) {
  using K = OutputSpec::Kind;
  json consts = json::array();
  for (int i = 0; i < 120'000; ++i) consts.push_back({{"const", i}});
  EXPECT_EQ(compile_error(K::kJsonSchema, json{{"oneOf", consts}}.dump()), "(compiled)");
  consts.push_back({{"const", 7.0}});  // equals 7
  EXPECT_NE(compile_error(K::kJsonSchema, json{{"oneOf", consts}}.dump())
                .find("schemas 7 and 120000 may both match"),
            std::string::npos);

  json words = json::array();
  for (int i = 0; i < 49'000; ++i) words.push_back("word" + std::to_string(i));
  json props = json::object();
  for (int i = 0; i < 4000; ++i)
    props["p" + std::to_string(i)] = {
        {"oneOf", json::array({{{"$ref", "#/$defs/w"}}, {{"type", "integer"}}})}};
  EXPECT_EQ(compile_error(K::kJsonSchema, json{{"$defs", {{"w", {{"enum", words}}}}},
                                               {"type", "object"},
                                               {"properties", props}}
                                              .dump()),
            "(compiled)");

  // Objects tagged by a row and a column: any two differ in one of them, and no tag alone tells
  // all apart, so they are compared pair by pair: 3 x 3 is fine, 100 x 100 is 50 million pairs.
  auto grid = [](int n) {
    json branches = json::array();
    for (int r = 0; r < n; ++r)
      for (int c = 0; c < n; ++c)
        branches.push_back({{"type", "object"},
                            {"properties", {{"row", {{"const", r}}}, {"col", {{"const", c}}}}},
                            {"required", {"row", "col"}}});
    return json{{"oneOf", branches}}.dump();
  };
  EXPECT_EQ(compile_error(K::kJsonSchema, grid(3)), "(compiled)");
  const std::string e = compile_error(K::kJsonSchema, grid(100));
  EXPECT_NE(e.find("schema #/oneOf: telling the schemas of this document's 'oneOf's apart takes "
                   "more than 4000000 steps"),
            std::string::npos)
      << e;
}

// A 'type' list names each type once (as JSON Schema requires): 16,000 'null's beside an enum of
// 16,000 nulls were checked value by name (24 s on the HTTP thread). The declared types are
// worked out once per schema, not per value.
TEST(StructuredOutput, ATypeListNamesEachTypeOnce) {
  using K = OutputSpec::Kind;
  const json many(std::vector<json>(16'000, nullptr));
  const std::string e =
      compile_error(K::kJsonSchema,
                    json{{"type", json(std::vector<json>(16'000, "null"))}, {"enum", many}}.dump());
  EXPECT_NE(e.find("schema #/type: 'type' lists 'null' twice"), std::string::npos) << e;
  EXPECT_NE(compile_error(K::kJsonSchema, R"({"type": ["string", "integer", "string"]})")
                .find("'type' lists 'string' twice"),
            std::string::npos);
  json values = json::array();
  for (int i = 0; i < 16'000; ++i) values.push_back(i % 2 ? json(i) : json(nullptr));
  EXPECT_EQ(
      compile_error(K::kJsonSchema, json{{"type", {"null", "integer"}}, {"enum", values}}.dump()),
      "(compiled)");
}

// A \uXXXX escape of a high surrogate must be followed by one of a low surrogate, and the pair is
// one character (Python's jsonschema counts "\ud83d\ude00" as 1): it counted 2, and lone
// surrogates, which JSON parsers such as nlohmann's refuse, were written.
TEST(StructuredOutput, SurrogatePairEscapesAreOneCharacterAndLoneSurrogatesAreRefused) {
  const json schema = {{"type", "string"}, {"minLength", 1}, {"maxLength", 2}};
  const auto g = compile({OutputSpec::Kind::kJsonSchema, schema.dump(), "f"});
  const std::string pair = R"(\ud83d\ude00)", other = R"(\uD834\uDD1E)";
  const std::vector<std::string> texts = {
      "\"" + pair + "\"",
      "\"" + pair + pair + "\"",
      "\"" + pair + pair + pair + "\"",
      "\"" + other + "x\"",
      "\"x" + pair + "y\"",
      "\"\\u00e9\\uFFFF\"",
      "\"\\u00e9\\uFFFFz\"",
      "\"\"",
      "\"\\u0041\"",
      "\"" + pair + other + "\"",
  };
  json answers = json::array();
  std::vector<bool> ours;
  for (const auto& t : texts) {
    answers.push_back(t);
    ours.push_back(full_match(g, t));
  }
  const json judged = oracle({{"schema", {{{"schema", schema}, {"answers", answers}}}}});
  ASSERT_TRUE(judged.contains("schema"));
  for (size_t i = 0; i < texts.size(); ++i)
    EXPECT_EQ(ours[i], judged["schema"][0][i].is_null())
        << texts[i] << " " << judged["schema"][0][i];
  for (const std::string lone :
       {R"("\ud800")", R"("\uDBFFx")", R"("\ude00")", R"("\ud83d\u0041")", R"("\ud83d\ud83d")"}) {
    EXPECT_THROW(static_cast<void>(json::parse(lone).is_null()), json::parse_error) << lone;
    EXPECT_FALSE(full_match(g, lone)) << lone;
  }
}

// \s is the white space of Python's re for str patterns (Unicode: U+00A0, U+2003, U+001C, ...),
// so \S and [^\s] exclude it: they were complements of ASCII white space and let U+00A0 through.
// \d and \w stay ASCII (RegexGrammarsAcceptExactlyWhatPythonsReFullmatches).
TEST(StructuredOutput, RegexWhiteSpaceIsUnicodeWhiteSpaceAsInPythonsRe) {
  const std::vector<std::string> patterns = {R"(\S+)", R"(\s+)", R"(a[^\s]b)", R"(a\sb)",
                                             R"([\s]?x)"};
  const std::vector<std::string> fill = {
      "\xc2\xa0", "\xe2\x80\x83", "\x1c", "\xc2\x85",     "\xe3\x80\x80", "\xef\xbb\xbf",
      " ",        "\t",           "\x0b", "\xe2\x80\xa8", "\xe1\x9a\x80", "z",
      "\xc3\xa9"};
  json input = {{"regex", json::array()}, {"flavour", "tandem"}};
  std::vector<std::vector<bool>> ours;
  for (const auto& p : patterns) {
    const auto g = compile({OutputSpec::Kind::kRegex, p, "guided_regex"});
    json texts = json::array();
    std::vector<bool> got;
    for (const auto& f : fill)
      for (const std::string& t : {f, f + f, "a" + f + "b", f + "x"}) {
        texts.push_back(t);
        got.push_back(full_match(g, t));
      }
    input["regex"].push_back({{"pattern", p}, {"texts", texts}});
    ours.push_back(got);
  }
  expect_python_re_agrees(patterns, input, ours);
}

// The classes are exactly the flavour regex.h states. \d \w and their complements \D \W are
// ASCII's (Python's re.ASCII, ECMAScript, xgrammar): 'é', '中' and '٣' are \W and \D, never \w
// or \d; judged by Python's re with those classes scoped ASCII ((?a:\W), the oracle's "tandem"
// flavour). '.' is Python's (any character but \n: \r, U+2028 and U+2029 included, which
// ECMAScript's '.' excludes); judged by Python's re unmodified.
TEST(StructuredOutput, RegexClassesAndDotAreTheFlavourRegexHStates) {
  const std::vector<std::string> fill = {
      "\xc3\xa9", "\xe4\xb8\xad", "\xd9\xa3",     "_",           "5", "x", " ", "\r", "\n",
      "\xc2\x85", "\xe2\x80\xa8", "\xe2\x80\xa9", "\xef\xbc\x91"};
  auto judge = [&](const std::vector<std::string>& patterns, const char* flavour) {
    json input = {{"regex", json::array()}};
    if (flavour) input["flavour"] = flavour;
    std::vector<std::vector<bool>> ours;
    for (const auto& p : patterns) {
      const auto g = compile({OutputSpec::Kind::kRegex, p, "guided_regex"});
      json texts = json::array();
      std::vector<bool> got;
      for (const auto& f : fill)
        for (const std::string& t : {f, f + f, "a" + f + "b"}) {
          texts.push_back(t);
          got.push_back(full_match(g, t));
        }
      input["regex"].push_back({{"pattern", p}, {"texts", texts}});
      ours.push_back(got);
    }
    expect_python_re_agrees(patterns, input, ours);
  };
  judge({R"(\W+)", R"(\D+)", R"(\w+)", R"(\d+)", R"([^\w]+)", R"([^\d]+)", R"(a\Wb)", R"([\W\d]+)",
         R"([^\D]+)", R"(a[\Wx]b)"},
        "tandem");
  judge({".", "..", "a.b", ".+", "(?:.|\n)+"}, nullptr);
  // The classes that differ among the flavours, spelled out.
  auto accepts = [](const std::string& pattern, const std::string& text) {
    return full_match(compile({OutputSpec::Kind::kRegex, pattern, "guided_regex"}), text);
  };
  for (const char* c : {"\xc3\xa9", "\xe4\xb8\xad", "\xd9\xa3"}) {
    EXPECT_TRUE(accepts(R"(\W)", c)) << c;
    EXPECT_TRUE(accepts(R"(\D)", c)) << c;
    EXPECT_FALSE(accepts(R"(\w)", c)) << c;
    EXPECT_FALSE(accepts(R"(\d)", c)) << c;
  }
  for (const char* c : {"\r", "\xe2\x80\xa8", "\xe2\x80\xa9"}) EXPECT_TRUE(accepts(".", c)) << c;
  EXPECT_FALSE(accepts(".", "\n"));
}

// JSON as pretty printers write it: 4-space indents reach 61 bytes of white space in one gap at
// depth 15 ("\n" and 60 spaces), 2-space ones 63 at depth 31, tabs 64 at depth 63; each is
// accepted (a 16-byte bound refused 4-space indents from depth 4 on). A gap past the bound is not.
TEST(StructuredOutput, PrettyPrintedJsonIsAcceptedUpToTheWhiteSpaceBound) {
  const auto object = compile({OutputSpec::Kind::kJsonObject, "", "response_format"});
  const auto recursive_arrays =
      compile({OutputSpec::Kind::kJsonSchema, R"({"type": "array", "items": {"$ref": "#"}})", "f"});
  auto nested = [](int depth) {
    json v = json::array({1, "x", nullptr});
    for (int d = 1; d < depth; ++d) v = json{{"k" + std::to_string(d), v}, {"n", d}};
    return v;
  };
  for (const auto& [indent, ch, depth] :
       {std::tuple{4, ' ', 15}, std::tuple{2, ' ', 31}, std::tuple{1, '\t', 63}}) {
    for (int d = 2; d <= depth; ++d) {
      const std::string text = nested(d).dump(indent, ch);
      ASSERT_TRUE(full_match(object, text)) << "indent " << indent << " depth " << d;
    }
    // Under a schema too: arrays of arrays, as deep.
    json arrays = json::array();
    for (int d = 1; d < depth; ++d) arrays = json::array({arrays});
    EXPECT_TRUE(full_match(recursive_arrays, arrays.dump(indent, ch))) << "indent " << indent;
  }
  EXPECT_TRUE(full_match(object, "{" + std::string(kMaxWhitespace, ' ') + "}"));
  EXPECT_FALSE(full_match(object, "{" + std::string(kMaxWhitespace + 1, '\n') + "}"));
  EXPECT_EQ(kMaxWhitespace, 64);
}

// A repeat count of more digits than any allowed count is refused like any count past the limit
// (a{1234567890} was read as 'a' then the literal text "{1234567890}").
TEST(StructuredOutput, RepeatCountsOfManyDigitsAreRefused) {
  for (const std::string p : {"a{1234567890}", "a{0,12345678901}", "a{1234567890,}", "a{99999}",
                              "a{00000000000000000002}x"}) {
    const std::string e = compile_error(OutputSpec::Kind::kRegex, p);
    if (p.back() == 'x') {
      EXPECT_EQ(e, "(compiled)") << p;  // leading zeros: the count is 2
      continue;
    }
    EXPECT_NE(e.find("repetition counts above 10000 are not supported"), std::string::npos)
        << p << "\n  " << e;
  }
  const auto g = compile({OutputSpec::Kind::kRegex, "a{00000000000000000002}x", "f"});
  EXPECT_TRUE(full_match(g, "aax"));
  EXPECT_FALSE(full_match(g, "ax"));
}

// Python's re reads a{,3} as 0 to 3 a's and \012 as octal (a newline), where the compiler read
// the text "a{,3}" and a NUL then "12"; ECMAScript reads a{,3} as text (and refuses \012 under its
// u flag), so neither is in the common subset: both are refused by name and offset, as is a count
// with nothing before it to repeat, which both refuse. Python's readings are checked here too.
TEST(StructuredOutput, BracesWithoutAMinimumAndOctalEscapesAreRefusedByName) {
  const std::pair<std::string, std::string> refused[] = {
      {"a{,3}", "offset 1: '{,n}'"},
      {"xa{,}", "offset 2: '{,n}'"},
      {"[ab]{,12}c", "offset 4: '{,n}'"},
      {"{,3}", "offset 0: '{,n}'"},
      {"\\012", "offset 0: octal escapes"},
      {"a\\00", "offset 1: octal escapes"},
      {"[\\012]", "offset 1: octal escapes"},
      {"\\09", "offset 0: octal escapes"},
      {"{1}", "offset 0: nothing to repeat"},
      {"a|{2,}", "offset 2: nothing to repeat"},
      {"({1,2})", "offset 1: nothing to repeat"},
  };
  for (const auto& [pattern, error] : refused) {
    const std::string e = compile_error(OutputSpec::Kind::kRegex, pattern);
    EXPECT_NE(e.find(error), std::string::npos) << pattern << "\n  " << e;
  }
  // What Python's re would have matched instead.
  const json input = {{"regex",
                       {{{"pattern", "a{,3}"}, {"texts", {"aa", "a{,3}"}}},
                        {{"pattern", "\\012"},
                         {"texts",
                          {"\n", std::string("\0"
                                             "12",
                                             3)}}}}}};
  const json judged = oracle(input);
  ASSERT_TRUE(judged.contains("regex"));
  EXPECT_EQ(judged["regex"], json::parse("[[true, false], [true, false]]"));
  // A lone NUL escape and braces that are no count stay what both read them as.
  for (const auto& [pattern, text] : std::vector<std::pair<std::string, std::string>>{
           {"a\\0b", std::string("a\0b", 3)}, {"a{}", "a{}"}, {"a{x}", "a{x}"}, {"{x", "{x"}})
    EXPECT_TRUE(full_match(compile({OutputSpec::Kind::kRegex, pattern, "f"}), text)) << pattern;
}

// A quantifier straight after another is an error to Python's re ("multiple repeat") and to
// ECMAScript ("nothing to repeat"); a{2}{3} was read as a{6} and a** as a*. A lazy mark is no
// quantifier, and braces that are no count are text.
TEST(StructuredOutput, AQuantifierAfterAnotherIsRefusedAsPythonAndEcmaScriptDo) {
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"a{2}{3}", "offset 4: multiple repeat"}, {"a**", "offset 2: multiple repeat"},
      {"a+*", "offset 2: multiple repeat"},     {"(ab)?{2}", "offset 5: multiple repeat"},
      {"a*??", "offset 3: multiple repeat"},    {"a{2}*", "offset 4: multiple repeat"},
      {"a*?+", "offset 3: multiple repeat"}};
  json cases = json::array();
  for (const auto& [pattern, error] : refused) {
    const std::string e = compile_error(OutputSpec::Kind::kRegex, pattern);
    EXPECT_NE(e.find(error), std::string::npos) << pattern << "\n  " << e;
    cases.push_back({{"pattern", pattern}, {"texts", json::array()}});
  }
  const json taken = {{{"pattern", "a*?"}, {"texts", {"", "aa"}}},
                      {{"pattern", "a{2}?x"}, {"texts", {"aax", "ax"}}},
                      {{"pattern", "a*{x}"}, {"texts", {"aa{x}", "a"}}}};
  for (const auto& c : taken) cases.push_back(c);
  const json judged = oracle({{"regex", cases}});
  ASSERT_TRUE(judged.contains("regex"));
  for (size_t k = 0; k < refused.size(); ++k)
    EXPECT_TRUE(judged["regex"][k].is_string()) << refused[k].first << " compiled in Python";
  for (size_t k = 0; k < taken.size(); ++k) {
    const json& c = taken[k];
    const auto g = compile({OutputSpec::Kind::kRegex, c["pattern"].get<std::string>(), "f"});
    for (size_t t = 0; t < c["texts"].size(); ++t)
      EXPECT_EQ(full_match(g, c["texts"][t].get<std::string>()),
                judged["regex"][refused.size() + k][t].get<bool>())
          << c["pattern"] << " on " << c["texts"][t];
  }
}

// JSON Schema counts are whole numbers, however written: maxLength 5.0 is 5 (it was a 400).
TEST(StructuredOutput, CountKeywordsTakeWholeNumbersWrittenAsFloats) {
  using K = OutputSpec::Kind;
  const auto s =
      compile({K::kJsonSchema, R"({"type": "string", "minLength": 2.0, "maxLength": 5.0})", "f"});
  EXPECT_TRUE(full_match(s, R"("abcde")"));
  EXPECT_FALSE(full_match(s, R"("abcdef")"));
  EXPECT_FALSE(full_match(s, R"("a")"));
  const auto a =
      compile({K::kJsonSchema, R"({"type": "array", "minItems": 1e0, "maxItems": 2.0})", "f"});
  EXPECT_TRUE(full_match(a, "[1, 2]"));
  EXPECT_FALSE(full_match(a, "[]"));
  EXPECT_FALSE(full_match(a, "[1, 2, 3]"));
  for (const std::string bad : {R"({"maxLength": 2.5})", R"({"maxLength": -1.0})",
                                R"({"maxLength": 1e6})", R"({"type": "array", "maxItems": "2"})"}) {
    const std::string e = compile_error(K::kJsonSchema, bad);
    EXPECT_NE(e.find("must be an integer from 0 to"), std::string::npos) << bad << "\n  " << e;
  }
}

// Item counts without "type" or "items" constrain arrays alone; they were ignored, so any value
// (an array of one item under minItems 2) could be generated. Arrays are generated now. And a
// count keyword is checked wherever it stands: {"maxItems": "2"} was accepted and ignored.
TEST(StructuredOutput, ItemCountsWithoutATypeAreEnforced) {
  using K = OutputSpec::Kind;
  const auto a = compile({K::kJsonSchema, R"({"minItems": 2, "maxItems": 3})", "f"});
  EXPECT_TRUE(full_match(a, R"([1, "x"])"));
  EXPECT_TRUE(full_match(a, R"([{}, [], null])"));
  EXPECT_FALSE(full_match(a, "[1]"));
  EXPECT_FALSE(full_match(a, "[1, 2, 3, 4]"));
  for (const std::string bad :
       {R"({"maxItems": "2"})", R"({"type": "string", "maxItems": "2"})",
        R"({"type": "integer", "minLength": -1})", R"({"properties": {}, "minItems": 0.5})"}) {
    const std::string e = compile_error(K::kJsonSchema, bad);
    EXPECT_NE(e.find("must be an integer from 0 to"), std::string::npos) << bad << "\n  " << e;
  }
}

// A small vocabulary for masks: ASCII bytes JSON needs, runs of letters (up to the longest, so
// that a mask tells apart every state a token's length from a bound), UTF-8 characters whole and
// cut (byte-level tokenizers have tokens that end or begin inside a character), and tokens that
// cross a repeat's end. Its longest tokens ("name": ", aaaaaaaaa) are 9 bytes.
std::shared_ptr<const MaskVocabulary> small_vocabulary() {
  // Split at '|', which no token holds.
  const std::string listed =
      "a|b|c|x|\"|\\|,|{|}|[|]|:| |0|1|5|-|.|e|n|u|l|t|r|f|s|v|k|i|d|m|ab|abc|aaaa|aaaaaaaa|ba|"
      "aaaaaaaaa|aaaaaaab|aaaaaaaab|aaaaaaaa\"|"
      "\",|\"}|\xC3\xA9|\xE6\x97\xA5|\xE6\x97\xA5\xE6\x9C\xAC|\xE6|\x97\xA5|\xC3|\xA9|\xA9\x61|"
      "\"name\": \"|\"kids\": [|\"v\": |{\"|\\n|\\u00e9|null|true|, |\"]|}]";
  std::vector<std::string> tokens(1);
  for (char c : listed)
    if (c == '|')
      tokens.emplace_back();
    else
      tokens.back() += c;
  return std::make_shared<const MaskVocabulary>(std::move(tokens));
}

// The id of the token whose bytes are `bytes` (a failure, and -1, if there is none).
int32_t token_of(const MaskVocabulary& vocabulary, const std::string& bytes) {
  for (size_t i = 0; i < vocabulary.size(); ++i)
    if (vocabulary.bytes(int32_t(i)) == bytes) return int32_t(i);
  ADD_FAILURE() << bytes;
  return -1;
}

// Masks are cached under GrammarMatcher::mask_key, which merges the states of a bounded repeat
// that no token can tell apart. Each mask the cache gives must be the one a fresh walk of the
// trie computes, and so must every state sharing a key, over random answers to formats with
// repeats near and far from both bounds, nested, under recursion, in regexes, of UTF-8.
TEST(StructuredOutput, MasksCachedByMaskKeyAreTheMasksOfAFreshWalk) {
  using K = OutputSpec::Kind;
  const auto vocabulary = small_vocabulary();
  const size_t v = vocabulary->size(), longest = vocabulary->trie().max_depth;
  ASSERT_EQ(longest, 9u);
  const int32_t end = static_cast<int32_t>(v);  // an end id past the vocabulary
  const std::vector<int32_t> ends = {end};
  const std::pair<K, std::string> specs[] = {
      {K::kJsonSchema, R"({"type": "string", "minLength": 15, "maxLength": 45})"},
      {K::kJsonSchema, R"({"type": "string", "pattern": "(a|b\u00e9)+c*", "minLength": 12,
                           "maxLength": 40})"},
      {K::kJsonSchema, R"({"type": "string", "format": "uri", "maxLength": 60})"},
      {K::kJsonSchema, R"({"type": "string", "pattern": "(ab|c\u00e9?)+", "minLength": 25})"},
      {K::kJsonSchema, R"({"type": "array", "items": {"type": "number", "minimum": -2.5,
                           "exclusiveMaximum": 10}, "minItems": 12})"},
      {K::kRegex, "a{0,40}b"},
      {K::kRegex, "a{30}b{0,30}"},
      {K::kRegex, "(ab|c){12,30}x"},
      {K::kRegex, "[a\u00e9]{25,}x"},
      {K::kRegex, "(a{2,20}b){0,15}"},
      {K::kRegex, "(\u65e5|\u00e9|ab){0,35}"},
      {K::kRegex, "(\u65e5\u672c|a){14}b{0,30}"},
      {K::kJsonSchema, R"({"$defs": {"node": {"type": "object", "properties": {
          "name": {"type": "string", "maxLength": 30},
          "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3}},
          "required": ["name"]}}, "$ref": "#/$defs/node"})"},
      {K::kJsonSchema, R"({"type": "array", "items": {"type": "string", "maxLength": 14},
          "minItems": 12, "maxItems": 25})"},
      {K::kJsonSchema, R"({"anyOf": [
          {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}},
          {"type": "object", "properties": {"name": {"type": "string", "maxLength": 33}}},
          {"type": "object", "properties": {"name": {"type": "string", "minLength": 12}}}]})"},
      {K::kJsonSchema, R"({"anyOf": [
          {"type": "array", "items": {"anyOf": [{"type": "string", "maxLength": 6},
                                                {"type": "string", "minLength": 3}]}},
          {"type": "array", "items": {"type": "string"}, "maxItems": 2},
          {"type": "object", "properties": {"k": {"type": "string"}, "n": {"type": "null"}}},
          {"type": "object", "properties": {"k": {"type": "string"}, "b": {"type": "boolean"}}}]})"},
      // Nine objects that begin alike (stacks merged inside "s"), one of them recursive.
      {K::kJsonSchema, R"({"$defs": {"o": {"anyOf": [
          {"type": "object", "properties": {"s": {"type": "string"}, "a": {"type": "null"}}},
          {"type": "object", "properties": {"s": {"type": "string"}, "b": {"type": "null"}}},
          {"type": "object", "properties": {"s": {"type": "string"}, "c": {"type": "null"}}},
          {"type": "object", "properties": {"s": {"type": "string"}, "d": {"type": "null"}}},
          {"type": "object", "properties": {"s": {"type": "string"}, "e": {"type": "null"}}},
          {"type": "object", "properties": {"s": {"type": "string"}, "f": {"type": "null"}}},
          {"type": "object", "properties": {"s": {"type": "string"}, "g": {"type": "null"}}},
          {"type": "object", "properties": {"s": {"type": "string"}, "h": {"type": "null"}}},
          {"type": "object", "properties": {"s": {"type": "string"},
                                            "k": {"type": "array", "items": {"$ref": "#/$defs/o"},
                                                  "maxItems": 2}}}]}},
          "$ref": "#/$defs/o"})"},
  };
  std::mt19937 rng(5);
  for (const auto& [kind, text] : specs) {
    SCOPED_TRACE(text);
    const auto grammar = compile({kind, text, "f"});
    const auto cache = std::make_shared<MaskCache>(size_t(1) << 16);
    std::unordered_map<std::string, std::vector<uint64_t>> by_mask_key;
    std::unordered_set<std::string> keys;
    size_t states = 0, reused = 0;
    for (int walk = 0; walk < 40; ++walk) {
      TokenConstraint constraint(grammar, cache, vocabulary);
      GrammarMatcher fresh(grammar);
      std::string answer;
      for (int n = 0; n < 120; ++n) {
        std::vector<uint64_t> walked((v + 63) / 64, 0);
        fresh.accepted_tokens(vocabulary->trie(), walked);
        std::vector<float> logits(v + 1, 0.0f);
        try {
          constraint.mask(logits, ends);
        } catch (const ConstraintError&) {
          // A dead end of this vocabulary (bytes may follow, no token of them does).
          EXPECT_TRUE(std::all_of(walked.begin(), walked.end(), [](uint64_t w) { return !w; }));
          EXPECT_FALSE(fresh.accepting());
          break;
        }
        std::vector<int32_t> allowed;
        for (size_t id = 0; id < v; ++id) {
          const bool bit = (walked[id / 64] >> (id % 64)) & 1;
          ASSERT_EQ(logits[id] == 0.0f, bit) << "token " << id << " after " << answer;
          if (bit) allowed.push_back(int32_t(id));
        }
        ASSERT_EQ(logits[size_t(end)] == 0.0f, fresh.accepting()) << answer;
        ++states;
        keys.insert(fresh.key());
        const auto [it, added] = by_mask_key.emplace(fresh.mask_key(longest), walked);
        ASSERT_TRUE(it->second == walked) << "a state sharing the mask key of another, " << answer;
        reused += !added;
        if (allowed.empty() || (fresh.accepting() && rng() % 8 == 0)) break;
        // Half the time the longest, to go deep into repeats.
        int32_t pick = allowed[rng() % allowed.size()];
        if (rng() % 2 == 0)
          for (int32_t t : allowed)
            if (vocabulary->bytes(t).size() > vocabulary->bytes(pick).size()) pick = t;
        constraint.accept(pick, ends);
        ASSERT_TRUE(fresh.advance(vocabulary->bytes(pick)));
        answer += vocabulary->bytes(pick);
      }
    }
    // Not vacuous: the walks met states that differ (key) but share a mask key.
    EXPECT_LT(by_mask_key.size(), keys.size()) << states << " states, " << reused << " reused";
  }
}

// Mask keys grow with the parse stacks and the answer's nesting: a recursive array schema whose
// answers nested '[[[[' filled each of 32 grammars' 128 entries with keys of kilobytes (an
// engine's RSS grew by 80 MB and stayed). The cache is bounded in bytes too, keys and masks
// counted: the least recently used go first, and an entry larger than the whole budget is not
// kept.
TEST(StructuredOutput, TheMaskCacheKeepsItsKeysAndMasksWithinItsByteBudget) {
  constexpr size_t kBudget = size_t(64) << 10;
  MaskCache cache(128, kBudget);
  const auto mask = std::make_shared<const std::vector<uint64_t>>(64);
  auto key = [](int i) { return std::to_string(i) + std::string(10'000, 'k'); };
  for (int i = 0; i < 40; ++i) {
    cache.put(key(i), mask);
    EXPECT_LE(cache.bytes(), kBudget);
    EXPECT_TRUE(cache.find(key(i))) << "the newest entry is kept";
  }
  EXPECT_FALSE(cache.find(key(0)));
  EXPECT_GE(cache.bytes(), kBudget / 2) << "the budget is used, not emptied";
  // The oldest kept, used again, outlives the next oldest.
  int oldest = 0;
  while (!cache.find(key(oldest))) ++oldest;
  cache.put(key(40), mask);
  EXPECT_TRUE(cache.find(key(oldest)));
  EXPECT_FALSE(cache.find(key(oldest + 1)));
  const std::string huge(kBudget, 'h');
  cache.put(huge, mask);
  EXPECT_FALSE(cache.find(huge));
  EXPECT_TRUE(cache.find(key(40))) << "an entry over the budget evicts nothing";
  // Small entries are still bounded in number.
  MaskCache counted(8, kBudget);
  for (int i = 0; i < 20; ++i) counted.put(std::to_string(i), mask);
  EXPECT_FALSE(counted.find("11"));
  EXPECT_TRUE(counted.find("12"));
}

// An answer inside a string of maxLength 400 is 400 states, all alike to a token until it is
// within a token's length of the bound: the masks computed (trie walks) stay within a few per
// byte of the longest token, however long the string may be. Each state had its own mask (a
// walk of the whole vocabulary) before: 8 requests of maxLength 2000 decoded at 58 tokens/s, of
// no maxLength at 441.
TEST(StructuredOutput, ABoundedStringWalksTheVocabularyAboutOncePerByteOfItsLongestToken) {
  const auto vocabulary = small_vocabulary();
  const size_t longest = vocabulary->trie().max_depth;
  const auto grammar =
      compile({OutputSpec::Kind::kJsonSchema, R"({"type": "string", "maxLength": 400})", "f"});
  const std::vector<int32_t> ends = {int32_t(vocabulary->size())};
  auto id = [&](const std::string& bytes) { return token_of(*vocabulary, bytes); };
  const std::string cycle[] = {"abc", "a", "ab", "aaaa", "\xC3\xA9", "aaaaaaaa", "\\n"};
  TokenConstraint constraint(grammar, std::make_shared<MaskCache>(128), vocabulary);
  std::vector<float> logits(vocabulary->size() + 1);
  auto step = [&](const std::string& token) {
    std::fill(logits.begin(), logits.end(), 0.0f);
    constraint.mask(logits, ends);
    const int32_t t = id(token);
    ASSERT_EQ(logits[size_t(t)], 0.0f) << token;
    constraint.accept(t, ends);
  };
  step("\"");
  size_t characters = 0, tokens = 1;
  for (size_t i = 0; characters < 400; ++i) {
    std::string token = cycle[i % std::size(cycle)];
    const size_t length = token == "\xC3\xA9" || token == "\\n" ? 1 : token.size();
    if (characters + length > 400) token = "a";
    step(token);
    characters += token == "a" ? 1 : length;
    ++tokens;
  }
  step("\"");
  ++tokens;
  EXPECT_TRUE(constraint.complete());
  const ConstraintStats& stats = constraint.stats();
  EXPECT_EQ(size_t(stats.masks_computed + stats.masks_reused), tokens);
  EXPECT_GT(tokens, 100u);
  EXPECT_LE(size_t(stats.masks_computed), 2 * longest + 4);
}

// The same for a pattern within maxLength, as Pydantic's HttpUrl asks ({"format": "uri",
// "maxLength": 2083}): its automaton is counted once per length (structured/regex.h), and the
// counts far from the bound share their masks, so a long URL walks the vocabulary about as often
// as a short one.
TEST(StructuredOutput, APatternWithinMaxLengthWalksTheVocabularyAboutOncePerByteOfItsLongestToken) {
  const auto vocabulary = small_vocabulary();
  const size_t longest = vocabulary->trie().max_depth;
  const auto grammar =
      compile({OutputSpec::Kind::kJsonSchema,
               R"({"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083})", "f"});
  const std::vector<int32_t> ends = {int32_t(vocabulary->size())};
  auto id = [&](const std::string& bytes) { return token_of(*vocabulary, bytes); };
  TokenConstraint constraint(grammar, std::make_shared<MaskCache>(128), vocabulary);
  std::vector<float> logits(vocabulary->size() + 1);
  auto step = [&](const std::string& token, bool allowed = true) {
    std::fill(logits.begin(), logits.end(), 0.0f);
    constraint.mask(logits, ends);
    const int32_t t = id(token);
    ASSERT_EQ(logits[size_t(t)] == 0.0f, allowed) << token;
    if (allowed) constraint.accept(t, ends);
  };
  // "a:" then a path of 2081 characters: the longest URI the bound takes.
  const std::string cycle[] = {"abc", "a", "ab", "aaaa", "aaaaaaaa", "ba", "aaaaaaaaa"};
  step("\"");
  step("a");
  step(":");
  size_t characters = 2, tokens = 3;
  for (size_t i = 0; characters < 2083; ++i) {
    std::string token = cycle[i % std::size(cycle)];
    if (characters + token.size() > 2083) token = "a";
    step(token);
    characters += token.size();
    ++tokens;
  }
  step("a", false);
  step("\"");
  ++tokens;
  EXPECT_TRUE(constraint.complete());
  const ConstraintStats& stats = constraint.stats();
  EXPECT_GT(tokens, 400u);
  EXPECT_LE(size_t(stats.masks_computed), 2 * longest + 8) << stats.masks_reused << " reused";
}

// ---- JSON Schema's pattern, format and integer bounds (tests/oracle/string_format_oracle.py) ----

// The verdicts of string_format_oracle.py on `checks` ([{"kind": ..., "texts": [...]}, ...]).
json string_format_oracle(const json& checks) {
  return run_oracle("string_format_oracle.py", json{{"checks", checks}});
}

// A check of `schema`'s grammar: answers sampled from it, each and one edit of each, and `extra`
// texts, judged by the oracle as `kind` (the check's other fields added). The grammar must accept
// a text exactly when the oracle finds it valid and written the one way JSON encoders write it.
struct FormatCheck {
  json schema;
  json check;  // {"kind": ..., other fields for the oracle}
  std::vector<std::string> extra;
};

void expect_grammars_agree_with_the_oracle(const std::vector<FormatCheck>& cases) {
  std::mt19937 rng(23);
  json checks = json::array();
  std::vector<std::vector<bool>> ours;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.schema.dump());
    const auto g = compile({OutputSpec::Kind::kJsonSchema, c.schema.dump(), "response_format"});
    std::vector<std::string> texts = c.extra;
    int sampled = 0;
    for (int i = 0; i < 60; ++i) {
      auto s = random_sentence(g, rng, 1000);
      if (!s) continue;
      ++sampled;
      texts.push_back(*s);
      texts.push_back(mutate(*s, rng));
    }
    EXPECT_GT(sampled, 20);
    std::vector<bool> got;
    for (const auto& t : texts) got.push_back(full_match(g, t));
    json check = c.check;
    check["texts"] = texts;
    checks.push_back(check);
    ours.push_back(got);
  }
  const json judged = string_format_oracle(checks);
  ASSERT_EQ(judged.size(), cases.size());
  size_t accepted = 0;
  for (size_t i = 0; i < cases.size(); ++i)
    for (size_t j = 0; j < ours[i].size(); ++j) {
      const json& v = judged[i][j];
      const bool expected = v["valid"].get<bool>() && v["canonical"].get<bool>();
      accepted += ours[i][j];
      EXPECT_EQ(ours[i][j], expected)
          << cases[i].schema.dump() << "\n  text " << json(checks[i]["texts"][j]).dump()
          << "\n  oracle " << v.dump();
    }
  EXPECT_GT(accepted, 20u * cases.size());
}

// 'pattern' matches the string's value whole (xgrammar's reading, vLLM's default backend; JSON
// Schema's is a search, which every answer here satisfies too), and characters a JSON string
// must escape are written escaped: '"', '\' and control characters the pattern allows came out
// raw, as invalid JSON, when a pattern was pasted between quotes.
TEST(StructuredOutput, APatternIsMatchedByTheStringsValueWrittenAsJsonWritesIt) {
  std::vector<FormatCheck> cases;
  for (const std::string p : {
           R"(^[a-z]+@[a-z]+\.(com|org)$)",
           R"(\d{3}-\d{4})",
           R"(say "hi"|back\\slash|/)",
           R"([\x00-\x1f"\\]{1,4}x)",
           R"(.{0,4})",
           R"(\S+\s\S)",
           R"([^a-z]{2,5})",
           "(?:\xc3\xa9|\xe4\xb8\xad|\\u2028){1,3}",
           R"(\w+[\n\t\r\f\x08\x7f\v]?)",
       })
    cases.push_back(
        {{{"type", "string"}, {"pattern", p}},
         {{"kind", "pattern"}, {"pattern", p}},
         {R"("\u0022")", R"("\/")", R"("\u000a")", "\"\t\"", R"("\"\"")", R"("\\")", R"("\n")",
          R"("\u001f")", R"("\u001F")", R"("ab")", R"(" ")", "\"\xc3\xa9\""}});
  // Without 'type', a pattern generates strings alone (it constrains no other value).
  cases.push_back({{{"pattern", "[0-9]{2}"}},
                   {{"kind", "pattern"}, {"pattern", "[0-9]{2}"}},
                   {"12", R"("12")", R"("1")"}});
  expect_grammars_agree_with_the_oracle(cases);
}

// The formats enforced: exactly the strings Python's parsers read in the RFCs' shapes, within
// the limits string_formats.h gives (29 February in leap years only, no leap second, at most 6
// fraction digits).
TEST(StructuredOutput, StringFormatsAcceptExactlyWhatPythonsParsersRead) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> formats = {
      {"date",
       {R"("2024-02-29")", R"("2023-02-29")", R"("2000-02-29")", R"("1900-02-29")",
        R"("0000-01-01")", R"("0001-01-01")", R"("9999-12-31")", R"("2024-04-31")",
        R"("2024-13-01")", R"("2024-1-01")", R"("20240101")"}},
      {"time",
       {R"("23:59:59Z")", R"("23:59:60Z")", R"("24:00:00Z")", R"("12:00:00")",
        R"("12:00:00.123456+05:30")", R"("12:00:00.1234567+05:30")", R"("12:00:00-00:00")",
        R"("12:00:00+24:00")", R"("12:00:00z")"}},
      {"date-time",
       {R"("2024-02-29T23:59:59.5Z")", R"("2023-02-29T00:00:00Z")", R"("2024-01-01 00:00:00Z")",
        R"("2024-01-01T00:00:00")", R"("2024-01-01t00:00:00Z")"}},
      {"uuid",
       {R"("123e4567-e89b-12d3-a456-426614174000")", R"("123E4567-E89B-12D3-A456-426614174000")",
        R"("123e4567e89b12d3a456426614174000")", R"("{123e4567-e89b-12d3-a456-426614174000}")"}},
      {"uuid4",
       {R"("123e4567-e89b-42d3-a456-426614174000")", R"("123e4567-e89b-42d3-c456-426614174000")",
        R"("123e4567-e89b-12d3-a456-426614174000")"}},
      {"ipv4",
       {R"("255.255.255.255")", R"("256.1.1.1")", R"("01.1.1.1")", R"("1.1.1")", R"("0.0.0.0")"}},
      {"ipv6",
       {R"("::")", R"("::1")", R"("1::")", R"("1:2:3:4:5:6:7:8")", R"("1:2:3:4:5:6:7::")",
        R"("::2:3:4:5:6:7:8")", R"("1:2:3:4:5:6:7:8:9")", R"("1::2::3")", R"("fe80::1:FFFF")",
        R"("12345::")"}},
      {"email",
       {R"("a@b.co")", R"("first.last+tag@mail.example.org")", R"("o'h{x}|~@b.io")",
        R"("a..b@c.com")", R"(".a@b.com")", R"("a@b")", R"("a@-b.com")", R"("a@b.c0m")",
        R"("a@[1.2.3.4]")"}},
  };
  std::vector<FormatCheck> cases;
  for (const auto& [f, extra] : formats)
    cases.push_back({{{"type", "string"}, {"format", f}}, {{"kind", f}}, extra});
  expect_grammars_agree_with_the_oracle(cases);
}

// minimum, maximum, exclusiveMinimum and exclusiveMaximum on integers: exactly the integers in
// the range, written as JSON writes them (no '-0'); an open side is bounded by the digits an
// integer may have (kMaxIntegerDigits).
TEST(StructuredOutput, IntegerBoundsAcceptExactlyTheIntegersInTheRange) {
  const int64_t most = 9'999'999'999'999'999;  // kMaxIntegerDigits nines
  struct Range {
    json bounds;
    int64_t lo, hi;
  };
  const std::vector<Range> ranges = {
      {{{"minimum", 0}}, 0, most},
      {{{"minimum", 1}}, 1, most},
      {{{"maximum", -5}}, -most, -5},
      {{{"minimum", -17}, {"maximum", 230}}, -17, 230},
      {{{"exclusiveMinimum", 0}, {"exclusiveMaximum", 100}}, 1, 99},
      {{{"minimum", 1.5}, {"maximum", 9.5}}, 2, 9},
      {{{"minimum", 999}, {"maximum", 1001}}, 999, 1001},
      {{{"minimum", -1000000}, {"maximum", -999}}, -1000000, -999},
      {{{"minimum", 0}, {"maximum", 0}}, 0, 0},
      {{{"minimum", 5}, {"exclusiveMinimum", 7}, {"maximum", 120}, {"exclusiveMaximum", 100}},
       8,
       99},
      {{{"minimum", -1e30}, {"maximum", 1e30}}, -most, most},
  };
  std::vector<FormatCheck> cases;
  for (const auto& r : ranges) {
    json schema = r.bounds;
    schema["type"] = "integer";
    std::vector<std::string> extra = {"-0", "0", "00", "1.0", "1e2"};
    for (int64_t v : {r.lo, r.hi})
      for (int64_t d : {-1, 0, 1}) extra.push_back(std::to_string(v + d));
    cases.push_back({schema, {{"kind", "integer"}, {"minimum", r.lo}, {"maximum", r.hi}}, extra});
  }
  expect_grammars_agree_with_the_oracle(cases);
}

// minLength and maxLength beside a pattern or a format: the strings of both, their length counted
// in characters of the decoded value (a JSON escape or a surrogate pair is one, as for a plain
// string's bounds), at both ends of each bound; Pydantic's HttpUrl is {"format": "uri",
// "minLength": 1, "maxLength": 2083}. A hostname is at most 253 characters with no maxLength.
TEST(StructuredOutput, LengthsBesideAPatternOrFormatAreEnforcedOnTheDecodedCharacters) {
  struct Case {
    json schema;
    json check;
    std::vector<std::string> extra;
  };
  const std::vector<Case> lengths = {
      {{{"pattern", "[a-z]+"}, {"maxLength", 5}},
       {{"kind", "pattern"}, {"pattern", "[a-z]+"}, {"maxLength", 5}},
       {R"("abcde")", R"("abcdef")", R"("")", R"("a")"}},
      {{{"pattern", "[a-z]*"}, {"minLength", 3}, {"maxLength", 4}},
       {{"kind", "pattern"}, {"pattern", "[a-z]*"}, {"minLength", 3}, {"maxLength", 4}},
       {R"("ab")", R"("abc")", R"("abcd")", R"("abcde")"}},
      {{{"pattern", "(?:\\\"|\u00e9|\U0001F600|x)+"}, {"minLength", 2}, {"maxLength", 3}},
       {{"kind", "pattern"},
        {"pattern", "(?:\\\"|\u00e9|\U0001F600|x)+"},
        {"minLength", 2},
        {"maxLength", 3}},
       {R"("\"x")", R"("\"\"\"")", R"("\"\"\"x")", R"("\u0022x")",
        "\"\xc3\xa9\xf0\x9f\x98\x80\xc3\xa9\"", "\"\xc3\xa9\xf0\x9f\x98\x80\xc3\xa9x\"",
        "\"\xf0\x9f\x98\x80\""}},
      {{{"pattern", "(ab|c)+d?"}, {"minLength", 4}},
       {{"kind", "pattern"}, {"pattern", "(ab|c)+d?"}, {"minLength", 4}},
       {R"("abc")", R"("abcd")", R"("cccc")", R"("ccd")"}},
      {{{"format", "date-time"}, {"maxLength", 20}},
       {{"kind", "date-time"}, {"maxLength", 20}},
       {R"("2024-01-01T00:00:00Z")", R"("2024-01-01T00:00:00.5Z")"}},
      {{{"format", "email"}, {"minLength", 8}, {"maxLength", 12}},
       {{"kind", "email"}, {"minLength", 8}, {"maxLength", 12}},
       {R"("a@bc.de")", R"("ab@cd.ef")", R"("abcd@efg.hij")", R"("abcde@efg.hij")"}},
      {{{"format", "uri"}, {"minLength", 1}, {"maxLength", 30}},
       {{"kind", "uri"}, {"maxLength", 30}},
       {R"("https://example.org/a?b=c#d")", R"("https://example.org/abcdefghijk")",
        R"("https://example.org/abcdefghij")"}},
      {{{"format", "hostname"}},
       {{"kind", "hostname"}},
       {"\"" + std::string(63, 'a') + "." + std::string(63, 'b') + "." + std::string(63, 'c') +
            "." + std::string(61, 'd') + "\"",
        "\"" + std::string(63, 'a') + "." + std::string(63, 'b') + "." + std::string(63, 'c') +
            "." + std::string(62, 'd') + "\""}},
  };
  std::vector<FormatCheck> cases;
  for (const auto& c : lengths) {
    json schema = c.schema;
    schema["type"] = "string";
    cases.push_back({schema, c.check, c.extra});
  }
  expect_grammars_agree_with_the_oracle(cases);
  // Pydantic's HttpUrl compiles to a grammar of bounded size.
  Grammar g;
  g.finish(json_schema_rule(
      g, json::parse(R"({"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083})")));
  EXPECT_LT(g.size(), Grammar::kMaxSymbols / 2);
}

// A pattern whose automaton, counted per length, would pass the budget is refused before it is
// built (its characters, repeats written out, were made into states and follower lists first,
// hundreds of megabytes for this one, and only then refused); maxLength 0 leaves only the empty
// string, which the pattern matches or not, and builds no automaton at all.
TEST(StructuredOutput, APatternTooLargeToCountIsRefusedBeforeItsAutomatonIsBuilt) {
  auto error = [](const json& schema) { return schema_error(schema); };
  const std::string huge = "(?:(?:a{1000}){499})?";  // 499,000 characters written out
  const std::string e = error({{"type", "string"}, {"pattern", huge}, {"maxLength", 1}});
  EXPECT_EQ(e.find("schema #/pattern: "), 0u) << e;
  EXPECT_NE(e.find("499000 characters (its repeats written out) times 2 lengths"),
            std::string::npos)
      << e;
  for (const std::string& p : {huge, std::string("(?:(?:a{1000}){1000})?")}) {
    SCOPED_TRACE(p);
    Grammar g;
    const auto rule =
        json_schema_rule(g, {{"type", "string"}, {"pattern", p}, {"maxLength", uint64_t{0}}});
    EXPECT_LT(g.rules(), 100u);  // no rule per state of the automaton
    g.finish(rule);
    const auto shared = std::make_shared<const Grammar>(std::move(g));
    EXPECT_TRUE(full_match(shared, R"("")"));
    EXPECT_FALSE(full_match(shared, R"("a")"));
  }
  EXPECT_EQ(
      error(
          {{"type", "string"}, {"pattern", "a(?:(?:a{1000}){1000})?"}, {"maxLength", uint64_t{0}}}),
      "schema #: no string of at most 0 characters matches the pattern");
}

// A maxLength past the pattern's own longest string adds nothing: it is counted as that longest
// (it made the work grow with maxLength, and refused such a schema as too costly).
TEST(StructuredOutput, AMaxLengthPastThePatternsLongestCostsWhatTheLongestCosts) {
  auto size = [](const std::string& pattern, uint64_t min, uint64_t max) {
    Grammar g;
    g.finish(json_schema_rule(
        g, {{"type", "string"}, {"pattern", pattern}, {"minLength", min}, {"maxLength", max}}));
    return g.size();
  };
  EXPECT_EQ(size("[0-9]{4,12}", 6, 100000), size("[0-9]{4,12}", 6, 12));
  EXPECT_EQ(size("[a-z]{1,50}", 2, 10000), size("[a-z]{1,50}", 2, 50));
  EXPECT_EQ(size("(?:ab|c){1,9}d", 3, 500), size("(?:ab|c){1,9}d", 3, 19));
}

// A pattern whose automaton alone passes the budget, whatever the lengths, is refused naming the
// pattern (it told the client to lower a bound, which could never help).
TEST(StructuredOutput, APatternWhoseAutomatonAlonePassesTheBudgetIsRefusedNamingThePattern) {
  std::string alternatives;  // 1001 two-character alternatives, each may follow each: 1001^2
  for (uint32_t c = 0x4e00; c <= 0x4e00 + 1000; ++c) {
    char escape[8];
    std::snprintf(escape, sizeof escape, "\\u%04x", c);
    alternatives += (alternatives.empty() ? "" : "|") + std::string(escape) + "x";
  }
  const std::string error = schema_error(
      {{"type", "string"}, {"pattern", "(?:" + alternatives + ")+"}, {"minLength", 3}});
  EXPECT_NE(error.find("#/pattern: lengths beside 'pattern' are enforced through its automaton"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("over 1000000 transitions"), std::string::npos) << error;
  EXPECT_EQ(error.find("lower"), std::string::npos) << error;
}

// Alternatives of one character each, repeated ((?:a|b|...)+, as a pattern lists allowed
// characters), are one class: 1001 of them were each linked to each (1001^2 transitions) and the
// pattern refused within lengths. The strings are Python's re's.
TEST(StructuredOutput, OneCharacterAlternativesRepeatedAreCountedAsOneClass) {
  std::string alternatives;
  for (uint32_t c = 0x4e00; c <= 0x4e00 + 1000; ++c) {
    char escape[8];
    std::snprintf(escape, sizeof escape, "\\u%04x", c);
    alternatives += (alternatives.empty() ? "" : "|") + std::string(escape);
  }
  std::vector<FormatCheck> cases;
  for (const std::string& p : {"(?:" + alternatives + ")+", "(?:" + alternatives + "|ab|c)+d",
                               "x(?:a|" + alternatives + ")*"})
    cases.push_back({{{"type", "string"}, {"pattern", p}, {"minLength", 2}, {"maxLength", 6}},
                     {{"kind", "pattern"}, {"pattern", p}, {"minLength", 2}, {"maxLength", 6}},
                     {R"("ab")", "\"\xe4\xb8\x80\"", "\"\xe4\xb8\x80\xe4\xb8\x80\"", R"("abcd")",
                      R"("xaaaaaa")"}});
  expect_grammars_agree_with_the_oracle(cases);
  // Written out, ten one-character branches a thousand times were 10,000 characters, too many
  // to count for 101 lengths; as one class they are 1,000.
  EXPECT_EQ(
      schema_error(
          {{"type", "string"}, {"pattern", "(?:a|b|c|d|e|f|g|h|i|j){1,1000}"}, {"maxLength", 100}}),
      "(compiled)");
}

// Lengths too costly to count beside a pattern or format: a lower bound is advised only where
// one would be accepted, and then the highest that is (that bound compiles, one more does not);
// where no bound that leaves a string of the pattern would do, the pattern is named. It told a
// schema of maxLength 1 to lower its maxLength, and gave no number to lower it to.
TEST(StructuredOutput, TooCostlyLengthsAdviseALowerBoundOnlyWhereOneWouldBeAccepted) {
  // The bound advised in `e` ("lower maxLength to N or less"), or -1.
  auto advised = [](const std::string& e, const std::string& bound) -> int64_t {
    const std::string says = "lower " + bound + " to ";
    const size_t at = e.find(says);
    return at == std::string::npos ? -1 : std::stoll(e.substr(at + says.size()));
  };
  struct Case {
    json schema;
    std::string bound;  // the keyword whose lowering is advised
  };
  const std::vector<Case> lowered = {
      {{{"type", "string"}, {"format", "uri"}, {"maxLength", 100000}}, "maxLength"},
      {{{"type", "string"}, {"pattern", "[a-z]{1,9000}x*"}, {"minLength", 40000}}, "minLength"},
      // Its characters are what cost (20,000 written out), more than its states.
      {{{"type", "string"},
        {"pattern", "(?:ab|cb|db|eb|fb|gb|hb|ib|jb|kb){1,1000}"},
        {"maxLength", 100}},
       "maxLength"},
      {{{"type", "string"}, {"pattern", "[0-9]{3}(?:(?:a{1000}){499})?"}, {"minLength", 5}},
       "minLength"},
  };
  for (const auto& c : lowered) {
    SCOPED_TRACE(c.schema.dump());
    const std::string e = schema_error(c.schema);
    EXPECT_EQ(e.find("schema #/" + c.bound + ": '" + c.bound + "' beside"), 0u) << e;
    const int64_t n = advised(e, c.bound);
    ASSERT_GE(n, 0) << e;
    json fits = c.schema, past = c.schema;
    fits[c.bound] = n;
    past[c.bound] = n + 1;
    EXPECT_EQ(schema_error(fits), "(compiled)");
    EXPECT_NE(schema_error(past), "(compiled)");
  }
  // Leaving maxLength out is advised too where that is accepted (no automaton is counted).
  const std::string left_out =
      schema_error({{"type", "string"}, {"pattern", "[a-z]{1,9000}"}, {"maxLength", 8999}});
  EXPECT_NE(left_out.find("or leave maxLength out"), std::string::npos) << left_out;
  EXPECT_EQ(schema_error({{"type", "string"}, {"pattern", "[a-z]{1,9000}"}}), "(compiled)");
  // No maxLength of 1 or more fits beside these patterns: the pattern is to blame.
  for (const json& schema :
       {json{{"type", "string"}, {"pattern", "(?:(?:a{1000}){499})?"}, {"maxLength", 1}},
        json{{"type", "string"}, {"pattern", "b{2}(?:(?:a{1000}){200})?"}, {"maxLength", 3}},
        json{{"type", "string"}, {"pattern", "(?:[a-z]{1,1000}){1,200}"}, {"maxLength", 20}},
        json{{"type", "string"},
             {"pattern", "x{2}(?:(?:[a-c]{1,1000}){130})?"},
             {"minLength", 1},
             {"maxLength", 900}}}) {
    SCOPED_TRACE(schema.dump());
    const std::string e = schema_error(schema);
    EXPECT_EQ(e.find("schema #/pattern: "), 0u) << e;
    EXPECT_EQ(advised(e, "maxLength"), -1) << e;
    EXPECT_NE(e.find("no lower maxLength that leaves a string of the pattern would do: a simpler "
                     "pattern"),
              std::string::npos)
        << e;
    // The least maxLength that leaves a string of the pattern is refused too (a lower one costs
    // less, so this is the one that could have been accepted).
    for (int64_t m = std::max<int64_t>(schema.value("minLength", 0), 1);; ++m) {
      json lower = schema;
      lower["maxLength"] = m;
      const std::string refused = schema_error(lower);
      if (refused.find("no string of") != std::string::npos) continue;
      EXPECT_NE(refused.find("automaton steps"), std::string::npos) << m << ": " << refused;
      break;
    }
  }
}

// Fields each within the budget of lengths counted beside a pattern or format, but together
// past the grammar's size: the refusal names them, largest first, with the bound to lower (it
// said only "the grammar is too large").
TEST(StructuredOutput, FieldsTooLargeTogetherAreNamed) {
  const json uri = {{"type", "string"}, {"format", "uri"}, {"maxLength", 10000}},
             shorter_uri = {{"type", "string"}, {"format", "uri"}, {"maxLength", 9000}};
  const json schema = {
      {"type", "object"},
      {"properties",
       {{"id", {{"type", "integer"}}},
        {"home", uri},
        {"note", {{"type", "string"}, {"maxLength", 50}}},
        {"code", {{"type", "string"}, {"pattern", "[a-z]{1,9000}x*"}, {"minLength", 12}}},
        {"work", shorter_uri}}}};
  const std::string e = schema_error(schema);
  EXPECT_EQ(e.find("schema #: the grammar is too large (over 4000000 symbols), most of it the "
                   "lengths beside patterns and formats"),
            0u)
      << e;
  const size_t home = e.find("#/properties/home/maxLength ("),
               code = e.find("#/properties/code/minLength (");
  EXPECT_NE(home, std::string::npos) << e;
  EXPECT_NE(code, std::string::npos) << e;
  EXPECT_LT(home, code) << e;  // the larger first
  EXPECT_NE(e.find("#/properties/work/maxLength ("), std::string::npos) << e;
  EXPECT_EQ(e.find("#/properties/note"), std::string::npos) << e;
  EXPECT_EQ(e.find("#/properties/id"), std::string::npos) << e;
  // Those named are what made it too large: without them the rest compiles.
  json rest = schema;
  rest["properties"].erase("home");
  rest["properties"].erase("code");
  rest["properties"].erase("work");
  rest["properties"]["more"] = uri;
  EXPECT_EQ(schema_error(rest), "(compiled)");
  // The same field twice is compiled once (its grammar is shared), and fits.
  EXPECT_EQ(schema_error({{"type", "array"}, {"items", {{"anyOf", {uri, uri}}}}}), "(compiled)");
}

// A length counted beside a format that takes an eighth of the grammar's size is named, but not
// as "most of it" where plain strings took most (it said so of any named part).
TEST(StructuredOutput, CountedLengthsAreMostOfAGrammarTooLargeOnlyWhereTheyTakeOverHalf) {
  json properties = {{"a_home", {{"type", "string"}, {"format", "uri"}, {"maxLength", 2500}}}};
  for (int i = 0; i < 9; ++i)  // each about 400,000 symbols, compiled after the uri
    properties["b_note" + std::to_string(i)] = {{"type", "string"}, {"maxLength", 100000 - i}};
  const std::string e = schema_error({{"type", "object"}, {"properties", properties}});
  EXPECT_EQ(e.find("schema #: the grammar is too large (over 4000000 symbols), the largest parts "
                   "of it the lengths beside patterns and formats, counted once per length: "
                   "#/properties/a_home/maxLength ("),
            0u)
      << e;
  EXPECT_EQ(e.find("most of it"), std::string::npos) << e;
  EXPECT_EQ(e.find("note"), std::string::npos) << e;
}

// A field of a format (or a pattern) with no lengths, whose grammar crosses the size after
// lengths counted beside formats filled most of it: the refusal names those lengths (it blamed
// the small field's "/pattern", even for a format, and named nothing to lower).
TEST(StructuredOutput, AFormatPastTheGrammarsSizeAfterCountedLengthsNamesThoseLengths) {
  auto uri = [](int64_t max_length) {
    return json{{"type", "string"}, {"format", "uri"}, {"maxLength", max_length}};
  };
  // Properties in the order they are compiled (json sorts its keys).
  auto schema = [&](int64_t office_length, const json& when) {
    return json{
        {"type", "object"},
        {"properties", {{"home", uri(10000)}, {"office", uri(office_length)}, {"when", when}}}};
  };
  const json plain = {{"type", "string"}},
             date_time = {{"type", "string"}, {"format", "date-time"}};
  auto symbols = [&](int64_t office_length) {
    Grammar g;
    json_schema_rule(g, nlohmann::ordered_json::parse(schema(office_length, plain).dump()));
    return int64_t(g.symbols());
  };
  // The office's maxLength that takes the grammar just past its size, "when" a plain string
  // (each length of the uri's takes the same symbols).
  const int64_t per_length = (symbols(2000) - symbols(1000)) / 1000;
  const int64_t past = 1000 + (int64_t(Grammar::kMaxSymbols) - symbols(1000)) / per_length + 1;
  ASSERT_EQ(schema_error(schema(past - 1, plain)), "(compiled)");
  ASSERT_EQ(schema_error(schema(past, plain)).find("schema #: the grammar is too large"), 0u);
  // The date-time's grammar takes more than a plain string's, and crosses the size there.
  const std::string e = schema_error(schema(past, date_time));
  EXPECT_EQ(e.find("schema #: the grammar is too large (over 4000000 symbols)"), 0u) << e;
  EXPECT_NE(e.find("#/properties/home/maxLength ("), std::string::npos) << e;
  EXPECT_NE(e.find("#/properties/office/maxLength ("), std::string::npos) << e;
  EXPECT_EQ(e.find("when"), std::string::npos) << e;
}

// A grammar too large without a pattern's or format's counted lengths in it names the parts that
// took it, or where it passed the limit (it said only "schema #: the grammar is too large").
TEST(StructuredOutput, AGrammarTooLargeAlwaysNamesWhere) {
  auto name = [](const char* prefix, int i) {
    char n[16];
    std::snprintf(n, sizeof n, "%s%02d", prefix, i);
    return std::string(n);
  };
  // Plain strings, each about 400,000 symbols (a tenth of the limit: none large alone).
  json strings = json::object();
  for (int i = 0; i < 11; ++i)
    strings[name("p", i)] = {{"type", "string"}, {"maxLength", 100000 - i}};
  const std::string e = schema_error({{"type", "object"}, {"properties", strings}});
  EXPECT_EQ(e.find("schema #: the grammar is too large (over 4000000 symbols), the largest parts "
                   "of it the lengths and item counts"),
            0u)
      << e;
  EXPECT_NE(e.find("#/properties/p00/maxLength ("), std::string::npos) << e;
  // Arrays, each about 70,000 symbols.
  json arrays = json::object();
  for (int i = 0; i < 60; ++i)
    arrays[name("a", i)] = {
        {"type", "array"}, {"items", {{"type", "integer"}}}, {"maxItems", 10000 - i}};
  const std::string a = schema_error({{"type", "object"}, {"properties", arrays}});
  EXPECT_NE(a.find("#/properties/a00/maxItems ("), std::string::npos) << a;
  // Long enums: no bound to lower, so where the limit was passed.
  json enums = json::object();
  for (int i = 0; i < 50; ++i) {
    json values = json::array();
    for (int v = 0; v < 1000; ++v)
      values.push_back(name("e", i) + std::to_string(v) + std::string(100, 'x'));
    enums[name("e", i)] = {{"enum", values}};
  }
  const std::string n = schema_error({{"type", "object"}, {"properties", enums}});
  EXPECT_EQ(n.find("schema #: the grammar is too large (over 4000000 symbols)"), 0u) << n;
  EXPECT_NE(n.find("passed that size at #/properties/e"), std::string::npos) << n;
}

// A length or item count that would take the grammar past its size is refused before its rules are
// made (the rules of lengths up to the limit were made first: ~100,000 of them for a string, an
// automaton's states once per length for a format), at the same bound as before: the largest
// length that fits compiles, the next is refused.
TEST(StructuredOutput, ALengthPastTheGrammarsSizeIsRefusedBeforeItIsBuilt) {
  // Sixty plain strings, 3.6 million symbols (each under a 64th of the limit, too small to be
  // named), and a string of `extra` characters, then `last` as property "z".
  auto schema = [](const json& last, int64_t extra) {
    json properties = json::object();
    for (int i = 0; i < 60; ++i) {
      char name[8];
      std::snprintf(name, sizeof name, "p%02d", i);
      properties[name] = {{"type", "string"}, {"maxLength", 15000 - i}};
    }
    if (extra > 0) properties["q"] = {{"type", "string"}, {"maxLength", extra}};
    properties["z"] = last;
    return json{{"type", "object"}, {"properties", properties}};
  };
  auto grammar_of = [](const json& schema, Grammar& g) {
    try {
      json_schema_rule(g, nlohmann::ordered_json::parse(schema.dump()));
      return std::string("(compiled)");
    } catch (const Error& e) {
      return std::string(e.what());
    }
  };
  auto symbols = [&](const json& schema) {
    Grammar g;
    EXPECT_EQ(grammar_of(schema, g), "(compiled)");
    return int64_t(g.symbols());
  };
  const json plain = {{"type", "string"}};
  const json uri = {{"type", "string"}, {"format", "uri"}};
  // (Lengths below kMaxCharacters reach the limit: a maxLength takes 4 symbols per character, a
  // minLength 1.)
  for (const auto& [kind, bound, first, extra] :
       {std::tuple{plain, "maxLength", int64_t{1000}, int64_t{10000}},
        std::tuple{uri, "maxLength", int64_t{100}, int64_t{0}},
        std::tuple{plain, "minLength", int64_t{1000}, int64_t{85000}}}) {
    SCOPED_TRACE(kind.dump() + " " + bound);
    auto with = [&](int64_t n) {
      json last = kind;
      last[bound] = n;
      return schema(last, extra);
    };
    // Symbols grow by the same amount per length: the largest length that fits.
    const int64_t per = (symbols(with(first * 2)) - symbols(with(first))) / first;
    const int64_t fits = first + (int64_t(Grammar::kMaxSymbols) - symbols(with(first))) / per;
    ASSERT_EQ(schema_error(with(fits)), "(compiled)");
    ASSERT_EQ(schema_error(with(fits + 1)).find("schema #: the grammar is too large"), 0u);
    // A length that passes the size by 10,000 symbols or more (more than the object's members
    // take after it): refused by name, and no rule of its was made.
    Grammar refused;
    const std::string e = grammar_of(with(fits + 10000 / per + 1), refused);
    EXPECT_EQ(e.find("schema #: the grammar is too large (over 4000000 symbols)"), 0u) << e;
    EXPECT_NE(e.find("#/properties/z/" + std::string(bound) + " ("), std::string::npos) << e;
    EXPECT_EQ(e.find("#/properties/p"), std::string::npos) << e;
    Grammar without;
    grammar_of(schema(json{{"type", "null"}}, extra), without);
    EXPECT_LT(refused.rules(), without.rules() + 100);
  }
}

// A pattern or format beside lengths that need no counting (its strings all have them) is read
// once: its lengths and its grammar come from one parse (it was parsed for its lengths, then
// again for its grammar), and the grammar is the one it has without the lengths.
TEST(StructuredOutput, APatternBesideLengthsThatAddNothingIsParsedOnce) {
  for (const json& schema : {json{{"type", "string"}, {"format", "date-time"}, {"maxLength", 100}},
                             json{{"type", "string"},
                                  {"pattern", "[a-z]{2,5}(?:x|yz)"},
                                  {"minLength", 1},
                                  {"maxLength", 9}}}) {
    SCOPED_TRACE(schema.dump());
    Grammar g;
    const int64_t before = patterns_parsed();
    g.finish(json_schema_rule(g, nlohmann::ordered_json::parse(schema.dump())));
    EXPECT_EQ(patterns_parsed() - before, 1);
    json without = schema;
    without.erase("minLength");
    without.erase("maxLength");
    Grammar plain;
    plain.finish(json_schema_rule(plain, nlohmann::ordered_json::parse(without.dump())));
    EXPECT_EQ(g.size(), plain.size());
    EXPECT_EQ(g.rules(), plain.rules());
  }
}

// A group repeated is one symbol of its repeat's item, however long the group: the grammar grows
// with the count, not with the count times the group (after the compiler began emitting from the
// parse tree, `(?:` + 400 'a's + `){10000}` took over 4,000,000 symbols and was refused as too
// large, where before it compiled in about 11,000).
TEST(StructuredOutput, ARepeatedGroupCostsItsCountNotItsCountTimesItsLength) {
  using K = OutputSpec::Kind;
  EXPECT_EQ(compile_error(K::kRegex, "^(?:" + std::string(400, 'a') + "){10000}$"), "(compiled)");
  Grammar g;
  g.finish(regex_rule(g, "(?:abcdefghij){10000}"));
  EXPECT_LT(g.symbols(), 20'000u);
  // And it matches what it matched.
  const auto ten = compile({K::kRegex, "(?:abc|de){2,3}x", "f"});
  for (const auto& [text, accepted] :
       std::vector<std::pair<std::string, bool>>{{"abcdex", true},
                                                 {"deabcdex", true},
                                                 {"abcx", false},
                                                 {"dededex", true},
                                                 {"dedededex", false}})
    EXPECT_EQ(full_match(ten, text), accepted) << text;
}

// Tools share one grammar: where a later tool's schema passes its size after an earlier tool's
// took most of it, the refusal says so, naming the earlier tool (it named only the later tool's
// bounds, as if they alone had made the grammar too large).
TEST(StructuredOutput, AToolPastTheGrammarsSizeNamesTheToolsBeforeItThatTookIt) {
  json big = json::object(), small = json::object();
  for (int i = 0; i < 9; ++i)  // each about 400,000 symbols
    big["note" + std::to_string(i)] = {{"type", "string"}, {"maxLength", 100000 - i}};
  small["text"] = {{"type", "string"}, {"maxLength", 100000}};
  auto tool = [](const std::string& name, const json& properties) {
    return json{{"name", name}, {"parameters", {{"type", "object"}, {"properties", properties}}}};
  };
  const json calls = {{"open", "<calls>"},
                      {"call_prefix", "<call>"},
                      {"after_name", ":"},
                      {"call_suffix", "</call>"},
                      {"between", ","},
                      {"close", "</calls>"},
                      {"functions", {tool("big_one", big), tool("small_one", small)}}};
  std::string e = "(compiled)";
  try {
    Grammar g;
    tool_calls_rule(g, nlohmann::ordered_json::parse(calls.dump()));
  } catch (const Error& error) {
    e = error.what();
  }
  EXPECT_EQ(e.find("function 'small_one' parameters: schema #: the grammar is too large"), 0u) << e;
  const size_t before = e.find(
      " symbols were taken by the schemas before this one: function "
      "'big_one' (");
  EXPECT_NE(before, std::string::npos) << e;
  // Each alone fits.
  for (const json& one : {tool("big_one", big), tool("small_one", small)}) {
    json alone = calls;
    alone["functions"] = {one};
    Grammar g;
    EXPECT_NO_THROW(tool_calls_rule(g, nlohmann::ordered_json::parse(alone.dump())));
  }
}

// uri (RFC 3986's URI, its host a name: no IP-literal), uri-reference (a URI or a relative
// reference) and hostname (RFC 1123), as xgrammar has them: exactly what the oracle's
// transcription of the RFCs' ABNF takes and urllib.parse reads alike.
TEST(StructuredOutput, UriUriReferenceAndHostnameFormatsAcceptExactlyTheirRfcs) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> formats = {
      {"uri",
       {R"("http://example.org/a/b?c=d&e#f")", R"("mailto:a@b.org")", R"("urn:isbn:0451450523")",
        R"("a:")", R"("http://user:pw@host:8080/p")", R"("http://[::1]/")", R"("1http://a")",
        R"("//a/b")", R"("/a")", R"("http://a b")", R"("http://a%2Fb/%41")", R"("http://a%zz")",
        R"("a+b-c.d:x")", R"("http:\/\/a")", R"("file:///etc/hosts")", R"("")"}},
      {"uri-reference",
       {R"("")", R"("/a")", R"("a")", R"("a:b")", R"("//h/p")", R"("?q")", R"("#f")", R"("./a:b")",
        R"("%41")", R"("a b")", R"("[x]")", R"("http://[::1]/")"}},
      {"hostname",
       {R"("a")", R"("example.org")", R"("A-1.b2")", R"("-a.b")", R"("a-.b")", R"("a..b")",
        R"("a.")", R"("")", R"("a_b.c")", R"("123.45")"}},
  };
  std::vector<FormatCheck> cases;
  for (const auto& [f, extra] : formats)
    cases.push_back({{{"type", "string"}, {"format", f}}, {{"kind", f}}, extra});
  expect_grammars_agree_with_the_oracle(cases);
}

// duration (RFC 3339's Appendix A, JSON Schema's) and json-pointer (RFC 6901): exactly what the
// oracle's readings of their ABNF take (they were refused as formats not enforced). Pydantic's
// timedelta field is {"type": "string", "format": "duration"}.
TEST(StructuredOutput, DurationAndJsonPointerFormatsAcceptExactlyTheirRfcs) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> formats = {
      {"duration",
       {R"("P1Y2M3DT4H5M6S")", R"("P1Y2D")", R"("P1M2D")", R"("PT1H3S")", R"("PT1H2M3S")",
        R"("P1W")", R"("P1W2D")", R"("P")", R"("PT")", R"("P1DT")", R"("P1.5D")", R"("P1D2M")",
        R"("PT2M")", R"("p1d")", R"("P007D")", R"("1D")"}},
      {"json-pointer",
       {R"("")", R"("/")", R"("//")", R"("/a~0b/~1")", R"("/a~")", R"("/~2")", R"("a/b")",
        R"("/\u0000\n\"")", "\"/\xc3\xa9/\xe4\xb8\xad\"", R"("/\/")", R"("/~~01")", R"("/~01~")"}},
  };
  std::vector<FormatCheck> cases;
  for (const auto& [f, extra] : formats)
    cases.push_back({{{"type", "string"}, {"format", f}}, {{"kind", f}}, extra});
  // Within lengths too.
  cases.push_back({{{"type", "string"}, {"format", "duration"}, {"maxLength", 6}},
                   {{"kind", "duration"}, {"maxLength", 6}},
                   {R"("PT1H2M")", R"("PT1H2M3S")"}});
  expect_grammars_agree_with_the_oracle(cases);
}

// The same bounds on "type": "number": numbers whose value, as a JSON parser reads it (Python
// compares an int exactly, a float as a double), lies in the range, written without an exponent,
// in at most 16 digits before the point and 16 after, never as -0 (string_format_oracle.py's
// "number").
TEST(StructuredOutput, NumberBoundsAcceptExactlyTheNumbersInTheRange) {
  const std::vector<json> ranges = {
      {{"minimum", 0}, {"maximum", 1}},
      {{"minimum", -2.5}, {"exclusiveMaximum", 0.1}},
      {{"exclusiveMinimum", 0}},
      {{"maximum", -0.001}},
      {{"minimum", 1.25}, {"maximum", 1.375}},
      {{"minimum", -100}, {"maximum", 100}},
      {{"exclusiveMinimum", 99.5}, {"exclusiveMaximum", 100.5}},
      {{"minimum", 0.1}, {"maximum", 0.3}},
      {{"minimum", 3}, {"maximum", 3}},
      {{"minimum", -7.75}, {"maximum", -7.5}},
      {{"minimum", -1e30}, {"maximum", 1e30}},
      // Integers past 2^53, which Python compares exactly: 9007199254740995 reads as the
      // double 9007199254740996, above it, and 9007199254740993 as 9007199254740992, below it.
      {{"maximum", 9007199254740995}},
      {{"minimum", 9007199254740993}},
      {{"minimum", -9007199254740995}, {"maximum", -9007199254740993}},
      {{"exclusiveMinimum", 9007199254740993}, {"exclusiveMaximum", 9007199254740996}},
      {{"minimum", 9007199254740995}, {"maximum", 9007199254740995}},
      // The largest integer an answer may write, which reads as the double 1e16, above it.
      {{"maximum", 9999999999999999}},
  };
  std::vector<FormatCheck> cases;
  for (const auto& r : ranges) {
    json schema = r;
    schema["type"] = "number";
    json check = r;
    check["kind"] = "number";
    std::vector<std::string> extra = {"-0",
                                      "-0.0",
                                      "0",
                                      "0.0",
                                      "1e2",
                                      "0.5",
                                      "00.5",
                                      "1.",
                                      ".5",
                                      "0.10000000000000001",
                                      "0.1000000000000001"};
    for (const auto& [k, v] : r.items())
      for (double d : {-0.01, -0.001, 0.0, 0.001, 0.01}) {
        const double x = v.get<double>() + d;
        if (std::fabs(x) < 1e15) extra.push_back(json(x).dump());
      }
    for (const auto& [k, v] : r.items())
      if (v.is_number_integer())
        for (int64_t d : {-2, -1, 0, 1, 2}) {
          const std::string n = std::to_string(v.get<int64_t>() + d);
          for (const char* point : {"", ".0"}) extra.push_back(n + point);
        }
    cases.push_back({schema, check, extra});
  }
  expect_grammars_agree_with_the_oracle(cases);
}

// What is not enforced is refused, naming the keyword (or the format) and where it stands.
TEST(StructuredOutput, FormatsPatternsAndBoundsThatCannotBeEnforcedAreRefusedByName) {
  auto error = [](const json& schema) { return schema_error(schema); };
  auto refused = [&](const json& schema, const std::string& says) {
    const std::string e = error(schema);
    EXPECT_NE(e.find(says), std::string::npos) << schema.dump() << "\n  " << e;
  };
  refused({{"properties", {{"d", {{"type", "string"}, {"format", "uri-template"}}}}}},
          "#/properties/d/format: the format 'uri-template' is not supported");
  refused({{"type", "string"}, {"format", 3}}, "'format' must be a string");
  refused({{"type", "string"}, {"pattern", "(a"}}, "#/pattern: regex at offset");
  refused({{"type", "string"}, {"pattern", "a+"}, {"format", "date"}}, "'pattern' beside 'format'");
  // Lengths beside a pattern or a format are enforced (LengthsBesideAPatternOrFormat...); a
  // pair that no string satisfies is refused, as is a pair whose grammar would be too large.
  refused({{"type", "string"}, {"format", "date"}, {"minLength", 11}},
          "#: no string of 11 or more characters matches the format");
  refused({{"type", "string"}, {"format", "hostname"}, {"minLength", 254}},
          "#: no string of 254 or more characters matches the format (its strings have at most "
          "253)");
  refused({{"type", "string"}, {"pattern", "(ab){2}|a{7}"}, {"minLength", 5}, {"maxLength", 6}},
          "#: no string of 5 to 6 characters matches the pattern");
  refused({{"type", "string"}, {"format", "uri"}, {"maxLength", 100000}},
          "#/maxLength: 'maxLength' beside 'format' is enforced for at most");
  refused({{"type", "string"}, {"pattern", "[a-z]{1,9000}x*"}, {"minLength", 40000}},
          "#/minLength: 'minLength' beside 'pattern' is enforced for at most");
  EXPECT_EQ(error({{"type", "string"}, {"format", "date"}, {"minLength", 10}, {"maxLength", 10}}),
            "(compiled)");
  EXPECT_EQ(error({{"type", "string"}, {"pattern", "^[A-Z]{2,3}$"}, {"maxLength", 3}}),
            "(compiled)");
  refused({{"type", "integer"}, {"minimum", 5}, {"maximum", 4}}, "no integer");
  refused({{"type", "integer"}, {"minimum", "0"}}, "#/minimum: 'minimum' must be a number");
  refused({{"type", "integer"}, {"exclusiveMinimum", true}}, "'exclusiveMinimum' must be a number");
  refused({{"type", "number"}, {"minimum", 5}, {"exclusiveMaximum", 5}}, "#: no number");
  refused({{"type", "number"}, {"minimum", 1e20}}, "#: no number");
  refused({{"type", "number"}, {"exclusiveMaximum", -1e16}}, "#: no number");
  // Ranges between numbers of 16 fraction digits hold none an answer may write.
  for (const json& bounds : {json{{"minimum", 1e-20}, {"maximum", 2e-20}},
                             json{{"minimum", -2e-20}, {"maximum", -1e-20}},
                             json{{"exclusiveMinimum", 0.1}, {"maximum", 0.10000000000000002}}}) {
    json schema = bounds;
    schema["type"] = "number";
    refused(schema, "#: no number of at most 16 digits and 16 fraction digits lies within");
  }
  refused({{"minimum", 0}}, "#/minimum: 'minimum' is enforced on integers and numbers only");
  // Where they do not apply, as JSON Schema has it, they constrain nothing: a format or pattern
  // beside "type": "integer", bounds beside "type": "string".
  EXPECT_EQ(error({{"type", "integer"}, {"format", "int64"}}), "(compiled)");
  EXPECT_EQ(error({{"type", "string"}, {"minimum", 3}}), "(compiled)");
}

// Pydantic's datetime, date, UUID, EmailStr, constr(pattern=...), conint(ge=..., le=...),
// confloat(gt=..., le=...) and HttpUrl (its maxLength 40, not 2083, so that random walks end)
// fields, as OpenAI's client.beta.chat.completions.parse sends them: answers sampled through the
// masks of a real vocabulary are valid JSON whose fields Python's parsers read.
TEST(StructuredOutput, AnswersToAPydanticModelWithFormatsReadBackThroughPythonsParsers) {
  const json schema = json::parse(R"({
    "title": "Booking", "type": "object", "additionalProperties": false,
    "properties": {
      "when": {"title": "When", "type": "string", "format": "date-time"},
      "day": {"type": "string", "format": "date"},
      "id": {"type": "string", "format": "uuid"},
      "mail": {"type": "string", "format": "email"},
      "code": {"type": "string", "pattern": "^[A-Z]{3}-\\d{2}$"},
      "seats": {"type": "integer", "minimum": 1, "maximum": 12},
      "rating": {"type": "number", "exclusiveMinimum": 0, "maximum": 5},
      "site": {"type": "string", "format": "uri", "minLength": 1, "maxLength": 40},
      "note": {"anyOf": [{"type": "string", "format": "time"}, {"type": "null"}]}},
    "required": ["when", "day", "id", "mail", "code", "seats", "rating", "site", "note"]})");
  StructuredOutputs outputs(std::make_shared<const text::Tokenizer>(
      text::Tokenizer::from_dir(test::lenml_model("deepseek_v3"))));
  std::mt19937 rng(5);
  const Walks w = random_walks(
      outputs, {OutputSpec::Kind::kJsonSchema, schema.dump(), "response_format"}, 12, 400, rng);
  ASSERT_FALSE(w.complete.empty()) << "no walk finished";
  const std::vector<std::pair<std::string, json>> fields = {
      {"when", {{"kind", "date-time"}}},
      {"day", {{"kind", "date"}}},
      {"id", {{"kind", "uuid"}}},
      {"mail", {{"kind", "email"}}},
      {"code", {{"kind", "pattern"}, {"pattern", "^[A-Z]{3}-\\d{2}$"}}},
      {"seats", {{"kind", "integer"}, {"minimum", 1}, {"maximum", 12}}},
      {"rating", {{"kind", "number"}, {"exclusiveMinimum", 0}, {"maximum", 5}}},
      {"site", {{"kind", "uri"}, {"minLength", 1}, {"maxLength", 40}}}};
  json checks = json::array();
  for (const auto& [name, check] : fields) {
    json c = check;
    c["texts"] = json::array();
    for (const auto& answer : w.complete) c["texts"].push_back(json::parse(answer)[name].dump());
    checks.push_back(c);
  }
  json notes = {{"kind", "time"}, {"texts", json::array()}};
  for (const auto& answer : w.complete)
    if (!json::parse(answer)["note"].is_null())
      notes["texts"].push_back(json::parse(answer)["note"].dump());
  checks.push_back(notes);
  const json judged = string_format_oracle(checks);
  ASSERT_EQ(judged.size(), checks.size());
  for (size_t i = 0; i < checks.size(); ++i)
    for (size_t j = 0; j < checks[i]["texts"].size(); ++j)
      EXPECT_TRUE(judged[i][j]["valid"].get<bool>())
          << checks[i]["kind"] << " " << checks[i]["texts"][j] << ": " << judged[i][j]["why"];
  // The whole answers validate too (pattern and bounds, which jsonschema checks).
  const json whole = oracle({{"schema", {{{"schema", schema}, {"answers", w.complete}}}}});
  for (size_t j = 0; j < w.complete.size(); ++j)
    EXPECT_TRUE(whole["schema"][0][j].is_null()) << w.complete[j] << ": " << whole["schema"][0][j];
}

}  // namespace
}  // namespace tandem::structured
