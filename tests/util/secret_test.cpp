// Secrets: HMAC-SHA256 against the test vectors of RFC 4231 (recorded external data), the
// comparison's answers, and the generator's output shape.
#include "util/secret.h"

#include <set>

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

}  // namespace
}  // namespace tandem
