#include "gateway/relay.h"

#include <algorithm>
#include <cctype>
#include <optional>

#include "api/disaggregation.h"
#include "api/error.h"
#include "gateway/answer_text.h"
#include "gateway/dispatcher.h"
#include "net/sse.h"

namespace tandem::gateway {
namespace {

constexpr size_t kMaxPrefillAnswerBytes = size_t{16} << 20;
// An engine's error answer is held only as far as read_engine_error reads one (64 KiB), plus a
// byte so that a longer one still reads as longer: the rest is dropped, whatever the answer limit.
constexpr size_t kMaxErrorAnswerBytes = (size_t{64} << 10) + 1;

bool is_event_stream(int status, const net::Headers& headers) {
  return status == 200 && headers.get("Content-Type").rfind("text/event-stream", 0) == 0;
}

// The first error event of a stream's text, or empty.
std::string first_error_event(std::string_view stream) {
  std::string error;
  net::SseParser events;
  events.feed(stream, [&](std::string_view data) {
    if (error.empty() && is_error_event(data)) error = std::string(data);
  });
  return error;
}

// Statuses an engine's HTTP server answers before any application reads the request (a wrong
// API key, a body or head past its limits): a decode leg refused so never saw its KV, and its
// engine told the prefill engine nothing.
bool refused_unread(int status) {
  return status == 401 || status == 413 || status == 431;
}

bool is_chunked(std::string transfer_encoding) {
  for (char& c : transfer_encoding)
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return transfer_encoding.find("chunked") != std::string::npos;
}

bool all_digits(std::string_view text) {
  return !text.empty() &&
         std::all_of(text.begin(), text.end(), [](unsigned char c) { return std::isdigit(c); });
}

// RFC 9110's IMF-fixdate, "Sun, 06 Nov 1994 08:49:37 GMT": the HTTP-date senders must write.
bool is_imf_fixdate(std::string_view v) {
  static constexpr std::string_view kDays[] = {"Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"};
  static constexpr std::string_view kMonths[] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun",
                                                 "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};
  auto one_of = [](std::string_view word, const auto& words) {
    return std::find(std::begin(words), std::end(words), word) != std::end(words);
  };
  return v.size() == 29 && one_of(v.substr(0, 3), kDays) && v.substr(3, 2) == ", " &&
         all_digits(v.substr(5, 2)) && v[7] == ' ' && one_of(v.substr(8, 3), kMonths) &&
         v[11] == ' ' && all_digits(v.substr(12, 4)) && v[16] == ' ' &&
         all_digits(v.substr(17, 2)) && v[19] == ':' && all_digits(v.substr(20, 2)) &&
         v[22] == ':' && all_digits(v.substr(23, 2)) && v.substr(25) == " GMT";
}

// The longest wait relayed: an engine asking for more (or a number that overflows a client's
// parser) is told to the client as a day.
constexpr uint64_t kMaxRetryAfterSeconds = 86400;

// An engine's Retry-After on its refusal (429, 503), kept for the client's answer once retries are
// spent, only as the clients that honour it read it: delay-seconds (at most a day) or an
// IMF-fixdate. Anything else ("soon", "-5", "1.5") is dropped rather than relayed.
std::string retry_after_of(int status, const net::Headers& hs) {
  if (status != 429 && status != 503) return {};
  const std::string value = hs.get("Retry-After");
  if (all_digits(value)) {
    // Without its leading zeros ("007" is 7), keeping one digit of "000".
    const std::string digits =
        value.substr(std::min(value.find_first_not_of('0'), value.size() - 1));
    return digits.size() > 5 || std::stoull(digits) > kMaxRetryAfterSeconds
               ? std::to_string(kMaxRetryAfterSeconds)
               : value;
  }
  return is_imf_fixdate(value) ? value : std::string();
}

std::string size_text(size_t bytes) {
  if (bytes % (size_t{1} << 20) == 0) return std::to_string(bytes >> 20) + " MiB";
  return std::to_string(bytes) + " bytes";
}

// The leg is cut (on_body answers false) by the gateway's choice: no fault of the engine's.
bool refuse_too_large(Leg& l) {
  l.answer_too_large = true;
  l.gateway_cancelled = true;
  l.body = {};
  l.held = {};
  return false;
}

// Once a stream has begun, the event its parser holds until it ends (the first one is bounded
// apart, as it is held whole whatever its framing).
bool event_too_large(const Leg& l, size_t max_answer_bytes) {
  return l.parser.pending_bytes() > max_answer_bytes;
}

}  // namespace

net::AsyncHttpHandlers Relay::prefill_handlers(const RequestPtr& r, LegRef leg_ref, int attempt,
                                               int endpoint_id, std::string where) {
  net::AsyncHttpHandlers h;
  h.on_head = [leg_ref](int status, const net::Headers& hs) {
    if (auto l = leg_ref->lock()) {
      l->status = status;
      l->streaming = is_event_stream(status, hs);  // parallel mode, a streaming client
      l->retry_after = retry_after_of(status, hs);
    }
  };
  // Sequential: the answer carries kv_transfer_params. Both modes: its usage says what the engine
  // reused (a one-token answer: small).
  h.on_body = [leg_ref](std::string_view piece) {
    auto l = leg_ref->lock();
    if (!l) return true;
    // Cut, its kv_transfer_params would be lost: refused whole, not read as an answer without.
    if (l->body.size() + piece.size() > kMaxPrefillAnswerBytes) return refuse_too_large(*l);
    l->body += piece;
    return true;
  };
  h.on_done = [this, r, leg_ref, attempt, where = std::move(where),
               endpoint_id](const std::string& error) {
    if (auto l = leg_ref->lock()) prefill_done(r, *l, attempt, where, endpoint_id, error);
  };
  return h;
}

void Relay::prefill_done(const RequestPtr& r, Leg& l, int attempt, const std::string& where,
                         int endpoint_id, const std::string& error) {
  std::string reason;
  {
    std::lock_guard lock(r->mutex);
    l.state = LegState::kFinished;
    // A whole answer (its call ended by itself) that a cut crossed (its engine's ejection, its
    // deadline): the answer stands, as an answering leg's does (relay_done); dropped, its KV
    // would stay held on the engine with nobody to release it.
    const bool came_whole = error.empty() && l.status == 200;
    reason = l.cancel_reason.empty() || came_whole ? error : l.cancel_reason;
  }
  if (l.answer_too_large) {
    dispatcher_.answer_refused(r, attempt, 502,
                               "the prefill answer from engine " + where + " is larger than " +
                                   size_text(kMaxPrefillAnswerBytes) +
                                   ", the most this gateway holds for one",
                               "answer_too_large");
    return;
  }
  if (!reason.empty()) {
    dispatcher_.leg_failed(r, attempt, endpoint_id, 502, {},
                           "prefill engine " + where + " failed: " + reason);
    return;
  }
  // A streamed prefill (parallel mode, for a streaming client) that fails says so in an error
  // event under its 200: that is the engine's error answer as much as a non-200 one is.
  const std::string error_event = l.streaming ? first_error_event(l.body) : std::string();
  const bool failed = l.status != 200 || !error_event.empty();
  if (topo_.mode == PdMode::kParallel && failed &&
      api::openai_error_code(error_event.empty() ? l.body : error_event) ==
          api::kRoomAbandonedCode) {
    // The decode leg ended before it joined the room, and its own answer (on its way, or here
    // already) decides the attempt: failing it here would retry it without this healthy engine
    // and name it in retried_after.
    l.room_abandoned = true;
    l.body = {};
    return;
  }
  if (l.status != 200) {
    dispatcher_.leg_failed(r, attempt, endpoint_id, l.status, std::move(l.body), {},
                           Dispatcher::Blame::kItsEngine, l.retry_after);
    return;
  }
  if (!error_event.empty()) {
    l.body = {};
    // The client's error, or the engine's refusal (a rate limit), found once generation started:
    // answered as the engine's 4xx answer or its 429 is (the client's error to the client without
    // retry; a refusal retried elsewhere), and no fault of the engine's. The leg's outcome is that
    // status's (a 429: the engine is full).
    if (const int status = error_event_status(error_event); status > 0) {
      l.status = status;
      dispatcher_.leg_failed(r, attempt, endpoint_id, status, error_event, {});
      return;
    }
    l.engine_error = true;
    dispatcher_.leg_failed(r, attempt, endpoint_id, 502, {},
                           "prefill engine " + where + " failed: " +
                               api::openai_error_message(error_event).value_or(error_event));
    return;
  }
  r->times.mark_prefill_done(exec_.now_ns());
  l.cached_tokens = usage_cached_tokens(l.body);
  if (l.cached_tokens >= 0) {
    std::lock_guard lock(r->mutex);
    // A leg of an attempt given up (its answer crossed the cancel) may end after the retry
    // started: what its engine reused is no report of the retry's.
    if (attempt == r->cached_tokens_attempt) r->cached_tokens_reported = l.cached_tokens;
  }
  if (topo_.mode != PdMode::kSequential) {  // parallel: the decode leg answers
    l.body = {};
    return;
  }
  std::string params;
  try {
    params = api::kv_transfer_params_member(l.body);
  } catch (const std::exception&) {
    l.engine_error = true;
    dispatcher_.leg_failed(r, attempt, endpoint_id, 502, {},
                           "prefill engine " + where + " answered without kv_transfer_params");
    return;
  }
  dispatcher_.prefill_answered(r, attempt, endpoint_id, std::move(params));
}

net::AsyncHttpHandlers Relay::answer_handlers(const RequestPtr& r, LegRef leg_ref, int attempt,
                                              int endpoint_id, std::string where) {
  net::AsyncHttpHandlers h;
  h.on_head = [leg_ref](int status, const net::Headers& hs) {
    auto l = leg_ref->lock();
    if (!l) return;
    l->status = status;
    l->streaming = is_event_stream(status, hs);
    l->until_close = hs.get("Content-Length").empty() && !is_chunked(hs.get("Transfer-Encoding"));
    l->retry_after = retry_after_of(status, hs);
  };
  h.on_body = [this, r, leg_ref](std::string_view piece) {
    auto l = leg_ref->lock();
    return l && relay_piece(r, *l, piece);
  };
  h.on_failure = [leg_ref](net::CallFailure failure) {
    if (auto l = leg_ref->lock()) l->never_connected = failure == net::CallFailure::kNotConnected;
  };
  h.on_done = [this, r, leg_ref, attempt, where = std::move(where),
               endpoint_id](const std::string& error) {
    if (auto l = leg_ref->lock()) relay_done(r, *l, attempt, where, endpoint_id, error);
  };
  return h;
}

bool Relay::relay_piece(const RequestPtr& r, Leg& l, std::string_view piece) {
  if (!l.streaming) {
    if (l.status != 200) {  // an error answer: what it says is read from its start
      if (l.body.size() < kMaxErrorAnswerBytes)
        l.body.append(piece.substr(0, kMaxErrorAnswerBytes - l.body.size()));
      return true;
    }
    if (l.body.size() + piece.size() > topo_.max_answer_bytes) return refuse_too_large(l);
    l.body += piece;
    return true;
  }
  // Without a translator the client gets the engine's bytes as they are, once the first event
  // has shown the stream is no error; with one, the translated events. Only this thread moves
  // the leg to kRelaying, so reading its state here needs no lock.
  // In the P/D modes the usage chunk's cached_tokens become the prefill engine's (which computed
  // the prompt), so the stream goes out event by event, as a translated one does.
  const bool verbatim = !r->translator && !reports_prefill_reuse_;
  const bool started = l.state == LegState::kRelaying;
  std::string out;
  if (!verbatim) out.reserve(piece.size() + 16);
  const int64_t now = exec_.now_ns();
  int64_t token_events = 0;
  int64_t completion_tokens = -1;  // a usage chunk's (stream_options.include_usage)
  bool refused = false;            // the stream must not go on (an error first, a leg given up)
  std::string rewritten;           // an event whose usage was rewritten
  l.parser.feed(piece, [&](std::string_view data) {
    if (refused) return;
    const bool done = net::SseParser::is_done(data);
    if (done) l.stream_done = true;
    const bool error_event = is_error_event(data);
    if (l.state != LegState::kRelaying) {
      if (error_event) {  // failed before any token: the client has seen nothing
        l.body = std::string(data);
        // The client's error or the engine's refusal (relay_done answers it, as the status it
        // stands for, which is the leg's outcome too) is no fault of the engine's: the rest of
        // its stream is cut by the gateway's choice.
        if (const int status = error_event_status(data); status > 0) {
          l.status = status;
          l.gateway_cancelled = true;
        } else {
          l.engine_error = true;
        }
        refused = true;
        return;
      }
      std::lock_guard lock(r->mutex);
      // A leg the gateway gave up on (a timeout, a retry) must not start the client's stream.
      if (r->client == ClientState::kEnded || l.gateway_cancelled.load() ||
          !l.cancel_reason.empty()) {
        l.gateway_cancelled = true;
        refused = true;
        return;
      }
      l.state = LegState::kRelaying;
      r->client = ClientState::kAnswering;
      r->streamed = true;
      r->outcome.status = 200;
      r->reply->start_stream(200, "text/event-stream");
    } else if (error_event && l.body.empty()) {
      // The engine failed after the client got tokens (our engines and vLLM then send an error
      // event and [DONE]): relayed as it came, but the request failed, and so did the engine,
      // unless the error is the client's or a refusal, whose status is the leg's outcome (a 429:
      // the engine is full, neither its success nor its failure). The first error decides.
      if (const int status = error_event_status(data); status > 0)
        l.status = status;
      else
        l.engine_error = true;
      l.body = std::string(data);
    }
    if (carries_tokens(data)) {
      ++token_events;
    } else if (!done && !error_event) {  // the usage chunk: what the engine generated, and reused
      if (const int64_t tokens = usage_completion_tokens(data); tokens >= 0)
        completion_tokens = tokens;
      if (computes_prompt_) {
        const int64_t cached = usage_cached_tokens(data);
        if (cached >= 0) l.cached_tokens = cached;
      }
      if (reports_prefill_reuse_ && !error_event) {
        if (const int64_t cached = prefill_reuse(*r); cached >= 0) {
          rewritten = with_usage_cached_tokens(std::string(data), cached);
          data = rewritten;
        }
      }
    }
    if (verbatim) return;
    // Framed anew: an event of several data lines reaches the client as one, each line a data
    // line (the parser joined them with newlines).
    if (r->translator && !error_event) {
      for (const auto& d : r->translator->event(data)) out += net::sse_event(d);
      return;
    }
    out += net::sse_event(data);
  });
  if (refused) return false;
  if (completion_tokens >= 0) {  // once a stream: only its relaying leg gets past its first event
    std::lock_guard lock(r->mutex);
    r->completion_tokens = completion_tokens;
  }
  if (token_events > 0) {
    // One lock per piece: the events a piece completes arrived together (gaps of 0).
    std::lock_guard lock(r->mutex);
    if (r->output_events == 0) {
      r->first_token_ns = now;
      r->times.mark(Phase::kDecoding, now);
      if (topo_.mode == PdMode::kAggregated) r->times.mark_prefill_done(now);
    } else {
      r->itl.push_back(static_cast<double>(now - r->last_token_ns) * 1e-9);
    }
    r->itl.insert(r->itl.end(), static_cast<size_t>(token_events - 1), 0.0);
    r->last_token_ns = now;
    r->output_events += token_events;
  }
  if (l.state != LegState::kRelaying) {  // no complete event yet: nothing went out
    // A stream's first event is held whole before it shows the stream is no error (verbatim: its
    // bytes; framed anew: the parser's), bounded as a whole answer is.
    l.bytes_before_first_event += piece.size();
    if (l.bytes_before_first_event > topo_.max_answer_bytes) return refuse_too_large(l);
    if (verbatim) l.held += piece;
    return true;
  }
  if (verbatim) {
    if (!started && !l.held.empty()) {  // the bytes held back go first
      l.held += piece;
      out = std::move(l.held);
      l.held = {};
    }
  }
  // Verbatim, the piece itself goes out unless held bytes had to be joined to it (most streams'
  // first event arrives whole: no copy).
  const std::string_view bytes = verbatim && out.empty() ? piece : std::string_view(out);
  if (!bytes.empty() && !r->reply->write(bytes)) {
    l.gateway_cancelled = true;  // the client is gone
    return false;
  }
  // Only once written: a client gone as the error event was written never had it (499).
  if (!l.body.empty()) l.error_event_sent = true;
  // Each event is held until it ends (the parser's, to read it): one the engine never ends
  // would grow without bound. Cut as the engine's failure (relay_done says why).
  if (event_too_large(l, topo_.max_answer_bytes)) {
    // Past its [DONE] or its error event the client has the whole answer: the bytes after it
    // are dropped.
    if (!l.stream_done && !l.error_event_sent) l.engine_error = true;
    return false;
  }
  return true;
}

int64_t Relay::prefill_reuse(Request& r) {
  std::lock_guard lock(r.mutex);
  return r.cached_tokens_reported;
}

void Relay::relay_done(const RequestPtr& r, Leg& l, int attempt, const std::string& where,
                       int endpoint_id, const std::string& error) {
  std::string reason;
  bool streamed, shutting_down, whole_answer_timed_out;
  // The code of an error answer (an error status's body, or a stream's first event when it is
  // an error), which says whether a P/D decode engine could take the prompt's KV.
  std::optional<std::string> error_code;
  if (topo_.mode != PdMode::kAggregated && !l.body.empty() &&
      (l.status >= 400 || (l.engine_error && l.streaming)))
    error_code = api::openai_error_code(l.body);
  {
    std::lock_guard lock(r->mutex);
    streamed = l.state == LegState::kRelaying;
    whole_answer_timed_out = l.whole_answer_timed_out;
    shutting_down = l.cancel_reason == kShuttingDown;
    l.state = LegState::kFinished;
    // Read with the state by whoever ends the request (Dispatcher::release_unclaimed_kv).
    l.left_kv_untaken = !streamed && (l.never_connected || refused_unread(l.status) ||
                                      error_code == api::kKvTransferFailedCode ||
                                      error_code == api::kKvTransferBusyCode);
    if (streamed && l.cached_tokens >= 0) r->cached_tokens_reported = l.cached_tokens;
    // A non-streaming answer that came whole (its call ended by itself) before a cut that
    // crossed it (its engine's ejection, its deadline) reached the call: the answer stands.
    const bool came_whole = error.empty() && !l.streaming && l.status == 200;
    if (came_whole) whole_answer_timed_out = false;
    reason = l.cancel_reason.empty() || came_whole ? error : l.cancel_reason;
  }
  if (streamed) {  // the client has the head: finish or cut the stream, no retry possible
    // Once streaming, the gateway cancels the leg only because the client left (a failed
    // write, or its connection closed): 499 however that news arrived first; or because it shuts
    // down (Dispatcher::shut_down). A connection lost after the stream's [DONE] lost nothing.
    const bool client_left = l.gateway_cancelled.load() && !shutting_down;
    // Once the engine's error event went out, the request ended as that error says, however its
    // stream is then cut: a client that takes nothing after it (one that left, or the merger of
    // an n > 1 request, which lets a choice go once it failed), or an engine that closes without
    // its [DONE] after it (a refusal so stays a refusal, as its leg is counted), cut off no whole
    // answer.
    const bool ended_by_error = l.error_event_sent;
    if (ended_by_error) reason.clear();
    if (!client_left && !ended_by_error && event_too_large(l, topo_.max_answer_bytes))
      reason = "an event of its stream is larger than " + size_text(topo_.max_answer_bytes) +
               ", the most this gateway holds for one";
    if (!client_left && l.stream_done) reason.clear();
    // Only [DONE] says the answer is whole (as for the choice merger's streams): a stream that
    // ends cleanly without it was cut all the same (a body delimited by the connection's close).
    if (!client_left && !ended_by_error && !l.stream_done && reason.empty()) {
      reason = "the stream ended without its [DONE]";
      l.engine_error = true;
    }
    Outcome outcome;
    if (!reason.empty() && shutting_down) {
      outcome.status = 503;
      outcome.error = reason;
    } else if (!reason.empty()) {
      outcome.status = client_left ? 499 : 502;
      // Named as the client's event names it: one text to grep the access log and clients for.
      outcome.error =
          client_left ? "client closed the connection" : "engine " + where + ": " + reason;
    } else if (l.engine_error) {
      // The engine's own error event, then its [DONE]: the client has both as they came (the
      // stream ends as the engine ended it), but the request failed.
      outcome.status = 502;
      outcome.error =
          "engine " + where + " failed: " + api::openai_error_message(l.body).value_or(l.body);
    } else if (!l.body.empty()) {
      // The client's error (or a refusal) in an error event (relay_piece), then [DONE]: the
      // client has both as they came, and the request failed as the client's, not the engine's.
      outcome.status = error_event_status(l.body);
      outcome.error = "engine " + where +
                      " refused the request: " + api::openai_error_message(l.body).value_or(l.body);
    }
    const std::string cut = outcome.error;
    // Recorded first: cutting the stream closes the exchange, which reports a client gone.
    l.ended_request =
        dispatcher_.end_request(r, std::move(outcome), Dispatcher::Accounting::kWithLeg);
    if (client_left && (ended_by_error || !reason.empty())) {
      r->reply->abort();
    } else if (reason.empty()) {
      // An engine that closed after its error event without [DONE]: the stream ends as a failing
      // engine's does, its error event then [DONE].
      std::string tail;
      if (!l.stream_done) tail = (l.parser.mid_event() ? "\n\n" : "") + std::string(net::kSseDone);
      if (tail.empty() || r->reply->write(tail))
        r->reply->end();
      else
        r->reply->abort();
    } else {
      // The client has a 200 and part of an answer; it must not take that for the whole one.
      // The stream ends as a failing engine's does (vLLM's, ours): an OpenAI error event (after
      // ending an event the engine left half-sent), then [DONE], then the chunked body ends
      // properly. Clients that read error events raise it; [DONE] only ends the stream.
      std::string tail = l.parser.mid_event() ? "\n\n" : "";
      tail += net::sse_event(api::openai_error_body("the answer was cut: " + cut, "server_error"));
      tail += net::kSseDone;
      if (r->reply->write(tail))
        r->reply->end();
      else
        r->reply->abort();
    }
    return;
  }
  if (l.answer_too_large) {
    const std::string limit = size_text(topo_.max_answer_bytes);
    dispatcher_.answer_refused(
        r, attempt, 502,
        l.streaming ? "the stream's first event from engine " + where + " is larger than " + limit +
                          ", the most this gateway holds"
                    : "the answer from engine " + where + " is larger than " + limit +
                          ", the most this gateway holds for a whole answer; ask with "
                          "\"stream\": true to receive it as it is generated",
        "answer_too_large");
    return;
  }
  // A decode engine that could not take the prompt's KV from its prefill engine says so in the
  // code of its error (an error status, or a stream's first event): that engine failed, or (the
  // KV was gone there, or the engine had no transfer connection free for now) no engine did.
  // Read before the 504 below too: start_leg's completion reads these flags, and a refusal that
  // came whole just after the leg's deadline is no failure of the decode engine's either.
  const Dispatcher::Blame blame = [&] {
    if (topo_.mode == PdMode::kAggregated) return Dispatcher::Blame::kItsEngine;
    l.kv_transfer_failed = error_code == api::kKvTransferFailedCode;
    l.kv_expired = error_code == api::kKvTransferExpiredCode;
    l.kv_transfer_busy =
        topo_.mode == PdMode::kSequential && error_code == api::kKvTransferBusyCode;
    if (l.kv_transfer_failed) return Dispatcher::Blame::kPrefillEngine;
    if (l.kv_expired) return Dispatcher::Blame::kNoEngineKvGone;
    if (l.kv_transfer_busy) return Dispatcher::Blame::kNoEngineKvBusy;
    return Dispatcher::Blame::kItsEngine;
  }();
  // A leg still connecting at the deadline never reached its engine: another engine need not take
  // as long, so it is retried below like any leg that could not connect.
  if (whole_answer_timed_out && !l.never_connected) {  // as nginx answers a timed-out POST: 504
    dispatcher_.answer_refused(
        r, attempt, 504,
        "engine " + where + " sent no whole answer within timeouts.first_token_ms (" +
            std::to_string(topo_.timeouts.first_token.count()) +
            " ms), which bounds a non-streaming answer; not retried, as another engine would "
            "take as long: ask with \"stream\": true to receive it as it is generated",
        "timeout");
    return;
  }
  if (!l.engine_error && l.streaming && !l.body.empty()) {
    // A stream that began with the client's error or a refusal (relay_piece): answered as the
    // engine's 4xx answer or its 429 is, with the engine's error (the client's error to the client
    // without retry; a refusal retried elsewhere), without blame.
    const int status = error_event_status(l.body);  // read before the body moves
    dispatcher_.leg_failed(r, attempt, endpoint_id, status, std::move(l.body), {});
    return;
  }
  if (l.engine_error && l.streaming && !l.body.empty()) {  // a stream that began with an error
    if (blame == Dispatcher::Blame::kNoEngineKvBusy) {
      // Not failed, but refused for now: answered as a whole refusal is (the engine's 503 and
      // error) once its busy retries are spent, not as the decode engine's failure (a 502).
      dispatcher_.leg_failed(r, attempt, endpoint_id, 503, std::move(l.body), {}, blame);
      return;
    }
    dispatcher_.leg_failed(
        r, attempt, endpoint_id, 502, {},
        "engine " + where + " failed: " + api::openai_error_message(l.body).value_or(l.body),
        blame);
    return;
  }
  if (reason.empty() && l.status == 200 && !l.streaming) {
    const int64_t now = exec_.now_ns();
    r->times.mark(Phase::kDecoding, now);
    if (topo_.mode == PdMode::kAggregated) r->times.mark_prefill_done(now);
    // The answer is relayed as the engine sent it; the gateway only checks it is a JSON
    // object and reads the completion tokens for its statistics (a full parse would cost
    // more than the rest of the relay). An answer delimited by the connection's close has no
    // other proof that it is whole: that one is parsed.
    if (l.until_close ? !is_json_object(l.body) : !looks_like_json_object(l.body)) {
      l.engine_error = true;
      dispatcher_.leg_failed(r, attempt, endpoint_id, 502, {},
                             "engine " + where + " sent a malformed answer (not a JSON object)");
      return;
    }
    const int64_t tokens = usage_completion_tokens(l.body);
    {
      std::lock_guard lock(r->mutex);
      // A leg the gateway gave up on (a retry, the other leg failed) must not answer, as it may
      // not start a stream (relay_piece).
      if (r->client != ClientState::kNothingSent || l.gateway_cancelled.load()) return;
      r->client = ClientState::kAnswering;
      r->completion_tokens = tokens;
      if (computes_prompt_) r->cached_tokens_reported = usage_cached_tokens(l.body);
      if (reports_prefill_reuse_ && r->cached_tokens_reported >= 0)
        l.body = with_usage_cached_tokens(std::move(l.body), r->cached_tokens_reported);
      r->reply->respond(200, r->translator ? r->translator->body(l.body) : std::move(l.body),
                        "application/json");
    }
    l.ended_request = dispatcher_.end_request(r, {}, Dispatcher::Accounting::kWithLeg);
    return;
  }
  if (reason.empty() && l.streaming) {  // a 200 stream that brought no event: no answer either
    reason = "the stream ended without an answer";
    if (!l.gateway_cancelled.load()) l.engine_error = true;
  }
  if (!reason.empty()) {
    dispatcher_.leg_failed(
        r, attempt, endpoint_id, 502, {}, "engine " + where + " failed: " + reason,
        l.never_connected ? Dispatcher::Blame::kItsEngineUnreached : Dispatcher::Blame::kItsEngine);
    return;
  }
  dispatcher_.leg_failed(r, attempt, endpoint_id, l.status, std::move(l.body), {}, blame,
                         l.retry_after);
}

}  // namespace tandem::gateway
