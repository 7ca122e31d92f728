// parse_untrusted_json against nlohmann's parser (the oracle): the same verdict and the same
// document, value types included, on generated documents and on mutations of them; hostile
// nesting is refused without recursion; errors name the byte.
#include "util/json.h"

#include <gtest/gtest.h>

#include <random>
#include <string>

#include "util/error.h"

namespace tandem {
namespace {

using nlohmann::json;

// The same document: equal types at every node (an unsigned 1 is not a signed 1 or 1.0).
::testing::AssertionResult same(const json& a, const json& b, const std::string& at = "$") {
  if (a.type() != b.type())
    return ::testing::AssertionFailure() << at << ": " << a.type_name() << " " << a.dump() << " vs "
                                         << b.type_name() << " " << b.dump();
  if (a.is_array()) {
    if (a.size() != b.size()) return ::testing::AssertionFailure() << at << ": array sizes";
    for (size_t i = 0; i < a.size(); ++i)
      if (auto r = same(a[i], b[i], at + "[" + std::to_string(i) + "]"); !r) return r;
    return ::testing::AssertionSuccess();
  }
  if (a.is_object()) {
    if (a.size() != b.size()) return ::testing::AssertionFailure() << at << ": object sizes";
    for (auto it = a.begin(); it != a.end(); ++it) {
      if (!b.contains(it.key())) return ::testing::AssertionFailure() << at << ": " << it.key();
      if (auto r = same(it.value(), b.at(it.key()), at + "." + it.key()); !r) return r;
    }
    return ::testing::AssertionSuccess();
  }
  if (a != b) return ::testing::AssertionFailure() << at << ": " << a.dump() << " vs " << b.dump();
  return ::testing::AssertionSuccess();
}

// Both parsers on `text`: both refuse it, or both give the same document.
::testing::AssertionResult agrees(const std::string& text) {
  std::optional<json> oracle, ours;
  try {
    oracle = json::parse(text);
  } catch (const json::exception&) {
  }
  std::string error;
  try {
    ours = parse_untrusted_json(text, 1000);
  } catch (const Error& e) {
    error = e.what();
  }
  if (oracle.has_value() != ours.has_value())
    return ::testing::AssertionFailure()
           << (oracle ? "nlohmann accepts, ours refuses (" + error + ")"
                      : "nlohmann refuses, ours accepts")
           << ": " << ::testing::PrintToString(text);
  if (!oracle) return ::testing::AssertionSuccess();
  auto r = same(*oracle, *ours);
  if (!r) r << " in " << ::testing::PrintToString(text);
  return r;
}

class Generator {
 public:
  explicit Generator(uint32_t seed) : rng_(seed) {}

  std::string document(int depth = 0) {
    switch (pick(depth < 4 ? 8 : 5)) {
      case 0:
        return number();
      case 1:
        return string();
      case 2:
        return std::vector<const char*>{"true", "false", "null"}[pick(3)];
      case 3:
      case 4:
        return number();
      case 5:
      case 6: {
        std::string s = "[" + space();
        const int n = pick(6);
        for (int i = 0; i < n; ++i) s += (i ? "," + space() : "") + document(depth + 1) + space();
        return s + "]";
      }
      default: {
        std::string s = "{" + space();
        const int n = pick(5);
        for (int i = 0; i < n; ++i)
          s += (i ? "," : "") + space() + string() + space() + ":" + space() + document(depth + 1);
        return s + space() + "}";
      }
    }
  }

  // A byte changed, dropped, inserted or the text cut short.
  std::string mutate(std::string s) {
    static const std::string bytes =
        "{}[]\",:.-+eE0123456789 \\u\x01\x7f\xc3\xa9\xed\xa0\xf4\x90tfn";
    if (s.empty()) return s;
    const size_t at = size_t(pick(int(s.size())));
    switch (pick(4)) {
      case 0:
        s[at] = bytes[size_t(pick(int(bytes.size())))];
        break;
      case 1:
        s.erase(at, 1);
        break;
      case 2:
        s.insert(at, 1, bytes[size_t(pick(int(bytes.size())))]);
        break;
      default:
        s.resize(at);
        break;
    }
    return s;
  }

