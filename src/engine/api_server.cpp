#include "engine/api_server.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>

#include "api/api_key.h"
#include "api/error.h"
#include "api/load_report.h"
#include "api/model_list.h"
#include "api/prefill_work.h"
#include "net/loop_tasks.h"
#include "net/reply.h"
#include "placement/placement_format.h"

namespace tandem::engine {
namespace {

using nlohmann::json;

int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

struct ApiServer::Drain {
  std::mutex mutex;
  std::condition_variable changed;
  int64_t answering = 0;     // generation requests taken and not yet answered in full
  bool engine_idle = false;  // no request live in the engine (Engine::when_idle)
  bool cut = false;          // end_drain()

  void update(const std::function<void(Drain&)>& change) {
    {
      std::lock_guard lock(mutex);
      change(*this);
    }
    changed.notify_all();
  }
};

namespace {

// A generation request's reply, counted in the drain from when its handler takes it until its
// answer is complete (or can no longer be sent: the client gone, the reply dropped).
class CountedReply final : public net::Reply {
 public:
  CountedReply(std::shared_ptr<net::Reply> reply, std::shared_ptr<ApiServer::Drain> drain)
      : reply_(std::move(reply)), drain_(std::move(drain)) {
    drain_->update([](ApiServer::Drain& d) { ++d.answering; });
  }
  ~CountedReply() override { answered(); }

  bool respond(int status, std::string body, std::string content_type) override {
    const bool sent = reply_->respond(status, std::move(body), std::move(content_type));
    answered();
    return sent;
  }
  bool send_error(int status, std::string_view message, std::string_view type,
                  std::string_view code) override {
    const bool sent = reply_->send_error(status, message, type, code);
    answered();
    return sent;
  }
  bool start_stream(int status, std::string content_type) override {
    return reply_->start_stream(status, std::move(content_type));
  }
  bool write(std::string_view chunk) override { return reply_->write(chunk); }
  bool end() override {
    const bool sent = reply_->end();
    answered();
    return sent;
  }
  void abort() override {
    reply_->abort();
    answered();
  }
  void on_close(std::function<void()> callback) override { reply_->on_close(std::move(callback)); }

 private:
  void answered() {
    if (!counted_.exchange(false)) return;
    drain_->update([](ApiServer::Drain& d) { --d.answering; });
  }

  const std::shared_ptr<net::Reply> reply_;
  const std::shared_ptr<ApiServer::Drain> drain_;
  std::atomic<bool> counted_{true};
};

}  // namespace

struct ApiServer::Unprepared {
  std::atomic<int64_t> requests{0}, tokens{0}, pairs{0};

  void add(const api::PrefillWork& work, int64_t sign) {
    requests += sign;
    tokens += sign * work.tokens;
    pairs += sign * work.pairs;
  }

  // One generation request, counted from when its handler takes it until its preparation ended
  // or was dropped (with the task that holds this).
  class Counted {
   public:
    Counted(std::shared_ptr<Unprepared> counts, api::PrefillWork work)
        : counts_(std::move(counts)), work_(work) {
      counts_->add(work_, 1);
    }
    ~Counted() { counts_->add(work_, -1); }
    Counted(const Counted&) = delete;
    Counted& operator=(const Counted&) = delete;

