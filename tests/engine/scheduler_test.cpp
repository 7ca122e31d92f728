// The scheduler as a pure policy over the KV-cache manager: token budget (chunked prefill),
// running limit, preemption of the newest sequence when blocks run out, priority order, prefix
// reuse, and a randomized run checking that every sequence completes with its blocks accounted.
#include "engine/scheduler/scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>

namespace tandem::engine {
namespace {

// What a sampled item yields: these tokens (accepted drafts, then the sampled one) and drafts.
StepTokens tokens(std::vector<int32_t> ids, std::vector<int32_t> drafts = {}) {
  StepTokens s;
  for (auto id : ids) s.tokens.push_back({id, 0, {}});
  s.drafts = std::move(drafts);
  return s;
}

struct Fixture {
  KvCacheManager kv;
  Scheduler sched;
  std::vector<std::unique_ptr<Sequence>> seqs;
  Fixture(int64_t blocks, int64_t block_size, SchedulerConfig cfg, bool prefix = true,
          KvCacheOptions kv_options = {})
      : kv(blocks, block_size, prefix, kv_options), sched(cfg, kv) {}

  Sequence* add(std::vector<int32_t> prompt, int64_t max_tokens, int64_t priority = 0,
                std::optional<uint64_t> cache_salt = std::nullopt) {
    auto s = std::make_unique<Sequence>();
    s->request.id = std::to_string(seqs.size());
    s->request.sampling.max_tokens = max_tokens;
    s->request.priority = priority;
    s->request.cache_salt = cache_salt;
    s->tokens = std::move(prompt);
    s->num_prompt = static_cast<int64_t>(s->tokens.size());
    s->arrival_order = seqs.size();
    seqs.push_back(std::move(s));
    sched.add(seqs.back().get());
    return seqs.back().get();
  }

  // Runs one step as the engine would: sampled sequences get token 7; those that reached
  // max_tokens finish.
  SchedulerOutput step(double now = 0) {
    auto out = sched.schedule();
    const std::vector<StepTokens> sampled(out.scheduled.size(), tokens({7}));
    for (const auto& u : sched.update_from_output(out, sampled, now))
      if (u.output.finished) sched.remove(u.seq);
    kv.check_invariants();
    return out;
  }
};

std::vector<int32_t> iota_tokens(int n, int first = 1) {
  std::vector<int32_t> v(n);
  for (int i = 0; i < n; ++i) v[i] = first + i;
  return v;
}

// A step in which `a`'s drafts gave way to `b`, which needs `b_tokens` computed: nobody is
// preempted; `a` is served first, its one token without drafts (they are dropped) in its one
// block, then `b` with its tokens in two blocks.
void expect_drafts_gave_way(const SchedulerOutput& out, const Fixture& f, const Sequence* a,
                            const Sequence* b, int64_t b_tokens) {
  EXPECT_TRUE(out.preempted.empty());
  ASSERT_EQ(out.scheduled.size(), 2u);
  EXPECT_EQ(out.scheduled[0].seq, a);
  EXPECT_EQ(out.scheduled[0].num_new_tokens, 1);
  EXPECT_EQ(out.scheduled[0].num_drafts, 0);
  EXPECT_TRUE(a->drafts.empty());
  EXPECT_EQ(out.scheduled[1].seq, b);
  EXPECT_EQ(out.scheduled[1].num_new_tokens, b_tokens);
  EXPECT_EQ(out.num_tokens, 1 + b_tokens);
  EXPECT_EQ(f.kv.block_table(a->request.id).size(), 1u);
  EXPECT_EQ(f.kv.block_table(b->request.id).size(), 2u);
}

// Drafts take blocks only while the cache has room for them: a sequence served after them that
// needs a block gets the drafts' block back, and no one is preempted.
TEST(Scheduler, AnotherSequencesDraftsGiveBackTheBlockBeforeAnyoneIsPreempted) {
  Fixture f(3, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 64});
  Sequence* a = f.add(iota_tokens(3), 20);
  Sequence* b = f.add(iota_tokens(4, 100), 20);
  auto out = f.sched.schedule();  // both prompts: a block each, one left
  ASSERT_EQ(out.scheduled.size(), 2u);
  f.sched.update_from_output(out, std::vector{tokens({7}, {8, 9, 10}), tokens({11})}, 0);
  ASSERT_EQ(a->drafts.size(), 3u);
  // a (served first) would put its three drafts in the last block; b's next token needs it.
  out = f.sched.schedule();
  ASSERT_NO_FATAL_FAILURE(expect_drafts_gave_way(out, f, a, b, 1));
  f.sched.update_from_output(out, std::vector{tokens({12}), tokens({13})}, 1);
  EXPECT_EQ(a->num_computed, 4);
  EXPECT_EQ(b->num_computed, 5);
  f.kv.check_invariants();
}

// A cache salt (the API's cache_salt) keeps a request's cached blocks to requests of the same
// salt: another salt, or none, finds nothing of them.
TEST(Scheduler, OnlyRequestsWithTheSameCacheSaltShareCachedBlocks) {
  Fixture f(32, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 64});
  f.add(iota_tokens(9), 1, 0, 7);
  f.step();  // its two full blocks enter the cache under salt 7; it finishes
  Sequence* other_salt = f.add(iota_tokens(9), 1, 0, 8);
  f.step();
  EXPECT_EQ(other_salt->num_cached, 0);
  Sequence* no_salt = f.add(iota_tokens(9), 1);
  f.step();
  EXPECT_EQ(no_salt->num_cached, 0);
  Sequence* same_salt = f.add(iota_tokens(9), 1, 0, 7);
  f.step();
  EXPECT_EQ(same_salt->num_cached, 8);
}