 private:
  int pick(int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng_); }
  std::string space() {
    static const char* spaces[] = {"", "", "", " ", "\n", "\t ", "\r\n  "};
    return spaces[pick(7)];
  }
  std::string number() {
    static const char* special[] = {"0",
                                    "-0",
                                    "-0.0",
                                    "1e-400",
                                    "18446744073709551615",
                                    "18446744073709551616",
                                    "-9223372036854775808",
                                    "-9223372036854775809",
                                    "9223372036854775807",
                                    "1E+2",
                                    "0.1",
                                    "123456789012345678901234567890",
                                    "2.5e-3",
                                    "1e308"};
    switch (pick(5)) {
      case 0:
        return special[pick(14)];
      case 1:
        return std::to_string(std::uniform_int_distribution<int64_t>()(rng_));
      case 2:
        return std::to_string(std::uniform_int_distribution<uint32_t>()(rng_) % 130000);
      case 3:
        return std::to_string(std::uniform_real_distribution<double>(-1e6, 1e6)(rng_));
      default:
        return std::to_string(pick(1000)) + "e" + std::to_string(pick(40) - 20);
    }
  }
  std::string string() {
    static const char* pieces[] = {"a",
                                   "hello",
                                   " ",
                                   "\\\"",
                                   "\\\\",
                                   "\\/",
                                   "\\b\\f\\n\\r\\t",
                                   "\\u00e9",
                                   "\\u0000",
                                   "\\ud83d\\ude00",
                                   "\xc3\xa9",
                                   "\xe2\x82\xac",
                                   "\xf0\x9f\x98\x80",
                                   "\\uABCD",
                                   "key"};
    std::string s = "\"";
    const int n = pick(5);
    for (int i = 0; i < n; ++i) s += pieces[pick(15)];
    return s + "\"";
  }
  std::mt19937 rng_;
};

TEST(Json, GeneratedDocumentsParseAsNlohmannParsesThem) {
  Generator g(1);
  for (int i = 0; i < 3000; ++i) ASSERT_TRUE(agrees(g.document()));
}

TEST(Json, MutatedDocumentsAreRefusedOrAcceptedAsNlohmannDoes) {
  Generator g(2);
  int accepted = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string doc = g.document();
    for (int k = 0; k < 3; ++k) doc = g.mutate(doc);
    ASSERT_TRUE(agrees(doc));
    try {
      parse_untrusted_json(doc, 1000);
      ++accepted;
    } catch (const Error&) {
    }
  }
  // Both verdicts are well represented.
  EXPECT_GT(accepted, 1000);
  EXPECT_LT(accepted, 19000);
}

TEST(Json, EdgeCasesAgreeWithNlohmann) {
  for (const char* text : {"",
                           " ",
                           "0",
                           "-",
                           "-0",
                           "01",
                           "1.",
                           ".5",
                           "1e",
                           "1e+",
                           "+1",
                           "0x10",
                           "1e999",
                           "-1e999",
                           "\"\\uD800\"",
                           "\"\\uDC00\"",
                           "\"\\uD800\\u0041\"",
                           "\"\\uD83D\\uDE00\"",
                           "\"\\x\"",
                           "\"\\u12G4\"",
                           "\"\xc0\x80\"",
                           "\"\xed\xa0\x80\"",
                           "\"\xf4\x90\x80\x80\"",
                           "\"\xff\"",
                           "\"\x1f\"",
                           "\"\x7f\"",
                           "\xEF\xBB\xBF{}",
                           "\xEF\xBB{}",
                           "[1,]",
                           "[,1]",
                           "{\"a\":1,}",
                           "{\"a\" 1}",
                           "{1:2}",
                           "{\"a\":1,\"a\":2}",
                           "[1 2]",
                           "nul",
                           "truex",
                           "[true,false,null]",
                           "{} {}",
                           "[]]",
                           "[[[]]]",
                           "\"a\"\"b\"",
                           "123abc",
                           "[-]",
                           "1.5e3",
                           "-12.25E-2"})
    EXPECT_TRUE(agrees(text)) << ::testing::PrintToString(std::string(text));
}

