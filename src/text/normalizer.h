#pragma once
// Normalizers of tokenizer.json: NFC, NFD, NFKC, NFKD (via ICU), Lowercase, Replace with a
// literal pattern, Prepend, and Sequence of these. Others are an error naming the type.
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace tandem::text {

class Normalizer {
 public:
  Normalizer(const nlohmann::json& config, const std::string& origin);
  ~Normalizer();

  bool is_identity() const { return steps_.empty(); }
  // Applies all steps; returns the input unchanged (as a copy) for the identity normalizer.
  std::string apply(std::string_view text) const;

  struct Step;

 private:
  std::vector<std::unique_ptr<Step>> steps_;
};

}  // namespace tandem::text
