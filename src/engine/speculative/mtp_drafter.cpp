#include "engine/speculative/mtp_drafter.h"

#include "engine/executor/model_executor.h"
#include "util/error.h"

namespace tandem::engine {

MtpDrafter::MtpDrafter(const model::DeepSeekModel& model, int64_t draft_tokens,
                       std::span<const int32_t> no_text)
    : model_(model), draft_tokens_(draft_tokens), no_text_(no_text.begin(), no_text.end()) {
  if (draft_tokens < 1) throw Error("speculative decoding needs at least one draft token");
  if (model.weights().mtp.empty())
    throw Error(
        "speculative decoding needs the model's MTP module, and this checkpoint has none "
        "(num_nextn_predict_layers is 0 or its weights are absent)");
}

namespace {

// The token at `position` of an item's sequence as known after the step: its history (prompt,
// then generated), its new tokens, then what the step yielded.
int32_t token_at(const ExecItem& item, const StepTokens& out, int64_t position) {
  const auto prompt = static_cast<int64_t>(item.prompt.size());
  const auto known = prompt + static_cast<int64_t>(item.generated.size());
  if (position < prompt) return item.prompt[size_t(position)];
  if (position < known) return item.generated[size_t(position - prompt)];
  return out.tokens.at(size_t(position - known)).token;
}

}  // namespace

void MtpDrafter::run(std::span<const ExecItem> batch, const model::StepOutput& main,
                     model::LatentCache& cache, std::vector<StepTokens>& sampled) const {
  const int64_t h = model_.config().hidden_size, vocab = model_.config().vocab_size;
  const int64_t bs = cache.shape().block_size;
  // First pass: every item's verified new positions, fed the token after each.
  std::vector<std::vector<int32_t>> next(batch.size());
  std::vector<model::SequenceStep> steps;
  std::vector<float> hidden;
  std::vector<size_t> item_of;  // step -> item
  int64_t row = 0;              // the item's first row in main.hidden
  for (size_t i = 0; i < batch.size(); ++i) {
    const ExecItem& item = batch[i];
    const auto rows = static_cast<int64_t>(item.tokens.size() + item.drafts.size());
    // A sampled item verified its new tokens and the drafts it accepted.
    const auto verified = static_cast<int64_t>(item.tokens.size()) +
                          (item.sample ? static_cast<int64_t>(sampled[i].tokens.size()) - 1 : 0);
    auto& ids = next[i];
    for (int64_t p = item.start; p < item.start + verified; ++p)
      ids.push_back(token_at(item, sampled[i], p + 1));
    steps.push_back({ids, item.start, item.blocks,
                     item.sample ? model::LogitRows::kLast : model::LogitRows::kNone});
    hidden.insert(hidden.end(), main.hidden.begin() + row * h,
                  main.hidden.begin() + (row + verified) * h);
    item_of.push_back(i);
    row += rows;
  }
  model::StepOutput out = model_.forward_mtp(steps, hidden.data(), cache);

  // Then the drafts: the first from that pass, the others from passes one position further.
  std::vector<std::vector<int32_t>> outputs(batch.size());  // generated + yielded + drafts
  for (size_t i = 0; i < batch.size(); ++i) {
    if (!batch[i].sample) continue;
    outputs[i].assign(batch[i].generated.begin(), batch[i].generated.end());
    for (const auto& t : sampled[i].tokens) outputs[i].push_back(t.token);
  }
  std::vector<int64_t> last_row(steps.size());  // each step's last hidden row in `out`
  {
    int64_t r = 0;
    for (size_t k = 0; k < steps.size(); ++k)
      last_row[k] = (r += int64_t(steps[k].tokens.size())) - 1;
  }
  std::vector<int32_t> feed(batch.size());
  for (int64_t d = 0; d < draft_tokens_; ++d) {
    std::vector<model::SequenceStep> more;
    std::vector<size_t> more_items;
    std::vector<float> more_hidden;
    for (size_t k = 0; k < steps.size(); ++k) {
      const size_t i = item_of[k];
      const ExecItem& item = batch[i];
      if (!item.sample) continue;
      std::span<float> logits(out.logits.data() + out.first_row[k] * vocab, size_t(vocab));
      mask_ids_without_text(logits, no_text_);
      std::vector<float> q;
      const int32_t draft = item.sampler->propose(logits, item.prompt, outputs[i], q);
      StepTokens& s = sampled[i];
      s.drafts.push_back(draft);
      s.draft_probs.insert(s.draft_probs.end(), q.begin(), q.end());
      outputs[i].push_back(draft);
      if (d + 1 == draft_tokens_) continue;
      // The next pass: this draft at the position after the step's last row.
      const int64_t position = steps[k].start + int64_t(steps[k].tokens.size());
      if (position >= static_cast<int64_t>(item.blocks.size()) * bs) continue;  // no room
      feed[i] = draft;
      more.push_back(
          {std::span<const int32_t>(&feed[i], 1), position, item.blocks, model::LogitRows::kLast});
      more_items.push_back(i);
      more_hidden.insert(more_hidden.end(), out.hidden.begin() + last_row[k] * h,
                         out.hidden.begin() + (last_row[k] + 1) * h);
    }
    if (more.empty()) break;
    out = model_.forward_mtp(more, more_hidden.data(), cache);
    steps = std::move(more);
    item_of = std::move(more_items);
    last_row.resize(steps.size());
    for (size_t k = 0; k < steps.size(); ++k) last_row[k] = int64_t(k);
  }
}

}  // namespace tandem::engine
