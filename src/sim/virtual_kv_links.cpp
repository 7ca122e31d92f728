#include "sim/virtual_kv_links.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "sim/virtual_time.h"

namespace tandem::sim {

using engine::KvFetch;
using engine::KvFetchResult;
using engine::KvTransfers;
using TimePoint = gateway::Executor::Clock::time_point;
using Duration = gateway::Executor::Clock::duration;

class VirtualKvNetwork::Endpoint final : public KvTransfers {
 public:
  Endpoint(VirtualKvNetwork& net, const engine::KvTransferConfig& config,
           engine::Executor& executor, Post post, std::function<double()> now,
           std::function<void()> wake)
      : net_(net),
        config_(config),
        layout_(executor.info().kv_layout),
        post_(std::move(post)),
        now_(std::move(now)),
        wake_(std::move(wake)) {
    if (serving()) net_.servers_[address(config_.advertise_host, port())] = this;
    net_.endpoints_[config_.engine_id] = this;
  }
  ~Endpoint() override {
    if (serving() && !dead_) net_.servers_.erase(address(config_.advertise_host, port()));
    net_.endpoints_.erase(config_.engine_id);
  }

  // The engine died: no new connection reaches it, and every transfer it is part of fails on the
  // other side as a reset connection would.
  void die() {
    if (dead_) return;
    dead_ = true;
    if (serving()) net_.servers_.erase(address(config_.advertise_host, port()));
    const double t = now_s() + net_.link_.latency_s;
    for (auto& [room, r] : rooms_)
      if (r.decode)
        at(t, [decode = r.decode->endpoint, id = r.decode->request_id] {
          decode->finish_fetch(id, prefills_fault("the prefill engine's connection was reset"));
        });
    for (auto& [room, reg] : registered_) {
      Endpoint* prefill = reg.second;
      at(t, [prefill, room = room, id = reg.first] { prefill->decode_gone(room, id); });
    }
  }

  // A slow-link fault begins, or ends: the links run as slow as the slowest under way.
  void slow_down(double factor) { slowdowns_.insert(factor); }
  void end_slow_down(double factor) {
    // One entry of that factor: another fault of the same factor may still last.
    if (auto it = slowdowns_.find(factor); it != slowdowns_.end()) slowdowns_.erase(it);
  }

  // The engine hangs from now until `until` (a stall fault): its KV side is frozen meanwhile.
  void stall(TimePoint until) {
    const TimePoint from = net_.clock_.now();
    if (!stalls_.empty() && from <= stalls_.back().second)
      stalls_.back().second = std::max(stalls_.back().second, until);  // extended
    else if (from < until)
      stalls_.emplace_back(from, until);
  }

  const engine::KvTransferConfig& config() const override { return config_; }
  bool serving() const override { return config_.port >= 0; }
  uint16_t port() const override { return serving() ? static_cast<uint16_t>(config_.port) : 0; }

  // ---- prefill side

  std::string hold(std::vector<int32_t> blocks, uint64_t prompt_hash, int64_t num_tokens,
                   Task release) override {
    const std::string id = config_.engine_id + "-" + std::to_string(++next_id_);
    Held& h = held_[id];
    h.blocks = std::move(blocks);
    h.prompt_hash = prompt_hash;
    h.num_tokens = num_tokens;
    h.release = std::move(release);
    // A hold being pulled is left to its pull, as the engines' reaper leaves it.
    h.expiry = at(now_() + config_.timeout_s, [this, id] { free_held(id, false); });
    return id;
  }

  uint64_t open_room(uint64_t room, uint64_t prompt_hash, int64_t prompt_tokens,
                     RoomDone done) override {
    if (auto refusal = refusals_.find(room); refusal != refusals_.end()) {
      Refusal f = std::move(refusal->second);
      refusals_.erase(refusal);
      net_.clock_.cancel(f.expiry);
      if (f.refuses_prefill && f.prompt_hash == prompt_hash && f.prompt_tokens == prompt_tokens)
        throw engine::KvTransferError(f.error, true);
    }
    Room& r = rooms_[room];
    if (r.claim != 0) return 0;  // another prefill request holds it
    r.claim = ++next_claim_;
    r.prompt_hash = prompt_hash;
    r.prompt_tokens = prompt_tokens;
    r.done = std::move(done);
    r.layer_times.assign(size_t(layout_.layers), -1);
    r.opened = now_();
    const uint64_t claim = r.claim;
    if (r.decode && r.decode->prompt_hash != prompt_hash)
      fail_room(room, "the decode leg's prompt differs from this prefill's (prompt hash)");
    else
      arm_room_wait(room);
    return claim;
  }
  void room_blocks(uint64_t room, uint64_t claim, std::vector<int32_t> blocks) override {
    if (Room* r = find_room(room, claim)) r->blocks = std::move(blocks);
  }
  void room_layers_done(uint64_t room, uint64_t claim, int64_t layers) override {
    Room* r = find_room(room, claim);
    if (!r) return;
    const double t = now_();
    for (int64_t l = 0; l < std::min<int64_t>(layers, layout_.layers); ++l)
      if (r->layer_times[size_t(l)] < 0) r->layer_times[size_t(l)] = t;
    arm_room_wait(room);
    maybe_send(room);
  }
  void room_failed(uint64_t room, uint64_t claim, const std::string& reason) override {
    if (find_room(room, claim)) fail_room(room, reason);
  }
  // A chunk of the prompt was computed: as the live agent's progress frame, it restarts the
  // room's wait (only a count that grew within the prompt is progress).
  void room_progress(uint64_t room, uint64_t claim, int64_t computed_tokens) override {
    Room* r = find_room(room, claim);
    if (!r || computed_tokens <= r->computed_tokens || computed_tokens > r->prompt_tokens) return;
    r->computed_tokens = computed_tokens;
    r->progressed = now_();
    arm_room_wait(room);
  }

