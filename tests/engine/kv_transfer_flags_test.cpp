// `tandem engine`'s KV transfer timeouts as a user meets them: a value that would round to 0 ms
// (the transports count milliseconds) is refused naming the flag and the smallest value taken,
// before any model loads, and the handshake timeout that tells a hung prefill engine from a slow
// one is a flag with its default in --help.
//
// The engines here are given a model folder that does not exist: a flag the engine takes gets as
// far as that folder's error, one it refuses never does.
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "cli/run_tandem.h"

namespace tandem {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kNoModel[] = "engine --model /nonexistent/kv-transfer-flags-model ";
constexpr char kModelsError[] =
    "--model: Directory does not exist: /nonexistent/kv-transfer-flags-model";

// `--kv-transfer-timeout 0.0004` became 0 ms: every frame's I/O timed out at once, so every
// transfer failed, with nothing naming the flag. Each timeout refuses what would round to 0.
TEST(KvTransferFlags, ATimeoutThatWouldRoundToNoMillisecondsIsRefusedNamingTheFlag) {
  for (const std::string flag : {"--kv-transfer-timeout", "--kv-transfer-handshake-timeout"}) {
    for (const std::string value : {"0.0004", "0", "-1"}) {
      const test::Result r = test::run(kNoModel + flag + " " + value);
      EXPECT_NE(r.status, 0) << flag << " " << value << ": " << r.output;
      EXPECT_THAT(
          r.output,
          HasSubstr(flag + ": must be at least 0.001 seconds (a millisecond), got " + value))
          << flag << " " << value;
      EXPECT_THAT(r.output, Not(HasSubstr(kModelsError))) << flag << " " << value;
    }
    const test::Result nan = test::run(kNoModel + flag + " nan");
    EXPECT_THAT(nan.output, HasSubstr(flag + ": expected a finite number of seconds, got nan"));
    // The smallest value taken gets past the flags, to the model's folder.
    const test::Result least = test::run(kNoModel + flag + " 0.001");
    EXPECT_THAT(least.output, HasSubstr(kModelsError)) << flag << ": " << least.output;
  }
}

// The fetch handshake's bound (how long a decode engine waits for a prefill engine to answer
// before it fails the pull as that engine's fault) was a constant of 5 s.
TEST(KvTransferFlags, TheHandshakeTimeoutIsAFlagWithItsDefaultInTheHelp) {
  const test::Result help = test::run("engine --help");
  EXPECT_EQ(help.status, 0) << help.output;
  const size_t at = help.output.find("  --kv-transfer-handshake-timeout ");
  ASSERT_NE(at, std::string::npos) << help.output;
  // Its line and the description, which CLI11 may put on the lines after it, up to the next flag.
  const std::string lines = help.output.substr(at, help.output.find("\n  -", at + 1) - at);
  EXPECT_THAT(lines, HasSubstr("=5")) << lines;
  EXPECT_THAT(lines, HasSubstr("hung")) << lines;
}

}  // namespace
}  // namespace tandem
