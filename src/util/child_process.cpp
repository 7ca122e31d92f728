#include "util/child_process.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "util/error.h"

namespace tandem {

ChildProcess::ChildProcess(const std::string& program, const std::vector<std::string>& argv,
                           const std::function<void()>& in_child) {
  // Built before fork: the child only calls what is safe after forking a threaded process.
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  int fds[2];
  if (pipe(fds) != 0) throw Error("cannot create a pipe for " + program);
  pid_ = fork();
  if (pid_ < 0) {
    close(fds[0]);
    close(fds[1]);
    throw Error("cannot start " + program);
  }
  if (pid_ == 0) {
    if (in_child) in_child();
    dup2(fds[1], STDOUT_FILENO);
    close(fds[0]);
    close(fds[1]);
    execv(program.c_str(), args.data());
    _exit(127);
  }
  close(fds[1]);
  out_ = fdopen(fds[0], "r");
}

ChildProcess::~ChildProcess() {
  stop();
}

std::string ChildProcess::read_line() {
  char line[4096];
  if (!out_ || !std::fgets(line, sizeof line, out_)) return {};
  return line;
}

void ChildProcess::signal(int sig) {
  if (pid_ > 0) kill(pid_, sig);
}

namespace {
int exit_status(int st) {
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}
}  // namespace

std::optional<int> ChildProcess::exited() {
  if (pid_ <= 0) return status_;
  int st = 0;
  if (waitpid(pid_, &st, WNOHANG) != pid_) return std::nullopt;
  pid_ = -1;
  if (out_) fclose(out_);
  out_ = nullptr;
  status_ = exit_status(st);
  return status_;
}

int ChildProcess::stop() {
  if (pid_ <= 0) return status_;
  kill(pid_, SIGTERM);
  int st = 0;
  waitpid(pid_, &st, 0);
  pid_ = -1;
  if (out_) fclose(out_);
  out_ = nullptr;
  status_ = exit_status(st);
  return status_;
}

}  // namespace tandem
