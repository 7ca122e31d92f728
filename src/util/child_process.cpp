#include "util/child_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string_view>
#include <thread>
#include <utility>

#include "util/error.h"

namespace tandem {

ChildProcess::ChildProcess(const std::string& program, const std::vector<std::string>& argv,
                           const std::function<void()>& in_child) {
  // Built before fork: the child only calls what is safe after forking a threaded process.
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const std::string cannot = "cannot execute " + program + ": ";
  int fds[2];
  // Close-on-exec: children started later must not inherit this one's pipe (dup2 below gives the
  // child its own end without the flag).
  if (pipe2(fds, O_CLOEXEC) != 0) throw Error("cannot create a pipe for " + program);
  pid_ = fork();
  if (pid_ < 0) {
    close(fds[0]);
    close(fds[1]);
    throw Error("cannot start " + program);
  }
  if (pid_ == 0) {
    // Ignored signals stay ignored across exec: `tandem` ignores SIGPIPE for its own stdout, a
    // program it starts gets the default.
    ::signal(SIGPIPE, SIG_DFL);
    if (in_child) in_child();
    dup2(fds[1], STDOUT_FILENO);
    close(fds[0]);
    close(fds[1]);
    execv(program.c_str(), args.data());
    // Said here, as nobody else can: the parent sees only the status, 127 as a shell reports it.
    // strerrordesc_np reads a table, where strerror may allocate (not safe after fork).
    const int why = errno;
    const char* reason = strerrordesc_np(why);
    if (!reason) reason = "unknown error";
    const std::string_view parts[] = {cannot, reason, "\n"};
    for (const auto part : parts)
      if (::write(STDERR_FILENO, part.data(), part.size()) < 0) break;
    _exit(127);
  }
  close(fds[1]);
  out_ = fds[0];
}

ChildProcess::~ChildProcess() {
  stop();
}

std::string ChildProcess::read_line() {
  for (;;)
    if (auto line = poll_line(std::chrono::milliseconds(-1))) return *std::move(line);
}

std::optional<std::string> ChildProcess::poll_line(std::chrono::milliseconds wait) {
  for (bool first = true;; first = false) {
    if (const size_t nl = buffer_.find('\n'); nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl + 1);
      buffer_.erase(0, nl + 1);
      return line;
    }
    if (out_ < 0) return std::exchange(buffer_, {});  // a last line without its newline, or ""
    // Once something came, only what is there already: `wait` bounds the whole call.
    if (!fill(first ? wait : std::chrono::milliseconds(0))) return std::nullopt;
  }
}

bool ChildProcess::fill(std::chrono::milliseconds wait) {
  pollfd p{out_, POLLIN, 0};
  int ready = 0;
  while ((ready = ::poll(&p, 1, static_cast<int>(wait.count()))) < 0 && errno == EINTR) {
  }
  if (ready <= 0) return false;
  char chunk[4096];
  ssize_t n = 0;
  while ((n = ::read(out_, chunk, sizeof chunk)) < 0 && errno == EINTR) {
  }
  if (n <= 0) {
    close_output();  // the end of its output (or a pipe that cannot be read: the same to callers)
    return true;
  }
  buffer_.append(chunk, static_cast<size_t>(n));
  return true;
}

void ChildProcess::close_output() {
  if (out_ >= 0) close(out_);
  out_ = -1;
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
  close_output();
  buffer_.clear();
  status_ = exit_status(st);
  return status_;
}

int ChildProcess::stop(std::chrono::milliseconds grace) {
  if (pid_ > 0) kill(pid_, SIGTERM);
  return wait_or_kill(grace);
}

int ChildProcess::wait_or_kill(std::chrono::milliseconds grace) {
  if (pid_ <= 0) return status_;
  int st = 0;
  const auto until = std::chrono::steady_clock::now() + grace;
  pid_t got = 0;
  // Polled: a child that ends does so within milliseconds of the signal, and a parent that stops
  // its children is shutting down, where a 10 ms step costs nothing.
  while ((got = waitpid(pid_, &st, WNOHANG)) == 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (got == 0) {
    kill(pid_, SIGKILL);  // also ends a stopped child: SIGKILL needs no SIGCONT
    waitpid(pid_, &st, 0);
  }
  pid_ = -1;
  close_output();
  buffer_.clear();
  status_ = exit_status(st);
  return status_;
}

}  // namespace tandem