// A request that scores its prompt (prompt_logprobs, echo with logprobs) skips the prefix lookup
// and computes every block, and still caches them under its salt. It cached them unsalted: any
// request without the salt (another tenant) was then served its KV, and its own tenant missed.
TEST(Scheduler, ARequestScoringItsPromptCachesItsBlocksUnderItsSalt) {
  Fixture f(32, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 64});
  const std::vector<int32_t> prompt = iota_tokens(9);
  Sequence* scoring = f.add(prompt, 1, 0, 7);
  scoring->request.prompt_logprobs = 0;
  auto out = f.sched.schedule();
  StepTokens st = tokens({7});
  st.prompt_at = 1;
  for (size_t p = 1; p < prompt.size(); ++p) st.prompt.push_back({prompt[p], 0, {}});
  for (const auto& u : f.sched.update_from_output(out, std::vector{st}, 0))
    if (u.output.finished) f.sched.remove(u.seq);
  f.kv.check_invariants();
  EXPECT_EQ(f.kv.find_cached_prefix(prompt, 7).num_tokens, 8);
  EXPECT_EQ(f.kv.find_cached_prefix(prompt).num_tokens, 0);
  Sequence* no_salt = f.add(prompt, 1);
  f.step();
  EXPECT_EQ(no_salt->num_cached, 0);
  Sequence* same_salt = f.add(prompt, 1, 0, 7);
  f.step();
  EXPECT_EQ(same_salt->num_cached, 8);
}

// update_from_output applies a step's tokens: sequences that sampled get their token appended and
// one update each (the token, counts, first-token flag, time since their previous token, the
// finish at max_tokens); a prefill chunk that does not reach the prompt's end gets none.
TEST(Scheduler, UpdateFromOutputAppliesTokensAndReportsFinishes) {
  Fixture f(64, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 12});
  Sequence* a = f.add(iota_tokens(5), 2);
  Sequence* b = f.add(iota_tokens(15, 100), 1);  // its prefill takes two steps (7 + 8)
  auto out = f.sched.schedule();
  std::vector<StepTokens> sampled;
  for (size_t i = 0; i < out.scheduled.size(); ++i)
    sampled.push_back(tokens({static_cast<int32_t>(50 + i)}));
  auto updates = f.sched.update_from_output(out, sampled, 10.0);
  ASSERT_EQ(updates.size(), 1u);  // b's chunk stopped short of its prompt's end
  EXPECT_EQ(updates[0].seq, a);
  EXPECT_TRUE(updates[0].first_token);
  EXPECT_EQ(updates[0].since_last_token_s, -1);
  EXPECT_EQ(updates[0].output.tokens, (std::vector<int32_t>{50}));
  EXPECT_EQ(updates[0].output.prompt_tokens, 5);
  EXPECT_EQ(updates[0].output.completion_tokens, 1);
  EXPECT_FALSE(updates[0].output.finished);
  EXPECT_EQ(a->tokens.back(), 50);
  EXPECT_EQ(a->num_computed, 5);
  EXPECT_EQ(b->num_generated(), 0);

  out = f.sched.schedule();
  sampled.assign(out.scheduled.size(), tokens({60}));
  updates = f.sched.update_from_output(out, sampled, 10.5);
  ASSERT_EQ(updates.size(), 2u);
  for (const auto& u : updates) {
    EXPECT_TRUE(u.output.finished) << u.seq->request.id;
    EXPECT_EQ(u.output.finish_reason, "length");
  }
  const auto& ua = updates[0].seq == a ? updates[0] : updates[1];
  EXPECT_FALSE(ua.first_token);
  EXPECT_DOUBLE_EQ(ua.since_last_token_s, 0.5);
  EXPECT_EQ(ua.output.completion_tokens, 2);
  EXPECT_DOUBLE_EQ(b->first_token_time, 10.5);
}

