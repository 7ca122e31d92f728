#pragma once
// KV transfer between a prefill engine and a decode engine, in the two flows real clusters use:
//
//  - sequential (vLLM NixlConnector shapes): the prefill engine computes the prompt, *holds* its
//    blocks under a transfer id and answers; the decode engine later connects and *pulls* the
//    blocks it lacks. Held blocks are freed once pulled, or after the timeout if nobody pulls.
//  - parallel (SGLang bootstrap shapes): both legs name the same bootstrap room. The decode engine
//    reserves blocks and *registers* the room with the prefill engine's bootstrap server; the
//    prefill engine *pushes* each layer as soon as the forward pass completes it. Either leg may
//    arrive first; each waits for the other at most the timeout.
//
// The decode engine always connects, the prefill engine always listens (one port serves both
// flows). Wire, over a KvTransport (kv_transport.h): the decode side sends one kPull or
// kRegister frame (JSON), the prefill side answers kAccept (JSON), then one kLayer frame per
// layer ([u32 layer][u32 flags][u64 XXH3-64 checksum or 0] + the tokens' bytes, block after
// block; sent gathered from the cache and received scattered into it when the executor exposes
// its memory), then kDone; kError (JSON {"message"}) ends a transfer early, on either side (a
// pull of a transfer the prefill engine does not hold says so with "transfer_gone": true). The
// decode engine always recomputes the prompt's last token (it needs its logits), so it asks for
// tokens [first_token, prompt - 1), first_token being where its own prefix cache stops. A decode
// leg that ends before it registers its room sends one kAbandon frame instead (answered kDone):
// the room's prefill leg then fails at once and frees its blocks, or is refused if it comes later.
// One that ends after it registered closes its connection, which the prefill side watches while
// it serves the room: the room fails the same way. (A decode leg cancelled while its fetch runs
// sends the kAbandon once the fetch ended, registered or not: it cannot tell. A room that is
// registered ignores it.)
//
// With a secret (KvTransferConfig::secret, one per deployment) every connection starts with a
// handshake in kAuth frames, before the request: the decode side sends {"nonce": Nd}, the
// prefill side answers {"nonce": Np, "proof": HMAC(secret, "tandem-kv-transfer server Nd Np")},
// the decode side checks it and sends {"proof": HMAC(secret, "tandem-kv-transfer client Np Nd")}
// (HMAC-SHA256, lowercase hex; nonces 16 random bytes in hex). Both sides prove they hold the
// secret and it never crosses the wire. The request that follows comes after a kAuth frame
// {"mac": HMAC(K, "tandem-kv-transfer request 0 TYPE PAYLOAD")}, K = HMAC(secret,
// "tandem-kv-transfer session Nd Np") (hex, as a key), TYPE the request's frame type as a decimal
// number and PAYLOAD its bytes: a stranger who gets a decode engine to connect to it (requests
// name hosts) and relays the handshake to a prefill engine can pass on only that engine's own
// request, never send one of its own. The prefill engine's frames carry no MAC: the cheapest
// keyed hash OpenSSL has, Poly1305, over each layer on both ends cost 13-58% of loopback TCP
// throughput and 235-279% of a one-copy (shared-memory) transfer of DeepSeek-V3's shape
// (measured 2026-12-06 on a 2-core VM; docs/reliability.md), and shared memory has no path to
// be on. So a relay (or an attacker on a TCP path, after the handshake) can still alter the KV
// a decode engine receives; --kv-transfer-allow (tandem serve sets it, but not for a wildcard
// --engine-host) keeps decode engines to the prefill engines' hosts. A peer that fails
// gets one kError saying only that it was not authenticated (the reason goes to the prefill
// engine's log), and each frame of a connection until its request (the first included) must arrive
// whole within handshake_timeout_s: silent or idle strangers cannot hold the port. Until a peer
// has proven that it holds the secret, no frame of its is read into memory past the size of the
// largest handshake frame (4 KiB), whatever size its header states.
//
// Threads: an accept thread, one thread per connection, one per fetch, one reaper for timeouts.
// Blocks are only read or written by those threads while the engine keeps them allocated; every
// callback to the engine goes through `post` (the engine runs it on its own thread).
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "engine/executor/executor.h"
#include "engine/transfer/kv_transfers.h"
#include "engine/transfer/kv_transport.h"
#include "util/error.h"
#include "util/log_throttle.h"
#include "util/metrics.h"

