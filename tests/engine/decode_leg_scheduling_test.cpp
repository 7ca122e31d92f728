// A decode-role engine's legs, which receive their prompt's KV from a prefill engine, take the
// blocks to receive it into as the scheduler admits any waiting request (vLLM v1 allocates a
// remote-KV request in its waiting pass): in queue order, after the running sequences got
// theirs, never in a step that preempted and never past a head that does not fit. The KV events
// the engine records between steps are published when it records them, and its load counts the
// legs as waiting requests, not as prompts to compute.
//
// The engine runs a simulated executor in process, in virtual time: run_once() steps it, its
// clock moves 1/32 s after each step, and its KV transfers are fakes whose fetches end at once
// (at the next run_once) or when the test ends them. No sleeps, no wall-clock timing. One test
// runs the engine's own loop (start()) on the steady clock instead: what it checks is that loop's
// sleep.
#include <gtest/gtest.h>

#include <algorithm>
#include <future>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/fake_kv_transfers.h"
#include "engine/sim_engine_fixture.h"
#include "util/bounded_wait.h"
#include "util/metrics.h"

namespace tandem::engine {
namespace {

constexpr double kStep = 1.0 / 32;  // virtual seconds per run_once

using test::tokens;

class DecodeLegs : public ::testing::Test {
 protected:
  // Which clock the engine reads: the test's virtual one, moved by step(), or the steady clock,
  // for the engine's own loop (start()), which no test steps.
  enum class Clock { kVirtual, kSteady };

  // A decode-role engine of `blocks` blocks of 16 tokens, whose decode legs may wait for blocks
  // for `kv_transfer_timeout_s`.
  void start(int64_t blocks, Clock clock = Clock::kVirtual,
             double kv_transfer_timeout_s = KvTransferConfig{}.timeout_s) {
    EngineConfig config;
    config.role = EngineRole::kDecode;
    config.transfer = KvTransferConfig{};
    config.transfer->timeout_s = kv_transfer_timeout_s;
    if (clock == Clock::kVirtual) config.clock = [this] { return now_; };
    config.kv_event_sink = [this](KvEventBatch batch) { published_.push_back(std::move(batch)); };
    config.make_transfers = [this](Executor&, KvTransfers::Post post) {
      auto t = std::make_unique<test::FakeKvTransfers>(std::move(post));
      t->instant = true;  // unless a test says otherwise
      fake_ = t.get();
      return t;
    };
    engine_ = test::sim_engine(config, test::deepseek_v3_tokenizer(), registry_, blocks);
  }
  ~DecodeLegs() override {
    if (engine_) engine_->stop();
  }

  // A request of `prompt_tokens` from `base`, its final output kept in finished_; a decode leg
  // pulling its KV unless `local`.
  void submit(const std::string& id, int prompt_tokens, int base, int64_t max_tokens,
              bool local = false) {
    EngineRequest r = request(id, prompt_tokens, base, max_tokens, local);
    r.on_output = [this, id](const RequestOutput& o) {
      if (o.finished) finished_[id] = o;
    };
    engine_->submit(std::move(r));
  }

  // The request submit() sends, without its on_output.
  static EngineRequest request(const std::string& id, int prompt_tokens, int base,
                               int64_t max_tokens, bool local = false) {
    EngineRequest r;
    r.id = id;
    r.prompt = tokens(prompt_tokens, base);
    r.sampling.max_tokens = max_tokens;
    r.sampling.ignore_eos = true;
    if (!local) {
      KvTransferSpec& kt = r.kv_transfer;
      kt.mode = KvTransferSpec::Mode::kDecodeByPull;
      kt.host = "127.0.0.1";
      kt.port = 1;
      kt.engine_id = "prefill-0";
      kt.transfer_id = id;
    }
    return r;
  }

  void step() {
    engine_->run_once();
    now_ += kStep;
  }