// Speculative decoding: drafts ride with the decode token; the step's accepted drafts and its
// sampled token are appended; the rejected drafts' KV is not counted as computed, their blocks
// go back and no prefix-cache hash ever covers them.
TEST(Scheduler, RejectedDraftsLeaveNoBlockAndNoCachedHash) {
  Fixture f(32, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 64, .speculative_lookahead = 2});
  Sequence* a = f.add(iota_tokens(7), 20);
  auto out = f.sched.schedule();  // the prompt; room for the draft passes past it
  ASSERT_EQ(out.scheduled[0].num_new_tokens, 7);
  EXPECT_EQ(f.kv.block_table("0").size(), 3u);  // 7 + 2 positions
  f.sched.update_from_output(out, std::vector{tokens({100}, {101, 102, 103})}, 0);
  EXPECT_EQ(a->num_computed, 7);
  EXPECT_EQ(a->drafts, (std::vector<int32_t>{101, 102, 103}));
  EXPECT_EQ(f.kv.block_table("0").size(), 2u);  // the scratch block went back
  f.kv.check_invariants();

  out = f.sched.schedule();  // 100 and its three drafts, positions 7..10, + 2 of lookahead
  ASSERT_EQ(out.scheduled[0].num_new_tokens, 4);
  EXPECT_EQ(out.scheduled[0].num_drafts, 3);
  EXPECT_EQ(f.kv.block_table("0").size(), 4u);  // 13 positions
  // 101 accepted, 102 rejected (replaced by 55): 103 is dropped.
  auto updates = f.sched.update_from_output(out, std::vector{tokens({101, 55}, {56, 57, 58})}, 1);
  ASSERT_EQ(updates.size(), 1u);
  EXPECT_EQ(updates[0].output.tokens, (std::vector<int32_t>{101, 55}));
  EXPECT_EQ(a->tokens, (std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 100, 101, 55}));
  EXPECT_EQ(a->num_computed, 9);                // 100 and 101 are in the cache; 55 is next
  EXPECT_EQ(f.kv.block_table("0").size(), 3u);  // 10 tokens; the rest went back
  EXPECT_EQ(f.kv.num_cached_blocks(), 2);       // blocks of 1..4 and 5..8, nothing of a draft
  EXPECT_EQ(f.kv.num_free_blocks(), 29);
  f.kv.check_invariants();

  // A step that stops mid-run (max_tokens) drops what follows and finishes.
  a->request.sampling.max_tokens = 5;
  out = f.sched.schedule();
  EXPECT_EQ(out.scheduled[0].num_drafts, 1);  // 3 generated, 2 to go: one draft is enough
  updates = f.sched.update_from_output(out, std::vector{tokens({56, 70})}, 2);
  EXPECT_TRUE(updates[0].output.finished);
  EXPECT_EQ(a->num_generated(), 5);
  EXPECT_TRUE(a->drafts.empty());
  f.sched.remove(a);
  EXPECT_EQ(f.kv.num_free_blocks(), 32);
}

TEST(Scheduler, ChunkedPrefillRespectsTokenBudget) {
  Fixture f(64, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 10});
  Sequence* a = f.add(iota_tokens(25), 3);
  auto out = f.step();
  ASSERT_EQ(out.scheduled.size(), 1u);
  EXPECT_EQ(out.scheduled[0].num_new_tokens, 10);
  EXPECT_FALSE(out.scheduled[0].sample);
  f.step();
  out = f.step();  // the last 5 prompt tokens, then a sample
  EXPECT_EQ(out.scheduled[0].num_new_tokens, 5);
  EXPECT_TRUE(out.scheduled[0].sample);
  EXPECT_EQ(a->num_computed, 25);
  EXPECT_EQ(a->num_generated(), 1);
  out = f.step();  // decode: one token
  EXPECT_EQ(out.scheduled[0].num_new_tokens, 1);
}

TEST(Scheduler, DecodeGoesBeforeNewPrefill) {
  Fixture f(64, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 8});
  Sequence* a = f.add(iota_tokens(8), 5);
  f.step();  // a's prefill uses the whole budget
  Sequence* b = f.add(iota_tokens(20, 100), 5);
  auto out = f.step();
  ASSERT_EQ(out.scheduled.size(), 2u);
  EXPECT_EQ(out.scheduled[0].seq, a);
  EXPECT_EQ(out.scheduled[0].num_new_tokens, 1);
  EXPECT_EQ(out.scheduled[1].seq, b);
  EXPECT_EQ(out.scheduled[1].num_new_tokens, 7);
  EXPECT_EQ(out.num_tokens, 8);
}

TEST(Scheduler, MaxNumSeqsLimitsTheRunningBatch) {
  Fixture f(64, 4, {.max_num_seqs = 2, .max_num_batched_tokens = 100});
  for (int i = 0; i < 4; ++i) f.add(iota_tokens(3, 10 * i + 1), 2);
  auto out = f.step();
  EXPECT_EQ(out.scheduled.size(), 2u);
  EXPECT_EQ(f.sched.waiting().size(), 2u);
}

TEST(Scheduler, PreemptsTheNewestWhenBlocksRunOut) {
  // 4 blocks of 4 tokens: two sequences of 6 prompt tokens need 2 blocks each; the first decode
  // that crosses into a third block must preempt the newest sequence.
  Fixture f(4, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 100}, /*prefix=*/false);
  Sequence* a = f.add(iota_tokens(6), 10);
  Sequence* b = f.add(iota_tokens(6, 50), 10);
  f.step();             // both prefills; both sample token 7 (7 tokens)
  f.step();             // both decode position 6 (blocks still 2 each); 8 tokens
  auto out = f.step();  // position 7 fits; 9 tokens each
  out = f.step();       // position 8 needs a third block for a: b is preempted
  ASSERT_EQ(out.preempted.size(), 1u);
  EXPECT_EQ(out.preempted[0], b);
  EXPECT_EQ(b->num_computed, 0);
  EXPECT_EQ(b->status, SequenceStatus::kWaiting);
  EXPECT_EQ(f.sched.waiting().front(), b);
  // Nothing is lost: run to completion and both finish with all their tokens.
  for (int i = 0; i < 200 && !(f.sched.running().empty() && f.sched.waiting().empty()); ++i)
    f.step();
  EXPECT_EQ(a->num_generated(), 10);
  EXPECT_EQ(b->num_generated(), 10);
  EXPECT_EQ(f.kv.num_free_blocks(), 4);
}

