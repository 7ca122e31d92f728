// The simulator's virtual KV links answer a bootstrap room's legs as the live engines' transfer
// agents do (kv_transfer_test.cpp covers those), so that a simulated run takes the same paths.
#include "sim/virtual_kv_links.h"

#include <map>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "gateway/virtual_executor.h"
#include "sim/virtual_time.h"

namespace tandem::sim {
namespace {

using engine::KvTransferError;
using engine::KvTransfers;

// What the virtual links read of an engine: its KV layout.
class LayoutOnly final : public engine::Executor {
 public:
  LayoutOnly() { info_.kv_layout = {"layout-only", 2, 4, 8}; }
  const engine::ExecutorInfo& info() const override { return info_; }
  engine::ExecResult execute(std::span<const engine::ExecItem>, const engine::LayerHook&) override {
    throw Error("LayoutOnly runs no step");
  }
  const std::byte* kv_bytes(int32_t, int64_t) const override { return nullptr; }
  void write_kv(int32_t, int64_t, std::span<const std::byte>) override {}

 private:
  engine::ExecutorInfo info_;
};

// The prefill engine the tests reach, at prefill-host:1, with its transfer timeout.
engine::KvTransferConfig prefill_config(double timeout_s) {
  engine::KvTransferConfig p;
  p.engine_id = "prefill";
  p.port = 1;
  p.advertise_host = "prefill-host";
  p.timeout_s = timeout_s;
  return p;
}

// A pull of `transfer_id` from that engine, of a `tokens`-token prompt of hash 1234.
engine::KvFetch pull_of(const std::string& transfer_id, int64_t tokens) {
  engine::KvFetch f;
  f.request_id = "pulled";
  f.host = "prefill-host";
  f.port = 1;
  f.engine_id = "prefill";
  f.transfer_id = transfer_id;
  f.prompt_hash = 1234;
  f.prompt_tokens = f.num_tokens = tokens;
  return f;
}

struct RoomEnd {
  std::optional<bool> ok;
  std::string error;
  bool abandoned = false;
  double at_s = -1;  // when it was posted to the prefill engine (VirtualKvLinks::run_until's)
};

// A fetch's outcome and the virtual instant it was posted to the decode engine.
struct FetchEnd {
  std::optional<engine::KvFetchResult> result;
  double at_s = -1;
};

class VirtualKvLinks : public ::testing::Test {
 protected:
  VirtualKvLinks() {
    make_prefill(30);
    engine::KvTransferConfig d;
    d.engine_id = "decode";
    d.timeout_s = 30;
    decode_ = net_.make(d, executor_, post(), now(), [] {});
  }

  // The prefill engine, one of this timeout from now on, at the same address.
  void make_prefill(double timeout_s) {
    prefill_.reset();  // first: its end takes its address out of the network
    prefill_ = net_.make(prefill_config(timeout_s), executor_, post(), now(), [] {});
  }
  KvTransfers::Post post() {
    return [this](KvTransfers::Task t) { engine_tasks_.push_back(std::move(t)); };
  }
  std::function<double()> now() {
    return [this] { return seconds_of(clock_.now()); };
  }
  // Delivers what is on the links, and runs what they posted to the engines.
  void settle() {
    gateway::Executor::Clock::time_point next;
    while (clock_.next_timer(&next) && next <= clock_.now() + duration_of(1))
      clock_.advance_to(next);
    for (size_t i = 0; i < engine_tasks_.size(); ++i) engine_tasks_[i]();
    engine_tasks_.clear();
  }
  KvTransfers::RoomDone room_end(RoomEnd& end) {
    return [this, &end](bool ok, const std::string& error, bool abandoned) {
      end.ok = ok;
      end.error = error;
      end.abandoned = abandoned;
      end.at_s = seconds_of(clock_.now()) - start_s_;
    };
  }
  std::function<void(const engine::KvFetchResult&)> fetch_end(FetchEnd& end) {
    return [this, &end](const engine::KvFetchResult& r) {
      end.result = r;
      end.at_s = seconds_of(clock_.now()) - start_s_;
    };
  }
  // Runs the links timer by timer up to `until_s` after the test began, and what they post to the
  // engines at once.
  void run_until(double until_s) {
    gateway::Executor::Clock::time_point next;
    for (;;) {
      for (size_t i = 0; i < engine_tasks_.size(); ++i) engine_tasks_[i]();
      engine_tasks_.clear();
      if (!clock_.next_timer(&next) || next > time_at(start_s_ + until_s)) break;
      clock_.advance_to(next);
    }
    clock_.advance_to(time_at(start_s_ + until_s));
  }
  // The decode leg of room 7, an 8-token prompt of hash 1234 (2 layers of 8 tokens of 8 bytes:
  // 128 bytes, 5.12 ns at 25 GB/s), registered over TCP with the prefill engine.
  static engine::KvFetch registration() {
    engine::KvFetch f;
    f.request_id = "registered";
    f.pull = false;
    f.host = "prefill-host";
    f.port = 1;
    f.engine_id = "prefill";
    f.room = 7;
    f.prompt_hash = 1234;
    f.prompt_tokens = f.num_tokens = 8;
    f.local_blocks = {0, 1};
    return f;
  }