  // ---- decode side

  void fetch(KvFetch f, std::function<void(const KvFetchResult&)> done) override {
    const std::string id = f.request_id;
    fetches_[id] = {std::move(done)};
    const double arrive = now_() + net_.link_.latency_s;
    auto server = net_.servers_.find(address(f.host, f.port));
    if (server == net_.servers_.end()) {
      at(arrive + net_.link_.latency_s, [this, id, where = address(f.host, f.port)] {
        finish_fetch(id, prefills_fault("cannot connect to the KV transfer server at " + where));
      });
      return;
    }
    Endpoint* prefill = server->second;
    const TimePoint started = time_at(now_());
    at(arrive, [this, prefill, started, f = std::move(f)]() mutable {
      reach(prefill, std::move(f), started);
    });
  }
  void cancel_fetch(const std::string& request_id) override {
    auto it = fetches_.find(request_id);
    if (it == fetches_.end()) return;
    // A room waiting for this decode leg learns it is gone, as a closed connection tells it (which
    // takes the room out of registered_: collect first).
    std::vector<std::pair<uint64_t, Endpoint*>> gone;
    for (auto& [room, endpoint] : registered_)
      if (endpoint.first == request_id) gone.emplace_back(room, endpoint.second);
    for (auto& [room, prefill] : gone) prefill->decode_gone(room, request_id);
    finish_fetch(request_id, {false, "cancelled", 0});
  }
  void release_remote(const std::string& host, uint16_t port, const std::string&,
                      const std::string& transfer_id, std::vector<int32_t>) override {
    auto server = net_.servers_.find(address(host, port));
    if (server == net_.servers_.end()) return;
    Endpoint* prefill = server->second;
    at(now_() + net_.link_.latency_s,
       [prefill, transfer_id] { prefill->free_held(transfer_id, false); });
  }
  bool release_held(const std::string& transfer_id) override {
    return free_held(transfer_id, false);
  }

  void abandon_room(const std::string& host, uint16_t port, uint64_t room, uint64_t prompt_hash,
                    int64_t prompt_tokens, const std::string& reason) override {
    auto server = net_.servers_.find(address(host, port));
    if (server == net_.servers_.end()) return;
    Endpoint* prefill = server->second;
    at(now_() + net_.link_.latency_s, [prefill, room, prompt_hash, prompt_tokens, reason] {
      prefill->abandoned(room, prompt_hash, prompt_tokens, reason);
    });
  }

  int64_t held_blocks() const override {
    int64_t n = 0;
    for (const auto& [id, h] : held_) n += static_cast<int64_t>(h.blocks.size());
    for (const auto& [room, r] : rooms_) n += static_cast<int64_t>(r.blocks.size());
    return n;
  }

 private:
  struct Held {
    std::vector<int32_t> blocks;
    uint64_t prompt_hash = 0;
    int64_t num_tokens = 0;
    Task release;
    gateway::Executor::TimerId expiry;
    bool pulling = false;  // a decode engine's pull of it runs
  };
  // The decode leg registered for a room.
  struct Registration {
    Endpoint* endpoint = nullptr;
    std::string request_id;
    uint64_t prompt_hash = 0;
    int64_t tokens = 0;  // to send per layer
    double registered = 0;
    int64_t prompt_tokens = 0;  // as the decode engine names them when it gives up
  };
  struct Room {
    uint64_t claim = 0;  // 0: no prefill request yet
    uint64_t prompt_hash = 0;
    int64_t prompt_tokens = 0;
    RoomDone done;
    std::vector<int32_t> blocks;
    std::vector<double> layer_times;  // when each layer was written; -1: not yet
    double opened = 0;                // when the prefill leg claimed it
    double progressed = -1;           // when its prompt last progressed; -1: not yet
    int64_t computed_tokens = 0;      // of the prompt, by the last progress
    std::optional<Registration> decode;
    bool sending = false;
    gateway::Executor::TimerId timeout;  // arm_room_wait's
  };
  struct Fetch {
    std::function<void(const KvFetchResult&)> done;
  };
  // Left where a room ended before one of its legs came, as the live agent's failed rooms: a
  // decode leg that registers later is failed with `error` at once (register_room), and a prefill
  // leg of the prompt is refused with it where `refuses_prefill` (its decode leg abandoned the room
  // or was refused); a prefill leg that failed alone leaves one that a prefill leg replaces.
  struct Refusal {
    uint64_t prompt_hash = 0;
    int64_t prompt_tokens = 0;
    std::string error;
    bool refuses_prefill = true;
    gateway::Executor::TimerId expiry;
  };

