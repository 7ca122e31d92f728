#pragma once
// CLI11's parse errors in tandem's words, one line, wherever a command line is parsed (main, and
// serve's check of its engines' command lines).
#include <string>
#include <string_view>

#include <CLI/CLI.hpp>

namespace tandem::cli {

// CLI11's words for a flag given twice ("--port: At Most 1 required but received 2") say which
// flag and that it is to be given once; other errors as CLI11 words them, which name the flag.
inline std::string cli11_error_text(const CLI::Error& e) {
  std::string what = e.what();
  static constexpr std::string_view kAtMostOnce = ": At Most 1 required but received ";
  if (const size_t at = what.find(kAtMostOnce); at != std::string::npos)
    what = what.substr(0, at) + ": given " + what.substr(at + kAtMostOnce.size()) +
           " times; it takes one value";
  return what;
}

}  // namespace tandem::cli
