#include "api/api_key.h"

#include <gtest/gtest.h>

#include "util/error.h"

namespace tandem::api {
namespace {

net::HttpRequest with_authorization(const std::string& value) {
  net::HttpRequest req;
  if (!value.empty()) req.headers.set("Authorization", value);
  return req;
}

TEST(ApiKey, ARequestCarryingOneOfTheKeysIsLetIn) {
  const std::vector<std::string> keys = {"k1", "k2"};
  EXPECT_TRUE(api_key_valid(keys, with_authorization("Bearer k2")));
  EXPECT_TRUE(api_key_valid(keys, with_authorization("bearer k1")));
  EXPECT_FALSE(api_key_valid(keys, with_authorization("Bearer k3")));
  EXPECT_FALSE(api_key_valid(keys, with_authorization("Basic k1")));
  EXPECT_TRUE(api_key_valid({}, with_authorization("")));  // no keys: an open server
}

TEST(ApiKey, AnEmptyKeyInTheListLetsNoRequestInWithoutAKey) {
  const std::vector<std::string> keys = {"", "k1"};
  EXPECT_FALSE(api_key_valid(keys, with_authorization("")));
  EXPECT_FALSE(api_key_valid(keys, with_authorization("Bearer ")));
  EXPECT_FALSE(api_key_valid(keys, with_authorization("Bearer")));
  EXPECT_TRUE(api_key_valid(keys, with_authorization("Bearer k1")));
}

TEST(ApiKey, AnEmptyKeyIsRefusedNamingTheOption) {
  EXPECT_NO_THROW(check_api_keys(std::vector<std::string>{"k1"}, "--api-key"));
  try {
    check_api_keys(std::vector<std::string>{"k1", ""}, "--api-key");
    FAIL() << "an empty key was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--api-key: an API key is empty"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace tandem::api
