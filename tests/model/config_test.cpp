// config.json parsing: the published DeepSeek-V3/R1, V2.5 and V2-Lite configs (as their
// Hugging Face repositories ship them, and V2-Lite as transformers v5 re-saves it), the
// W8A8 INT8 variant, round trips, and errors that name the field.
#include "model/config.h"

#include <cmath>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "model/model_test_support.h"
#include "util/error.h"
#include "util/fifo.h"
#include "util/file.h"

namespace tandem::model {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using json = nlohmann::json;

// deepseek-ai/DeepSeek-V3 config.json.
const char* kV3 = R"({
  "architectures": ["DeepseekV3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "auto_map": {
    "AutoConfig": "configuration_deepseek.DeepseekV3Config",
    "AutoModel": "modeling_deepseek.DeepseekV3Model",
    "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"
  },
  "aux_loss_alpha": 0.001,
  "bos_token_id": 0,
  "eos_token_id": 1,
  "ep_size": 1,
  "first_k_dense_replace": 3,
  "hidden_act": "silu",
  "hidden_size": 7168,
  "initializer_range": 0.02,
  "intermediate_size": 18432,
  "kv_lora_rank": 512,
  "max_position_embeddings": 163840,
  "model_type": "deepseek_v3",
  "moe_intermediate_size": 2048,
  "moe_layer_freq": 1,
  "n_group": 8,
  "n_routed_experts": 256,
  "n_shared_experts": 1,
  "norm_topk_prob": true,
  "num_attention_heads": 128,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 61,
  "num_key_value_heads": 128,
  "num_nextn_predict_layers": 1,
  "pretraining_tp": 1,
  "q_lora_rank": 1536,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "quantization_config": {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128]
  },
  "rms_norm_eps": 1e-06,
  "rope_scaling": {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn"
  },
  "rope_theta": 10000,
  "routed_scaling_factor": 2.5,
  "scoring_func": "sigmoid",
  "seq_aux": true,
  "tie_word_embeddings": false,
  "topk_group": 4,
  "topk_method": "noaux_tc",
  "torch_dtype": "bfloat16",
  "transformers_version": "4.33.1",
  "use_cache": true,
  "v_head_dim": 128,
  "vocab_size": 129280
})";

// deepseek-ai/DeepSeek-V2-Lite config.json.
const char* kV2Lite = R"({
  "architectures": ["DeepseekV2ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "auto_map": {
    "AutoConfig": "configuration_deepseek.DeepseekV2Config",
    "AutoModel": "modeling_deepseek.DeepseekV2Model",
    "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM"
  },
  "aux_loss_alpha": 0.001,
  "bos_token_id": 100000,
  "eos_token_id": 100001,
  "first_k_dense_replace": 1,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 10944,
  "kv_lora_rank": 512,
  "max_position_embeddings": 163840,
  "model_type": "deepseek_v2",
  "moe_intermediate_size": 1408,
  "moe_layer_freq": 1,
  "n_group": 1,
  "n_routed_experts": 64,
  "n_shared_experts": 2,
  "norm_topk_prob": false,
  "num_attention_heads": 16,
  "num_experts_per_tok": 6,
  "num_hidden_layers": 27,
  "num_key_value_heads": 16,
  "pretraining_tp": 1,
  "q_lora_rank": null,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "rms_norm_eps": 1e-06,
  "rope_scaling": {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "original_max_position_embeddings": 4096,
    "type": "yarn"
  },
  "rope_theta": 10000,
  "routed_scaling_factor": 1.0,
  "scoring_func": "softmax",
  "seq_aux": true,
  "tie_word_embeddings": false,
  "topk_group": 1,
  "topk_method": "greedy",
  "torch_dtype": "bfloat16",
  "transformers_version": "4.33.1",
  "use_cache": true,
  "v_head_dim": 128,
  "vocab_size": 102400
})";