  gateway::VirtualExecutor clock_;
  const double start_s_ = seconds_of(clock_.now());  // run_until's instants count from it
  VirtualKvNetwork net_{clock_, KvLinkModel{}};
  LayoutOnly executor_;
  std::vector<KvTransfers::Task> engine_tasks_;
  std::unique_ptr<KvTransfers> prefill_, decode_;
};

// An abandonment that comes before the room's prefill leg refuses that leg when it arrives, once,
// and only the leg of the prompt it names (its hash and length); one for another prompt leaves
// the room to its leg.
TEST_F(VirtualKvLinks, AnAbandonedRoomRefusesALatePrefillLegOfItsPromptOnly) {
  decode_->abandon_room("prefill-host", 1, 7, 1234, 11, "the decode request ended: no blocks");
  decode_->abandon_room("prefill-host", 1, 8, 9999, 11, "another prompt's");
  decode_->abandon_room("prefill-host", 1, 9, 1234, 12, "a longer prompt's");
  settle();

  RoomEnd refused;
  try {
    prefill_->open_room(7, 1234, 11, room_end(refused));
    ADD_FAILURE() << "open_room accepted a room whose decode leg was abandoned";
  } catch (const KvTransferError& e) {
    EXPECT_EQ(std::string(e.what()), "the decode request ended: no blocks");
    EXPECT_TRUE(e.room_abandoned);
  }
  RoomEnd again;
  EXPECT_NE(prefill_->open_room(7, 1234, 11, room_end(again)), 0u);  // the refusal was used up

  for (const uint64_t room : {8, 9}) {
    RoomEnd served;
    uint64_t claim = 0;
    EXPECT_NO_THROW(claim = prefill_->open_room(room, 1234, 11, room_end(served))) << room;
    ASSERT_NE(claim, 0u) << room;
    settle();
    EXPECT_FALSE(served.ok.has_value()) << room;
    prefill_->room_failed(room, claim, "test over");
    settle();
    EXPECT_EQ(served.ok, std::optional<bool>(false)) << room;
    EXPECT_EQ(served.error, "test over") << room;
    EXPECT_FALSE(served.abandoned) << room;
  }
  EXPECT_FALSE(refused.ok.has_value());
}

// An abandonment of a room whose prefill leg is there fails that leg, saying the decode leg
// abandoned it (the engine's answer then carries api::kRoomAbandonedCode).
TEST_F(VirtualKvLinks, AnAbandonedRoomFailsItsPrefillLegAsAbandoned) {
  RoomEnd end;
  ASSERT_NE(prefill_->open_room(7, 1234, 11, room_end(end)), 0u);
  decode_->abandon_room("prefill-host", 1, 7, 1234, 11, "the decode request ended: no blocks");
  settle();
  EXPECT_EQ(end.ok, std::optional<bool>(false));
  EXPECT_EQ(end.error, "the decode request ended: no blocks");
  EXPECT_TRUE(end.abandoned);
}

// A pull of a transfer the prefill engine no longer holds (expired here) says its KV is gone, as
// the real engines' pulls say: the gateway then prefills the request again, blaming no engine.
TEST_F(VirtualKvLinks, APullOfAnExpiredTransferSaysItsKvIsGone) {
  bool released = false;
  const std::string id = prefill_->hold({0, 1}, 1234, 8, [&] { released = true; });
  clock_.advance_to(clock_.now() + duration_of(31));  // past the 30 s timeout
  settle();
  ASSERT_TRUE(released);
  engine::KvFetch f = pull_of(id, 8);
  f.remote_blocks = {0, 1};
  f.local_blocks = {0, 1};
  std::optional<engine::KvFetchResult> result;
  decode_->fetch(f, [&](const engine::KvFetchResult& r) { result = r; });
  for (int i = 0; i < 10 && !result; ++i) settle();
  ASSERT_TRUE(result.has_value());
  EXPECT_FALSE(result->ok);
  EXPECT_TRUE(result->transfer_gone) << result->error;
}

// A refusal lasts the transfer timeout: a prefill leg that comes later waits for its decode leg.
TEST_F(VirtualKvLinks, AnAbandonmentsRefusalExpiresWithTheTimeout) {
  decode_->abandon_room("prefill-host", 1, 7, 1234, 11, "gone");
  settle();
  clock_.advance_by(duration_of(31));
  RoomEnd end;
  EXPECT_NE(prefill_->open_room(7, 1234, 11, room_end(end)), 0u);
}

// A prefill leg that comes before its decode leg waits for it however long its prompt computes,
// as the live agent's reaper leaves a room whose layers are not all written; its timeout counts
// from its last layer (KvTransferAgent::room_layers_done). Timeout 30 s.
TEST_F(VirtualKvLinks, APrefillLegThatComesFirstWaitsOutItsComputeAndThenTheTimeout) {
  RoomEnd served, unserved;
  const uint64_t claim = prefill_->open_room(7, 1234, 8, room_end(served));
  const uint64_t alone = prefill_->open_room(8, 1234, 8, room_end(unserved));
  ASSERT_NE(claim, 0u);
  ASSERT_NE(alone, 0u);
  run_until(40);  // both prompts compute for 40 s, past the timeout
  EXPECT_FALSE(served.ok.has_value()) << served.error;
  EXPECT_FALSE(unserved.ok.has_value()) << unserved.error;
  prefill_->room_layers_done(7, claim, 2);
  prefill_->room_layers_done(8, alone, 2);
  run_until(45);
  FetchEnd fetched;
  decode_->fetch(registration(), fetch_end(fetched));  // room 7's decode leg, 5 s later
  run_until(69);
  ASSERT_TRUE(fetched.result.has_value());
  EXPECT_TRUE(fetched.result->ok) << fetched.result->error;
  EXPECT_EQ(served.ok, std::optional<bool>(true)) << served.error;
  EXPECT_FALSE(unserved.ok.has_value()) << unserved.error;
  run_until(80);  // room 8 never had a decode leg: it fails 30 s after its last layer, at 70 s
  EXPECT_EQ(unserved.ok, std::optional<bool>(false));
  EXPECT_EQ(unserved.error, "no decode engine registered bootstrap_room 8 within 30 s");
  EXPECT_FALSE(unserved.abandoned);
  EXPECT_NEAR(unserved.at_s, 70, 1e-9);
}

// A decode leg that registers after its room's prefill leg, alone, failed: live, the failed room
// leaves a marker (KvTransferAgent::finish_room) that fails the late leg at once with the prefill
// leg's failure, as the prefill engine's answer, not its fault, instead of letting it wait out its
// timeout for a prefill leg that is gone. The marker is used once. Timeouts 30 s, a link's
// latency 50 us.
TEST_F(VirtualKvLinks, ADecodeLegLateForAFailedPrefillLegIsFailedAtOnce) {
  // Room 7: its prefill leg times out at 30 s. Room 8: its prefill leg fails at 35 s.
  RoomEnd timed_out, failed;
  const uint64_t claim = prefill_->open_room(7, 1234, 8, room_end(timed_out));
  ASSERT_NE(claim, 0u);
  prefill_->room_layers_done(7, claim, 2);
  run_until(35);
  const uint64_t other = prefill_->open_room(8, 1234, 8, room_end(failed));
  ASSERT_NE(other, 0u);
  prefill_->room_failed(8, other, "the prefill request was cancelled");
  run_until(40);
  ASSERT_EQ(timed_out.ok, std::optional<bool>(false));
  ASSERT_EQ(failed.ok, std::optional<bool>(false));

  FetchEnd late_7, late_8;
  decode_->fetch(registration(), fetch_end(late_7));
  engine::KvFetch f = registration();
  f.room = 8;
  f.request_id = "registered-8";
  decode_->fetch(f, fetch_end(late_8));
  run_until(45);
  ASSERT_TRUE(late_7.result.has_value());
  EXPECT_FALSE(late_7.result->ok);
  EXPECT_FALSE(late_7.result->prefill_fault);
  EXPECT_EQ(late_7.result->error, "no decode engine registered bootstrap_room 7 within 30 s");
  EXPECT_NEAR(late_7.at_s, 40.0001, 1e-6);  // registered at 40.00005 s, told 50 us later
  ASSERT_TRUE(late_8.result.has_value());
  EXPECT_FALSE(late_8.result->ok);
  EXPECT_FALSE(late_8.result->prefill_fault);
  EXPECT_EQ(late_8.result->error, "the prefill request was cancelled");
  EXPECT_NEAR(late_8.at_s, 40.0001, 1e-6);

  FetchEnd again;  // the marker was used: another decode leg of room 7 waits for its prefill leg
  f = registration();
  f.request_id = "registered-again";
  decode_->fetch(f, fetch_end(again));
  run_until(60);
  EXPECT_FALSE(again.result.has_value());
}

// The marker a prefill leg that failed alone leaves refuses no prefill leg: a new one of the same
// prompt (the gateway's retry) opens the room afresh, as live, uses the marker up, and is served.
TEST_F(VirtualKvLinks, APrefillLegReopeningARoomWhosePrefillLegFailedAloneIsServed) {
  RoomEnd failed, retried;
  const uint64_t claim = prefill_->open_room(7, 1234, 8, room_end(failed));
  ASSERT_NE(claim, 0u);
  prefill_->room_failed(7, claim, "the prefill request was cancelled");
  run_until(1);
  ASSERT_EQ(failed.ok, std::optional<bool>(false));

  uint64_t again = 0;
  EXPECT_NO_THROW(again = prefill_->open_room(7, 1234, 8, room_end(retried)));
  ASSERT_NE(again, 0u);
  prefill_->room_layers_done(7, again, 2);
  FetchEnd fetched;
  decode_->fetch(registration(), fetch_end(fetched));
  run_until(2);
  ASSERT_TRUE(fetched.result.has_value());
  EXPECT_TRUE(fetched.result->ok) << fetched.result->error;
  EXPECT_EQ(retried.ok, std::optional<bool>(true)) << retried.error;
}

// The marker lasts the timeout: a decode leg that registers later waits for its prefill leg, and
// gives up at its own timeout as the prefill engine's fault. Timeouts 30 s: the marker of the
// prefill leg failed at 0 s is gone at 30 s; the decode leg sends its registration at 31 s.
TEST_F(VirtualKvLinks, AFailedPrefillLegsMarkerExpiresWithTheTimeout) {
  RoomEnd failed;
  const uint64_t claim = prefill_->open_room(7, 1234, 8, room_end(failed));
  ASSERT_NE(claim, 0u);
  prefill_->room_failed(7, claim, "the prefill request was cancelled");
  run_until(31);
  ASSERT_EQ(failed.ok, std::optional<bool>(false));

  FetchEnd late;
  decode_->fetch(registration(), fetch_end(late));
  run_until(60);
  EXPECT_FALSE(late.result.has_value()) << late.result->error;
  run_until(100);
  ASSERT_TRUE(late.result.has_value());
  EXPECT_FALSE(late.result->ok);
  EXPECT_TRUE(late.result->prefill_fault);
  EXPECT_EQ(late.result->error,
            "the prefill of bootstrap_room 7 made no progress within 30 s (0 of its 8 tokens "
            "computed)");
  EXPECT_NEAR(late.at_s, 61, 1e-6);
}

// With both legs there and no layer written yet, the live decode engine waits for the prompt's
// progress (KvTransferAgent::await_room) from when it sent its registration, and again from each
// progress frame (a grown count of computed tokens) it receives; the prefill engine's room
// deadline runs from open_room and each progress. The first to pass fails the room: the decode
// engine's as the prefill engine's fault (the prefill leg then ends as abandoned, a latency
// later, as its connection closes), the prefill engine's as its refusal (which reaches the decode
// engine a latency later). Timeouts 30 s, a link's latency 50 us.
TEST_F(VirtualKvLinks, ARoomWithBothLegsWaitsForItsPromptsProgressWithinTheTimeout) {
  // Room 7: no progress. Room 8: progress every 25 s. Room 9: its count does not grow at 45 s.
  // Room 10: the prefill leg comes 5 s before the decode leg and makes no progress.
  std::map<uint64_t, RoomEnd> rooms;
  std::map<uint64_t, FetchEnd> fetches;
  std::map<uint64_t, uint64_t> claims;
  const auto register_leg = [&](uint64_t room) {
    engine::KvFetch f = registration();
    f.room = room;
    f.request_id = "registered-" + std::to_string(room);
    decode_->fetch(f, fetch_end(fetches[room]));
  };
  const auto open = [&](uint64_t room) {
    claims[room] = prefill_->open_room(room, 1234, 8, room_end(rooms[room]));
    ASSERT_NE(claims[room], 0u) << room;
  };
  for (const uint64_t room : {7, 8, 9}) register_leg(room);
  open(10);
  run_until(5);
  register_leg(10);
  run_until(10);
  for (const uint64_t room : {7, 8, 9}) open(room);
  run_until(20);
  prefill_->room_progress(8, claims[8], 2);
  prefill_->room_progress(9, claims[9], 2);
  run_until(45);
  prefill_->room_progress(8, claims[8], 4);
  prefill_->room_progress(9, claims[9], 2);  // no progress
  run_until(50);
  prefill_->room_layers_done(7, claims[7], 2);  // too late
  run_until(70);
  prefill_->room_progress(8, claims[8], 6);
  run_until(95);
  prefill_->room_layers_done(8, claims[8], 2);
  run_until(100);

  for (const uint64_t room : {7, 8, 9, 10}) {
    SCOPED_TRACE("room " + std::to_string(room));
    ASSERT_TRUE(fetches[room].result.has_value());
    ASSERT_TRUE(rooms[room].ok.has_value());
  }
  EXPECT_TRUE(fetches[8].result->ok) << fetches[8].result->error;
  EXPECT_EQ(rooms[8].ok, std::optional<bool>(true)) << rooms[8].error;

  // Room 7: the decode engine sent its registration at 0 s and gives up at 30 s.
  EXPECT_FALSE(fetches[7].result->ok);
  EXPECT_TRUE(fetches[7].result->prefill_fault);
  EXPECT_EQ(fetches[7].result->error,
            "the prefill of bootstrap_room 7 made no progress within 30 s (0 of its 8 tokens "
            "computed)");
  EXPECT_NEAR(fetches[7].at_s, 30, 1e-6);
  // Its connection closes: the prefill leg ends as abandoned a latency later.
  EXPECT_TRUE(rooms[7].abandoned);
  EXPECT_EQ(rooms[7].error,
            "the decode engine of bootstrap_room 7 closed its connection (its request ended)");
  EXPECT_NEAR(rooms[7].at_s, 30.00005, 1e-6);

  // Room 9: progress at 20 s; the prefill engine's deadline (20 s + 30 s) passes before the
  // decode engine's (20.00005 s + 30 s).
  EXPECT_FALSE(fetches[9].result->ok);
  EXPECT_FALSE(fetches[9].result->prefill_fault);
  EXPECT_EQ(fetches[9].result->error,
            "the prefill of bootstrap_room 9 did not complete within 30 s");
  EXPECT_NEAR(rooms[9].at_s, 50, 1e-6);
  EXPECT_NEAR(fetches[9].at_s, 50.00005, 1e-6);

  // Room 10: opened at 0 s, its deadline passes at 30 s, before the decode engine's at 35 s.
  EXPECT_FALSE(fetches[10].result->ok);
  EXPECT_FALSE(fetches[10].result->prefill_fault);
  EXPECT_EQ(fetches[10].result->error,
            "the prefill of bootstrap_room 10 did not complete within 30 s");
  EXPECT_NEAR(rooms[10].at_s, 30, 1e-6);
}

// A prefill engine stalled past its room deadline cannot check it (SIGSTOP): the decode engine,
// awake, gives up first, at the timeout from its registration, as the prefill engine's fault, and
// the prefill leg ends as abandoned a latency later. Room 7 opened at 0 s, its decode leg sent at
// 5 s, the prefill engine stalled from 10 s to 50 s: its deadline (30 s) would pass at its wake.
TEST_F(VirtualKvLinks, AStalledPrefillsRoomDeadlineWaitsForItsWakeAndTheDecodeGivesUpFirst) {
  RoomEnd room;
  const uint64_t claim = prefill_->open_room(7, 1234, 8, room_end(room));
  ASSERT_NE(claim, 0u);
  run_until(5);
  FetchEnd fetched;
  decode_->fetch(registration(), fetch_end(fetched));
  run_until(10);
  net_.stall("prefill", time_at(start_s_ + 50));
  run_until(100);
  ASSERT_TRUE(fetched.result.has_value());
  EXPECT_FALSE(fetched.result->ok);
  EXPECT_TRUE(fetched.result->prefill_fault);
  EXPECT_EQ(fetched.result->error,
            "the prefill of bootstrap_room 7 made no progress within 30 s (0 of its 8 tokens "
            "computed)");
  EXPECT_NEAR(fetched.at_s, 35, 1e-6);
  EXPECT_EQ(room.ok, std::optional<bool>(false));
  EXPECT_TRUE(room.abandoned);
  EXPECT_EQ(room.error,
            "the decode engine of bootstrap_room 7 closed its connection (its request ended)");
  EXPECT_NEAR(room.at_s, 35.00005, 1e-6);
}

// A progress frame that reaches a stalled decode engine waits in its socket: live, await_room
// reads it when the engine wakes and waits the timeout from then, not from the frame's arrival.
// Room 7 opened and registered at 0 s, progress at 20 s, the decode engine stalled from 10 s to
// 45 s and the prefill engine from 40 s to 100 s (its own deadline, 50 s, passes at its wake):
// the decode engine gives up at 45 s + 30 s, as the prefill engine's fault, not at 50.00005 s.
TEST_F(VirtualKvLinks, AProgressFrameReachingAStalledDecodeEngineCountsFromItsWake) {
  RoomEnd room;
  const uint64_t claim = prefill_->open_room(7, 1234, 8, room_end(room));
  ASSERT_NE(claim, 0u);
  FetchEnd fetched;
  decode_->fetch(registration(), fetch_end(fetched));
  run_until(10);
  net_.stall("decode", time_at(start_s_ + 45));
  run_until(20);
  prefill_->room_progress(7, claim, 2);
  run_until(40);
  net_.stall("prefill", time_at(start_s_ + 100));
  run_until(200);
  ASSERT_TRUE(fetched.result.has_value());
  EXPECT_FALSE(fetched.result->ok);
  EXPECT_TRUE(fetched.result->prefill_fault);
  EXPECT_EQ(fetched.result->error,
            "the prefill of bootstrap_room 7 made no progress within 30 s (2 of its 8 tokens "
            "computed)");
  EXPECT_NEAR(fetched.at_s, 75, 1e-6);
  EXPECT_TRUE(room.abandoned);
  EXPECT_NEAR(room.at_s, 75.00005, 1e-6);
}

// A decode leg whose prefill leg never comes: live, the decode engine's await_room began a
// latency before the prefill engine took the registration, so it gives up first, at the timeout
// from sending it, as the prefill engine's fault.
TEST_F(VirtualKvLinks, ADecodeLegAloneGivesUpAtTheTimeoutAsThePrefillsFault) {
  FetchEnd fetched;
  decode_->fetch(registration(), fetch_end(fetched));
  run_until(100);
  ASSERT_TRUE(fetched.result.has_value());
  EXPECT_FALSE(fetched.result->ok);
  EXPECT_TRUE(fetched.result->prefill_fault);
  EXPECT_EQ(fetched.result->error,
            "the prefill of bootstrap_room 7 made no progress within 30 s (0 of its 8 tokens "
            "computed)");
  EXPECT_NEAR(fetched.at_s, 30, 1e-6);
}

// The decode engine that gave up on a room closed its connection: live, the prefill engine then
// leaves the room a refusal (KvTransferAgent::leave_refusal), so that a prefill leg of that
// prompt arriving later is refused at once, as abandoned, with the closed connection's text,
// instead of computing its prompt and then waiting out the timeout for a decode leg that is
// gone. Timeouts 30 s: the decode leg gives up at 30 s, the refusal is there a latency later and
// lasts the timeout.
TEST_F(VirtualKvLinks, APrefillLegArrivingAfterTheDecodeGaveUpIsRefusedAtOnce) {
  FetchEnd fetched;
  decode_->fetch(registration(), fetch_end(fetched));
  run_until(40);
  ASSERT_TRUE(fetched.result.has_value());
  ASSERT_FALSE(fetched.result->ok);

  RoomEnd late;
  try {
    prefill_->open_room(7, 1234, 8, room_end(late));
    ADD_FAILURE() << "open_room accepted a room whose decode leg gave up";
  } catch (const KvTransferError& e) {
    EXPECT_EQ(std::string(e.what()),
              "the decode engine of bootstrap_room 7 closed its connection (its request ended)");
    EXPECT_TRUE(e.room_abandoned);
  }
  run_until(100);
  EXPECT_FALSE(late.ok.has_value());
}

// A registered decode leg whose request ends (cancel_fetch closes its connection): live, the
// prefill engine fails its room's prefill leg as abandoned, with the closed connection's text, or,
// with none there yet, refuses one of that prompt that comes later, as abandoned
// (kv_transfer_test's a_decode_that_leaves_mid_transfer_fails_the_room and
// a_decode_that_left_before_the_prefill_leg_has_it_refused).
TEST_F(VirtualKvLinks, ADecodeLegThatLeavesEndsItsRoomAsAbandoned) {
  // Room 7: its prefill leg is there. Room 8: its prefill leg comes after the decode leg left.
  RoomEnd left;
  ASSERT_NE(prefill_->open_room(7, 1234, 8, room_end(left)), 0u);
  FetchEnd fetched_7, fetched_8;
  decode_->fetch(registration(), fetch_end(fetched_7));
  engine::KvFetch f = registration();
  f.room = 8;
  f.request_id = "registered-8";
  decode_->fetch(f, fetch_end(fetched_8));
  run_until(1);
  decode_->cancel_fetch("registered");
  decode_->cancel_fetch("registered-8");
  run_until(2);
  EXPECT_EQ(left.ok, std::optional<bool>(false));
  EXPECT_EQ(left.error,
            "the decode engine of bootstrap_room 7 closed its connection (its request ended)");
  EXPECT_TRUE(left.abandoned);

  RoomEnd late;
  try {
    prefill_->open_room(8, 1234, 8, room_end(late));
    ADD_FAILURE() << "open_room accepted a room whose decode leg left";
  } catch (const KvTransferError& e) {
    EXPECT_EQ(std::string(e.what()),
              "the decode engine of bootstrap_room 8 closed its connection (its request ended)");
    EXPECT_TRUE(e.room_abandoned);
  }
}

// A prefill engine whose timeout (10 s) is shorter than the decode engine's (30 s) times out a
// room whose prefill leg has not come first: live, serve_register refuses the decode leg (the
// prefill engine's answer, not its fault) and leaves the room a refusal, so that a prefill leg of
// that prompt arriving later is refused at once, as abandoned, instead of computing its prompt
// and then waiting out the timeout for a decode leg that has been told to go.
TEST_F(VirtualKvLinks, APrefillLegArrivingAfterTheShorterPrefillTimeoutPassedIsRefusedAtOnce) {
  make_prefill(10);
  FetchEnd fetched;
  decode_->fetch(registration(), fetch_end(fetched));
  run_until(12);
  ASSERT_TRUE(fetched.result.has_value());
  EXPECT_FALSE(fetched.result->ok);
  EXPECT_FALSE(fetched.result->prefill_fault);
  EXPECT_EQ(fetched.result->error, "no prefill request with bootstrap_room 7 arrived within 10 s");
  EXPECT_NEAR(fetched.at_s, 10.0001, 1e-6);  // registered at 50 us, told 50 us after 10 s

  RoomEnd late;
  try {
    prefill_->open_room(7, 1234, 8, room_end(late));
    ADD_FAILURE() << "open_room accepted a room whose decode leg was refused";
  } catch (const KvTransferError& e) {
    EXPECT_EQ(std::string(e.what()),
              "bootstrap_room 7 expired: its decode request waited 10 s for this prefill request "
              "and was failed");
    EXPECT_TRUE(e.room_abandoned);
  }
  run_until(100);
  EXPECT_FALSE(late.ok.has_value());
}

// A decode engine that stalls after registering its room, before the room's layers are written,
// holds the first frame the prefill engine sends: live, that send times out after the transfer
// timeout (30 s) from when it began, as the prefill engine's fault, whenever the stall began.
TEST_F(VirtualKvLinks, ARoomSendToADecodeEngineStalledBeforeItBeganTimesOut) {
  RoomEnd room;
  const uint64_t claim = prefill_->open_room(7, 1234, 8, room_end(room));
  ASSERT_NE(claim, 0u);
  run_until(1);
  FetchEnd fetched;
  decode_->fetch(registration(), fetch_end(fetched));
  run_until(2);
  net_.stall("decode", time_at(start_s_ + 100));  // frozen from 2 s to 100 s
  run_until(5);
  prefill_->room_layers_done(7, claim, 2);  // the send begins at 5 s
  run_until(200);
  ASSERT_TRUE(room.ok.has_value());
  EXPECT_FALSE(*room.ok);
  EXPECT_NEAR(room.at_s, 35, 1e-9);
  EXPECT_EQ(room.error,
            "no KV frame moved within the transfer timeout of 30 s (--kv-transfer-timeout): an "
            "engine of the link stalled");
  ASSERT_TRUE(fetched.result.has_value());
  EXPECT_FALSE(fetched.result->ok);
  EXPECT_TRUE(fetched.result->prefill_fault);
}

// Room 7's send slowed so that its 128 bytes take 3.5 s (5.12 ns at 25 GB/s, 683,593,750 times
// slower): its decode leg registers at 50 us, every layer written at 0 s, the last byte goes at
// 3.50005 s and arrives a latency later, at 3.5001 s, unless a stall holds it back.
class VirtualKvLinksSlowRoom : public VirtualKvLinks {
 protected:
  void begin(RoomEnd& room, FetchEnd& fetched) {
    net_.slow("prefill", 683593750);
    const uint64_t claim = prefill_->open_room(7, 1234, 8, room_end(room));
    ASSERT_NE(claim, 0u);
    prefill_->room_layers_done(7, claim, 2);
    decode_->fetch(registration(), fetch_end(fetched));
  }
  void stall(const std::string& engine, double from_s, double until_s) {
    run_until(from_s);
    net_.stall(engine, time_at(start_s_ + until_s));
  }
};

// Overlapping stalls of the two engines freeze the link for their union: prefill stalled from 3 s
// to 4 s and decode from 3.8 s to 6 s leave the send 0.5001 s to go at 3 s, which it goes on
// with at 6 s, ending at 6.5001 s (timeout 30 s: nothing fails). It ended at 4.5001 s: at its
// planned end, in prefill's stall, the send was moved on by the 0.5001 s prefill's stall had
// taken, from prefill's wake (4 s), and then counted only decode's stall time after 6 s.
TEST_F(VirtualKvLinksSlowRoom, OverlappingStallsOfBothEnginesHoldTheTransferForTheirUnion) {
  RoomEnd room;
  FetchEnd fetched;
  begin(room, fetched);
  stall("prefill", 3.0, 4.0);
  stall("decode", 3.8, 6.0);
  run_until(10);
  ASSERT_TRUE(fetched.result.has_value());
  EXPECT_TRUE(fetched.result->ok) << fetched.result->error;
  EXPECT_NEAR(fetched.at_s, 6.5001, 1e-6);
  EXPECT_EQ(room.ok, std::optional<bool>(true)) << room.error;
  EXPECT_NEAR(room.at_s, 6.5001, 1e-6);
}

// A stall extended after the transfer's planned end counts from its start: prefill stalled from
// 3 s to 3.9 s (within a 1 s timeout), extended at 3.8 s to 4.5 s, freezes the link for 1.5 s;
// live, the decode engine's receive times out at 4 s, as the prefill engine's fault. The stall
// was measured from the planned end (3.5001 s to 4.5 s: not over the timeout), and the transfer
// ended at 4.4001 s, inside the stall (moved on from the wake known at its planned end, 3.9 s).
TEST_F(VirtualKvLinksSlowRoom, AStallExtendedPastTheTimeoutAfterThePlannedEndFailsTheTransfer) {
  make_prefill(1);
  RoomEnd room;
  FetchEnd fetched;
  begin(room, fetched);
  stall("prefill", 3.0, 3.9);
  stall("prefill", 3.8, 4.5);
  run_until(10);
  EXPECT_EQ(room.ok, std::optional<bool>(false));
  EXPECT_NEAR(room.at_s, 4.0, 1e-9);
  EXPECT_EQ(room.error,
            "no KV frame moved within the transfer timeout of 1 s (--kv-transfer-timeout): an "
            "engine of the link stalled");
  ASSERT_TRUE(fetched.result.has_value());
  EXPECT_FALSE(fetched.result->ok);
  EXPECT_TRUE(fetched.result->prefill_fault);
  EXPECT_NEAR(fetched.at_s, 4.00005, 1e-9);
}

// A transfer a slow-link fault slows past what the virtual clock counts (a long prompt over a
// link slowed a millionfold takes centuries) fails alone, saying which flags made it so; the run
// goes on (it used to end with the clock's own error, every result lost).
TEST_F(VirtualKvLinks, ATransferTooSlowForTheClockFailsAloneNamingTheFlags) {
  const int64_t tokens = int64_t{1} << 45;  // 16 bytes each: 10^10 s at 25 GB/s slowed 10^6 x
  net_.slow("prefill", 1e6);
  const engine::KvFetch pull = pull_of(prefill_->hold({}, 1234, tokens, [] {}), tokens);
  std::optional<engine::KvFetchResult> pulled;
  decode_->fetch(pull, [&](const engine::KvFetchResult& r) { pulled = r; });
  ASSERT_NO_THROW(settle());
  ASSERT_TRUE(pulled.has_value());
  EXPECT_FALSE(pulled->ok);
  EXPECT_NE(pulled->error.find("--kv-link-gb-per-s"), std::string::npos) << pulled->error;
  EXPECT_NE(pulled->error.find("--slow-link"), std::string::npos) << pulled->error;

  RoomEnd room;
  const uint64_t claim = prefill_->open_room(7, 1234, tokens, room_end(room));
  ASSERT_NE(claim, 0u);
  engine::KvFetch reg = pull;
  reg.request_id = "registered";
  reg.pull = false;
  reg.room = 7;
  std::optional<engine::KvFetchResult> pushed;
  decode_->fetch(reg, [&](const engine::KvFetchResult& r) { pushed = r; });
  ASSERT_NO_THROW(settle());
  prefill_->room_layers_done(7, claim, 2);
  ASSERT_NO_THROW(settle());
  ASSERT_TRUE(pushed.has_value());
  EXPECT_FALSE(pushed->ok);
  EXPECT_NE(pushed->error.find("--slow-link"), std::string::npos) << pushed->error;
  EXPECT_EQ(room.ok, std::optional<bool>(false));
  EXPECT_EQ(room.error, pushed->error);
}

// A decode engine's fetch from a stalled prefill engine ends as a live engine's does
// (KvTransferAgent::run_fetch): what needs the prefill's answer before any KV moves (a pull's
// accept; over shared memory, the transport's hello) fails at the handshake timeout as the
// prefill's fault, so that the gateway retries the request on another prefill engine; a room
// registered over TCP without a secret waits in the socket for the prefill's compute, up to the
// transfer timeout. The two engines share a host. Instants are the virtual clock's.
class VirtualKvLinksStalledPrefill : public VirtualKvLinks {
 protected:
  VirtualKvLinksStalledPrefill() { make_prefill(120); }
  void make_decode(engine::KvTransportKind transport) {
    decode_.reset();  // one decode engine of that id at a time
    engine::KvTransferConfig d;
    d.engine_id = "decode";
    d.timeout_s = 120;
    d.handshake_timeout_s = 5;
    d.transport = transport;
    d.advertise_host = "prefill-host";  // one host: shared memory is used where asked for
    decode_ = net_.make(d, executor_, post(), now(), [] {});
  }
  // Room 7's registration, or a pull of its prompt's KV, held now.
  engine::KvFetch request(bool pull) {
    if (!pull) return registration();
    engine::KvFetch f = pull_of(prefill_->hold({1, 2}, 1234, 8, [] {}), 8);
    f.room = 7;
    f.local_blocks = {0, 1};
    return f;
  }
};

TEST_F(VirtualKvLinksStalledPrefill, APullFailsAtTheHandshakeTimeoutAsThePrefillsFault) {
  for (const auto transport : {engine::KvTransportKind::kTcp, engine::KvTransportKind::kShm}) {
    SCOPED_TRACE(transport == engine::KvTransportKind::kTcp ? "tcp" : "shm");
    make_decode(transport);
    const double start_s = seconds_of(clock_.now()) - start_s_;
    net_.stall("prefill", clock_.now() + duration_of(30));
    FetchEnd end;
    decode_->fetch(request(true), fetch_end(end));
    run_until(start_s + 60);
    ASSERT_TRUE(end.result.has_value());
    EXPECT_FALSE(end.result->ok);
    EXPECT_TRUE(end.result->prefill_fault) << end.result->error;
    EXPECT_FALSE(end.result->transfer_gone);
    EXPECT_EQ(end.result->error,
              "the prefill engine did not answer within the handshake timeout of 5 s");
    EXPECT_NEAR(end.at_s, start_s + 5, 1e-9);
  }
}

TEST_F(VirtualKvLinksStalledPrefill, ARoomOverSharedMemoryFailsAtTheHandshakeTimeout) {
  make_decode(engine::KvTransportKind::kShm);  // the hello needs the prefill's answer
  net_.stall("prefill", clock_.now() + duration_of(30));
  FetchEnd end;
  decode_->fetch(request(false), fetch_end(end));
  run_until(60);
  ASSERT_TRUE(end.result.has_value());
  EXPECT_FALSE(end.result->ok);
  EXPECT_TRUE(end.result->prefill_fault) << end.result->error;
  EXPECT_NEAR(end.at_s, 5, 1e-9);
}

TEST_F(VirtualKvLinksStalledPrefill, ARoomOverTcpWaitsForTheWakeWithinTheTransferTimeout) {
  make_decode(engine::KvTransportKind::kTcp);  // the register waits in the socket
  net_.stall("prefill", clock_.now() + duration_of(30));
  FetchEnd end;
  decode_->fetch(request(false), fetch_end(end));
  run_until(29);
  EXPECT_FALSE(end.result.has_value());
  run_until(31);  // awake: the room has its decode leg, which the prefill leg then feeds
  RoomEnd room;
  const uint64_t claim =
      prefill_->open_room(7, 1234, 8, [&room](bool ok, const std::string& e, bool abandoned) {
        room.ok = ok;
        room.error = e;
        room.abandoned = abandoned;
      });
  ASSERT_NE(claim, 0u);
  prefill_->room_layers_done(7, claim, 2);
  run_until(40);
  ASSERT_TRUE(end.result.has_value());
  EXPECT_TRUE(end.result->ok) << end.result->error;
  EXPECT_EQ(room.ok, std::optional<bool>(true)) << room.error;
}

TEST_F(VirtualKvLinksStalledPrefill, ARoomOverTcpFailsAtTheTransferTimeoutIfThePrefillSleepsOn) {
  make_decode(engine::KvTransportKind::kTcp);
  net_.stall("prefill", clock_.now() + duration_of(200));
  FetchEnd end;
  decode_->fetch(request(false), fetch_end(end));
  run_until(300);
  ASSERT_TRUE(end.result.has_value());
  EXPECT_FALSE(end.result->ok);
  EXPECT_TRUE(end.result->prefill_fault) << end.result->error;
  EXPECT_NE(end.result->error.find("made no progress within 120 s"), std::string::npos)
      << end.result->error;
  EXPECT_NEAR(end.at_s, 120, 1e-9);
}

// The virtual clock, arming at most `limit` timers: a spin that re-arms one at the same instant
// ends, and the test sees what it left undone, instead of hanging.
class BoundedClock final : public gateway::Executor {
 public:
  explicit BoundedClock(size_t limit) : left_(limit) {}
  Clock::time_point now() const override { return clock_.now(); }
  void post(Task task) override { clock_.post(std::move(task)); }
  void post_batched(Task task) override { clock_.post_batched(std::move(task)); }
  void set_busy(bool busy) override { clock_.set_busy(busy); }
  TimerId at(Clock::time_point when, Task task) override {
    if (left_ == 0) return {};
    --left_;
    return clock_.at(when, std::move(task));
  }
  void cancel(TimerId id) override { clock_.cancel(id); }
  void advance_by(Clock::duration d) { clock_.advance_by(d); }
  bool ran_out() const { return left_ == 0; }