  static std::string address(const std::string& host, uint16_t port) {
    return host + ":" + std::to_string(port);
  }
  // A configured timeout in seconds as the engines' agent writes it.
  static std::string seconds_text(double s) {
    char text[32];
    std::snprintf(text, sizeof text, "%g", s);
    return text;
  }
  double now_s() const { return double(net_.clock_.now_ns()) / 1e9; }  // the virtual clock
  gateway::Executor::TimerId at(double seconds, gateway::Executor::Task task) {
    return at(time_at(seconds), std::move(task));
  }
  gateway::Executor::TimerId at(TimePoint t, gateway::Executor::Task task) {
    return net_.clock_.at(std::max(t, net_.clock_.now()), std::move(task));
  }
  void to_engine(Task task) {
    post_(std::move(task));
    wake_();
  }
  // A link between this prefill engine and `decode`, at the slower end's speed.
  double bytes_per_s(const Endpoint* decode) const {
    return net_.link_.bytes_per_s / std::max(slowdown(), decode->slowdown());
  }
  double slowdown() const { return slowdowns_.empty() ? 1 : *slowdowns_.rbegin(); }

  // When this engine is awake at or after `t`: the end of the stall `t` falls in, else `t`. In
  // time points, as the stalls are: an end in seconds was armed at the nanosecond before it,
  // which found the engine still stalled and armed the same instant again, for ever.
  TimePoint awake_from(TimePoint t) const {
    for (const auto& [from, until] : stalls_)
      if (from <= t && t < until) return until;
    return t;
  }
  // When this engine and `peer` are both awake at or after `t` (one may wake as the other
  // stalls: each stall moves `t` to a later end, so this ends).
  TimePoint both_awake_from(const Endpoint* peer, TimePoint t) const {
    for (;;) {
      const TimePoint awake = peer->awake_from(awake_from(t));
      if (awake == t) return t;
      t = awake;
    }
  }
  // The time in [from, to] during which this engine or `peer` was stalled.
  Duration frozen(const Endpoint* peer, TimePoint from, TimePoint to) const {
    std::vector<std::pair<TimePoint, TimePoint>> spans;
    for (const Endpoint* e : {this, peer})
      for (const auto& [a, b] : e->stalls_)
        if (std::max(a, from) < std::min(b, to))
          spans.emplace_back(std::max(a, from), std::min(b, to));
    std::sort(spans.begin(), spans.end());
    Duration length{};  // the union's, left to right
    TimePoint covered = from;
    for (const auto& [a, b] : spans) {
      if (b > covered) length += b - std::max(a, covered);
      covered = std::max(covered, b);
    }
    return length;
  }
  // When this engine or `peer`, stalled from a time in [from, to), stayed stalled (the two
  // together, without a break) for longer than `limit`: that stall's start, or none. Stalls are
  // known once they begin, their ends with them.
  std::optional<TimePoint> frozen_past(const Endpoint* peer, TimePoint from, TimePoint to,
                                       Duration limit) const {
    std::vector<std::pair<TimePoint, TimePoint>> spans;
    for (const Endpoint* e : {this, peer})
      for (const auto& [a, b] : e->stalls_)
        if (b > from && a < to) spans.emplace_back(std::max(a, from), b);
    std::sort(spans.begin(), spans.end());
    for (size_t i = 0; i < spans.size();) {
      const TimePoint start = spans[i].first;
      TimePoint until = spans[i].second;
      for (++i; i < spans.size() && spans[i].first <= until; ++i)
        until = std::max(until, spans[i].second);
      if (until - start > limit) return start;
    }
    return std::nullopt;
  }
  // Runs `done` once the link between this engine and `peer` has run for `seconds` from `from`,
  // the time either engine was stalled not counting: a stalled engine's transfer threads are
  // frozen (SIGSTOP), and its transfers go on where they stopped when it wakes. A stall is known
  // once it begins, so the end is checked when it comes and moved on by what stalls took of it.
  // Live, each frame is sent and received within the transfer timeout: a stall longer than that
  // fails the transfer at the timeout from the stall's start (the side still running gives up;
  // a stalled decode engine finds the connection closed when it wakes), as the prefill engine's
  // fault (check_stalled_links, as each stall begins). A transfer whose end is past what the clock
  // counts (a long prompt over a link slowed a millionfold takes centuries) fails too, alone, and
  // the run goes on. `failed` gets why, and whether the prefill engine is at fault.
  using LinkFailed = std::function<void(const std::string& why, bool prefills_fault)>;
  void after_link_time(Endpoint* peer, TimePoint from, double seconds, gateway::Executor::Task done,
                       LinkFailed failed) {
    if (!(seconds <= kMaxVirtualSeconds)) {
      failed(too_slow_error(peer, seconds_of(from) + seconds), false);
      return;
    }
    after_link_time(peer, from, duration_of(seconds), std::move(done), std::move(failed));
  }
  void after_link_time(Endpoint* peer, TimePoint from, Duration length,
                       gateway::Executor::Task done, LinkFailed failed) {
    const TimePoint awake = both_awake_from(peer, from);
    if (awake.time_since_epoch() + length > duration_of(kMaxVirtualSeconds)) {
      failed(too_slow_error(peer, seconds_of(awake + length)), false);
      return;
    }
    const uint64_t id = ++next_link_;
    // Started at `from`, not at the wake: a stall under way already (the decode engine froze after
    // it registered a room) holds the first frame, which times out as any other would.
    links_[id] = {peer, from, awake, std::move(failed)};
    check_stalled_link(id);
    link_end(id, awake + length, std::move(done));
  }
  void link_end(uint64_t id, TimePoint end, gateway::Executor::Task done) {
    at(end, [this, id, end, done = std::move(done)]() mutable {
      auto it = links_.find(id);
      if (it == links_.end() || it->second.failing) return;  // failed by a stall
      Link& l = it->second;
      // What stalls took of the time since it last went on moves its end on by as much, from
      // when both engines are awake again (the time until then, stalled, is not counted twice).
      const Duration lost = frozen(l.peer, l.resumed, end);
      if (lost > Duration::zero()) {
        l.resumed = both_awake_from(l.peer, end);
        if (l.resumed.time_since_epoch() + lost > duration_of(kMaxVirtualSeconds)) {
          const std::string why = too_slow_error(l.peer, seconds_of(l.resumed + lost));
          LinkFailed failed = std::move(l.failed);
          links_.erase(it);
          failed(why, false);
          return;
        }
        link_end(id, l.resumed + lost, std::move(done));
        return;
      }
      links_.erase(it);
      done();
    });
  }