   private:
    const std::shared_ptr<Unprepared> counts_;
    const api::PrefillWork work_;
  };
};

struct ApiServer::Preparer {
  util::TaskThread thread{"prepare"};
  std::atomic<int64_t> queued{0};  // requests posted whose preparation has not ended
};

ApiServer::ApiServer(Engine& engine, metrics::Registry& registry, net::HttpServerOptions options,
                     std::vector<std::string> api_keys, RequestPreparation preparation)
    : engine_(engine),
      registry_(registry),
      api_keys_(std::move(api_keys)),
      io_threads_(std::max(1, options.threads)),
      drain_(std::make_shared<Drain>()),
      unprepared_(std::make_shared<Unprepared>()),
      server_([&] {
        options.error_response = api::openai_error_response;
        return std::move(options);
      }()),
      before_preparation_(std::move(preparation.before_each)),
      generation_(engine, [renderer = renderer_](
                              std::function<void()> task) { renderer->post(std::move(task)); }),
      created_(unix_seconds()) {
  for (int i = 0; i < std::max(1, preparation.threads); ++i)
    preparers_.push_back(std::make_unique<Preparer>());
  const ExecutorInfo& info = engine_.executor_info();

  route("GET", "/health", [this](const net::HttpRequest&, std::shared_ptr<net::Exchange> ex) {
    if (refusing()) {
      ex->send_error(503, kShuttingDown, "server_error");
      return;
    }
    if (auto why = engine_.executor_failure(); !why.empty()) {
      ex->respond(503, api::openai_error_body(why, "server_error"));
      return;
    }
    ex->respond(200, "", "text/plain");
  });
  route("GET", "/v1/models",
        [this, info](const net::HttpRequest&, std::shared_ptr<net::Exchange> ex) {
          ex->respond(200,
                      api::model_list_json({info.model_name, created_, engine_.max_model_len()}));
        });
  // The openai client's models.retrieve: the model object of the list, or model_not_found for
  // another id (api::retrieved_model_id reads it).
  route_prefix("GET", "/v1/models/",
               [this, info](const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
                 ex->respond(api::model_retrieval(
                     req.path, {info.model_name, created_, engine_.max_model_len()}));
               });
  route("GET", "/metrics", [this](const net::HttpRequest&, std::shared_ptr<net::Exchange> ex) {
    ex->respond(200, registry_.render(), std::string(metrics::Registry::kContentType));
  });
  route("GET", "/load", [this](const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
    ex->respond(200, api::to_json(load(), api::load_since_step(req.target)));
  });
  route("GET", "/expert_load", [this](const net::HttpRequest&, std::shared_ptr<net::Exchange> ex) {
    if (auto load = engine_.expert_load()) {
      ex->respond(200, load->to_json().dump());
      return;
    }
    ex->respond(404, api::openai_error_body("this engine's executor reports no expert routing "
                                            "(a model without MoE layers)",
                                            "invalid_request_error", "not_found"));
  });
  // Where experts live (expert-parallel engines) and live changes of it.
  const std::string not_placing_experts = api::openai_error_body(
      "this engine does not place experts (start it with "
      "--expert-parallel N)",
      "invalid_request_error", "not_found");
  route("GET", "/admin/expert_placement",
        [this, not_placing_experts](const net::HttpRequest&, std::shared_ptr<net::Exchange> ex) {
          const auto current = engine_.expert_placement();
          const auto status = engine_.expert_remap_status();
          if (!current || !status) {
            ex->respond(404, not_placing_experts);
            return;
          }
          json j = status->to_json();
          j["placement"] = placement::placement_to_json(*current);
          j["ranks"] = json::array();
          for (const RankWork& w : engine_.rank_work())
            j["ranks"].push_back({{"expert_rows", w.expert_rows},
                                  {"moe_layers", w.moe_layers},
                                  {"exchange_bytes", w.exchange_bytes},
                                  {"copy_seconds", w.copy_seconds},
                                  {"wait_seconds", w.wait_seconds},
                                  {"expert_seconds", w.expert_seconds}});
          ex->respond(200, j.dump());
        });
  route(
      "POST", "/admin/expert_placement",
      [this, not_placing_experts](const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
        const auto status = engine_.expert_remap_status();
        if (!status) {
          ex->respond(404, not_placing_experts);
          return;
        }
        constexpr const char* kRetry = "; retry when GET /admin/expert_placement says idle";
        if (status->loading) {
          ex->respond(409, api::openai_error_body(
                               std::string("a placement change is already underway") + kRetry));
          return;
        }
        try {
          const placement::Placement next =
              placement::placement_from_json(req.body, "expert placement");
          engine_.change_expert_placement(next);
        } catch (const RemapUnderway& e) {
          // One began since the check above (an automatic rebalance, another POST).
          ex->respond(409, api::openai_error_body(e.what() + std::string(kRetry)));
          return;
        } catch (const RemapUnavailable& e) {
          // The executor has failed (a rank died): nothing wrong with the request.
          ex->respond(503, api::openai_error_body(e.what(), "server_error"));
          return;
        } catch (const std::exception& e) {
          ex->respond(400, api::openai_error_body(e.what()));
          return;
        }
        ex->respond(202, json{{"state", "loading"}}.dump());
      });
  auto generation = [this](api::ApiKind kind) {
    return [this, kind](const net::HttpRequest&, std::shared_ptr<net::Exchange> ex) {
      std::shared_ptr<net::Reply> reply = std::make_shared<net::ExchangeReply>(ex);
      if (refusing()) {
        auto refuse = [this, kind](const net::HttpRequest& req, std::shared_ptr<net::Reply> r) {
          generation_.refuse(kind, req, *r, kShuttingDown);
        };
        prepare(std::move(ex), std::move(reply), refuse, refuse);
        return;
      }
      // Counted from here, on the io thread: a drain that begins while it waits to be prepared
      // waits for it too.
      reply = std::make_shared<CountedReply>(std::move(reply), drain_);
      // Until it is submitted, the engine cannot count it: /load does (load()).
      const int64_t prompt =
          std::min<int64_t>(static_cast<int64_t>(ex->request().body.size()) / kBodyBytesPerToken,
                            engine_.max_model_len());
      auto unprepared = std::make_shared<Unprepared::Counted>(
          unprepared_, api::PrefillWork::of_prompt(0, prompt));
      prepare(
          std::move(ex), std::move(reply),
          [this, kind, unprepared = std::move(unprepared)](const net::HttpRequest& req,
                                                           std::shared_ptr<net::Reply> r) {
            generation_.handle(kind, req, std::move(r));
          },
          // A decode leg whose client (the gateway) left before it was prepared still names KV
          // that a prefill engine holds for it: refused (the answer goes to nobody), it tells that
          // engine to let go, which would otherwise keep it until its timeout.
          [this, kind](const net::HttpRequest& req, std::shared_ptr<net::Reply> r) {
            generation_.refuse(kind, req, *r, "its client left before it was prepared");
          });
    };
  };
  route("POST", "/v1/completions", generation(api::ApiKind::kCompletion));
  route("POST", "/v1/chat/completions", generation(api::ApiKind::kChat));
  route("POST", "/generate", generation(api::ApiKind::kGenerate));
  route("POST", "/tokenize", [this](const net::HttpRequest&, std::shared_ptr<net::Exchange> ex) {
    auto reply = std::make_shared<net::ExchangeReply>(ex);
    prepare(std::move(ex), std::move(reply),
            [this](const net::HttpRequest& req, std::shared_ptr<net::Reply> r) {
              generation_.tokenize(req, std::move(r));
            });
  });
  // Not refused while the engine stops: freeing KV is what a drain waits for. Done also when its
  // caller left first (the gateway gives the call up after timeouts.connect_ms, which a busy
  // preparation queue can outlast): the release needs no one to read its answer.
  route("POST", "/v1/kv_transfer/release",
        [this](const net::HttpRequest&, std::shared_ptr<net::Exchange> ex) {
          auto reply = std::make_shared<net::ExchangeReply>(ex);
          auto release = [this](const net::HttpRequest& req, std::shared_ptr<net::Reply> r) {
            generation_.release_kv(req, std::move(r));
          };
          prepare(std::move(ex), std::move(reply), release, release);
        });
  route("POST", "/detokenize", [this](const net::HttpRequest&, std::shared_ptr<net::Exchange> ex) {
    auto reply = std::make_shared<net::ExchangeReply>(ex);
    prepare(std::move(ex), std::move(reply),
            [this](const net::HttpRequest& req, std::shared_ptr<net::Reply> r) {
              generation_.detokenize(req, std::move(r));
            });
  });
}

void ApiServer::prepare(std::shared_ptr<net::Exchange> exchange, std::shared_ptr<net::Reply> reply,
                        Preparation work, Preparation dropped) {
  Preparer* least = preparers_.front().get();
  for (const auto& p : preparers_)
    if (p->queued.load() < least->queued.load()) least = p.get();
  ++least->queued;
  least->thread.post([this, least, exchange = std::move(exchange), reply = std::move(reply),
                      work = std::move(work), dropped = std::move(dropped)]() mutable {
    struct Done {
      Preparer* preparer;
      ~Done() { --preparer->queued; }
    } done{least};
    if (before_preparation_) before_preparation_(exchange->request(), *reply);
    // A client that left while its request waited gets nothing prepared and starts no
    // generation (`dropped` may still let go of what the request names, such as held KV). One
    // that leaves during the preparation has its engine requests aborted as soon as
    // they are submitted: the reply's close callback runs at once when registered then.
    if (exchange->closed()) {
      if (dropped) dropped(exchange->request(), std::move(reply));
      return;
    }
    work(exchange->request(), std::move(reply));
  });
}

void ApiServer::route(std::string method, std::string path, net::Handler handler) {
  // /health and /metrics stay open, as vLLM's do: probes and Prometheus scrapers carry no key.
  const bool open = path == "/health" || path == "/metrics";
  server_.route(std::move(method), std::move(path),
                open ? std::move(handler) : behind_api_keys(std::move(handler)));
}

void ApiServer::route_prefix(std::string method, std::string prefix, net::Handler handler) {
  server_.route_prefix(std::move(method), std::move(prefix), behind_api_keys(std::move(handler)));
}

net::Handler ApiServer::behind_api_keys(net::Handler handler) const {
  if (api_keys_.empty()) return handler;
  return [this, handler = std::move(handler)](const net::HttpRequest& req,
                                              std::shared_ptr<net::Exchange> ex) {
    if (!api::api_key_valid(api_keys_, req)) {
      ex->send_error(401, api::kInvalidApiKey, "invalid_request_error", "invalid_api_key");
      return;
    }
    handler(req, std::move(ex));
  };
}

ApiServer::~ApiServer() {
  stop();
}

void ApiServer::start() {
  renderer_->start();
  for (auto& p : preparers_) p->thread.start();
  server_.start();
  state_ = State::kServing;
}
uint16_t ApiServer::port() const {
  return server_.port();
}

api::LoadReport ApiServer::load() const {
  api::LoadReport report = engine_.load();
  report.instance = api::this_process_instance();
  report.waiting += unprepared_->requests.load();
  report.prefill_tokens += unprepared_->tokens.load();
  if (report.prefill_pairs >= 0) report.prefill_pairs += unprepared_->pairs.load();
  return report;
}

void ApiServer::refuse_new_requests() {
  State serving = State::kServing;
  state_.compare_exchange_strong(serving, State::kRefusing);
}

void ApiServer::end_drain() {
  drain_->update([](Drain& d) { d.cut = true; });
  server_.end_flush();
}

void ApiServer::stop(std::chrono::milliseconds drain) {
  const State before = state_.exchange(State::kStopped);
  if (before == State::kStopped) return;
  const bool started = before != State::kCreated;
  const auto deadline = std::chrono::steady_clock::now() + drain;
  if (started && drain > std::chrono::milliseconds::zero()) {
    // A request a handler took before the refusal is counted once that handler has returned.
    io_threads_pass();
    std::unique_lock lock(drain_->mutex);
    // First the answers; then the engine, where a prefill's answered leg may still hold its KV
    // for a decode engine's pull or room. No request is submitted after the answers: all were.
    if (drain_->changed.wait_until(lock, deadline,
                                   [&] { return drain_->cut || drain_->answering == 0; }) &&
        !drain_->cut) {
      lock.unlock();
      engine_.when_idle(
          [d = drain_] { d->update([](Drain& state) { state.engine_idle = true; }); });
      lock.lock();
      drain_->changed.wait_until(lock, deadline,
                                 [&] { return drain_->cut || drain_->engine_idle; });
    }
  }
  // The answers written by now go to the sockets before the connections close, within what is
  // left of the drain: a large answer to a slow reader is cut only at the deadline.
  server_.stop(std::max(std::chrono::milliseconds::zero(),
                        std::chrono::duration_cast<std::chrono::milliseconds>(
                            deadline - std::chrono::steady_clock::now())));
  // What still waits to be prepared has lost its client with the connections: it is dropped.
  for (auto& p : preparers_) p->thread.stop();
  renderer_->stop();  // what it still has is written; later outputs render where they arrive
}

void ApiServer::io_threads_pass() {
  net::pass_io_threads(server_, static_cast<size_t>(io_threads_));
}

}  // namespace tandem::engine
