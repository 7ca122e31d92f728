// The asynchronous HTTP client against the HTTP server: plain and streamed responses, hundreds of
// concurrent streams on the client's one thread, keep-alive reuse, cancellation that the server
// sees as a client gone, stopping from on_body, timeouts, refused connections, and destruction
// with calls in flight. Every server binds port 0 on 127.0.0.1.
#include "net/async_http_client.h"

#include <arpa/inet.h>
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstring>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <source_location>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "net/http_client.h"
#include "net/http_server.h"
#include "scripted_server.h"
#include "util/bounded_wait.h"
#include "util/loopback_socket.h"

namespace tandem::net {
namespace {

using namespace std::chrono_literals;
using tandem::testing::fail_hung;
using tandem::testing::get_within;
using tandem::testing::kHangGuard;

// A client that reuses an idle connection however long the test pauses between calls: the tests
// that count connections must not depend on the machine's speed.
AsyncHttpClientOptions ageless() {
  AsyncHttpClientOptions options;
  options.max_idle_age = std::chrono::milliseconds(0);
  return options;
}

// What one call saw; wait() blocks until on_done ran.
struct Outcome {
  std::mutex m;
  std::condition_variable cv;
  int status = 0;
  std::string body, error, content_type;
  int heads = 0, dones = 0;
  std::optional<CallFailure> failure;  // on_failure's, before on_done

  AsyncHttpHandlers handlers(std::function<bool(std::string_view)> on_body = {}) {
    AsyncHttpHandlers h;
    h.on_head = [this](int s, const Headers& headers) {
      std::lock_guard lock(m);
      status = s;
      content_type = headers.get("Content-Type");
      ++heads;
    };
    h.on_body = [this, on_body](std::string_view piece) {
      {
        std::lock_guard lock(m);
        body += piece;
      }
      return on_body ? on_body(piece) : true;
    };
    h.on_failure = [this](CallFailure f) {
      std::lock_guard lock(m);
      EXPECT_EQ(dones, 0) << "on_failure after on_done";
      failure = f;
    };
    h.on_done = [this](const std::string& e) {
      std::lock_guard lock(m);
      EXPECT_EQ(e.empty(), !failure.has_value()) << e;
      error = e;
      ++dones;
      cv.notify_all();
    };
    return h;
  }
  // A call that never ends fails the test and ends the run (bounded_wait.h): returning would let
  // the test go on to destroy this Outcome while the client may still call its handlers.
  void wait(const std::source_location& where = std::source_location::current()) {
    std::unique_lock lock(m);
    if (!cv.wait_for(lock, kHangGuard, [&] { return dones > 0; }))
      fail_hung("the call never ended (no on_done)", kHangGuard, where);
  }
};

class AsyncClient : public ::testing::Test {
 protected:
  void SetUp() override {
    HttpServerOptions o;
    o.host = "127.0.0.1";
    o.threads = 2;
    server_ = std::make_unique<HttpServer>(o);
    server_->route("POST", "/echo", [](const HttpRequest& r, std::shared_ptr<Exchange> ex) {
      ex->respond(200, "echo:" + r.body, "text/plain");
    });
    // Streams `n` numbered chunks from another thread, as the engine streams tokens.
    server_->route("GET", "/stream", [](const HttpRequest& r, std::shared_ptr<Exchange> ex) {
      const int n = std::stoi(r.headers.get("X-Chunks", "20"));
      ex->start_stream(200, "text/event-stream");
      std::thread([ex, n] {
        for (int i = 0; i < n; ++i) {
          ex->write("chunk " + std::to_string(i) + "\n");
          std::this_thread::sleep_for(1ms);
        }
        ex->end();
      }).detach();
    });
    // Holds streams until X-Gather of them are open at once, then streams 10 chunks to each: the
    // streams are concurrent whatever the speed of the machine.
    server_->route("GET", "/gather", [this](const HttpRequest& r, std::shared_ptr<Exchange> ex) {
      const size_t n = std::stoul(r.headers.get("X-Gather", "1"));
      ex->start_stream(200, "text/event-stream");
      std::vector<std::shared_ptr<Exchange>> release;
      {
        std::lock_guard lock(m_);
        gathered_.push_back(std::move(ex));
        if (gathered_.size() == n) release.swap(gathered_);
      }
      if (release.empty()) return;
      std::thread([release] {
        for (int i = 0; i < 10; ++i) {
          for (auto& e : release) e->write("chunk " + std::to_string(i) + "\n");
          std::this_thread::sleep_for(1ms);
        }
        for (auto& e : release) e->end();
      }).detach();
    });
    // Starts a stream and never ends it; tells the test when the client went away.
    server_->route("GET", "/forever", [this](const HttpRequest&, std::shared_ptr<Exchange> ex) {
      ex->start_stream(200, "text/event-stream");
      ex->write("first\n");
      ex->on_close([this] {
        std::lock_guard lock(m_);
        ++closed_;
        cv_.notify_all();
      });
      std::lock_guard lock(m_);
      held_.push_back(ex);
    });
    // Never answers.
    server_->route("GET", "/silent", [this](const HttpRequest&, std::shared_ptr<Exchange> ex) {
      std::lock_guard lock(m_);
      held_.push_back(ex);
    });
    server_->start();
  }
  void TearDown() override {
    {
      std::lock_guard lock(m_);
      held_.clear();
      gathered_.clear();
    }
    server_->stop();
  }

