#include "gateway/choice_fan_out.h"

#include <algorithm>
#include <optional>

#include "api/body_fields.h"
#include "api/error.h"
#include "gateway/answer_text.h"

namespace tandem::gateway {

using nlohmann::json;

namespace {

size_t skip_space(std::string_view s, size_t at) {
  while (at < s.size() && (s[at] == ' ' || s[at] == '\t' || s[at] == '\n' || s[at] == '\r')) ++at;
  return at;
}

// A "prompt" key whose value is a list of strings or of lists (several prompts), as the bytes
// look: a false yes costs a parse, no request that has one is missed.
bool may_hold_prompt_list(std::string_view body) {
  constexpr std::string_view kKey = "\"prompt\"";
  for (size_t at = body.find(kKey); at != std::string_view::npos; at = body.find(kKey, at + 1)) {
    size_t i = skip_space(body, at + kKey.size());
    if (i >= body.size() || body[i] != ':') continue;
    i = skip_space(body, i + 1);
    if (i >= body.size() || body[i] != '[') continue;
    i = skip_space(body, i + 1);
    if (i < body.size() && (body[i] == '"' || body[i] == '[')) return true;
  }
  return false;
}

// The answer id of choice i's request without the "-i" its request id ends with (the front end
// names the choices' requests so): the id of the request the client sent.
std::string request_answer_id(std::string id, size_t i) {
  std::string tail = "-";  // appended, not "-" + ...: GCC 12 warns (-Wrestrict) about that
  tail += std::to_string(i);
  if (id.size() > tail.size() && id.compare(id.size() - tail.size(), tail.size(), tail) == 0)
    id.resize(id.size() - tail.size());
  return id;
}

int64_t count_of(const json& usage, const char* key) {
  const auto it = usage.find(key);
  return it != usage.end() && it->is_number_integer() ? it->get<int64_t>() : 0;
}

// Adds the whole numbers of `from` into `into`, field by field and through nested objects (the
// details an engine reports: cached, reasoning tokens); other values stay as they came first.
void sum_into(json& into, const json& from) {
  for (auto it = from.begin(); it != from.end(); ++it) {
    json& slot = into[it.key()];
    if (it->is_number_integer() && (slot.is_null() || slot.is_number_integer())) {
      slot = (slot.is_null() ? 0 : slot.get<int64_t>()) + it->get<int64_t>();
    } else if (it->is_object() && (slot.is_null() || slot.is_object())) {
      if (slot.is_null()) slot = json::object();
      sum_into(slot, *it);
    } else if (slot.is_null()) {
      slot = *it;
    }
  }
}

}  // namespace

bool may_ask_several_choices(std::string_view body) {
  return body.find("\"n\"") != std::string_view::npos || may_hold_prompt_list(body);
}

ChoiceRequests split_choices(std::string_view path, const json& body, std::string_view text) {
  ChoiceRequests out;
  const bool chat = path.ends_with("/chat/completions");
  const bool completions = !chat && path.ends_with("/completions");
  if ((!chat && !completions) || !body.is_object()) return out;
  int64_t n = 1;
  if (const auto it = body.find("n"); it != body.end() && !it->is_null()) {
    const auto v = api::whole_number_value(*it);
    if (!v || *v < 1 || *v > int64_t(kMaxFanOut)) return out;  // the engine names the field
    n = *v;
  }
  if (const auto it = body.find("best_of"); it != body.end() && !it->is_null())
    if (chat || api::whole_number_value(*it) != n) return out;  // not a chat parameter
  const json* prompts = nullptr;
  if (completions)
    if (const auto it = body.find("prompt"); it != body.end() && it->is_array() && it->size() > 1 &&
                                             ((*it)[0].is_string() || (*it)[0].is_array()))
      prompts = &*it;
  // n choices of each prompt, prompt-major: choice k answers prompt k / n (OpenAI's and vLLM's
  // order, and an engine's).
  const size_t per_prompt = static_cast<size_t>(n);
  const size_t prompt_count = prompts ? prompts->size() : 1;
  if (prompt_count > kMaxFanOut)  // before multiplying: a body may list millions
    throw api::ApiError{400,
                        "at most " + std::to_string(kMaxFanOut) +
                            " prompts in one request in the prefill-decode modes, got " +
                            std::to_string(prompt_count),
                        "prompt"};
  const size_t count = prompt_count * per_prompt;
  if (count <= 1) return out;
  if (count > kMaxFanOut)
    throw api::ApiError{400,
                        "at most " + std::to_string(kMaxFanOut) +
                            " choices in one request in the prefill-decode modes, got " +
                            std::to_string(count) + " ('n' " + std::to_string(n) + " times " +
                            std::to_string(prompt_count) + " prompts)",
                        "n"};
  // As the engine reads it (an int64, 42.0 as 42, seeding an unsigned 64-bit number); another
  // value stays in every choice's body for the engine to refuse.
  std::optional<uint64_t> seed;
  if (const auto it = body.find("seed"); it != body.end())
    if (const auto value = api::whole_number_value(*it)) seed = static_cast<uint64_t>(*value);
  json base = json::object();
  for (const auto& [key, value] : body.items())
    if (key != "n" && key != "best_of" && !(prompts && key == "prompt") && !(seed && key == "seed"))
      base[key] = value;
  // What every choice's body holds, in the client's key order; each adds its prompt and seed.
  const std::string base_text = dump_in_client_order(base, text);
  // Every choice carries the whole body (and each is parsed, held and sent again): 128 copies
  // of an 8 MB body took gigabytes and seconds of an io thread.
  if (const size_t bytes = base_text.size(); bytes * count > kMaxFanOutBytes)
    throw api::ApiError{400,
                        "this request would fan out to " + std::to_string(count) + " bodies of " +
                            std::to_string(bytes) + " bytes, more than " +
                            std::to_string(kMaxFanOutBytes >> 20) +
                            " MiB in all; send fewer choices or a smaller body",
                        prompts ? "prompt" : "n"};
  for (size_t i = 0; i < count; ++i) {
    std::string members;
    if (prompts) members = "\"prompt\":" + (*prompts)[i / per_prompt].dump();
    if (seed) {
      if (!members.empty()) members += ',';
      // As the engine seeds choices: each prompt of a list from the request's seed (vLLM). Written
      // as the int64 of the same 64 bits (seed -3's choice 1 is -2, INT64_MAX's is INT64_MIN):
      // the engine takes a seed within int64 only.
      const size_t choice = i % per_prompt;
      members += "\"seed\":" + (choice == 0 ? body.at("seed").dump()
                                            : std::to_string(static_cast<int64_t>(*seed + choice)));
    }
    out.bodies.push_back(members.empty() ? base_text : splice_fields(base_text, members));
  }
  out.repeats = per_prompt;
  return out;
}

// ------------------------------------------------------------------------------ merging

class ChoiceMerger::Part final : public net::Reply {
 public:
  Part(std::shared_ptr<ChoiceMerger> merger, size_t i) : merger_(std::move(merger)), i_(i) {}
  bool respond(int status, std::string body, std::string content_type) override {
    return merger_->respond(i_, status, std::move(body), std::move(content_type));
  }
  // A refusal's header fields (the gateway's or an engine's Retry-After) reach the client too.
  bool respond_with_headers(net::HttpResponse response) override {
    return merger_->respond(i_, response.status, std::move(response.body),
                            std::move(response.content_type), std::move(response.headers));
  }
  bool send_error(int status, std::string_view message, std::string_view type,
                  std::string_view code) override {
    return respond(status,
                   api::openai_error_body(
                       message, type.empty() ? api::default_error_type(status) : type, code),
                   "application/json");
  }
  bool start_stream(int status, std::string content_type) override {
    return merger_->start_stream(i_, status, std::move(content_type));
  }
  bool write(std::string_view chunk) override { return merger_->write(i_, chunk); }
  bool end() override { return merger_->end(i_); }
  void abort() override { merger_->abort(i_); }
  void on_close(std::function<void()> callback) override {
    merger_->on_close(i_, std::move(callback));
  }

