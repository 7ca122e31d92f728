// `tandem serve`'s supervisor as a user meets it: the real binary, its real engines. An engine is
// made to hang in its start on demand: every engine reads its KV transfer secret from a named
// pipe (--kv-transfer-secret-file), so one starts only when the test writes the secret into it;
// the first engine gets it, a restarted one waits in open() until the test writes again.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine/engine_http.h"
#include "net/http_client.h"
#include "text/oracle_support.h"
#include "util/child_process.h"

namespace tandem {
namespace {

using testing::eventually;
using ::testing::HasSubstr;
using ::testing::Not;

// A serve process and what it printed; kills whatever a failed test leaves behind (serve and a
// stopped engine), so that a failure is reported rather than hanging the test program.
class Serve {
 public:
  explicit Serve(const std::vector<std::string>& flags) : process_(TANDEM_BINARY, argv(flags)) {}
  ~Serve() {
    for (pid_t pid : engines_) {  // only ours while serve has not reaped them
      ::kill(pid, SIGKILL);
      ::kill(pid, SIGCONT);
    }
    process_.signal(SIGKILL);
  }

  ChildProcess& process() { return process_; }
  // Reads what serve printed until a line holds `text`, without waiting for a line that may never
  // come; returns that line, or "" (all it printed in `output()`).
  std::string line_with(const std::string& text) {
    std::string found;
    eventually([&] {
      while (auto line = process_.poll_line()) {
        if (line->empty()) return true;  // serve ended
        output_ += *line;
        if (line->find(text) != std::string::npos) {
          found = *line;
          return true;
        }
      }
      return false;
    });
    return found;
  }
  const std::string& output() const { return output_; }
  // An engine pid the destructor kills if the test fails before serve has reaped it.
  void track(pid_t engine) { engines_.push_back(engine); }

 private:
  static std::vector<std::string> argv(const std::vector<std::string>& flags) {
    std::vector<std::string> a = {TANDEM_BINARY, "serve"};
    a.insert(a.end(), flags.begin(), flags.end());
    return a;
  }
  ChildProcess process_;
  std::string output_;
  std::vector<pid_t> engines_;
};

int number_after(const std::string& line, const std::string& key) {
  const size_t at = line.find(key);
  return at == std::string::npos ? -1 : std::stoi(line.substr(at + key.size()));
}

// A named pipe every engine reads its secret from.
class SecretPipe {
 public:
  SecretPipe() : path_(test::temp_path("serve-secret-pipe")) {
    if (::mkfifo(path_.c_str(), 0600) != 0) throw std::runtime_error("mkfifo " + path_.string());
  }
  ~SecretPipe() { std::filesystem::remove(path_); }
  const std::filesystem::path& path() const { return path_; }
  std::string flag() const { return "--engine-arg=--kv-transfer-secret-file=" + path_.string(); }
  // Lets the one engine that waits in open() start; false when none opened the pipe in time.
  bool feed_one_engine() {
    int fd = -1;  // O_NONBLOCK: fails (ENXIO) until an engine opens the pipe to read
    if (!eventually([&] { return (fd = ::open(path_.c_str(), O_WRONLY | O_NONBLOCK)) >= 0; }))
      return false;
    const std::string secret = "serve-test-secret\n";
    const bool written =
        ::write(fd, secret.data(), secret.size()) == static_cast<ssize_t>(secret.size());
    ::close(fd);  // the engine reads to the end
    return written;
  }