TEST(Json, LargeTokenListsParseExactly) {
  std::string text = "{\"prompt\": [";
  for (int i = 0; i < 20000; ++i) {
    if (i) text += ',';
    text += std::to_string(i * 7919 % 129280);
  }
  text += "], \"max_tokens\": 16, \"temperature\": 0.0}";
  EXPECT_TRUE(agrees(text));
  const json j = parse_untrusted_json(text);
  EXPECT_EQ(j["prompt"].size(), 20000u);
  EXPECT_TRUE(j["prompt"][5].is_number_unsigned());
}

TEST(Json, NestingBeyondTheLimitIsRefusedWithoutRecursion) {
  EXPECT_NO_THROW(parse_untrusted_json(std::string(64, '[') + std::string(64, ']')));
  for (const std::string& deep :
       {std::string(65, '[') + std::string(65, ']'), std::string(4 << 20, '['), [] {
          std::string s;
          for (int i = 0; i < 200000; ++i) s += "{\"a\":";
          return s;
        }()}) {
    try {
      parse_untrusted_json(deep);
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("deeper than 64 levels"), std::string::npos) << e.what();
    }
  }
}

TEST(Json, ReleasingADocumentEmptiesItWithoutRecursion) {
  json doc = parse_untrusted_json(R"({"a": [1, [2, {"b": [3, 4]}], "x"], "c": {"d": {}}, "e": 5})");
  release_json(doc);
  EXPECT_TRUE(doc.is_null());
  // 100,000 levels would overflow a recursive walk's stack.
  json deep = json::array();
  json* at = &deep;
  for (int i = 0; i < 100000; ++i) {
    at->push_back(json::array({i}));
    at = &at->back();
  }
  release_json(deep);
  EXPECT_TRUE(deep.is_null());
  json scalar = 3;
  { const ReleaseJsonOnExit release{scalar}; }
  EXPECT_TRUE(scalar.is_null());
}

TEST(Json, ErrorsSayWhatAndWhere) {
  try {
    parse_untrusted_json("{\"a\": [1, 2,, 3]}");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "malformed JSON at byte 12: expected a value");
  }
  try {
    parse_json_document("[1", "config.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "config.json: malformed JSON at byte 2: unexpected end "
              "(expected ',' or ']')");
  }
}

TEST(Json, RepeatedKeysAreRefusedByNameWhenAsked) {
  const std::string text = R"({"a": {"x": 1, "y": 2}, "b": {"x": 3}, "a": 4})";
  EXPECT_EQ(parse_untrusted_json(text), json::parse(text));  // the last wins by default
  try {
    parse_untrusted_json(text, 64, DuplicateKeys::kRefuse);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "key 'a' appears twice in one object");
  }
  // The same key in two objects is no repeat.
  EXPECT_EQ(parse_untrusted_json(R"({"a": {"x": 1}, "b": {"x": 2}})", 64, DuplicateKeys::kRefuse),
            json::parse(R"({"a": {"x": 1}, "b": {"x": 2}})"));
  try {
    parse_untrusted_json(R"([{"k": 1}, {"k": 2, "k": 3}])", 64, DuplicateKeys::kRefuse);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "key 'k' appears twice in one object");
  }
}

TEST(Json, ExcerptsAreTheJsonTextCutShort) {
  EXPECT_EQ(json_excerpt(json::parse(R"({"a": [1, "x", null, {}], "b": 2.5})")),
            R"({"a":[1,"x",null,{}],"b":2.5})");
  EXPECT_EQ(json_excerpt(json::parse("[1, 2, 3, 4]"), 4), "[1,2...");
  EXPECT_EQ(json_excerpt(json(std::string(1000, 'a')), 10), "\"aaaaaaaaa...");
  // A cut never splits a UTF-8 sequence: "é" is two bytes, the cut at byte 2 falls inside it.
  EXPECT_EQ(json_excerpt(json("\u00e9\u00e9"), 2), "\"...");
  // nlohmann's dump() of 100,000 levels overflows the stack; an excerpt stops at its limit.
  json deep = json::array();
  json* at = &deep;
  for (int i = 0; i < 100000; ++i) at = &at->emplace_back(json::array());
  EXPECT_EQ(json_excerpt(deep, 5), "[[[[[...");
  json wide = json::object();
  for (int i = 0; i < 100000; ++i) wide[std::to_string(i)] = i;
  EXPECT_EQ(json_excerpt(wide, 12), R"({"0":0,"1":1...)");
}

}  // namespace
}  // namespace tandem