// A sequence added holding the blocks of its received KV, as a decode leg joins the scheduler
// (PdCoordinator: allocated for the whole prompt, all but the last token computed).
Sequence* add_with_received_kv(Fixture& f, std::vector<int32_t> prompt, int64_t max_tokens) {
  auto s = std::make_unique<Sequence>();
  s->request.id = std::to_string(f.seqs.size());
  s->request.sampling.max_tokens = max_tokens;
  s->tokens = std::move(prompt);
  s->num_prompt = static_cast<int64_t>(s->tokens.size());
  s->arrival_order = f.seqs.size();
  EXPECT_TRUE(f.kv.allocate(s->request.id, s->num_prompt, f.kv.find_cached_prefix(s->tokens)));
  s->num_computed = s->num_prompt - 1;
  f.seqs.push_back(std::move(s));
  f.sched.add(f.seqs.back().get());
  return f.seqs.back().get();
}

// A decode leg waiting for the blocks to receive its prompt's KV into (PdCoordinator::admit).
Sequence* add_decode_leg(Fixture& f, std::vector<int32_t> prompt, int64_t max_tokens) {
  Sequence* s = f.add(std::move(prompt), max_tokens);
  s->kv_state = KvTransferState::kAwaitingBlocks;
  return s;
}

// Its KV arrived (PdCoordinator::on_fetch_done): all but the prompt's last token computed.
void receive_kv(Sequence* s) {
  s->kv_state = KvTransferState::kNone;
  s->num_computed = s->num_prompt - 1;
}

// Runs steps until every sequence has finished; false if that takes more than `limit` steps or a
// step schedules nothing.
bool run_to_completion(Fixture& f, int limit = 200) {
  for (int i = 0; i < limit; ++i) {
    if (f.sched.running().empty() && f.sched.waiting().empty()) return true;
    if (f.step().empty()) return false;
  }
  return false;
}

// The one running sequence needs a block and the last one holds a decode leg's received KV: the
// running sequence gives way, and the decode leg, which needs no block, runs in that step. Before,
// the step scheduled nothing (no admission after a preemption), and the engine waited for an
// outside event with a sequence ready to run (the simulator never stepped again).
TEST(Scheduler, ADecodeLegHoldingItsBlocksRunsInTheStepItsNeighbourGaveWayTo) {
  Fixture f(3, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 64});
  Sequence* x = f.add(iota_tokens(8), 4);               // 12 tokens: its KV fits the cache
  f.step();                                             // x: 9 tokens, 8 computed, in 2 blocks
  Sequence* d = add_with_received_kv(f, {9, 9, 9}, 2);  // the third block
  ASSERT_EQ(f.kv.num_free_blocks(), 0);
  auto out = f.step();
  ASSERT_EQ(out.preempted, std::vector<Sequence*>{x});
  ASSERT_EQ(out.scheduled.size(), 1u);
  EXPECT_EQ(out.scheduled[0].seq, d);
  EXPECT_EQ(out.scheduled[0].num_new_tokens, 1);
  EXPECT_TRUE(out.scheduled[0].sample);
  ASSERT_TRUE(run_to_completion(f));
  EXPECT_EQ(x->num_generated(), 4);
  EXPECT_EQ(d->num_generated(), 2);
  EXPECT_EQ(f.kv.num_free_blocks(), 3);
}

// A decode leg gets the blocks of its whole prompt in the waiting pass and computes nothing: it
// is listed for its fetch and stays waiting, passed over while the fetch runs (nothing to
// schedule), and once its KV is here it runs holding those blocks.
TEST(Scheduler, ADecodeLegTakesItsPromptsBlocksWhenAdmittedAndRunsOnceItsKvIsHere) {
  Fixture f(8, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 64}, /*prefix=*/false);
  Sequence* d = add_decode_leg(f, iota_tokens(10), 2);
  auto out = f.step();
  EXPECT_TRUE(out.empty());
  EXPECT_EQ(out.fetches, std::vector<Sequence*>{d});
  EXPECT_EQ(f.kv.block_table(d->request.id).size(), 3u);
  EXPECT_EQ(d->status, SequenceStatus::kWaiting);
  d->kv_state = KvTransferState::kFetching;
  EXPECT_FALSE(f.sched.has_schedulable());
  out = f.step();
  EXPECT_TRUE(out.empty());
  EXPECT_TRUE(out.fetches.empty());
  receive_kv(d);
  EXPECT_TRUE(f.sched.has_schedulable());
  out = f.step();
  ASSERT_EQ(out.scheduled.size(), 1u);
  EXPECT_EQ(out.scheduled[0].seq, d);
  EXPECT_EQ(out.scheduled[0].num_new_tokens, 1);
  EXPECT_TRUE(out.scheduled[0].sample);
  ASSERT_TRUE(run_to_completion(f));
  EXPECT_EQ(d->num_generated(), 2);
  EXPECT_EQ(f.kv.num_free_blocks(), 8);
}