namespace tandem::engine {

// The environment variable an engine reads its KV transfer secret from when no flag gives one:
// `tandem serve` sets it for the engines it starts (one fresh secret per deployment), and an
// environment, unlike a command line, is not shown to other users of the host.
inline constexpr const char* kKvTransferSecretVariable = "TANDEM_KV_TRANSFER_SECRET";

// Shared memory with engines on this host (TCP with the others), or TCP with every engine.
enum class KvTransportKind { kShm, kTcp };

struct KvTransferConfig {
  std::string engine_id;  // this engine, as remote_engine_id in the responses
  std::string listen_host = "0.0.0.0";
  int port = -1;               // -1: no server (a decode-only engine); 0: any free port
  std::string advertise_host;  // what decode engines connect to (remote_host)
  // Held blocks, a room's wait for its other leg, and each I/O: each frame sent or received (one
  // layer's KV included), not a transfer as a whole, which may take a timeout per frame.
  double timeout_s = 120;
  // The deployment's shared secret (the handshake above); empty: no handshake, any peer that
  // can connect may transfer.
  std::string secret;
  // Prefill side: each frame until the request arrives within this. Decode side: the connect,
  // the handshake and a pull's accept within this as a whole (a prefill engine answers them at
  // once: one that does not is hung), as each release's whole exchange.
  double handshake_timeout_s = 5;
  // The prefill hosts a decode engine may connect to, as requests name them (kv_peer_allowed);
  // empty: any. Requests name hosts, so an engine open to strangers would connect wherever they
  // say.
  std::vector<std::string> allow;
  KvTransportKind transport = KvTransportKind::kShm;
  // Refusals a peer leaves for rooms this engine has not seen (an abandoned room, a decode
  // engine of another layout) are kept until the timeout so the late prefill leg fails at once;
  // past this many rooms none is left (that leg then waits out its timeout), so peers cannot
  // grow the table, and the reaper's scan of it, without bound.
  size_t max_rooms = 65536;
#ifdef NDEBUG
  bool checksum = false;  // XXH3-64 per layer; always on in debug builds
#else
  bool checksum = true;
#endif
  // Starts a thread running the given function, detached: std::thread when empty. Tests make it
  // throw std::system_error, as a process out of threads does.
  std::function<void(std::function<void()>)> start_thread;
  // The clock that the agent's timeouts, deadlines and retry waits read: std::chrono::steady_clock
  // when empty. Tests move it by hand. A connection still waits in real time up to the deadline
  // it is given (KvConnection::set_deadline), so a clock that runs ahead of the real one only
  // lets a real connection wait longer.
  std::function<std::chrono::steady_clock::time_point()> now;
};

// Whether a decode engine with this allow list may connect to `host`: an entry equal to it, or an
// IPv4 block (a.b.c.d/n) holding it. Names are compared as written, not resolved.
bool kv_peer_allowed(const std::vector<std::string>& allow, std::string_view host);
// Throws tandem::Error naming an entry that is neither a host nor a valid IPv4 block.
void check_kv_peer_allow(const std::vector<std::string>& allow);

// The address of KvConnection::peer() ("address:port"), as one text for each address: an IPv6
// one without brackets, in its shortest form; an IPv4-mapped IPv6 one as that IPv4 address.
// Anything else (a local peer over shared memory) is its text.
std::string kv_peer_address(std::string_view peer);
// The group of KvConnection::peer() whose connections in their handshake count together against
// KvHandshakeCounts::kMaxPerGroup: an IPv6 address's /64, the least one host is given (it could
// take a new address for every connection); any other address (kv_peer_address) alone.
std::string kv_handshake_group(std::string_view peer);

// The connections a prefill engine's transfer server has taken that are still in their handshake
// (or, without a secret, before their request), so that no host holds many of the port's slots
// with connections that never get past it, reconnecting faster than the handshake timeout closes
// them. At most kMaxPerAddress from one address, and kMaxPerGroup from one kv_handshake_group: one
// host may own a whole IPv6 /64, but so do the decode engines of one subnet (a cloud's IPv6
// subnet, a Kubernetes node's pod range), whose bursts of fetches must not share one address's
// cap. Not thread-safe.
class KvHandshakeCounts {
 public:
  static constexpr int64_t kMaxPerAddress = 64;
  static constexpr int64_t kMaxPerGroup = 256;  // of the port's 512