// DeepSeek-V2-Lite as transformers v5 saves it: rope_parameters, dtype, head_dim, mlp_bias.
const char* kV2LiteV5 = R"({
  "architectures": ["DeepseekV2ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "aux_loss_alpha": 0.001,
  "bos_token_id": 100000,
  "dtype": "bfloat16",
  "eos_token_id": 100001,
  "first_k_dense_replace": 1,
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 10944,
  "kv_lora_rank": 512,
  "max_position_embeddings": 163840,
  "mlp_bias": false,
  "model_type": "deepseek_v2",
  "moe_intermediate_size": 1408,
  "moe_layer_freq": 1,
  "n_group": 1,
  "n_routed_experts": 64,
  "n_shared_experts": 2,
  "norm_topk_prob": false,
  "num_attention_heads": 16,
  "num_experts_per_tok": 6,
  "num_hidden_layers": 27,
  "num_key_value_heads": 16,
  "pad_token_id": null,
  "pretraining_tp": 1,
  "q_lora_rank": null,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "rms_norm_eps": 1e-06,
  "rope_parameters": {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "original_max_position_embeddings": 4096,
    "rope_theta": 10000,
    "rope_type": "yarn",
    "type": "yarn"
  },
  "routed_scaling_factor": 1.0,
  "scoring_func": "softmax",
  "seq_aux": true,
  "tie_word_embeddings": false,
  "topk_group": 1,
  "topk_method": "greedy",
  "transformers_version": "5.7.0",
  "use_cache": true,
  "v_head_dim": 128,
  "vocab_size": 102400
})";

ModelConfig parse(const json& doc) {
  return ModelConfig::parse(doc, "test/config.json");
}

std::string parse_error(const json& doc) {
  try {
    parse(doc);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Config, DeepSeekV3) {
  const ModelConfig c = parse(json::parse(kV3));
  EXPECT_EQ(c.architecture, "DeepseekV3ForCausalLM");
  EXPECT_EQ(c.vocab_size, 129280);
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.qk_head_dim(), 192);
  EXPECT_EQ(c.n_routed_experts, 256);
  EXPECT_EQ(c.n_group, 8);
  EXPECT_EQ(c.topk_group, 4);
  EXPECT_EQ(c.scoring_func, "sigmoid");
  EXPECT_TRUE(c.uses_correction_bias());
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_EQ(c.num_nextn_predict_layers, 1);
  EXPECT_FALSE(c.is_moe_layer(2));
  EXPECT_TRUE(c.is_moe_layer(3));
  EXPECT_TRUE(c.is_moe_layer(61));  // the MTP layer
  ASSERT_TRUE(c.yarn);
  EXPECT_DOUBLE_EQ(c.yarn->factor, 40.0);
  EXPECT_EQ(c.yarn->original_max_position_embeddings, 4096);
  ASSERT_TRUE(c.fp8);
  EXPECT_EQ(c.fp8->block_rows, 128);
  EXPECT_FALSE(c.int8);
  EXPECT_EQ(c.bos_token_id, 0);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{1});
  // sigma = 192^-1/2 * mscale^2, mscale = 0.1 * ln 40 + 1 (the reference notes: x1.874).
  const double m = 0.1 * std::log(40.0) + 1.0;
  EXPECT_DOUBLE_EQ(c.softmax_scale(), m * m / std::sqrt(192.0));
  EXPECT_NEAR(m * m, 1.874, 1e-3);
}

TEST(Config, DeepSeekV2Lite) {
  const ModelConfig c = parse(json::parse(kV2Lite));
  EXPECT_EQ(c.architecture, "DeepseekV2ForCausalLM");
  EXPECT_EQ(c.q_lora_rank, 0);
  EXPECT_EQ(c.n_shared_experts, 2);
  EXPECT_EQ(c.topk_method, "greedy");
  EXPECT_FALSE(c.uses_correction_bias());
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.num_nextn_predict_layers, 0);
  EXPECT_FALSE(c.quantized());
  EXPECT_FALSE(c.is_moe_layer(0));
  EXPECT_TRUE(c.is_moe_layer(1));
  const double m = 0.1 * 0.707 * std::log(40.0) + 1.0;
  EXPECT_NEAR(m * m, 1.590, 1e-3);
  EXPECT_DOUBLE_EQ(c.softmax_scale(), m * m / std::sqrt(192.0));
  // transformers v5's spelling of the same model parses to the same config.
  EXPECT_EQ(parse(json::parse(kV2LiteV5)), c);
}

