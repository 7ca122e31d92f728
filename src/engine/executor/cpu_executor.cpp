#include "engine/executor/cpu_executor.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "engine/executor/model_executor.h"

#include "util/error.h"

namespace tandem::engine {
namespace {

std::string gib(double bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f GiB", bytes / double(1ull << 30));
  return buf;
}

// A cgroup's memory limit: the smallest of the files' values; 0 when none is readable or all say
// unlimited ("max", or v1's near-2^63 sentinel).
int64_t cgroup_memory_limit() {
  std::ifstream self("/proc/self/cgroup");
  const std::string membership((std::istreambuf_iterator<char>(self)), {});
  int64_t limit = 0;
  for (const std::string& path : cgroup_memory_limit_files(membership)) {
    std::ifstream in(path);
    std::string value;
    if (!(in >> value) || value == "max") continue;
    char* end = nullptr;
    const unsigned long long v = std::strtoull(value.c_str(), &end, 10);
    if (end != value.c_str() && *end == 0 && v > 0 && v < (1ull << 62) &&
        (limit == 0 || static_cast<int64_t>(v) < limit))
      limit = static_cast<int64_t>(v);
  }
  return limit;
}

}  // namespace

std::vector<std::string> cgroup_memory_limit_files(std::string_view proc_self_cgroup) {
  std::vector<std::string> files;
  // The cgroup's own folder and every one above it: a limit set on a parent (a systemd slice, a
  // container's) binds too.
  auto with_ancestors = [&](const std::string& root, std::string_view path, const char* file) {
    std::string dir(path);
    for (;;) {
      while (!dir.empty() && dir.back() == '/') dir.pop_back();
      files.push_back(root + dir + "/" + file);
      if (dir.empty()) return;
      dir.erase(dir.rfind('/') == std::string::npos ? 0 : dir.rfind('/'));
    }
  };
  size_t at = 0;
  while (at < proc_self_cgroup.size()) {
    size_t end = proc_self_cgroup.find('\n', at);
    if (end == std::string_view::npos) end = proc_self_cgroup.size();
    const std::string_view line = proc_self_cgroup.substr(at, end - at);
    at = end + 1;
    // "ID:CONTROLLERS:PATH": v2 is "0::PATH"; v1 names "memory" among its controllers.
    const size_t first = line.find(':'), second = line.find(':', first + 1);
    if (first == std::string_view::npos || second == std::string_view::npos) continue;
    const std::string_view controllers = line.substr(first + 1, second - first - 1);
    const std::string_view path = line.substr(second + 1);
    if (path.empty() || path.front() != '/') continue;
    if (controllers.empty()) {
      with_ancestors("/sys/fs/cgroup", path, "memory.max");
    } else {
      for (size_t c = 0; c <= controllers.size();) {
        size_t comma = controllers.find(',', c);
        if (comma == std::string_view::npos) comma = controllers.size();
        if (controllers.substr(c, comma - c) == "memory")
          with_ancestors("/sys/fs/cgroup/memory", path, "memory.limit_in_bytes");
        c = comma + 1;
      }
    }
  }
  return files;
}

int64_t kv_cache_memory_limit() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  int64_t limit = pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
  if (const int64_t cgroup = cgroup_memory_limit(); cgroup > 0 && (limit == 0 || cgroup < limit))
    limit = cgroup;
  return limit;
}

int64_t kv_blocks_for(const model::LatentCacheShape& shape, const CpuExecutorOptions& o) {
  if (o.block_size < 1) throw Error("block size must be at least 1");
  const int64_t block_bytes = shape.block_bytes();
  if (block_bytes < 1) throw Error("the KV cache's blocks have no bytes");
  constexpr int64_t kMaxBlocks = std::numeric_limits<int32_t>::max();  // block ids are int32
  char budget[64];
  std::snprintf(budget, sizeof budget, "%g", o.kv_cache_bytes / double(1ull << 30));
  const std::string flag = o.num_blocks > 0 ? "--num-kv-blocks " + std::to_string(o.num_blocks)
                                            : std::string("--kv-cache-gb ") + budget;
  int64_t n = o.num_blocks;
  if (n <= 0) {
    if (!std::isfinite(o.kv_cache_bytes) || o.kv_cache_bytes <= 0)
      throw Error("--kv-cache-gb: expected a positive number of GiB");
    const double fit = std::floor(o.kv_cache_bytes / static_cast<double>(block_bytes));
    if (fit < 1)
      throw Error(flag + ": the KV cache budget holds no block of " + std::to_string(block_bytes) +
                  " bytes");
    // Compared as a double: a cast of a budget like 1e10 GiB to int64 would overflow.
    n = fit > static_cast<double>(kMaxBlocks) ? kMaxBlocks + 1 : static_cast<int64_t>(fit);
  }
  if (n > kMaxBlocks)
    throw Error(flag + ": the KV cache would hold " +
                (o.num_blocks > 0 ? std::to_string(n) : std::string("more than 2^31-1")) +
                " blocks; at most " + std::to_string(kMaxBlocks) + " (block ids are 32-bit)");
  int64_t bytes = 0;
  if (__builtin_mul_overflow(n, block_bytes, &bytes))
    throw Error(flag + ": " + std::to_string(n) + " KV blocks of " + std::to_string(block_bytes) +
                " bytes overflow a 64-bit size");
  // The cache is zero pages until written, so an oversized one starts and then dies (SIGBUS or
  // the OOM killer) once requests fill it. It must fit the machine's physical memory (or its
  // cgroup's limit, when lower); the weights and activations need memory too, which this does
  // not try to estimate: the rule only refuses a cache that can never be filled.
  const int64_t limit = kv_cache_memory_limit();
  if (limit > 0 && bytes > limit)
    throw Error(flag + ": a KV cache of " + std::to_string(n) + " blocks needs " + gib(bytes) +
                " (" + std::to_string(bytes) + " bytes), more than this machine's " + gib(limit) +
                " (" + std::to_string(limit) +
                " bytes) of physical memory (or its cgroup's limit, when lower)");
  return n;
}