  // Counts a connection from `peer` (KvConnection::peer()) and returns "", or returns why it is
  // refused and counts nothing.
  std::string admit(std::string_view peer);
  // A connection admit() counted is past its handshake, or gone.
  void over(std::string_view peer);

 private:
  std::unordered_map<std::string, int64_t> by_address_, by_group_;
};

// What a decode engine asks for.
struct KvFetch {
  std::string request_id;  // the engine request it is for (cancel_fetch)
  bool pull = true;        // sequential pull, else register a bootstrap room
  std::string host;        // the prefill engine's transfer server
  uint16_t port = 0;
  std::string engine_id, transfer_id;  // pull: remote_engine_id, remote_request_id
  std::vector<int32_t> remote_blocks;  // pull: remote_block_ids, the whole list
  uint64_t room = 0;                   // register: bootstrap_room
  uint64_t prompt_hash = 0;            // register: kv_prompt_hash() of the prompt
  int64_t prompt_tokens = 0;           // the prompt's length
  int64_t first_token = 0;             // tokens before it are cached here (block aligned)
  int64_t num_tokens = 0;              // transfer tokens [first_token, num_tokens)
  std::vector<int32_t> local_blocks;   // this engine's blocks for those tokens, in order
};

struct KvFetchResult {
  bool ok = false;
  std::string error;
  uint64_t bytes = 0;
  // A failure of the prefill engine's: it could not be reached, went silent or closed the
  // connection, or broke the protocol. Not one of this engine's (its --kv-transfer-allow, its
  // cancellation or shutdown) nor an error the prefill engine answered (an unknown transfer, a
  // layout or secret that differs, too many connections): those name no engine at fault.
  bool prefill_fault = false;
  // A pull the prefill engine refused because it no longer holds the transfer (it expired after
  // --kv-transfer-timeout, was pulled already, or was never held there, as after a restart): no
  // engine's fault, and the prompt's KV is gone, so the request must be prefilled again.
  bool transfer_gone = false;
  // A pull or a room's registration the prefill engine refused for now, before reading it: every
  // KV transfer connection it allows (in all, or from this engine's address or its /64) was in
  // use, or it could not start a thread for one. No engine's fault. A pull's KV is still held
  // there: the same pull may succeed once a connection is free. A room's prefill leg still waits
  // for a registration (PdCoordinator::on_fetch_done abandons the room).
  bool prefill_busy = false;
};

// A transfer that cannot happen for a reason on the other engine (its answer is a 502, not a
// client error).
class KvTransferError : public Error {
 public:
  using Error::Error;
  KvTransferError(const std::string& message, bool room_abandoned)
      : Error(message), room_abandoned(room_abandoned) {}
  // A room refused because its decode leg abandoned it (KvTransfers::abandon_room) or left it:
  // no fault of either engine's transfer.
  bool room_abandoned = false;
};

// The hash both legs of a bootstrap room compare, so a room never joins different prompts.
uint64_t kv_prompt_hash(std::span<const int32_t> prompt);

// What a prefill leg is refused with when it comes for `room` after the room, registered by its
// decode leg, timed out (`timeout_s`, the prefill engine's) and that leg was failed. The live
// agent and the simulator (sim/virtual_kv_links.cpp) both say it.
std::string kv_room_expired_text(uint64_t room, double timeout_s);
// What a decode leg is failed with when no prefill leg came for `room` within `timeout_s`, and
// what a prefill leg is failed with when no decode engine registered `room` in time; the live
// agent and the simulator both say them.
std::string kv_no_prefill_text(uint64_t room, double timeout_s);
std::string kv_no_decode_text(uint64_t room, double timeout_s);

// The KvTransfers of real engines: bytes over a KvTransport, on threads of its own.
class KvTransferAgent final : public KvTransfers {
 public:
  // Starts the server when config.port >= 0 (throws tandem::Error if it cannot listen).
  KvTransferAgent(const KvTransferConfig& config, Executor& executor,
                  std::unique_ptr<KvTransport> transport, metrics::Registry& registry, Post post);
  ~KvTransferAgent() override;  // shuts every connection and waits for the threads
  KvTransferAgent(const KvTransferAgent&) = delete;
  KvTransferAgent& operator=(const KvTransferAgent&) = delete;

