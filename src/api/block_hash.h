#pragma once
// The project's one block hash, used by the engine's prefix cache, its KV-cache events and the
// gateway's prefix-aware routing. It is chained over token ids, so a block's hash names the whole
// prefix up to and including that block.
//
// Exact definition (reproducible from any language with an XXH3-64 implementation):
//
//   hash(block i) = XXH3_64bits_withSeed(input_i, kBlockHashSeed)
//   input_i       = LE64(parent_i) ++ LE32(t_0) ++ ... ++ LE32(t_{n-1}) [++ LE64(salt) if i == 0]
//   parent_0      = kBlockHashRoot;  parent_i = hash(block i-1) for i > 0
//
// where LE64/LE32 write an unsigned 64/32-bit integer as little-endian bytes, t_j are the
// block's token ids as two's-complement 32-bit integers (ids are never negative in practice), n
// is the number of tokens in the block, and the optional 64-bit salt (vLLM's cache_salt, for
// tenant isolation, cache_salt_hash of its string) is appended to the first block's input only.
// Only full blocks are hashed.
//
// Example: block_size 2, tokens [1, 2, 3, 4] without salt:
//   h0 = XXH3_64(seed, 00..00 (8 zero bytes, the root) 01000000 02000000)
//   h1 = XXH3_64(seed, LE64(h0) 03000000 04000000)
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

namespace tandem::api {

// "TandemKV" in ASCII, read as a big-endian integer.
inline constexpr uint64_t kBlockHashSeed = 0x54616e64656d4b56ULL;
// The parent value of a sequence's first block.
inline constexpr uint64_t kBlockHashRoot = 0;

// The 64-bit salt of a request's cache_salt string: XXH3_64bits of its UTF-8 bytes, seed 0. The
// engine salts its cache with it and the gateway its prefix matching, so both must get it here.
uint64_t cache_salt_hash(std::string_view cache_salt);

// Hash of one block. `parent` is the previous block's hash, or nullopt for a sequence's first
// block (which then uses kBlockHashRoot and appends `salt` if one is given). A salt with a parent
// is a caller error (the salt belongs to the first block only) and throws tandem::Error.
uint64_t block_hash(std::optional<uint64_t> parent, std::span<const int32_t> block_tokens,
                    std::optional<uint64_t> salt = std::nullopt);

// Hashes of every full block of `tokens` (tokens.size() / block_size of them); a trailing
// partial block is not hashed. Throws tandem::Error when block_size < 1.
std::vector<uint64_t> block_hashes(std::span<const int32_t> tokens, int64_t block_size,
                                   std::optional<uint64_t> salt = std::nullopt);

// Extends `hashes`, the hashes of the first hashes.size() full blocks of `tokens`, with the hashes
// of the remaining full blocks. Lets a caller hash a growing sequence once per block.
void extend_block_hashes(std::vector<uint64_t>& hashes, std::span<const int32_t> tokens,
                         int64_t block_size, std::optional<uint64_t> salt = std::nullopt);

}  // namespace tandem::api