 public:
  // A stall began on `stalled`: a transfer of this engine's whose link it freezes, with its
  // peer's stalls, for longer than the transfer timeout fails at that timeout.
  void check_stalled_links(const Endpoint* stalled) {
    for (const auto& [id, l] : links_)
      if (stalled == this || stalled == l.peer) check_stalled_link(id);
  }

 private:
  // The stalls begun by now fail link `id` if they freeze it for longer than the transfer timeout.
  void check_stalled_link(uint64_t id) {
    Link& l = links_.at(id);
    if (l.failing) return;
    const Duration limit = duration_of(config_.timeout_s);
    const std::optional<TimePoint> stopped =
        frozen_past(l.peer, l.started, net_.clock_.now() + Duration(1), limit);
    if (!stopped) return;
    l.failing = true;
    at(*stopped + limit, [this, id, limit_s = config_.timeout_s] {
      auto it = links_.find(id);
      if (it == links_.end()) return;
      LinkFailed failed = std::move(it->second.failed);
      links_.erase(it);
      failed("no KV frame moved within the transfer timeout of " + seconds_text(limit_s) +
                 " s (--kv-transfer-timeout): an engine of the link stalled",
             true);
    });
  }

  // A transfer under way on a link of this (prefill) engine's (after_link_time).
  struct Link {
    Endpoint* peer = nullptr;
    // When it began: its stalls count from here towards the transfer timeout, however often it
    // was moved on.
    TimePoint started;
    // When it last went on (both engines awake), from its start or a stall that held back its
    // planned end: the time after it that stalls take moves its end on again.
    TimePoint resumed;
    LinkFailed failed;
    bool failing = false;  // a stall fails it (check_stalled_links)
  };
  std::map<uint64_t, Link> links_;
  uint64_t next_link_ = 0;
  std::string too_slow_error(const Endpoint* peer, double end) const {
    const double slowed = std::max(slowdown(), peer->slowdown());
    char text[256];
    std::snprintf(text, sizeof text,
                  "the KV transfer would end at %.4g s of virtual time, past the %.0f s the "
                  "simulator counts: its link runs at %g GB/s (--kv-link-gb-per-s)",
                  end, kMaxVirtualSeconds, net_.link_.bytes_per_s / 1e9);
    std::string why = text;
    if (slowed > 1) {
      std::snprintf(text, sizeof text, ", slowed %g times (--slow-link)", slowed);
      why += text;
    }
    return why;
  }
  double bytes_for(int64_t tokens) const {
    return double(tokens) * double(layout_.token_bytes) * double(layout_.layers);
  }

  // Prefill side: a hold ends (pulled, released or expired); false when there is none, or a pull
  // of it runs and this is not that pull's end (`by_its_pull`), as in the engines' agent.
  bool free_held(const std::string& id, bool by_its_pull) {
    auto it = held_.find(id);
    if (it == held_.end() || (it->second.pulling && !by_its_pull)) return false;
    net_.clock_.cancel(it->second.expiry);
    Task release = std::move(it->second.release);
    held_.erase(it);
    to_engine(std::move(release));
    return true;
  }

