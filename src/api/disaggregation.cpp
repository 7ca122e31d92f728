#include "api/disaggregation.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>

#include "api/body_fields.h"
#include "api/error.h"
#include "util/error.h"
#include "util/json.h"

namespace tandem::api {
namespace {

using nlohmann::json;

constexpr const char* kKvTransferParams = "kv_transfer_params";
constexpr const char* kBootstrapHost = "bootstrap_host";
constexpr const char* kBootstrapPort = "bootstrap_port";
constexpr const char* kBootstrapRoom = "bootstrap_room";

uint64_t unsigned_value(const json& v, const char* name) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return uint64_t(v.get<int64_t>());
  if (v.is_string()) {
    const std::string t = v.get<std::string>();
    if (!t.empty() && t.size() <= 20 && std::all_of(t.begin(), t.end(), ::isdigit)) {
      errno = 0;
      char* end = nullptr;
      const unsigned long long x = std::strtoull(t.c_str(), &end, 10);
      if (errno == 0 && *end == 0) return x;
    }
  }
  if (v.is_array())
    fail(name, std::string("'") + name +
                   "' as a list (batched requests) is not supported: send one request per prompt");
  fail(name, std::string("'") + name + "' must be a non-negative integer (or its decimal string)");
}

json prompt_logprobs_json(const std::vector<TokenLogprob>& lps) {
  json out = json::array();
  for (const TokenLogprob& lp : lps) {
    json top = json::array();
    for (const auto& [id, v] : lp.top) top.push_back(json::array({id, wire_logprob(v)}));
    out.push_back(json::array({lp.token, wire_logprob(lp.logprob), lp.rank, std::move(top)}));
  }
  return out;
}

std::vector<TokenLogprob> prompt_logprobs_from(const json& v, int64_t vocab_size) {
  const std::string what = std::string(kKvTransferParams) + ".prompt_logprobs";
  auto bad = [&](const std::string& why) { fail(kKvTransferParams, what + " " + why); };
  auto id = [&](const json& t) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= vocab_size)
      bad("holds a token id outside the vocabulary");
    return t.get<int32_t>();
  };
  auto logprob = [&](const json& x) {
    if (!x.is_number() || !std::isfinite(x.get<double>()) || x.get<double>() > 0)
      bad("holds a logprob that is not a number <= 0");
    return static_cast<float>(x.get<double>());
  };
  if (!v.is_array()) bad("must be a list of [token, logprob, rank, top] entries");
  std::vector<TokenLogprob> out;
  out.reserve(v.size());
  for (const json& e : v) {
    if (!e.is_array() || e.size() != 4 || !e[2].is_number_integer() || e[2].get<int64_t>() < 1 ||
        e[2].get<int64_t>() > INT32_MAX || !e[3].is_array() || e[3].size() > 20)
      bad("must be a list of [token, logprob, rank >= 1, at most 20 [id, logprob] pairs]");
    TokenLogprob& lp = out.emplace_back();
    lp.token = id(e[0]);
    lp.logprob = logprob(e[1]);
    lp.rank = e[2].get<int32_t>();
    for (const json& pair : e[3]) {
      if (!pair.is_array() || pair.size() != 2)
        bad("holds an alternative that is not [id, logprob]");
      lp.top.emplace_back(id(pair[0]), logprob(pair[1]));
    }
  }
  return out;
}

void parse_pull(const json& kv, DisaggregationParams& d, int64_t vocab_size) {
  auto text = [&](const char* name) {
    const json* v = field(kv, name);
    if (!v || !v->is_string())
      fail(kKvTransferParams, std::string("kv_transfer_params.") + name +
                                  " must be a string (the prefill engine's answer)");
    return v->get<std::string>();
  };
  d.remote_host = text("remote_host");
  d.remote_engine_id = text("remote_engine_id");
  d.remote_request_id = text("remote_request_id");
  const json* port = field(kv, "remote_port");
  if (!port || !port->is_number_integer() || port->get<int64_t>() < 1 ||
      port->get<int64_t>() > 65535)
    fail(kKvTransferParams, "kv_transfer_params.remote_port must be a port number");
  d.remote_port = port->get<int64_t>();
  const json* blocks = field(kv, "remote_block_ids");
  if (!blocks || !blocks->is_array() ||
      !std::all_of(blocks->begin(), blocks->end(),
                   [](const json& b) { return b.is_number_integer(); }))
    fail(kKvTransferParams, "kv_transfer_params.remote_block_ids must be a list of ints");
  for (const auto& b : *blocks) {
    const int64_t v = b.get<int64_t>();
    if (v < 0 || v > INT32_MAX)
      fail(kKvTransferParams, "kv_transfer_params.remote_block_ids holds an invalid id");
    d.remote_block_ids.push_back(static_cast<int32_t>(v));
  }
  if (const json* ids = field(kv, "prompt_token_ids")) {
    if (!is_token_list(*ids))
      fail(kKvTransferParams, "kv_transfer_params.prompt_token_ids must be a token list");
    d.prompt_token_ids = token_list(*ids, kKvTransferParams, vocab_size);
  }
  if (const json* lps = field(kv, "prompt_logprobs"))
    d.prompt_logprobs = prompt_logprobs_from(*lps, vocab_size);
}

}  // namespace