TEST(Config, DeepSeekV25GroupLimitedGreedy) {
  json doc = json::parse(kV2Lite);
  doc["hidden_size"] = 5120;
  doc["num_hidden_layers"] = 60;
  doc["num_attention_heads"] = 128;
  doc["num_key_value_heads"] = 128;
  doc["q_lora_rank"] = 1536;
  doc["n_routed_experts"] = 160;
  doc["n_group"] = 8;
  doc["topk_group"] = 3;
  doc["topk_method"] = "group_limited_greedy";
  doc["routed_scaling_factor"] = 16.0;
  const ModelConfig c = parse(doc);
  EXPECT_EQ(c.topk_method, "group_limited_greedy");
  EXPECT_EQ(c.n_group, 8);
  EXPECT_EQ(c.q_lora_rank, 1536);
}

// meituan/DeepSeek-R1-Channel-INT8 as SGLang loads it ("w8a8_int8").
TEST(Config, W8A8Int8) {
  json doc = json::parse(kV3);
  doc["quantization_config"] = {{"quant_method", "w8a8_int8"}, {"activation_scheme", "dynamic"}};
  ModelConfig c = parse(doc);
  EXPECT_TRUE(c.int8);
  EXPECT_FALSE(c.fp8);
  doc["quantization_config"] = {{"quant_method", "w8a8_int8"},
                                {"is_dynamic", true},
                                {"ignore", {"lm_head"}},
                                {"packed_modules_mapping", json::object()}};
  EXPECT_TRUE(parse(doc).int8);
}

TEST(Config, RoundTripsThroughToJson) {
  for (const char* text : {kV3, kV2Lite}) {
    const ModelConfig c = parse(json::parse(text));
    const auto out = c.to_json();
    EXPECT_EQ(ModelConfig::parse(out, "round trip"), c);
    // Keys come out sorted, as transformers writes config.json.
    std::vector<std::string> keys;
    for (const auto& [k, v] : out.items()) keys.push_back(k);
    EXPECT_TRUE(std::is_sorted(keys.begin(), keys.end()));
  }
  json doc = json::parse(kV3);
  doc["quantization_config"] = {{"quant_method", "w8a8_int8"}};
  doc["tie_word_embeddings"] = true;
  doc.erase("rope_scaling");
  const ModelConfig c = parse(doc);
  EXPECT_EQ(ModelConfig::parse(c.to_json(), "round trip"), c);
  EXPECT_TRUE(c.to_json()["rope_scaling"].is_null());
}

// transformers' PretrainedConfig takes eos_token_id as an integer or a list of them
// (Union[int, List[int]]; Llama 3.1 and GLM-4 publish lists), as Tandem's generation-config
// reader does: every id is kept, each below vocab_size, and a list survives the round trip.
TEST(Config, EosTokenIdIsAnIdOrAListOfIds) {
  json doc = json::parse(kV3);
  doc["eos_token_id"] = {1, 2};
  const ModelConfig c = parse(doc);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(c.to_json()["eos_token_id"], json({1, 2}));
  EXPECT_EQ(ModelConfig::parse(c.to_json(), "round trip"), c);
  doc["eos_token_id"] = json::array();
  EXPECT_TRUE(parse(doc).eos_token_ids.empty());
  EXPECT_FALSE(parse(doc).to_json().contains("eos_token_id"));

  doc["eos_token_id"] = {1, 129280};
  EXPECT_EQ(parse_error(doc),
            "test/config.json: field 'eos_token_id[1]' must be a token id below vocab_size "
            "129280, got 129280");
  doc["eos_token_id"] = {1, "2"};
  EXPECT_EQ(parse_error(doc),
            "test/config.json: field 'eos_token_id[1]' must be an integer, "
            "got \"2\"");
  doc["eos_token_id"] = "1";
  EXPECT_EQ(parse_error(doc),
            "test/config.json: field 'eos_token_id' must be an integer or a "
            "list of integers, got \"1\"");
}

