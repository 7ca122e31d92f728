#include "structured/vocabulary_trie.h"

#include <algorithm>

namespace tandem::structured {

VocabularyTrie VocabularyTrie::build(std::vector<std::pair<std::string, int32_t>> entries) {
  std::erase_if(entries, [](const auto& e) { return e.first.empty(); });
  std::sort(entries.begin(), entries.end());
  VocabularyTrie t;
  t.nodes.emplace_back();
  // Breadth by breadth: each node covers a range of the sorted entries sharing its prefix, so
  // its children are the runs of equal bytes at its depth.
  struct Pending {
    uint32_t node;
    size_t begin, end, depth;
  };
  std::vector<Pending> queue = {{0, 0, entries.size(), 0}};
  for (size_t q = 0; q < queue.size(); ++q) {
    const Pending p = queue[q];
    size_t i = p.begin;
    t.nodes[p.node].first_token = static_cast<uint32_t>(t.tokens.size());
    while (i < p.end && entries[i].first.size() == p.depth) t.tokens.push_back(entries[i++].second);
    t.nodes[p.node].num_tokens =
        static_cast<uint32_t>(t.tokens.size()) - t.nodes[p.node].first_token;
    t.nodes[p.node].first_child = static_cast<uint32_t>(t.nodes.size());
    while (i < p.end) {
      const auto b = static_cast<uint8_t>(entries[i].first[p.depth]);
      size_t j = i;
      while (j < p.end && static_cast<uint8_t>(entries[j].first[p.depth]) == b) ++j;
      Node child;
      child.byte = b;
      t.nodes.push_back(child);
      queue.push_back({static_cast<uint32_t>(t.nodes.size() - 1), i, j, p.depth + 1});
      t.max_depth = std::max(t.max_depth, p.depth + 1);
      i = j;
    }
    t.nodes[p.node].num_children =
        static_cast<uint32_t>(t.nodes.size()) - t.nodes[p.node].first_child;
  }
  return t;
}

}  // namespace tandem::structured
