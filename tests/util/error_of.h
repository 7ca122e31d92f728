#pragma once
// The message of the tandem::Error a piece of test code throws (a test failure when it throws
// none), for tests that check what an error says.
#include <functional>
#include <string>

#include <gtest/gtest.h>

#include "util/error.h"

namespace tandem::testing {

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no tandem::Error thrown";
  return {};
}

}  // namespace tandem::testing
