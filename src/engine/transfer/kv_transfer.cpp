#include "engine/transfer/kv_transfer.h"

#include <arpa/inet.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <exception>
#include <optional>
#include <random>

#include <xxhash.h>
#include <nlohmann/json.hpp>

#include "util/duration.h"
#include "util/error.h"
#include "util/json.h"
#include "util/little_endian.h"
#include "util/secret.h"
#include "util/utf8.h"

namespace tandem::engine {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr size_t kControlLimit = 1 << 20;  // JSON frames
// The largest frame of the handshake (JSON of nonces, proofs and MACs of at most kNonceHexMax hex
// digits, or a short refusal), with room to spare: what a peer that has not proven anything yet
// may make this engine read into memory, whatever its frame's header states.
constexpr size_t kHandshakeFrameLimit = 4096;
constexpr size_t kLayerHeader = 16;  // [u32 layer][u32 flags][u64 checksum]
constexpr uint32_t kFlagChecksum = 1;
constexpr int64_t kMaxConnections = 512;  // served at once; more are refused, not queued
// A stranger with one /64 holds at most half the port in handshakes (decode engines finish theirs
// in a round trip); the others' slots stay free.
static_assert(KvHandshakeCounts::kMaxPerGroup < kMaxConnections);
// Worker threads at most: every connection served at once, plus room for the decode side's
// fetches, which therefore never wait behind connections blocked on their transfers.
constexpr int64_t kMaxWorkers = kMaxConnections + 128;
// release_remote and abandon_room messages sent at once (each is a connection and a worker for up
// to the handshake timeout), and waiting their turn beyond those. A burst (a gateway cancelling
// hundreds of decode legs) is sent in turn rather than dropped: a dropped one holds a prefill
// engine's blocks until its timeout, when it most needs them. Past the queue they are dropped and
// counted; the prefill engine frees what nobody releases when it expires anyway.
constexpr int64_t kMaxReleases = 16;
constexpr size_t kMaxQueuedReleases = 4096;
// Of those, to one prefill engine (host and port): a hung one holds each of its senders for the
// handshake timeout, and a burst to it (a gateway cancelling the legs of a prefill engine it just
// ejected) took every sender, so that releases to healthy engines waited behind it. A host (as a
// release names it) has a share of the senders: past it, its engines get a sender only while no
// message of a host within its share waits for one. A hung machine (four engines, one per GPU)
// thus leaves other machines' releases the first senders to end, and a hung engine does not hold
// up its host-mates, while one machine alone (every engine of `tandem serve` on one host) may use
// every sender. The queue is shared alike: one engine may fill it while it has room, and once it
// is full a message to a host with fewer queued takes the place of the newest message of the host
// with the most (of its longest engine; dropped and counted), and within one host, a message to
// an engine with a shorter queue that of the longest; past that, the newcomer is dropped. Hosts
// first, since a client chooses the port a release goes to, and one host named on a hundred ports
// is a hundred engines.
constexpr int64_t kMaxReleasesPerPeer = 2;
constexpr int64_t kReleaseShareOfHost = 4;
static_assert(kMaxReleasesPerPeer < kReleaseShareOfHost && kReleaseShareOfHost < kMaxReleases);
// A message the prefill engine refused as busy is sent again after 100 ms, then twice as long each
// time, up to 5 tries in all (1.5 s of waits): the abandon that follows a room registration refused
// as busy needs a connection to that same busy engine, and dropped, the room's prefill leg waited
// out the timeout. Past that it is dropped and counted (the engine's timeout frees what it holds).
constexpr auto kBusyRetryFirst = std::chrono::milliseconds(100);
constexpr int kMaxBusyRefusals = 4;
// A worker with nothing to do for this long ends (a burst's threads do not linger).
constexpr auto kWorkerIdle = std::chrono::seconds(10);
// How often a prefill engine serving a registered room looks whether its decode engine is still
// connected while it waits (one system call per room each time).
constexpr auto kPeerCheck = std::chrono::milliseconds(100);

std::span<const std::byte> bytes_of(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

void send_json(KvConnection& conn, KvFrameType type, const json& j) {
  const std::string text = j.dump();
  const std::span<const std::byte> parts[] = {bytes_of(text)};
  conn.send(type, parts);
}

// What a refusal tells the decode engine besides its message (KvFetchResult).
enum class Refusal {
  kOther,
  kTransferGone,  // "transfer_gone": true, KvFetchResult::transfer_gone
  kBusy,          // "busy": true, KvFetchResult::prefill_busy
};

void send_error(KvConnection& conn, const std::string& message, Refusal kind = Refusal::kOther) {
  json error = {{"message", message}};
  if (kind == Refusal::kTransferGone) error["transfer_gone"] = true;
  if (kind == Refusal::kBusy) error["busy"] = true;
  try {
    send_json(conn, KvFrameType::kError, error);
  } catch (const std::exception&) {
    // The peer is gone; it learns of the failure from the closed connection.
  }
}

// Tells a connection that will not be served now (every connection it may take is in use) why,
// as busy: the same request may succeed later, and a pull's KV stays held. Without waiting on its
// peer: the frame goes only if it fits at once. The accept loop refuses, and nothing may hold it
// (nor the shutdown that joins it): a local peer writes the counters of its shared-memory ring and
// can claim it full.
void refuse_for_now(KvConnection& conn, const std::string& message) {
  conn.set_timeout(std::chrono::milliseconds(0));
  send_error(conn, message, Refusal::kBusy);
}

json parse_control(const KvFrame& f, const std::string& what) {
  try {
    return parse_untrusted_json(
        std::string_view(reinterpret_cast<const char*>(f.payload.data()), f.payload.size()));
  } catch (const std::exception& e) {
    throw Error(what + ": malformed JSON frame: " + e.what());
  }
}

// The message of a peer's error frame, clipped as any peer's text (it reaches logs and a client's
// 502); a frame without one still says that the peer failed.
std::string error_message(const KvFrame& f) {
  const json j = parse_control(f, "error");
  if (j.is_object() && j.contains("message") && j["message"].is_string())
    return utf8::clip(j["message"].get<std::string>());
  return "the peer reported an error without a message";
}

// A fetch that failed for a reason on this side, or one the prefill engine gave in an error frame
// (it was there and answered): not a prefill engine that died, hung or broke the protocol
// (KvFetchResult::prefill_fault).
class NotThePrefillsFault : public Error {
 public:
  using Error::Error;
};

// The prefill engine's answer to a pull of a transfer it does not hold (KvFetchResult::
// transfer_gone).
class TransferGone : public NotThePrefillsFault {
 public:
  using NotThePrefillsFault::NotThePrefillsFault;
};

// The prefill engine's answer that every connection it allows was in use (KvFetchResult::
// prefill_busy).
class PrefillBusy : public NotThePrefillsFault {
 public:
  using NotThePrefillsFault::NotThePrefillsFault;
};

// Whether an error frame's JSON sets `flag` (Refusal).
bool refusal_says(const json& j, const char* flag) {
  return j.is_object() && j.contains(flag) && j[flag] == true;
}

// The refusal a peer's error frame carries, as the exception that stands for it.
std::exception_ptr refusal_of(const KvFrame& f) {
  const std::string message = error_message(f);
  const json j = parse_control(f, "error");
  if (refusal_says(j, "transfer_gone")) return std::make_exception_ptr(TransferGone(message));
  if (refusal_says(j, "busy")) return std::make_exception_ptr(PrefillBusy(message));
  return std::make_exception_ptr(NotThePrefillsFault(message));
}

[[noreturn]] void throw_refusal(const KvFrame& f) {
  std::rethrow_exception(refusal_of(f));
}

// Sends the decode side's first frame on a connection. A prefill engine that refuses the
// connection tells why and closes at once, maybe before that frame went out: the send then fails
// (over shared memory it always does) while the reason waits to be read, and the reason is what
// the decode engine reports.
void send_opening(KvConnection& conn, KvFrameType type, const std::string& text) {
  try {
    const std::span<const std::byte> parts[] = {bytes_of(text)};
    conn.send(type, parts);
  } catch (const std::exception&) {
    std::exception_ptr refusal;
    try {
      conn.set_timeout(std::chrono::milliseconds(0));
      // A refusal is short, and the peer may not have proven anything yet.
      const KvFrame f = conn.receive(kHandshakeFrameLimit);
      if (f.type == KvFrameType::kError) refusal = refusal_of(f);
    } catch (const std::exception&) {
      // Nothing was said: the failed send's error stands.
    }
    if (refusal) std::rethrow_exception(refusal);
    throw;
  }
}

// "a layer frame of 4112 bytes": what arrived, for errors about the unexpected.
std::string frame_text(KvFrameType type, uint64_t bytes) {
  return std::string("a ") + kv_frame_type_name(type) + " frame of " + std::to_string(bytes) +
         " bytes";
}

// ---------------------------------------------------------------- the handshake (kv_transfer.h)

// All an unauthenticated peer learns (nothing of the model or its cache layout).
constexpr const char* kNotAuthenticated = "KV transfer refused: not authenticated";
constexpr size_t kNonceHexMax = 128;

std::string handshake_proof(const std::string& secret, const char* side, const std::string& first,
                            const std::string& second) {
  return hmac_sha256_hex(secret,
                         std::string("tandem-kv-transfer ") + side + " " + first + " " + second);
}

// A handshake, error or progress frame's JSON, parsed once; null when it is not JSON.
json handshake_json(const KvFrame& f) {
  try {
    return parse_untrusted_json(
        std::string_view(reinterpret_cast<const char*>(f.payload.data()), f.payload.size()));
  } catch (const std::exception&) {
    return nullptr;
  }
}

// A string field of that JSON, or empty when it is missing, not a string or oversized.
std::string handshake_field(const json& j, const char* name) {
  if (!j.is_object() || !j.contains(name) || !j[name].is_string()) return {};
  std::string v = j[name].get<std::string>();
  return v.size() <= kNonceHexMax ? v : std::string();
}

// The key of a connection's requests: the secret bound to this handshake's nonces, so that a
// stranger who relays a handshake between two engines cannot make requests of its own after it.
std::string session_key(const std::string& secret, const std::string& decode_nonce,
                        const std::string& prefill_nonce) {
  return handshake_proof(secret, "session", decode_nonce, prefill_nonce);
}

// The MAC of the `n`th request a decode engine sends on a connection (the first is 0).
std::string request_mac(const std::string& session, uint64_t n, KvFrameType type,
                        std::span<const std::byte> payload) {
  return hmac_sha256_hex(
      session, "tandem-kv-transfer request " + std::to_string(n) + " " +
                   std::to_string(static_cast<uint32_t>(type)) + " " +
                   std::string(reinterpret_cast<const char*>(payload.data()), payload.size()));
}

// Decode side, after the handshake: the request, with a secret preceded by a kAuth frame holding
// its MAC (`session` empty: no secret, no MAC).
void send_request(KvConnection& conn, const std::string& session, KvFrameType type,
                  const std::string& text) {
  if (!session.empty())
    send_opening(conn, KvFrameType::kAuth,
                 json{{"mac", request_mac(session, 0, type, bytes_of(text))}}.dump());
  send_opening(conn, type, text);
}

// Decode side, right after connecting: proves that it holds the secret and checks that the
// prefill engine does too; returns the connection's session key. Throws KvTransferError when the
// prefill engine refuses or fails.
std::string authenticate_to_prefill(KvConnection& conn, const std::string& secret,
                                    const std::string& where) {
  const std::string mine = random_secret_hex(16);
  send_opening(conn, KvFrameType::kAuth, json{{"nonce", mine}}.dump());
  const KvFrame reply = conn.receive(kHandshakeFrameLimit);
  const json answer = handshake_json(reply);
  if (reply.type == KvFrameType::kError) {
    const std::string refusal =
        "KV transfer from " + where + ": " + handshake_field(answer, "message");
    if (refusal_says(answer, "busy")) throw PrefillBusy(refusal);
    throw KvTransferError(refusal);
  }
  const std::string theirs = handshake_field(answer, "nonce");
  if (reply.type != KvFrameType::kAuth || theirs.empty())
    throw KvTransferError("KV transfer from " + where + ": no answer to the handshake");
  if (!secrets_equal(handshake_field(answer, "proof"),
                     handshake_proof(secret, "server", mine, theirs)))
    throw KvTransferError("KV transfer from " + where +
                          ": the prefill engine does not hold this engine's KV transfer secret "
                          "(--kv-transfer-secret differs)");
  send_json(conn, KvFrameType::kAuth, {{"proof", handshake_proof(secret, "client", theirs, mine)}});
  return session_key(secret, mine, theirs);
}

// Prefill side, with a secret: the connection's first frame, from a peer that has proven nothing
// yet. Its payload is kept only up to kHandshakeFrameLimit: a stranger must not make this engine
// allocate what a header states (up to kControlLimit, on each connection the port admits) before
// it even sends it. A larger handshake frame comes back with an empty payload, unread (no
// handshake is that large: it is refused as malformed on its header); a larger frame of another
// type (the request of a decode engine without the secret) is read in pieces and dropped, within
// the handshake's deadline, so that the refusal that follows reaches the engine that sent it.
KvFrame receive_first_frame(KvConnection& conn) {
  KvFrame f;
  uint64_t size = 0;
  f.type = conn.receive_header(size, kControlLimit);
  if (size <= kHandshakeFrameLimit) {
    f.payload.resize(size);
    const std::span<std::byte> whole(f.payload);
    conn.receive_payload(std::span(&whole, 1));
  } else if (f.type != KvFrameType::kAuth) {
    std::array<std::byte, 16384> sink;
    for (uint64_t left = size; left > 0;) {
      const std::span<std::byte> piece(sink.data(), std::min<uint64_t>(left, sink.size()));
      conn.receive_payload(std::span(&piece, 1));
      left -= piece.size();
    }
  }
  return f;
}

// Prefill side, `first` being the connection's first frame: empty when the decode engine proved
// that it holds the secret (`session` then gets the connection's session key), else why not
// (for the log, not for the peer).
std::string authenticate_decode(KvConnection& conn, const std::string& secret, const KvFrame& first,
                                std::string& session) {
  if (first.type != KvFrameType::kAuth)
    return "no handshake (a decode engine without --kv-transfer-secret, or not an engine)";
  const std::string theirs = handshake_field(handshake_json(first), "nonce");
  if (theirs.empty()) return "a malformed handshake";
  const std::string mine = random_secret_hex(16);
  send_json(conn, KvFrameType::kAuth,
            {{"nonce", mine}, {"proof", handshake_proof(secret, "server", theirs, mine)}});
  KvFrame answer;
  try {
    answer = conn.receive(kHandshakeFrameLimit);
  } catch (const std::exception& e) {
    return std::string("the handshake was not completed: ") + e.what();
  }
  if (answer.type != KvFrameType::kAuth) return "the handshake was not completed";
  if (!secrets_equal(handshake_field(handshake_json(answer), "proof"),
                     handshake_proof(secret, "client", mine, theirs)))
    return "a wrong proof (a different --kv-transfer-secret)";
  session = session_key(secret, theirs, mine);
  return {};
}

json layout_json(const KvLayout& k) {
  return {{"model", k.model},
          {"layers", k.layers},
          {"block_size", k.block_size},
          {"token_bytes", k.token_bytes}};
}

// Empty when the peer's layout (from its request) matches ours, else what differs.
std::string layout_mismatch(const json& theirs, const KvLayout& ours) {
  if (!theirs.is_object()) return "the request has no KV layout";
  auto differs = [&](const char* field, const json& mine) -> std::string {
    if (!theirs.contains(field) || theirs[field] != mine)
      return std::string(field) + " mismatch: this prefill engine has " + mine.dump() +
             ", the decode engine " +
             (theirs.contains(field) ? utf8::clip(theirs[field].dump()) : "none");
    return {};
  };
  for (auto [field, mine] : {std::pair<const char*, json>{"model", ours.model},
                             {"block_size", ours.block_size},
                             {"layers", ours.layers},
                             {"token_bytes", ours.token_bytes}})
    if (auto d = differs(field, mine); !d.empty()) return d;
  return {};
}

template <typename T>
T get_field(const json& j, const char* name) {
  if (!j.contains(name)) throw Error(std::string("missing field '") + name + "'");
  try {
    return j.at(name).get<T>();
  } catch (const std::exception&) {
    throw Error(std::string("field '") + name + "' has the wrong type");
  }
}

// The layer frame's header: [u32 layer][u32 flags][u64 checksum], little-endian.
struct LayerHeader {
  uint64_t layer = 0;
  bool has_checksum = false;
  uint64_t checksum = 0;
};

void encode(const LayerHeader& h, std::byte* out) {
  put_le(out, h.layer, 4);
  put_le(out + 4, h.has_checksum ? kFlagChecksum : 0, 4);
  put_le(out + 8, h.checksum, 8);
}
LayerHeader decode(const std::byte* in) {
  return {get_le(in, 4), (get_le(in + 4, 4) & kFlagChecksum) != 0, get_le(in + 8, 8)};
}

// XXH3-64 over a layer's bytes as they lie, in pieces (block after block).
template <typename Span>
uint64_t checksum(std::span<const Span> pieces) {
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  for (const auto& p : pieces) XXH3_64bits_update(st, p.data(), p.size());
  const uint64_t sum = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return sum;
}

// A configured timeout in seconds as the transports take it.
std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", s);
  return buf;
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

uint64_t kv_prompt_hash(std::span<const int32_t> prompt) {
  std::vector<uint8_t> bytes(prompt.size() * 4);
  for (size_t i = 0; i < prompt.size(); ++i)
    for (int b = 0; b < 4; ++b) bytes[i * 4 + b] = uint8_t(uint32_t(prompt[i]) >> (8 * b));
  return XXH3_64bits(bytes.data(), bytes.size());
}

struct KvTransferAgent::Held {
  std::vector<int32_t> blocks;
  uint64_t prompt_hash = 0;
  int64_t num_tokens = 0;
  Task release;
  Clock::time_point deadline;
  bool pulling = false;
};

struct KvTransferAgent::Room {
  // The prefill request, once it arrived.
  bool has_prefill = false;
  uint64_t claim = 0;
  uint64_t prompt_hash = 0;
  int64_t prompt_tokens = 0;
  RoomDone done;
  std::vector<int32_t> blocks;
  int64_t layers_ready = 0;
  int64_t computed_tokens = 0;  // of the prompt so far (room_progress)
  // The decode engine's registration, once it arrived.
  bool registered = false;
  // Either side gave up; the other one learns it from here.
  bool failed = false;
  bool refuses_prefill = false;  // a marker left by a refused decode engine (else a late
                                 // prefill leg may claim the room afresh)
  // A marker left by an abandonment (serve_abandon): it refuses only the prefill leg of
  // prompt_hash and prompt_tokens, since one for another prompt must not cost a room its prefill
  // leg, and says the refusal is the decode leg's doing (KvTransferError::room_abandoned).
  bool abandoned = false;
  std::string error;
  Clock::time_point deadline;
};

struct KvTransferAgent::Metrics {
  metrics::Family<metrics::IntCounter>& bytes;
  metrics::Family<metrics::IntCounter>& transfers;
  metrics::IntCounter& expired;
  metrics::Gauge& held_blocks;
  metrics::Histogram& fetch_seconds;
  metrics::Family<metrics::IntCounter>& fetch_connections;
  metrics::IntCounter& refused;
  metrics::IntCounter& bytes_in_place;
  metrics::IntCounter& releases_dropped;
};

KvTransferAgent::KvTransferAgent(const KvTransferConfig& config, Executor& executor,
                                 std::unique_ptr<KvTransport> transport,
                                 metrics::Registry& registry, Post post)
    : config_(config),
      executor_(executor),
      layout_(executor.info().kv_layout),
      transport_(std::move(transport)),
      post_(std::move(post)) {
  if (!(config_.timeout_s > 0)) throw Error("--kv-transfer-timeout must be positive");
  if (config_.engine_id.empty()) {
    std::random_device rd;
    config_.engine_id = "tandem-" + hex64((uint64_t(rd()) << 32) | rd());
  }
  const metrics::LabelPairs model = {{"model_name", executor.info().model_name}};
  metrics_.reset(new Metrics{
      registry.int_counter_family("tandem:kv_transfer_bytes_total",
                                  "KV bytes moved by transfers (sent by prefill, received by "
                                  "decode)",
                                  {"direction"}, model),
      registry.int_counter_family("tandem:kv_transfers_total", "KV transfers by outcome",
                                  {"direction", "result"}, model),
      registry.int_counter("tandem:kv_transfer_expired_total",
                           "Held prefill KV freed because no decode engine took it in time", model),
      registry.gauge("tandem:kv_transfer_held_blocks", "KV blocks held for a decode engine to take",
                     model),
      registry.histogram("tandem:kv_transfer_seconds",
                         "Decode side: from asking for a prompt's KV to having all of it",
                         {0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60},
                         model),
      registry.int_counter_family("tandem:kv_transfer_connections_total",
                                  "Decode side: connections to prefill engines, by transport "
                                  "(shm on this host, tcp otherwise)",
                                  {"transport"}, model),
      registry.int_counter("tandem:kv_transfer_refused_total",
                           "Prefill side: connections refused by the KV transfer handshake "
                           "(no or a wrong --kv-transfer-secret)",
                           model),
      registry.int_counter("tandem:kv_transfer_in_place_bytes_total",
                           "Prefill side: KV bytes a decode engine on this host copied straight "
                           "from this engine's cache (shared memory, one copy)",
                           model),
      registry.int_counter("tandem:kv_transfer_releases_dropped_total",
                           "Decode side: messages letting a prefill engine's held KV go that were "
                           "dropped, too many being queued or refused as busy too many times (it "
                           "frees the KV at its timeout)",
                           model)});
  if (!(config_.handshake_timeout_s > 0)) throw Error("the KV handshake timeout must be positive");
  if (config_.port >= 0) {
    if (config_.port > 65535) throw Error("--kv-transfer-port must be at most 65535");
    listener_ = transport_->listen(config_.listen_host, static_cast<uint16_t>(config_.port),
                                   executor_.kv_shared_memory());
    accept_thread_ = std::thread([this] { accept_loop(); });
  }
  reap_thread_ = std::thread([this] { reap_loop(); });
}

KvTransferAgent::~KvTransferAgent() {
  std::vector<std::shared_ptr<KvConnection>> conns;
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    for (auto& [id, slot] : fetches_)
      if (slot.conn) conns.push_back(slot.conn);
    conns.insert(conns.end(), serving_.begin(), serving_.end());
    conns.insert(conns.end(), releases_.begin(), releases_.end());
  }
  changed_.notify_all();
  work_ready_.notify_all();  // idle workers end; busy ones finish what is queued first
  if (listener_) listener_->close();
  for (auto& c : conns) c->shutdown();
  if (accept_thread_.joinable()) accept_thread_.join();
  if (reap_thread_.joinable()) reap_thread_.join();
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return threads_ == 0; });
}

