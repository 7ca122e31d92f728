#include "gateway/access_log.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string_view>
#include <thread>
#include <vector>

#include "util/error.h"
#include "util/log_throttle.h"

namespace tandem::gateway {
namespace {

using Clock = std::chrono::steady_clock;

// Where the lines go, opened so that no write can block indefinitely on a reader: a regular file
// is written as it is (a disk does not wait for anyone); anything else gets a non-blocking
// descriptor of its own, or, for a socket, sends that do not wait.
struct Output {
  int fd = -1;
  bool owned = false;
  bool socket = false;
  // Others may write to it too (gateway replicas of one `serve` share its standard output, and
  // serve prints there): each line goes in a write of its own, which a pipe keeps whole (up to
  // PIPE_BUF bytes) however writers interleave. A regular file takes whole batches.
  bool line_writes = false;
};

Output open_output(const std::string& path) {
  Output out;
  if (path == "-") {
    out.fd = STDOUT_FILENO;
    struct stat st {};
    if (::fstat(out.fd, &st) != 0 || S_ISREG(st.st_mode)) return out;
    out.line_writes = true;
    if (S_ISSOCK(st.st_mode)) {
      out.socket = true;
      return out;
    }
    // O_NONBLOCK on standard output itself would change the description the shell or a
    // terminal shares with us; a fresh open of the same pipe or terminal has a description of
    // its own. Without /proc, standard output is written as it is (and may block).
    const int fd = ::open("/proc/self/fd/1", O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd >= 0) {
      out.fd = fd;
      out.owned = true;
    }
    return out;
  }
  // Opened without blocking: a blocking open of a FIFO waits for a reader, for ever if none
  // comes (and at start-up, with the stop signals blocked, nothing could end that wait). A FIFO
  // without a reader fails at once (ENXIO) and is said as such.
  out.fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NONBLOCK, 0644);
  if (out.fd < 0) {
    const int error = errno;
    if (error == ENXIO)
      throw Error("access log '" + path +
                  "': a FIFO (or socket) with no reader: start its reader before the gateway (" +
                  std::strerror(error) + ")");
    throw Error("access log '" + path + "': cannot open for append: " + std::strerror(error));
  }
  out.owned = true;
  struct stat st {};
  if (::fstat(out.fd, &st) == 0 && S_ISREG(st.st_mode)) {
    // A regular file is written as it is (O_NONBLOCK means nothing to a disk; cleared anyway).
    ::fcntl(out.fd, F_SETFL, ::fcntl(out.fd, F_GETFL) & ~O_NONBLOCK);
  } else {
    out.line_writes = true;  // the description is our own, and stays non-blocking
  }
  return out;
}

}  // namespace

struct AccessLog::Impl {
  std::string path;
  Output out;
  Limits limits;
  metrics::IntCounter* dropped_metric;
  std::atomic<uint64_t> dropped{0};
  int stop_fd = -1;  // eventfd: wakes a writer waiting for the output to take more
  LogThrottle drop_log{std::chrono::seconds(10)};
  LogThrottle write_log{std::chrono::seconds(10)};

  std::mutex mutex;
  std::condition_variable wake;
  std::string queue;                // serialized lines, under `mutex`
  std::vector<size_t> queue_lines;  // their lengths, under `mutex`
  size_t queued_bytes = 0;          // the queue and the batch being written, under `mutex`
  std::atomic<bool> stopping{false};
  Clock::time_point deadline;  // set before `stopping`
  bool gave_up = false;        // the writer hit the deadline (writer thread, read after join)
  std::thread writer;

  void count_dropped(uint64_t lines) {
    if (lines == 0) return;
    dropped.fetch_add(lines, std::memory_order_relaxed);
    if (dropped_metric) dropped_metric->inc(lines);
  }