DisaggregationParams parse_disaggregation(const json& body, int64_t vocab_size) {
  DisaggregationParams d;
  if (const json* kv = field(body, kKvTransferParams)) {
    if (!kv->is_object()) fail(kKvTransferParams, "'kv_transfer_params' must be an object");
    d.remote_decode = boolean(*kv, "do_remote_decode", false);
    d.remote_prefill = boolean(*kv, "do_remote_prefill", false);
    if (d.remote_decode && d.remote_prefill)
      fail(kKvTransferParams,
           "'kv_transfer_params' cannot ask for both do_remote_decode and do_remote_prefill");
    if (d.remote_prefill) parse_pull(*kv, d, vocab_size);
  }
  if (const json* room = field(body, kBootstrapRoom)) {
    d.has_bootstrap = true;
    d.bootstrap_room = unsigned_value(*room, kBootstrapRoom);
    if (const json* host = field(body, kBootstrapHost)) {
      if (!host->is_string()) fail(kBootstrapHost, "'bootstrap_host' must be a string");
      d.bootstrap_host = host->get<std::string>();
    }
    if (const json* port = field(body, kBootstrapPort)) {
      const uint64_t p = unsigned_value(*port, kBootstrapPort);
      if (p < 1 || p > 65535) fail(kBootstrapPort, "'bootstrap_port' must be a port number");
      d.bootstrap_port = static_cast<int64_t>(p);
    }
  }
  return d;
}

json kv_transfer_params(const PulledKv& kv) {
  json params = {{"do_remote_prefill", true},
                 {"do_remote_decode", false},
                 {"remote_engine_id", kv.engine_id},
                 {"remote_block_ids", kv.blocks},
                 {"remote_host", kv.host},
                 {"remote_port", kv.port},
                 {"remote_request_id", kv.transfer_id},
                 {"tp_size", 1},
                 {"prompt_token_ids", kv.prompt_ids}};
  if (!kv.prompt_logprobs.empty()) {
    // Larger ones would outgrow the decode leg's body (an engine takes 8 MiB by default): the
    // decode engine then computes them again.
    json lps = prompt_logprobs_json(kv.prompt_logprobs);
    if (lps.dump().size() <= kMaxCarriedPromptLogprobsBytes)
      params["prompt_logprobs"] = std::move(lps);
  }
  return params;
}

json prefill_leg_body(json body) {
  body[kKvTransferParams] = {{"do_remote_decode", true},    {"do_remote_prefill", false},
                             {"remote_engine_id", nullptr}, {"remote_block_ids", nullptr},
                             {"remote_host", nullptr},      {"remote_port", nullptr}};
  body["stream"] = false;
  body.erase("stream_options");
  body["max_tokens"] = 1;
  if (body.contains("max_completion_tokens")) body["max_completion_tokens"] = 1;
  body.erase("min_tokens");
  return body;
}

std::string kv_transfer_params_member(std::string_view prefill_answer) {
  json answer;
  try {
    answer = parse_untrusted_json(prefill_answer);
  } catch (const Error&) {
    throw Error("the prefill answer is not JSON");
  }
  const json* kv = answer.is_object() ? field(answer, kKvTransferParams) : nullptr;
  if (!kv) throw Error("the prefill answer has no kv_transfer_params");
  return std::string("\"") + kKvTransferParams + "\":" + kv->dump();
}

std::string bootstrap_members(std::string_view host, int64_t port, uint64_t room) {
  const std::string text =
      json{{kBootstrapHost, host}, {kBootstrapPort, port}, {kBootstrapRoom, room}}.dump();
  return text.substr(1, text.size() - 2);
}

void strip_disaggregation_fields(json& body) {
  for (const char* k : {kKvTransferParams, kBootstrapHost, kBootstrapPort, kBootstrapRoom})
    body.erase(k);
}

}  // namespace tandem::api
