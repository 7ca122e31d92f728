#pragma once
// Byte-level BPE model of a Hugging Face tokenizer.json ("model": {"type": "BPE", ...}).
// Vocabulary entries are converted from the byte-level alphabet to raw bytes when loading, so
// encoding works on the bytes of each pre-tokenized piece directly.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace tandem::text {

using TokenId = int32_t;

class Bpe {
 public:
  // `model` is the tokenizer.json "model" object; errors name `origin`. `added_tokens` is how
  // many added tokens the file lists besides the model: they may fill holes in the vocabulary's
  // ids, so they count towards how sparse its ids may be.
  Bpe(const nlohmann::json& model, const std::string& origin, size_t added_tokens = 0);
  ~Bpe();

  // Appends the tokens of one pre-tokenized piece (raw bytes).
  void encode_piece(std::string_view bytes, std::vector<TokenId>& out) const;

  // Vocabulary as written in tokenizer.json (alphabet form), indexed by id; empty for ids the
  // model does not define.
  const std::vector<std::string>& tokens() const { return tokens_; }

 private:
  struct PairTable;
  struct WordTable;

  void merge_short(std::vector<TokenId>& ids) const;
  void merge_long(std::vector<TokenId>& ids) const;
  void encode_uncached(std::string_view bytes, std::vector<TokenId>& out) const;

  std::vector<std::string> tokens_;
  std::unique_ptr<WordTable> vocab_;   // raw bytes -> id
  std::unique_ptr<PairTable> merges_;  // (left id, right id) -> (rank, merged id)
  TokenId byte_ids_[256];              // single-byte tokens, -1 when absent
  std::optional<TokenId> unk_;
  bool fuse_unk_ = false;
  bool ignore_merges_ = false;
  uint64_t cache_owner_;  // identifies this model in the per-thread word cache
};

}  // namespace tandem::text
