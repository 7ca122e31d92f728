#pragma once
// Starts `tandem engine ... --port 0` as a child process for a test, reads the port from its
// first line of output, and stops it (SIGTERM, then SIGKILL) when destroyed.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

namespace tandem::testing {

class EngineProcess {
 public:
  explicit EngineProcess(std::vector<std::string> args) {
    int fds[2];
    if (pipe(fds) != 0) throw std::runtime_error("pipe failed");
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], STDOUT_FILENO);
      close(fds[0]);
      close(fds[1]);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(fds[1]);
    out_ = fdopen(fds[0], "r");
    char line[4096];
    while (std::fgets(line, sizeof line, out_)) {
      std::string l = line;
      output_ += l;
      const auto at = l.find("listening on http://");
      if (at != std::string::npos) {
        const auto colon = l.find(':', at + 20);
        port_ = static_cast<uint16_t>(std::stoi(l.substr(colon + 1)));
        // Later lines (KV event endpoints) are read on demand.
        return;
      }
    }
    throw std::runtime_error("engine did not start; output: " + output_);
  }
  ~EngineProcess() { stop(); }

  uint16_t port() const { return port_; }
  // The next line the engine printed (empty at end of output).
  std::string next_line() {
    char line[4096];
    if (!std::fgets(line, sizeof line, out_)) return {};
    return line;
  }
  // Kills the engine at once (SIGKILL), as a crashed node.
  void kill_now() {
    if (pid_ > 0) kill(pid_, SIGKILL);
    stop();
  }
  // Sends SIGTERM and returns the exit status.
  int stop() {
    if (pid_ <= 0) return status_;
    kill(pid_, SIGTERM);
    int st = 0;
    waitpid(pid_, &st, 0);
    pid_ = -1;
    if (out_) fclose(out_);
    out_ = nullptr;
    status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    return status_;
  }

 private:
  pid_t pid_ = -1;
  FILE* out_ = nullptr;
  uint16_t port_ = 0;
  int status_ = -1;
  std::string output_;
};

}  // namespace tandem::testing
