#include "gateway/policies/prefix_tree.h"

#include <algorithm>
#include <queue>
#include <tuple>

namespace tandem::gateway {

struct PrefixTree::Node {
  std::vector<int32_t> key;  // the edge from the parent
  Node* parent = nullptr;
  std::map<int32_t, std::unique_ptr<Node>> children;  // by the first token of their key
  std::map<int, int64_t> tenants;                     // tenant -> last access (ms)
  uint64_t serial = 0;                                // creation order, for deterministic ties

  bool has(int tenant) const { return tenants.count(tenant) != 0; }
  // A leaf of `tenant`: the tenant is here and in none of the children. Because insert() marks
  // every node of a path, a tenant's nodes always form a subtree hanging from the root.
  bool leaf_of(int tenant) const {
    if (!has(tenant)) return false;
    for (const auto& [first, child] : children)
      if (child->has(tenant)) return false;
    return true;
  }
};

PrefixTree::PrefixTree() : root_(std::make_unique<Node>()) {}
PrefixTree::~PrefixTree() = default;
PrefixTree::PrefixTree(PrefixTree&&) noexcept = default;
PrefixTree& PrefixTree::operator=(PrefixTree&&) noexcept = default;

namespace {

size_t common_prefix(const std::vector<int32_t>& key, std::span<const int32_t> rest) {
  const size_t n = std::min(key.size(), rest.size());
  size_t i = 0;
  while (i < n && key[i] == rest[i]) ++i;
  return i;
}

}  // namespace

void PrefixTree::insert(std::span<const int32_t> tokens, int tenant, int64_t now_ms) {
  Node* node = root_.get();
  size_t pos = 0;
  while (pos < tokens.size()) {
    const auto rest = tokens.subspan(pos);
    auto it = node->children.find(rest[0]);
    if (it == node->children.end()) {
      auto leaf = std::make_unique<Node>();
      leaf->key.assign(rest.begin(), rest.end());
      leaf->parent = node;
      leaf->tenants[tenant] = now_ms;
      leaf->serial = next_serial_++;
      sizes_[tenant] += static_cast<int64_t>(leaf->key.size());
      ++nodes_;
      node->children.emplace(rest[0], std::move(leaf));
      return;
    }
    Node* child = it->second.get();
    const size_t common = common_prefix(child->key, rest);
    if (common < child->key.size()) {
      // Split the edge: a middle node takes the shared part and the child's tenants (its tokens
      // count once for each, as before the split).
      auto mid = std::make_unique<Node>();
      mid->key.assign(child->key.begin(), child->key.begin() + static_cast<std::ptrdiff_t>(common));
      mid->parent = node;
      mid->tenants = child->tenants;
      mid->serial = next_serial_++;
      std::unique_ptr<Node> old = std::move(it->second);
      old->key.erase(old->key.begin(), old->key.begin() + static_cast<std::ptrdiff_t>(common));
      old->parent = mid.get();
      const int32_t old_first = old->key[0];
      mid->children.emplace(old_first, std::move(old));
      it->second = std::move(mid);
      child = it->second.get();
      ++nodes_;
    }
    auto [t, fresh] = child->tenants.try_emplace(tenant, now_ms);
    if (fresh)
      sizes_[tenant] += static_cast<int64_t>(child->key.size());
    else
      t->second = now_ms;
    pos += common;
    node = child;
  }
}

std::map<int, int64_t> PrefixTree::match(std::span<const int32_t> tokens) const {
  std::map<int, int64_t> depth;
  const Node* node = root_.get();
  size_t pos = 0;
  while (pos < tokens.size()) {
    auto it = node->children.find(tokens[pos]);
    if (it == node->children.end()) break;
    const Node* child = it->second.get();
    const size_t common = common_prefix(child->key, tokens.subspan(pos));
    pos += common;
    for (const auto& [tenant, at] : child->tenants) depth[tenant] = static_cast<int64_t>(pos);
    if (common < child->key.size()) break;
    node = child;
  }
  return depth;
}

int64_t PrefixTree::size(int tenant) const {
  auto it = sizes_.find(tenant);
  return it == sizes_.end() ? 0 : it->second;
}

int64_t PrefixTree::node_count() const {
  return nodes_;
}

// Removes `tenant` from `node`, and the node from the tree if nobody is left in it.
void PrefixTree::drop_tenant(Node* node, int tenant) {
  if (node->tenants.erase(tenant) == 0) return;
  auto size = sizes_.find(tenant);
  size->second -= static_cast<int64_t>(node->key.size());
  if (size->second <= 0) sizes_.erase(size);
  if (node->tenants.empty() && node->children.empty() && node->parent) {
    node->parent->children.erase(node->key[0]);  // destroys node
    --nodes_;
  }
}

void PrefixTree::evict(int64_t max_tokens) {
  std::vector<int> over;
  for (const auto& [tenant, size] : sizes_)
    if (size > max_tokens) over.push_back(tenant);
  for (const int tenant : over) {
    // Least recently used first; the creation order makes ties deterministic.
    using Entry = std::tuple<int64_t, uint64_t, Node*>;
    std::priority_queue<Entry, std::vector<Entry>, std::greater<>> leaves;
    std::vector<Node*> stack = {root_.get()};
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      for (auto& [first, child] : n->children)
        if (child->has(tenant)) stack.push_back(child.get());
      if (n != root_.get() && n->leaf_of(tenant))
        leaves.emplace(n->tenants.at(tenant), n->serial, n);
    }
    while (size(tenant) > max_tokens && !leaves.empty()) {
      Node* n = std::get<2>(leaves.top());
      leaves.pop();
      Node* parent = n->parent;
      drop_tenant(n, tenant);
      if (parent != root_.get() && parent->leaf_of(tenant))
        leaves.emplace(parent->tenants.at(tenant), parent->serial, parent);
    }
  }
}

void PrefixTree::remove_tenant(int tenant) {
  // Post-order, so children go before their parents.
  std::vector<Node*> order, stack = {root_.get()};
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    order.push_back(n);
    for (auto& [first, child] : n->children)
      if (child->has(tenant)) stack.push_back(child.get());
  }
  for (auto it = order.rbegin(); it != order.rend(); ++it)
    if (*it != root_.get()) drop_tenant(*it, tenant);
  sizes_.erase(tenant);
}

}  // namespace tandem::gateway