  // Decode side: a request for KV, sent at `started`, reaches `prefill`'s transfer server, which
  // takes it once its engine is awake (a stalled engine's server thread is frozen too). As the
  // engines' agent (run_fetch): what needs the prefill engine's answer before the transfer (the
  // shared-memory transport's hello, the secret's handshake, a pull's accept, which a prefill
  // engine holding the KV gives at once) fails as that engine's fault at the handshake timeout;
  // a room registered over TCP (to another host, whatever the transport) without a secret waits
  // in the socket for the prefill's compute, up to the transfer timeout.
  void reach(Endpoint* prefill, KvFetch f, TimePoint started) {
    if (!fetches_.count(f.request_id)) return;  // cancelled on the way
    const TimePoint now = net_.clock_.now();
    if (const TimePoint awake = prefill->awake_from(now); awake > now) {
      // The shared-memory transport connects through its hello only to an engine of this host
      // (another host's it reaches over TCP).
      const bool hello =
          config_.transport == engine::KvTransportKind::kShm && f.host == config_.advertise_host;
      const bool answer_needed = f.pull || hello || !config_.secret.empty();
      const double limit_s = answer_needed ? config_.handshake_timeout_s : config_.timeout_s;
      const TimePoint give_up = started + duration_of(limit_s);
      if (awake > give_up) {
        at(give_up, [this, answer_needed, limit_s, id = f.request_id, room = f.room,
                     tokens = f.prompt_tokens] {
          finish_fetch(
              id, prefills_fault(answer_needed
                                     ? "the prefill engine did not answer within the handshake "
                                       "timeout of " +
                                           seconds_text(limit_s) + " s"
                                     : "the prefill of bootstrap_room " + std::to_string(room) +
                                           " made no progress within " + seconds_text(limit_s) +
                                           " s (0 of its " + std::to_string(tokens) +
                                           " tokens computed)"));
        });
        return;
      }
      at(awake, [this, prefill, started, f = std::move(f)]() mutable {
        reach(prefill, std::move(f), started);
      });
      return;
    }
    if (f.pull)
      prefill->serve_pull(std::move(f), this);
    else
      prefill->register_room(std::move(f), this);
  }

  void serve_pull(KvFetch f, Endpoint* decode) {
    const TimePoint now = net_.clock_.now();
    auto it = held_.find(f.transfer_id);
    KvFetchResult refused;
    if (it == held_.end()) {
      refused.error =
          "no KV transfer '" + f.transfer_id + "' is held here (pulled, released or expired)";
      refused.transfer_gone = true;  // as the engines' pulls say it: prefill the request again
    } else if (it->second.prompt_hash != f.prompt_hash ||
               it->second.num_tokens != f.prompt_tokens) {
      refused.error = "transfer '" + f.transfer_id + "' holds another prompt";
    }
    if (!refused.error.empty()) {
      at(now_s() + net_.link_.latency_s,
         [decode, id = f.request_id, refused] { decode->finish_fetch(id, refused); });
      return;
    }
    it->second.pulling = true;
    const int64_t tokens = std::max<int64_t>(f.num_tokens - f.first_token, 0);
    const double bytes = bytes_for(tokens);
    const double seconds = bytes / bytes_per_s(decode) + net_.link_.latency_s;
    after_link_time(
        decode, now, seconds,
        [this, decode, id = f.request_id, transfer = f.transfer_id, bytes] {
          if (dead_) {
            decode->finish_fetch(id, prefills_fault("the prefill engine's connection was reset"));
            return;
          }
          free_held(transfer, true);
          ++net_.transfers_;
          net_.bytes_ += bytes;
          decode->finish_fetch(id, {true, "", static_cast<uint64_t>(bytes)});
        },
        [this, decode, id = f.request_id, transfer = f.transfer_id](const std::string& why,
                                                                    bool prefills_fault) {
          // A pull that fails once begun ends its hold, as the engines' agent ends it.
          free_held(transfer, true);
          KvFetchResult failed;
          failed.error = why;
          failed.prefill_fault = prefills_fault;
          at(now_s() + net_.link_.latency_s,
             [decode, id, failed] { decode->finish_fetch(id, failed); });
        });
  }

  void register_room(KvFetch f, Endpoint* decode) {
    if (auto refusal = refusals_.find(f.room); refusal != refusals_.end()) {
      // The room failed before this leg came (its prefill leg timed out alone, say): the live
      // serve_register tells it so at once, the prefill engine's answer, not its fault.
      net_.clock_.cancel(refusal->second.expiry);
      at(now_s() + net_.link_.latency_s,
         [decode, id = f.request_id, error = std::move(refusal->second.error)] {
           decode->finish_fetch(id, {false, error, 0});
         });
      refusals_.erase(refusal);
      return;
    }
    Room& r = rooms_[f.room];
    if (r.decode) {
      at(now_s() + net_.link_.latency_s, [decode, id = f.request_id, room = f.room] {
        decode->finish_fetch(
            id, {false, "bootstrap room " + std::to_string(room) + " already has a decode leg", 0});
      });
      return;
    }
    decode->registered_[f.room] = {f.request_id, this};
    r.decode = Registration{decode,        f.request_id,
                            f.prompt_hash, std::max<int64_t>(f.num_tokens - f.first_token, 0),
                            now_s(),       f.prompt_tokens};
    if (r.claim == 0) {
      if (r.layer_times.empty()) r.layer_times.assign(size_t(layout_.layers), -1);
      arm_room_wait(f.room);  // the prefill leg has not arrived yet
      return;
    }
    if (r.prompt_hash != f.prompt_hash) {
      fail_room(f.room, "the decode leg's prompt differs from this prefill's (prompt hash)");
      return;
    }
    arm_room_wait(f.room);
    maybe_send(f.room);
  }