// A decode leg's blocks follow the rules of any admission (vLLM v1 allocates a remote-KV request
// in its waiting pass): the running sequences get theirs first, none go to it in a step that
// preempted, and none past a head of the queue that does not fit, such as a preempted sequence,
// which therefore runs again before the leg takes a block.
TEST(Scheduler, ADecodeLegsBlocksComeAfterTheRunningAndThePreemptedSequences) {
  Fixture f(4, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 64}, /*prefix=*/false);
  Sequence* x = f.add(iota_tokens(8), 6);
  Sequence* y = f.add(iota_tokens(3, 50), 6);
  f.step();  // x: 2 blocks, y: 1; one free
  Sequence* d = add_decode_leg(f, iota_tokens(3, 90), 2);
  bool fetched = false;
  for (int i = 0; i < 100 && !fetched; ++i) {
    auto out = f.step();
    if (out.fetches.empty()) continue;
    fetched = true;
    EXPECT_EQ(out.fetches, std::vector<Sequence*>{d});
    EXPECT_TRUE(out.preempted.empty());
    EXPECT_NE(y->status, SequenceStatus::kWaiting) << "the leg passed the preempted head";
    d->kv_state = KvTransferState::kFetching;
  }
  ASSERT_TRUE(fetched);
  EXPECT_GT(y->num_preemptions, 0);
  EXPECT_EQ(x->num_preemptions, 0);
  receive_kv(d);
  ASSERT_TRUE(run_to_completion(f));
  EXPECT_EQ(x->num_generated(), 6);
  EXPECT_EQ(y->num_generated(), 6);
  EXPECT_EQ(d->num_generated(), 2);
  EXPECT_EQ(f.kv.num_free_blocks(), 4);
}

// A sequence holding its blocks (a decode leg whose KV arrived) is admitted in its turn, as any
// waiting sequence (vLLM v1 sends a request whose remote KV arrived through its waiting pass like
// any other): not in a step that preempted. It was, as adding no memory pressure; but it grows as
// it decodes and, the newest running, was the next to give way: its received KV was thrown away,
// its prompt computed here, and it went back to the queue ahead of the sequence it had passed.
TEST(Scheduler, AfterAPreemptionASequenceHoldingItsBlocksWaitsItsTurn) {
  Fixture f(4, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 64}, /*prefix=*/false);
  Sequence* x = f.add(iota_tokens(8), 6);
  Sequence* y = f.add(iota_tokens(3, 50), 6);
  f.step();                                             // x: 2 blocks, y: 1
  Sequence* d = add_with_received_kv(f, {9, 9, 9}, 4);  // the fourth
  auto out = f.step();  // x's ninth token needs a block: y, the newest, gives way
  ASSERT_EQ(out.preempted, std::vector<Sequence*>{y});
  ASSERT_GE(out.scheduled.size(), 1u);
  EXPECT_EQ(out.scheduled.size(), 1u);
  EXPECT_EQ(out.scheduled[0].seq, x);
  EXPECT_EQ(f.sched.waiting(), (std::deque<Sequence*>{y, d}));
  // x's thirteenth token needs the block d holds: x gives way, and d, behind the head x that does
  // not fit, runs then (nothing else runs: the head waits for d's blocks, which only d's end
  // frees).
  ASSERT_TRUE(run_to_completion(f));
  EXPECT_EQ(d->num_preemptions, 0) << "its received KV was thrown away";
  EXPECT_EQ(x->num_generated(), 6);
  EXPECT_EQ(y->num_generated(), 6);
  EXPECT_EQ(d->num_generated(), 4);
  EXPECT_EQ(f.kv.num_free_blocks(), 4);
}

// By priority, an urgent decode leg takes its blocks before a running prefill that then finds
// none and gives way; the second admission pass that follows passes over the leg, which holds its
// blocks already: it is listed for one fetch, not two (two transfers into the same blocks, the
// second pulling KV the prefill engine had let go of).
TEST(Scheduler, ADecodeLegGivenItsBlocksIsListedForOneFetchWhenTheStepAdmitsAgain) {
  Fixture f(8, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 20, .priority = true},
            /*prefix=*/false);
  Sequence* a = f.add(iota_tokens(28), 2, /*priority=*/1);
  f.step();  // a: 20 of 28 prompt tokens in 5 blocks
  ASSERT_EQ(a->num_computed, 20);
  Sequence* leg = add_decode_leg(f, iota_tokens(12, 100), 2);  // priority 0: 3 blocks
  const auto out = f.step();
  ASSERT_EQ(out.preempted, std::vector<Sequence*>{a});
  EXPECT_EQ(out.fetches, std::vector<Sequence*>{leg});
  EXPECT_EQ(f.kv.block_table(leg->request.id).size(), 3u);
}

// When every running sequence had to give way, the waiting ones are admitted in the same step
// (as the next step would admit them): a step never schedules nothing while something fits.
// By priority, a short urgent prompt that came meanwhile fits the blocks the preempted sequence
// freed, while its own blocks elsewhere (a finished prefill's KV held for its transfer) stay.
TEST(Scheduler, AStepWhoseOnlyRunningSequenceGaveWayAdmitsWhatFits) {
  Fixture f(3, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 64, .priority = true},
            /*prefix=*/false);
  ASSERT_TRUE(f.kv.allocate("held for a transfer", 4));
  Sequence* x = f.add(iota_tokens(8), 4, /*priority=*/1);
  f.step();  // x: 9 tokens, 8 computed, in 2 blocks
  Sequence* urgent = f.add(iota_tokens(2, 50), 1, /*priority=*/0);
  auto out = f.step();
  ASSERT_EQ(out.preempted, std::vector<Sequence*>{x});
  ASSERT_EQ(out.scheduled.size(), 1u);
  EXPECT_EQ(out.scheduled[0].seq, urgent);
  EXPECT_EQ(urgent->num_generated(), 1);
  // x needs 3 blocks, 2 are free: it waits for the held block, scheduling nothing (no spin).
  EXPECT_TRUE(f.step().empty());
  f.kv.free("held for a transfer");
  ASSERT_TRUE(run_to_completion(f));
  EXPECT_EQ(x->num_generated(), 4);
}

