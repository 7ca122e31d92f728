// The block hash against its documented definition: recomputed by an independent Python program
// (tests/oracle/kv_events_subscriber.py, whose XXH3-64 is itself checked against libxxhash here),
// plus its properties and a golden value built byte by byte.
#include "api/block_hash.h"

#include <xxhash.h>

#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "text/oracle_support.h"
#include "util/error.h"
#include "util/hash.h"

namespace tandem::api {
namespace {

const std::string kPython = "/usr/bin/python3";

std::string oracle_script() {
  return test::quote(test::oracle_dir() / "kv_events_subscriber.py");
}

// Runs the oracle subcommand with `input` on stdin; returns its stdout lines.
std::vector<std::string> run_oracle(const std::string& subcommand, const std::string& input) {
  const auto in = test::temp_path("block-hash-in");
  const auto out = test::temp_path("block-hash-out");
  std::ofstream(in) << input;
  const int rc = test::run_command(kPython + " " + oracle_script() + " " + subcommand + " < " +
                                   test::quote(in) + " > " + test::quote(out));
  std::vector<std::string> lines;
  std::ifstream file(out);
  for (std::string line; std::getline(file, line);) lines.push_back(line);
  std::filesystem::remove(in);
  std::filesystem::remove(out);
  EXPECT_EQ(rc, 0) << "oracle " << subcommand << " failed";
  return lines;
}

std::string hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

// The oracle's pure-Python XXH3-64 agrees with libxxhash on every input-length path (0, 1-3,
// 4-8, 9-16, 17-128, 129-240, long with several stripes and blocks), seeded and unseeded, so the
// block-hash comparison below really compares against an independent implementation.
TEST(BlockHashTest, OracleXxh3MatchesLibxxhash) {
  std::mt19937_64 rng(7);
  std::ostringstream input;
  std::vector<uint64_t> expected;
  std::vector<size_t> lengths;
  for (size_t n = 0; n <= 260; ++n) lengths.push_back(n);
  for (size_t n : {511, 512, 513, 1023, 1024, 1025, 1088, 2047, 2049, 3000}) lengths.push_back(n);
  for (const size_t n : lengths) {
    std::string bytes(n, '\0');
    for (char& c : bytes) c = static_cast<char>(rng());
    const uint64_t seed = n % 3 == 0 ? 0 : rng();
    input << seed << " " << hex(bytes) << "\n";
    expected.push_back(hash_bytes(bytes, seed));
  }
  const auto lines = run_oracle("xxh3", input.str());
  ASSERT_EQ(lines.size(), expected.size());
  for (size_t i = 0; i < lines.size(); ++i) {
    EXPECT_EQ(lines[i], std::to_string(expected[i])) << "input length " << lengths[i];
  }
}

TEST(BlockHashTest, MatchesIndependentPythonDefinition) {
  std::mt19937_64 rng(11);
  struct Case {
    int64_t block_size;
    std::optional<uint64_t> salt;
    std::vector<int32_t> tokens;
  };
  std::vector<Case> cases;
  // Block sizes cover every XXH3 input-length path: 8 + 4 * block_size (+ 8 with a salt) bytes.
  for (const int64_t bs : {1, 2, 3, 7, 16, 29, 32, 58, 64, 128}) {
    for (int salted = 0; salted < 2; ++salted) {
      Case c{bs, salted ? std::optional<uint64_t>(rng()) : std::nullopt, {}};
      const size_t n = static_cast<size_t>(bs) * (1 + rng() % 6) + rng() % static_cast<size_t>(bs);
      for (size_t i = 0; i < n; ++i) c.tokens.push_back(static_cast<int32_t>(rng() % 129280));
      cases.push_back(std::move(c));
    }
  }
  cases.push_back({4, std::nullopt, {0, 2147483647, 1, 2}});  // extreme ids
  std::ostringstream input;
  for (const Case& c : cases) {
    input << c.block_size << " " << (c.salt ? std::to_string(*c.salt) : "-");
    for (const int32_t t : c.tokens) input << " " << t;
    input << "\n";
  }
  const auto lines = run_oracle("blockhash", input.str());
  ASSERT_EQ(lines.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto hashes = block_hashes(cases[i].tokens, cases[i].block_size, cases[i].salt);
    EXPECT_EQ(hashes.size(), cases[i].tokens.size() / static_cast<size_t>(cases[i].block_size));
    std::string joined;
    for (const uint64_t h : hashes) {
      if (!joined.empty()) joined += ' ';
      joined += std::to_string(h);
    }
    EXPECT_EQ(lines[i], joined) << "case " << i << " block_size " << cases[i].block_size;
  }
}

// The header's worked example, with the input bytes written out by hand and hashed by libxxhash.
TEST(BlockHashTest, GoldenBytes) {
  const unsigned char first[16] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0};
  const uint64_t h0 = XXH3_64bits_withSeed(first, sizeof(first), 0x54616e64656d4b56ULL);
  unsigned char second[16] = {0, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0};
  for (int i = 0; i < 8; ++i) second[i] = static_cast<unsigned char>(h0 >> (8 * i));
  const uint64_t h1 = XXH3_64bits_withSeed(second, sizeof(second), 0x54616e64656d4b56ULL);
  const std::vector<int32_t> tokens = {1, 2, 3, 4, 5};
  EXPECT_EQ(block_hashes(tokens, 2), (std::vector<uint64_t>{h0, h1}));

