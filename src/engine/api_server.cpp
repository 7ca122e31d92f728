#include "engine/api_server.h"

#include <atomic>
#include <chrono>
#include <limits>
#include <mutex>

#include "api/error.h"
#include "api/load_report.h"
#include "api/request.h"
#include "api/response.h"
#include "net/sse.h"
#include "placement/placement_format.h"
#include "util/error.h"
#include "util/json.h"
#include "util/random_id.h"

namespace tandem::engine {
namespace {

using api::ApiError;
using api::ApiKind;
using api::ApiRequest;
using api::DisaggregationParams;
using api::ModelLimits;
using api::ResponseBuilder;
using nlohmann::json;

int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Invalid UTF-8 in generated text (a token cut mid-character is held back by the detokenizer,
// but a model may emit any bytes) is replaced rather than failing the whole response.
std::string dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}
std::string sse(const json& j) {
  return net::sse_event(dump(j));
}

// One HTTP request in flight: its choices' engine requests and the response being built.
struct Call {
  ApiRequest request;
  std::unique_ptr<ResponseBuilder> builder;
  std::shared_ptr<net::Exchange> exchange;
  std::vector<std::string> engine_ids;
  std::mutex mutex;
  bool failed = false;
  const KvTransferAgent* transfer = nullptr;  // for a prefill leg's kv_transfer_params

  void on_output(size_t index, const RequestOutput& out) {
    std::lock_guard lock(mutex);
    if (failed) return;
    if (out.finish_reason == "error") {
      failed = true;
      const std::string msg = "generation failed: " + out.error;
      if (request.stream) {
        exchange->write(net::sse_event(api::openai_error_body(msg, "server_error")));
        exchange->write(net::kSseDone);
        exchange->end();
      } else {
        exchange->send_error(out.error_status, msg,
                             out.error_status < 500 ? "invalid_request_error" : "server_error");
      }
      return;
    }
    if (!out.kv_transfer_id.empty()) kv_transfer_params = prefill_answer(out);
    auto chunks = builder->on_output(index, out);
    if (request.stream) {
      for (const auto& c : chunks) exchange->write(sse(c));
      if (builder->all_finished()) {
        if (auto usage = builder->usage_chunk()) exchange->write(sse(*usage));
        exchange->write(net::kSseDone);
        exchange->end();
      }
    } else if (builder->all_finished()) {
      json body = builder->final_body();
      if (!kv_transfer_params.is_null()) body["kv_transfer_params"] = kv_transfer_params;
      exchange->respond(200, dump(body));
    }
  }