// The speculation space of running sequences (their drafts, the draft passes' lookahead) gives
// way to a new request it keeps out: the cache had room for it, so it was taken, never at a
// waiting request's expense. Before, B waited until A finished (8 steps).
TEST(Scheduler, SpeculationSpaceGivesWayToAnAdmissionItKeepsOut) {
  Fixture f(4, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 64, .speculative_lookahead = 2});
  Sequence* a = f.add(iota_tokens(3), 9);
  auto out = f.sched.schedule();
  f.sched.update_from_output(out, std::vector{tokens({4}, {50, 51, 52})}, 0);
  Sequence* b = f.add(iota_tokens(5, 100), 1);  // 2 blocks
  out = f.sched.schedule();
  // a's token and drafts (positions 3..6) and lookahead (to 8) would take 3 blocks.
  ASSERT_NO_FATAL_FAILURE(expect_drafts_gave_way(out, f, a, b, 5));
  f.sched.update_from_output(out, std::vector{tokens({5}), tokens({6})}, 1);
  f.kv.check_invariants();
}

// ... but only when giving way lets the request in: one too large for the cache's free blocks
// even then leaves the drafts alone.
TEST(Scheduler, SpeculationSpaceStaysWhenGivingItUpWouldNotAdmitTheRequest) {
  Fixture f(4, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 64, .speculative_lookahead = 2});
  Sequence* a = f.add(iota_tokens(3), 9);
  auto out = f.sched.schedule();
  f.sched.update_from_output(out, std::vector{tokens({4}, {50, 51, 52})}, 0);
  f.add(iota_tokens(13, 100), 1);  // 4 blocks: a holds 1 whatever happens
  out = f.sched.schedule();
  ASSERT_EQ(out.scheduled.size(), 1u);
  EXPECT_EQ(out.scheduled[0].seq, a);
  EXPECT_EQ(out.scheduled[0].num_drafts, 3);
  EXPECT_EQ(f.kv.block_table("0").size(), 3u);
}

// The prefix-cache statistics (vllm:prefix_cache_queries/hits) count a request's lookup once: a
// preempted sequence finding its own blocks again when readmitted is not a new query.
TEST(Scheduler, APreemptedSequencesReadmissionIsNotCountedAsAPrefixCacheQuery) {
  Fixture f(4, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 100});
  Sequence* a = f.add(iota_tokens(6), 10);
  Sequence* b = f.add(iota_tokens(6, 50), 10);
  int64_t preempted = 0;
  for (int i = 0; i < 100 && !(f.sched.running().empty() && f.sched.waiting().empty()); ++i)
    preempted += static_cast<int64_t>(f.step().preempted.size());
  ASSERT_GT(preempted, 0);
  EXPECT_EQ(a->num_generated(), 10);
  EXPECT_EQ(b->num_generated(), 10);
  const PrefixCacheStats& stats = f.kv.prefix_cache_stats();
  EXPECT_EQ(stats.requests, 2);
  EXPECT_EQ(stats.queries, 12);
  EXPECT_EQ(stats.hits, 0);
}

TEST(Scheduler, PriorityPolicyAdmitsLowerValuesFirstAndPreemptsTheLowestPriority) {
  Fixture f(64, 4, {.max_num_seqs = 1, .max_num_batched_tokens = 100, .priority = true});
  f.add(iota_tokens(3), 1, /*priority=*/5);
  Sequence* urgent = f.add(iota_tokens(3, 20), 1, /*priority=*/-1);
  auto out = f.step();
  ASSERT_EQ(out.scheduled.size(), 1u);
  EXPECT_EQ(out.scheduled[0].seq, urgent);
}

TEST(Scheduler, ByPriorityAnUrgentPromptTakesTheBudgetFromALongPrefillPartWayThrough) {
  Fixture f(64, 4, {.max_num_seqs = 4, .max_num_batched_tokens = 10, .priority = true});
  Sequence* decoding = f.add(iota_tokens(3, 100), 5, /*priority=*/9);
  f.step();  // prefilled, first token sampled: decoding from now on
  Sequence* long_prompt = f.add(iota_tokens(40), 1, /*priority=*/5);
  f.step();  // the decode token and 9 of the long prompt's 40
  EXPECT_EQ(long_prompt->num_computed, 9);
  Sequence* urgent = f.add(iota_tokens(6, 50), 1, /*priority=*/1);
  auto out = f.step();
  // The decode token first whatever its priority, then the urgent prompt whole, then the rest of
  // the budget to the long prompt, which kept its blocks.
  ASSERT_EQ(out.scheduled.size(), 3u);
  EXPECT_EQ(out.scheduled[0].seq, decoding);
  EXPECT_EQ(out.scheduled[1].seq, urgent);
  EXPECT_EQ(out.scheduled[1].num_new_tokens, 6);
  EXPECT_EQ(out.scheduled[2].seq, long_prompt);
  EXPECT_EQ(out.scheduled[2].num_new_tokens, 3);
  EXPECT_EQ(long_prompt->num_computed, 12);
  EXPECT_EQ(urgent->num_generated(), 1);
}