  unsigned char salted[24] = {0, 0, 0, 0, 0,    0,    0,    0,    1,    0,    0,    0,
                              2, 0, 0, 0, 0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01};
  EXPECT_EQ(block_hashes(tokens, 2, 0x0102030405060708ULL)[0],
            XXH3_64bits_withSeed(salted, sizeof(salted), 0x54616e64656d4b56ULL));
}

// A cache_salt string becomes the salt as the header defines it, in the engine and the gateway.
TEST(BlockHashTest, ACacheSaltIsTheXxh3OfItsBytes) {
  EXPECT_EQ(cache_salt_hash("tenant-a"), XXH3_64bits_withSeed("tenant-a", 8, 0));
  EXPECT_NE(cache_salt_hash("tenant-a"), cache_salt_hash("tenant-b"));
}

TEST(BlockHashTest, ChainingAndSensitivity) {
  std::vector<int32_t> tokens(64);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(1000 + i);
  const auto base = block_hashes(tokens, 16);
  ASSERT_EQ(base.size(), 4u);
  EXPECT_EQ(base, block_hashes(tokens, 16));  // deterministic
  for (size_t i = 1; i < base.size(); ++i) {
    EXPECT_EQ(base[i], block_hash(base[i - 1], std::span(tokens).subspan(i * 16, 16)));
  }
  // Changing any token changes its block's hash and every later one, never an earlier one.
  for (size_t pos = 0; pos < tokens.size(); ++pos) {
    auto changed = tokens;
    changed[pos] += 1;
    const auto h = block_hashes(changed, 16);
    for (size_t b = 0; b < base.size(); ++b) {
      if (b < pos / 16) {
        EXPECT_EQ(h[b], base[b]) << "pos " << pos << " block " << b;
      } else {
        EXPECT_NE(h[b], base[b]) << "pos " << pos << " block " << b;
      }
    }
  }
  // Order matters, within a block and between blocks.
  auto swapped = tokens;
  std::swap(swapped[3], swapped[4]);
  EXPECT_NE(block_hashes(swapped, 16)[0], base[0]);
  std::vector<int32_t> reordered(tokens.begin() + 16, tokens.begin() + 32);
  reordered.insert(reordered.end(), tokens.begin(), tokens.begin() + 16);
  EXPECT_NE(block_hashes(reordered, 16)[1], base[1]);
  // The same block content after a different prefix hashes differently.
  EXPECT_NE(block_hashes(std::span(tokens).subspan(16), 16)[0], base[1]);
  // A trailing partial block is not hashed, and a prefix's hashes are a prefix of the hashes.
  EXPECT_EQ(block_hashes(std::span(tokens).first(63), 16).size(), 3u);
  EXPECT_EQ(block_hashes(std::span(tokens).first(40), 16),
            std::vector<uint64_t>(base.begin(), base.begin() + 2));
  // Incremental extension equals hashing at once.
  std::vector<uint64_t> grown;
  for (size_t n = 0; n <= tokens.size(); n += 5) {
    extend_block_hashes(grown, std::span(tokens).first(n), 16);
  }
  extend_block_hashes(grown, tokens, 16);
  EXPECT_EQ(grown, base);
  // A salt changes the whole chain; different salts differ; no salt differs from salt 0.
  const auto salted = block_hashes(tokens, 16, 42);
  for (size_t b = 0; b < base.size(); ++b) EXPECT_NE(salted[b], base[b]);
  EXPECT_NE(block_hashes(tokens, 16, 43)[0], salted[0]);
  EXPECT_NE(block_hashes(tokens, 16, 0)[0], base[0]);
  EXPECT_EQ(salted[1], block_hash(salted[0], std::span(tokens).subspan(16, 16)));
}

TEST(BlockHashTest, RejectsMisuse) {
  const std::vector<int32_t> tokens = {1, 2, 3, 4};
  EXPECT_THROW(block_hashes(tokens, 0), Error);
  EXPECT_THROW(block_hash(uint64_t{5}, tokens, uint64_t{1}), Error);
  std::vector<uint64_t> too_many = {1, 2, 3};
  EXPECT_THROW(extend_block_hashes(too_many, tokens, 2), Error);
  // Blocks larger than the on-stack buffer take the heap path and still chain correctly.
  std::vector<int32_t> big(600, 7);
  const auto h = block_hashes(big, 300);
  EXPECT_EQ(h[1], block_hash(h[0], std::span(big).subspan(300, 300)));
}

}  // namespace
}  // namespace tandem::api