uint16_t KvTransferAgent::port() const {
  return listener_ ? listener_->port() : 0;
}

Clock::time_point KvTransferAgent::now() const {
  return config_.now ? config_.now() : Clock::now();
}

Clock::time_point KvTransferAgent::deadline() const {
  return now() + std::chrono::duration_cast<Clock::duration>(
                     std::chrono::duration<double>(config_.timeout_s));
}

bool KvTransferAgent::spawn(std::function<void()> body) {
  std::lock_guard lock(mutex_);
  work_.push_back(std::move(body));
  // An idle worker takes it, unless the idle ones are already spoken for by queued work (a
  // woken worker counts as idle until it takes its task): work must never wait behind a
  // transfer that blocks for its peer while the pool could grow.
  if (static_cast<int64_t>(work_.size()) <= idle_workers_) {
    work_ready_.notify_one();
    return true;
  }
  if (threads_ >= kMaxWorkers) return true;  // a worker takes it when one is free
  try {
    if (config_.start_thread)
      config_.start_thread([this] { worker(); });
    else
      std::thread([this] { worker(); }).detach();
    ++threads_;
    return true;
  } catch (const std::system_error&) {
    if (threads_ > 0) return true;  // the workers there are will get to it
    // Out of threads: the caller refuses this piece of work instead of the process dying.
    work_.pop_back();
    return false;
  }
}