  const KvTransferConfig& config() const override { return config_; }
  bool serving() const override { return listener_ != nullptr; }
  uint16_t port() const override;  // the bound port (0 without a server)

  // --- prefill side, sequential: the finished prompt's blocks wait to be pulled. Returns the
  // transfer id: the engine id, '-', and 32 hex digits of a cryptographic generator (not derived
  // from another id: whoever can connect to the port must not be able to name it). `release` is
  // posted once, when the blocks may be freed (pulled or expired). A pull must name the same prompt
  // (kv_prompt_hash and length): KV never lands under another prompt's tokens in the decode
  // engine's prefix cache.
  std::string hold(std::vector<int32_t> blocks, uint64_t prompt_hash, int64_t num_tokens,
                   Task release) override;
  bool release_held(const std::string& transfer_id) override;

  // --- prefill side, parallel. open_room (engine thread, at admission) claims the room for a
  // prefill request and returns its claim (non-zero); 0 when the room is already claimed by
  // another one. Once claimed, `done` is posted exactly once: ok after the decode engine received
  // everything, else with the reason; the engine keeps the request's blocks until then. Throws
  // KvTransferError when the room already failed (its decode engine was refused). The calls
  // below name the claim, so a late call from an earlier, failed claim of the same room number
  // never touches a newer one.
  uint64_t open_room(uint64_t room, uint64_t prompt_hash, int64_t prompt_tokens,
                     RoomDone done) override;
  // Engine thread, before the step that completes the prompt: the prompt's block table.
  void room_blocks(uint64_t room, uint64_t claim, std::vector<int32_t> blocks) override;
  // Engine thread, during or after that step: layers [0, layers) of the prompt are complete.
  void room_layers_done(uint64_t room, uint64_t claim, int64_t layers) override;
  // The prefill request failed or was aborted before it completed: tell the decode side.
  void room_failed(uint64_t room, uint64_t claim, const std::string& reason) override;
  void room_progress(uint64_t room, uint64_t claim, int64_t computed_tokens) override;

  // --- decode side: `done` is posted once, with the outcome; until then the transfer may write
  // into f.local_blocks. cancel_fetch makes a running fetch fail promptly. A prefill engine that
  // does not answer within the handshake timeout (KvTransferConfig::handshake_timeout_s) fails the
  // fetch as its fault; only what waits for its compute (a room's prompt) and each layer frame
  // wait up to the transfer timeout.
  void fetch(KvFetch f, std::function<void(const KvFetchResult&)> done) override;
  void cancel_fetch(const std::string& request_id) override;
  // Any thread: asks a prefill engine to free a held transfer without moving any KV (a pull of
  // zero tokens), in the background; failures are ignored (the hold expires anyway). At most
  // kMaxReleases run at once, each bounded by the handshake timeout as a whole (connect,
  // handshake and answer, its clock started once the host's name is resolved); more wait their
  // turn, up to kMaxQueuedReleases, and past that are dropped and counted (a client naming a
  // silent host in many refused requests must not tie up the transfer threads). Of those,
  // kMaxReleasesPerPeer at once go to one prefill engine, and past kReleaseShareOfHost to the
  // engines of one host (as `host` names it) only while no other host's message could go: a hung
  // engine holds up only its own, a hung machine of them leaves other hosts the senders that end
  // first, and one host alone may use them all. When the queue is full, a message to an engine
  // with a shorter queue takes the place of the newest of the longest (that one dropped), hosts
  // first: the newcomer's host is one with fewer queued than the host with the most, whose
  // longest engine's newest then goes, else one of that host's own engines is longer than the
  // newcomer's; otherwise the newcomer is dropped. One client naming many ports of one host fills
  // only that host's share; one that may name hosts too (no KvTransferConfig::allow, or an allow
  // list of ranges) makes each host it names one more, and so may still fill the queue with them
  // all. One whose sender cannot start (the process is out of threads) stays
  // queued for the next try. One refused as busy kMaxBusyRefusals + 1 times is dropped, counted.
  void release_remote(const std::string& host, uint16_t port, const std::string& engine_id,
                      const std::string& transfer_id, std::vector<int32_t> blocks) override;
  // A kAbandon frame, sent as release_remote sends its pull (same bound on those in flight).
  void abandon_room(const std::string& host, uint16_t port, uint64_t room, uint64_t prompt_hash,
                    int64_t prompt_tokens, const std::string& reason) override;