  AsyncHttpRequest request(std::string method, std::string target) {
    AsyncHttpRequest r;
    r.host = "127.0.0.1";
    r.port = server_->port();
    r.method = std::move(method);
    r.target = std::move(target);
    return r;
  }

  std::unique_ptr<HttpServer> server_;
  std::mutex m_;
  std::condition_variable cv_;
  int closed_ = 0;
  std::vector<std::shared_ptr<Exchange>> held_;
  std::vector<std::shared_ptr<Exchange>> gathered_;
};

TEST_F(AsyncClient, PlainAndStreamedResponses) {
  AsyncHttpClient client;
  Outcome plain;
  auto r = request("POST", "/echo");
  r.body = "hello";
  client.start(r, plain.handlers());
  plain.wait();
  EXPECT_EQ(plain.error, "");
  EXPECT_EQ(plain.status, 200);
  EXPECT_EQ(plain.body, "echo:hello");
  EXPECT_EQ(plain.content_type, "text/plain");

  Outcome streamed;
  auto s = request("GET", "/stream");
  s.headers.set("X-Chunks", "50");
  client.start(s, streamed.handlers());
  streamed.wait();
  EXPECT_EQ(streamed.error, "");
  std::string want;
  for (int i = 0; i < 50; ++i) want += "chunk " + std::to_string(i) + "\n";
  EXPECT_EQ(streamed.body, want);
  EXPECT_EQ(streamed.heads, 1);
  EXPECT_EQ(streamed.dones, 1);
  EXPECT_EQ(client.in_flight(), 0u);
}

TEST_F(AsyncClient, HostNamesAreResolved) {
  AsyncHttpClient client;
  Outcome named;
  auto r = request("POST", "/echo");
  r.host = "localhost";  // every address it has is tried until one takes the connection
  r.body = "by name";
  client.start(r, named.handlers());
  named.wait();
  EXPECT_EQ(named.error, "");
  EXPECT_EQ(named.body, "echo:by name");

  Outcome unknown;
  r.host = "no-such-host.invalid";
  client.start(r, unknown.handlers());
  unknown.wait();
  EXPECT_NE(unknown.error.find("cannot resolve"), std::string::npos) << unknown.error;
}

TEST_F(AsyncClient, HundredsOfConcurrentStreamsOnOneThreadAndReusedConnections) {
  AsyncHttpClient client(ageless());
  const int n = 300;
  std::vector<std::unique_ptr<Outcome>> outcomes;
  for (int i = 0; i < n; ++i) {
    outcomes.push_back(std::make_unique<Outcome>());
    auto s = request("GET", "/gather");
    s.headers.set("X-Gather", std::to_string(n));
    client.start(s, outcomes.back()->handlers());
  }
  std::string want;
  for (int i = 0; i < 10; ++i) want += "chunk " + std::to_string(i) + "\n";
  for (auto& o : outcomes) {
    o->wait();
    EXPECT_EQ(o->error, "");
    EXPECT_EQ(o->body, want);
  }
  EXPECT_EQ(client.connections_opened(), uint64_t(n));
  // Done calls left their connections for reuse: sequential calls open none.
  for (int i = 0; i < 20; ++i) {
    Outcome o;
    auto r = request("POST", "/echo");
    r.body = std::to_string(i);
    client.start(r, o.handlers());
    o.wait();
    EXPECT_EQ(o.body, "echo:" + std::to_string(i));
  }
  EXPECT_EQ(client.connections_opened(), uint64_t(n));
}

TEST_F(AsyncClient, CancelEndsTheCallAndTheServerSeesTheClientGo) {
  AsyncHttpClient client;
  Outcome o;
  std::promise<void> first_piece;
  std::atomic<bool> once{false};
  const auto id = client.start(request("GET", "/forever"), o.handlers([&](std::string_view) {
    if (!once.exchange(true)) first_piece.set_value();
    return true;
  }));
  auto streaming = first_piece.get_future();
  get_within(streaming, kHangGuard, "the stream's first piece never came");
  client.cancel(id);
  o.wait();
  EXPECT_EQ(o.error, "cancelled");
  EXPECT_EQ(o.body, "first\n");
  std::unique_lock lock(m_);
  EXPECT_TRUE(cv_.wait_for(lock, 10s, [&] { return closed_ == 1; }));
}

TEST_F(AsyncClient, OnBodyReturningFalseStopsTheCall) {
  AsyncHttpClient client;
  Outcome o;
  client.start(request("GET", "/forever"), o.handlers([](std::string_view) { return false; }));
  o.wait();
  EXPECT_EQ(o.error, "cancelled");
  std::unique_lock lock(m_);
  EXPECT_TRUE(cv_.wait_for(lock, 10s, [&] { return closed_ == 1; }));
}

TEST_F(AsyncClient, TimeoutsAndRefusedConnectionsAreErrors) {
  AsyncHttpClient client;
  Outcome silent;
  auto r = request("GET", "/silent");
  r.timeout = 200ms;
  client.start(r, silent.handlers());
  silent.wait();
  EXPECT_NE(silent.error.find("timed out"), std::string::npos) << silent.error;
  EXPECT_EQ(silent.heads, 0);

  // A stream that stops moving times out too, after what it delivered.
  Outcome stalled;
  auto f = request("GET", "/forever");
  f.timeout = 200ms;
  client.start(f, stalled.handlers());
  stalled.wait();
  EXPECT_NE(stalled.error.find("timed out"), std::string::npos) << stalled.error;
  EXPECT_EQ(stalled.body, "first\n");

  Outcome refused;
  auto c = request("GET", "/stream");
  c.port = 1;
  client.start(c, refused.handlers());
  refused.wait();
  EXPECT_NE(refused.error.find("cannot connect"), std::string::npos) << refused.error;
}

// A server of one connection on 127.0.0.1, driven by the test: it reads a request head, then
// writes what it is told and closes.
class RawServer {
 public:
  RawServer() { listener_ = listen_on_loopback(port_); }
  ~RawServer() {
    if (conn_ >= 0) ::close(conn_);
    ::close(listener_);
  }
  uint16_t port() const { return port_; }
  // Waits until a client connected and sent a whole request head. A client that never connects
  // or never ends its head is a failure, not a hang: a wait past `limit` ends the run
  // (bounded_wait.h), and a head past kMaxRequestHead, or a connection closed before the head
  // ended, is a failure recorded here.
  void read_request_head(std::chrono::seconds limit = kHangGuard,
                         const std::source_location& where = std::source_location::current()) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    wait_readable(listener_, deadline, limit, "no client connected to the raw server", where);
    conn_ = ::accept(listener_, nullptr, nullptr);
    if (conn_ < 0) {
      ADD_FAILURE_AT(where.file_name(), where.line()) << "accept: " << std::strerror(errno);
      return;
    }
    std::string head;
    char buf[1024];
    while (head.find("\r\n\r\n") == std::string::npos) {
      if (head.size() > kMaxRequestHead) {
        ADD_FAILURE_AT(where.file_name(), where.line())
            << "the request head has no blank line in its first " << kMaxRequestHead << " bytes";
        return;
      }
      wait_readable(conn_, deadline, limit, "the client never ended its request head", where);
      const ssize_t n = ::recv(conn_, buf, sizeof buf, 0);
      if (n <= 0) {
        ADD_FAILURE_AT(where.file_name(), where.line())
            << "the client closed after " << head.size() << " bytes, before its head ended";
        return;
      }
      head.append(buf, static_cast<size_t>(n));
    }
  }
  // Far more than any request head these tests send.
  static constexpr size_t kMaxRequestHead = 64 * 1024;
  // Writes `bytes` and closes the connection: the FIN right behind the data.
  void write_and_close(const std::string& bytes) {
    size_t sent = 0;
    while (sent < bytes.size()) {
      const ssize_t n = ::send(conn_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) break;
      sent += static_cast<size_t>(n);
    }
    ::close(conn_);
    conn_ = -1;
  }