TEST(Scheduler, FirstComeFirstServedARunningPrefillKeepsTheBudget) {
  Fixture f(64, 4, {.max_num_seqs = 4, .max_num_batched_tokens = 10});
  Sequence* long_prompt = f.add(iota_tokens(40), 1);
  f.step();
  Sequence* later = f.add(iota_tokens(6, 50), 1);
  auto out = f.step();
  ASSERT_EQ(out.scheduled.size(), 1u);
  EXPECT_EQ(out.scheduled[0].seq, long_prompt);
  EXPECT_EQ(later->num_computed, 0);
}

TEST(Scheduler, ReusesCachedPrefixBlocks) {
  Fixture f(64, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 100});
  auto shared = iota_tokens(12);
  Sequence* a = f.add(shared, 1);
  f.step();  // a: prefill and its single token; finished and freed, blocks stay cached
  EXPECT_EQ(a->num_generated(), 1);
  auto prompt = shared;
  prompt.push_back(99);
  Sequence* b = f.add(prompt, 1);
  auto out = f.step();
  ASSERT_EQ(out.scheduled.size(), 1u);
  EXPECT_EQ(b->num_cached, 12);
  EXPECT_EQ(out.scheduled[0].num_new_tokens, 1);
  EXPECT_EQ(f.kv.prefix_cache_stats().hits, 12);
}

// With MTP drafts, a prefix hit leaves its last block to recompute: the MTP layer's entry at the
// block's last position was computed with the next token of the request that cached it, which no
// block hash covers. The recomputed block is private until computed, then takes the cached copy's
// entry over (nobody else holds that copy: holding it would take a free block), and the blocks
// before it are shared as usual.
TEST(Scheduler, WithMtpDraftsAPrefixHitRecomputesItsLastBlock) {
  Fixture f(64, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 100}, true,
            {.recompute_last_hit_block = true});
  auto shared = iota_tokens(12);
  Sequence* a = f.add(shared, 1);
  f.step();  // a's 3 full blocks are cached; it finishes
  ASSERT_EQ(a->num_generated(), 1);
  ASSERT_EQ(f.kv.num_cached_blocks(), 3);
  std::vector<int32_t> cached_by_a;
  for (int32_t id = 0; id < 64; ++id)
    if (f.kv.cached_hash(id)) cached_by_a.push_back(id);
  ASSERT_EQ(cached_by_a.size(), 3u);
  auto prompt = shared;
  prompt.push_back(99);
  Sequence* b = f.add(prompt, 2);
  auto out = f.sched.schedule();
  ASSERT_EQ(out.scheduled.size(), 1u);
  EXPECT_EQ(b->num_cached, 8);
  EXPECT_EQ(out.scheduled[0].num_new_tokens, 5);  // tokens 9..12 again, and 99
  const auto& table = f.kv.block_table("1");
  ASSERT_EQ(table.size(), 4u);
  EXPECT_EQ(f.kv.ref_count(table[0]), 1);  // the block a cached, now b's
  EXPECT_TRUE(f.kv.cached_hash(table[0]).has_value());
  EXPECT_TRUE(f.kv.cached_hash(table[1]).has_value());
  EXPECT_FALSE(f.kv.cached_hash(table[2]).has_value());  // private: recomputed here
  EXPECT_EQ(f.kv.prefix_cache_stats().hits, 8);
  f.sched.update_from_output(out, std::vector{tokens({7})}, 0);
  // b's recomputed block took a's cache entry over: a's copy of it is free and uncached.
  EXPECT_TRUE(f.kv.cached_hash(table[2]).has_value());
  for (int32_t id : cached_by_a)
    if (std::find(table.begin(), table.end(), id) == table.end()) {
      EXPECT_FALSE(f.kv.cached_hash(id).has_value()) << "block " << id;
    }
  EXPECT_EQ(f.kv.num_cached_blocks(), 3);
  EXPECT_EQ(f.kv.num_free_blocks(), 60);
  f.kv.check_invariants();
  ASSERT_TRUE(run_to_completion(f));
  EXPECT_EQ(f.kv.num_free_blocks(), 64);
}

TEST(Scheduler, RandomWorkloadsFinishEverySequence) {
  std::mt19937 rng(42);
  for (int round = 0; round < 20; ++round) {
    const int64_t blocks = 8 + rng() % 24, bs = 1 + rng() % 8;
    Fixture f(blocks, bs,
              {.max_num_seqs = 1 + int64_t(rng() % 6),
               .max_num_batched_tokens = 1 + int64_t(rng() % 40),
               .priority = rng() % 2 == 0},
              rng() % 2 == 0);
    std::vector<Sequence*> all;
    for (int i = 0; i < 12; ++i) {
      const int64_t cap = blocks * bs;
      const int64_t len = 1 + rng() % std::max<int64_t>(1, cap / 2);
      const int64_t max_tokens = 1 + rng() % std::max<int64_t>(1, cap - len);
      std::vector<int32_t> p(len);
      for (auto& t : p) t = rng() % 5;  // few distinct ids: many shared prefixes
      all.push_back(f.add(p, max_tokens, rng() % 3));
    }
    int steps = 0;
    while (!(f.sched.running().empty() && f.sched.waiting().empty())) {
      auto out = f.step();
      ASSERT_LE(out.num_tokens, f.sched.config().max_num_batched_tokens);
      ASSERT_LE(static_cast<int64_t>(f.sched.running().size()), f.sched.config().max_num_seqs);
      ASSERT_LT(++steps, 100000) << "no progress in round " << round;
    }
    for (auto* s : all) EXPECT_EQ(s->num_generated(), s->request.sampling.max_tokens);
    EXPECT_EQ(f.kv.num_free_blocks(), blocks);
  }
}