  // Both legs are there and every layer is written: the layers go over the link in order, each
  // once written and once the one before has gone (and while either engine is awake: a stall
  // from now on holds the rest back by its length).
  void maybe_send(uint64_t room) {
    Room& r = rooms_[room];
    if (r.sending || r.claim == 0 || !r.decode) return;
    for (double t : r.layer_times)
      if (t < 0) return;
    r.sending = true;
    net_.clock_.cancel(r.timeout);  // the layers go: each frame has its own timeout (links_)
    const double layer_bytes = double(r.decode->tokens) * double(layout_.token_bytes);
    double link_free = r.decode->registered;
    const double speed = bytes_per_s(r.decode->endpoint);
    for (double t : r.layer_times) link_free = std::max(t, link_free) + layer_bytes / speed;
    const double end = link_free + net_.link_.latency_s;
    const double bytes = layer_bytes * double(layout_.layers);
    const double now = now_s();
    after_link_time(
        r.decode->endpoint, net_.clock_.now(), std::max(end - now, 0.0),
        [this, room, bytes] {
          auto it = rooms_.find(room);
          if (it == rooms_.end() || dead_) return;  // failed meanwhile (or told the decode leg)
          Room done = std::move(it->second);
          rooms_.erase(it);
          ++net_.transfers_;
          net_.bytes_ += bytes;
          done.decode->endpoint->registered_.erase(room);
          done.decode->endpoint->finish_fetch(done.decode->request_id,
                                              {true, "", static_cast<uint64_t>(bytes)});
          to_engine([d = std::move(done.done)] { d(true, "", false); });
        },
        [this, room](const std::string& why, bool prefills_fault) {
          fail_room(room, why, false, prefills_fault);
        });
  }

