#pragma once
// Secrets shared by the processes of one deployment (the KV transfer port's key) and comparisons
// that must not leak a secret through their timing. OpenSSL's libcrypto underneath.
#include <string>
#include <string_view>

namespace tandem {

// `bytes` bytes from the operating system's cryptographic generator, as lowercase hex.
std::string random_secret_hex(int bytes = 32);

// HMAC-SHA256 (RFC 2104) of `message` under `key`, as 64 lowercase hex digits.
std::string hmac_sha256_hex(std::string_view key, std::string_view message);

// a == b in a time that depends on neither one's bytes nor on where they first differ (both are
// hashed, and the digests compared in constant time).
bool secrets_equal(std::string_view a, std::string_view b);

}  // namespace tandem
