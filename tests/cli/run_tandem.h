#pragma once
// Runs the tandem binary (TANDEM_BINARY, set by tests/CMakeLists.txt) for the CLI tests.

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace tandem::test {

struct Result {
  int status;
  std::string output;  // stdout and stderr together
};

// A shell command line, its stderr with its stdout.
inline Result run_shell(const std::string& command) {
  const std::string cmd = command + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  Result r{-1, ""};
  std::array<char, 4096> buf;
  for (size_t n; (n = fread(buf.data(), 1, buf.size(), p)) > 0;) r.output.append(buf.data(), n);
  const int rc = pclose(p);
  r.status = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  return r;
}

// `tandem args` through the shell; `env` (NAME=value ...) goes before it.
inline Result run(const std::string& args, const std::string& env = {}) {
  return run_shell((env.empty() ? "" : "env " + env + " ") + std::string(TANDEM_BINARY) + " " +
                   args);
}

}  // namespace tandem::test