void KvTransferAgent::worker() {
  std::unique_lock lock(mutex_);
  for (;;) {
    if (work_.empty()) {
      ++idle_workers_;
      work_ready_.wait_for(lock, kWorkerIdle, [this] { return !work_.empty() || stopping_; });
      --idle_workers_;
      if (work_.empty()) break;  // idle too long, or stopping
    }
    std::function<void()> body = std::move(work_.front());
    work_.pop_front();
    lock.unlock();
    body();
    body = nullptr;  // what it captured goes before the lock is taken again
    lock.lock();
  }
  --threads_;
  changed_.notify_all();
}

std::string kv_room_expired_text(uint64_t room, double timeout_s) {
  return "bootstrap_room " + std::to_string(room) + " expired: its decode request waited " +
         seconds_text(timeout_s) + " s for this prefill request and was failed";
}

std::string kv_no_prefill_text(uint64_t room, double timeout_s) {
  return "no prefill request with bootstrap_room " + std::to_string(room) + " arrived within " +
         seconds_text(timeout_s) + " s";
}

std::string kv_no_decode_text(uint64_t room, double timeout_s) {
  return "no decode engine registered bootstrap_room " + std::to_string(room) + " within " +
         seconds_text(timeout_s) + " s";
}

int64_t KvTransferAgent::held_blocks() const {
  std::lock_guard lock(mutex_);
  return held_blocks_locked();
}

KvTransferAgent::ReleaseQueueState KvTransferAgent::release_queue_state() const {
  std::lock_guard lock(mutex_);
  return {queued_releases_, deferred_releases_, release_peers_.size(), releasing_};
}

int64_t KvTransferAgent::held_blocks_locked() const {
  int64_t n = 0;
  for (const auto& [id, h] : held_) n += static_cast<int64_t>(h->blocks.size());
  for (const auto& [id, r] : rooms_) n += static_cast<int64_t>(r->blocks.size());
  return n;
}

// ---------------------------------------------------------------- prefill side: holding blocks

std::string KvTransferAgent::hold(std::vector<int32_t> blocks, uint64_t prompt_hash,
                                  int64_t num_tokens, Task release) {
  // 128 bits from the system's cryptographic generator after the engine's id: whoever may
  // connect to the port must not work out another request's id (a counter's next) and release
  // or pull that request's KV before its decode leg does.
  const std::string id = config_.engine_id + "-" + random_secret_hex(16);
  std::lock_guard lock(mutex_);
  auto h = std::make_unique<Held>();
  h->blocks = std::move(blocks);
  h->prompt_hash = prompt_hash;
  h->num_tokens = num_tokens;
  h->release = std::move(release);
  h->deadline = deadline();
  held_[id] = std::move(h);
  return id;
}

uint64_t KvTransferAgent::open_room(uint64_t room, uint64_t prompt_hash, int64_t prompt_tokens,
                                    RoomDone done) {
  std::lock_guard lock(mutex_);
  auto& r = rooms_[room];
  if (!r) {
    r = std::make_unique<Room>();
  } else if (r->has_prefill) {
    return 0;
  } else if (r->failed && !r->registered && r->refuses_prefill &&
             (!r->abandoned ||
              (r->prompt_hash == prompt_hash && r->prompt_tokens == prompt_tokens))) {
    const std::string error = r->error;
    const bool abandoned = r->abandoned;
    rooms_.erase(room);
    throw KvTransferError(error, abandoned);
  } else if (r->failed && !r->registered) {
    r = std::make_unique<Room>();  // a marker for a late decode engine: start afresh
  }
  r->has_prefill = true;
  r->claim = ++next_claim_;
  r->prompt_hash = prompt_hash;
  r->prompt_tokens = prompt_tokens;
  r->done = std::move(done);
  r->deadline = deadline();  // for the decode engine to register, or to fail
  changed_.notify_all();
  return r->claim;
}

void KvTransferAgent::room_blocks(uint64_t room, uint64_t claim, std::vector<int32_t> blocks) {
  std::lock_guard lock(mutex_);
  auto it = rooms_.find(room);
  if (it == rooms_.end() || it->second->claim != claim) return;
  it->second->blocks = std::move(blocks);
}

void KvTransferAgent::room_layers_done(uint64_t room, uint64_t claim, int64_t layers) {
  {
    std::lock_guard lock(mutex_);
    auto it = rooms_.find(room);
    if (it == rooms_.end() || it->second->claim != claim || layers <= it->second->layers_ready)
      return;
    it->second->layers_ready = layers;
    if (layers == layout_.layers) it->second->deadline = deadline();  // now waits for decode
  }
  changed_.notify_all();
}

void KvTransferAgent::room_progress(uint64_t room, uint64_t claim, int64_t computed_tokens) {
  {
    std::lock_guard lock(mutex_);
    auto it = rooms_.find(room);
    if (it == rooms_.end() || it->second->claim != claim ||
        computed_tokens <= it->second->computed_tokens)
      return;
    it->second->computed_tokens = computed_tokens;
    it->second->deadline = deadline();
  }
  changed_.notify_all();
}

void KvTransferAgent::room_failed(uint64_t room, uint64_t claim, const std::string& reason) {
  {
    std::lock_guard lock(mutex_);
    auto it = rooms_.find(room);
    if (it == rooms_.end() || it->second->claim != claim) return;
    if (it->second->registered) {
      // The connection's thread tells the decode engine and then finishes the room.
      it->second->failed = true;
      it->second->error = reason;
    } else {
      finish_room(room, false, reason);
    }
  }
  changed_.notify_all();
}

