#include "engine/api_server.h"

#include <chrono>

#include "api/api_key.h"
#include "api/error.h"
#include "api/load_report.h"
#include "api/model_list.h"
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

ApiServer::ApiServer(Engine& engine, metrics::Registry& registry, net::HttpServerOptions options,
                     std::vector<std::string> api_keys)
    : engine_(engine),
      registry_(registry),
      api_keys_(std::move(api_keys)),
      server_([&] {
        options.error_response = api::openai_error_response;
        return std::move(options);
      }()),
      generation_(engine, [renderer = renderer_](
                              std::function<void()> task) { renderer->post(std::move(task)); }),
      created_(unix_seconds()) {
  const ExecutorInfo& info = engine_.executor_info();

  route("GET", "/health", [this](const net::HttpRequest&, std::shared_ptr<net::Exchange> ex) {
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
  route("GET", "/metrics", [this](const net::HttpRequest&, std::shared_ptr<net::Exchange> ex) {
    ex->respond(200, registry_.render(), std::string(metrics::Registry::kContentType));
  });
  route("GET", "/load", [this](const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
    ex->respond(200, api::to_json(engine_.load(), api::load_since_step(req.target)));
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
  route("GET", "/admin/expert_placement",
        [this](const net::HttpRequest&, std::shared_ptr<net::Exchange> ex) {
          const auto current = engine_.expert_placement();
          const auto status = engine_.expert_remap_status();
          if (!current || !status) {
            ex->respond(404,
                        api::openai_error_body("this engine does not place experts (start it with "
                                               "--expert-parallel N)",
                                               "invalid_request_error", "not_found"));
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
  route("POST", "/admin/expert_placement",
        [this](const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
          const auto status = engine_.expert_remap_status();
          if (status && status->loading) {
            ex->respond(409,
                        api::openai_error_body("a placement change is already underway; retry when "
                                               "GET /admin/expert_placement says idle"));
            return;
          }
          try {
            const placement::Placement next =
                placement::placement_from_json(req.body, "expert placement");
            engine_.change_expert_placement(next);
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
    return [this, kind](const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
      generation_.handle(kind, req, std::make_shared<net::ExchangeReply>(std::move(ex)));
    };
  };
  route("POST", "/v1/completions", generation(api::ApiKind::kCompletion));
  route("POST", "/v1/chat/completions", generation(api::ApiKind::kChat));
  route("POST", "/generate", generation(api::ApiKind::kGenerate));
  route("POST", "/tokenize",
        [this](const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
          generation_.tokenize(req, std::make_shared<net::ExchangeReply>(std::move(ex)));
        });
  route("POST", "/detokenize",
        [this](const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
          generation_.detokenize(req, std::make_shared<net::ExchangeReply>(std::move(ex)));
        });
}

void ApiServer::route(std::string method, std::string path, net::Handler handler) {
  // /health and /metrics stay open, as vLLM's do: probes and Prometheus scrapers carry no key.
  if (api_keys_.empty() || path == "/health" || path == "/metrics") {
    server_.route(std::move(method), std::move(path), std::move(handler));
    return;
  }
  server_.route(std::move(method), std::move(path),
                [this, handler = std::move(handler)](const net::HttpRequest& req,
                                                     std::shared_ptr<net::Exchange> ex) {
                  if (!api::api_key_valid(api_keys_, req)) {
                    ex->send_error(401, api::kInvalidApiKey, "invalid_request_error",
                                   "invalid_api_key");
                    return;
                  }
                  handler(req, std::move(ex));
                });
}

ApiServer::~ApiServer() {
  stop();
}

void ApiServer::start() {
  renderer_->start();
  server_.start();
}
uint16_t ApiServer::port() const {
  return server_.port();
}
void ApiServer::stop() {
  server_.stop();
  renderer_->stop();  // what it still has is written; later outputs render where they arrive
}

}  // namespace tandem::engine