 private:
  // Returns once `fd` is readable; ends the run (fail_hung) at `deadline`.
  static void wait_readable(int fd, std::chrono::steady_clock::time_point deadline,
                            std::chrono::seconds limit, std::string_view what,
                            const std::source_location& where) {
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      pollfd p{fd, POLLIN, 0};
      const int ready = ::poll(&p, 1, static_cast<int>(std::max<int64_t>(left.count(), 0)));
      if (ready > 0) return;
      if (ready == 0) fail_hung(what, limit, where);
      if (errno != EINTR) {
        ADD_FAILURE_AT(where.file_name(), where.line()) << "poll: " << std::strerror(errno);
        return;
      }
    }
  }

  int listener_ = -1, conn_ = -1;
  uint16_t port_ = 0;
};

// The raw server's waits fail the test instead of hanging it: a client that never connects
// ends the run with the failure (within `limit`, here 1 s; the tests below use kHangGuard)...
TEST(RawServerDeathTest, AClientThatNeverConnectsEndsTheRunInsteadOfHangingIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the fixtures' threads may still be about
  EXPECT_EXIT(RawServer().read_request_head(1s), ::testing::KilledBySignal(SIGABRT), "");
}

// ...and a client that sends a head without its end, and stays, is a failure at the size bound.
TEST(RawServer, ARequestHeadWithoutItsEndIsAFailureAtTheSizeBound) {
  RawServer server;
  const int client = tandem::testing::connect_loopback(server.port());
  ASSERT_GE(client, 0);
  // More than the bound, sent beside the test thread: the send may wait for the server's reads.
  auto sender = std::async(std::launch::async, [client] {
    const std::string endless = "GET / HTTP/1.1\r\nX-Long: " + std::string(100 * 1024, 'x');
    for (size_t sent = 0; sent < endless.size();) {
      const ssize_t n = ::send(client, endless.data() + sent, endless.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return;  // the server closed, leaving the rest unread
      sent += static_cast<size_t>(n);
    }
  });
  EXPECT_NONFATAL_FAILURE(server.read_request_head(), "has no blank line in its first 65536");
  server.write_and_close("");  // which ends a send still waiting
  get_within(sender, kHangGuard, "the client's send never ended");
  ::close(client);
}

// A one-shot signal between threads. A signal never raised fails the test and ends the run
// (bounded_wait.h) instead of hanging the thread that waits, often a server's or the client's.
struct Signal {
  std::promise<void> promise;
  std::shared_future<void> future = promise.get_future().share();
  void raise() { promise.set_value(); }
  void wait(const std::source_location& where = std::source_location::current()) const {
    if (future.wait_for(kHangGuard) != std::future_status::ready)
      fail_hung("the signal was never raised", kHangGuard, where);
  }
};

// An engine that dies mid-answer: the last data and the FIN reach the client in one edge of its
// edge-triggered epoll, and the client must see the EOF then, not at its idle timeout (set to a
// day here: without the fix this test fails when its wait runs out, kHangGuard).
TEST_F(AsyncClient, AnAnswerCutWithItsLastBytesIsSeenCutAtOnce) {
  AsyncHttpClient client;  // one io thread: both calls below run on it
  RawServer engine;
  Outcome cut;
  AsyncHttpRequest r = request("GET", "/answer");
  r.port = engine.port();
  r.timeout = std::chrono::hours(24);
  client.start(r, cut.handlers());
  engine.read_request_head();

  // The client's thread is held in another call's callback while the engine writes and
  // closes, so both arrive before the client looks again: one edge for the two.
  Signal in_callback, engine_closed;
  Outcome holder;
  AsyncHttpHandlers h = holder.handlers();
  auto on_head = h.on_head;
  h.on_head = [&, on_head](int status, const Headers& headers) {
    on_head(status, headers);
    in_callback.raise();
    engine_closed.wait();
  };
  client.start(request("POST", "/echo"), std::move(h));
  in_callback.wait();
  engine.write_and_close("HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial");
  engine_closed.raise();

  cut.wait();
  EXPECT_EQ(cut.status, 200);
  EXPECT_EQ(cut.body, "partial");
  EXPECT_EQ(cut.error, "cannot read the response body: connection closed by the server");
  holder.wait();
  EXPECT_EQ(holder.error, "");
}

TEST_F(AsyncClient, DestructionEndsCallsInFlight) {
  std::vector<std::unique_ptr<Outcome>> outcomes;
  {
    AsyncHttpClient client;
    for (int i = 0; i < 5; ++i) {
      outcomes.push_back(std::make_unique<Outcome>());
      client.start(request("GET", "/silent"), outcomes.back()->handlers());
    }
    // Let the requests reach the server before the client goes away.
    for (int i = 0; i < 400; ++i) {
      {
        std::lock_guard lock(m_);
        if (held_.size() == 5) break;
      }
      std::this_thread::sleep_for(5ms);
    }
  }
  for (auto& o : outcomes) {
    EXPECT_EQ(o->dones, 1);
    EXPECT_EQ(o->error, "cancelled");
  }
}

TEST_F(AsyncClient, ShutdownReturnsOnlyAfterEveryOnDoneReturned) {
  // Callers free what on_done touches once shutdown() returns (the bench driver's mutex and
  // condition variable): an on_done still running then is a use after free.
  AsyncHttpClient client;
  std::promise<void> entered, release;
  std::shared_future<void> gate = release.get_future().share();
  std::atomic<bool> on_done_returned{false};
  auto c = request("GET", "/stream");
  c.port = 1;  // refused: on_done comes at once
  AsyncHttpHandlers h;
  h.on_done = [&, gate](const std::string&) {
    entered.set_value();
    gate.wait();
    on_done_returned = true;
  };
  client.start(c, std::move(h));
  auto on_done_entered = entered.get_future();
  get_within(on_done_entered, kHangGuard, "on_done of a refused call never ran");
  auto closer = std::async(std::launch::async, [&] {
    client.shutdown();
    return on_done_returned.load();  // seen when shutdown returned
  });
  // Give a shutdown that does not wait the chance to return while on_done is held; one that waits
  // is released below either way, so this wait decides nothing by itself.
  std::this_thread::sleep_for(100ms);
  release.set_value();
  EXPECT_TRUE(get_within(closer, kHangGuard, "shutdown never returned"));
}

// A proxy on one server's threads: the handler starts an upstream call on the io thread it runs
// on, the call's callbacks run on that same thread and relay into the handler's Exchange.
TEST(AsyncClientOnServer, RelayStaysOnTheThreadThatStartedTheCall) {
  HttpServerOptions o;
  o.host = "127.0.0.1";
  o.threads = 2;
  HttpServer upstream(o);
  upstream.route("POST", "/echo", [](const HttpRequest& r, std::shared_ptr<Exchange> ex) {
    ex->start_stream(200, "text/plain");
    ex->write("echo:");
    ex->write(r.body);
    ex->end();
  });
  upstream.start();

  HttpServer proxy(o);
  AsyncHttpClient client(proxy, ageless());
  std::atomic<int> same_thread{0}, other_thread{0};
  proxy.route("POST", "/relay", [&](const HttpRequest& r, std::shared_ptr<Exchange> ex) {
    AsyncHttpRequest u;
    u.host = "127.0.0.1";
    u.port = upstream.port();
    u.method = "POST";
    u.target = "/echo";
    u.body = r.body;
    const auto handler_thread = std::this_thread::get_id();
    auto check = [&, handler_thread] {
      ++(std::this_thread::get_id() == handler_thread ? same_thread : other_thread);
    };
    AsyncHttpHandlers h;
    h.on_head = [ex, check](int status, const Headers&) {
      check();
      ex->start_stream(status, "text/plain");
    };
    h.on_body = [ex, check](std::string_view piece) {
      check();
      return ex->write(piece);
    };
    h.on_done = [ex, check](const std::string& error) {
      check();
      if (error.empty()) ex->end();
    };
    client.start(std::move(u), std::move(h));
  });
  proxy.start();

  for (int i = 0; i < 20; ++i) {
    HttpClient c("127.0.0.1", proxy.port());
    const std::string body = std::to_string(i * 7);
    auto r = c.request("POST", "/relay", body);
    EXPECT_EQ(r.status, 200);
    EXPECT_EQ(r.body, "echo:" + body);
  }
  EXPECT_GE(same_thread.load(), 60);
  EXPECT_EQ(other_thread.load(), 0);
  // Each io thread keeps its own idle connections: at most one per thread was opened.
  EXPECT_LE(client.connections_opened(), 2u);
  client.shutdown();
  proxy.stop();
}

// The documented order is shutdown() before the server stops; the other way round must still end
// the calls (from the calling thread) instead of waiting forever for io threads that are gone.
TEST(AsyncClientOnServer, ShutdownAfterTheServerStoppedEndsTheCalls) {
  HttpServerOptions o;
  o.host = "127.0.0.1";
  HttpServer upstream(o);
  std::mutex m;
  std::vector<std::shared_ptr<Exchange>> held;
  std::promise<void> arrived;
  upstream.route("GET", "/silent", [&](const HttpRequest&, std::shared_ptr<Exchange> ex) {
    std::lock_guard lock(m);
    held.push_back(std::move(ex));
    arrived.set_value();
  });
  upstream.start();

  HttpServer proxy(o);
  proxy.start();
  AsyncHttpClient client(proxy);
  Outcome outcome;
  AsyncHttpRequest r;
  r.host = "127.0.0.1";
  r.port = upstream.port();
  r.target = "/silent";
  client.start(r, outcome.handlers());
  auto reached = arrived.get_future();
  get_within(reached, kHangGuard, "the call never reached the upstream server");
  proxy.stop();
  auto shut = std::async(std::launch::async, [&] { client.shutdown(); });
  get_within(shut, kHangGuard, "shutdown waited for io threads that are gone");
  EXPECT_EQ(outcome.dones, 1);
  EXPECT_EQ(outcome.error, "cancelled");
  EXPECT_EQ(client.in_flight(), 0u);
  std::lock_guard lock(m);
  held.clear();
}

// An engine that refuses a large body from its head alone and keeps the connection (uvicorn
// answers a 400 or 401 that way) has not read the rest of the request: were the connection
// reused, the next request would be read as the rest of that body and its caller would get no
// answer, or another caller's. The client stops sending once the answer came and closes.
TEST(AsyncClientEarlyAnswer, AConnectionWhoseRequestWasNotAllSentIsNotReused) {
  Signal answered;  // the client has the refusal: only then does the engine read on
  std::atomic<int> bodies_read_whole{0};
  ScriptedServer engine([&](int& fd, int connection) {
    std::string buffer;
    for (;;) {
      const std::string head = ScriptedServer::read_head(fd, buffer);
      if (head.empty()) return;
      if (head.rfind("POST", 0) == 0) {
        ScriptedServer::write(fd, "HTTP/1.1 400 Bad Request\r\nContent-Length: 5\r\n\r\nearly");
        answered.wait();
        // As uvicorn: the body is read (and dropped) after the answer, then the next request.
        if (!ScriptedServer::read_body(fd, buffer, ScriptedServer::content_length(head))) return;
        ++bodies_read_whole;
        continue;
      }
      const std::string body = "second on connection " + std::to_string(connection);
      ScriptedServer::write(fd, "HTTP/1.1 200 OK\r\nContent-Length: " +
                                    std::to_string(body.size()) + "\r\n\r\n" + body);
    }
  });
  AsyncHttpClient client;
  AsyncHttpRequest big;
  big.host = "127.0.0.1";
  big.port = engine.port();
  big.method = "POST";
  big.target = "/v1/completions";
  big.body.assign(size_t{16} << 20, 'a');  // more than the socket buffers hold
  Outcome refused;
  client.start(big, refused.handlers());
  refused.wait();
  answered.raise();
  EXPECT_EQ(refused.error, "");
  EXPECT_EQ(refused.status, 400);
  EXPECT_EQ(refused.body, "early");

  AsyncHttpRequest next = big;
  next.method = "GET";
  next.target = "/v1/models";
  next.body.clear();
  next.timeout = 10s;  // without the fix this call gets no answer: the engine reads it as body
  Outcome second;
  client.start(next, second.handlers());
  second.wait();
  EXPECT_EQ(second.error, "");
  EXPECT_EQ(second.body, "second on connection 1");
  EXPECT_EQ(bodies_read_whole.load(), 0);
  EXPECT_EQ(client.connections_opened(), 2u);
}

AsyncHttpRequest request_to(uint16_t port, std::string method, std::string body = {}) {
  AsyncHttpRequest r;
  r.host = "127.0.0.1";
  r.port = port;
  r.method = std::move(method);
  r.target = "/v1/completions";
  r.body = std::move(body);
  return r;
}

// An engine that dies after reading a POST on a reused connection may have started it: sent
// again, it would generate twice (or prefill twice into one bootstrap room), past the gateway's
// counted retries. The client reports the failure instead; the engine saw the POST once.
TEST(AsyncClientResend, APostTheEngineReadWholeIsNotSentAgain) {
  std::atomic<int> posts{0};
  ScriptedServer engine(closes_first_connection_at(2, posts));
  AsyncHttpClient client(ageless());
  Outcome first;
  client.start(request_to(engine.port(), "POST", "{\"n\":1}"), first.handlers());
  first.wait();
  EXPECT_EQ(first.body, "answer 1");

  Outcome second;
  client.start(request_to(engine.port(), "POST", "{\"n\":2}"), second.handlers());
  second.wait();
  EXPECT_EQ(second.error, "cannot read the response header: connection closed by the server");
  EXPECT_EQ(second.heads, 0);
  EXPECT_EQ(posts.load(), 2);  // without the fix 3: the second POST ran again and was answered
  EXPECT_EQ(client.connections_opened(), 1u);
}

// The same failure for a GET is the stale keep-alive connection it usually is: sending it again
// is harmless, and the caller gets its answer.
TEST(AsyncClientResend, AGetOnAConnectionClosedUnansweredIsSentAgain) {
  std::atomic<int> gets{0};
  ScriptedServer engine(closes_first_connection_at(2, gets));
  AsyncHttpClient client(ageless());
  for (int i = 0; i < 2; ++i) {
    Outcome o;
    client.start(request_to(engine.port(), "GET"), o.handlers());
    o.wait();
    EXPECT_EQ(o.error, "");
    EXPECT_EQ(o.body, i == 0 ? "answer 1" : "answer 3");
  }
  EXPECT_EQ(gets.load(), 3);
  EXPECT_EQ(client.connections_opened(), 2u);
}

// An engine closes an idle keep-alive connection (its keep-alive timeout) while the loop that
// holds it is busy: the close is not seen until that loop waits again, but the next call starts
// before. Such a connection is dropped when picked, so a POST goes out on a new one instead of
// failing (it is not sent twice once it went out whole).
TEST(AsyncClientResend, AnIdleConnectionTheEngineClosedIsNotPicked) {
  Signal loop_held, engine_closed;
  std::atomic<int> posts{0};
  ScriptedServer engine([&](int& fd, int connection) {
    std::string buffer;
    while (read_request(fd, buffer)) {
      ++posts;
      answer(fd, "answer on connection " + std::to_string(connection));
      if (connection == 0) {
        loop_held.wait();
        ::shutdown(fd, SHUT_WR);
        // The client's kernel has the FIN once it acknowledged it: the client's peek sees the
        // close, as with an engine that closed a while before.
        EXPECT_TRUE(ScriptedServer::wait_acknowledged(fd));
        ::close(fd);
        fd = -1;
        engine_closed.raise();
        return;
      }
    }
  });
  HttpServerOptions o;
  o.host = "127.0.0.1";
  o.threads = 1;  // the handler and the client's calls share this one loop
  HttpServer proxy(o);
  AsyncHttpClient client(proxy, ageless());  // the peek alone drops the connection
  proxy.route("POST", "/relay", [&](const HttpRequest& r, std::shared_ptr<Exchange> ex) {
    // The loop is held here, after its wait returned, until the engine closed its connection.
    if (r.body == "second") {
      loop_held.raise();
      engine_closed.wait();
    }
    AsyncHttpHandlers h;
    auto answer = std::make_shared<std::string>();
    h.on_body = [answer](std::string_view piece) {
      *answer += piece;
      return true;
    };
    h.on_done = [ex, answer](const std::string& error) {
      ex->respond(200, error.empty() ? *answer : "error: " + error, "text/plain");
    };
    client.start(request_to(engine.port(), "POST", r.body), std::move(h));
  });
  proxy.start();
  HttpClient c("127.0.0.1", proxy.port());
  EXPECT_EQ(c.request("POST", "/relay", "first").body, "answer on connection 0");
  EXPECT_EQ(c.request("POST", "/relay", "second").body, "answer on connection 1");
  EXPECT_EQ(posts.load(), 2);
  client.shutdown();
  proxy.stop();
}

// uvicorn (under vLLM and SGLang) closes a keep-alive connection idle for 5 s: a POST sent on it
// as it closes is read, or not, and never answered, and once it went out whole it is not sent
// again. The client does not pick a connection idle for max_idle_age, below such keep-alives.
// The test's clock stands still between calls unless the test moves it.
TEST(AsyncClientIdleAge, AConnectionIdlePastTheMaxAgeIsNotPicked) {
  std::atomic<int> posts{0};
  ScriptedServer engine(closes_first_connection_at(3, posts, true));
  std::atomic<int64_t> now_ms{0};
  AsyncHttpClientOptions options;
  options.max_idle_age = std::chrono::hours(1);  // only the test's clock gets there
  options.clock = [&] {
    return std::chrono::steady_clock::time_point(std::chrono::milliseconds(now_ms.load()));
  };
  AsyncHttpClient client(options);
  const auto post_after = [&](std::chrono::milliseconds idle) {
    now_ms += idle.count();
    Outcome o;
    client.start(request_to(engine.port(), "POST", "{}"), o.handlers());
    o.wait();
    return o.error.empty() ? o.body : "error: " + o.error;
  };
  EXPECT_EQ(post_after(0ms), "answer 1 on connection 0");
  EXPECT_EQ(post_after(std::chrono::minutes(59)), "answer 2 on connection 0");  // reused
  // Without the fix: error: cannot read the response header: connection closed by the server.
  EXPECT_EQ(post_after(std::chrono::hours(1)), "answer 3 on connection 1");
  EXPECT_EQ(posts.load(), 3);
  EXPECT_EQ(client.connections_opened(), 2u);
}

// An engine that refuses a large body from its head, then resets the connection (closing with
// the body unread): its answer and the reset reach the client together, while the client still
// has body to send. The answer is the call's outcome, not the failed send.
TEST(AsyncClientResend, AnAnswerBeforeAResetIsTheOutcomeNotTheFailedSend) {
  Signal head_read, go, engine_reset;
  ScriptedServer engine([&](int& fd, int) {
    std::string buffer;
    const bool got_head = !ScriptedServer::read_head(fd, buffer).empty();
    head_read.raise();
    go.wait();
    if (got_head) {
      ScriptedServer::write(fd,
                            "HTTP/1.1 413 Content Too Large\r\nContent-Length: 8\r\n\r\ntoo long");
    }
    ::close(fd);  // with the body unread: a reset
    fd = -1;
    engine_reset.raise();
  });
  ScriptedServer other([&](int& fd, int) {
    std::string buffer;
    if (read_request(fd, buffer)) answer(fd, "other");
  });
  AsyncHttpClient client;  // one io thread, held below while the engine answers and resets
  Outcome refused;
  // More than the socket buffers hold: the client is still sending when the answer comes.
  client.start(request_to(engine.port(), "POST", std::string(size_t{16} << 20, 'a')),
               refused.handlers());
  head_read.wait();
  Signal in_callback;
  Outcome holder;
  AsyncHttpHandlers h = holder.handlers();
  auto on_head = h.on_head;
  h.on_head = [&, on_head](int status, const Headers& headers) {
    on_head(status, headers);
    in_callback.raise();
    engine_reset.wait();
  };
  client.start(request_to(other.port(), "GET"), std::move(h));
  in_callback.wait();
  go.raise();
  refused.wait();
  EXPECT_EQ(refused.error, "");  // without the fix: cannot send the request: Connection reset...
  EXPECT_EQ(refused.status, 413);
  EXPECT_EQ(refused.body, "too long");
  holder.wait();
  EXPECT_EQ(holder.body, "other");
}

// The client never sends Upgrade: a 101 is no answer, and what follows on the connection is not
// HTTP. The call fails and the connection is not reused.
TEST(AsyncClientUpgrade, An101IsAnErrorAndItsConnectionIsClosed) {
  ScriptedServer engine([&](int& fd, int connection) {
    std::string buffer;
    while (read_request(fd, buffer)) {
      if (connection == 0) {
        ScriptedServer::write(
            fd, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: Upgrade\r\n\r\n");
      } else {
        answer(fd, "models");
      }
    }
  });
  AsyncHttpClient client;
  Outcome upgraded;
  client.start(request_to(engine.port(), "GET"), upgraded.handlers());
  upgraded.wait();
  EXPECT_EQ(upgraded.error, "the server switched protocols (HTTP 101) unasked");
  EXPECT_EQ(upgraded.heads, 0);
  Outcome next;
  client.start(request_to(engine.port(), "GET"), next.handlers());
  next.wait();
  EXPECT_EQ(next.error, "");
  EXPECT_EQ(next.body, "models");
  EXPECT_EQ(client.connections_opened(), 2u);
}

// An engine whose answer ends its lines with LF alone fails the call when that answer arrives,
// not at the call's timeout (without the fix the call times out after 10 s, and says so).
TEST(AsyncClientFraming, AnAnswerWithBareLineFeedsFailsAtOnce) {
  ScriptedServer engine([&](int& fd, int) {
    std::string buffer;
    while (read_request(fd, buffer)) {
      ScriptedServer::write(fd, "HTTP/1.1 200 OK\nContent-Length: 2\n\nok");
    }
  });
  AsyncHttpClient client;
  Outcome o;
  AsyncHttpRequest r = request_to(engine.port(), "GET");
  r.timeout = 10s;
  client.start(r, o.handlers());
  o.wait();
  EXPECT_EQ(o.error,
            "cannot read the response header: bare LF line ending (lines must end with CRLF)");
}

// How far a failed call got, for callers that decide whether sending it again is safe (the
// gateway sends a sequential decode leg that never reached its engine to another one with the
// same KV): typed, not read from the error's words. A refused connection never reached the
// server; a request read whole and then reset may have been acted on; an answer cut short was
// begun; a cancelled call says so.
TEST(AsyncClientFailure, EachFailureSaysHowFarTheCallGot) {
  Signal cancel_now;
  ScriptedServer engine([&](int& fd, int connection) {
    std::string buffer;
    if (!read_request(fd, buffer)) return;
    if (connection == 0) {  // the whole request read, then a reset
      const linger reset = {1, 0};
      ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof reset);
      ::close(fd);
      fd = -1;
    } else if (connection == 1) {  // an answer cut short
      ScriptedServer::write(fd, "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\ncut");
    } else {  // no answer until the client cancels
      cancel_now.raise();
      char byte;
      while (::recv(fd, &byte, 1, 0) > 0) {
      }
    }
  });
  AsyncHttpClient client;
  Outcome refused;
  client.start(request_to(1, "POST", "{}"), refused.handlers());  // nothing listens on port 1
  refused.wait();
  EXPECT_EQ(refused.failure, CallFailure::kNotConnected) << refused.error;

  Outcome reset;
  client.start(request_to(engine.port(), "POST", "{}"), reset.handlers());
  reset.wait();
  EXPECT_EQ(reset.failure, CallFailure::kUnanswered) << reset.error;
  EXPECT_EQ(reset.heads, 0);

  Outcome cut;
  client.start(request_to(engine.port(), "POST", "{}"), cut.handlers());
  cut.wait();
  EXPECT_EQ(cut.failure, CallFailure::kAnswerBroken) << cut.error;
  EXPECT_EQ(cut.body, "cut");

  Outcome cancelled;
  const auto id = client.start(request_to(engine.port(), "POST", "{}"), cancelled.handlers());
  cancel_now.wait();
  client.cancel(id);
  cancelled.wait();
  EXPECT_EQ(cancelled.failure, CallFailure::kCancelled) << cancelled.error;

  Outcome answered;
  ScriptedServer fine([&](int& fd, int) {
    std::string buffer;
    if (read_request(fd, buffer)) answer(fd, "fine");
  });
  client.start(request_to(fine.port(), "POST", "{}"), answered.handlers());
  answered.wait();
  EXPECT_EQ(answered.error, "");
  EXPECT_FALSE(answered.failure.has_value());
}

}  // namespace
}  // namespace tandem::net