void KvTransferAgent::finish_room(uint64_t room, bool ok, const std::string& error,
                                  bool abandoned) {
  auto it = rooms_.find(room);
  if (it == rooms_.end()) return;
  std::unique_ptr<Room> r = std::move(it->second);
  rooms_.erase(it);
  if (r->has_prefill && r->done)
    post_([done = std::move(r->done), ok, error, abandoned] { done(ok, error, abandoned); });
  if (!ok && r->has_prefill && !r->registered) {
    // A decode engine that registers later learns why at once instead of waiting out its
    // timeout; the marker itself expires after one.
    auto marker = std::make_unique<Room>();
    marker->failed = true;
    marker->error = error;
    marker->deadline = deadline();
    rooms_[room] = std::move(marker);
  }
}

void KvTransferAgent::leave_refusal(uint64_t room, const std::string& error, bool abandoned,
                                    uint64_t prompt_hash, int64_t prompt_tokens) {
  if (rooms_.size() >= config_.max_rooms) return;
  auto r = std::make_unique<Room>();
  r->failed = true;
  r->refuses_prefill = true;
  r->abandoned = abandoned;
  r->prompt_hash = prompt_hash;
  r->prompt_tokens = prompt_tokens;
  r->error = error;
  r->deadline = deadline();
  rooms_[room] = std::move(r);
}

void KvTransferAgent::reap_loop() {
  std::unique_lock lock(mutex_);
  auto peers_checked = now();
  while (!stopping_) {
    changed_.wait_for(lock, std::chrono::milliseconds(50));
    const auto now = this->now();
    if (now - peers_checked >= std::chrono::seconds(1)) {
      // A dead prefill engine's cache, still mapped here, is freed within a second.
      peers_checked = now;
      lock.unlock();
      transport_->forget_exited_peers();
      // Messages whose sender could not start (the process was out of threads) wait for no
      // other release, which may never come.
      start_release_senders();
      lock.lock();
      if (stopping_) break;
    }
    if (deferred_releases_ > 0) {
      // Messages refused as busy wait for their next try, which no other event brings.
      lock.unlock();
      start_release_senders();
      lock.lock();
      if (stopping_) break;
    }
    metrics_->held_blocks.set(static_cast<double>(held_blocks_locked()));
    for (auto it = held_.begin(); it != held_.end();) {
      Held& h = *it->second;
      if (h.pulling || now < h.deadline) {
        ++it;
        continue;
      }
      metrics_->expired.inc();
      post_(std::move(h.release));
      it = held_.erase(it);
    }
    std::vector<uint64_t> expired;
    for (const auto& [id, r] : rooms_)
      if (!r->registered && now >= r->deadline &&
          (!r->has_prefill || r->layers_ready == layout_.layers))
        expired.push_back(id);
    for (auto id : expired) finish_room(id, false, kv_no_decode_text(id, config_.timeout_s));
  }
  // Shutting down: everything held goes back to the engine, except what a connection is still
  // reading (its blocks must stay until it stops: serve_pull releases them then).
  for (auto it = held_.begin(); it != held_.end();) {
    if (it->second->pulling) {
      ++it;
      continue;
    }
    post_(std::move(it->second->release));
    it = held_.erase(it);
  }
  std::vector<uint64_t> rooms;
  for (const auto& [id, r] : rooms_)
    if (!r->registered) rooms.push_back(id);
  for (auto id : rooms) finish_room(id, false, "the prefill engine is shutting down");
}

// ---------------------------------------------------------------- prefill side: the server

void KvTransferAgent::accept_loop() {
  while (auto conn = listener_->accept()) {
    std::shared_ptr<KvConnection> shared(std::move(conn));
    const std::string peer = shared->peer();
    std::string refusal;  // told outside the lock
    {
      std::lock_guard lock(mutex_);
      if (stopping_) {
        shared->shutdown();
        break;
      }
      if (connections_ >= kMaxConnections) {
        refusal =
            "too many KV transfer connections (" + std::to_string(kMaxConnections) + "); try again";
      } else {
        refusal = handshaking_.admit(peer);
      }
      if (refusal.empty()) {
        ++connections_;
        serving_.push_back(shared);
      }
    }
    if (!refusal.empty()) {
      refuse_for_now(*shared, refusal);
      continue;
    }
    if (!spawn([this, shared, peer] { serve(shared, peer); })) {
      refuse_for_now(*shared, "the prefill engine cannot start a transfer thread; try again");
      std::lock_guard lock(mutex_);
      --connections_;
      std::erase(serving_, shared);
      handshaking_.over(peer);
    }
  }
}

void KvTransferAgent::serve(std::shared_ptr<KvConnection> conn, const std::string& peer) {
  bool handshaking = true;
  const auto handshake_done = [&] {
    if (!handshaking) return;
    handshaking = false;
    std::lock_guard lock(mutex_);
    handshaking_.over(peer);
  };
  try {
    serve_connection(*conn, handshake_done);
  } catch (const std::exception&) {
    // A connection that failed before or during its request: nothing of ours to undo here
    // (the handlers restore their own state).
  }
  handshake_done();
  std::lock_guard lock(mutex_);
  --connections_;
  std::erase(serving_, conn);
}

void KvTransferAgent::serve_connection(KvConnection& conn,
                                       const std::function<void()>& handshake_done) {
  using std::chrono::milliseconds;
  // Until the request has arrived (after the handshake), a silent peer is dropped quickly: each
  // frame within the handshake timeout, its header and payload together.
  const auto handshake = milliseconds_of(config_.handshake_timeout_s);
  conn.set_timeout(handshake);
  conn.set_deadline(now() + handshake);
  KvFrame first = config_.secret.empty() ? conn.receive(kControlLimit) : receive_first_frame(conn);
  if (!config_.secret.empty()) {
    conn.set_deadline(now() + handshake);
    std::string session;
    std::string why = authenticate_decode(conn, config_.secret, first, session);
    if (why.empty()) {
      // The request comes after its MAC: one made with this handshake's key, which only the
      // engine that made the handshake has (not a stranger relaying it).
      conn.set_deadline(now() + handshake);
      const KvFrame mac = conn.receive(kControlLimit);
      conn.set_deadline(now() + handshake);
      first = conn.receive(kControlLimit);
      if (mac.type != KvFrameType::kAuth ||
          !secrets_equal(handshake_field(handshake_json(mac), "mac"),
                         request_mac(session, 0, first.type, first.payload)))
        why =
            "a request without this connection's MAC (not sent by the engine that made the "
            "handshake: relayed?)";
    }
    if (!why.empty()) {
      refused(conn.peer(), why);
      send_error(conn, kNotAuthenticated);
      return;
    }
  } else if (first.type == KvFrameType::kAuth) {
    send_error(conn,
               "this prefill engine does not authenticate KV transfers (no --kv-transfer-secret)");
    return;
  }
  handshake_done();
  conn.set_deadline(Clock::time_point::max());
  conn.set_timeout(milliseconds_of(config_.timeout_s));
  if (first.type == KvFrameType::kPull)
    serve_pull(conn, first.payload);
  else if (first.type == KvFrameType::kRegister)
    serve_register(conn, first.payload);
  else if (first.type == KvFrameType::kAbandon)
    serve_abandon(conn, first.payload);
  else
    send_error(conn, "expected a pull, register or abandon frame, got " +
                         frame_text(first.type, first.payload.size()));
}

void KvTransferAgent::refused(const std::string& peer, const std::string& why) {
  metrics_->refused.inc();
  std::optional<int64_t> held_back = refusal_log_.admit(LogThrottle::Clock::now());
  if (!held_back) return;
  std::fprintf(
      stderr, "tandem engine: refused a KV transfer connection from %s: %s%s\n", peer.c_str(),
      why.c_str(),
      *held_back > 0 ? (" (and " + std::to_string(*held_back) + " more not logged)").c_str() : "");
}

void KvTransferAgent::send_layers(KvConnection& conn, const std::vector<int32_t>& blocks,
                                  int64_t first_token, int64_t num_tokens, int64_t from_layer,
                                  int64_t to_layer, bool with_checksum) {
  const int64_t bs = layout_.block_size, tb = layout_.token_bytes;
  for (int64_t layer = from_layer; layer < to_layer; ++layer) {
    std::vector<std::span<const std::byte>> parts;
    std::byte header[kLayerHeader] = {};
    parts.emplace_back(header, kLayerHeader);
    for (int64_t t = first_token; t < num_tokens; t += bs) {
      const int64_t n = std::min(bs, num_tokens - t);
      parts.emplace_back(executor_.kv_bytes(blocks[size_t(t / bs)], layer), size_t(n * tb));
    }
    const auto data = std::span<const std::span<const std::byte>>(parts).subspan(1);
    encode({uint64_t(layer), with_checksum, with_checksum ? checksum(data) : 0}, header);
    const uint64_t in_place = conn.bytes_sent_in_place();
    conn.send(KvFrameType::kLayer, parts);
    metrics_->bytes.labels({"sent"}).inc(uint64_t((num_tokens - first_token) * tb));
    metrics_->bytes_in_place.inc(conn.bytes_sent_in_place() - in_place);
  }
}