int64_t kv_blocks_for(const model::DeepSeekModel& m, const CpuExecutorOptions& o) {
  return kv_blocks_for(m.cache_shape(o.block_size, o.kv_cache_type), o);
}

CpuExecutor::CpuExecutor(std::shared_ptr<const model::DeepSeekModel> model,
                         const text::Tokenizer& tokenizer, std::string model_name,
                         const CpuExecutorOptions& options)
    : model_(std::move(model)),
      cache_(model_->cache_shape(options.block_size, options.kv_cache_type),
             kv_blocks_for(*model_, options)) {
  const auto& c = model_->config();
  info_ = model_executor_info(*model_, std::move(model_name), cache_.shape(), cache_.num_blocks());
  for (int64_t layer : info_.moe_layers)
    for (int64_t e = 0; e < info_.routed_experts; ++e)
      seen_.push_back(model_->expert_counts()[layer][e]);
  no_text_ = ids_without_text(tokenizer, c.vocab_size);
  if (options.speculative_tokens > 0) {
    drafter_.emplace(*model_, options.speculative_tokens, no_text_);
    info_.speculative_tokens = options.speculative_tokens;
    // The MTP layer's cache travels with the main layers' in P/D: a decode engine's drafts then
    // see the whole prompt. Both legs must speculate (the layouts say so when they do not).
    info_.kv_layout.layers += 1;
    info_.kv_layout.model += " with its MTP layer";
  }
}

const std::byte* CpuExecutor::kv_bytes(int32_t block, int64_t layer) const {
  return cache_.block_layer(block, layer);
}

std::byte* CpuExecutor::kv_bytes_mutable(int32_t block, int64_t layer) {
  return kv_block_or_null(cache_, info_, block, layer);
}

void CpuExecutor::write_kv(int32_t block, int64_t layer, std::span<const std::byte> bytes) {
  write_kv_block(cache_, info_, block, layer, bytes);
}

ExecResult CpuExecutor::execute(std::span<const ExecItem> batch, const LayerHook& on_layer) {
  std::vector<model::SequenceStep> steps;
  steps.reserve(batch.size());
  std::vector<std::vector<int32_t>> with_drafts(batch.size());  // tokens, then drafts
  for (size_t i = 0; i < batch.size(); ++i) {
    const ExecItem& item = batch[i];
    if (!item.drafts.empty() && !item.sample)
      throw Error("execute: item " + std::to_string(i) + " has drafts but samples nothing");
    if (!item.drafts.empty() && !drafter_)
      throw Error("execute: item " + std::to_string(i) +
                  " has drafts and the executor does not speculate");
    std::span<const int32_t> tokens = item.tokens;
    if (!item.drafts.empty()) {
      with_drafts[i].assign(item.tokens.begin(), item.tokens.end());
      with_drafts[i].insert(with_drafts[i].end(), item.drafts.begin(), item.drafts.end());
      tokens = with_drafts[i];
    }
    steps.push_back({tokens, item.start, item.blocks, logit_rows(item)});
  }
  auto out = model_->forward(steps, cache_, on_layer);
  const int64_t vocab = info_.vocab_size;
  ExecResult result;
  routes_this_step(model_->expert_counts(), info_, seen_, result.expert_tokens);
  auto row_of = [&](size_t i, size_t row) {
    return out.logits.data() + (out.first_row[i] + static_cast<int64_t>(row)) * vocab;
  };
  score_prompts(batch, row_of, vocab, no_text_, result.sampled);
  sample_items(batch, row_of, vocab, no_text_, result.sampled);
  if (drafter_) drafter_->run(batch, out, cache_, result.sampled);
  return result;
}

}  // namespace tandem::engine