  metrics::Registry registry_;
  std::unique_ptr<Engine> engine_;
  test::FakeKvTransfers* fake_ = nullptr;
  double now_ = 1000;
  std::map<std::string, RequestOutput> finished_;
  std::vector<KvEventBatch> published_;
};

// One long decode runs while a new short decode leg arrives at every step, more than the cache
// holds at once. The long one crosses block boundaries as it grows: a leg that took the blocks
// it needed ahead of it made it give way (all its KV lost), and once preempted it needed more
// blocks than the legs arriving after it, which took every block freed before it was looked at:
// it waited for as long as legs kept coming. Now the legs' blocks are given in the scheduler's
// waiting pass, after the running sequences', and the preempted one waits at the head of the
// queue, ahead of the legs that came after it: it finishes while they still arrive.
TEST_F(DecodeLegs, ALongDecodeFinishesWhileNewLegsKeepArriving) {
  start(8);
  submit("long", 40, 100, 60);  // 100 tokens at the end: 7 of the 8 blocks
  int legs = 0;
  for (int i = 0; i < 600 && !finished_.count("long"); ++i) {
    submit("leg" + std::to_string(legs), 20, 3000 + 50 * legs, 4);  // 24 tokens: 2 blocks
    ++legs;
    step();
  }
  ASSERT_TRUE(finished_.count("long"))
      << "the long decode did not finish while " << legs << " legs arrived";
  EXPECT_EQ(finished_["long"].finish_reason, "length");
  EXPECT_EQ(finished_["long"].completion_tokens, 60);
  // Every leg finishes too, and nothing stays allocated.
  for (int i = 0; i < 2000 && engine_->has_work(); ++i) step();
  for (int i = 0; i < legs; ++i) {
    const std::string id = "leg" + std::to_string(i);
    ASSERT_TRUE(finished_.count(id)) << id;
    EXPECT_EQ(finished_[id].finish_reason, "length") << id;
    EXPECT_EQ(finished_[id].completion_tokens, 4) << id;
  }
  EXPECT_EQ(engine_->load().free_blocks, 8);
}

// Blocks evicted from the prefix cache to receive a decode leg's KV are published at once: the
// pass that took them runs no step (the leg computes nothing until its KV is here), and the
// events waited for some later step, while the gateway's prefix index believed them cached.
TEST_F(DecodeLegs, BlocksEvictedForADecodeLegsKvArePublishedInThePassThatEvictedThem) {
  start(8);
  fake_->instant = false;
  submit("cached", 64, 100, 1, /*local=*/true);  // 4 full blocks that stay cached
  for (int i = 0; i < 20 && engine_->has_work(); ++i) step();
  ASSERT_TRUE(finished_.count("cached"));
  const int64_t cached_before = engine_->load().cached_blocks;
  ASSERT_EQ(cached_before, 4);
  published_.clear();
  submit("leg", 100, 9000, 4);  // 7 blocks: at least 3 of the cached ones go
  step();
  ASSERT_EQ(fake_->fetched, std::vector<std::string>{"leg"});
  const int64_t evicted = cached_before - engine_->load().cached_blocks;
  ASSERT_GT(evicted, 0);
  int64_t removed = 0;
  for (const KvEventBatch& batch : published_)
    for (const KvEvent& e : batch.events)
      if (const auto* r = std::get_if<BlockRemoved>(&e)) removed += int64_t(r->block_hashes.size());
  EXPECT_EQ(removed, evicted);
}

// A decode leg waiting for its KV is a waiting request (vLLM counts one waiting for remote KV
// in vllm:num_requests_waiting), and its prompt, computed by the prefill engine, is no prefill
// work of this engine's: /load counted it whole while the leg waited for blocks, as soon as it
// was submitted.
TEST_F(DecodeLegs, ALegWaitingForItsKvIsWaitingAndItsPromptIsNoQueuedPrefill) {
  start(8);
  fake_->instant = false;
  submit("long", 100, 100, 20, /*local=*/true);  // 7 blocks: the leg waits for blocks
  step();
  submit("leg", 40, 9000, 4);
  EXPECT_EQ(engine_->load().prefill_tokens, 0) << "submitted, not yet taken in";
  step();
  EXPECT_TRUE(fake_->fetched.empty());
  LoadReport load = engine_->load();
  EXPECT_EQ(load.running, 1);
  EXPECT_EQ(load.waiting, 1);
  EXPECT_EQ(load.prefill_tokens, 0);
  EXPECT_EQ(load.prefill_pairs, 0);
  for (int i = 0; i < 100 && fake_->fetched.empty(); ++i) step();
  ASSERT_EQ(fake_->fetched, std::vector<std::string>{"leg"});
  load = engine_->load();
  EXPECT_EQ(load.waiting, 1) << "receiving its KV";
  EXPECT_EQ(load.prefill_tokens, 0);
  fake_->fetches[0]({true, {}, 0});
  for (int i = 0; i < 100 && engine_->has_work(); ++i) step();
  ASSERT_TRUE(finished_.count("leg"));
  EXPECT_EQ(finished_["leg"].completion_tokens, 4);
  EXPECT_EQ(engine_->load().waiting, 0);
}

// While a leg waits for blocks, the engine thread sleeps until an event (a submission, an abort,
// a transfer's end: outside a step only these free blocks) or until the leg's wait runs out; it
// woke every 50 ms for a pass that scheduled nothing. The abort that frees the blocks gives them
// to the leg in the pass that takes the abort in.
TEST_F(DecodeLegs, ALegWaitingForBlocksWakesTheEngineByItselfOnlyWhenItsWaitRunsOut) {
  start(8);
  fake_->instant = false;
  submit("long", 100, 100, 20, /*local=*/true);  // 7 blocks: the leg waits for blocks
  step();
  EXPECT_EQ(engine_->wakes_by_itself_at(), std::numeric_limits<double>::infinity());
  const double arrival = now_;
  submit("leg", 40, 9000, 4);
  step();
  ASSERT_TRUE(fake_->fetched.empty());
  EXPECT_EQ(engine_->wakes_by_itself_at(), arrival + KvTransferConfig{}.timeout_s);
  engine_->abort("long");
  step();
  EXPECT_EQ(fake_->fetched, std::vector<std::string>{"leg"});
  EXPECT_EQ(engine_->wakes_by_itself_at(), std::numeric_limits<double>::infinity())
      << "receiving its KV: the fetch's end is an event";
}

// The engine's own loop, with nothing else to do, sleeps until a leg's wait for blocks runs out:
// nothing but that deadline wakes it (no submission, abort or transfer comes), so a loop that
// slept until an event only left the leg waiting forever, and its client with it.
TEST_F(DecodeLegs, TheEnginesOwnLoopFailsALegWhoseWaitForBlocksRunsOutWithNothingElseHappening) {
  start(8, Clock::kSteady, /*kv_transfer_timeout_s=*/0.2);
  fake_->instant = false;  // "holder" receives its KV for as long as the test runs
  EngineRequest holder = request("holder", 100, 100, 4);  // 7 of the 8 blocks
  holder.on_output = [](const RequestOutput&) {};         // aborted when the engine stops
  EngineRequest leg = request("leg", 40, 9000, 4);        // 3 blocks: it waits for them
  std::promise<RequestOutput> leg_final;
  leg.on_output = [&leg_final](const RequestOutput& o) {
    if (o.finished) leg_final.set_value(o);
  };
  engine_->submit(std::move(holder));
  engine_->submit(std::move(leg));
  engine_->start();
  std::future<RequestOutput> leg_done = leg_final.get_future();
  const RequestOutput out =
      testing::get_within(leg_done, testing::kHangGuard, "the leg waiting for blocks never ended");
  EXPECT_EQ(out.finish_reason, "error");
  EXPECT_EQ(out.error_status, 503);
  EXPECT_NE(out.error.find("no free KV blocks for the prompt's transfer within"), std::string::npos)
      << out.error;
  EXPECT_EQ(out.completion_tokens, 0);
}

}  // namespace
}  // namespace tandem::engine