void KvTransferAgent::serve_pull(KvConnection& conn, const std::vector<std::byte>& payload) {
  json req;
  try {
    req = parse_control(KvFrame{KvFrameType::kPull, payload}, "pull");
  } catch (const std::exception& e) {
    return send_error(conn, e.what());
  }
  std::string id;
  std::vector<int32_t> blocks;
  int64_t first = 0, num = 0;
  bool checksum = config_.checksum;
  std::string problem;
  bool gone = false;
  {
    std::lock_guard lock(mutex_);
    try {
      id = get_field<std::string>(req, "transfer_id");
      const auto engine = get_field<std::string>(req, "engine_id");
      const auto wanted = get_field<std::vector<int32_t>>(req, "block_ids");
      first = get_field<int64_t>(req, "first_token");
      num = get_field<int64_t>(req, "num_tokens");
      const auto prompt_hash = get_field<uint64_t>(req, "prompt_hash");
      const auto prompt_tokens = get_field<int64_t>(req, "prompt_tokens");
      checksum = config_.checksum || req.value("checksum", false);
      auto it = held_.find(id);
      // A pull of nothing (a decode engine's release) moves no KV: neither its layout nor its
      // blocks matter, and it follows a pull refused for them (the decode engine lets go of what
      // it will not pull), which would leave the hold until its timeout if refused alike.
      const bool moves_kv = num > first;
      if (moves_kv) problem = layout_mismatch(req.value("layout", json()), layout_);
      if (!problem.empty()) {
      } else if (engine != config_.engine_id) {
        // Another engine's transfer: most often this one restarted at its address (a new random
        // id) after holding it, so its KV is gone, and only a new prefill brings it back.
        gone = true;
        problem = "remote_engine_id '" + engine + "' is not this prefill engine ('" +
                  config_.engine_id + "')";
      } else if (it == held_.end()) {
        gone = true;
        problem = "unknown transfer '" + id +
                  "' (never held here, already pulled, or expired after " +
                  seconds_text(config_.timeout_s) + " s)";
      } else if (it->second->pulling) {
        problem = "transfer '" + id + "' is being pulled by another connection";
      } else if (first < 0 || first % layout_.block_size != 0 || num < first ||
                 num > it->second->num_tokens) {
        problem = "tokens [" + std::to_string(first) + ", " + std::to_string(num) +
                  ") are not within the " + std::to_string(it->second->num_tokens) +
                  " held tokens (block aligned start)";
      } else if (moves_kv && wanted != it->second->blocks) {
        problem = "remote_block_ids do not match the blocks held for transfer '" + id + "'";
      } else if (moves_kv && (prompt_hash != it->second->prompt_hash ||
                              prompt_tokens != it->second->num_tokens)) {
        problem = "the decode request's prompt (" + std::to_string(prompt_tokens) +
                  " tokens) is not the prompt of transfer '" + id + "' (" +
                  std::to_string(it->second->num_tokens) + " tokens)";
      } else {
        it->second->pulling = true;
        blocks = it->second->blocks;
      }
    } catch (const std::exception& e) {
      problem = std::string("malformed pull request: ") + e.what();
    }
  }
  if (!problem.empty()) {
    // Outside the lock: a slow peer must not stall the agent.
    send_error(conn, problem, gone ? Refusal::kTransferGone : Refusal::kOther);
    return;
  }
  bool ok = false;
  try {
    send_json(conn, KvFrameType::kAccept,
              {{"layers", layout_.layers}, {"first_token", first}, {"num_tokens", num}});
    send_layers(conn, blocks, first, num, 0, layout_.layers, checksum);
    send_json(conn, KvFrameType::kDone, json::object());
    ok = true;
  } catch (const std::exception&) {
  }
  std::lock_guard lock(mutex_);
  metrics_->transfers.labels({"sent", ok ? "ok" : "error"}).inc();
  // A pull that broke once accepted ends the hold as one that completed does: its decode leg
  // failed or was cancelled (nothing retries it), and kept, the blocks would stay until expiry.
  // (A refused pull, above, keeps it: the right parameters may still pull it.)
  free_held_locked(id, true);
}

bool KvTransferAgent::release_held(const std::string& transfer_id) {
  std::lock_guard lock(mutex_);
  return free_held_locked(transfer_id, false);
}

bool KvTransferAgent::free_held_locked(const std::string& id, bool by_its_pull) {
  auto it = held_.find(id);
  // A pull under way reads the blocks: freed now, they could be reused and overwritten under it.
  if (it == held_.end() || (it->second->pulling && !by_its_pull)) return false;
  post_(std::move(it->second->release));
  held_.erase(it);
  return true;
}

void KvTransferAgent::serve_register(KvConnection& conn, const std::vector<std::byte>& payload) {
  json req;
  try {
    req = parse_control(KvFrame{KvFrameType::kRegister, payload}, "register");
  } catch (const std::exception& e) {
    return send_error(conn, e.what());
  }
  bool checksum = config_.checksum;
  json layout;
  uint64_t room = 0;
  int64_t first = 0, num = 0, prompt_tokens = 0;
  uint64_t hash = 0;
  std::unique_lock lock(mutex_);
  try {
    room = get_field<uint64_t>(req, "room");
    first = get_field<int64_t>(req, "first_token");
    num = get_field<int64_t>(req, "num_tokens");
    prompt_tokens = get_field<int64_t>(req, "prompt_tokens");
    hash = get_field<uint64_t>(req, "prompt_hash");
    // Here too, not before: a request that is not an object, or a checksum that is not a bool,
    // is a malformed request the peer is told of, not an exception that only closes it.
    checksum = config_.checksum || req.value("checksum", false);
    layout = req.value("layout", json());
  } catch (const std::exception& e) {
    lock.unlock();
    send_error(conn, std::string("malformed register request: ") + e.what());
    return;
  }
  if (auto problem = layout_mismatch(layout, layout_); !problem.empty()) {
    // The prefill leg of this room cannot succeed either: fail it now, or when it arrives,
    // rather than at the timeout.
    auto it = rooms_.find(room);
    if (it != rooms_.end() && !it->second->registered) {
      finish_room(room, false, problem);
    } else if (it == rooms_.end()) {
      // Any prompt's leg: as when it came first, when a decode engine of another prompt fails
      // the room too (the prompts differ), the leg cannot succeed.
      leave_refusal(room, problem);
    }
    lock.unlock();
    send_error(conn, problem);
    return;
  }
  auto& slot = rooms_[room];
  if (!slot) {
    slot = std::make_unique<Room>();
    slot->deadline = deadline();  // for the prefill request to arrive
  } else if (slot->registered) {
    lock.unlock();
    send_error(conn, "bootstrap_room " + std::to_string(room) +
                         " already has a decode engine registered (duplicate room)");
    return;
  }
  slot->registered = true;
  Room* r = slot.get();
  int64_t sent = 0, progress_told = 0;
  bool accepted = false;
  std::string failure;
  // The decode engine sends nothing more once registered: its connection closing means that its
  // request ended (cancelled, its client gone) or its engine did. Nothing wakes the wait below
  // when that happens, so it looks every kPeerCheck, and before each batch of layers (a send may
  // still succeed into a socket buffer): the room then fails at once, as an abandoned one does,
  // instead of holding the prefill leg's blocks and answer until the timeout.
  bool decode_gone = false;
  bool timed_out = false;
  auto next_peer_check = now() + kPeerCheck;
  const std::string gone = "the decode engine of bootstrap_room " + std::to_string(room) +
                           " closed its connection (its request ended)";
  // Under the lock (a system call that does not wait): a connection this engine shut down itself,
  // stopping, is not the decode leg's doing.
  auto decode_left = [&] { return !stopping_ && conn.peer_gone(); };
  // The room fails as one whose decode leg went away (true: stop waiting).
  auto failed_if_decode_left = [&] {
    decode_gone = decode_left();
    if (decode_gone) failure = gone;
    return decode_gone;
  };
  // A send failed: because the decode leg left, or as a failure of its own (under the lock).
  auto send_failed = [&](const std::exception& e) {
    if (!failed_if_decode_left())
      failure = std::string("sending to the decode engine failed: ") + e.what();
  };
  while (true) {
    if (stopping_) {
      failure = "the prefill engine is shutting down";
      break;
    }
    if (r->failed) {
      failure = r->error;
      break;
    }
    if (r->has_prefill && (r->prompt_hash != hash || r->prompt_tokens != prompt_tokens)) {
      failure = "bootstrap_room " + std::to_string(room) +
                ": the decode and prefill requests have different prompts (" +
                std::to_string(prompt_tokens) + " and " + std::to_string(r->prompt_tokens) +
                " tokens)";
      break;
    }
    if (r->has_prefill &&
        (first < 0 || first % layout_.block_size != 0 || num < first || num > r->prompt_tokens)) {
      failure = "bootstrap_room " + std::to_string(room) + ": tokens [" + std::to_string(first) +
                ", " + std::to_string(num) + ") are not within the prompt";
      break;
    }
    if (r->has_prefill && r->layers_ready > sent && !r->blocks.empty()) {
      if (failed_if_decode_left()) break;
      const int64_t upto = r->layers_ready;
      std::vector<int32_t> blocks = r->blocks;
      lock.unlock();
      try {
        if (!accepted) {
          send_json(conn, KvFrameType::kAccept,
                    {{"layers", layout_.layers}, {"first_token", first}, {"num_tokens", num}});
          accepted = true;
        }
        send_layers(conn, blocks, first, num, sent, upto, checksum);
        sent = upto;
        if (sent == layout_.layers) send_json(conn, KvFrameType::kDone, json::object());
      } catch (const std::exception& e) {
        lock.lock();
        send_failed(e);
        break;
      }
      lock.lock();
      if (sent == layout_.layers) break;
      continue;
    }
    if (!accepted && r->computed_tokens > progress_told) {
      // The decode engine waits with an I/O timeout: each progress frame restarts it.
      progress_told = r->computed_tokens;
      lock.unlock();
      try {
        send_json(conn, KvFrameType::kProgress, {{"computed_tokens", progress_told}});
      } catch (const std::exception& e) {
        lock.lock();
        send_failed(e);
        break;
      }
      lock.lock();
      continue;
    }
    if (now() >= r->deadline) {
      // A decode leg that gave up too (its timeout is as long) is told apart from one still
      // waiting: the refusal below names why, as for one seen leaving between the checks.
      if (failed_if_decode_left()) break;
      timed_out = true;
      failure = r->has_prefill
                    ? "the prefill of bootstrap_room " + std::to_string(room) +
                          " did not complete within " + seconds_text(config_.timeout_s) + " s"
                    : kv_no_prefill_text(room, config_.timeout_s);
      break;
    }
    if (const auto now = this->now(); now >= next_peer_check) {
      next_peer_check = now + kPeerCheck;
      if (failed_if_decode_left()) break;
    }
    // For as long as this clock says (KvTransferConfig::now), at most kPeerCheck.
    changed_.wait_for(
        lock, std::max(Clock::duration::zero(), std::min(r->deadline, next_peer_check) - now()));
  }
  const bool ok = failure.empty();
  metrics_->transfers.labels({"sent", ok ? "ok" : "error"}).inc();
  const bool had_prefill = r->has_prefill;
  // A decode leg that left is no fault of this engine's: its prefill leg fails as one whose room
  // was abandoned (KvTransferError::room_abandoned), and one still to come is refused when it
  // arrives rather than waiting out the timeout for a decode engine that is gone. So is one
  // that comes after the room timed out: its decode leg has been told so and waits no more.
  finish_room(room, ok, failure, decode_gone);
  if (decode_gone && !had_prefill) leave_refusal(room, failure, true, hash, prompt_tokens);
  if (timed_out && !had_prefill)
    leave_refusal(room, kv_room_expired_text(room, config_.timeout_s), true, hash, prompt_tokens);
  lock.unlock();
  if (!ok && !decode_gone) send_error(conn, failure);
}