 private:
  std::filesystem::path path_;
};

// Runs serve to its end (one that fails to start); returns its exit status, with its standard
// output and error in `output`.
int run_serve(const std::vector<std::string>& flags, std::string& output) {
  std::string command = test::quote(TANDEM_BINARY);
  command += " serve";
  for (const auto& f : flags) command.append(" ").append(test::quote(f));
  command += " 2>&1";
  FILE* out = ::popen(command.c_str(), "r");
  if (!out) throw std::runtime_error("popen " + command);
  char chunk[4096];
  while (size_t n = std::fread(chunk, 1, sizeof chunk, out)) output.append(chunk, n);
  return ::pclose(out);
}

// The processes `pid`'s main thread started (serve starts its engines from its main thread).
std::vector<pid_t> children_of(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/task/" + std::to_string(pid) + "/children");
  std::vector<pid_t> children;
  for (pid_t child = 0; in >> child;) children.push_back(child);
  return children;
}

bool gone(pid_t pid) {
  return ::kill(pid, 0) == -1 && errno == ESRCH;
}

const std::vector<std::string> kOneEngine = {"--model",  "sim:tiny", "--host", "127.0.0.1",
                                             "--port",   "0",        "--mode", "aggregated",
                                             "--decode", "1"};

// The reviewer's case: the decode engine dies, its replacement hangs before naming its ports
// (here in open(), and stopped with SIGSTOP so that it would not act on SIGTERM either), and the
// operator stops serve. Serve acts on the signal at once, kills the starting engine and ends.
TEST(ServeSupervisor, AStopSignalWhileARestartedEngineIsStuckStartingEndsServePromptly) {
  SecretPipe pipe;
  std::vector<std::string> flags = kOneEngine;
  flags.push_back(pipe.flag());
  Serve serve(flags);
  ASSERT_TRUE(pipe.feed_one_engine()) << "no engine opened the secret pipe";
  const std::string engine = serve.line_with(" engine http://");
  const pid_t pid = number_after(engine, "(pid ");
  ASSERT_GT(pid, 0) << serve.output();
  serve.track(pid);

  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  // Its replacement: serve's one child once it has reaped the dead one and restarted it.
  pid_t stuck = -1;
  EXPECT_TRUE(eventually([&] {
    const std::vector<pid_t> children = children_of(serve.process().pid());
    stuck = children.size() == 1 && children[0] != pid ? children[0] : -1;
    return stuck > 0;
  }));
  ASSERT_GT(stuck, 0) << "serve restarted no engine; it printed:\n" << serve.output();
  serve.track(stuck);
  EXPECT_THAT(serve.line_with("restarting (pid "),
              HasSubstr("decode engine on port " +
                        std::to_string(number_after(engine, "http://127.0.0.1:")) +
                        " restarting (pid " + std::to_string(stuck) + ")"));
  ASSERT_EQ(::kill(stuck, SIGSTOP), 0);

  ASSERT_EQ(::kill(serve.process().pid(), SIGTERM), 0);
  std::optional<int> status;
  ASSERT_TRUE(eventually([&] { return (status = serve.process().exited()).has_value(); }))
      << "serve did not end on SIGTERM while its engine was starting";
  EXPECT_EQ(*status, 0);
  EXPECT_TRUE(eventually([&] { return gone(stuck); }))
      << "the starting engine (pid " << stuck << ") outlived serve";
}

// The auditor's case: a running engine stopped with SIGSTOP does not die, so serve restarted it
// never, and the gateway only ejected it. Its /health unanswered for --engine-hang-seconds, serve
// kills it and restarts it on its port, where the gateway serves through it again.
TEST(ServeSupervisor, AnEngineHungPastTheHangTimeoutIsKilledAndRestartedOnItsPort) {
  std::vector<std::string> flags = kOneEngine;
  flags.insert(flags.end(), {"--engine-hang-seconds", "1"});
  Serve serve(flags);
  const std::string listening = serve.line_with("tandem serve: listening on ");
  const std::string engine = serve.line_with(" engine http://");
  const pid_t pid = number_after(engine, "(pid ");
  ASSERT_GT(pid, 0) << serve.output();
  serve.track(pid);
  const std::string port = std::to_string(number_after(engine, "http://127.0.0.1:"));

  ASSERT_EQ(::kill(pid, SIGSTOP), 0);
  EXPECT_THAT(serve.line_with("restarting (pid "), HasSubstr("decode engine on port " + port));
  const std::string restarted = serve.line_with("restarted (pid ");
  ASSERT_THAT(restarted, HasSubstr("decode engine on port " + port + " restarted (pid "))
      << serve.output();
  const pid_t second = number_after(restarted, "(pid ");
  serve.track(second);
  EXPECT_NE(second, pid);
  EXPECT_TRUE(gone(pid)) << "the hung engine was not killed and reaped";

  const uint16_t gateway = static_cast<uint16_t>(number_after(listening, "127.0.0.1:"));
  EXPECT_TRUE(eventually([&] {
    return testing::post_json(gateway, "/v1/completions", {{"prompt", "hi"}, {"max_tokens", 2}})
               .status == 200;
  }));
  EXPECT_EQ(serve.process().stop(), 0);
}

// An engine that names no ports within --engine-start-timeout at the stack's start fails serve,
// naming the engine and the flag, and is killed with it. (Restarts past their deadline are killed
// and tried again: engine_child_test, on its own clock.)
TEST(ServeSupervisor, AnEngineThatNamesNoPortsInTimeFailsTheStartNamingTheFlag) {
  SecretPipe pipe;  // never fed: the engine waits in open() for good
  std::vector<std::string> flags = kOneEngine;
  flags.insert(flags.end(), {pipe.flag(), "--engine-start-timeout", "1"});
  std::string output;
  EXPECT_NE(run_serve(flags, output), 0) << output;
  EXPECT_THAT(output, HasSubstr("serve: decode engine did not start: it named no ports within "
                                "1.0 s (--engine-start-timeout)"));
  const int fd = ::open(pipe.path().c_str(), O_WRONLY | O_NONBLOCK);
  EXPECT_EQ(fd, -1) << "an engine still has the pipe open";
  EXPECT_EQ(errno, ENXIO);
  if (fd >= 0) ::close(fd);
}

bool has_ipv6_loopback() {
  const int fd = ::socket(AF_INET6, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  const bool ok = ::bind(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return ok;
}

// Engines on IPv6 loopback: they print their URLs with the host in brackets, serve reads their
// ports from them, and requests (both legs, KV transfer included) pass through. The bracketed
// form is refused naming the flag and the form to use.
TEST(ServeSupervisor, EnginesListenOnAnIpv6EngineHost) {
  if (!has_ipv6_loopback()) GTEST_SKIP() << "no IPv6 loopback on this machine";
  Serve serve(
      {"--model", "sim:tiny", "--host", "127.0.0.1", "--port", "0", "--engine-host", "::1"});
  const std::string listening = serve.line_with("tandem serve: listening on ");
  ASSERT_FALSE(listening.empty()) << serve.output();
  EXPECT_THAT(serve.line_with("prefill engine "), HasSubstr("prefill engine http://[::1]:"));
  EXPECT_THAT(serve.line_with("decode engine "), HasSubstr("decode engine http://[::1]:"));
  const uint16_t gateway = static_cast<uint16_t>(number_after(listening, "127.0.0.1:"));
  EXPECT_EQ(
      testing::post_json(gateway, "/v1/completions", {{"prompt", "hi"}, {"max_tokens", 2}}).status,
      200);
  EXPECT_EQ(serve.process().stop(), 0);

  // The bracketed form is refused before anything starts, naming the flag and the form to use.
  std::string refused;
  FILE* out = ::popen(
      (std::string(TANDEM_BINARY) + " serve --model sim:tiny --port 0 --engine-host '[::1]' 2>&1")
          .c_str(),
      "r");
  ASSERT_NE(out, nullptr);
  char chunk[4096];
  while (size_t n = std::fread(chunk, 1, sizeof chunk, out)) refused.append(chunk, n);
  EXPECT_NE(::pclose(out), 0) << refused;
  EXPECT_THAT(refused, HasSubstr("--engine-host '[::1]': an address without brackets, e.g. "
                                 "--engine-host ::1"));
}

// Serve starts its engines through /proc/self/exe, and the kernel names a process after the file
// it runs: "exe". Every tandem process names itself "tandem", so that `pgrep tandem` and ps's
// process names find serve's engines as they find serve.
TEST(ServeSupervisor, ItsEnginesAreNamedTandem) {
  Serve serve(kOneEngine);
  const std::string engine = serve.line_with(" engine http://");
  const pid_t pid = number_after(engine, "(pid ");
  ASSERT_GT(pid, 0) << serve.output();
  serve.track(pid);
  std::ifstream comm("/proc/" + std::to_string(pid) + "/comm");
  std::string name;
  std::getline(comm, name);
  EXPECT_EQ(name, "tandem");
  EXPECT_EQ(serve.process().stop(), 0);
}

// serve's --upstream-timeout reaches its gateway: an engine slowed far past it (a 512-token
// prompt's prefill takes seconds at --sim-time-scale 500) is answered 504 naming the flag's
// 250 ms, not the 300 s serve's gateway had whatever was asked.
TEST(ServeGatewayFlags, UpstreamTimeoutReachesTheGateway) {
  std::vector<std::string> flags = kOneEngine;
  flags.insert(flags.end(), {"--upstream-timeout", "0.25", "--engine-arg=--sim-time-scale=500",
                             "--engine-arg=--max-num-batched-tokens=64"});
  Serve serve(flags);
  const std::string listening = serve.line_with("tandem serve: listening on ");
  ASSERT_FALSE(listening.empty()) << serve.output();
  const uint16_t gateway = static_cast<uint16_t>(number_after(listening, "127.0.0.1:"));
  std::vector<int32_t> prompt;
  for (int i = 0; i < 512; ++i) prompt.push_back(1000 + i);
  const net::HttpClientResponse r = testing::post_json(
      gateway, "/v1/completions", {{"prompt", prompt}, {"max_tokens", 2}, {"ignore_eos", true}});
  EXPECT_EQ(r.status, 504) << r.body;
  EXPECT_THAT(r.body, HasSubstr("within timeouts.first_token_ms (250 ms)"));
}

// serve's --max-answer-bytes reaches every gateway replica: each of them refuses an answer larger
// than the flag's 64 bytes (a completion's JSON is more) with 502 answer_too_large, where serve's
// gateways held 64 MiB whatever was asked. Each request is a new connection, which the kernel
// gives either replica.
TEST(ServeGatewayFlags, MaxAnswerBytesReachesEveryGatewayReplica) {
  std::vector<std::string> flags = kOneEngine;
  flags.insert(flags.end(), {"--gateways", "2", "--max-answer-bytes", "64"});
  Serve serve(flags);
  const std::string listening = serve.line_with("tandem serve: listening on ");
  ASSERT_FALSE(listening.empty()) << serve.output();
  const uint16_t gateway = static_cast<uint16_t>(number_after(listening, "127.0.0.1:"));
  for (int i = 0; i < 8; ++i) {
    const net::HttpClientResponse r = testing::post_json(
        gateway, "/v1/completions", {{"prompt", "hello"}, {"max_tokens", 4}, {"ignore_eos", true}});
    EXPECT_EQ(r.status, 502) << r.body;
    EXPECT_THAT(r.body, HasSubstr("answer_too_large"));
  }
  EXPECT_EQ(serve.process().stop(), 0);
}

// A run stopped while it wrote a preset's model (a Ctrl-C in serve's first seconds) left its
// DIR.partial-ID folder in the cache for good, the model's size each time; and the first run's
// line named that folder, gone once renamed. The next run removes the folders whose writer is gone
// and keeps a running writer's: told by the writer's flock on a lock file in the folder, not by
// its PID, which names another process in a cache shared between PID namespaces or hosts. A
// folder without the lock file (an older tandem's) goes once a day old. The engine fails at its
// start here (serve does not read the secret file, which may be a pipe for the engine): the model
// is written by then.
TEST(ServePresetModel, StalePartialFoldersAreRemovedAndTheLineNamesTheModelsFolder) {
  const std::filesystem::path cache = test::scratch_path("serve-partial-cache", "");
  const std::filesystem::path models = cache / "tandem" / "models";
  const auto dead = models / "tiny-v3.partial-1-2";
  // Its PID is this process's, which the old check took for a writer at work.
  const auto dead_same_pid = models / ("tiny-v3.partial-" + std::to_string(::getpid()));
  // Its PID names no process here, as another container's writer's would.
  const auto running = models / "tiny-v3.partial-999999999";
  const auto old_unlocked = models / "tiny-v3.partial-3";
  const auto new_unlocked = models / "tiny-v3.partial-4";
  const auto other = models / "tiny-v2-lite.partial-5";  // another preset's: not this run's
  for (const auto& dir : {dead, dead_same_pid, running, old_unlocked, new_unlocked, other})
    std::filesystem::create_directories(dir);
  const auto lock_file = [](const std::filesystem::path& dir) {
    const int fd =
        ::open((dir / ".tandem-writer.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    EXPECT_GE(fd, 0) << dir;
    return fd;
  };
  for (const auto& dir : {dead, dead_same_pid, other}) ::close(lock_file(dir));
  const int held = lock_file(running);  // the writer at work: its lock held on another fd
  ASSERT_EQ(::flock(held, LOCK_EX), 0);
  std::filesystem::last_write_time(
      old_unlocked, std::filesystem::file_time_type::clock::now() - std::chrono::hours(48));
  // serve (run_serve's shell) with the test's cache; the test's own environment as it was.
  const auto serve = [&cache](std::string& output) {
    const char* const old = std::getenv("XDG_CACHE_HOME");
    const std::string saved = old ? old : "";
    ::setenv("XDG_CACHE_HOME", cache.c_str(), 1);
    const int status = run_serve({"--model", "tiny-v3", "--port", "0", "--mode", "aggregated",
                                  "--engine-arg=--kv-transfer-secret-file=/no/such/secret"},
                                 output);
    if (old)
      ::setenv("XDG_CACHE_HOME", saved.c_str(), 1);
    else
      ::unsetenv("XDG_CACHE_HOME");
    return status;
  };
  std::string output;
  EXPECT_NE(serve(output), 0) << output;
  EXPECT_THAT(output, HasSubstr("make-model: wrote " + (models / "tiny-v3").string() + " ("));
  EXPECT_THAT(output, Not(HasSubstr(".partial-"))) << output;
  EXPECT_TRUE(std::filesystem::exists(models / "tiny-v3" / "config.json")) << output;
  EXPECT_FALSE(std::filesystem::exists(dead));
  EXPECT_FALSE(std::filesystem::exists(dead_same_pid));
  EXPECT_TRUE(std::filesystem::exists(running));
  EXPECT_FALSE(std::filesystem::exists(old_unlocked));
  EXPECT_TRUE(std::filesystem::exists(new_unlocked));
  EXPECT_TRUE(std::filesystem::exists(other));
  EXPECT_FALSE(std::filesystem::exists(models / "tiny-v3" / ".tandem-writer.lock"));
  // A run that finds the model written still sweeps; the writer's lock released, its folder goes.
  std::filesystem::create_directories(dead);
  ::close(lock_file(dead));
  ::close(held);
  output.clear();
  serve(output);
  EXPECT_FALSE(std::filesystem::exists(dead)) << output;
  EXPECT_FALSE(std::filesystem::exists(running)) << output;
  std::filesystem::remove_all(cache);
}

}  // namespace
}  // namespace tandem