  // Writes text[*done..] until it is all written (true), or the deadline passes, or a write
  // fails (false).
  bool write_all(std::string_view text, size_t* done) {
    while (*done < text.size()) {
      const char* data = text.data() + *done;
      const size_t size = text.size() - *done;
      const ssize_t n = out.socket ? ::send(out.fd, data, size, MSG_DONTWAIT | MSG_NOSIGNAL)
                                   : ::write(out.fd, data, size);
      if (n >= 0) {
        *done += static_cast<size_t>(n);
        continue;
      }
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        const int error = errno;
        if (auto held_back = write_log.admit(Clock::now()))
          std::fprintf(stderr, "tandem gateway: access log '%s': write failed: %s%s\n",
                       path.c_str(), std::strerror(error),
                       *held_back > 0 ? (" (and " + std::to_string(*held_back) +
                                         " more failures since the last line)")
                                            .c_str()
                                      : "");
        return false;
      }
      if (!wait_writable()) return false;
    }
    return true;
  }

  // Waits until the output takes more: without end until destruction begins, then until the
  // deadline. False once the deadline passed.
  bool wait_writable() {
    for (;;) {
      pollfd fds[2] = {{out.fd, POLLOUT, 0}, {stop_fd, POLLIN, 0}};
      int timeout = -1;
      nfds_t count = 2;
      if (stopping.load()) {
        const auto left =
            std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
        if (left <= 0) {
          gave_up = true;
          return false;
        }
        timeout = static_cast<int>(left);
        count = 1;  // the stop event stays readable: polling it again would spin
      }
      const int ready = ::poll(fds, count, timeout);
      if (ready < 0 && errno != EINTR) return true;  // let the write say what is wrong
      if (ready > 0 && fds[0].revents != 0) return true;
      // Woken by the stop event or a timeout: look at the deadline again.
    }
  }

  void run() {
    std::string batch;
    std::vector<size_t> lines;
    for (;;) {
      {
        std::unique_lock lock(mutex);
        wake.wait(lock, [this] { return stopping.load() || !queue.empty(); });
        if (queue.empty()) return;  // stopping, and everything is written
        batch.swap(queue);
        lines.swap(queue_lines);
      }
      size_t done = 0;
      bool whole = true;
      if (out.line_writes) {
        for (size_t length : lines) {
          size_t line_done = 0;
          whole = write_all(std::string_view(batch).substr(done, length), &line_done);
          done += line_done;
          if (!whole) break;
        }
      } else {
        whole = write_all(batch, &done);
      }
      if (!whole) {
        // The lines not wholly written are lost (a line cut short at the deadline stays cut).
        size_t end = 0;
        uint64_t lost = 0;
        for (size_t length : lines) {
          end += length;
          if (end > done) ++lost;
        }
        count_dropped(lost);
      }
      {
        std::lock_guard lock(mutex);
        queued_bytes -= batch.size();
      }
      if (gave_up) return;
      batch.clear();
      lines.clear();
    }
  }
};

AccessLog::AccessLog(const std::string& path, metrics::IntCounter* dropped, Limits limits)
    : impl_(std::make_unique<Impl>()) {
  impl_->path = path;
  impl_->limits = limits;
  impl_->dropped_metric = dropped;
  impl_->out = open_output(path);
  impl_->stop_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (impl_->stop_fd < 0) {
    const int error = errno;
    if (impl_->out.owned) ::close(impl_->out.fd);
    throw Error("access log '" + path + "': eventfd: " + std::strerror(error));
  }
  impl_->writer = std::thread([impl = impl_.get()] { impl->run(); });
}

AccessLog::~AccessLog() {
  Impl& impl = *impl_;
  {
    std::lock_guard lock(impl.mutex);
    impl.deadline = Clock::now() + impl.limits.shutdown_deadline;
    impl.stopping = true;
  }
  impl.wake.notify_one();
  const uint64_t one = 1;
  [[maybe_unused]] const ssize_t n = ::write(impl.stop_fd, &one, sizeof one);
  impl.writer.join();
  if (impl.gave_up) {
    impl.count_dropped(impl.queue_lines.size());
    std::fprintf(stderr,
                 "tandem gateway: access log '%s': not written within %lld ms of shutdown (the "
                 "reader does not read); giving up: %llu lines lost in all\n",
                 impl.path.c_str(), static_cast<long long>(impl.limits.shutdown_deadline.count()),
                 static_cast<unsigned long long>(impl.dropped.load()));
  } else if (const uint64_t lost = impl.dropped.load(); lost > 0) {
    std::fprintf(stderr, "tandem gateway: access log '%s': %llu lines were not written\n",
                 impl.path.c_str(), static_cast<unsigned long long>(lost));
  }
  ::close(impl.stop_fd);
  if (impl.out.owned) ::close(impl.out.fd);
}

void AccessLog::add(const nlohmann::json& line) {
  std::string text = line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  bool queued = false;
  {
    std::lock_guard lock(impl_->mutex);
    if (impl_->queued_bytes + text.size() <= impl_->limits.max_queued_bytes) {
      impl_->queue += text;
      impl_->queue_lines.push_back(text.size());
      impl_->queued_bytes += text.size();
      queued = true;
    }
  }
  if (queued) {
    impl_->wake.notify_one();
    return;
  }
  impl_->count_dropped(1);
  if (auto held_back = impl_->drop_log.admit(Clock::now()))
    std::fprintf(stderr,
                 "tandem gateway: access log '%s': %zu bytes wait to be written (the cap): "
                 "dropping lines (%llu so far)\n",
                 impl_->path.c_str(), impl_->limits.max_queued_bytes,
                 static_cast<unsigned long long>(impl_->dropped.load()));
}

uint64_t AccessLog::dropped_lines() const {
  return impl_->dropped.load(std::memory_order_relaxed);
}

}  // namespace tandem::gateway