void KvTransferAgent::serve_abandon(KvConnection& conn, const std::vector<std::byte>& payload) {
  uint64_t room = 0, hash = 0;
  int64_t prompt_tokens = 0;
  std::string reason;
  try {
    const json req = parse_control(KvFrame{KvFrameType::kAbandon, payload}, "abandon");
    room = get_field<uint64_t>(req, "room");
    hash = get_field<uint64_t>(req, "prompt_hash");
    prompt_tokens = get_field<int64_t>(req, "prompt_tokens");
    // Kept with the room's refusal until the timeout (up to max_rooms of them) and told to its
    // prefill leg: a peer's text, clipped like any other quoted.
    reason = utf8::clip(get_field<std::string>(req, "reason"));
  } catch (const std::exception& e) {
    return send_error(conn, std::string("malformed abandon request: ") + e.what());
  }
  {
    std::lock_guard lock(mutex_);
    auto it = rooms_.find(room);
    if (it == rooms_.end()) {
      // The prefill leg has not arrived: it is refused when it does (nobody would receive its
      // KV), if it is for this prompt; the marker expires after the timeout.
      leave_refusal(room, reason, true, hash, prompt_tokens);
    } else if (const Room& r = *it->second; r.has_prefill && !r.registered &&
                                            r.prompt_hash == hash &&
                                            r.prompt_tokens == prompt_tokens) {
      finish_room(room, false, reason, true);
    }
    // Otherwise a decode engine registered (its own connection tells how it ends), or the room
    // holds another prompt, or already failed: nothing of this leg's to end.
  }
  changed_.notify_all();
  try {
    send_json(conn, KvFrameType::kDone, json::object());
  } catch (const std::exception&) {
  }
}

// ---------------------------------------------------------------- decode side

void KvTransferAgent::fetch(KvFetch f, std::function<void(const KvFetchResult&)> done) {
  FetchSlot* slot = nullptr;
  {
    std::lock_guard lock(mutex_);
    if (stopping_) {
      post_([done] { done({false, "the engine is shutting down", 0}); });
      return;
    }
    slot = &fetches_[f.request_id];  // stable: unordered_map nodes do not move
  }
  const std::string id = f.request_id;
  if (!spawn([this, f = std::move(f), slot, done] { run_fetch(f, slot, done); })) {
    {
      std::lock_guard lock(mutex_);
      fetches_.erase(id);
    }
    post_([done] { done({false, "the decode engine cannot start a transfer thread", 0}); });
  }
}

void KvTransferAgent::release_remote(const std::string& host, uint16_t port,
                                     const std::string& engine_id, const std::string& transfer_id,
                                     std::vector<int32_t> blocks) {
  // A pull of zero tokens: the prefill engine lets go of the hold without sending any KV.
  const json req = {{"transfer_id", transfer_id},
                    {"engine_id", engine_id},
                    {"block_ids", blocks},
                    {"first_token", 0},
                    {"num_tokens", 0},
                    {"prompt_hash", 0},
                    {"prompt_tokens", 0},
                    {"layout", layout_json(layout_)}};
  tell_prefill(host, port, KvFrameType::kPull, req.dump());
}

void KvTransferAgent::abandon_room(const std::string& host, uint16_t port, uint64_t room,
                                   uint64_t prompt_hash, int64_t prompt_tokens,
                                   const std::string& reason) {
  const json req = {{"room", room},
                    {"prompt_hash", prompt_hash},
                    {"prompt_tokens", prompt_tokens},
                    {"reason", reason}};
  tell_prefill(host, port, KvFrameType::kAbandon, req.dump());
}

void KvTransferAgent::tell_prefill(const std::string& host, uint16_t port, KvFrameType type,
                                   std::string request) {
  if (!kv_peer_allowed(config_.allow, host)) return;
  {
    std::lock_guard lock(mutex_);
    if (stopping_) return;
    if (!queue_release_locked({host, port, type, std::move(request)})) {
      metrics_->releases_dropped.inc();
      return;
    }
  }
  start_release_senders();
}

bool KvTransferAgent::queue_release_locked(QueuedRelease r) {
  ReleasePeer& peer = release_peers_[r.peer()];
  // One that a sender takes at once is not held to the queue's bound (it does not wait).
  const bool waits =
      releasing_ >= kMaxReleases || peer.sending >= kMaxReleasesPerPeer || !peer.queued.empty();
  if (waits && queued_releases_ >= kMaxQueuedReleases) {
    // Hosts first: one client naming a host's ports one by one makes as many engines of it, and
    // its messages must not crowd out another host's one. Its own host's count would still be
    // the most: the victim is that host's longest engine's, if longer than the newcomer's would
    // be; else the newcomer is the one dropped. That holds for a host the client cannot choose:
    // with no allow list (or one of ranges) it names hosts too, each of which counts as another,
    // and a queue full of one message each for many hosts drops the next host's newcomer.
    ReleaseHost& own = release_hosts_[r.host];
    const auto [most, most_host] = *hosts_by_queued_.rbegin();
    ReleaseHost& victims = most > own.queued + 1 ? release_hosts_.at(most_host) : own;
    if (&victims == &own &&
        (own.queued == 0 || own.peers_by_queued.rbegin()->first <= peer.queued.size() + 1)) {
      forget_idle_release_peer_locked(r.host, r.peer());
      return false;
    }
    const std::string victim = victims.peers_by_queued.rbegin()->second;
    const QueuedRelease dropped =
        dequeue_release_locked(release_peers_.at(victim), /*newest=*/true);
    metrics_->releases_dropped.inc();
    // Another host's engine may have had just that one message: forgotten, or a client cycling
    // ports would leave an idle engine behind for each (never removed, each pick walks them).
    forget_idle_release_peer_locked(dropped.host, victim);
  }
  enqueue_release_locked(std::move(r));
  return true;
}

void KvTransferAgent::enqueue_release_locked(QueuedRelease r, bool at_front) {
  const std::string name = r.peer();
  ReleasePeer& peer = release_peers_[name];
  ReleaseHost& host = release_hosts_[r.host];
  if (host.queued > 0) hosts_by_queued_.erase({host.queued, r.host});
  hosts_by_queued_.insert({++host.queued, r.host});
  if (!peer.queued.empty()) host.peers_by_queued.erase({peer.queued.size(), name});
  host.peers_by_queued.insert({peer.queued.size() + 1, name});
  ++queued_releases_;
  if (r.busy_refusals > 0) ++deferred_releases_;
  if (at_front)
    peer.queued.push_front(std::move(r));
  else
    peer.queued.push_back(std::move(r));
}

KvTransferAgent::QueuedRelease KvTransferAgent::dequeue_release_locked(ReleasePeer& peer,
                                                                       bool newest) {
  QueuedRelease r = std::move(newest ? peer.queued.back() : peer.queued.front());
  const size_t was = peer.queued.size();
  if (newest)
    peer.queued.pop_back();
  else
    peer.queued.pop_front();
  const std::string name = r.peer();
  ReleaseHost& host = release_hosts_.at(r.host);
  hosts_by_queued_.erase({host.queued, r.host});
  if (--host.queued > 0) hosts_by_queued_.insert({host.queued, r.host});
  host.peers_by_queued.erase({was, name});
  if (was > 1) host.peers_by_queued.insert({was - 1, name});
  --queued_releases_;
  if (r.busy_refusals > 0) --deferred_releases_;
  return r;
}

void KvTransferAgent::start_release_senders() {
  for (;;) {
    std::shared_ptr<QueuedRelease> first;
    {
      std::lock_guard lock(mutex_);
      if (stopping_ || releasing_ >= kMaxReleases) return;
      std::optional<QueuedRelease> next = next_release_locked();
      if (!next) return;
      ++releasing_;
      first = std::make_shared<QueuedRelease>(std::move(*next));
    }
    if (!spawn([this, first] { send_releases(std::move(*first)); })) {
      // No thread (and no worker alive to take it): the message goes back to the front of its
      // engine's queue, for the next release's call here, the next sender to end, or the
      // reaper's, whichever comes first; dropped, it held the prefill engine's KV until its
      // timeout.
      std::lock_guard lock(mutex_);
      --releasing_;
      --release_peers_[first->peer()].sending;
      --release_hosts_[first->host].sending;
      enqueue_release_locked(std::move(*first), /*at_front=*/true);
      return;
    }
  }
}

void KvTransferAgent::send_releases(QueuedRelease first) {
  // A queued message always finds a sender: its engine or its host has senders (which take it up
  // as they end), or every sender is busy (the first to end takes it up).
  std::optional<QueuedRelease> next = std::move(first);
  while (next) {
    const bool busy = send_release(*next);
    const std::string host = next->host, peer = next->peer();
    std::lock_guard lock(mutex_);
    --release_peers_[peer].sending;
    --release_hosts_[host].sending;
    if (busy && next->busy_refusals < kMaxBusyRefusals && !stopping_) {
      // Behind its engine's others (in order no more: the engine refused it).
      next->not_before = now() + kBusyRetryFirst * (1 << next->busy_refusals);
      ++next->busy_refusals;
      enqueue_release_locked(std::move(*next));
    } else if (busy && !stopping_) {
      metrics_->releases_dropped.inc();  // refused as busy once too often
    }
    forget_idle_release_peer_locked(host, peer);
    next = stopping_ ? std::nullopt : next_release_locked();
    if (!next) --releasing_;
  }
}

