#pragma once
// What the kernel says of a process or thread in /proc/.../stat: how tests see that a thread
// blocks or a process ended, without guessing a time.
#include <fcntl.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <string>

namespace tandem::testing {

struct ProcStat {
  int error = 0;   // errno of reading the file (EINVAL: it did not parse); 0 when read
  char state = 0;  // R running, S sleeping, D in uninterruptible wait, Z zombie, X dead, ...
  pid_t parent = 0;
};

// `path` ("/proc/PID/stat" or "/proc/self/task/TID/stat") read and parsed: "PID (NAME) STATE PPID
// ...", where NAME may hold spaces and parentheses, so the fields start after the last ')'.
inline ProcStat read_proc_stat(const std::string& path) {
  ProcStat out;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    out.error = errno;
    return out;
  }
  char buffer[4096];  // a stat line is some 300 bytes (NAME is at most 15)
  const ssize_t n = ::read(fd, buffer, sizeof buffer - 1);
  out.error = n < 0 ? errno : 0;
  ::close(fd);
  if (n < 0) return out;
  const std::string line(buffer, static_cast<size_t>(n));
  const size_t name_end = line.rfind(')');
  // ") S 123": the state two bytes past the ')' and the parent's pid after it.
  if (name_end == std::string::npos || name_end + 4 >= line.size()) {
    out.error = EINVAL;
    return out;
  }
  out.state = line[name_end + 2];
  out.parent = static_cast<pid_t>(std::stol(line.substr(name_end + 4)));
  return out;
}

}  // namespace tandem::testing