 private:
  std::shared_ptr<ChoiceMerger> merger_;
  size_t i_;
};

std::shared_ptr<ChoiceMerger> ChoiceMerger::create(std::shared_ptr<net::Reply> client,
                                                   size_t choices, size_t repeats) {
  std::shared_ptr<ChoiceMerger> m(new ChoiceMerger(std::move(client), choices, repeats));
  std::weak_ptr<ChoiceMerger> weak = m;
  m->client_->on_close([weak] {
    if (auto merger = weak.lock()) merger->client_gone();
  });
  return m;
}

ChoiceMerger::ChoiceMerger(std::shared_ptr<net::Reply> client, size_t choices, size_t repeats)
    : client_(std::move(client)), parts_(choices), repeats_(repeats > 0 ? repeats : 1) {}

std::shared_ptr<net::Reply> ChoiceMerger::reply(size_t i) {
  return std::make_shared<Part>(shared_from_this(), i);
}

bool ChoiceMerger::ended() const {
  std::lock_guard lock(mutex_);
  return outcome_ != Outcome::kOpen;
}

bool ChoiceMerger::all_done() const {
  for (const auto& p : parts_)
    if (p.state != PartState::kDone) return false;
  return true;
}

namespace {

void run(std::vector<std::function<void()>>& callbacks) {
  for (auto& f : callbacks) f();
}

}  // namespace

bool ChoiceMerger::respond(size_t i, int status, std::string body, std::string content_type,
                           net::Headers headers) {
  std::vector<std::function<void()>> later, dropped;
  {
    std::lock_guard lock(mutex_);
    PartData& p = parts_.at(i);
    if (outcome_ != Outcome::kOpen || p.state != PartState::kWaiting) return false;
    if (status == 200 && started_) {  // the others stream: a whole body cannot join them
      status = 502;
      body = api::openai_error_body("an engine answered a streamed choice with a whole body",
                                    "server_error");
    }
    if (status != 200) {
      later = fail(i, status, std::move(body), std::move(content_type), std::move(headers));
    } else {
      p.state = PartState::kDone;
      p.body = std::move(body);
      if (all_done()) {
        outcome_ = Outcome::kComplete;
        dropped = drop_callbacks();
        std::string merged = merged_body();
        if (merged.empty())
          client_->send_error(502, "an engine's answer to one of the choices is not a completion",
                              "server_error");
        else
          client_->respond(200, std::move(merged), "application/json");
      }
    }
  }
  run(later);
  return true;
}

bool ChoiceMerger::start_stream(size_t i, int status, std::string content_type) {
  std::vector<std::function<void()>> later;
  bool streaming = false;
  {
    std::lock_guard lock(mutex_);
    PartData& p = parts_.at(i);
    if (outcome_ != Outcome::kOpen || p.state != PartState::kWaiting) return false;
    const auto whole = std::find_if(parts_.begin(), parts_.end(),
                                    [](const PartData& q) { return q.state == PartState::kDone; });
    if (!started_ && whole != parts_.end()) {
      // A choice answered whole cannot join a stream (as respond() refuses the converse): the
      // answer would lack it, silently.
      const size_t k = static_cast<size_t>(whole - parts_.begin());
      later = fail(k, 502,
                   api::openai_error_body("an engine answered choice " + std::to_string(k) +
                                              " of a streamed request with a whole body",
                                          "server_error"),
                   "application/json");
    } else {
      p.state = PartState::kStreaming;
      streaming = true;
      if (!started_) {
        started_ = true;
        client_->start_stream(status, std::move(content_type));
      }
    }
  }
  run(later);
  return streaming;
}

bool ChoiceMerger::write(size_t i, std::string_view chunk) {
  std::vector<std::function<void()>> later;
  {
    std::lock_guard lock(mutex_);
    PartData& p = parts_.at(i);
    if (outcome_ != Outcome::kOpen || p.state != PartState::kStreaming) return false;
    p.parser.feed(chunk, [&](std::string_view data) {
      if (outcome_ == Outcome::kOpen) forward_event(i, data, later);
    });
  }
  run(later);
  return true;
}

void ChoiceMerger::forward_event(size_t i, std::string_view data,
                                 std::vector<std::function<void()>>& later) {
  PartData& p = parts_[i];
  if (net::SseParser::is_done(data)) {
    p.saw_done = true;
    return;
  }
  json event = json::parse(data, nullptr, false);
  if (!event.is_object()) {
    client_->write(net::sse_event(data));
    return;
  }
  if (event.contains("error")) {  // this choice failed mid-stream: so did the answer
    end_with_error(std::string(data));
    // As its own request's relay records it: the client's error (or a refusal) with its status,
    // else the engine's failure.
    const int status = error_event_status(data);
    abandon(i, status > 0 ? status : 502);
    // Nothing more of it is taken (its [DONE] neither): its engine may go on sending, and what
    // comes after its error is no part of the answer. Its relay records it as its error says.
    p.state = PartState::kFailed;
    later = take_callbacks(i);
    return;
  }
  const auto choices = event.find("choices");
  if (choices != event.end() && choices->is_array() && choices->empty()) {
    // A usage chunk: the merged one goes last, before [DONE].
    if (const auto u = event.find("usage"); u != event.end() && u->is_object()) {
      add_usage(*u);
      usage_seen_ = true;
    }
    return;
  }
  if (choices != event.end() && choices->is_array())
    for (auto& c : *choices)
      if (c.is_object()) c["index"] = i;
  if (const auto id = event.find("id"); id != event.end() && id->is_string()) {
    if (id_.empty()) id_ = request_answer_id(id->get<std::string>(), i);
    *id = id_;
    if (!chunk_template_.is_object()) chunk_template_ = event;
  }
  client_->write(net::sse_event(event.dump()));
}

bool ChoiceMerger::end(size_t i) {
  std::vector<std::function<void()>> later, dropped;
  {
    std::lock_guard lock(mutex_);
    PartData& p = parts_.at(i);
    if (outcome_ != Outcome::kOpen || p.state != PartState::kStreaming) return false;
    p.state = p.saw_done ? PartState::kDone : PartState::kFailed;
    if (!p.saw_done) {  // cut without its [DONE]: the client must not take the rest for all
      end_with_error(api::openai_error_body(
          "the answer was cut: choice " + std::to_string(i) + " ended without its end",
          "server_error"));
      abandon(i, 502);
      later = take_callbacks(i);
    } else if (all_done()) {
      outcome_ = Outcome::kComplete;
      dropped = drop_callbacks();
      if (usage_seen_) {
        json u = chunk_template_.is_object() ? chunk_template_ : json::object();
        u["choices"] = json::array();
        u["usage"] = merged_usage();
        client_->write(net::sse_event(u.dump()));
      }
      client_->write(net::kSseDone);
      client_->end();
    }
  }
  run(later);
  return true;
}

void ChoiceMerger::abort(size_t i) {
  std::vector<std::function<void()>> later;
  {
    std::lock_guard lock(mutex_);
    if (outcome_ != Outcome::kOpen) return;
    abandon(i, 502);
    client_->abort();
    later = take_callbacks(i);
  }
  run(later);
}

void ChoiceMerger::on_close(size_t i, std::function<void()> callback) {
  {
    std::lock_guard lock(mutex_);
    if (outcome_ == Outcome::kOpen) {
      if (callback) parts_.at(i).on_close.push_back(std::move(callback));
      return;
    }
    if (outcome_ == Outcome::kComplete) return;  // dropped after the lock: nothing to let go
  }
  if (callback) callback();  // the answer already failed or the client left: not wanted
}

void ChoiceMerger::client_gone() {
  std::vector<std::function<void()>> later;
  {
    std::lock_guard lock(mutex_);
    if (outcome_ != Outcome::kOpen) return;
    outcome_ = Outcome::kAbandoned;
    later = take_callbacks(parts_.size());
  }
  run(later);
}

std::vector<std::function<void()>> ChoiceMerger::fail(size_t i, int status, std::string body,
                                                      std::string content_type,
                                                      net::Headers headers) {
  abandon(i, status);
  parts_[i].state = PartState::kFailed;
  if (!started_ && headers.empty()) {
    client_->respond(status, std::move(body), std::move(content_type));
  } else if (!started_) {
    client_->respond_with_headers(
        net::HttpResponse{status, std::move(content_type), std::move(body), std::move(headers)});
  } else {  // the client has a 200 and some choices: the stream's last event says what failed
    end_with_error(api::openai_error_body("choice " + std::to_string(i) + " failed: " +
                                              api::openai_error_message(body).value_or(body),
                                          "server_error"));
  }
  return take_callbacks(i);
}

void ChoiceMerger::end_with_error(const std::string& error) {
  client_->write(net::sse_event(error));
  client_->write(net::kSseDone);
  client_->end();
}

void ChoiceMerger::abandon(size_t i, int status) {
  outcome_ = Outcome::kAbandoned;
  failure_ = Failure{status, i};
}

std::optional<ChoiceMerger::Failure> ChoiceMerger::failure() const {
  std::lock_guard lock(mutex_);
  return failure_;
}

std::vector<std::function<void()>> ChoiceMerger::take_callbacks(size_t except) {
  std::vector<std::function<void()>> out;
  for (size_t k = 0; k < parts_.size(); ++k) {
    PartData& p = parts_[k];
    const bool unfinished = p.state == PartState::kWaiting || p.state == PartState::kStreaming;
    if (k != except && unfinished)
      for (auto& f : p.on_close) out.push_back(std::move(f));
    p.on_close.clear();
  }
  return out;
}

std::vector<std::function<void()>> ChoiceMerger::drop_callbacks() {
  std::vector<std::function<void()>> out;
  for (auto& p : parts_) {
    for (auto& f : p.on_close) out.push_back(std::move(f));
    p.on_close.clear();
  }
  return out;
}

void ChoiceMerger::add_usage(const json& usage) {
  sum_into(usage_, usage);
}

json ChoiceMerger::merged_usage() const {
  // Each of the n choices of one prompt counted it (and its cached part); the client sent it once.
  const auto r = static_cast<int64_t>(repeats_);
  json u = usage_;
  const int64_t prompt = count_of(u, "prompt_tokens") / r;
  const int64_t completion = count_of(u, "completion_tokens");
  u["prompt_tokens"] = prompt;
  u["completion_tokens"] = completion;
  u["total_tokens"] = prompt + completion;
  if (const auto d = u.find("prompt_tokens_details"); d != u.end() && d->is_object())
    for (auto& v : *d)
      if (v.is_number_integer()) v = v.get<int64_t>() / r;
  return u;
}

std::string ChoiceMerger::merged_body() {
  json out;
  for (size_t i = 0; i < parts_.size(); ++i) {
    json b = json::parse(parts_[i].body, nullptr, false);
    if (!b.is_object()) return {};
    const auto choices = b.find("choices");
    if (choices == b.end() || !choices->is_array()) return {};
    if (i == 0) {
      out = b;
      out["choices"] = json::array();
      if (const auto id = out.find("id"); id != out.end() && id->is_string())
        *id = request_answer_id(id->get<std::string>(), 0);
    }
    for (auto& c : *choices) {
      if (c.is_object()) c["index"] = i;
      out["choices"].push_back(std::move(c));
    }
    if (const auto u = b.find("usage"); u != b.end() && u->is_object()) add_usage(*u);
  }
  out["usage"] = merged_usage();
  return out.dump();
}

}  // namespace tandem::gateway
