#include "engine/executor/sim_executor.h"

#include <algorithm>
#include <thread>

#include "text/token_text.h"
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
  // Qwen3-30B-A3B on an 80 GB H100: ~15 GB left for K/V after 61 GB of BF16 weights, at
  // 48 layers x 16 tokens x 2,048 B (K|V of 4 heads of 128) per block.
  if (name == "qwen3-30b-a3b-h100") return {9500, 40960, 48, 2 * 4 * 128 * 2, 0, 128, 8};
  return {32768, 163840, 61, 576 * 2, 3, 256, 8};
}

SimLatencyModel load_model(const std::string& preset) {
  if (preset.empty()) throw Error("sim: no preset given (sim:PRESET)");
  // A fitted model saved as JSON is named by its path.
  if (preset.find('/') != std::string::npos || preset.ends_with(".json"))
    return SimLatencyModel::load(preset);
  return SimLatencyModel::preset(preset);
}

// The options' KV size, or (at 0) the model's.
SimKvSize kv_size_of(const Capacity& cap, const SimExecutorOptions& options) {
  if (options.block_size < 1) throw Error("block size must be at least 1");
  if (options.kv_token_bytes < 0) throw Error("sim: KV bytes per token must be >= 0");
  return {options.num_blocks > 0
              ? options.num_blocks
              : std::max<int64_t>(1, cap.num_blocks_16 * 16 / options.block_size),
          options.kv_token_bytes > 0 ? options.kv_token_bytes : cap.token_bytes};
}

}  // namespace

SimKvSize sim_kv_size(const SimExecutorOptions& options) {
  return kv_size_of(capacity_of(load_model(options.preset).name()), options);
}

SimExecutor::SimExecutor(const text::Tokenizer& tokenizer, const SimExecutorOptions& options)
    : model_(load_model(options.preset)), options_(options) {
  if (!(options.time_scale >= 0)) throw Error("sim: time scale must be >= 0");
  const Capacity cap = capacity_of(model_.name());
  info_.model_name = options.model_name;
  info_.samples = false;
  info_.vocab_size = static_cast<int64_t>(tokenizer.vocab_size());
  info_.max_model_len = options.max_model_len > 0 ? options.max_model_len : cap.max_model_len;
  info_.block_size = options.block_size;
  const SimKvSize kv = kv_size_of(cap, options);
  info_.num_blocks = kv.num_blocks;
  for (size_t id = 0; id < tokenizer.vocab_size(); ++id) {
    const auto t = static_cast<int32_t>(id);
    if (text::has_text(tokenizer, t) && !tokenizer.is_special(t)) ordinary_.push_back(t);
  }
  if (ordinary_.empty()) throw Error("sim: the tokenizer has no ordinary tokens to emit");
  info_.kv_layout = {"sim:" + model_.name(), cap.layers, options.block_size, kv.token_bytes};
  if (options.expert_parallel.ranks > 0) {
    SimExpertParallelOptions ep = options.expert_parallel;
    ep.skew.top_k = cap.experts_per_token;
    expert_parallel_.emplace(cap.layers - cap.first_moe_layer, cap.routed_experts, ep);
    for (int64_t l = cap.first_moe_layer; l < cap.layers; ++l) info_.moe_layers.push_back(l);
    info_.routed_experts = cap.routed_experts;
  }
  const SimMtpOptions& mtp = options.mtp;
  if (mtp.drafts < 0 || mtp.drafts > 16) throw Error("sim: MTP drafts must be 0..16");
  if (mtp.acceptance.empty()) throw Error("sim: MTP acceptance: expected at least one probability");
  for (double p : mtp.acceptance)
    if (!(p >= 0 && p <= 1))
      throw Error("sim: MTP acceptance " + std::to_string(p) + " is not a probability (0..1)");
  if (!(mtp.draft_pass_share >= 0 && mtp.draft_pass_share < 1e6))
    throw Error("sim: MTP draft pass share must be in 0..10^6");
  info_.speculative_tokens = mtp.drafts;
  pattern_ = SharableBuffer(size_t(options.block_size * kv.token_bytes), "tandem-sim-kv");
  for (size_t i = 0; i < pattern_.size(); ++i) pattern_.data()[i] = std::byte(i * 131 + 7);
}

