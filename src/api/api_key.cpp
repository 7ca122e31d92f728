#include "api/api_key.h"

#include "util/error.h"
#include "util/secret.h"

namespace tandem::api {

std::string bearer_token(const net::HttpRequest& req) {
  const std::string auth = req.headers.get("Authorization");
  if (auth.size() > 7 && net::iequals(std::string_view(auth).substr(0, 7), "Bearer "))
    return auth.substr(7);
  return {};
}

bool api_key_valid(std::span<const std::string> keys, const net::HttpRequest& req) {
  if (keys.empty()) return true;
  const std::string key = bearer_token(req);
  if (key.empty()) return false;
  bool valid = false;
  for (const std::string& k : keys) valid |= secrets_equal(key, k);
  return valid;
}

void check_api_keys(std::span<const std::string> keys, const std::string& option) {
  for (const std::string& k : keys)
    if (k.empty())
      throw Error(option + ": an API key is empty (an unset variable?); give the key, or no " +
                  option + " for an open server");
}

}  // namespace tandem::api
