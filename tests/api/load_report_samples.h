#pragma once
// A /load body as `tandem engine` wrote it before it reported attention pairs, while a step of 2
// sequences and 2048 tokens ran: what the gateway must still read from engines of that version.
namespace tandem::api::samples {

inline constexpr const char* kRunningStepReport =
    R"({"running":2,"waiting":3,"free_blocks":900,"total_blocks":1024,
  "block_size":16,"tokens_in_flight":5000,"kv_usage":0.12,"cached_blocks":40,"steps":17,
  "prefill_tokens":6000,"max_batch_tokens":2048,
  "step":{"seqs":2,"tokens":2048,"running_for_s":0.05},
  "recent_steps":[[15,1,2048,0.25],[16,2,2048,0.25],[17,2,2048,0.25]]})";

}  // namespace tandem::api::samples