  // Blocks held for pulls or rooms right now: what the tandem:kv_transfer_held_blocks gauge
  // shows (refreshed by the reaper); tests read it to see that nothing stays held.
  int64_t held_blocks() const override;

  // The release queue's bookkeeping, for tests: messages queued, of them refused as busy and
  // waiting for their next try, senders at work, and the engines it keeps (each one has a message
  // queued or being sent, or it is forgotten).
  struct ReleaseQueueState {
    size_t queued = 0, deferred = 0, engines = 0;
    int64_t sending = 0;
  };
  ReleaseQueueState release_queue_state() const;

 private:
  struct Held;
  struct Room;
  // A refusal marker for `room`, unless the table is full (KvTransferConfig::max_rooms): a
  // prefill leg that arrives later is refused with `error`; when the room was `abandoned`, only
  // the leg of that prompt. Under mutex_.
  void leave_refusal(uint64_t room, const std::string& error, bool abandoned = false,
                     uint64_t prompt_hash = 0, int64_t prompt_tokens = 0);
  struct Metrics;
  void accept_loop();
  void serve(std::shared_ptr<KvConnection> conn, const std::string& peer);
  // The handshake, then the request; `handshake_done` runs once the peer is past the handshake.
  void serve_connection(KvConnection& conn, const std::function<void()>& handshake_done);
  void refused(const std::string& peer, const std::string& why);  // counted, logged (rate-limited)
  void serve_pull(KvConnection& conn, const std::vector<std::byte>& request);
  void serve_register(KvConnection& conn, const std::vector<std::byte>& request);
  void serve_abandon(KvConnection& conn, const std::vector<std::byte>& request);
  // Under mutex_: ends the hold `id`, its release posted to the engine: false when there is none,
  // or when a connection pulls it and this is not that pull's own end (`by_its_pull`).
  bool free_held_locked(const std::string& id, bool by_its_pull);
  // release_remote and abandon_room: one JSON frame to a prefill engine, in the background,
  // answered by kDone or kError (or nothing: failures are ignored).
  void tell_prefill(const std::string& host, uint16_t port, KvFrameType type, std::string request);
  struct QueuedRelease {
    std::string host;
    uint16_t port = 0;
    KvFrameType type{};
    std::string request;
    int busy_refusals = 0;                               // times the engine refused it as busy
    std::chrono::steady_clock::time_point not_before{};  // after such a refusal: its next try
    std::string peer() const { return host + ":" + std::to_string(port); }  // the engine told
  };
  // Under mutex_: `r` waits for a sender; false when it must be dropped (too many wait), else
  // perhaps in place of another engine's newest message (dropped and counted). O(log engines).
  bool queue_release_locked(QueuedRelease r);
  struct ReleasePeer;
  // Under mutex_: `r` joins its engine's queue (at its front: it goes first), counted in all,
  // for its host and engine.
  void enqueue_release_locked(QueuedRelease r, bool at_front = false);
  // Under mutex_: the oldest (else the newest) message queued for `peer`, no longer counted.
  QueuedRelease dequeue_release_locked(ReleasePeer& peer, bool newest = false);
  // Starts senders for queued messages while there are senders to spare and messages they may
  // take.
  void start_release_senders();
  // A sender, on a worker: `first`, then queued messages next_release_locked picks, until none is
  // left.
  void send_releases(QueuedRelease first);
  // Failures are ignored but for a refusal as busy (every connection the engine allows in use):
  // true, and the message may be tried again.
  bool send_release(const QueuedRelease& r);
  // Under mutex_: the next queued message whose engine has a sender to spare, those of hosts
  // within their share first, counted as sent: engines in turn, each one's in order; O(engines).
  std::optional<QueuedRelease> next_release_locked();
  // Under mutex_: forgets the engine `peer` and `host` when nothing is sent or queued for them.
  void forget_idle_release_peer_locked(const std::string& host, const std::string& peer);
  struct FetchSlot {
    std::shared_ptr<KvConnection> conn;
    bool cancelled = false;
  };
  void run_fetch(KvFetch f, FetchSlot* slot, const std::function<void(const KvFetchResult&)>& done);
  // A room fetch, registered: the frame that ends its wait for the prompt (accept or error),
  // reading the progress frames before it. Each that tells of more of the prompt computed
  // restarts the timeout; others do not.
  KvFrame await_room(KvConnection& conn, const KvFetch& f);
  void send_layers(KvConnection& conn, const std::vector<int32_t>& blocks, int64_t first_token,
                   int64_t num_tokens, int64_t from_layer, int64_t to_layer, bool with_checksum);
  // Under mutex_. `abandoned`: the decode leg abandoned the room (RoomDone).
  void finish_room(uint64_t room, bool ok, const std::string& error, bool abandoned = false);
  void reap_loop();  // also refreshes the held-blocks gauge
  int64_t held_blocks_locked() const;
  // Runs `body` on the worker pool; false: no worker could be started.
  bool spawn(std::function<void()> body);
  void worker();  // a pool thread: runs queued work until idle for kWorkerIdle, or stopping
  std::chrono::steady_clock::time_point deadline() const;
  std::chrono::steady_clock::time_point now() const;  // KvTransferConfig::now

