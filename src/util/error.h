#pragma once
// The one exception type Tandem throws for bad input and unsupported features. Messages name
// the file, field or construct at fault and what was expected, so they can go to users verbatim.
#include <stdexcept>
#include <string>

namespace tandem {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

}  // namespace tandem