TEST(Config, LoadNamesTheFile) {
  test::TempDir dir("config");
  test::write_bytes(dir / "config.json", kV2Lite);
  EXPECT_EQ(ModelConfig::load(dir.path()).hidden_size, 2048);
  test::write_bytes(dir / "config.json", "{\"architectures\": [");
  try {
    ModelConfig::load(dir.path());
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("config.json"), HasSubstr("malformed")));
  }
  EXPECT_THROW(ModelConfig::load(dir / "absent"), Error);
  // A FIFO blocked the load until some writer came.
  std::filesystem::remove(dir / "config.json");
  const test::Fifo fifo(dir / "config.json");
  try {
    ModelConfig::load(dir.path());
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              (dir / "config.json").string() + ": not a regular file (it is a FIFO)");
  }
}

// config.json was read whole whatever its size (a wrong multi-gigabyte file copied in was read
// until memory ran out); past the limit it is refused naming it, before anything is read.
TEST(Config, AConfigOfAbsurdSizeIsRefusedUnread) {
  test::TempDir dir("config-huge");
  test::write_bytes(dir / "config.json", "");
  std::filesystem::resize_file(dir / "config.json", kMaxModelConfigBytes + 1);  // sparse
  try {
    ModelConfig::load(dir.path());
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              (dir / "config.json").string() + ": is " + std::to_string(kMaxModelConfigBytes + 1) +
                  " bytes, above the limit of " + std::to_string(kMaxModelConfigBytes));
  }
}

// Messages quote a field's value. nlohmann's dump() recurses, so a value nested 100,000 deep (a
// 200 KB config.json) crashed the loader with SIGSEGV; the file is now read with a depth limit and
// quoted values are cut short, however deep or long.
TEST(Config, DeepOrHugeValuesAreRefusedWithShortMessages) {
  test::TempDir dir("config-deep");
  json doc = json::parse(kV3);
  doc["vocab_size"] = 0;
  std::string text = doc.dump();
  const std::string field = "\"vocab_size\":0";
  ASSERT_NE(text.find(field), std::string::npos);
  text.replace(text.find(field), field.size(),
               "\"vocab_size\":" + std::string(100000, '[') + std::string(100000, ']'));
  test::write_bytes(dir / "config.json", text);
  try {
    ModelConfig::load(dir.path());
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("config.json"), HasSubstr("nesting")));
  }

  // The same values given to parse() as documents: only the field and the first bytes appear.
  json deep = json::array();
  json* at = &deep;
  for (int i = 0; i < 100000; ++i) at = &at->emplace_back(json::array());
  json wide = json::array();
  for (int i = 0; i < 1000000; ++i) wide.push_back(i);
  for (json* value : {&deep, &wide}) {
    doc = json::parse(kV3);
    doc["vocab_size"] = std::move(*value);
    const std::string msg = parse_error(doc);
    EXPECT_THAT(
        msg, AllOf(HasSubstr("'vocab_size'"), HasSubstr("must be an integer"), HasSubstr("...")));
    EXPECT_LT(msg.size(), 300u) << msg.substr(0, 300);
  }
}

struct BadCase {
  const char* what;
  std::function<void(json&)> edit;
  std::vector<std::string> expect;  // substrings of the message
};

