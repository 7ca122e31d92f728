// The gateway's capacity flags as `tandem gateway` and `tandem serve` read them: each flag given
// lands in its Topology field, one left out keeps the Topology's default (or a --config file's
// setting), and a bad value is refused naming the flag.
#include "cli/gateway_capacity_flags.h"

#include "cli/number_checks.h"

#include <algorithm>
#include <chrono>
#include <string>
#include <tuple>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace tandem::cli {
namespace {

using ::testing::HasSubstr;

// `args` parsed by a command that took the flags as both commands do.
class CapacityFlags {
 public:
  CapacityFlags() {
    add_gateway_capacity_flags(app_, flags_);
    refuse_malformed_numbers(app_);  // as main() does for every command
  }
  // The parse's error, or "" when it took `args`.
  std::string parse(std::vector<std::string> args) {
    std::reverse(args.begin(), args.end());  // CLI11 takes them last first
    try {
      app_.parse(args);
    } catch (const CLI::ParseError& e) {
      return e.what();
    }
    return std::string();
  }
  gateway::Topology applied(gateway::Topology t, bool only_given) const {
    apply_gateway_capacity_flags(t, flags_, app_, only_given);
    return t;
  }

 private:
  CLI::App app_{"capacity flags"};
  GatewayCapacityFlags flags_;
};

TEST(GatewayCapacityFlags, EachFlagGivenLandsInItsTopologyField) {
  CapacityFlags cli;
  ASSERT_EQ(
      cli.parse({"--max-queue", "7", "--max-connections", "100", "--max-connections-per-address",
                 "3", "--max-unsent-bytes", "4096", "--max-answer-bytes", "8192", "--http-threads",
                 "5", "--max-queued-body-bytes", "65536"}),
      "");
  for (bool only_given : {false, true}) {
    const gateway::Topology t = cli.applied(gateway::Topology{}, only_given);
    EXPECT_EQ(t.max_queue, 7u) << only_given;
    EXPECT_EQ(t.max_queued_body_bytes, 65536u) << only_given;
    EXPECT_EQ(t.max_connections, 100u) << only_given;
    EXPECT_EQ(t.max_connections_per_address, 3u) << only_given;
    EXPECT_EQ(t.max_unsent_bytes, 4096u) << only_given;
    EXPECT_EQ(t.max_answer_bytes, 8192u) << only_given;
    EXPECT_EQ(t.io_threads, 5) << only_given;
  }
}

// Without the flags a topology from flags gets the Topology's defaults (what the help shows),
// and a --config file's settings stay.
TEST(GatewayCapacityFlags, AFlagLeftOutKeepsTheDefaultOrTheFilesSetting) {
  CapacityFlags cli;
  ASSERT_EQ(cli.parse({"--max-queue", "7"}), "");
  gateway::Topology file;
  file.max_connections = 11;
  file.max_connections_per_address = 2;
  file.max_unsent_bytes = 1000;
  file.max_answer_bytes = 2000;
  file.io_threads = 3;
  file.max_queued_body_bytes = 4000;
  const gateway::Topology from_file = cli.applied(file, /*only_given=*/true);
  EXPECT_EQ(from_file.max_queued_body_bytes, 4000u);
  EXPECT_EQ(from_file.max_queue, 7u);
  EXPECT_EQ(from_file.max_connections, 11u);
  EXPECT_EQ(from_file.max_connections_per_address, 2u);
  EXPECT_EQ(from_file.max_unsent_bytes, 1000u);
  EXPECT_EQ(from_file.max_answer_bytes, 2000u);
  EXPECT_EQ(from_file.io_threads, 3);
  const gateway::Topology defaults;
  const gateway::Topology from_flags = cli.applied(file, /*only_given=*/false);
  EXPECT_EQ(from_flags.max_queue, 7u);
  EXPECT_EQ(from_flags.max_connections, defaults.max_connections);
  EXPECT_EQ(from_flags.max_connections_per_address, defaults.max_connections_per_address);
  EXPECT_EQ(from_flags.max_unsent_bytes, defaults.max_unsent_bytes);
  EXPECT_EQ(from_flags.max_answer_bytes, defaults.max_answer_bytes);
  EXPECT_EQ(from_flags.io_threads, defaults.io_threads);
  EXPECT_EQ(from_flags.max_queued_body_bytes, defaults.max_queued_body_bytes);
  EXPECT_EQ(defaults.max_queued_body_bytes, size_t{1} << 30);
}

// The bounds are a topology file's: a count 1 (0 for the connection caps, "the default") to the
// largest int, a held size 1 to kMaxHeldBytesLimit, io threads 1 to kMaxIoThreads. CLI11 read
// "-1" and a number past 2^64 for a size_t as its largest value: an unbounded limit.
TEST(GatewayCapacityFlags, ABadValueIsRefusedNamingTheFlag) {
  for (const auto& [flag, value, said] : {
           std::tuple{"--max-queue", "0", "--max-queue: Value 0 not in range 1 to 2147483647"},
           std::tuple{"--max-queue", "-1", "--max-queue: Value -1 not in range 1 to 2147483647"},
           std::tuple{"--max-queue", "2147483648", "--max-queue: Value 2147483648 not in range"},
           std::tuple{"--max-queue", "99999999999999999999999", "--max-queue: Value 9999"},
           std::tuple{"--max-connections", "-1",
                      "--max-connections: Value -1 not in range 0 to 2147483647"},
           std::tuple{"--max-connections-per-address", "-1",
                      "--max-connections-per-address: Value -1 not in range 0 to 2147483647"},
           std::tuple{"--max-unsent-bytes", "0",
                      "--max-unsent-bytes: Value 0 not in range 1 to 17179869184"},
           std::tuple{"--max-unsent-bytes", "-1",
                      "--max-unsent-bytes: Value -1 not in range 1 to 17179869184"},
           std::tuple{"--max-answer-bytes", "17179869185",
                      "--max-answer-bytes: Value 17179869185 not in range 1 to 17179869184"},
           std::tuple{"--http-threads", "0", "--http-threads: Value 0 not in range 1 to 64"},
           std::tuple{"--http-threads", "65", "--http-threads: Value 65 not in range 1 to 64"},
           std::tuple{"--max-queue", "many", "--max-queue"},
           std::tuple{"--max-queued-body-bytes", "-1",
                      "--max-queued-body-bytes: Value -1 not in range 0 to 9223372036854775807"},
           std::tuple{"--max-queued-body-bytes", "1GiB", "--max-queued-body-bytes"},
       }) {
    CapacityFlags cli;
    EXPECT_THAT(cli.parse({flag, value}), HasSubstr(said)) << flag << " " << value;
  }
}

// CORS: no flag set net::HttpServerOptions::allowed_origins, so every origin was allowed. The
// flag takes origins separated by commas, or vLLM's JSON list; "*" (any) when left out, as
// vLLM's default; '' none. An entry that is no origin is refused naming the flag and the entry.
TEST(GatewayCapacityFlags, AllowedOriginsAreACommaListOrVllmsJsonList) {
  for (const auto& [value, want] :
       {std::pair{"https://a.example, http://localhost:3000",
                  std::vector<std::string>{"https://a.example", "http://localhost:3000"}},
        std::pair{R"(["https://a.example"])", std::vector<std::string>{"https://a.example"}},
        std::pair{"*", std::vector<std::string>{"*"}}, std::pair{"", std::vector<std::string>{}}}) {
    CapacityFlags cli;
    ASSERT_EQ(cli.parse({"--allowed-origins", value}), "") << value;
    EXPECT_EQ(cli.applied(gateway::Topology{}, /*only_given=*/true).allowed_origins, want) << value;
  }
  CapacityFlags none;
  ASSERT_EQ(none.parse({}), "");
  EXPECT_EQ(none.applied(gateway::Topology{}, /*only_given=*/false).allowed_origins,
            std::vector<std::string>{"*"});
  gateway::Topology file;
  file.allowed_origins = {"https://file.example"};
  EXPECT_EQ(none.applied(file, /*only_given=*/true).allowed_origins, file.allowed_origins);
  for (const auto& [value, said] :
       {std::pair{"https://a.example/", "'https://a.example/': an origin is scheme://host[:port]"},
        std::pair{"a.example", "'a.example': expected an origin"},
        std::pair{"https://a.example,", "'': expected an origin"},
        std::pair{R"(["https://a.example", 5])", "expected a JSON list of origins (strings)"},
        std::pair{"[https://a.example]", "expected origins separated by commas or a JSON list"}}) {
    CapacityFlags cli;
    const std::string error = cli.parse({"--allowed-origins", value});
    EXPECT_THAT(error, HasSubstr("--allowed-origins")) << value;
    EXPECT_THAT(error, HasSubstr(said)) << value;
  }
}

// The largest values a topology file takes are taken.
TEST(GatewayCapacityFlags, TheBoundsThemselvesAreTaken) {
  CapacityFlags cli;
  ASSERT_EQ(cli.parse({"--max-queue", "2147483647", "--max-connections", "0",
                       "--max-connections-per-address", "2147483647", "--max-unsent-bytes",
                       "17179869184", "--max-answer-bytes", "1", "--http-threads", "64",
                       "--max-queued-body-bytes", "0"}),
            "");
  const gateway::Topology t = cli.applied(gateway::Topology{}, /*only_given=*/true);
  EXPECT_EQ(t.max_queued_body_bytes, 0u);  // no bound
  EXPECT_EQ(t.max_queue, 2147483647u);
  EXPECT_EQ(t.max_connections, 0u);
  EXPECT_EQ(t.max_connections_per_address, 2147483647u);
  EXPECT_EQ(t.max_unsent_bytes, gateway::kMaxHeldBytesLimit);
  EXPECT_EQ(t.max_answer_bytes, 1u);
  EXPECT_EQ(t.io_threads, gateway::kMaxIoThreads);
}

// The HTTP server's total bound on a body (max_body_time, 5 minutes) had no flag: a gateway
// taking large bodies from slow clients could not raise it, nor a guarded one lower it. It lands
// in the topology as a duration, a file's setting stays where the flag is not given, and a value
// a file would refuse is refused naming the flag.
TEST(GatewayCapacityFlags, MaxBodyTimeMsLandsInTheTopologyAndIsBoundedAsTheFilesKey) {
  CapacityFlags cli;
  ASSERT_EQ(cli.parse({"--max-body-time-ms", "600000"}), "");
  for (bool only_given : {false, true})
    EXPECT_EQ(cli.applied(gateway::Topology{}, only_given).max_body_time, std::chrono::minutes(10))
        << only_given;
  gateway::Topology file;
  file.max_body_time = std::chrono::seconds(42);
  CapacityFlags none;
  ASSERT_EQ(none.parse({}), "");
  EXPECT_EQ(none.applied(file, /*only_given=*/true).max_body_time, std::chrono::seconds(42));
  EXPECT_EQ(none.applied(file, /*only_given=*/false).max_body_time, std::chrono::minutes(5));
  for (const auto& [value, said] : {
           std::pair{"0", "--max-body-time-ms: Value 0 not in range 1 to 2147483647"},
           std::pair{"-1", "--max-body-time-ms: Value -1 not in range 1 to 2147483647"},
           std::pair{"2147483648", "--max-body-time-ms: Value 2147483648 not in range"},
           std::pair{"0x10", "--max-body-time-ms: expected a decimal number"},
           std::pair{"010", "--max-body-time-ms: expected a decimal number"},
           std::pair{"1.5", "--max-body-time-ms"},
           std::pair{"5m", "--max-body-time-ms"},
       }) {
    CapacityFlags bad;
    EXPECT_THAT(bad.parse({"--max-body-time-ms", value}), HasSubstr(said)) << value;
  }
  CapacityFlags largest;
  ASSERT_EQ(largest.parse({"--max-body-time-ms", "2147483647"}), "");
  EXPECT_EQ(largest.applied(gateway::Topology{}, true).max_body_time.count(),
            gateway::kMaxMilliseconds);
}

// CLI11 reads an integer as C's strtoll does: "010" as octal 8, "0x10" as 16. A user writes
// decimal; each is refused naming the flag rather than taken as another number.
TEST(GatewayCapacityFlags, AnIntegerNotInDecimalIsRefusedNamingTheFlag) {
  for (const auto& [flag, value] : {
           std::pair{"--http-threads", "010"},
           std::pair{"--http-threads", "0x10"},
           std::pair{"--max-queue", "0X10"},
           std::pair{"--max-connections", "01000"},
           std::pair{"--max-connections-per-address", "+010"},
           std::pair{"--max-connections", "00"},
           std::pair{"--max-answer-bytes", "0100"},
       }) {
    CapacityFlags cli;
    EXPECT_THAT(cli.parse({flag, value}),
                HasSubstr(std::string(flag) +
                          ": expected a decimal number (no leading 0 or 0x), got " + value))
        << flag << " " << value;
  }
  CapacityFlags cli;
  EXPECT_EQ(cli.parse({"--http-threads", "10", "--max-connections", "0", "--max-queue", "+7"}), "");
  const gateway::Topology t = cli.applied(gateway::Topology{}, /*only_given=*/true);
  EXPECT_EQ(t.io_threads, 10);
  EXPECT_EQ(t.max_connections, 0u);
  EXPECT_EQ(t.max_queue, 7u);
}

// `tandem serve --gateways N` runs N gateways in one process, one file descriptor limit between
// them. Each took the whole of a connection cap (or, by default, three quarters of the limit), so
// together they held N times the cap and ran out of descriptors (EMFILE) before any cap refused a
// connection. The cap bounds the stack: each replica takes its share. The per-address cap stays
// whole: the replicas count an address's connections together (net::ConnectionsPerAddress), where
// a share of it each refused an address early when the kernel sent more than a share to one.
TEST(GatewayReplicas, EachTakesItsShareOfTheStacksConnectionCap) {
  gateway::Topology stack;
  stack.max_connections = 1000;
  stack.max_connections_per_address = 10;
  stack.max_queue = 64;
  stack.max_queued_body_bytes = 1000;
  stack.io_threads = 3;
  stack.prefill.max_in_flight = 10;
  stack.decode.max_in_flight = 256;
  for (int replicas : {2, 3, 4, 7}) {
    gateway::Topology replica = stack;
    share_among_gateway_replicas(replica, replicas, size_t{4096});
    const auto n = static_cast<size_t>(replicas);
    // Rounded up: together at least the stack's cap, at most one more per extra replica.
    EXPECT_GE(replica.max_connections * n, 1000u) << replicas;
    EXPECT_LT(replica.max_connections * n, 1000u + n) << replicas;
    EXPECT_EQ(replica.max_connections_per_address, 10u) << replicas;
    // The replicas' queues hold their bodies in one process's memory: a share each.
    EXPECT_GE(replica.max_queued_body_bytes * n, 1000u) << replicas;
    EXPECT_LT(replica.max_queued_body_bytes * n, 1000u + n) << replicas;
    EXPECT_GE(static_cast<size_t>(replica.prefill.max_in_flight) * n, 10u) << replicas;
    EXPECT_LT(static_cast<size_t>(replica.prefill.max_in_flight) * n, 10u + n) << replicas;
    EXPECT_GE(static_cast<size_t>(replica.decode.max_in_flight) * n, 256u) << replicas;
    // Each replica has its own queue, fed by the connections it accepted: a bound of its own.
    EXPECT_EQ(replica.max_queue, 64u) << replicas;
    EXPECT_EQ(replica.io_threads, 3) << replicas;
  }
}

// A cap smaller than the replicas is 1 each, never 0 (which would mean the default: three
// quarters of the descriptor limit each).
TEST(GatewayReplicas, ASmallCapIsNeverDividedToTheDefault) {
  gateway::Topology replica;
  replica.max_connections = 2;
  replica.max_queued_body_bytes = 0;  // no bound: none for each either
  share_among_gateway_replicas(replica, 4, size_t{4096});
  EXPECT_EQ(replica.max_connections, 1u);
  EXPECT_EQ(replica.max_queued_body_bytes, 0u);
}

// Without --max-connections one gateway holds three quarters of the descriptor limit (the rest
// for its upstream connections and files): N replicas hold an equal share of those three
// quarters, not three quarters each. No per-address cap stays none.
TEST(GatewayReplicas, TheDefaultCapIsAnEqualShareOfThreeQuartersOfTheDescriptorLimit) {
  for (int replicas : {2, 3, 4}) {
    gateway::Topology replica;
    ASSERT_EQ(replica.max_connections, 0u);
    share_among_gateway_replicas(replica, replicas, size_t{4096});
    EXPECT_EQ(replica.max_connections, 3072u / static_cast<size_t>(replicas)) << replicas;
    EXPECT_EQ(replica.max_connections_per_address, 0u) << replicas;
  }
  // An unlimited descriptor limit: one gateway's default (2^20) shared likewise.
  gateway::Topology replica;
  share_among_gateway_replicas(replica, 4, std::nullopt);
  EXPECT_EQ(replica.max_connections, (size_t{1} << 20) / 4);
}

// One gateway (serve's default) keeps its settings as given: 0 stays the server's own default.
TEST(GatewayReplicas, OneGatewayKeepsItsSettings) {
  gateway::Topology replica;
  replica.max_connections_per_address = 5;
  share_among_gateway_replicas(replica, 1, size_t{4096});
  EXPECT_EQ(replica.max_queued_body_bytes, gateway::Topology{}.max_queued_body_bytes);
  EXPECT_EQ(replica.max_connections, 0u);
  EXPECT_EQ(replica.max_connections_per_address, 5u);
  EXPECT_EQ(replica.decode.max_in_flight, gateway::Pool{}.max_in_flight);
}

}  // namespace
}  // namespace tandem::cli
