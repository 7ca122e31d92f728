#include "cli/gateway_capacity_flags.h"

#include <limits>

namespace tandem::cli {
namespace {

// The largest count a topology file takes (max_queue, listen.max_connections...). CLI11 reads
// "-1", and a number past 2^64, into a size_t as its largest value: without this bound, an
// unbounded queue or cap where a typo was meant to be refused.
constexpr size_t kMaxCount = std::numeric_limits<int>::max();

}  // namespace

void add_gateway_capacity_flags(CLI::App& cmd, GatewayCapacityFlags& flags) {
  cmd.add_option("--max-queue", flags.max_queue, "requests waiting in the gateway before 429")
      ->capture_default_str()
      ->check(CLI::Range(size_t{1}, kMaxCount));
  cmd.add_option("--max-connections", flags.max_connections,
                 "client connections held at once; past it new ones are closed at once "
                 "(0: three quarters of the file descriptor limit)")
      ->capture_default_str()
      ->check(CLI::Range(size_t{0}, kMaxCount));
  cmd.add_option("--max-connections-per-address", flags.max_connections_per_address,
                 "of those, held at once from one client address; past it its new ones are "
                 "closed at once (0: no limit; leave it behind a proxy or load balancer)")
      ->capture_default_str()
      ->check(CLI::Range(size_t{0}, kMaxCount));
  const auto held_bytes = CLI::Range(size_t{1}, gateway::kMaxHeldBytesLimit);
  cmd.add_option("--max-unsent-bytes", flags.max_unsent_bytes,
                 "a streaming client this many bytes behind its stream is cut as stalled, and "
                 "its engine legs cancelled (listen.max_unsent_bytes)")
      ->capture_default_str()
      ->check(held_bytes);
  cmd.add_option("--max-answer-bytes", flags.max_answer_bytes,
                 "the largest non-streamed answer, or event of a stream, the gateway holds to "
                 "relay; a larger answer or first event is refused with 502 answer_too_large, a "
                 "larger later event cuts the stream (max_answer_bytes)")
      ->capture_default_str()
      ->check(held_bytes);
  cmd.add_option("--http-threads", flags.http_threads, "HTTP io threads")
      ->capture_default_str()
      ->check(CLI::Range(1, gateway::kMaxIoThreads));
}

void apply_gateway_capacity_flags(gateway::Topology& t, const GatewayCapacityFlags& flags,
                                  const CLI::App& cmd, bool only_given) {
  const auto given = [&](const char* flag) { return !only_given || cmd.count(flag) > 0; };
  if (given("--max-queue")) t.max_queue = flags.max_queue;
  if (given("--max-connections")) t.max_connections = flags.max_connections;
  if (given("--max-connections-per-address"))
    t.max_connections_per_address = flags.max_connections_per_address;
  if (given("--max-unsent-bytes")) t.max_unsent_bytes = flags.max_unsent_bytes;
  if (given("--max-answer-bytes")) t.max_answer_bytes = flags.max_answer_bytes;
  if (given("--http-threads")) t.io_threads = flags.http_threads;
}

}  // namespace tandem::cli
