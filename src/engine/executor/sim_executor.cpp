#include "engine/executor/sim_executor.h"

#include <thread>

#include "util/error.h"
#include "util/hash.h"

namespace tandem::engine {
namespace {

// KV capacity and context length of the presets' engines. DeepSeek-V3 caches 61 layers x
// (512 latent + 64 rope) BF16 values = 70,272 bytes per token; 32,768 blocks of 16 tokens
// (524,288 tokens, ~34 GiB) is what one 80 GB H800 rank keeps for KV after its share of the
// expert-parallel weights, and 163,840 is the model's max_position_embeddings.
// The tiny preset stands for a small MLA model (2 layers, 32 + 16 float32 values per token).
// MoE shape: DeepSeek-V3's 58 MoE layers (after 3 dense ones) of 256 routed experts, 8 per
// token; the tiny model's one MoE layer of 8 experts, 2 per token.
struct Capacity {
  int64_t num_blocks_16, max_model_len;
  int64_t layers, token_bytes;
  int64_t first_moe_layer, routed_experts, experts_per_token;
};

Capacity capacity_of(const std::string& name) {
  if (name == "tiny") return {2048, 4096, 2, 48 * 4, 1, 8, 2};
  return {32768, 163840, 61, 576 * 2, 3, 256, 8};
}

SimLatencyModel load_model(const std::string& preset) {
  if (preset.empty()) throw Error("sim: no preset given (sim:PRESET)");
  // A fitted model saved as JSON is named by its path.
  if (preset.find('/') != std::string::npos || preset.ends_with(".json"))
    return SimLatencyModel::load(preset);
  return SimLatencyModel::preset(preset);
}

}  // namespace

SimExecutor::SimExecutor(const text::Tokenizer& tokenizer, const SimExecutorOptions& options)
    : model_(load_model(options.preset)), options_(options) {
  if (options.block_size < 1) throw Error("block size must be at least 1");
  if (!(options.time_scale >= 0)) throw Error("sim: time scale must be >= 0");
  const Capacity cap = capacity_of(model_.name());
  info_.model_name = options.model_name;
  info_.vocab_size = static_cast<int64_t>(tokenizer.vocab_size());
  info_.max_model_len = options.max_model_len > 0 ? options.max_model_len : cap.max_model_len;
  info_.block_size = options.block_size;
  info_.num_blocks = options.num_blocks > 0
                         ? options.num_blocks
                         : std::max<int64_t>(1, cap.num_blocks_16 * 16 / options.block_size);
  for (size_t id = 0; id < tokenizer.vocab_size(); ++id) {
    const auto t = static_cast<int32_t>(id);
    if (tokenizer.id_to_token(t) && !tokenizer.is_special(t)) ordinary_.push_back(t);
  }
  if (ordinary_.empty()) throw Error("sim: the tokenizer has no ordinary tokens to emit");
  if (options.kv_token_bytes < 0) throw Error("sim: KV bytes per token must be >= 0");
  const int64_t token_bytes = options.kv_token_bytes > 0 ? options.kv_token_bytes : cap.token_bytes;
  info_.kv_layout = {"sim:" + model_.name(), cap.layers, options.block_size, token_bytes};
  if (options.expert_parallel.ranks > 0) {
    SimExpertParallelOptions ep = options.expert_parallel;
    ep.skew.top_k = cap.experts_per_token;
    expert_parallel_.emplace(cap.layers - cap.first_moe_layer, cap.routed_experts, ep);
    for (int64_t l = cap.first_moe_layer; l < cap.layers; ++l) info_.moe_layers.push_back(l);
    info_.routed_experts = cap.routed_experts;
  }
  pattern_.resize(size_t(options.block_size * token_bytes));
  for (size_t i = 0; i < pattern_.size(); ++i) pattern_[i] = std::byte(i * 131 + 7);
}

const std::byte* SimExecutor::kv_bytes(int32_t, int64_t) const {
  return pattern_.data();
}

void SimExecutor::write_kv(int32_t, int64_t, std::span<const std::byte>) {}

ExecResult SimExecutor::execute(std::span<const ExecItem> batch, const LayerHook& on_layer) {
  const auto start = std::chrono::steady_clock::now();
  StepShape shape;
  for (const auto& item : batch) {
    const auto n = static_cast<int64_t>(item.tokens.size());
    if (n == 1 && !item.generated.empty()) {
      ++shape.decode_seqs;
      ++shape.decode_tokens;
      shape.decode_context_tokens += item.start;
    } else {
      shape.prefills.push_back({n, item.start});
    }
  }
  ExecResult result;
  result.sampled.resize(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    const auto& item = batch[i];
    if (!item.drafts.empty())
      throw Error("the simulated executor does not speculate: item " + std::to_string(i) +
                  " has drafts");
    if (!item.sample) continue;
    const auto position = static_cast<uint64_t>(item.start) + item.tokens.size();
    const uint64_t h =
        hash_u64(options_.seed ^ hash_u64(position * 0x9e3779b97f4a7c15ULL ^
                                          static_cast<uint32_t>(item.tokens.back())));
    TokenLogprob& out = result.sampled[i].tokens.emplace_back();
    out.token = ordinary_[h % ordinary_.size()];
    out.logprob = 0;
    if (item.logprobs > 0) {
      out.top.emplace_back(out.token, 0.0f);
      for (int32_t k = 1; k < item.logprobs; ++k)
        out.top.emplace_back(ordinary_[(h + k) % ordinary_.size()], -static_cast<float>(k));
    }
  }
  double seconds = model_.step_seconds(shape) * options_.time_scale;
  if (expert_parallel_) {
    int64_t tokens = shape.decode_tokens;
    for (const PrefillPart& p : shape.prefills) tokens += p.new_tokens;
    SimExpertParallel::Step moe = expert_parallel_->step(tokens);
    seconds *= moe.factor;
    result.expert_tokens = std::move(moe.routes);
  }
  // The step's time passes (until `at` seconds into it), on the wall clock or the owner's.
  double passed = 0;
  auto pass_until = [&](double at) {
    if (options_.wait) {
      if (at > passed) options_.wait(at - passed);
    } else {
      std::this_thread::sleep_until(start + std::chrono::duration<double>(at));
    }
    passed = std::max(passed, at);
  };
  if (on_layer) {
    // Layers complete evenly over the step, as KV transfer would see them on a GPU.
    const int64_t layers = info_.kv_layout.layers;
    for (int64_t l = 1; l <= layers; ++l) {
      pass_until(seconds * double(l) / double(layers));
      on_layer(l);
    }
  }
  pass_until(seconds);
  return result;
}

}  // namespace tandem::engine