  // What a decode engine needs to pull this prefill's KV.
  json prefill_answer(const RequestOutput& out) const {
    return api::kv_transfer_params({transfer->config().engine_id, transfer->config().advertise_host,
                                    transfer->port(), out.kv_transfer_id, out.kv_blocks,
                                    request.prompts.at(0)});
  }
  json kv_transfer_params;
};

// Turns the request's disaggregation fields into the engine's transfer mode for this engine's
// role. Throws ApiError for a leg this role does not serve.
KvTransferSpec transfer_spec(const DisaggregationParams& d, EngineRole role) {
  KvTransferSpec t;
  using Mode = KvTransferSpec::Mode;
  if (d.remote_decode) {
    if (role == EngineRole::kDecode)
      throw ApiError{400,
                     "this engine runs with --role decode: send prefill legs "
                     "(do_remote_decode) to a prefill engine",
                     "kv_transfer_params"};
    t.mode = Mode::kPrefillForPull;
  } else if (d.remote_prefill) {
    if (role == EngineRole::kPrefill)
      throw ApiError{400,
                     "this engine runs with --role prefill: send decode legs "
                     "(do_remote_prefill) to a decode engine",
                     "kv_transfer_params"};
    t.mode = Mode::kDecodeByPull;
    t.host = d.remote_host;
    t.port = static_cast<uint16_t>(d.remote_port);
    t.engine_id = d.remote_engine_id;
    t.transfer_id = d.remote_request_id;
    t.remote_blocks = d.remote_block_ids;
  } else if (d.has_bootstrap && role != EngineRole::kBoth) {
    // SGLang sends the same body to both legs; the engine's role says which leg this is. An
    // engine with both roles serves the request alone.
    t.room = d.bootstrap_room;
    if (role == EngineRole::kPrefill) {
      t.mode = Mode::kPrefillForRoom;
    } else {
      if (d.bootstrap_host.empty() || d.bootstrap_port == 0)
        throw ApiError{400, "a decode leg needs bootstrap_host and bootstrap_port",
                       "bootstrap_host"};
      t.mode = Mode::kDecodeByRoom;
      t.host = d.bootstrap_host;
      t.port = static_cast<uint16_t>(d.bootstrap_port);
    }
  }
  return t;
}

}  // namespace

ApiServer::ApiServer(Engine& engine, metrics::Registry& registry, net::HttpServerOptions options)
    : engine_(engine),
      registry_(registry),
      server_([&] {
        options.error_response = api::openai_error_response;
        return std::move(options);
      }()),
      created_(unix_seconds()) {
  if (!engine_.tokenizer().chat_template().empty())
    chat_template_.emplace(engine_.tokenizer().chat_template());
  const ExecutorInfo& info = engine_.executor_info();

  server_.route("GET", "/health",
                [this](const net::HttpRequest&, std::shared_ptr<net::Exchange> ex) {
                  if (auto why = engine_.executor_failure(); !why.empty()) {
                    ex->respond(503, api::openai_error_body(why, "server_error"));
                    return;
                  }
                  ex->respond(200, "", "text/plain");
                });
  server_.route("GET", "/v1/models",
                [this, info](const net::HttpRequest&, std::shared_ptr<net::Exchange> ex) {
                  json model = {{"id", info.model_name},
                                {"object", "model"},
                                {"created", created_},
                                {"owned_by", "tandem"},
                                {"root", info.model_name},
                                {"parent", nullptr},
                                {"max_model_len", info.max_model_len}};
                  ex->respond(200, json{{"object", "list"}, {"data", json::array({model})}}.dump());
                });
  server_.route(
      "GET", "/metrics", [this](const net::HttpRequest&, std::shared_ptr<net::Exchange> ex) {
        ex->respond(200, registry_.render(), std::string(metrics::Registry::kContentType));
      });
  server_.route("GET", "/load", [this](const net::HttpRequest&, std::shared_ptr<net::Exchange> ex) {
    ex->respond(200, api::to_json(engine_.load()));
  });
  server_.route(
      "GET", "/expert_load", [this](const net::HttpRequest&, std::shared_ptr<net::Exchange> ex) {
        if (auto load = engine_.expert_load()) {
          ex->respond(200, load->to_json().dump());
          return;
        }
        ex->respond(404, api::openai_error_body("this engine's executor reports no expert routing "
                                                "(a model without MoE layers)",
                                                "invalid_request_error", "not_found"));
      });
  // Where experts live (expert-parallel engines) and live changes of it.
  server_.route("GET", "/admin/expert_placement",
                [this](const net::HttpRequest&, std::shared_ptr<net::Exchange> ex) {
                  const auto current = engine_.expert_placement();
                  const auto status = engine_.expert_remap_status();
                  if (!current || !status) {
                    ex->respond(404, api::openai_error_body(
                                         "this engine does not place experts (start it with "
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
  server_.route("POST", "/admin/expert_placement",
                [this](const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
                  const auto status = engine_.expert_remap_status();
                  if (status && status->loading) {
                    ex->respond(409, api::openai_error_body(
                                         "a placement change is already underway; retry when "
                                         "GET /admin/expert_placement says idle"));
                    return;
                  }
                  try {
                    const placement::Placement next =
                        placement::placement_from_json(req.body, "expert placement");
                    engine_.change_expert_placement(next);
                  } catch (const std::exception& e) {
                    ex->respond(400, api::openai_error_body(e.what()));
                    return;
                  }
                  ex->respond(202, json{{"state", "loading"}}.dump());
                });
  auto generation = [this](int kind) {
    return [this, kind](const net::HttpRequest& req, std::shared_ptr<net::Exchange> ex) {
      handle_generation(kind, req, std::move(ex));
    };
  };
  server_.route("POST", "/v1/completions", generation(int(ApiKind::kCompletion)));
  server_.route("POST", "/v1/chat/completions", generation(int(ApiKind::kChat)));
  server_.route("POST", "/generate", generation(int(ApiKind::kGenerate)));
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

// A decode leg refused before it could pull (a bad field, a role mismatch, a full engine) would
// strand the prefill engine's blocks until its timeout: tell the prefill engine to let go now.
void ApiServer::release_refused_decode_leg(const json& body) {
  if (!body.is_object()) return;
  DisaggregationParams d;
  try {
    // Any token ids will do: only the transfer's name is needed.
    d = api::parse_disaggregation(body, std::numeric_limits<int64_t>::max());
  } catch (const ApiError&) {
    return;  // not enough to name the transfer: the prefill engine's timeout frees it
  }
  if (!d.remote_prefill) return;
  engine_.release_remote_kv(d.remote_host, static_cast<uint16_t>(d.remote_port), d.remote_engine_id,
                            d.remote_request_id, d.remote_block_ids);
}

void ApiServer::handle_generation(int kind_value, const net::HttpRequest& req,
                                  std::shared_ptr<net::Exchange> ex) {
  const auto kind = static_cast<ApiKind>(kind_value);
  const ExecutorInfo& info = engine_.executor_info();
  const ModelLimits limits{info.model_name, info.max_model_len, info.vocab_size};
  auto call = std::make_shared<Call>();
  KvTransferSpec kv_transfer;
  json body;
  try {
    body = parse_untrusted_json(req.body);
    switch (kind) {
      case ApiKind::kCompletion:
        call->request = api::parse_completion(body, engine_.tokenizer(), limits);
        break;
      case ApiKind::kChat:
        call->request = api::parse_chat(body, engine_.tokenizer(),
                                        chat_template_ ? &*chat_template_ : nullptr, limits);
        break;
      case ApiKind::kGenerate:
        call->request = api::parse_generate(body, engine_.tokenizer(), limits);
        break;
    }
    kv_transfer = transfer_spec(call->request.disagg, engine_.role());
    if (kv_transfer.prefill()) {
      // The prefill leg computes the prompt and its first token only.
      call->request.sampling.max_tokens = 1;
    }
    // A pull-prefill leg's answer carries kv_transfer_params, which only a whole JSON body has
    // (vLLM's proxy sends these legs with stream false anyway).
    if (kv_transfer.mode == KvTransferSpec::Mode::kPrefillForPull) call->request.stream = false;
  } catch (const ApiError& e) {
    release_refused_decode_leg(body);
    ex->send_error(e.status, e.message, e.type);
    return;
  } catch (const Error& e) {
    release_refused_decode_leg(body);
    ex->send_error(400, e.what());
    return;
  }
  call->transfer = engine_.transfer();
  std::string id = req.headers.get("x-request-id");
  if (id.empty()) id = std::string(api::response_id_prefix(kind)) + random_hex(2);
  call->builder =
      std::make_unique<ResponseBuilder>(call->request, engine_.tokenizer(), id, unix_seconds());
  call->exchange = ex;
  // Engine ids are ours and unique, whatever id the client chose.
  const std::string base = random_hex(2);
  const auto& prompts = call->request.prompts;
  for (size_t i = 0; i < prompts.size(); ++i)
    call->engine_ids.push_back(base + "-" + std::to_string(i));
  if (call->request.stream) ex->start_stream(200, "text/event-stream");
  for (size_t i = 0; i < prompts.size(); ++i) {
    EngineRequest er;
    er.id = call->engine_ids[i];
    er.prompt = prompts[i];
    er.sampling = call->request.sampling;
    if (er.sampling.seed && i > 0) er.sampling.seed = *er.sampling.seed + i;
    er.priority = call->request.priority;
    er.logprobs = call->request.logprobs;
    er.kv_transfer = kv_transfer;
    er.on_output = [call, i, renderer = renderer_](const RequestOutput& out) {
      renderer->post([call, i, out] { call->on_output(i, out); });
    };
    try {
      engine_.submit(std::move(er));
    } catch (const Error& e) {
      release_refused_decode_leg(body);
      for (size_t k = 0; k < i; ++k) engine_.abort(call->engine_ids[k]);
      std::lock_guard lock(call->mutex);
      call->failed = true;
      if (call->request.stream) {
        ex->write(net::sse_event(api::openai_error_body(e.what())));
        ex->write(net::kSseDone);
        ex->end();
      } else {
        ex->send_error(400, e.what());
      }
      return;
    }
  }
  Engine* engine = &engine_;
  ex->on_close([engine, ids = call->engine_ids] {
    for (const auto& id : ids) engine->abort(id);
  });
}

}  // namespace tandem::engine
