#pragma once
// KV transfers for an engine in process that move nothing: the test sees what the engine asked of
// them and ends each fetch, hold and room itself, so that it decides every outcome the engine
// reacts to (PdCoordinator) without real agents (kv_transfer_test.cpp has those).
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/transfer/kv_transfer.h"  // KvFetch, KvFetchResult; KvTransfers

namespace tandem::test {

class FakeKvTransfers final : public engine::KvTransfers {
 public:
  using Log = std::vector<std::string>;

  // `post` runs a task on the engine thread (at its next run_once): the engine's own, given to
  // make_transfers; an instant fetch ends through it. `log`, when given, gets the name of each call
  // that tells a prefill engine something or starts or ends a transfer, in order, and "ended" when
  // the engine destroys the fake. `serving`: whether it stands for a prefill engine's transfer
  // server (on port 1), as serving() tells the engine.
  explicit FakeKvTransfers(Post post = {}, std::shared_ptr<Log> log = {}, bool serving = false)
      : post(std::move(post)), log_(std::move(log)), serving_(serving) {}
  ~FakeKvTransfers() override { record("ended"); }

  const engine::KvTransferConfig& config() const override { return config_; }
  bool serving() const override { return serving_; }
  uint16_t port() const override { return serving_ ? 1 : 0; }
  std::string hold(std::vector<int32_t>, uint64_t, int64_t, Task release) override {
    record("hold");
    hold_releases.push_back(std::move(release));
    return std::to_string(hold_releases.size());  // a transfer id
  }
  uint64_t open_room(uint64_t, uint64_t, int64_t, RoomDone done) override {
    record("open_room");
    rooms.push_back(std::move(done));
    return rooms.size();  // its claim
  }
  void room_blocks(uint64_t, uint64_t, std::vector<int32_t>) override {}
  void room_layers_done(uint64_t, uint64_t, int64_t) override {}
  void room_progress(uint64_t, uint64_t, int64_t) override {}
  void room_failed(uint64_t, uint64_t, const std::string&) override { record("room_failed"); }
  void fetch(engine::KvFetch f, std::function<void(const engine::KvFetchResult&)> done) override {
    record("fetch");
    fetched.push_back(f.request_id);
    if (instant) {
      post([done = std::move(done)] { done({true, {}, 0}); });
      return;
    }
    fetches.push_back(std::move(done));
  }
  void cancel_fetch(const std::string&) override { record("cancel_fetch"); }
  void release_remote(const std::string& host, uint16_t port, const std::string& engine_id,
                      const std::string& transfer_id, std::vector<int32_t> blocks) override {
    record("release_remote");
    remote_releases.push_back({host, port, engine_id, transfer_id, std::move(blocks)});
  }
  void abandon_room(const std::string& host, uint16_t port, uint64_t room, uint64_t,
                    int64_t prompt_tokens, const std::string&) override {
    record("abandon_room");
    abandons.push_back({host, port, room, prompt_tokens});
  }
  int64_t held_blocks() const override { return 0; }

  // A release_remote call: the hold it lets go of.
  struct RemoteRelease {
    std::string host;
    uint16_t port = 0;
    std::string engine_id, transfer_id;
    std::vector<int32_t> blocks;
  };
  // An abandon_room call: the room it abandons.
  struct Abandon {
    std::string host;
    uint16_t port = 0;
    uint64_t room = 0;
    int64_t prompt_tokens = 0;
  };

  Post post;
  // Fetches succeed at the engine's next run_once; otherwise each waits in `fetches` for the test.
  bool instant = false;
  std::vector<std::string> fetched;  // the request ids whose fetch started, in order
  std::vector<std::function<void(const engine::KvFetchResult&)>> fetches;  // ends of those waiting
  std::vector<Task> hold_releases;                                         // of each hold, in order
  std::vector<RoomDone> rooms;  // the outcome of each room opened, in order
  std::vector<RemoteRelease> remote_releases;
  std::vector<Abandon> abandons;

 private:
  void record(const char* call) {
    if (log_) log_->push_back(call);
  }

  engine::KvTransferConfig config_;
  std::shared_ptr<Log> log_;
  bool serving_;
};

}  // namespace tandem::test