 private:
  gateway::VirtualExecutor clock_;
  size_t left_;
};

// A request for a stalled prefill engine's KV waits for the stall's end. An end of 496.4 s is no
// whole number of nanoseconds: kept in seconds, the wait was armed at the nanosecond before it,
// found the engine still stalled and re-armed at that same instant, for ever.
TEST(VirtualKvLinksStalled, ARequestForAStalledEnginesKvIsServedWhenTheStallEndsInsideANanosecond) {
  BoundedClock clock(1000);
  VirtualKvNetwork net(clock, KvLinkModel{});
  LayoutOnly executor;
  std::vector<KvTransfers::Task> tasks;
  auto post = [&](KvTransfers::Task t) { tasks.push_back(std::move(t)); };
  auto now = [&] { return seconds_of(clock.now()); };
  const auto prefill = net.make(prefill_config(1000), executor, post, now, [] {});
  engine::KvTransferConfig d;
  d.engine_id = "decode";
  d.handshake_timeout_s = 1000;  // a pull waits for the wake, as a live engine's would then
  const auto decode = net.make(d, executor, post, now, [] {});

  const auto start = clock.now();
  net.stall("prefill", start + duration_of(496.4));
  const engine::KvFetch pull = pull_of(prefill->hold({1, 2}, 1234, 11, [] {}), 11);
  std::optional<engine::KvFetchResult> pulled;
  decode->fetch(pull, [&](const engine::KvFetchResult& r) { pulled = r; });
  clock.advance_by(duration_of(497));
  for (size_t i = 0; i < tasks.size(); ++i) tasks[i]();
  EXPECT_FALSE(clock.ran_out());
  ASSERT_TRUE(pulled.has_value());
  EXPECT_TRUE(pulled->ok) << pulled->error;
}

}  // namespace
}  // namespace tandem::sim