// Randomized P/D workloads, first come first served and by priority, on small caches: local
// prompts and decode legs arrive over time, each leg's KV a few steps after its fetch starts.
// Every step keeps vLLM v1's waiting-pass order: nothing waiting is admitted, nor given blocks
// for its KV, past a waiting sequence that stays waiting (one receiving its KV aside: vLLM skips
// those), nor (first come first served, where the running go first) in a step that preempted a
// sequence while others ran on. The one exception: a sequence holding its blocks is admitted past
// the head when nothing else runs, since the head may wait for those very blocks. And every
// sequence finishes.
TEST(Scheduler, RandomDecodeLegWorkloadsKeepTheWaitingOrderAndFinishEverySequence) {
  std::mt19937 rng(7);
  for (int round = 0; round < 60; ++round) {
    const bool priority = round % 2 == 1;
    const int64_t blocks = 6 + rng() % 16, bs = 2 + rng() % 4, cap = blocks * bs;
    Fixture f(blocks, bs,
              {.max_num_seqs = 2 + int64_t(rng() % 5),
               .max_num_batched_tokens = 4 + int64_t(rng() % 40),
               .priority = priority},
              rng() % 2 == 0);
    std::vector<Sequence*> all;
    std::map<Sequence*, int> kv_arrives_in;  // legs fetching: steps until their KV is here
    for (int steps = 0;; ++steps) {
      ASSERT_LT(steps, 20000) << "no progress in round " << round;
      if (steps < 40 && rng() % 2 == 0) {
        const int64_t len = 1 + rng() % std::max<int64_t>(1, cap / 2);
        const int64_t max_tokens = 1 + rng() % std::max<int64_t>(1, cap - len);
        std::vector<int32_t> p(size_t(len), 0);
        for (auto& t : p) t = int32_t(rng() % 5);
        all.push_back(rng() % 2 == 0 ? add_decode_leg(f, p, max_tokens)
                                     : f.add(p, max_tokens, rng() % 3));
      } else if (steps >= 40 && f.sched.running().empty() && f.sched.waiting().empty()) {
        break;
      }
      for (auto it = kv_arrives_in.begin(); it != kv_arrives_in.end();) {
        if (it->second-- > 0) {
          ++it;
          continue;
        }
        receive_kv(it->first);
        it = kv_arrives_in.erase(it);
      }
      const std::deque<Sequence*> waiting(f.sched.waiting());
      const std::vector<Sequence*> running(f.sched.running());
      std::set<const Sequence*> holding;
      for (const Sequence* s : waiting)
        if (f.kv.has_request(s->request.id)) holding.insert(s);
      const auto out = f.sched.schedule();
      auto took_its_turn = [&](const Sequence* s) {
        return s->status == SequenceStatus::kRunning ||
               std::find(out.fetches.begin(), out.fetches.end(), s) != out.fetches.end();
      };
      const bool others_ran_on = std::any_of(running.begin(), running.end(), [](const Sequence* s) {
        return s->status == SequenceStatus::kRunning;
      });
      bool admitted_before = false;  // a waiting sequence ahead of this one runs now
      for (size_t k = 0; k < waiting.size(); ++k) {
        const Sequence* s = waiting[k];
        if (!took_its_turn(s)) continue;
        if (!priority && !out.preempted.empty()) {
          EXPECT_FALSE(others_ran_on)
              << "round " << round << ": " << s->request.id << " admitted in a step that preempted";
        }
        const bool nothing_else_runs = !others_ran_on && !admitted_before;
        for (size_t j = 0; j < k; ++j)
          EXPECT_TRUE(took_its_turn(waiting[j]) || waiting[j]->fetching() ||
                      (holding.count(s) && nothing_else_runs))
              << "round " << round << ": " << s->request.id << " passed " << waiting[j]->request.id
              << ", which stays waiting";
        admitted_before = admitted_before || s->status == SequenceStatus::kRunning;
      }
      if (::testing::Test::HasFailure()) return;
      for (Sequence* s : out.fetches) {
        s->kv_state = KvTransferState::kFetching;
        kv_arrives_in[s] = int(rng() % 4);
      }
      ASSERT_FALSE(out.empty() && out.fetches.empty() && kv_arrives_in.empty() &&
                   f.sched.has_schedulable())
          << "round " << round << ": a step scheduled nothing and nothing would change that";
      const std::vector<StepTokens> sampled(out.scheduled.size(), tokens({7}));
      for (const auto& u : f.sched.update_from_output(out, sampled, 0))
        if (u.output.finished) f.sched.remove(u.seq);
      f.kv.check_invariants();
    }
    for (auto* s : all) EXPECT_EQ(s->num_generated(), s->request.sampling.max_tokens);
    EXPECT_EQ(f.kv.num_free_blocks(), blocks);
  }
}

}  // namespace
}  // namespace tandem::engine
