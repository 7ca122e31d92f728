#include "api/block_hash.h"

#include <bit>
#include <cstring>
#include <string>

#include "util/error.h"
#include "util/hash.h"

namespace tandem::api {
namespace {

void put_le64(unsigned char* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<unsigned char>(v >> (8 * i));
}

void put_tokens_le32(unsigned char* out, std::span<const int32_t> tokens) {
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(out, tokens.data(), tokens.size() * 4);
  } else {
    for (size_t j = 0; j < tokens.size(); ++j) {
      const auto v = static_cast<uint32_t>(tokens[j]);
      for (int i = 0; i < 4; ++i) out[4 * j + i] = static_cast<unsigned char>(v >> (8 * i));
    }
  }
}

}  // namespace

uint64_t cache_salt_hash(std::string_view cache_salt) {
  return hash_bytes(cache_salt);
}

uint64_t block_hash(std::optional<uint64_t> parent, std::span<const int32_t> block_tokens,
                    std::optional<uint64_t> salt) {
  if (parent && salt) {
    throw Error(
        "block_hash: a cache salt belongs to a sequence's first block, which has no parent");
  }
  const size_t size = 8 + 4 * block_tokens.size() + (salt ? 8 : 0);
  // Blocks are small (16-64 tokens); keep the common case off the heap.
  unsigned char stack[8 + 4 * 256 + 8];
  std::string heap;
  unsigned char* buf = stack;
  if (size > sizeof(stack)) {
    heap.resize(size);
    buf = reinterpret_cast<unsigned char*>(heap.data());
  }
  put_le64(buf, parent.value_or(kBlockHashRoot));
  put_tokens_le32(buf + 8, block_tokens);
  if (salt) put_le64(buf + 8 + 4 * block_tokens.size(), *salt);
  return hash_bytes(std::string_view(reinterpret_cast<const char*>(buf), size), kBlockHashSeed);
}

void extend_block_hashes(std::vector<uint64_t>& hashes, std::span<const int32_t> tokens,
                         int64_t block_size, std::optional<uint64_t> salt) {
  if (block_size < 1) {
    throw Error("block_hashes: block_size must be at least 1, got " + std::to_string(block_size));
  }
  const size_t bs = static_cast<size_t>(block_size);
  const size_t full = tokens.size() / bs;
  if (hashes.size() > full) {
    throw Error("extend_block_hashes: " + std::to_string(hashes.size()) +
                " hashes given for a sequence of only " + std::to_string(full) + " full blocks");
  }
  hashes.reserve(full);
  for (size_t i = hashes.size(); i < full; ++i) {
    const auto block = tokens.subspan(i * bs, bs);
    hashes.push_back(i == 0 ? block_hash(std::nullopt, block, salt)
                            : block_hash(hashes[i - 1], block));
  }
}

std::vector<uint64_t> block_hashes(std::span<const int32_t> tokens, int64_t block_size,
                                   std::optional<uint64_t> salt) {
  std::vector<uint64_t> hashes;
  extend_block_hashes(hashes, tokens, block_size, salt);
  return hashes;
}

}  // namespace tandem::api
