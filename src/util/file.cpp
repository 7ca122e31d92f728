#include "util/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "util/error.h"

namespace tandem {

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("cannot read " + path.string() + ": " + std::strerror(errno));
  std::ostringstream out;
  out << in.rdbuf();
  if (in.bad()) throw Error("error while reading " + path.string());
  return std::move(out).str();
}

namespace {

const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "something else";
}

}  // namespace

RegularFile::RegularFile(const std::filesystem::path& path) {
  // O_NONBLOCK: opening a FIFO for reading otherwise waits for a writer.
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd_ < 0) throw Error(path.string() + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    const int err = errno;
    ::close(fd_);
    throw Error(path.string() + ": cannot stat: " + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    throw Error(path.string() + ": not a regular file (it is " + kind_of(st.st_mode) + ")");
  }
  // Reads of a regular file ignore O_NONBLOCK on Linux, but not every file system promises it.
  const int flags = ::fcntl(fd_, F_GETFL);
  if (flags >= 0) ::fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK);
  size_ = static_cast<uint64_t>(st.st_size);
}

RegularFile::~RegularFile() {
  ::close(fd_);
}

std::string read_regular_file(const std::filesystem::path& path, uint64_t max_bytes) {
  const RegularFile file(path);
  if (file.size() > max_bytes)
    throw Error(path.string() + ": is " + std::to_string(file.size()) +
                " bytes, above the limit of " + std::to_string(max_bytes));
  std::string out;
  out.reserve(static_cast<size_t>(file.size()));
  char buffer[1 << 16];
  // Up to end of file rather than the size fstat gave: a file may grow or shrink meanwhile, and
  // some (those of /proc) report a size of 0.
  for (;;) {
    const ssize_t n = ::read(file.fd(), buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw Error(path.string() + ": cannot read: " + std::strerror(errno));
    if (n == 0) return out;
    if (out.size() + static_cast<size_t>(n) > max_bytes)
      throw Error(path.string() + ": grew past the limit of " + std::to_string(max_bytes) +
                  " bytes while being read");
    out.append(buffer, static_cast<size_t>(n));
  }
}

namespace {

// 0, or the errno of the write that failed.
int write_all(int fd, std::string_view bytes) {
  while (!bytes.empty()) {
    const ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    bytes.remove_prefix(static_cast<size_t>(n));
  }
  return 0;
}

}  // namespace

int create_temporary_beside(const std::filesystem::path& path, std::filesystem::path* tmp) {
  static std::atomic<uint64_t> counter{0};
  for (int attempt = 0;; ++attempt) {
    *tmp = path;
    *tmp += ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
    const int fd = ::open(tmp->c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0) return fd;
    if (errno != EEXIST || attempt == 100) {
      // Errors name the file asked for: the temporary one's name is of no use to the user.
      const int err = errno;
      throw Error("cannot write " + path.string() + ": " + std::strerror(err));
    }
  }
}

void write_file_atomically(const std::filesystem::path& path, std::string_view bytes) {
  std::filesystem::path tmp;
  const int fd = create_temporary_beside(path, &tmp);
  int err = write_all(fd, bytes);
  // A file replaced keeps its permissions (the new one would otherwise get the umask's).
  struct stat st {};
  if (!err && ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode))
    ::fchmod(fd, st.st_mode & 07777);
  // Checked at close too: some file systems (NFS) report a failed write only then.
  if (::close(fd) != 0 && !err) err = errno;
  if (err) {
    ::unlink(tmp.c_str());
    throw Error("cannot write " + path.string() + ": " + std::strerror(err));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    err = errno;
    ::unlink(tmp.c_str());
    throw Error(path.string() + ": cannot rename from " + tmp.string() + ": " + std::strerror(err));
  }
}

}  // namespace tandem
