// Qwen3-MoE: the published configs parse and what the engine does not run is refused by name;
// the CPU forward pass against the independent PyTorch reference (tests/oracle/
// qwen3_moe_reference.py, float32, written from the published architecture): logits at every
// position for sequences fed whole, in chunks and token by token through the paged K/V cache in
// one mixed batch, and greedy continuations, in float32 and bfloat16 checkpoints. Tolerances and
// the routing near-tie rule are numerics_test's (see there).
#include <algorithm>
#include <array>
#include <cstring>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "model/model_test_support.h"
#include "model/qwen3_moe.h"
#include "model/rope.h"
#include "text/oracle_support.h"
#include "text/tokenizer.h"
#include "util/error.h"

namespace tandem::model {
namespace {

using nlohmann::json;

// Qwen/Qwen3-30B-A3B's config.json as published on the Hugging Face Hub (Qwen3-235B-A22B's has
// the same fields: hidden 4096, intermediate 12288, moe_intermediate 1536, 64 heads, 94 layers).
const char* kQwen3_30B_A3B = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
  "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
  "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
  "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
  "norm_topk_prob": true, "num_attention_heads": 32, "num_experts": 128,
  "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
  "output_router_logits": false, "rms_norm_eps": 1e-06, "rope_scaling": null,
  "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": null,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
  "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})";

TEST(Qwen3MoeConfig, ThePublishedConfigsParse) {
  const auto c = Qwen3MoeConfig::parse(json::parse(kQwen3_30B_A3B), "30B-A3B");
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_TRUE(c.is_moe_layer(0));
  EXPECT_TRUE(c.is_moe_layer(47));
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{151645});
  json big = json::parse(kQwen3_30B_A3B);
  for (auto [k, v] : std::vector<std::pair<const char*, int>>{{"hidden_size", 4096},
                                                              {"intermediate_size", 12288},
                                                              {"max_window_layers", 94},
                                                              {"moe_intermediate_size", 1536},
                                                              {"num_attention_heads", 64},
                                                              {"num_hidden_layers", 94}})
    big[k] = v;
  EXPECT_EQ(Qwen3MoeConfig::parse(big, "235B-A22B").num_hidden_layers, 94);
  // YaRN as Qwen documents it for long contexts, and the 2507 releases' longer contexts.
  big["rope_scaling"] = {
      {"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768}};
  big["max_position_embeddings"] = 262144;
  const auto yarn = Qwen3MoeConfig::parse(big, "yarn");
  ASSERT_TRUE(yarn.yarn);
  EXPECT_DOUBLE_EQ(yarn.yarn->factor, 4.0);
  EXPECT_NEAR(yarn.rope_mscale(), 0.1 * std::log(4.0) + 1.0, 1e-12);
  EXPECT_EQ(Qwen3MoeConfig::parse(json::parse(c.to_json().dump()), "round trip"), c);
  // eos_token_id as an integer or a list of them, as transformers' PretrainedConfig takes it.
  json listed = json::parse(kQwen3_30B_A3B);
  listed["eos_token_id"] = {151645, 151643};
  const auto l = Qwen3MoeConfig::parse(listed, "eos list");
  EXPECT_EQ(l.eos_token_ids, (std::vector<int64_t>{151645, 151643}));
  EXPECT_EQ(Qwen3MoeConfig::parse(json::parse(l.to_json().dump()), "round trip"), l);
}

// Qwen3-30B-A3B's config.json changed by `change`: the parse error, or "(parsed)".
std::string config_error(const std::function<void(json&)>& change) {
  json doc = json::parse(kQwen3_30B_A3B);
  change(doc);
  try {
    Qwen3MoeConfig::parse(doc, "config.json");
  } catch (const Error& e) {
    return std::string(e.what());
  }
  return std::string("(parsed)");
}

// transformers >= 4.56 (and v5) write `dtype` for torch_dtype and fold rope_theta and
// rope_scaling into `rope_parameters`: such a config is the same model, as DeepSeek's parser
// already reads it (both families share the reading). They were refused as unknown fields.
TEST(Qwen3MoeConfig, ConfigsAsNewerTransformersWriteThemParse) {
  const auto v4 = Qwen3MoeConfig::parse(json::parse(kQwen3_30B_A3B), "v4");
  json v5 = json::parse(kQwen3_30B_A3B);
  v5.erase("torch_dtype");
  v5["dtype"] = "bfloat16";
  v5.erase("rope_scaling");
  v5.erase("rope_theta");
  v5["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1000000.0}};
  EXPECT_EQ(Qwen3MoeConfig::parse(v5, "v5"), v4);

  json yarn4 = json::parse(kQwen3_30B_A3B);
  yarn4["rope_scaling"] = {
      {"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768}};
  json yarn5 = v5;
  yarn5["rope_parameters"] = {{"rope_type", "yarn"},
                              {"rope_theta", 1000000.0},
                              {"factor", 4.0},
                              {"original_max_position_embeddings", 32768}};
  const auto y = Qwen3MoeConfig::parse(yarn5, "v5 yarn");
  ASSERT_TRUE(y.yarn);
  EXPECT_EQ(y, Qwen3MoeConfig::parse(yarn4, "v4 yarn"));

  // The shared rules hold here too: a dtype this engine does not load, both RoPE objects, an
  // inner rope_theta contradicting the top-level one.
  EXPECT_THAT(config_error([](json& d) { d["dtype"] = "int4"; }), testing::HasSubstr("'dtype'"));
  EXPECT_THAT(config_error([](json& d) {
                d["rope_scaling"] = {{"rope_type", "default"}};
                d["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1000000.0}};
              }),
              testing::HasSubstr("'rope_parameters' and 'rope_scaling' must not both be given"));
  EXPECT_THAT(config_error([](json& d) {
                d.erase("rope_scaling");
                d["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5.0e5}};
              }),
              testing::HasSubstr("rope_theta contradicts the top-level rope_theta"));
}

TEST(Qwen3MoeConfig, WhatTheEngineDoesNotRunIsRefusedByName) {
  const auto& error = config_error;
  EXPECT_NE(error([](json& d) { d["use_sliding_window"] = true; }).find("'use_sliding_window'"),
            std::string::npos);
  EXPECT_NE(error([](json& d) { d["attention_bias"] = true; }).find("'attention_bias'"),
            std::string::npos);
  EXPECT_NE(error([](json& d) { d["hidden_act"] = "gelu"; }).find("'hidden_act'"),
            std::string::npos);
  EXPECT_NE(error([](json& d) { d["num_key_value_heads"] = 5; }).find("'num_key_value_heads'"),
            std::string::npos);
  EXPECT_NE(error([](json& d) { d["num_experts_per_tok"] = 129; }).find("'num_experts_per_tok'"),
            std::string::npos);
  EXPECT_NE(error([](json& d) { d["mlp_only_layers"] = {48}; }).find("'mlp_only_layers'"),
            std::string::npos);
  EXPECT_NE(error([](json& d) { d["qkv_bias"] = true; }).find("'qkv_bias' is not a known field"),
            std::string::npos);
  EXPECT_NE(error([](json& d) {
              d["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", 2.0}};
            }).find("rope_scaling"),
            std::string::npos);
  EXPECT_NE(
      error([](json& d) { d["architectures"] = {"Qwen3ForCausalLM"}; }).find("'architectures'"),
      std::string::npos);
  EXPECT_NE(error([](json& d) {
              d["quantization_config"] = {{"quant_method", "fp8"}};
            }).find("'quantization_config'"),
            std::string::npos);
}

// architecture_of picks a model family before any config is parsed; what it cannot read is
// refused in the form of every config field's message (util/json_fields.h), naming the file.
TEST(Qwen3MoeConfig, ArchitectureOfNamesTheFirstArchitectureOrTheFieldInTheCommonForm) {
  test::TempDir dir("qwen3-architecture-of");
  const std::string file = (dir / "config.json").string();
  auto write = [&](const std::string& text) { std::ofstream(dir / "config.json") << text; };
  auto error = [&](const std::string& text) -> std::string {
    write(text);
    try {
      architecture_of(dir.path());
    } catch (const Error& e) {
      return e.what();
    }
    return "(no error)";
  };
  write(R"({"architectures": ["Qwen3MoeForCausalLM", "Other"], "hidden_size": "anything"})");
  EXPECT_EQ(architecture_of(dir.path()), "Qwen3MoeForCausalLM");
  EXPECT_EQ(error(R"({"model_type": "qwen3_moe"})"),
            file + ": field 'architectures' is required (a list)");
  EXPECT_EQ(error(R"({"architectures": null})"),
            file + ": field 'architectures' is required (a list)");
  EXPECT_EQ(error(R"({"architectures": "Qwen3MoeForCausalLM"})"),
            file + ": field 'architectures' must be a list, got \"Qwen3MoeForCausalLM\"");
  EXPECT_EQ(error(R"({"architectures": []})"),
            file + ": field 'architectures' must name the model's architecture, got []");
  EXPECT_EQ(error(R"({"architectures": [7]})"),
            file + ": field 'architectures[0]' must be a string, got 7");
  EXPECT_EQ(error(R"(["Qwen3MoeForCausalLM"])"), file + ": expected a JSON object");
}

// A config's sizes drive loops and allocations before any weight is read, so values no model has
// are refused by name instead of hanging (a loop over 4e18 layers) or exhausting memory; the
// numeric fields every family shares get DeepSeek's checks.
TEST(Qwen3MoeConfig, ImplausibleSizesAndBrokenNumbersAreRefusedByName) {
  const auto& error = config_error;
  using ::testing::AllOf;
  using ::testing::HasSubstr;
  EXPECT_THAT(error([](json& d) { d["num_hidden_layers"] = int64_t{4'000'000'000'000'000'000}; }),
              AllOf(HasSubstr("config.json"), HasSubstr("'num_hidden_layers'"),
                    HasSubstr("limit of 4096")));
  EXPECT_THAT(error([](json& d) { d["num_experts"] = 1'000'000'000; }),
              AllOf(HasSubstr("'num_experts'"), HasSubstr("limit of 65536")));
  // Each alone is allowed; 48 MoE layers of 65536 experts are 3M expert MLPs.
  EXPECT_THAT(error([](json& d) { d["num_experts"] = 65536; }),
              AllOf(HasSubstr("'num_experts'"), HasSubstr("48 MoE layers")));
  EXPECT_THAT(error([](json& d) { d["vocab_size"] = int64_t{1} << 40; }),
              AllOf(HasSubstr("'vocab_size'"), HasSubstr("limit")));
  EXPECT_THAT(error([](json& d) {
                d["mlp_only_layers"] = {3, 5, 3};
              }),
              AllOf(HasSubstr("'mlp_only_layers'"), HasSubstr("layer 3 twice")));
  EXPECT_THAT(error([](json& d) { d["rms_norm_eps"] = -1e-6; }),
              AllOf(HasSubstr("'rms_norm_eps'"), HasSubstr("positive")));
  EXPECT_THAT(error([](json& d) { d["rope_theta"] = 0; }),
              AllOf(HasSubstr("'rope_theta'"), HasSubstr("positive")));
  EXPECT_THAT(error([](json& d) { d["max_position_embeddings"] = 0; }),
              AllOf(HasSubstr("'max_position_embeddings'"), HasSubstr("positive")));
  EXPECT_THAT(error([](json& d) { d["max_position_embeddings"] = int64_t{1} << 40; }),
              AllOf(HasSubstr("'max_position_embeddings'"), HasSubstr("limit")));
  EXPECT_THAT(error([](json& d) { d["eos_token_id"] = 151936; }),
              AllOf(HasSubstr("'eos_token_id'"), HasSubstr("vocab_size 151936")));
  // An integer or a list of them, as transformers' PretrainedConfig takes it.
  EXPECT_THAT(error([](json& d) {
                d["eos_token_id"] = {151645, 151936};
              }),
              AllOf(HasSubstr("'eos_token_id[1]'"), HasSubstr("vocab_size 151936")));
  EXPECT_THAT(error([](json& d) { d["bos_token_id"] = -1; }),
              AllOf(HasSubstr("'bos_token_id'"), HasSubstr("vocab_size")));
  EXPECT_EQ(error([](json& d) { d["mlp_only_layers"] = {3, 5}; }), "(parsed)");
  // Each within the limit, heads and head_dim made an attention 2^48 wide: a KV-cache entry of
  // 2^49 values, whose block (layers x block size x entry bytes) overflowed int64 in the engine's
  // KV budget check, which reads the config alone.
  EXPECT_THAT(error([](json& d) {
                d["num_attention_heads"] = d["num_key_value_heads"] = d["head_dim"] = 1 << 24;
              }),
              AllOf(HasSubstr("'head_dim'"), HasSubstr("num_attention_heads (16777216)"),
                    HasSubstr("limit of 16777216")));
  // At the limits, a KV block of the engine's largest block size (4096 tokens) has a 64-bit size.
  const Qwen3MoeConfig widest = Qwen3MoeConfig::parse(
      [] {
        json d = json::parse(kQwen3_30B_A3B);
        d["num_attention_heads"] = d["num_key_value_heads"] = 1 << 17;
        d["head_dim"] = 1 << 7;
        d["num_hidden_layers"] = 4096;
        d["torch_dtype"] = "float32";
        return d;
      }(),
      "config.json");
  const LatentCacheShape shape = qwen3_cache_shape(widest, 4096);
  int64_t block_bytes = 0;
  EXPECT_FALSE(
      __builtin_mul_overflow(shape.layers * shape.block_size, shape.entry_bytes(), &block_bytes));
  // Each of these made every logit NaN (YaRN's correction range divides by ln(rope_theta); the
  // last frequency is 1 / rope_theta^(126/128)).
  EXPECT_THAT(error([](json& d) {
                d["rope_theta"] = 1.0;
                d["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
              }),
              AllOf(HasSubstr("'rope_theta'"), HasSubstr("must exceed 1 with YaRN")));
  EXPECT_THAT(error([](json& d) { d["rope_theta"] = 5e-324; }),
              AllOf(HasSubstr("'rope_theta'"), HasSubstr("frequencies that are not finite")));
  EXPECT_THAT(error([](json& d) {
                d["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"mscale", 1e200}};
              }),
              AllOf(HasSubstr("'rope_scaling.mscale'"), HasSubstr("between 0 and 10")));
}

// YaRN on Qwen3-MoE as transformers' _compute_yarn_parameters (v5 modeling_rope_utils.py) has it:
// the expected numbers below come from its formulas transcribed to float64 Python, for Qwen3-30B-
// A3B's head_dim 128, rope_theta 1e6 and max_position_embeddings 40960. Without
// original_max_position_embeddings the context is max_position_embeddings (it was DeepSeek's
// 4096); attention_factor is the magnitude when given (it was refused as an unknown field);
// mscale over mscale_all_dim when both are given and non-zero, else 0.1 ln(factor) + 1 (both were
// ignored); truncate false keeps the correction range's ends fractional (refused before).
TEST(Qwen3MoeConfig, YarnIsTransformersYarn) {
  struct YarnCase {
    const char* name;
    json rope_scaling;
    double magnitude;
    std::array<double, 6> inv_freq;  // of the pairs below
  };
  const std::array<size_t, 6> pairs = {20, 26, 30, 33, 36, 40};
  const std::vector<YarnCase> cases = {
      {"no original context",
       {{"rope_type", "yarn"}, {"factor", 4.0}},
       1.138629436111989,
       {0.01333521432163324, 0.00332952880732352, 0.0011322989162202146, 0.00048587543673854055,
        0.00019844541337815636, 5.2302335589380085e-05}},
      {"attention_factor, and 'type' for 'rope_type'",
       {{"type", "yarn"},
        {"factor", 4.0},
        {"original_max_position_embeddings", 32768},
        {"attention_factor", 1.25}},
       1.25,
       {0.01333521432163324, 0.003168422574711092, 0.0010643609812470017, 0.00045032357551376927,
        0.00017984115587395423, 4.445698525097307e-05}},
      {"mscale and mscale_all_dim",
       {{"rope_type", "yarn"},
        {"factor", 8.0},
        {"original_max_position_embeddings", 32768},
        {"mscale", 0.8},
        {"mscale_all_dim", 0.5}},
       1.0565079928608092,
       {0.01333521432163324, 0.003087869458404878, 0.0009851000571115868, 0.00039107047347248386,
        0.0001395319312815162, 2.2228492625486534e-05}},
      {"mscale_all_dim alone",
       {{"rope_type", "yarn"},
        {"factor", 8.0},
        {"original_max_position_embeddings", 32768},
        {"mscale_all_dim", 1.0}},
       1.2079441541679836,
       {0.01333521432163324, 0.003087869458404878, 0.0009851000571115868, 0.00039107047347248386,
        0.0001395319312815162, 2.2228492625486534e-05}},
      {"betas, untruncated",
       {{"rope_type", "yarn"},
        {"factor", 4.0},
        {"original_max_position_embeddings", 32768},
        {"beta_fast", 16},
        {"beta_slow", 2},
        {"truncate", false}},
       1.138629436111989,
       {0.01333521432163324, 0.003651741272548377, 0.001157093516936135, 0.0004172829799528355,
        0.00011986686741615794, 4.445698525097307e-05}},
  };
  for (const auto& yc : cases) {
    for (const char* field : {"rope_scaling", "rope_parameters"}) {  // transformers v4 and v5
      json doc = json::parse(kQwen3_30B_A3B);
      doc.erase("rope_scaling");
      doc[field] = yc.rope_scaling;
      Qwen3MoeConfig c;
      try {
        c = Qwen3MoeConfig::parse(doc, "config.json");
      } catch (const Error& e) {
        ADD_FAILURE() << yc.name << " in " << field << ": " << e.what();
        continue;
      }
      const Rope rope(c.head_dim, c.rope_theta, c.yarn, c.rope_mscale());
      EXPECT_NEAR(rope.magnitude(), yc.magnitude, 1e-15) << yc.name << " in " << field;
      ASSERT_EQ(rope.inv_freq().size(), 64u);
      EXPECT_EQ(rope.inv_freq()[0], 1.0) << yc.name;
      for (size_t i = 0; i < pairs.size(); ++i)
        EXPECT_NEAR(rope.inv_freq()[pairs[i]] / yc.inv_freq[i], 1.0, 1e-12)
            << yc.name << " in " << field << ", pair " << pairs[i];
      EXPECT_EQ(Qwen3MoeConfig::parse(c.to_json(), "written"), c) << yc.name;
    }
  }
}

// The PyTorch reference's answer to `request` for the model folder (see the script's header).
json qwen3_reference(const std::filesystem::path& model, const json& request) {
  auto req = test::temp_path("qwen3-request"), out = test::temp_path("qwen3-out");
  std::ofstream(req) << request.dump();
  const std::string cmd = "/usr/bin/python3 " +
                          test::quote(test::oracle_dir() / "qwen3_moe_reference.py") + " " +
                          test::quote(model) + " " + test::quote(req) + " " + test::quote(out);
  EXPECT_EQ(test::run_command(cmd), 0) << "reference failed: " << cmd;
  std::ifstream in(out);
  json doc = json::parse(in);
  std::filesystem::remove(req);
  std::filesystem::remove(out);
  return doc;
}

struct Case {
  std::string dtype;
  double tol;
  float min_margin;
  bool yarn = false;  // rope_scaling YaRN, with a short original context so the ramp matters
  bool tied = false;  // tie_word_embeddings: the checkpoint has no lm_head, the embedding is it
};

class Qwen3Numerics : public ::testing::TestWithParam<Case> {
 protected:
  static std::filesystem::path make(const Case& c) {
    auto dir =
        test::temp_path("qwen3-" + c.dtype + (c.yarn ? "-yarn" : "") + (c.tied ? "-tied" : ""))
            .replace_extension();
    const std::string cmd = std::string(TANDEM_BINARY) +
                            " make-model --preset tiny-qwen3-moe --dtype " + c.dtype +
                            " --seed 5 --out " + test::quote(dir) + " 2>&1";
    EXPECT_EQ(test::run_command(cmd), 0) << cmd;
    if (c.yarn) {
      json config = json::parse(test::read_bytes(dir / "config.json"));
      config["rope_scaling"] = {
          {"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 16}};
      test::write_bytes(dir / "config.json", config.dump(2));
    }
    if (c.tied) {
      json config = json::parse(test::read_bytes(dir / "config.json"));
      config["tie_word_embeddings"] = true;
      test::write_bytes(dir / "config.json", config.dump(2));
      json index = json::parse(test::read_bytes(dir / "model.safetensors.index.json"));
      index["weight_map"].erase("lm_head.weight");
      test::write_bytes(dir / "model.safetensors.index.json", index.dump());
    }
    return dir;
  }

  static json reference(const std::filesystem::path& model, const json& request) {
    return qwen3_reference(model, request);
  }
};

TEST_P(Qwen3Numerics, LogitsOfEveryFeedMatchThePyTorchReference) {
  const Case c = GetParam();
  const auto dir = make(c);
  const auto model = Qwen3MoeModel::load(dir);
  const int64_t vocab = model.config().vocab_size;
  std::mt19937 rng(3);
  std::uniform_int_distribution<int32_t> id(0, 151000);
  std::vector<std::vector<int32_t>> seqs;
  for (int len : {1, 5, 18, 37}) {
    seqs.emplace_back(len);
    for (auto& t : seqs.back()) t = id(rng);
  }
  const json ref =
      reference(dir, {{"sequences", seqs}, {"all_logits", true}, {"greedy_tokens", 0}});
  ASSERT_EQ(ref["sequences"].size(), seqs.size());
  size_t compared = 0, positions = 0;
  for (size_t chunk : {size_t(1000), size_t(6), size_t(1)}) {  // whole, chunks, token by token
    const int64_t block = 4;
    LatentCache cache(model.cache_shape(block), 64);
    const auto tables = test::block_tables(seqs, block);
    std::vector<std::vector<float>> rows(seqs.size()), margins(seqs.size());
    std::vector<size_t> done(seqs.size(), 0);
    for (;;) {
      std::vector<SequenceStep> batch;
      std::vector<size_t> who;
      for (size_t s = 0; s < seqs.size(); ++s) {
        if (done[s] == seqs[s].size()) continue;
        const size_t n = std::min(chunk, seqs[s].size() - done[s]);
        batch.push_back({std::span(seqs[s]).subspan(done[s], n), static_cast<int64_t>(done[s]),
                         tables[s], LogitRows::kAll});
        who.push_back(s);
      }
      if (batch.empty()) break;
      const auto out = model.forward(batch, cache);
      size_t before = 0;
      for (size_t b = 0; b < batch.size(); ++b) {
        const size_t s = who[b], n = batch[b].tokens.size();
        const float* first = out.logits.data() + out.first_row[b] * vocab;
        rows[s].insert(rows[s].end(), first, first + n * vocab);
        margins[s].insert(margins[s].end(), out.routing_margin.begin() + before,
                          out.routing_margin.begin() + before + n);
        before += n;
        done[s] += n;
      }
    }
    for (size_t s = 0; s < seqs.size(); ++s) {
      const auto expected = ref["sequences"][s]["logits"].get<std::vector<std::vector<float>>>();
      ASSERT_EQ(expected.size(), seqs[s].size());
      size_t stable = 0;  // positions before the first routing near-tie
      while (stable < seqs[s].size() && margins[s][stable] >= c.min_margin) ++stable;
      const double dev = test::logit_deviation(expected, rows[s].data(), vocab, stable);
      EXPECT_LE(dev, c.tol) << "sequence " << s << ", chunks of " << chunk;
      compared += stable;
      positions += seqs[s].size();
      if (chunk == 1000)
        std::printf(
            "[ qwen3/%s ] %zu tokens: %zu positions compared, max relative deviation %.2e\n",
            c.dtype.c_str(), seqs[s].size(), stable, dev);
    }
  }
  EXPECT_GE(compared, positions * 6 / 10) << "too many routing near-ties to compare";
  std::filesystem::remove_all(dir);
}

TEST_P(Qwen3Numerics, GreedyContinuationsMatchFullRecomputation) {
  const Case c = GetParam();
  const auto dir = make(c);
  const auto model = Qwen3MoeModel::load(dir);
  const auto tok = text::Tokenizer::from_dir(dir);
  const std::vector<std::vector<int32_t>> prompts = {tok.encode("The quick brown fox", false),
                                                     tok.encode("你好，世界！Hello", false)};
  constexpr int kTokens = 24;
  const json ref =
      reference(dir, {{"sequences", prompts}, {"all_logits", false}, {"greedy_tokens", kTokens}});
  const int64_t vocab = model.config().vocab_size, block = 8;
  for (size_t s = 0; s < prompts.size(); ++s) {
    LatentCache cache(model.cache_shape(block), 16);
    std::vector<int32_t> table(16);
    std::iota(table.begin(), table.end(), 0);
    std::vector<int32_t> tokens = prompts[s], generated;
    int64_t start = 0;
    while (static_cast<int>(generated.size()) < kTokens) {
      const std::span<const int32_t> fresh = std::span(tokens).subspan(size_t(start));
      const SequenceStep step{fresh, start, table, LogitRows::kLast};
      const auto out = model.forward(std::span(&step, 1), cache);
      start = static_cast<int64_t>(tokens.size());
      const auto next = static_cast<int32_t>(
          std::max_element(out.logits.data(), out.logits.data() + vocab) - out.logits.data());
      generated.push_back(next);
      tokens.push_back(next);
    }
    const auto expected = ref["sequences"][s]["greedy"].get<std::vector<int32_t>>();
    const auto margins = ref["sequences"][s]["greedy_margins"].get<std::vector<double>>();
    ASSERT_EQ(expected.size(), generated.size());
    size_t same = 0;
    while (same < expected.size() && generated[same] == expected[same]) ++same;
    if (same < expected.size()) {
      EXPECT_LE(margins[same], 2 * c.tol)
          << "prompt " << s << ": token " << same << " is " << generated[same]
          << ", the reference chose " << expected[same] << " with a clear margin " << margins[same];
    }
    std::printf("[ qwen3/%s ] prompt %zu: %zu of %zu greedy tokens equal\n", c.dtype.c_str(), s,
                same, expected.size());
  }
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Checkpoints, Qwen3Numerics,
                         ::testing::Values(Case{"f32", 1e-4, 1e-5f}, Case{"bf16", 1e-2, 0.02f},
                                           Case{"f32", 1e-4, 1e-5f, true},
                                           Case{"f32", 1e-4, 1e-5f, false, true}),
                         [](const auto& info) {
                           return info.param.dtype + (info.param.yarn ? "_yarn" : "") +
                                  (info.param.tied ? "_tied" : "");
                         });

// The whole model under YaRN's rules beyond factor and the original context (transformers'
// _compute_yarn_parameters; Qwen3MoeConfig.YarnIsTransformersYarn checks the frequencies and the
// magnitude alone): attention_factor, mscale over mscale_all_dim, betas with truncate false, and
// no original_max_position_embeddings (max_position_embeddings is the original context). Each
// checkpoint's original context is 16 positions and the sequences run to position 43, so every
// sequence's last logits read keys rotated past it; fed whole (GEMM attention) and token by token
// through the cache, in float32, against the PyTorch reference's last logits.
TEST(Qwen3MoeModel, YarnVariantsMatchThePyTorchReferencePastTheOriginalContext) {
  test::TempDir dir("qwen3-yarn-variants");
  ASSERT_EQ(test::run_command(std::string(TANDEM_BINARY) +
                              " make-model --preset tiny-qwen3-moe --dtype f32 --seed 5 --out " +
                              test::quote(dir.path()) + " 2>/dev/null"),
            0);
  const json made = json::parse(test::read_bytes(dir / "config.json"));
  struct Variant {
    const char* name;
    json rope_scaling;
    int64_t max_position_embeddings = 0;  // 0: make-model's
  };
  const std::vector<Variant> variants = {
      {"attention_factor",
       {{"rope_type", "yarn"},
        {"factor", 4.0},
        {"original_max_position_embeddings", 16},
        {"attention_factor", 1.5}}},
      {"mscale over mscale_all_dim",
       {{"type", "yarn"},
        {"factor", 8.0},
        {"original_max_position_embeddings", 16},
        {"mscale", 0.8},
        {"mscale_all_dim", 0.5}}},
      // head_dim 16 and rope_theta 1e6 put this correction range at pairs 2.28 to 3.21 (2 to 4
      // truncated): the ramp's ends are fractional.
      {"betas, untruncated",
       {{"rope_type", "yarn"},
        {"factor", 4.0},
        {"original_max_position_embeddings", 16},
        {"beta_fast", 0.05},
        {"beta_slow", 0.01},
        {"truncate", false}}},
      {"no original context", {{"rope_type", "yarn"}, {"factor", 4.0}}, 16},
  };
  std::mt19937 rng(11);
  std::uniform_int_distribution<int32_t> id(0, 151000);
  std::vector<std::vector<int32_t>> seqs;
  for (int len : {17, 30, 44}) {
    seqs.emplace_back(len);
    for (auto& t : seqs.back()) t = id(rng);
  }
  constexpr double kTolerance = 1e-4;  // float32, as Qwen3Numerics
  constexpr float kMinMargin = 1e-5f;  // a routing near-tie may flip an expert legitimately
  size_t compared = 0;
  for (const Variant& v : variants) {
    json config = made;
    config["rope_scaling"] = v.rope_scaling;
    if (v.max_position_embeddings > 0)
      config["max_position_embeddings"] = v.max_position_embeddings;
    test::write_bytes(dir / "config.json", config.dump(2));
    const auto model = Qwen3MoeModel::load(dir.path());
    ASSERT_TRUE(model.config().yarn) << v.name;
    const int64_t vocab = model.config().vocab_size;
    const json ref = qwen3_reference(
        dir.path(), {{"sequences", seqs}, {"all_logits", false}, {"greedy_tokens", 0}});
    ASSERT_EQ(ref["sequences"].size(), seqs.size()) << v.name;
    for (size_t s = 0; s < seqs.size(); ++s) {
      const auto expected = ref["sequences"][s]["logits"].get<std::vector<std::vector<float>>>();
      ASSERT_EQ(expected.size(), 1u);
      for (size_t chunk : {seqs[s].size(), size_t(1)}) {
        LatentCache cache(model.cache_shape(4), 16);
        std::vector<int32_t> table(16);
        std::iota(table.begin(), table.end(), 0);
        std::vector<float> last;
        float margin = std::numeric_limits<float>::infinity();
        for (size_t done = 0; done < seqs[s].size(); done += chunk) {
          const SequenceStep step{std::span(seqs[s]).subspan(done, chunk),
                                  static_cast<int64_t>(done), table, LogitRows::kLast};
          const auto out = model.forward(std::span(&step, 1), cache);
          for (float m : out.routing_margin) margin = std::min(margin, m);
          last.assign(out.logits.data(), out.logits.data() + vocab);
        }
        if (margin < kMinMargin) continue;
        EXPECT_LE(test::logit_deviation(expected, last.data(), vocab, 1), kTolerance)
            << v.name << ", sequence of " << seqs[s].size() << " fed in chunks of " << chunk;
        ++compared;
      }
    }
  }
  EXPECT_GE(compared, variants.size() * seqs.size()) << "too many routing near-ties to compare";
}

TEST(Qwen3MoeModel, ACheckpointMissingATensorIsRefusedNamingIt) {
  test::TempDir dir("qwen3-extra");
  const std::string cmd = std::string(TANDEM_BINARY) +
                          " make-model --preset tiny-qwen3-moe --dtype f32 --out " +
                          test::quote(dir.path()) + " 2>&1";
  ASSERT_EQ(test::run_command(cmd), 0);
  // Removing a tensor from the index: the loader names what is missing.
  json index = json::parse(test::read_bytes(dir / "model.safetensors.index.json"));
  index["weight_map"].erase("model.layers.1.self_attn.k_norm.weight");
  test::write_bytes(dir / "model.safetensors.index.json", index.dump());
  try {
    Qwen3MoeModel::load(dir.path());
    ADD_FAILURE() << "loaded without k_norm";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.1.self_attn.k_norm.weight"),
              std::string::npos)
        << e.what();
  }
}

// The binder checks shapes only: an I8 norm of the right shape was widened as if it were a float.
TEST(Qwen3MoeModel, AQuantizedTensorIsRefusedNamingIt) {
  test::TempDir made("qwen3-src"), dir("qwen3-i8");
  const std::string cmd = std::string(TANDEM_BINARY) +
                          " make-model --preset tiny-qwen3-moe --dtype f32 --out " +
                          test::quote(made.path()) + " 2>&1";
  ASSERT_EQ(test::run_command(cmd), 0);
  const Checkpoint source = Checkpoint::open(made.path());
  const std::string target = "model.layers.1.self_attn.k_norm.weight";
  std::vector<TensorSpec> specs;
  for (const auto& [name, info] : source.tensors())
    specs.push_back({name, name == target ? DType::kI8 : info.dtype, info.shape});
  write_checkpoint(
      dir.path(), specs,
      [&](const TensorSpec& s, std::span<std::byte> out) {
        std::memcpy(out.data(), source.find(s.name)->data, out.size());
      },
      size_t{1} << 30);
  std::filesystem::copy_file(made / "config.json", dir / "config.json");
  try {
    Qwen3MoeModel::load(dir.path());
    ADD_FAILURE() << "loaded an I8 k_norm";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::AllOf(::testing::HasSubstr("'" + target + "'"),
                                           ::testing::HasSubstr("is I8"),
                                           ::testing::HasSubstr("expected F32, BF16 or F16")));
  }
}

// Checkpoints exported by transformers while RoPE's inv_freq was a persistent buffer hold
// model.layers.N.self_attn.rotary_emb.inv_freq. vLLM's Qwen3-MoE loader (AutoWeightsLoader) skips
// every name with "rotary_emb.inv_freq", and so does this one: the model is the one without them.
// They were refused as not part of the model. Only those names: a rotary_emb.cos_cached is still
// refused.
TEST(Qwen3MoeModel, InvFreqTensorsOfOldExportsAreSkippedAsVllmDoes) {
  test::TempDir plain("qwen3-rope-plain"), old("qwen3-rope-inv-freq"), cached("qwen3-rope-cos");
  ASSERT_EQ(test::run_command(std::string(TANDEM_BINARY) +
                              " make-model --preset tiny-qwen3-moe --dtype bf16 --out " +
                              test::quote(plain.path()) + " 2>/dev/null"),
            0);
  const Qwen3MoeConfig c = Qwen3MoeConfig::load(plain.path());
  std::vector<TensorSpec> inv_freq;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    inv_freq.push_back({"model.layers." + std::to_string(i) + ".self_attn.rotary_emb.inv_freq",
                        DType::kF32,
                        {c.head_dim / 2}});
  test::copy_with_tensors(plain.path(), old.path(), inv_freq);

  auto logits = [](const Qwen3MoeModel& model) {
    const std::vector<int32_t> prompt = {11, 700, 151000, 42, 9, 3};
    LatentCache cache(model.cache_shape(4), 4);
    const std::vector<int32_t> table = {0, 1};
    SequenceStep step{prompt, 0, table, LogitRows::kAll};
    const auto out = model.forward(std::span(&step, 1), cache).logits;
    return std::vector<float>(out.begin(), out.end());
  };
  size_t done = 0, total = 0;
  const auto with_buffers =
      Qwen3MoeModel::load(old.path(), [&](size_t d, size_t t) { done = d, total = t; });
  EXPECT_EQ(done, total);
  EXPECT_EQ(total, Checkpoint::open(plain.path()).tensors().size());
  EXPECT_EQ(logits(with_buffers), logits(Qwen3MoeModel::load(plain.path())));

  const std::string cos = "model.layers.0.self_attn.rotary_emb.cos_cached";
  test::copy_with_tensors(plain.path(), cached.path(), {{cos, DType::kF32, {4, 16}}});
  try {
    Qwen3MoeModel::load(cached.path());
    ADD_FAILURE() << "loaded with " << cos;
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("'" + cos + "' is not part of"));
  }
  // A name from the file is quoted escaped: a line break in it no longer splits the message.
  test::TempDir odd("qwen3-odd-name");
  test::copy_with_tensors(plain.path(), odd.path(), {{"x\ny", DType::kF32, {1}}});
  try {
    Qwen3MoeModel::load(odd.path());
    ADD_FAILURE() << "loaded with an extra tensor";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("tensor 'x\\x0ay' is not part of"));
  }
}

// make-model's Qwen3 presets: the same seed gives the same bytes, the layout is the one the
// loader checks (it loads), and quantized weight types are refused by name.
TEST(Qwen3MoeModel, MakeModelIsDeterministicAndRefusesQuantizedWeights) {
  test::TempDir a("qwen3-a"), b("qwen3-b"), c("qwen3-c");
  auto make = [](const std::filesystem::path& out, const std::string& extra) {
    return test::run_command(std::string(TANDEM_BINARY) + " make-model --preset tiny-qwen3-moe " +
                             extra + " --out " + test::quote(out) + " 2>/dev/null");
  };
  ASSERT_EQ(make(a.path(), "--seed 9"), 0);
  ASSERT_EQ(make(b.path(), "--seed 9"), 0);
  for (const auto& f : std::filesystem::directory_iterator(a.path()))
    EXPECT_EQ(test::read_bytes(f.path()), test::read_bytes(b / f.path().filename().string()))
        << f.path().filename();
  EXPECT_NO_THROW(Qwen3MoeModel::load(a.path()));
  EXPECT_NE(make(c.path(), "--dtype fp8"), 0);
  EXPECT_NE(make(c.path(), "--dtype int8"), 0);
}

// tie_word_embeddings with an lm_head.weight in the file as well (Qwen1.5-0.5B-Chat's first
// release had both): as transformers (tie_weights) and vLLM (skip_prefixes lm_head.), the head is
// the embedding and the file's lm_head is ignored. It was refused as not part of the model.
TEST(Qwen3MoeModel, AnLmHeadInATiedCheckpointIsIgnoredAndTheEmbeddingIsTheHead) {
  test::TempDir untied("qwen3-untied"), both("qwen3-tied-with-head"), plain("qwen3-tied");
  ASSERT_EQ(test::run_command(std::string(TANDEM_BINARY) +
                              " make-model --preset tiny-qwen3-moe --dtype bf16 --out " +
                              test::quote(untied.path()) + " 2>/dev/null"),
            0);
  for (const auto* dir : {&both, &plain}) {
    std::filesystem::copy(untied.path(), dir->path(), std::filesystem::copy_options::recursive);
    json config = json::parse(test::read_bytes(*dir / "config.json"));
    config["tie_word_embeddings"] = true;
    test::write_bytes(*dir / "config.json", config.dump(2));
  }
  json index = json::parse(test::read_bytes(plain / "model.safetensors.index.json"));
  ASSERT_EQ(index["weight_map"].erase("lm_head.weight"), 1u);
  test::write_bytes(plain / "model.safetensors.index.json", index.dump());

  auto logits = [](const Qwen3MoeModel& model) {
    const std::vector<int32_t> prompt = {11, 700, 151000, 42, 9};
    LatentCache cache(model.cache_shape(4), 4);
    const std::vector<int32_t> table = {0, 1};
    SequenceStep step{prompt, 0, table, LogitRows::kAll};
    const auto out = model.forward(std::span(&step, 1), cache).logits;
    return std::vector<float>(out.begin(), out.end());
  };
  const std::vector<float> with_head = logits(Qwen3MoeModel::load(both.path()));
  EXPECT_EQ(with_head, logits(Qwen3MoeModel::load(plain.path())));
  EXPECT_NE(with_head, logits(Qwen3MoeModel::load(untied.path())));  // the file's head differs
}

}  // namespace
}  // namespace tandem::model