  KvTransferConfig config_;
  Executor& executor_;
  KvLayout layout_;
  std::unique_ptr<KvTransport> transport_;
  Post post_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<KvListener> listener_;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  bool stopping_ = false;
  // The worker pool that runs connections and fetches: threads are reused, at most
  // kMaxWorkers at once; work beyond that waits in `work_` for a free worker.
  int64_t threads_ = 0;       // workers alive
  int64_t idle_workers_ = 0;  // of them, waiting for work
  std::deque<std::function<void()>> work_;
  std::condition_variable work_ready_;
  uint64_t next_claim_ = 0;
  int64_t connections_ = 0;        // server connections being served
  KvHandshakeCounts handshaking_;  // under mutex_: connections not yet past the handshake
  // A flood of strangers must not flood the log.
  LogThrottle refusal_log_{std::chrono::seconds(10)};
  std::map<std::string, std::unique_ptr<Held>> held_;
  std::map<uint64_t, std::unique_ptr<Room>> rooms_;
  std::unordered_map<std::string, FetchSlot> fetches_;   // by request id
  std::vector<std::shared_ptr<KvConnection>> serving_;   // open server sides
  int64_t releasing_ = 0;                                // tell_prefill senders running
  std::vector<std::shared_ptr<KvConnection>> releases_;  // and their open connections
  size_t queued_releases_ = 0;                           // messages waiting for a sender
  size_t deferred_releases_ = 0;  // of them, refused as busy and waiting for their next try
  struct ReleasePeer {            // a prefill engine
    int64_t sending = 0;          // senders at work on its messages
    std::deque<QueuedRelease> queued;
  };
  struct ReleaseHost {
    int64_t sending = 0;  // senders at work on messages to its engines
    size_t queued = 0;    // messages queued for its engines
    // Its engines with messages queued, by their number (the longest last), and their names.
    std::set<std::pair<size_t, std::string>> peers_by_queued;
  };
  std::map<std::string, ReleasePeer> release_peers_;            // by QueuedRelease::peer()
  std::string last_release_peer_;                               // the last one picked
  std::unordered_map<std::string, ReleaseHost> release_hosts_;  // by QueuedRelease::host
  // Hosts with messages queued, by their number (the most last), and their names: the queue's
  // victim when it is full comes from the last.
  std::set<std::pair<size_t, std::string>> hosts_by_queued_;
  std::thread accept_thread_, reap_thread_;
};

}  // namespace tandem::engine
