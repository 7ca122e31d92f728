#include "util/secret.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <openssl/sha.h>

#include <vector>

#include "util/error.h"

namespace tandem {
namespace {

std::string hex(const unsigned char* data, size_t n) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    out[2 * i] = kDigits[data[i] >> 4];
    out[2 * i + 1] = kDigits[data[i] & 15];
  }
  return out;
}

}  // namespace

std::string random_secret_hex(int bytes) {
  std::vector<unsigned char> raw(static_cast<size_t>(bytes));
  if (RAND_bytes(raw.data(), bytes) != 1)
    throw Error("the system's random generator failed (OpenSSL RAND_bytes)");
  return hex(raw.data(), raw.size());
}

std::string hmac_sha256_hex(std::string_view key, std::string_view message) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (!HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
            reinterpret_cast<const unsigned char*>(message.data()), message.size(), digest,
            &length))
    throw Error("HMAC-SHA256 failed (OpenSSL)");
  return hex(digest, length);
}

bool secrets_equal(std::string_view a, std::string_view b) {
  unsigned char da[SHA256_DIGEST_LENGTH], db[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(a.data()), a.size(), da);
  SHA256(reinterpret_cast<const unsigned char*>(b.data()), b.size(), db);
  return CRYPTO_memcmp(da, db, sizeof da) == 0;
}

}  // namespace tandem
