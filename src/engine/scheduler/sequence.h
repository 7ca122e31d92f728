#pragma once
// A request inside the engine: its tokens (prompt, then generated ids), how many of them are in
// the KV cache, and the per-request state that sampling and streaming need. Owned by the engine
// thread; the scheduler moves it between the waiting queue and the running batch.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "engine/output_processor.h"
#include "engine/sampler.h"

namespace tandem::engine {

// One update sent to whoever submitted the request. Called on the engine thread: keep it short.
using api::RequestOutput;
using OutputCallback = std::function<void(const RequestOutput&)>;

// How a request takes part in prefill/decode disaggregation (engine/transfer/kv_transfer.h).
struct KvTransferSpec {
  enum class Mode {
    kNone,
    kPrefillForPull,  // compute the prompt, hold its KV for a decode engine to pull
    kDecodeByPull,    // pull the prompt's KV from a prefill engine, then decode
    kPrefillForRoom,  // compute the prompt, push its KV to the room's decode engine
    kDecodeByRoom,    // register the room with the prefill engine, receive the KV, decode
  };
  Mode mode = Mode::kNone;
  std::string host;  // decode modes: the prefill engine's KV transfer server
  uint16_t port = 0;
  std::string engine_id, transfer_id;  // kDecodeByPull
  std::vector<int32_t> remote_blocks;  // kDecodeByPull
  uint64_t room = 0;                   // room modes: bootstrap_room
  bool prefill() const { return mode == Mode::kPrefillForPull || mode == Mode::kPrefillForRoom; }
  bool decode() const { return mode == Mode::kDecodeByPull || mode == Mode::kDecodeByRoom; }
};

// The choices the API made of one prompt (its n > 1), each an engine request of its own: the
// engine observes vllm:request_params_n and vllm:request_max_num_generation_tokens once for them
// all, when the last one finishes, as vLLM does for a parent request's children. Engine thread.
struct ChoiceGroup {
  explicit ChoiceGroup(int64_t choices) : n(choices), unfinished(choices) {}
  int64_t n;
  int64_t unfinished;
  int64_t max_generated = 0;
};

struct EngineRequest {
  std::string id;
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  int64_t priority = 0;  // lower runs earlier when the engine schedules by priority
  // Folded into the prefix cache's first block hash: only requests with the same salt share
  // cached blocks (the API's cache_salt, hashed).
  std::optional<uint64_t> cache_salt;
  int32_t logprobs = -1;  // -1: none; k >= 0: sampled token's logprob plus the k most likely
  // Prompt logprobs: -1 none; k >= 0: each prompt token's (after the first) logprob, rank and the
  // k most likely tokens, sent with the first generated token. The prefix cache is not read
  // until they are computed: a cached position has no logits.
  int32_t prompt_logprobs = -1;
  // A decode leg's prompt logprobs, computed by the prefill engine (api::PulledKv).
  std::vector<TokenLogprob> known_prompt_logprobs;
  KvTransferSpec kv_transfer;
  OutputCallback on_output;
  std::shared_ptr<ChoiceGroup> choices;  // null: a prompt asked for once (n = 1)
  // Set by Engine::submit (the engine's clock): latencies count from the request's arrival, as
  // vLLM's from its API server's, not from when the engine loop took it in after a step.
  double arrival_time = 0;
};

enum class SequenceStatus { kWaiting, kRunning, kFinished };

// Where a sequence stands in its prefill/decode KV transfer (engine thread; only the P/D
// coordinator, engine/transfer/pd_coordinator.h, changes it). Each transfer mode
// walks its own path:
//   decode legs:        kAwaitingBlocks (in the scheduler's waiting queue, which gives it blocks
//                       for its prompt's KV as it admits any request) -> kFetching -> kNone (KV
//                       arrived)                               \-> kFetchCancelled (finished
//                                                                   while fetching: dropped
//                                                                   when the transfer ends)
//   prefill for a room: kRoomOpen -> kRoomClosed (the room ended first) or kParked (finished,
//                       blocks kept for the room's transfer)
//   prefill for a pull: kNone -> kParked (finished, blocks held for the decode engine's pull)
enum class KvTransferState {
  kNone,
  kAwaitingBlocks,
  kFetching,
  kFetchCancelled,
  kRoomOpen,
  kRoomClosed,
  kParked
};

struct Sequence {
  // The sequence of `request`, its prompt moved to the start of `tokens`: the request it keeps
  // holds no second copy (each of n choices of a long prompt kept two).
  static std::unique_ptr<Sequence> of(EngineRequest request) {
    auto seq = std::make_unique<Sequence>();
    seq->num_prompt = static_cast<int64_t>(request.prompt.size());
    seq->tokens = std::move(request.prompt);
    seq->request = std::move(request);
    return seq;
  }

  EngineRequest request;
  std::vector<int32_t> tokens;  // prompt followed by generated ids
  int64_t num_prompt = 0;
  int64_t num_computed = 0;  // tokens whose latents are in the cache
  int64_t num_cached = 0;    // prompt tokens served from the prefix cache at first admission
  // Prompt tokens the prefix cache held when it arrived: its queued work until it is admitted
  // (admission looks again, and may find more or less).
  int64_t cached_on_arrival = 0;
  uint64_t arrival_order = 0;
  double arrival_time = 0, first_token_time = -1, last_token_time = -1;
  // When the engine loop took it in (vLLM's QUEUED event, which its engine core records between
  // steps): queue time begins; TTFT and e2e latency count from arrival_time (submission).
  double queued_time = 0;
  double first_scheduled_time = -1;  // its first step: queue time ends, prefill time begins
  int64_t num_preemptions = 0;
  bool admitted_once = false;
  KvTransferState kv_state = KvTransferState::kNone;
  uint64_t room_claim = 0;  // KvTransferAgent::open_room's claim (kPrefillForRoom)
  SequenceStatus status = SequenceStatus::kWaiting;
  std::unique_ptr<Sampler> sampler;
  std::unique_ptr<OutputProcessor> output;
  // Speculative decoding: tokens proposed after tokens.back(), verified by the next step (never
  // in `tokens`, the prefix cache or the counts until accepted), and the distribution each was
  // drawn from, [drafts, vocab] (empty for greedy requests).
  std::vector<int32_t> drafts;
  std::vector<float> draft_probs;
  // Prompt logprobs so far, of positions 1, 2, ... (kept across preemption: a recomputed prompt
  // is not scored again).
  std::vector<TokenLogprob> prompt_logprobs;

  int64_t num_generated() const { return static_cast<int64_t>(tokens.size()) - num_prompt; }
  // A transfer writes into its blocks (it may have been cancelled, and still runs).
  bool fetching() const {
    return kv_state == KvTransferState::kFetching || kv_state == KvTransferState::kFetchCancelled;
  }
  // A decode leg whose prompt's KV has not arrived: it waits for blocks to receive it into, or
  // receives it. Its prompt is not this engine's to compute.
  bool awaiting_kv() const { return kv_state == KvTransferState::kAwaitingBlocks || fetching(); }
  std::span<const int32_t> prompt() const { return {tokens.data(), size_t(num_prompt)}; }
  std::span<const int32_t> generated() const {
    return {tokens.data() + num_prompt, tokens.size() - size_t(num_prompt)};
  }
  // It asked for prompt logprobs that are not all computed yet.
  bool scoring_prompt() const {
    return request.prompt_logprobs >= 0 &&
           static_cast<int64_t>(prompt_logprobs.size()) + 1 < num_prompt;
  }
};

}  // namespace tandem::engine