TEST(Config, ErrorsNameTheField) {
  const std::vector<BadCase> cases = {
      {"unknown field",
       [](json& d) { d["sliding_window"] = 4096; },
       {"'sliding_window'", "not a known"}},
      {"missing field",
       [](json& d) { d.erase("hidden_size"); },
       {"field 'hidden_size' is required (an integer)"}},
      {"rope_scaling not an object",
       [](json& d) { d["rope_scaling"] = "yarn"; },
       {"field 'rope_scaling' must be an object, got \"yarn\""}},
      {"quantization_config not an object",
       [](json& d) { d["quantization_config"] = 8; },
       {"field 'quantization_config' must be an object, got 8"}},
      {"wrong type", [](json& d) { d["hidden_size"] = "7168"; }, {"'hidden_size'", "integer"}},
      {"float for int", [](json& d) { d["num_hidden_layers"] = 61.5; }, {"'num_hidden_layers'"}},
      {"zero",
       [](json& d) { d["num_attention_heads"] = 0; },
       {"'num_attention_heads'", "positive"}},
      {"odd rope dim", [](json& d) { d["qk_rope_head_dim"] = 63; }, {"'qk_rope_head_dim'", "even"}},
      {"topk_group > n_group", [](json& d) { d["topk_group"] = 9; }, {"'topk_group'", "n_group"}},
      {"too many experts per token",
       [](json& d) { d["num_experts_per_tok"] = 300; },
       {"'num_experts_per_tok'", "256"}},
      {"experts beyond kept groups",
       [](json& d) {
         d["topk_group"] = 1;
         d["num_experts_per_tok"] = 40;
       },
       {"'num_experts_per_tok'", "32 experts"}},
      {"groups not dividing experts",
       [](json& d) {
         d["n_group"] = 7;
         d["topk_group"] = 4;
       },
       {"'n_group'", "divide"}},
      {"noaux_tc with single-expert groups",
       [](json& d) {
         d["n_group"] = 256;
         d["topk_group"] = 8;
       },
       {"'n_group'", "top-2"}},
      {"greedy with groups",
       [](json& d) { d["topk_method"] = "greedy"; },
       {"'topk_method'", "n_group"}},
      {"unknown scoring",
       [](json& d) { d["scoring_func"] = "relu"; },
       {"'scoring_func'", "relu", "sigmoid"}},
      {"unknown topk method",
       [](json& d) { d["topk_method"] = "gready"; },
       {"'topk_method'", "gready"}},
      {"missing routing field",
       [](json& d) { d.erase("scoring_func"); },
       {"'scoring_func'", "required"}},
      {"missing q_lora_rank", [](json& d) { d.erase("q_lora_rank"); }, {"'q_lora_rank'", "null"}},
      {"q_lora_rank 0", [](json& d) { d["q_lora_rank"] = 0; }, {"'q_lora_rank'", "null"}},
      {"activation", [](json& d) { d["hidden_act"] = "gelu"; }, {"'hidden_act'", "silu"}},
      {"attention bias",
       [](json& d) { d["attention_bias"] = true; },
       {"'attention_bias'", "false"}},
      {"kv heads", [](json& d) { d["num_key_value_heads"] = 8; }, {"'num_key_value_heads'", "128"}},
      {"model_type",
       [](json& d) { d["model_type"] = "deepseek_v2"; },
       {"'model_type'", "DeepseekV3"}},
      {"architecture",
       [](json& d) { d["architectures"] = {"LlamaForCausalLM"}; },
       {"'architectures'", "LlamaForCausalLM", "DeepseekV3ForCausalLM"}},
      {"two architectures",
       [](json& d) { d["architectures"].push_back("X"); },
       {"'architectures'"}},
      {"rope type",
       [](json& d) { d["rope_scaling"]["type"] = "linear"; },
       {"'rope_scaling.type'", "yarn", "linear"}},
      {"rope field",
       [](json& d) { d["rope_scaling"]["low_freq_factor"] = 1; },
       {"'rope_scaling.low_freq_factor'"}},
      {"rope factor",
       [](json& d) { d["rope_scaling"]["factor"] = 0.5; },
       {"'rope_scaling.factor'"}},
      {"rope interleave", [](json& d) { d["rope_interleave"] = false; }, {"'rope_interleave'"}},
      {"quant method",
       [](json& d) { d["quantization_config"]["quant_method"] = "gptq"; },
       {"'quantization_config.quant_method'", "gptq", "w8a8_int8"}},
      {"fp8 per tensor",
       [](json& d) { d["quantization_config"].erase("weight_block_size"); },
       {"'quantization_config.weight_block_size'", "block"}},
      {"fp8 format",
       [](json& d) { d["quantization_config"]["fmt"] = "e5m2"; },
       {"'quantization_config.fmt'", "e5m2"}},
      {"static activations",
       [](json& d) { d["quantization_config"]["activation_scheme"] = "static"; },
       {"'quantization_config.activation_scheme'"}},
      {"quant field",
       [](json& d) { d["quantization_config"]["modules_to_not_convert"] = json::array(); },
       {"'quantization_config.modules_to_not_convert'"}},
      {"int8 ignore",
       [](json& d) {
         d["quantization_config"] = {{"quant_method", "w8a8_int8"}, {"ignore", {"mlp.gate"}}};
       },
       {"'quantization_config.ignore'", "lm_head"}},
      {"int8 static",
       [](json& d) {
         d["quantization_config"] = {{"quant_method", "w8a8_int8"}, {"is_dynamic", false}};
       },
       {"'quantization_config.is_dynamic'"}},
      {"eos beyond vocab",
       [](json& d) { d["eos_token_id"] = 129280; },
       {"'eos_token_id'", "129280"}},
      {"first_k_dense_replace",
       [](json& d) { d["first_k_dense_replace"] = 62; },
       {"'first_k_dense_replace'", "61"}},
      {"torch_dtype", [](json& d) { d["torch_dtype"] = "int4"; }, {"'torch_dtype'", "int4"}},
      {"experts without routing",
       [](json& d) { d["n_routed_experts"] = nullptr; },
       {"'num_experts_per_tok'", "n_routed_experts"}},
      {"negative layers",
       [](json& d) { d["num_nextn_predict_layers"] = -1; },
       {"'num_nextn_predict_layers'"}},
      // Sizes no model has would otherwise make validating a checkpoint list every tensor they
      // imply (1e12 layers: out of memory) before reading any.
      {"layers beyond the limit",
       [](json& d) { d["num_hidden_layers"] = int64_t{1'000'000'000'000}; },
       {"'num_hidden_layers'", "limit of 4096"}},
      {"experts beyond the limit",
       [](json& d) { d["n_routed_experts"] = 1'000'000'000; },
       {"'n_routed_experts'", "limit of 65536"}},
      {"MTP layers beyond the limit",
       [](json& d) { d["num_nextn_predict_layers"] = 1'000'000'000; },
       {"'num_nextn_predict_layers'", "limit"}},
      {"experts times layers beyond the limit",
       [](json& d) { d["n_routed_experts"] = 65536; },
       {"'n_routed_experts'", "59 MoE layers", "1048576"}},
      {"vocabulary beyond the limit",
       [](json& d) { d["vocab_size"] = int64_t{1} << 40; },
       {"'vocab_size'", "limit"}},
      // Read as int64_t, 2^64 - 1 was reported as "must be positive, got -1".
      {"vocabulary beyond 64-bit integers",
       [](json& d) { d["vocab_size"] = UINT64_MAX; },
       {"'vocab_size'", "is 18446744073709551615, above the limit of 9223372036854775807"}},
      {"token id beyond 64-bit integers",
       [](json& d) { d["bos_token_id"] = uint64_t{1} << 63; },
       {"'bos_token_id'", "is 9223372036854775808, above the limit"}},
      {"fp8 block beyond the limit",
       [](json& d) {
         d["quantization_config"]["weight_block_size"] = {int64_t{1} << 62, 128};
       },
       {"'quantization_config.weight_block_size'"}},
      {"negative rms_norm_eps",
       [](json& d) { d["rms_norm_eps"] = -1e-6; },
       {"'rms_norm_eps'", "positive"}},
      {"zero rope_theta", [](json& d) { d["rope_theta"] = 0; }, {"'rope_theta'", "positive"}},
      // Each of these was accepted and made every logit NaN: generate exited 0 with no tokens.
      // YaRN's correction range divides by ln(rope_theta).
      {"rope_theta 1 with YaRN",
       [](json& d) { d["rope_theta"] = 1.0; },
       {"'rope_theta'", "must exceed 1 with YaRN", "got 1.0"}},
      // The attention temperature, squared into the softmax scale: infinite.
      {"huge mscale_all_dim",
       [](json& d) { d["rope_scaling"]["mscale_all_dim"] = 1e200; },
       {"'rope_scaling.mscale_all_dim'", "between 0 and 10.0", "got 1e+200"}},
      // A temperature of zero divides the RoPE magnitude.
      {"negative mscale_all_dim",
       [](json& d) { d["rope_scaling"]["mscale_all_dim"] = -10 / std::log(40.0); },
       {"'rope_scaling.mscale_all_dim'", "between 0"}},
      {"negative mscale",
       [](json& d) { d["rope_scaling"]["mscale"] = -1.0; },
       {"'rope_scaling.mscale'", "between 0"}},
      // transformers would apply it, vLLM's deepseek_yarn ignores it: refused rather than guessed.
      {"attention_factor",
       [](json& d) { d["rope_scaling"]["attention_factor"] = 1.2; },
       {"'rope_scaling.attention_factor'", "not read by DeepSeek's YaRN"}},
      {"truncate",
       [](json& d) { d["rope_scaling"]["truncate"] = false; },
       {"'rope_scaling.truncate'", "which DeepSeek's YaRN does not read"}},
      // Betas this small make YaRN's correction range infinite, and its ramp 0 / 0.
      {"denormal YaRN betas",
       [](json& d) {
         d["rope_scaling"]["beta_fast"] = 2e-320;
         d["rope_scaling"]["beta_slow"] = 1e-320;
       },
       {"'rope_scaling'", "frequencies that are not finite"}},
      // Without YaRN any positive base is allowed, but the last frequency is 1 / base^(62/64).
      {"rope_theta so small its frequencies overflow",
       [](json& d) {
         d.erase("rope_scaling");
         d["rope_theta"] = 5e-324;
       },
       {"'rope_theta'", "frequencies that are not finite"}},
      {"positions beyond the limit",
       [](json& d) { d["max_position_embeddings"] = int64_t{1} << 40; },
       {"'max_position_embeddings'", "limit"}},
  };
  for (const auto& c : cases) {
    json doc = json::parse(kV3);
    c.edit(doc);
    const std::string msg = parse_error(doc);
    EXPECT_THAT(msg, HasSubstr("test/config.json")) << c.what;
    for (const auto& s : c.expect) EXPECT_THAT(msg, HasSubstr(s)) << c.what;
  }
  EXPECT_THAT(parse_error(json::array()), HasSubstr("JSON object"));
  json v2 = json::parse(kV2LiteV5);
  v2["rope_scaling"] = v2["rope_parameters"];
  v2["rope_scaling"].erase("rope_theta");
  EXPECT_THAT(parse_error(v2), HasSubstr("'rope_parameters'"));
  v2 = json::parse(kV2LiteV5);
  v2["head_dim"] = 128;
  EXPECT_THAT(parse_error(v2), AllOf(HasSubstr("'head_dim'"), HasSubstr("64")));
}

TEST(Config, DenseModelNeedsNoRoutingFields) {
  json doc = json::parse(kV2Lite);
  doc["n_routed_experts"] = nullptr;
  for (const char* k : {"num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                        "scoring_func", "topk_method", "norm_topk_prob", "routed_scaling_factor",
                        "first_k_dense_replace", "n_group", "topk_group"})
    doc.erase(k);
  const ModelConfig c = parse(doc);
  EXPECT_EQ(c.n_routed_experts, 0);
  EXPECT_FALSE(c.is_moe_layer(5));
  EXPECT_EQ(ModelConfig::parse(c.to_json(), "round trip"), c);
}

}  // namespace
}  // namespace tandem::model