  // The room's wait for what comes next, as the live agent's room deadline and the decode
  // engine's await_room bound it (kv_transfer.cpp): a prefill leg alone waits for the decode leg
  // from when its last layer was written (its prompt may compute for longer than the timeout: the
  // live reaper leaves such a room be); with a decode leg and no layer written yet, the decode
  // engine waits from sending its registration, and again from each progress frame it receives,
  // and the prefill engine's deadline runs from the registration's arrival (no prefill leg yet),
  // else from open_room and each progress. The first to pass decides; a stalled engine (SIGSTOP)
  // checks its deadline only when it wakes, so the awake engine's decides meanwhile.
  struct RoomWait {
    TimePoint when;
    bool decode_gives_up = false;
  };
  std::optional<RoomWait> next_room_wait(const Room& r) const {
    if (r.sending) return std::nullopt;
    const double written = *std::max_element(r.layer_times.begin(), r.layer_times.end());
    if (!r.decode) {
      const bool all_written = *std::min_element(r.layer_times.begin(), r.layer_times.end()) >= 0;
      if (!all_written) return std::nullopt;
      return RoomWait{awake_from(time_at(written + config_.timeout_s)), false};
    }
    if (r.claim != 0 && written >= 0) return std::nullopt;  // the layers go when all are written
    // The decode engine's wait begins as it sends its registration, and again as it reads each
    // progress frame: a link's latency before and after the prefill engine's times. A frame that
    // reaches it stalled waits in its socket until it wakes and reads it (await_room).
    const double latency_s = net_.link_.latency_s;
    const Endpoint* decode = r.decode->endpoint;
    TimePoint decode_waits_from = time_at(r.decode->registered - latency_s);
    if (r.progressed >= 0)
      decode_waits_from =
          std::max(decode_waits_from, decode->awake_from(time_at(r.progressed + latency_s)));
    const TimePoint decode_gives_up =
        decode->awake_from(decode_waits_from + duration_of(decode->config_.timeout_s));
    const double prefill_waits_from =
        r.claim == 0 ? r.decode->registered : std::max(r.opened, r.progressed);
    const TimePoint prefill_gives_up = awake_from(time_at(prefill_waits_from + config_.timeout_s));
    if (decode_gives_up <= prefill_gives_up) return RoomWait{decode_gives_up, true};
    return RoomWait{prefill_gives_up, false};
  }
  void arm_room_wait(uint64_t room) {
    auto it = rooms_.find(room);
    if (it == rooms_.end()) return;
    Room& r = it->second;
    net_.clock_.cancel(r.timeout);
    r.timeout = {};
    if (const std::optional<RoomWait> wait = next_room_wait(r))
      r.timeout = at(wait->when, [this, room] { room_wait_passed(room); });
  }
  // A room's wait passed, unless a stall begun since it was armed holds its engine's check back
  // to its wake: then it waits again.
  void room_wait_passed(uint64_t room) {
    auto it = rooms_.find(room);
    if (it == rooms_.end()) return;
    Room& r = it->second;
    const std::optional<RoomWait> wait = next_room_wait(r);
    if (!wait) return;
    if (wait->when > net_.clock_.now()) {
      arm_room_wait(room);
      return;
    }
    const std::string name = "the prefill of bootstrap_room " + std::to_string(room);
    if (wait->decode_gives_up) {
      decode_gave_up(room, name + " made no progress within " +
                               seconds_text(r.decode->endpoint->config_.timeout_s) + " s (" +
                               std::to_string(r.computed_tokens) + " of its " +
                               std::to_string(r.decode->prompt_tokens) + " tokens computed)");
    } else if (r.claim != 0 && r.decode) {
      // The prefill engine's answer to the decode engine: a refusal, no engine's fault.
      fail_room(room, name + " did not complete within " + seconds_text(config_.timeout_s) + " s");
    } else if (r.decode) {
      // This engine's timeout, shorter than the decode engine's, passed first: the decode leg is
      // refused, and so is a prefill leg of its prompt that comes later (its KV would reach
      // nobody), as the live agent's serve_register leaves a refusal for it, in its words.
      const uint64_t hash = r.decode->prompt_hash;
      const int64_t tokens = r.decode->prompt_tokens;
      fail_room(room, engine::kv_no_prefill_text(room, config_.timeout_s));
      leave_refusal(room, hash, tokens, engine::kv_room_expired_text(room, config_.timeout_s));
    } else {
      fail_room(room, engine::kv_no_decode_text(room, config_.timeout_s));
    }
  }
  // The decode engine's await_room gave up, the prefill engine's fault: its fetch fails now, and
  // its connection closes, which ends the prefill leg, if any, as abandoned a latency later; with
  // none yet, it leaves the room a refusal for that leg, as the live agent's leave_refusal does
  // (abandoned(): a leg of the prompt arriving meanwhile is ended so).
  void decode_gave_up(uint64_t room, const std::string& why) {
    auto it = rooms_.find(room);
    if (it == rooms_.end()) return;
    Room r = std::move(it->second);
    rooms_.erase(it);
    net_.clock_.cancel(r.timeout);
    r.decode->endpoint->registered_.erase(room);
    r.decode->endpoint->finish_fetch(r.decode->request_id, prefills_fault(why));
    const std::string gone = decode_closed_text(room);
    if (r.claim == 0) {
      at(now_s() + net_.link_.latency_s,
         [this, room, hash = r.decode->prompt_hash, tokens = r.decode->prompt_tokens, gone] {
           abandoned(room, hash, tokens, gone);
         });
      return;
    }
    if (!r.done) return;
    at(now_s() + net_.link_.latency_s,
       [this, d = std::move(r.done), gone] { to_engine([d, gone] { d(false, gone, true); }); });
  }

  // The room ends badly: both legs hear why (`abandoned`: the decode leg abandoned it;
  // `prefills_fault`: the decode leg's fetch blames the prefill engine).
  void fail_room(uint64_t room, const std::string& why, bool abandoned = false,
                 bool prefills_fault = false) {
    auto it = rooms_.find(room);
    if (it == rooms_.end()) return;
    Room r = std::move(it->second);
    rooms_.erase(it);
    net_.clock_.cancel(r.timeout);
    if (r.decode) {
      Endpoint* decode = r.decode->endpoint;
      decode->registered_.erase(room);
      KvFetchResult failed;
      failed.error = why;
      failed.prefill_fault = prefills_fault;
      at(now_s() + net_.link_.latency_s,
         [decode, id = r.decode->request_id, failed] { decode->finish_fetch(id, failed); });
    }
    if (r.claim != 0 && r.done)
      to_engine([d = std::move(r.done), why, abandoned] { d(false, why, abandoned); });
    // A decode leg that comes later learns why at once, as from the live agent's finish_room.
    if (r.claim != 0 && !r.decode) leave_refusal(room, r.prompt_hash, r.prompt_tokens, why, false);
  }

  // Prefill side: the decode leg of `room` ended before it registered, or gave up before the
  // prefill leg came. As the live engine: the room's prefill leg for this prompt fails, or is
  // refused if it comes within the timeout.
  void abandoned(uint64_t room, uint64_t prompt_hash, int64_t prompt_tokens,
                 const std::string& reason) {
    auto it = rooms_.find(room);
    if (it == rooms_.end()) {
      leave_refusal(room, prompt_hash, prompt_tokens, reason);
      return;
    }
    if (it->second.claim == 0 || it->second.decode || it->second.prompt_hash != prompt_hash ||
        it->second.prompt_tokens != prompt_tokens)
      return;
    fail_room(room, reason, true);
  }

