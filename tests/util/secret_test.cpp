// Secrets: HMAC-SHA256 against the test vectors of RFC 4231 (recorded external data), the
// comparison's answers, the generator's output shape, and random ids that cannot be predicted.
#include "util/secret.h"

#include <functional>
#include <random>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "util/random_id.h"

#include <gtest/gtest.h>

namespace tandem {
namespace {

TEST(Secret, HmacSha256MatchesRfc4231) {
  // Test case 1: a 20-byte key of 0x0b.
  EXPECT_EQ(hmac_sha256_hex(std::string(20, '\x0b'), "Hi There"),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  // Test case 2: a key shorter than the output.
  EXPECT_EQ(hmac_sha256_hex("Jefe", "what do ya want for nothing?"),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  // Test case 6: a key longer than the hash's block (hashed first).
  EXPECT_EQ(hmac_sha256_hex(std::string(131, '\xaa'),
                            "Test Using Larger Than Block-Size Key - Hash Key First"),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}

TEST(Secret, EqualOnlyForTheSameBytes) {
  EXPECT_TRUE(secrets_equal("", ""));
  EXPECT_TRUE(secrets_equal("sk-abc", "sk-abc"));
  EXPECT_FALSE(secrets_equal("sk-abc", "sk-abd"));
  EXPECT_FALSE(secrets_equal("sk-abc", "sk-ab"));
  EXPECT_FALSE(secrets_equal("sk-abc", "sk-abc "));
  EXPECT_FALSE(secrets_equal("", "x"));
  EXPECT_TRUE(secrets_equal(std::string("a\0b", 3), std::string("a\0b", 3)));
  EXPECT_FALSE(secrets_equal(std::string("a\0b", 3), std::string("a\0c", 3)));
}

TEST(Secret, RandomSecretsAreHexOfTheAskedLengthAndDiffer) {
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    const std::string s = random_secret_hex(16);
    ASSERT_EQ(s.size(), 32u);
    EXPECT_EQ(s.find_first_not_of("0123456789abcdef"), std::string::npos) << s;
    seen.insert(s);
  }
  EXPECT_EQ(seen.size(), 100u);
  EXPECT_EQ(random_secret_hex().size(), 64u);
}

// Undoes std::mt19937_64's tempering of one output, giving the state word behind it.
uint64_t untemper(uint64_t y) {
  auto undo_right = [](uint64_t v, int shift, uint64_t mask) {
    uint64_t x = v;
    for (int i = 0; i < 64; ++i) x = v ^ ((x >> shift) & mask);
    return x;
  };
  auto undo_left = [](uint64_t v, int shift, uint64_t mask) {
    uint64_t x = v;
    for (int i = 0; i < 64; ++i) x = v ^ ((x << shift) & mask);
    return x;
  };
  y = undo_right(y, 43, ~uint64_t{0});
  y = undo_left(y, 37, 0xFFF7EEE000000000ULL);
  y = undo_left(y, 17, 0x71D67FFFEDA60000ULL);
  return undo_right(y, 29, 0x5555555555555555ULL);
}

// Predicts the next output of `draw` from its last 312, as anyone who saw that many ids could if
// they came from a Mersenne Twister: the state words, loaded through the engine's text form.
bool next_is_predictable(const std::function<uint64_t()>& draw) {
  std::ostringstream state;
  for (size_t i = 0; i < std::mt19937_64::state_size; ++i) state << untemper(draw()) << ' ';
  std::mt19937_64 clone;
  std::istringstream in(state.str());
  in >> clone;
  for (int i = 0; i < 8; ++i)
    if (clone() != draw()) return false;
  return true;
}

TEST(RandomIds, AreNotPredictableFromThoseSeenBefore) {
  std::mt19937_64 twister(12345);
  ASSERT_TRUE(next_is_predictable([&] { return twister(); }));  // the predictor works
  uint64_t predicted = 0;
  // On a thread of its own: this one may be seeded by another test.
  std::thread([&] { predicted = next_is_predictable(random_u64); }).join();
  EXPECT_FALSE(predicted);
}

TEST(RandomIds, ASeededThreadRepeatsItsIdsAndOthersStayUnpredictable) {
  std::vector<std::string> first, second;
  std::thread([&] {
    seed_random_ids(7);
    for (int i = 0; i < 3; ++i) first.push_back(random_hex(2));
    seed_random_ids(7);
    for (int i = 0; i < 3; ++i) second.push_back(random_hex(2));
  }).join();
  EXPECT_EQ(first, second);
  EXPECT_EQ(first[0].size(), 32u);
  std::string elsewhere;
  std::thread([&] { elsewhere = random_hex(2); }).join();
  EXPECT_NE(elsewhere, first[0]);
}

}  // namespace
}  // namespace tandem
