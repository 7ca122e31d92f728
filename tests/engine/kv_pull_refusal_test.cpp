// A decode engine's pull of a prompt's KV that fails, as the engine reports it and as it leaves the
// prefill engine's hold (PdCoordinator::on_fetch_done): each outcome of a failed pull
// (KvFetchResult) gives the decode leg's error its status and code (api/error.h), which tell the
// gateway what to do next, and the hold is released from here exactly where no pull will come
// for it again and nothing else lets it go. Likewise a refused registration in a bootstrap room
// abandons the room where nothing else would end its prefill leg.
//
// The engine runs a simulated executor in process, stepped by run_once(); its KV transfers are a
// fake whose fetches end when the test ends them (kv_transfer_test.cpp has the real agents
// produce each outcome).
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "api/error.h"
#include "engine/engine.h"
#include "engine/fake_kv_transfers.h"
#include "engine/sim_engine_fixture.h"
#include "engine/transfer/kv_transfer.h"
#include "util/metrics.h"

namespace tandem::engine {
namespace {

// A decode engine in process whose one pull the test ends with `result`: the leg's final output
// and the releases the engine asked for.
struct PullEnded {
  api::RequestOutput output;
  std::vector<test::FakeKvTransfers::RemoteRelease> releases;
  std::vector<test::FakeKvTransfers::Abandon> abandons;
};

// `mode`: a pull of a held transfer, or a registration in a bootstrap room (parallel mode).
PullEnded end_a_pull_with(const KvFetchResult& result,
                          KvTransferSpec::Mode mode = KvTransferSpec::Mode::kDecodeByPull) {
  metrics::Registry registry;
  test::FakeKvTransfers* fake = nullptr;
  EngineConfig config;
  config.role = EngineRole::kDecode;
  config.transfer = KvTransferConfig{};
  config.make_transfers = [&fake](Executor&, KvTransfers::Post) {
    auto t = std::make_unique<test::FakeKvTransfers>();
    fake = t.get();
    return t;
  };
  auto engine = test::sim_engine(config, test::deepseek_v3_tokenizer(), registry);
  EngineRequest r;
  r.id = "leg";
  r.prompt = test::tokens(40, 100);
  r.sampling.max_tokens = 4;
  KvTransferSpec& kt = r.kv_transfer;
  kt.mode = mode;
  kt.host = "10.0.0.7";
  kt.port = 7100;
  if (mode == KvTransferSpec::Mode::kDecodeByRoom) {
    kt.room = 77;
  } else {
    kt.engine_id = "prefill-0";
    kt.transfer_id = "prefill-0-t0";
    kt.remote_blocks = {4, 5, 6};
  }
  PullEnded ended;
  r.on_output = [&ended](const api::RequestOutput& o) {
    if (o.finished) ended.output = o;
  };
  engine->submit(std::move(r));
  for (int i = 0; i < 10 && fake->fetches.empty(); ++i) engine->run_once();
  EXPECT_EQ(fake->fetches.size(), 1u) << "the leg never started its pull";
  if (fake->fetches.empty()) return ended;
  fake->fetches[0](result);
  for (int i = 0; i < 10 && !ended.output.finished; ++i) engine->run_once();
  EXPECT_TRUE(ended.output.finished);
  ended.releases = fake->remote_releases;
  ended.abandons = fake->abandons;
  engine->stop();
  return ended;
}

KvFetchResult failed(const std::string& error) {
  KvFetchResult r;
  r.error = error;
  return r;
}

// Every connection the prefill engine allows was in use: the engine is full for now (503), and
// the KV is still held there, so the code tells the gateway to send the decode leg again with the
// same kv_transfer_params after a short wait, and nothing releases the hold. It was a code-less
// 502, which the gateway counted against this engine and answered by prefilling the prompt again.
TEST(KvPullRefusal, APrefillEngineBusyForNowIsA503KvTransferBusyAndKeepsTheHold) {
  KvFetchResult busy = failed("too many KV transfer connections from this address; try again");
  busy.prefill_busy = true;
  const PullEnded ended = end_a_pull_with(busy);
  EXPECT_EQ(ended.output.finish_reason, "error");
  EXPECT_EQ(ended.output.error_status, 503);
  EXPECT_EQ(ended.output.error_code, api::kKvTransferBusyCode);
  EXPECT_NE(ended.output.error.find("try again"), std::string::npos) << ended.output.error;
  EXPECT_TRUE(ended.releases.empty()) << "the hold a retry pulls was released";
}

// A room's registration refused for the same reason leaves the room's prefill leg waiting for a
// registration that will not come (the gateway retries the pair with another room): the engine
// abandons the room, which ends that leg at once; it waited for the room's timeout. The leg still
// fails as any refusal's, 502 without a code: a gateway reads kv_transfer_busy as "send the decode
// leg again with the same KV" only in sequential mode, and in parallel mode as this engine full
// for now, avoided by the retry.
TEST(KvPullRefusal, ARoomRegistrationRefusedBusyAbandonsTheRoom) {
  KvFetchResult busy = failed("too many KV transfer connections from this address; try again");
  busy.prefill_busy = true;
  const PullEnded ended = end_a_pull_with(busy, KvTransferSpec::Mode::kDecodeByRoom);
  EXPECT_EQ(ended.output.finish_reason, "error");
  EXPECT_EQ(ended.output.error_status, 502);
  EXPECT_EQ(ended.output.error_code, "");
  EXPECT_NE(ended.output.error.find("try again"), std::string::npos) << ended.output.error;
  EXPECT_TRUE(ended.releases.empty());
  ASSERT_EQ(ended.abandons.size(), 1u) << "the room's prefill leg waits for its timeout";
  EXPECT_EQ(ended.abandons[0].host, "10.0.0.7");
  EXPECT_EQ(ended.abandons[0].port, 7100);
  EXPECT_EQ(ended.abandons[0].room, 77u);
  EXPECT_EQ(ended.abandons[0].prompt_tokens, 40);
}

// A pull the prefill engine answered with a refusal (here blocks that do not match its hold), or
// that failed on this engine (here its --kv-transfer-allow), names no engine at fault: the
// gateway prefills the prompt again, so nothing will pull this hold, and nothing else lets it go.
// The decode engine releases it. It stayed held until the prefill engine's --kv-transfer-timeout.
TEST(KvPullRefusal, AFailureThatNamesNoEngineReleasesTheHold) {
  for (const std::string error :
       {"remote_block_ids do not match the blocks held for transfer 'prefill-0-t0'",
        "KV transfer from 10.0.0.7 refused: the host is not in --kv-transfer-allow"}) {
    const PullEnded ended = end_a_pull_with(failed(error));
    EXPECT_EQ(ended.output.finish_reason, "error") << error;
    EXPECT_EQ(ended.output.error_status, 502) << error;
    EXPECT_EQ(ended.output.error_code, "") << error;
    ASSERT_EQ(ended.releases.size(), 1u) << error;
    const test::FakeKvTransfers::RemoteRelease& r = ended.releases[0];
    EXPECT_EQ(r.host, "10.0.0.7");
    EXPECT_EQ(r.port, 7100);
    EXPECT_EQ(r.engine_id, "prefill-0");
    EXPECT_EQ(r.transfer_id, "prefill-0-t0");
    EXPECT_EQ(r.blocks, (std::vector<int32_t>{4, 5, 6}));
  }
}

// The failures that carry a code leave the hold alone: a prefill engine at fault is told by the
// gateway (it releases the KV of a leg that blamed its prefill engine), one that no longer holds
// the transfer has nothing to release, and a busy one's hold is pulled again (above).
TEST(KvPullRefusal, AFailureWithACodeLeavesTheHoldToWhoeverTheCodeTells) {
  KvFetchResult fault = failed("the prefill engine did not answer within the handshake timeout");
  fault.prefill_fault = true;
  KvFetchResult gone = failed("unknown transfer 'prefill-0-t0'");
  gone.transfer_gone = true;
  for (const auto& [result, code] : {std::pair{fault, api::kKvTransferFailedCode},
                                     std::pair{gone, api::kKvTransferExpiredCode}}) {
    const PullEnded ended = end_a_pull_with(result);
    EXPECT_EQ(ended.output.error_status, 502) << result.error;
    EXPECT_EQ(ended.output.error_code, code) << result.error;
    EXPECT_TRUE(ended.releases.empty()) << result.error;
  }
}

}  // namespace
}  // namespace tandem::engine