std::optional<KvTransferAgent::QueuedRelease> KvTransferAgent::next_release_locked() {
  // Round the engines from the one after the last picked: each engine's queue is in order, and
  // one with thousands of messages behind a hung peer costs a pick no more than one with none.
  // Engines of hosts within their share first; those of hosts past it only when none is left.
  for (const bool past_share : {false, true}) {
    auto it = release_peers_.upper_bound(last_release_peer_);
    for (size_t n = release_peers_.size(); n > 0; --n, ++it) {
      if (it == release_peers_.end()) it = release_peers_.begin();
      ReleasePeer& peer = it->second;
      if (peer.queued.empty() || peer.sending >= kMaxReleasesPerPeer) continue;
      if (peer.queued.front().busy_refusals > 0 && peer.queued.front().not_before > now())
        continue;  // the reaper looks again
      ReleaseHost& host = release_hosts_[peer.queued.front().host];
      if (!past_share && host.sending >= kReleaseShareOfHost) continue;
      QueuedRelease next = dequeue_release_locked(peer);
      ++peer.sending;
      ++host.sending;
      last_release_peer_ = it->first;
      return next;
    }
  }
  return std::nullopt;
}

void KvTransferAgent::forget_idle_release_peer_locked(const std::string& host,
                                                      const std::string& peer) {
  if (auto it = release_peers_.find(peer);
      it != release_peers_.end() && it->second.sending == 0 && it->second.queued.empty())
    release_peers_.erase(it);
  if (auto it = release_hosts_.find(host);
      it != release_hosts_.end() && it->second.sending == 0 && it->second.queued == 0)
    release_hosts_.erase(it);
}

bool KvTransferAgent::send_release(const QueuedRelease& r) {
  std::shared_ptr<KvConnection> conn;
  const auto handshake = milliseconds_of(config_.handshake_timeout_s);
  // The connect too is bounded by the handshake timeout, not the transport's I/O timeout: one
  // unreachable host would otherwise hold every release queued behind it for that long. The clock
  // starts as run_fetch's does: once the transport asks whether to give up (after it resolved the
  // host and began to connect), else once it connected. A slow name lookup on this host took the
  // whole bound, and the release gave up at once though the prefill engine was there.
  std::optional<Clock::time_point> started;
  const auto deadline = [&] {
    if (!started) started = now() + handshake;
    return *started;
  };
  bool busy = false;
  try {
    conn = transport_->connect(r.host, r.port, [this, &deadline] {
      if (now() >= deadline()) return true;
      std::lock_guard lock(mutex_);
      return stopping_;
    });
    {
      std::lock_guard lock(mutex_);
      if (stopping_) throw Error("stopping");
      releases_.push_back(conn);
    }
    // One bound for the whole exchange, not one per call: a host that keeps answering with
    // frames other than the last would hold this sender for as many timeouts as it has frames.
    conn->set_deadline(deadline());
    conn->set_timeout(handshake);
    std::string session;
    if (!config_.secret.empty())
      session =
          authenticate_to_prefill(*conn, config_.secret, r.host + ":" + std::to_string(r.port));
    send_request(*conn, session, r.type, r.request);
    std::vector<std::byte> payload;
    for (int frames = 0; frames < layout_.layers + 2; ++frames) {
      const KvFrameType t = conn->receive(payload, kControlLimit);
      if (t == KvFrameType::kDone) break;
      if (t == KvFrameType::kError) {
        if (refusal_says(json::parse(payload.begin(), payload.end(), nullptr, false), "busy"))
          throw PrefillBusy("busy");
        break;
      }
    }
  } catch (const PrefillBusy&) {
    busy = true;
  } catch (const std::exception&) {
    // Best effort: the prefill engine's timeout frees the blocks otherwise.
  }
  if (conn) {
    std::lock_guard lock(mutex_);
    std::erase(releases_, conn);
  }
  return busy;
}

void KvTransferAgent::cancel_fetch(const std::string& request_id) {
  std::lock_guard lock(mutex_);
  auto it = fetches_.find(request_id);
  if (it == fetches_.end()) return;
  it->second.cancelled = true;
  if (it->second.conn) it->second.conn->shutdown();
}

KvFrame KvTransferAgent::await_room(KvConnection& conn, const KvFetch& f) {
  // Only a count that grew within the prompt is progress: a prefill engine repeating itself (or
  // counting past the prompt) must not hold this leg, and the blocks reserved for it, forever.
  int64_t computed = 0;
  auto until = deadline();
  const auto no_progress = [&] {
    return Error("the prefill of bootstrap_room " + std::to_string(f.room) +
                 " made no progress within " + seconds_text(config_.timeout_s) + " s (" +
                 std::to_string(computed) + " of its " + std::to_string(f.prompt_tokens) +
                 " tokens computed)");
  };
  for (;;) {
    conn.set_deadline(until);
    KvFrame frame;
    try {
      frame = conn.receive(kControlLimit);
    } catch (const std::exception& e) {
      if (now() < until) throw;
      throw no_progress();
    }
    if (frame.type != KvFrameType::kProgress) {
      conn.set_deadline(Clock::time_point::max());
      return frame;
    }
    const json j = handshake_json(frame);
    if (j.is_object() && j.contains("computed_tokens") &&
        j["computed_tokens"].is_number_integer()) {
      const int64_t n = j["computed_tokens"].get<int64_t>();
      if (n > computed && n <= f.prompt_tokens) {
        computed = n;
        until = deadline();
        continue;
      }
    }
    // A prefill engine flooding frames that do not advance never fails a receive: the bound is
    // checked here too (the connection's own is in real time; this clock may be another).
    if (now() >= until) throw no_progress();
  }
}

