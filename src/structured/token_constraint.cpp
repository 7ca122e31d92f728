#include "structured/token_constraint.h"

#include <algorithm>
#include <limits>

#include "text/token_text.h"
#include "util/error.h"

namespace tandem::structured {

MaskVocabulary::MaskVocabulary(const text::Tokenizer& tokenizer) {
  const size_t n = tokenizer.vocab_size();
  bytes_.resize(n);
  for (size_t id = 0; id < n; ++id) {
    const auto t = static_cast<int32_t>(id);
    if (text::has_text(tokenizer, t) && !tokenizer.is_special(t))
      bytes_[id] = tokenizer.token_bytes(t);
  }
  build_trie();
}

MaskVocabulary::MaskVocabulary(std::vector<std::string> bytes) : bytes_(std::move(bytes)) {
  build_trie();
}

void MaskVocabulary::build_trie() {
  std::vector<std::pair<std::string, int32_t>> entries;
  entries.reserve(bytes_.size());
  for (size_t id = 0; id < bytes_.size(); ++id) entries.emplace_back(bytes_[id], int32_t(id));
  trie_ = VocabularyTrie::build(std::move(entries));
}

std::shared_ptr<const std::vector<uint64_t>> MaskCache::find(const std::string& state) {
  std::lock_guard lock(mutex_);
  auto it = entries_.find(state);
  if (it == entries_.end()) return nullptr;
  order_.splice(order_.begin(), order_, it->second.at);
  return it->second.mask;
}

void MaskCache::put(const std::string& state, std::shared_ptr<const std::vector<uint64_t>> mask) {
  // The map's node and the list's, besides the key's and the mask's own bytes.
  constexpr size_t kEntryOverhead = 128;
  const size_t cost = state.size() + (mask ? mask->size() * sizeof(uint64_t) : 0) + kEntryOverhead;
  std::lock_guard lock(mutex_);
  // An entry over the whole budget would evict every other and still not fit: it is not kept.
  if (cost > max_bytes_ || entries_.count(state)) return;
  const auto it = entries_.emplace(state, Entry{std::move(mask), {}, cost}).first;
  order_.push_front(&it->first);
  it->second.at = order_.begin();
  bytes_ += cost;
  while (!order_.empty() && (entries_.size() > capacity_ || bytes_ > max_bytes_)) {
    const auto last = entries_.find(*order_.back());
    order_.pop_back();
    bytes_ -= last->second.bytes;
    entries_.erase(last);
  }
}

size_t MaskCache::bytes() {
  std::lock_guard lock(mutex_);
  return bytes_;
}

TokenConstraint::TokenConstraint(std::shared_ptr<const Grammar> grammar,
                                 std::shared_ptr<MaskCache> cache,
                                 std::shared_ptr<const MaskVocabulary> vocabulary)
    : matcher_(std::move(grammar)), cache_(std::move(cache)), vocabulary_(std::move(vocabulary)) {}

const std::vector<uint64_t>& TokenConstraint::allowed() {
  if (current_) return *current_;
  const std::string state = matcher_.mask_key(vocabulary_->trie().max_depth);
  current_ = cache_->find(state);
  if (current_) {
    ++stats_.masks_reused;
    return *current_;
  }
  const auto start = std::chrono::steady_clock::now();
  auto mask = std::make_shared<std::vector<uint64_t>>((vocabulary_->size() + 63) / 64, 0);
  matcher_.accepted_tokens(vocabulary_->trie(), *mask);
  stats_.compute_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ++stats_.masks_computed;
  cache_->put(state, mask);
  current_ = std::move(mask);
  return *current_;
}

void TokenConstraint::mask(std::span<float> logits, std::span<const int32_t> end_ids) {
  const std::vector<uint64_t>& bits = allowed();
  const bool may_end = ended_ || matcher_.accepting();
  constexpr float kOff = -std::numeric_limits<float>::infinity();
  // The end ids' logits, which the grammar's mask (text tokens only) would drop.
  std::vector<std::pair<size_t, float>> ends;
  if (may_end)
    for (int32_t id : end_ids)
      if (id >= 0 && size_t(id) < logits.size()) ends.emplace_back(size_t(id), logits[size_t(id)]);
  const size_t n = std::min(logits.size(), vocabulary_->size());
  for (size_t w = 0; w * 64 < n; ++w) {
    const uint64_t word = ended_ ? 0 : bits[w];
    if (word == ~uint64_t(0)) continue;
    for (size_t id = w * 64; id < std::min(n, w * 64 + 64); ++id)
      if (!((word >> (id % 64)) & 1)) logits[id] = kOff;
  }
  for (size_t id = n; id < logits.size(); ++id) logits[id] = kOff;
  for (const auto& [id, v] : ends) logits[id] = v;
  if (std::any_of(logits.begin(), logits.end(), [&](float v) { return v > kOff; })) return;
  // Nothing is left. When the grammar allowed something, the request's other masks removed it,
  // and the sampler, which knows them, decides (it fails the request naming them); only the
  // grammar's own dead end is this constraint's error.
  bool allows = !ends.empty();
  for (size_t id = 0; !ended_ && !allows && id < n; ++id) allows = (bits[id / 64] >> (id % 64)) & 1;
  if (!allows) throw ConstraintError("structured output: no token can continue the answer");
}

void TokenConstraint::accept(int32_t token, std::span<const int32_t> end_ids) {
  const bool is_end = std::find(end_ids.begin(), end_ids.end(), token) != end_ids.end();
  if (is_end && (ended_ || matcher_.accepting())) {
    ended_ = true;
    return;
  }
  if (token < 0 || size_t(token) >= vocabulary_->size() || vocabulary_->bytes(token).empty() ||
      ended_ || !matcher_.advance(vocabulary_->bytes(token)))
    throw ConstraintError("structured output: token " + std::to_string(token) +
                          " does not continue the answer as its format requires");
  current_.reset();
}

StructuredOutputs::StructuredOutputs(std::shared_ptr<const text::Tokenizer> tokenizer,
                                     size_t max_grammars, size_t masks_per_grammar)
    : tokenizer_(std::move(tokenizer)),
      max_grammars_(max_grammars),
      masks_per_grammar_(masks_per_grammar) {}

std::unique_ptr<TokenConstraint> StructuredOutputs::start(const OutputSpec& spec,
                                                          std::shared_ptr<const Grammar> compiled) {
  std::lock_guard lock(mutex_);
  if (!vocabulary_) vocabulary_ = std::make_shared<const MaskVocabulary>(*tokenizer_);
  const std::string key = spec.key();
  auto it = grammars_.find(key);
  if (it == grammars_.end()) {
    if (!compiled) compiled = spec.compiled;
    Compiled c{compiled ? std::move(compiled) : compile(spec),
               std::make_shared<MaskCache>(masks_per_grammar_)};
    grammar_bytes_ += c.grammar->bytes();
    order_.push_front(key);
    it = grammars_.emplace(key, std::make_pair(std::move(c), order_.begin())).first;
    // The newest stays (its request holds it anyway).
    while (grammars_.size() > 1 &&
           (grammars_.size() > max_grammars_ || grammar_bytes_ > kMaxGrammarBytes)) {
      auto last = grammars_.find(order_.back());
      grammar_bytes_ -= last->second.first.grammar->bytes();
      grammars_.erase(last);
      order_.pop_back();
    }
  } else {
    order_.splice(order_.begin(), order_, it->second.second);
  }
  const Compiled& c = it->second.first;
  return std::make_unique<TokenConstraint>(c.grammar, c.masks, vocabulary_);
}

}  // namespace tandem::structured
