#pragma once
// `tandem simulate`'s core: a whole cluster in virtual time, from the gateway to the engines,
// running their own code. The gateway's front end, dispatcher, policies, queue, relay and health
// checks (gateway/) run on a virtual clock (gateway/virtual_executor.h) and reach the engines
// through a virtual upstream (virtual_upstream.h); every engine is the serving engine with its
// scheduler, KV cache manager and prefix cache, stepping in virtual time with the simulated
// executor's latency model (simulated_engine.h); KV events reach the gateway's prefix index in
// the engines' own wire format after a small delay; in the P/D modes KV moves between prefill and
// decode engines over virtual links (virtual_kv_links.h). Clients send each request at its
// arrival time and measure it as `tandem bench` does (bench/stream_measure.h). One thread, no
// sockets, and the same result for the same inputs.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bench/driver.h"
#include "bench/metrics.h"
#include "bench/workload.h"
#include "engine/executor/sim_executor.h"
#include "engine/scheduler/scheduler.h"
#include "gateway/topology.h"
#include "sim/virtual_kv_links.h"
#include "text/tokenizer.h"

namespace tandem::sim {

struct SimulationOptions {
  // The gateway: its mode (aggregated, sequential or parallel), pools and settings (policy,
  // scheduling, health, timeouts). Endpoints are made up by the simulator: `prefill` and
  // `decode` engines named prefill-0.., decode-0..
  gateway::Topology gateway;
  int prefill = 0, decode = 1;
  // Every engine's simulated executor: its latency model (a preset name or a fitted JSON file),
  // KV blocks (0: the preset's) and block size, KV bytes per token, expert parallelism under a
  // placement and MTP acceptance (its seed: the tokens and routes, and the gateway's random ids).
  // The name and the seed of the routes drawn are set per engine; its wait is the simulator's.
  engine::SimExecutorOptions executor = [] {
    engine::SimExecutorOptions x;
    x.preset = "deepseek-v3-h800";
    return x;
  }();
  // And its scheduler limits.
  engine::SchedulerConfig scheduler = [] {
    engine::SchedulerConfig c;
    c.max_num_seqs = 64;  // `tandem engine`'s defaults
    c.max_num_batched_tokens = 2048;
    return c;
  }();
  bool prefix_caching = true;
  // From an engine's step to the gateway's prefix index (the ZMQ hop), seconds.
  double kv_event_delay_s = 0.001;
  // Request bodies take time: the clients' requests reach the gateway one after another (one
  // sending thread, as tandem bench's) and the gateway's reach each engine one after another
  // (one HTTP thread), each after its body's bytes at this rate, written, sent and parsed (0: at
  // once). Order is kept; what changes is that requests sent together (a trace's equal
  // timestamps) arrive tens of milliseconds apart behind long prompts, as live. 60 MB/s: what
  // the live stack showed between tandem bench and the gateway (docs/benchmarks.md).
  double body_bytes_per_s = 60e6;
  // The clients' requests, made as tandem bench makes them (token-id prompts, streamed with
  // usage; the BOS first where the dataset counts it, cli::set_prompt_bos). Its address,
  // timeout, concurrency and tokenizer are not used.
  bench::DriverOptions client;
  // Prefill to decode KV transfers (P/D modes): every engine pair's link, and how long a hold or
  // a bootstrap room waits for its other leg.
  KvLinkModel kv_link;
  double kv_transfer_timeout_s = 120;
  // How long a decode engine waits for a prefill engine's answer before the transfer itself (a
  // pull's accept, the shared-memory transport's hello), as `tandem engine` has it.
  double kv_transfer_handshake_timeout_s = engine::KvTransferConfig{}.handshake_timeout_s;
  // Faults, on engines by name (e.g. "decode-3") at times in seconds from the first send. The
  // gateway's own failure handling (timeouts, resets, retries, health checks) does the rest.
  struct Fault {
    enum class Kind {
      kDeath,  // the engine dies: its streams are reset, connections refused, transfers failed
      // For duration_s it is frozen whole, as SIGSTOP freezes a live engine: it neither steps
      // nor answers (calls wait), and moves no KV (requests for its KV wait, transfers to or
      // from it stop; all go on when it wakes).
      kStall,
      // For duration_s its KV links run `factor` times slower (the transfers that start then);
      // faults on one engine that overlap leave the largest factor under way in force. P/D only.
      kSlowLink,
    };
    Kind kind = Kind::kDeath;
    std::string engine;
    double at_s = 0;
    double duration_s = 0;  // kStall, kSlowLink
    double factor = 1;      // kSlowLink
  };
  std::vector<Fault> faults;
  // Idle gaps (nothing in flight, every engine idle), and waits that nothing can end sooner
  // (requests in flight, every engine idle, dead or stalled, their timeouts far off), skip the
  // gateway's probes and polls that would only repeat themselves (cluster_simulation.cpp): the
  // same run, sooner. Off: every timer runs (for tests that compare the two).
  bool skip_idle = true;
};

struct EngineSummary {
  std::string name;
  bool prefill = false;
  int64_t steps = 0;
  double busy_s = 0;                             // virtual seconds in steps
  double prefix_queries = 0, prefix_hits = 0;    // tokens (vLLM's counters)
  double draft_tokens = 0, accepted_tokens = 0;  // MTP drafts verified and accepted
  int64_t blocks_in_use = 0;                     // at the end (0 when every request ended)
  bool died = false;                             // a fault killed it
  bool stalled = false;                          // the run ended during its stall
  bool healthy = true;                           // as the gateway saw it at the end
  int64_t ejections = 0;                         // times the gateway ejected it (its failures)
};

struct SimulationRun {
  std::vector<bench::RequestResult> results;  // in workload order
  double duration_s = 0;                      // first send to last answer, virtual
  std::vector<EngineSummary> engines;
  // Over the engines that compute prompts: the prefill pool in P/D, every engine aggregated.
  double prefix_queries = 0, prefix_hits = 0;
  double draft_tokens = 0, accepted_tokens = 0;  // MTP, over every engine
  int64_t upstream_calls = 0;
  int64_t indexed_blocks = 0;   // distinct blocks in the gateway's prefix index at the end
  int64_t retries = 0;          // legs the gateway retried on another engine
  int64_t engine_failures = 0;  // calls to engines that failed: request legs and health probes
  int64_t timeouts = 0;         // engine calls that ended by their timeout (probes, polls too)
  int64_t kv_transfers = 0;     // P/D transfers completed
  double kv_transfer_bytes = 0;
  double virtual_end_s = 0;  // when the simulation stopped, from the first send
  double skipped_s = 0;      // of it, idle virtual time skipped (SimulationOptions::skip_idle)
};

// Engines of each pool at most (each is a whole engine in memory).
inline constexpr int kMaxEngines = 10000;
// The most a slow-link fault may slow an engine's links (a transfer's time must stay countable).
inline constexpr double kMaxSlowdown = 1e6;
// Each engine's KV blocks: tokens per block as `tandem engine` takes them, and bytes per token and
// layer a transfer moves (DeepSeek-V3's latent is 1,152; a dense model's with 128 KV heads of 128
// BF16 values 64 KiB). Every simulated engine holds one block's bytes of a layer (the simulated
// executor's KV pattern), so both are bounded, and so is that product over all engines.
inline constexpr int64_t kMaxBlockSize = 4096;
inline constexpr int64_t kMaxKvTokenBytes = int64_t{1} << 20;
inline constexpr int64_t kMaxKvBytesAllEngines = int64_t{16} << 30;
// KV blocks per engine (0: the preset's): the block manager keeps a record per block (24 bytes),
// so the blocks of all engines are bounded too (~10 GB of records).
inline constexpr int64_t kMaxNumBlocks = 100'000'000;
inline constexpr int64_t kMaxNumBlocksAllEngines = 400'000'000;
// The KV links: a transfer takes the latency plus its bytes over the bandwidth, and its time must
// stay countable on the virtual clock (virtual_time.h) with the slowest link and longest prompt.
inline constexpr double kMinLinkGbPerS = 1e-4, kMaxLinkGbPerS = 1e6;  // 100 KB/s..
inline constexpr double kMaxLinkLatencyUs = 1e9;                      // 1,000 s
// The KV transfer timeouts, seconds, as `tandem engine`'s flags take them (cli/engine_command.cpp):
// at least a millisecond (the transports count milliseconds) and at most int64 milliseconds'
// bound.
inline constexpr double kMinKvTransferTimeoutS = 0.001, kMaxKvTransferTimeoutS = 2147483.647;

// Throws tandem::Error for what simulate() would refuse before running anything: engine counts
// the mode cannot serve, an invalid topology or unknown policy, a fault on an engine the counts
// do not make, a fault time or slowdown out of range, a slow-link fault in the aggregated mode,
// scheduler limits below 1, an unknown latency model, a block size, KV bytes per token, block
// count, link or KV transfer timeout out of the bounds above (named by their `tandem simulate`
// flags). A sweep checks every point with it first.
void check_options(const SimulationOptions& options);

// Runs the workload (arrival_s from the start), making each request as it is sent. `tokenizer`
// is the engines' and the gateway's (options.gateway.model names its folder when the gateway
// tokenizes). Throws tandem::Error for a topology that cannot serve (no engines, an unknown
// policy), an unknown latency model, a fault on no engine, or an arrival time that is not one.
SimulationRun simulate(const bench::LazyWorkload& workload, const SimulationOptions& options,
                       std::shared_ptr<const text::Tokenizer> tokenizer);
SimulationRun simulate(const std::vector<bench::BenchRequest>& requests,
                       const SimulationOptions& options,
                       std::shared_ptr<const text::Tokenizer> tokenizer);

}  // namespace tandem::sim