void KvTransferAgent::run_fetch(KvFetch f, FetchSlot* slot,
                                const std::function<void(const KvFetchResult&)>& done) {
  const auto started = now();
  KvFetchResult result;
  const std::string where = f.host + ":" + std::to_string(f.port);
  try {
    {
      std::lock_guard lock(mutex_);
      if (slot->cancelled || stopping_) throw NotThePrefillsFault("cancelled");
    }
    if (!kv_peer_allowed(config_.allow, f.host))
      throw NotThePrefillsFault("KV transfer from " + f.host +
                                " refused: the host is not in --kv-transfer-allow");
    // The connect, the handshake and a pull's accept are bounded as a whole by the handshake
    // timeout, as a release's are (send_release): a prefill engine answers them at once (it holds
    // a pulled transfer's KV already), so one that does not is hung (a stopped process keeps its
    // sockets open and the kernel completes the connection), and a wait for the transfer timeout
    // would hold the request that long though the gateway ejected that engine long before. What
    // waits for the prefill's compute (a room's prompt and layers) keeps the transfer timeout.
    // The clock starts once the transport asks whether to give up (after it resolved the host
    // and began to connect), else once it connected: a slow name lookup on this host (with
    // --advertise-host a DNS name) is not the prefill engine's silence.
    std::optional<Clock::time_point> started_handshake;
    const auto handshake_deadline = [&] {
      if (!started_handshake)
        started_handshake = now() + milliseconds_of(config_.handshake_timeout_s);
      return *started_handshake;
    };
    const auto unanswered = [&](const std::exception& e) {
      return Error("the prefill engine did not answer within the handshake timeout of " +
                   seconds_text(config_.handshake_timeout_s) + " s (" + e.what() + ")");
    };
    // Runs a step of the handshake; a failure once its deadline passed is that timeout's (an
    // answer the prefill engine gave, as a refusal, stays what it is).
    const auto within_handshake = [&](const std::function<void()>& step) {
      try {
        step();
      } catch (const NotThePrefillsFault&) {
        throw;
      } catch (const KvTransferError&) {
        throw;
      } catch (const std::exception& e) {
        if (now() >= handshake_deadline()) throw unanswered(e);
        throw;
      }
    };
    std::shared_ptr<KvConnection> conn;
    try {
      conn = transport_->connect(f.host, f.port, [this, slot, &handshake_deadline] {
        if (now() >= handshake_deadline()) return true;
        std::lock_guard lock(mutex_);
        return slot->cancelled || stopping_;
      });
    } catch (const std::exception& e) {
      // A connect this side gave up says why, as a fetch cancelled before it began does.
      std::lock_guard lock(mutex_);
      if (slot->cancelled || stopping_)
        throw NotThePrefillsFault(std::string("cancelled (") + e.what() + ")");
      if (started_handshake && now() >= *started_handshake) throw unanswered(e);
      throw;
    }
    metrics_->fetch_connections.labels({conn->kind()}).inc();
    {
      std::lock_guard lock(mutex_);
      slot->conn = conn;
      if (slot->cancelled || stopping_) conn->shutdown();
    }
    conn->set_deadline(handshake_deadline());
    std::string session;
    within_handshake([&] {
      if (!config_.secret.empty()) session = authenticate_to_prefill(*conn, config_.secret, where);
    });
    json req = {{"first_token", f.first_token},
                {"num_tokens", f.num_tokens},
                {"layout", layout_json(layout_)}};
    req["prompt_hash"] = f.prompt_hash;
    req["prompt_tokens"] = f.prompt_tokens;
    if (config_.checksum) req["checksum"] = true;  // the prefill engine checksums its layers then
    if (f.pull) {
      req["transfer_id"] = f.transfer_id;
      req["engine_id"] = f.engine_id;
      req["block_ids"] = f.remote_blocks;
    } else {
      req["room"] = f.room;
    }
    within_handshake([&] {
      send_request(*conn, session, f.pull ? KvFrameType::kPull : KvFrameType::kRegister,
                   req.dump());
    });
    const int64_t bs = layout_.block_size, tb = layout_.token_bytes;
    const int64_t tokens = f.num_tokens - f.first_token;
    if (tokens < 0 || int64_t(f.local_blocks.size()) * bs < tokens)
      throw NotThePrefillsFault("the local block table does not cover tokens [" +
                                std::to_string(f.first_token) + ", " +
                                std::to_string(f.num_tokens) + ")");
    const size_t layer_bytes = size_t(tokens * tb);
    KvFrame accept;
    if (f.pull) {
      within_handshake([&] { accept = conn->receive(kControlLimit); });
      // The layers of a held transfer: each frame within the transport's I/O timeout (one layer
      // of a long prompt over a slow link takes its time).
      conn->set_deadline(Clock::time_point::max());
    } else {
      conn->set_deadline(Clock::time_point::max());  // await_room sets its own
      accept = await_room(*conn, f);
    }
    if (accept.type == KvFrameType::kError) throw_refusal(accept);
    if (accept.type != KvFrameType::kAccept)
      throw Error("expected an accept frame, got " +
                  frame_text(accept.type, accept.payload.size()));
    // Layers land straight in the cache blocks when the executor has them in memory (one copy
    // fewer), else in one reused buffer handed to write_kv.
    std::vector<std::span<std::byte>> targets;
    for (size_t b = 0; b < f.local_blocks.size(); ++b) {
      const int64_t n = std::min(bs, tokens - int64_t(b) * bs);
      if (n <= 0) break;
      std::byte* at = executor_.kv_bytes_mutable(f.local_blocks[b], 0);
      if (!at) {
        targets.clear();
        break;
      }
      targets.emplace_back(at, size_t(n * tb));
    }
    const bool in_place = !targets.empty() || tokens == 0;
    std::vector<std::byte> buffer(in_place ? 0 : layer_bytes);
    std::byte header[kLayerHeader];
    for (int64_t layer = 0; layer < layout_.layers; ++layer) {
      uint64_t size = 0;
      const KvFrameType type = conn->receive_header(size, kLayerHeader + layer_bytes);
      if (type == KvFrameType::kError) {
        // An error is a JSON control frame, however large a layer may be: the prefill engine
        // does not get a layer's worth of memory for it (received in place, the layers need
        // none).
        if (size > kControlLimit)
          throw Error("an error frame of " + std::to_string(size) + " bytes exceeds the limit of " +
                      std::to_string(kControlLimit));
        KvFrame e{type, {}};
        conn->receive_payload_as_it_arrives(e.payload, size);
        throw NotThePrefillsFault(error_message(e));
      }
      if (type != KvFrameType::kLayer || size != kLayerHeader + layer_bytes)
        throw Error("layer " + std::to_string(layer) + ": expected a layer frame of " +
                    std::to_string(kLayerHeader + layer_bytes) + " bytes, got " +
                    frame_text(type, size));
      std::vector<std::span<std::byte>> parts = {std::span<std::byte>(header, kLayerHeader)};
      if (in_place) {
        for (size_t b = 0; b < targets.size(); ++b)
          parts.emplace_back(executor_.kv_bytes_mutable(f.local_blocks[b], layer),
                             targets[b].size());
      } else {
        parts.emplace_back(buffer);
      }
      conn->receive_payload(parts);
      const LayerHeader got = decode(header);
      if (got.layer != uint64_t(layer))
        throw Error("expected layer " + std::to_string(layer) + ", got " +
                    std::to_string(got.layer));
      const auto data = std::span<const std::span<std::byte>>(parts).subspan(1);
      if (config_.checksum && !got.has_checksum)
        throw Error("layer " + std::to_string(layer) +
                    " came without a checksum, which this engine asked for "
                    "(--kv-transfer-checksum; a prefill engine of an older version?)");
      if (got.has_checksum && checksum(data) != got.checksum)
        throw Error("layer " + std::to_string(layer) + ": checksum mismatch (corrupted transfer)");
      if (!in_place)
        for (size_t b = 0; b < f.local_blocks.size(); ++b) {
          const int64_t off = int64_t(b) * bs;
          const int64_t n = std::min(bs, tokens - off);
          if (n <= 0) break;
          executor_.write_kv(
              f.local_blocks[b], layer,
              std::span<const std::byte>(buffer).subspan(size_t(off * tb), size_t(n * tb)));
        }
      result.bytes += layer_bytes;
      metrics_->bytes.labels({"received"}).inc(layer_bytes);
    }
    KvFrame end = conn->receive(kControlLimit);
    if (end.type == KvFrameType::kError) throw NotThePrefillsFault(error_message(end));
    if (end.type != KvFrameType::kDone)
      throw Error("expected a done frame, got " + frame_text(end.type, end.payload.size()));
    result.ok = true;
  } catch (const std::exception& e) {
    result.ok = false;
    result.error = "KV transfer from the prefill engine at " + where + " failed: " + e.what();
    std::lock_guard lock(mutex_);
    result.transfer_gone = f.pull && dynamic_cast<const TransferGone*>(&e) != nullptr;
    result.prefill_busy =
        dynamic_cast<const PrefillBusy*>(&e) != nullptr && !slot->cancelled && !stopping_;
    result.prefill_fault = !dynamic_cast<const NotThePrefillsFault*>(&e) &&
                           !dynamic_cast<const KvTransferError*>(&e) && !slot->cancelled &&
                           !stopping_;
  }
  {
    std::lock_guard lock(mutex_);
    fetches_.erase(f.request_id);
  }
  metrics_->transfers.labels({"received", result.ok ? "ok" : "error"}).inc();
  if (result.ok)
    metrics_->fetch_seconds.observe(std::chrono::duration<double>(now() - started).count());
  post_([done, result] { done(result); });
}

namespace {

// "a.b.c.d/n" into the block's address (host order) and mask; false for anything else.
bool parse_ipv4_block(const std::string& entry, uint32_t& network, uint32_t& mask) {
  const size_t slash = entry.find('/');
  if (slash == std::string::npos || slash + 1 >= entry.size() || entry.size() - slash > 3)
    return false;
  int bits = 0;
  for (char c : entry.substr(slash + 1)) {
    if (c < '0' || c > '9') return false;
    bits = bits * 10 + (c - '0');
  }
  in_addr a{};
  if (bits > 32 || ::inet_pton(AF_INET, entry.substr(0, slash).c_str(), &a) != 1) return false;
  mask = bits == 0 ? 0 : ~uint32_t{0} << (32 - bits);
  network = ntohl(a.s_addr) & mask;
  return true;
}

}  // namespace

bool kv_peer_allowed(const std::vector<std::string>& allow, std::string_view host) {
  if (allow.empty()) return true;
  in_addr address{};
  const bool numeric = ::inet_pton(AF_INET, std::string(host).c_str(), &address) == 1;
  for (const std::string& entry : allow) {
    if (entry == host) return true;
    uint32_t network = 0, mask = 0;
    if (numeric && parse_ipv4_block(entry, network, mask) &&
        (ntohl(address.s_addr) & mask) == network)
      return true;
  }
  return false;
}

namespace {

// A peer's address: its text as kv_peer_address says, and the address itself when it is an IPv6
// one (not IPv4-mapped).
struct PeerAddress {
  std::string text;
  std::optional<in6_addr> v6;
};

PeerAddress parse_peer_address(std::string_view peer) {
  std::string address(peer.substr(0, peer.rfind(':')));  // IPv6 addresses hold colons too
  if (address.size() >= 2 && address.front() == '[' && address.back() == ']')
    address = address.substr(1, address.size() - 2);
  in6_addr v6{};
  if (::inet_pton(AF_INET6, address.c_str(), &v6) != 1) return {address, {}};  // IPv4, or none
  char text[INET6_ADDRSTRLEN] = {};
  if (IN6_IS_ADDR_V4MAPPED(&v6)) {
    ::inet_ntop(AF_INET, &v6.s6_addr[12], text, sizeof text);
    return {text, {}};
  }
  ::inet_ntop(AF_INET6, &v6, text, sizeof text);
  return {text, v6};
}

}  // namespace

std::string kv_peer_address(std::string_view peer) {
  return parse_peer_address(peer).text;
}

std::string kv_handshake_group(std::string_view peer) {
  PeerAddress address = parse_peer_address(peer);
  if (!address.v6) return address.text;
  std::memset(&address.v6->s6_addr[8], 0, 8);
  char text[INET6_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET6, &*address.v6, text, sizeof text);
  return std::string(text) + "/64";
}

namespace {

using Counts = std::unordered_map<std::string, int64_t>;

int64_t counted(const Counts& counts, const std::string& key) {
  const auto it = counts.find(key);  // not [], which would keep a key for each refused peer
  return it == counts.end() ? 0 : it->second;
}

void uncount(Counts& counts, const std::string& key) {
  const auto it = counts.find(key);
  if (it != counts.end() && --it->second <= 0) counts.erase(it);
}

}  // namespace

std::string KvHandshakeCounts::admit(std::string_view peer) {
  const std::string address = kv_peer_address(peer);
  const std::string group = kv_handshake_group(peer);
  if (counted(by_address_, address) >= kMaxPerAddress)
    return "too many KV transfer connections from this address; try again";
  if (counted(by_group_, group) >= kMaxPerGroup)
    return "too many KV transfer connections from this address's /64 network; try again";
  ++by_address_[address];
  ++by_group_[group];
  return "";
}

void KvHandshakeCounts::over(std::string_view peer) {
  uncount(by_address_, kv_peer_address(peer));
  uncount(by_group_, kv_handshake_group(peer));
}

void check_kv_peer_allow(const std::vector<std::string>& allow) {
  for (const std::string& entry : allow) {
    uint32_t network = 0, mask = 0;
    if (entry.empty() ||
        (entry.find('/') != std::string::npos && !parse_ipv4_block(entry, network, mask)))
      throw Error("--kv-transfer-allow: '" + entry +
                  "' is neither a host nor an IPv4 block like 10.0.0.0/8");
  }
}

}  // namespace tandem::engine
