#include "cli/gateway_capacity_flags.h"

#include <algorithm>
#include <chrono>
#include <limits>

#include "net/http_server.h"
#include "util/error.h"

namespace tandem::cli {
namespace {

// The largest count a topology file takes (max_queue, listen.max_connections...). CLI11 reads
// "-1", and a number past 2^64, into a size_t as its largest value: without this bound, an
// unbounded queue or cap where a typo was meant to be refused.
constexpr size_t kMaxCount = std::numeric_limits<int>::max();

// `whole` shared by `n`, rounded up: together at least `whole`, and never 0 where `whole` is not.
size_t share_rounded_up(size_t whole, size_t n) {
  return (whole + n - 1) / n;
}

}  // namespace

void add_gateway_capacity_flags(CLI::App& cmd, GatewayCapacityFlags& flags) {
  cmd.add_option("--max-queue", flags.max_queue, "requests waiting in the gateway before 429")
      ->capture_default_str()
      ->check(CLI::Range(size_t{1}, kMaxCount));
  // Bounded as the file's key: CLI11 reads "-1" into a size_t as its largest value.
  cmd.add_option("--max-queued-body-bytes", flags.max_queued_body_bytes,
                 "bytes of request bodies waiting in the gateway before 429, unless nothing "
                 "waits (max_queued_body_bytes; 0: no bound)")
      ->capture_default_str()
      ->check(CLI::Range(size_t{0}, static_cast<size_t>(std::numeric_limits<int64_t>::max())));
  add_max_connections_flag(cmd, flags.max_connections);
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
  cmd.add_option("--max-body-time-ms", flags.max_body_time_ms,
                 "a request body must be complete within this many milliseconds of its head, "
                 "however fast it comes, else 408 (listen.max_body_time_ms); the bound applied "
                 "is the longer of this and the time the largest body (listen.max_body_bytes, "
                 "8 MiB by default) takes at 28 KB/s")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, gateway::kMaxMilliseconds));
  cmd.add_option("--http-threads", flags.http_threads, "HTTP io threads")
      ->capture_default_str()
      ->check(CLI::Range(1, gateway::kMaxIoThreads));
  add_allowed_origins_flag(cmd, flags.allowed_origins);
}

void add_allowed_origins_flag(CLI::App& cmd, std::vector<std::string>& origins) {
  const CLI::Validator checked(
      [](std::string& value) {
        try {
          net::parse_allowed_origins(value);
        } catch (const Error& e) {
          return std::string(e.what());
        }
        return std::string();
      },
      "ORIGINS");
  cmd.add_option_function<std::string>(
         "--allowed-origins",
         [&origins](const std::string& value) { origins = net::parse_allowed_origins(value); },
         "CORS: the origins of the browser pages that may call this server, separated by commas "
         "(https://app.example.com,http://localhost:3000) or as vLLM's JSON list; * allows any, "
         "'' none")
      ->default_str("*")
      ->check(checked);
}

void add_max_connections_flag(CLI::App& cmd, size_t& max_connections) {
  cmd.add_option("--max-connections", max_connections,
                 "client connections held at once; past it new ones are closed at once "
                 "(0: three quarters of the file descriptor limit)")
      ->capture_default_str()
      ->check(CLI::Range(size_t{0}, kMaxCount));
}

void apply_gateway_capacity_flags(gateway::Topology& t, const GatewayCapacityFlags& flags,
                                  const CLI::App& cmd, bool only_given) {
  const auto given = [&](const char* flag) { return !only_given || cmd.count(flag) > 0; };
  if (given("--max-queue")) t.max_queue = flags.max_queue;
  if (given("--max-queued-body-bytes")) t.max_queued_body_bytes = flags.max_queued_body_bytes;
  if (given("--max-connections")) t.max_connections = flags.max_connections;
  if (given("--max-connections-per-address"))
    t.max_connections_per_address = flags.max_connections_per_address;
  if (given("--max-unsent-bytes")) t.max_unsent_bytes = flags.max_unsent_bytes;
  if (given("--max-answer-bytes")) t.max_answer_bytes = flags.max_answer_bytes;
  if (given("--http-threads")) t.io_threads = flags.http_threads;
  if (given("--max-body-time-ms"))
    t.max_body_time = std::chrono::milliseconds(flags.max_body_time_ms);
  if (given("--allowed-origins")) t.allowed_origins = flags.allowed_origins;
}

void share_among_gateway_replicas(gateway::Topology& t, int replicas,
                                  std::optional<size_t> descriptor_limit) {
  if (replicas <= 1) return;
  const auto n = static_cast<size_t>(replicas);
  for (gateway::Pool* p : {&t.prefill, &t.decode})
    p->max_in_flight = static_cast<int>(share_rounded_up(static_cast<size_t>(p->max_in_flight), n));
  // The replicas' queues hold their bodies in one process's memory.
  t.max_queued_body_bytes = share_rounded_up(t.max_queued_body_bytes, n);
  // The default is an equal share rounded down: together no more than one gateway's, which
  // leaves the process a quarter of its descriptors.
  t.max_connections = t.max_connections > 0
                          ? share_rounded_up(t.max_connections, n)
                          : std::max<size_t>(1, net::default_max_connections(descriptor_limit) / n);
  // max_connections_per_address stays whole: the replicas count one address's connections
  // together (net::ConnectionsPerAddress), wherever the kernel sends each.
}

}  // namespace tandem::cli
