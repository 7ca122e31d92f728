#pragma once
// What the engine asks of KV transfer (kv_transfer.h describes the two flows): the P/D
// coordinator and the generation API call only this. The real agent (KvTransferAgent) moves
// bytes over a transport with its own threads; the cluster simulator (src/sim/) plugs in one that
// moves none and takes the time a link model gives, on its virtual clock. Every callback reaches
// the engine through the `Post` the implementation was given (run on the engine thread, in order).
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace tandem::engine {

struct KvTransferConfig;
struct KvFetch;
struct KvFetchResult;

class KvTransfers {
 public:
  using Task = std::function<void()>;
  using Post = std::function<void(Task)>;  // runs the task on the engine thread, in order
  // `abandoned`: the room failed because its decode leg ended before it registered
  // (abandon_room) or left after it did (closed its connection), which is no fault of this
  // engine's.
  using RoomDone = std::function<void(bool ok, const std::string& error, bool abandoned)>;

  virtual ~KvTransfers() = default;

  virtual const KvTransferConfig& config() const = 0;
  virtual bool serving() const = 0;   // prefill legs can be served (a server listens)
  virtual uint16_t port() const = 0;  // the bound port (0 without a server)

  // Prefill side, sequential: the finished prompt's blocks wait to be pulled; returns the transfer
  // id. `release` is posted once, when the blocks may be freed (pulled or expired).
  virtual std::string hold(std::vector<int32_t> blocks, uint64_t prompt_hash, int64_t num_tokens,
                           Task release) = 0;
  // Any thread: frees the held transfer `transfer_id` now (its `release` posted), as its pull
  // would: the request it was held for ended before any decode engine took it (the gateway's
  // POST /v1/kv_transfer/release). False when nothing is held by that id (never held here,
  // pulled, released or expired), or while a decode engine is pulling it: that pull frees it
  // when it ends, and its blocks must stay until then. (The default is that of an implementation
  // that holds nothing, such as tests' decode-side fakes.)
  virtual bool release_held(const std::string& /*transfer_id*/) { return false; }
  // Prefill side, parallel: claims the room (0 when another request holds it; throws
  // KvTransferError when the room already failed, room_abandoned set when its decode leg
  // abandoned it); `done` is posted once with the outcome.
  virtual uint64_t open_room(uint64_t room, uint64_t prompt_hash, int64_t prompt_tokens,
                             RoomDone done) = 0;
  virtual void room_blocks(uint64_t room, uint64_t claim, std::vector<int32_t> blocks) = 0;
  virtual void room_layers_done(uint64_t room, uint64_t claim, int64_t layers) = 0;
  // A chunk of the room's prompt was computed (`computed_tokens` so far): the room's deadline
  // starts again, and the waiting decode engine hears of it, so that a long prompt whose prefill
  // keeps progressing does not fail at the transfer timeout.
  virtual void room_progress(uint64_t room, uint64_t claim, int64_t computed_tokens) = 0;
  virtual void room_failed(uint64_t room, uint64_t claim, const std::string& reason) = 0;

  // Decode side: `done` is posted once; until then the transfer may write into f.local_blocks.
  virtual void fetch(KvFetch f, std::function<void(const KvFetchResult&)> done) = 0;
  virtual void cancel_fetch(const std::string& request_id) = 0;
  // Any thread: asks a prefill engine to free a held transfer without moving KV (best effort).
  virtual void release_remote(const std::string& host, uint16_t port, const std::string& engine_id,
                              const std::string& transfer_id, std::vector<int32_t> blocks) = 0;
  // Any thread: tells a prefill engine that the decode leg of `room` (for this prompt) ended
  // before it registered, so that the room's prefill leg fails now instead of holding its blocks
  // until the timeout, or is refused if it has not arrived yet (best effort).
  virtual void abandon_room(const std::string& host, uint16_t port, uint64_t room,
                            uint64_t prompt_hash, int64_t prompt_tokens,
                            const std::string& reason) = 0;

  // Blocks held for pulls or rooms right now.
  virtual int64_t held_blocks() const = 0;
};

}  // namespace tandem::engine