  // Prefill side: a leg that comes for `room` within the timeout is refused with `error`, a decode
  // leg whatever its prompt, a prefill leg of this prompt as abandoned where `refuses_prefill`
  // (open_room); a refusal there already stands.
  void leave_refusal(uint64_t room, uint64_t prompt_hash, int64_t prompt_tokens,
                     const std::string& error, bool refuses_prefill = true) {
    if (refusals_.count(room)) return;
    Refusal& f = refusals_[room];
    f.prompt_hash = prompt_hash;
    f.prompt_tokens = prompt_tokens;
    f.error = error;
    f.refuses_prefill = refuses_prefill;
    f.expiry = at(now_s() + config_.timeout_s, [this, room] { refusals_.erase(room); });
  }

  // Prefill side: the decode leg of `room` went away (its request ended, closing its connection).
  // As the live agent's serve_register: the room's prefill leg fails as abandoned, or, with none
  // there yet, one of its prompt that comes within the timeout is refused so.
  void decode_gone(uint64_t room, const std::string& request_id) {
    auto it = rooms_.find(room);
    if (it == rooms_.end() || !it->second.decode || it->second.decode->request_id != request_id)
      return;
    const bool had_prefill = it->second.claim != 0;
    const uint64_t hash = it->second.decode->prompt_hash;
    const int64_t tokens = it->second.decode->prompt_tokens;
    const std::string why = decode_closed_text(room);
    fail_room(room, why, true);
    if (!had_prefill) leave_refusal(room, hash, tokens, why);
  }
  // What the prefill side says of a room whose decode engine closed its connection, in the live
  // agent's words.
  static std::string decode_closed_text(uint64_t room) {
    return "the decode engine of bootstrap_room " + std::to_string(room) +
           " closed its connection (its request ended)";
  }

  Room* find_room(uint64_t room, uint64_t claim) {
    auto it = rooms_.find(room);
    return it == rooms_.end() || it->second.claim != claim ? nullptr : &it->second;
  }

  // A fetch's failure that blames the prefill engine (KvFetchResult::prefill_fault), as the
  // engines' agent blames it for a connection refused or reset and for silence: the gateway
  // retries the request on another prefill engine.
  static KvFetchResult prefills_fault(std::string error) {
    KvFetchResult r;
    r.error = std::move(error);
    r.prefill_fault = true;
    return r;
  }

  // Decode side: a fetch ends once.
  void finish_fetch(const std::string& id, KvFetchResult result) {
    auto it = fetches_.find(id);
    if (it == fetches_.end()) return;
    auto done = std::move(it->second.done);
    fetches_.erase(it);
    to_engine([done = std::move(done), result = std::move(result)] { done(result); });
  }

  VirtualKvNetwork& net_;
  engine::KvTransferConfig config_;
  engine::KvLayout layout_;
  Post post_;
  std::function<double()> now_;
  std::function<void()> wake_;
  std::map<std::string, Held> held_;
  std::map<uint64_t, Room> rooms_;
  std::map<uint64_t, Refusal> refusals_;                              // prefill side, by room
  std::map<std::string, Fetch> fetches_;                              // decode side, by request
  std::map<uint64_t, std::pair<std::string, Endpoint*>> registered_;  // decode side, by room
  uint64_t next_id_ = 0, next_claim_ = 0;
  bool dead_ = false;
  // The factors of the slow-link faults under way on this engine: its links run as slow as the
  // largest says (none: as modelled).
  std::multiset<double> slowdowns_;
  // This engine's stalls, [from, until), in time order.
  std::vector<std::pair<TimePoint, TimePoint>> stalls_;
};

void VirtualKvNetwork::kill(const std::string& engine_id) {
  if (auto it = endpoints_.find(engine_id); it != endpoints_.end()) it->second->die();
}

void VirtualKvNetwork::slow(const std::string& engine_id, double factor) {
  if (auto it = endpoints_.find(engine_id); it != endpoints_.end()) it->second->slow_down(factor);
}

void VirtualKvNetwork::end_slow(const std::string& engine_id, double factor) {
  if (auto it = endpoints_.find(engine_id); it != endpoints_.end())
    it->second->end_slow_down(factor);
}

void VirtualKvNetwork::stall(const std::string& engine_id, TimePoint until) {
  auto it = endpoints_.find(engine_id);
  if (it == endpoints_.end()) return;
  it->second->stall(until);
  for (auto& [id, e] : endpoints_) e->check_stalled_links(it->second);
}

VirtualKvNetwork::VirtualKvNetwork(gateway::Executor& clock, KvLinkModel link)
    : clock_(clock), link_(link) {}

VirtualKvNetwork::~VirtualKvNetwork() = default;

std::unique_ptr<engine::KvTransfers> VirtualKvNetwork::make(const engine::KvTransferConfig& config,
                                                            engine::Executor& executor,
                                                            engine::KvTransfers::Post post,
                                                            std::function<double()> now,
                                                            std::function<void()> wake) {
  return std::make_unique<Endpoint>(*this, config, executor, std::move(post), std::move(now),
                                    std::move(wake));
}

}  // namespace tandem::sim