size_t SimExecutor::next_token(uint64_t position, int32_t previous) const {
  const uint64_t h = hash_u64(
      options_.seed ^ hash_u64(position * 0x9e3779b97f4a7c15ULL ^ static_cast<uint32_t>(previous)));
  return h % ordinary_.size();
}

void SimExecutor::emit(size_t index, int32_t logprobs, StepTokens& out) const {
  TokenLogprob& t = out.tokens.emplace_back();
  t.token = ordinary_[index];
  t.logprob = 0;
  if (logprobs <= 0) return;
  // Placeholder alternatives: the ordinary tokens after the sampled one.
  t.top.emplace_back(t.token, 0.0f);
  for (int32_t k = 1; k < logprobs; ++k)
    t.top.emplace_back(ordinary_[(index + size_t(k)) % ordinary_.size()], -static_cast<float>(k));
}

void SimExecutor::score_prompt(const ExecItem& item, StepTokens& out) const {
  const auto [first, end] = item.scored_prompt();
  if (first >= end) return;
  out.prompt_at = first;
  for (int64_t p = first; p < end; ++p) {
    // Placeholders as emit()'s: the prompt token is the most likely, then ordinary tokens.
    TokenLogprob& t = out.prompt.emplace_back();
    t.token = item.prompt[size_t(p)];
    t.rank = 1;
    for (int32_t k = 0; k < item.prompt_logprobs; ++k)
      t.top.emplace_back(k == 0 ? t.token : ordinary_[size_t(p + k) % ordinary_.size()],
                         -static_cast<float>(k));
  }
}

void SimExecutor::propose_drafts(uint64_t position, int32_t last, int64_t count,
                                 StepTokens& out) const {
  const std::vector<double>& acceptance = options_.mtp.acceptance;
  for (int64_t d = 0; d < count; ++d) {
    ++position;
    const size_t index = next_token(position, last);
    const double p = acceptance[std::min(size_t(d), acceptance.size() - 1)];
    // A uniform draw in [0, 1) from the seed, the position and the token before.
    const uint64_t h =
        hash_u64(options_.seed ^ 0x6d74702d64726166ULL ^
                 hash_u64(position * 0xc2b2ae3d27d4eb4fULL ^ static_cast<uint32_t>(last)));
    const bool right = double(h >> 11) * 0x1.0p-53 < p || ordinary_.size() == 1;
    // A wrong draft is another ordinary token.
    const size_t other =
        (index + 1 + h % (ordinary_.size() - 1 + (ordinary_.size() == 1))) % ordinary_.size();
    out.drafts.push_back(ordinary_[right ? index : other]);
    last = ordinary_[index];
  }
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
      shape.decode_tokens += 1 + static_cast<int64_t>(item.drafts.size());
      shape.decode_context_tokens += item.start;
    } else {
      shape.prefills.push_back({n, item.start});
    }
  }
  ExecResult result;
  result.sampled.resize(batch.size());
  int64_t draft_passes = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const auto& item = batch[i];
    if (!item.drafts.empty() && info_.speculative_tokens == 0)
      throw Error("the simulated executor speculates only with MTP drafts on: item " +
                  std::to_string(i) + " has drafts");
    score_prompt(item, result.sampled[i]);
    if (!item.sample) continue;
    // Verification: the drafts the sequence does continue with, up to the first that it does
    // not, then the token after the last accepted one (or the rejected draft's replacement).
    StepTokens& out = result.sampled[i];
    uint64_t position = static_cast<uint64_t>(item.start) + item.tokens.size();
    int32_t previous = item.tokens.back();
    for (size_t d = 0;; ++d, ++position) {
      const size_t index = next_token(position, previous);
      emit(index, item.logprobs, out);
      previous = ordinary_[index];
      if (d == item.drafts.size() || item.drafts[d] != previous) break;
    }
    if (info_.speculative_tokens > 0) {
      propose_drafts(position, out.tokens.back().token, info_.speculative_tokens, out);
      draft_passes = info_.speculative_tokens;
    }
  }
  double seconds = model_.step_seconds(shape) * options_.time_scale;
  seconds *= 1 + options_.mtp.draft_pass_share * double(draft_passes);
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
