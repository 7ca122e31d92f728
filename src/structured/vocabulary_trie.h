#pragma once
// A tokenizer's vocabulary as a trie of the tokens' bytes, so a token mask is one walk that
// leaves a subtree as soon as its prefix is refused, instead of one match per token.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tandem::structured {

struct VocabularyTrie {
  struct Node {
    uint32_t first_child = 0, num_children = 0;  // children are contiguous in `nodes`
    uint32_t first_token = 0, num_tokens = 0;    // tokens whose bytes end here, in `tokens`
    uint8_t byte = 0;                            // the byte that leads here from the parent
  };
  std::vector<Node> nodes;  // nodes[0] is the root (the empty prefix)
  std::vector<int32_t> tokens;
  size_t max_depth = 0;

  // From (bytes, id) pairs; empty byte strings are left out.
  static VocabularyTrie build(std::vector<std::pair<std::string, int32_t>> entries);
};

}  // namespace tandem::structured
