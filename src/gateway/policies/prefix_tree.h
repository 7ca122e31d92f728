#pragma once
// SGLang's approximate cache model for its `cache_aware` policy: one radix tree of the prompts the
// router itself sent, shared by all engines ("tenants"), each node remembering which tenants were
// sent a prompt through it and when. It knows nothing the engines report; it is routing history.
// We key it by token ids where SGLang keys by characters, so sizes count tokens.
//
// The tree is the explicit state of the cache_aware policy: the gateway owns one per pool, the
// policy reads it to choose and the gateway calls insert() for the decision it applied, and
// evict() on the policy's interval. Deterministic: time is passed in, ties break by tenant id.
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <vector>

namespace tandem::gateway {

class PrefixTree {
 public:
  PrefixTree();
  ~PrefixTree();
  PrefixTree(PrefixTree&&) noexcept;
  PrefixTree& operator=(PrefixTree&&) noexcept;

  // Records that `tokens` were sent to `tenant` at `now_ms`: every node on the path gets the
  // tenant with that access time, edges are split where the prompt leaves them.
  void insert(std::span<const int32_t> tokens, int tenant, int64_t now_ms);

  // For each tenant, how many leading tokens of `tokens` the tree holds for it (a partial match
  // inside an edge counts, as in SGLang). Tenants without any match are absent.
  std::map<int, int64_t> match(std::span<const int32_t> tokens) const;

  // Tokens held for `tenant` (the sum of its nodes' edge lengths); 0 if unknown.
  int64_t size(int tenant) const;

  // SGLang's eviction: for every tenant holding more than `max_tokens`, remove its least recently
  // used leaves (nodes of the tenant with no child of the tenant) until it holds at most
  // `max_tokens`; nodes left without tenants are deleted. Ties: the lower node creation order.
  void evict(int64_t max_tokens);

  // Forgets a tenant entirely (an engine left the pool).
  void remove_tenant(int tenant);

  int64_t node_count() const;  // nodes besides the root (for tests and metrics)

 private:
  struct Node;
  std::unique_ptr<Node> root_;
  std::map<int, int64_t> sizes_;
  int64_t nodes_ = 0;
  uint64_t next_serial_ = 1;
  void drop_tenant(Node* node, int tenant);
};

}  // namespace tandem::gateway
