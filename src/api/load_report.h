#pragma once
// An engine's load as it reports it at GET /load, and as the gateway reads it: running and waiting
// sequences, KV blocks, the prefill work queued behind the step that runs now, and its recent
// step durations (the gateway learns the engine's batch times from them). docs/gateway.md,
// "Engine load reports", describes each field.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::api {

// One executed step.
struct StepRecord {
  uint64_t index = 0;  // 1 for the engine's first step
  int64_t seqs = 0, tokens = 0;
  double seconds = 0;
  int64_t prefill_pairs = -1;  // causal attention pairs of its prefill chunks; -1: not reported
};

struct LoadReport {
  static constexpr size_t kRecentSteps = 32;  // how many steps an engine reports
  // The engine process that wrote it (this_process_instance()); empty: not reported (an engine
  // that predates the field, another server). A different one means the engine restarted, even
  // when the new process has already run more steps than the old one had.
  std::string instance;
  int64_t running = 0, waiting = 0;
  int64_t free_blocks = 0, total_blocks = 0, block_size = 0;
  int64_t tokens_in_flight = 0;  // prompt + generated tokens of running and waiting requests
  double kv_usage = 0;           // fraction of blocks in use
  int64_t cached_blocks = 0;     // blocks findable by the prefix cache (in use or evictable)
  uint64_t steps = 0;
  // Prompt tokens still to compute (uncached, not yet prefilled), not counting those of the step
  // that runs now: the prefill work queued behind it, and its attention pairs (-1: not reported).
  int64_t prefill_tokens = 0;
  int64_t prefill_pairs = -1;
  int64_t max_batch_tokens = 0;        // the engine's chunked-prefill budget; 0: not said
  bool schedules_by_priority = false;  // it orders prefills by the requests' `priority`
  // The step that runs now (step_seqs 0: none): its size and how long it has run.
  int64_t step_seqs = 0, step_tokens = 0;
  int64_t step_prefill_pairs = -1;  // -1: not reported
  double step_running_for_s = 0;
  std::vector<StepRecord> recent_steps;  // oldest first
};

// This process's identity for its /load reports: 16 lowercase hex digits of a random 64-bit
// number drawn (std::random_device) on the first call and the same for the process's life.
const std::string& this_process_instance();

// The gateway's poll asks only for the steps it has not seen: GET /load?since_step=N (docs/
// gateway.md). An engine answers with its recent steps after step N, or all of them when N is
// beyond its newest (a restarted engine, whose indices start again); one that ignores the
// parameter sends them all, which the gateway reads the same way.
std::string load_target(uint64_t since_step);
// The N of a /load target ("/load?since_step=N"); 0 when absent or not a number.
uint64_t load_since_step(std::string_view target);
// The /load body, with the recent steps after `since_step` as above.
std::string to_json(const LoadReport& report, uint64_t since_step = 0);

// Whether a parsed /load body describes an engine: every Tandem engine reports its KV cache. Other
// servers answer GET /load with other objects (vLLM's {"server_load": N}, a proxy's fixed reply),
// which parse_load_report reads as an engine with nothing free.
bool describes_an_engine(const LoadReport& report);

// Parses a /load body. Throws tandem::Error naming the field and what was expected; unknown
// fields are ignored, missing optional ones keep their defaults (pairs: -1).
LoadReport parse_load_report(std::string_view body);

}  // namespace tandem::api
