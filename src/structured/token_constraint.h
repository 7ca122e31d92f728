#pragma once
// Constrained decoding: per step, the tokens whose bytes keep the answer inside a grammar (a mask
// over the vocabulary, computed by walking the vocabulary's trie from the matcher's state, and
// cached per grammar and state, since answers revisit states: every character inside one JSON
// string leaves the same state, and those inside a bounded one the same as far as a token can
// tell, GrammarMatcher::mask_key), and the state advanced by the token sampled.
#include <chrono>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "structured/matcher.h"
#include "structured/output_spec.h"
#include "structured/vocabulary_trie.h"
#include "text/tokenizer.h"
#include "util/error.h"

namespace tandem::structured {

// A vocabulary prepared for masks: the trie of every token with text (special tokens are never
// allowed by a grammar; the end ids are allowed when the answer is complete).
class MaskVocabulary {
 public:
  explicit MaskVocabulary(const text::Tokenizer& tokenizer);
  // Token id i has bytes[i] (empty: a token never allowed).
  explicit MaskVocabulary(std::vector<std::string> bytes);
  const VocabularyTrie& trie() const { return trie_; }
  const std::string& bytes(int32_t id) const { return bytes_[size_t(id)]; }
  size_t size() const { return bytes_.size(); }

 private:
  void build_trie();

  VocabularyTrie trie_;
  std::vector<std::string> bytes_;
};

// The masks met so far for one grammar, by state (bounded in number and in the bytes of keys
// and masks: the least recently used go).
class MaskCache {
 public:
  // 128 masks of a 262k-token vocabulary are 4 MiB; keys grow with the answer's nesting, and 32
  // grammars' caches of 128 such keys each held 80 MB.
  static constexpr size_t kMaxBytes = size_t(6) << 20;
  explicit MaskCache(size_t capacity, size_t max_bytes = kMaxBytes)
      : capacity_(capacity), max_bytes_(max_bytes) {}
  std::shared_ptr<const std::vector<uint64_t>> find(const std::string& state);
  void put(const std::string& state, std::shared_ptr<const std::vector<uint64_t>> mask);
  size_t bytes();

 private:
  std::mutex mutex_;
  size_t capacity_, max_bytes_;
  size_t bytes_ = 0;
  // The keys in entries_, most recent first (each key held once: keys grow long).
  std::list<const std::string*> order_;
  struct Entry {
    std::shared_ptr<const std::vector<uint64_t>> mask;
    std::list<const std::string*>::iterator at;
    size_t bytes = 0;  // its key's and mask's
  };
  std::unordered_map<std::string, Entry> entries_;
};

// What constrained decoding cost one request: masks computed and reused, and the time the
// computed ones took.
struct ConstraintStats {
  int64_t masks_computed = 0, masks_reused = 0;
  double compute_seconds = 0;
};

class TokenConstraint {
 public:
  TokenConstraint(std::shared_ptr<const Grammar> grammar, std::shared_ptr<MaskCache> cache,
                  std::shared_ptr<const MaskVocabulary> vocabulary);

  // Sets the logits of tokens the grammar refuses next to -infinity. `end_ids` (EOS, stop ids)
  // keep theirs when the answer is complete. Throws ConstraintError when the grammar allows no
  // token of the vocabulary (nor an end) next. When it allows some but their logits were already
  // -infinity (the request's other masks), every logit is left so: the caller, which knows those
  // masks, decides (engine::Sampler fails the request naming them).
  void mask(std::span<float> logits, std::span<const int32_t> end_ids);
  // The token sampled: advances the state. Throws ConstraintError for a token the grammar
  // refuses.
  void accept(int32_t token, std::span<const int32_t> end_ids);
  bool complete() const { return matcher_.accepting(); }
  const ConstraintStats& stats() const { return stats_; }

 private:
  const std::vector<uint64_t>& allowed();

  GrammarMatcher matcher_;
  std::shared_ptr<MaskCache> cache_;
  std::shared_ptr<const MaskVocabulary> vocabulary_;
  std::shared_ptr<const std::vector<uint64_t>> current_;  // the mask of the current state
  bool ended_ = false;                                    // an end id was accepted
  ConstraintStats stats_;
};

// Compiled grammars by spec (bounded in number and in bytes, least recently used go), each with
// its mask cache: what an engine keeps so that requests with the same schema share the work.
class StructuredOutputs {
 public:
  // A grammar near Grammar::kMaxSymbols holds ~30 MB: 32 of them were ~1 GB.
  static constexpr size_t kMaxGrammarBytes = size_t(256) << 20;
  explicit StructuredOutputs(std::shared_ptr<const text::Tokenizer> tokenizer,
                             size_t max_grammars = 32, size_t masks_per_grammar = 128);
  // When the spec is not cached: takes `compiled` (the engine takes the API's grammar out of the
  // request, so that the request's copies do not each keep one alive), else spec.compiled, else
  // compiles it (a large grammar takes seconds: the API compiles it where it parses the
  // request). Throws tandem::Error for a spec that does not compile.
  std::unique_ptr<TokenConstraint> start(const OutputSpec& spec,
                                         std::shared_ptr<const Grammar> compiled = nullptr);

 private:
  struct Compiled {
    std::shared_ptr<const Grammar> grammar;
    std::shared_ptr<MaskCache> masks;
  };
  std::shared_ptr<const text::Tokenizer> tokenizer_;
  std::shared_ptr<const MaskVocabulary> vocabulary_;  // built on first use
  size_t max_grammars_, masks_per_grammar_;
  size_t grammar_bytes_ = 0;  // held by grammars_
  std::mutex mutex_;
  std::list<std::string> order_;
  std::unordered_map<std::string, std::pair<Compiled, std::list<std::string>::iterator>> grammars_;
};

}  // namespace tandem::structured
