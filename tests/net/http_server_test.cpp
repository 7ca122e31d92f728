// The HTTP server and client against each other, plus raw sockets for what a well-behaved client
// never sends. Every server binds port 0 on 127.0.0.1.
#include "net/http_server.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <linux/sockios.h>
#include <malloc.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <future>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "api/error.h"
#include "net/body_read_deadline.h"
#include "net/http_client.h"
#include "net/sse.h"
#include "util/bounded_wait.h"
#include "util/error.h"
#include "util/error_of.h"

namespace tandem::net {
namespace {

using namespace std::chrono_literals;
using tandem::testing::get_within;

// With the OpenAI error body, as the engine and the gateway run their servers.
HttpServerOptions local_options() {
  HttpServerOptions options;
  options.host = "127.0.0.1";
  options.threads = 2;
  options.error_response = api::openai_error_response;
  return options;
}

// Starts `server` with one route, POST /x answering {}, that counts the requests it was given:
// what a test of rejected input checks stays 0.
void count_posts_to_x(HttpServer& server, std::atomic<int>& calls) {
  server.route("POST", "/x", [&calls](const HttpRequest&, std::shared_ptr<Exchange> ex) {
    ++calls;
    ex->respond(200, "{}");
  });
  server.start();
}

// A blocking TCP connection for hand-written requests. Reads give up after 10 s, so a server
// bug fails the test instead of hanging it.
class RawConnection {
 public:
  // `from`: the loopback address to connect from (127.0.0.0/8 is all this host's).
  // `receive_buffer`: SO_RCVBUF, set before connecting (it sizes the window), 0 for the default.
  explicit RawConnection(uint16_t port, const char* from = nullptr, int receive_buffer = 0) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    timeval tv{10, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (receive_buffer > 0) {
      ::setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof receive_buffer);
    }
    if (from) {
      sockaddr_in source{};
      source.sin_family = AF_INET;
      ::inet_pton(AF_INET, from, &source.sin_addr);
      if (::bind(fd_, reinterpret_cast<sockaddr*>(&source), sizeof source) != 0)
        throw std::runtime_error("bind failed");
    }
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      throw std::runtime_error("connect failed");
    }
  }
  ~RawConnection() { close(); }

  void send(std::string_view bytes) {
    while (!bytes.empty()) {
      ssize_t n = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (n <= 0) throw std::runtime_error("send failed");
      bytes.remove_prefix(static_cast<size_t>(n));
    }
  }
  // Everything until the server closes (or the 10 s read timeout).
  std::string read_all() {
    std::string out;
    char buf[4096];
    for (;;) {
      ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) {
        eof_ = n == 0;
        return out;
      }
      out.append(buf, static_cast<size_t>(n));
    }
  }
  // Whether the last read_all() ended with an orderly close by the server (not a timeout).
  bool eof() const { return eof_; }
  // Reads until `out` contains `marker`; false on EOF/timeout first.
  bool read_until(std::string& out, std::string_view marker) {
    char buf[4096];
    while (out.find(marker) == std::string::npos) {
      ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) return false;
      out.append(buf, static_cast<size_t>(n));
    }
    return true;
  }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
  bool eof_ = false;
};

// A POST /x with no body, which count_posts_to_x answers "{}".
constexpr std::string_view kPostToX = "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n";

// Sends kPostToX on `c` and reads its answer: false when the server closed `c` (refused it).
bool post_to_x_answered(RawConnection& c) {
  std::string got;
  try {
    c.send(kPostToX);
  } catch (const std::runtime_error&) {
    return false;  // already closed by the server
  }
  return c.read_until(got, "{}");
}

// What a client uploading `piece` every `every` saw: it sends until the server answers (the end of
// an answer's head arrived), a send fails (the server answered and closed), or `count` pieces
// went; `raw` is all the server sent, read to its close.
struct PacedUpload {
  int sent = 0;
  std::string raw;
};
PacedUpload upload_paced_until_answered(RawConnection& c, const std::string& piece, int count,
                                        std::chrono::milliseconds every) {
  PacedUpload out;
  char buf[4096];
  while (out.sent < count && out.raw.find("\r\n\r\n") == std::string::npos) {
    std::this_thread::sleep_for(every);
    if (::send(c.fd(), piece.data(), piece.size(), MSG_NOSIGNAL) !=
        static_cast<ssize_t>(piece.size()))
      break;
    ++out.sent;
    for (ssize_t n; (n = ::recv(c.fd(), buf, sizeof buf, MSG_DONTWAIT)) > 0;)
      out.raw.append(buf, n);
  }
  out.raw += c.read_all();
  return out;
}

// The server's end of `client` (the server runs in this process): what a test uses to give the
// server's socket the small or full send buffer of a slow network path, which loopback never has.
// Waits until the server accepted the connection; -1 if it never does.
int server_end_of(const RawConnection& client, uint16_t server_port) {
  sockaddr_in mine{};
  socklen_t len = sizeof mine;
  if (::getsockname(client.fd(), reinterpret_cast<sockaddr*>(&mine), &len) != 0) return -1;
  for (int attempt = 0; attempt < 1000; ++attempt) {
    for (int fd = 0; fd < 4096; ++fd) {
      if (fd == client.fd()) continue;
      sockaddr_in local{}, peer{};
      socklen_t l1 = sizeof local, l2 = sizeof peer;
      if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &l1) != 0) continue;
      if (l1 != sizeof local || local.sin_family != AF_INET) continue;
      if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &l2) != 0) continue;
      if (ntohs(local.sin_port) == server_port && peer.sin_port == mine.sin_port) return fd;
    }
    std::this_thread::sleep_for(10ms);
  }
  return -1;
}

// Sets a socket's receive (or send) buffer: what the kernel then holds for it stays small.
void set_buffer(int fd, int option, int bytes) {
  ::setsockopt(fd, SOL_SOCKET, option, &bytes, sizeof bytes);
}

// What a server logged (HttpServerOptions::log), from any of its threads.
class ServerLog {
 public:
  std::function<void(const std::string&)> sink() {
    return [this](const std::string& line) {
      std::lock_guard lock(mu_);
      lines_.push_back(line);
    };
  }
  std::vector<std::string> lines() {
    std::lock_guard lock(mu_);
    return lines_;
  }

 private:
  std::mutex mu_;
  std::vector<std::string> lines_;
};

// Hostile bytes printable in a failure message.
std::string ascii_excerpt(std::string_view bytes) {
  std::string out;
  for (char ch : bytes.substr(0, 24)) out += (ch >= 0x20 && ch < 0x7f) ? ch : '?';
  return out;
}

int status_of(const std::string& raw) {
  // "HTTP/1.1 404 Not Found\r\n..."
  if (raw.size() < 12) return 0;
  return std::stoi(raw.substr(9, 3));
}

std::string body_of(const std::string& raw) {
  size_t end = raw.find("\r\n\r\n");
  return end == std::string::npos ? "" : raw.substr(end + 4);
}

// The body must be the OpenAI error object with this type.
void expect_openai_error(const std::string& body, std::string_view type) {
  auto json = nlohmann::json::parse(body);
  ASSERT_TRUE(json.contains("error")) << body;
  const auto& error = json["error"];
  EXPECT_TRUE(error["message"].is_string()) << body;
  EXPECT_FALSE(error["message"].get<std::string>().empty()) << body;
  EXPECT_EQ(error["type"], type) << body;
  EXPECT_TRUE(error["param"].is_null()) << body;
  EXPECT_TRUE(error["code"].is_null()) << body;
}

TEST(Headers, CaseInsensitiveAndValidated) {
  Headers h;
  h.add("Content-Type", "text/plain");
  h.add("X-A", "1");
  h.add("x-a", "2");
  ASSERT_NE(h.find("content-type"), nullptr);
  EXPECT_EQ(*h.find("CONTENT-TYPE"), "text/plain");
  EXPECT_EQ(h.get("X-a"), "1");
  EXPECT_EQ(h.get("missing", "none"), "none");
  h.set("X-A", "3");
  EXPECT_EQ(h.get("x-a"), "3");
  EXPECT_EQ(h.size(), 2u);
  EXPECT_THROW(h.add("Bad Name", "v"), Error);
  EXPECT_THROW(h.add("X-Inject", "a\r\nX-Evil: 1"), Error);
}

TEST(HttpServer, KeepAliveServesSeveralRequestsOnOneConnection) {
  HttpServer server(local_options());
  std::atomic<int> count{0};
  server.route("POST", "/echo", [&](const HttpRequest& req, std::shared_ptr<Exchange> ex) {
    nlohmann::json j = {{"body", req.body},
                        {"port", req.remote_port},
                        {"addr", req.remote_address},
                        {"query", req.query},
                        {"path", req.path},
                        {"n", ++count},
                        {"x", req.headers.get("x-test")}};
    HttpResponse r;
    r.body = j.dump();
    r.headers.add("X-Reply", "yes");
    ex->respond(std::move(r));
  });
  server.start();
  ASSERT_NE(server.port(), 0);

  HttpClientOptions ageless;  // reused however long the test pauses between requests
  ageless.max_idle_age = std::chrono::milliseconds(0);
  HttpClient client("127.0.0.1", server.port(), ageless);
  std::set<int> ports;
  for (int i = 0; i < 5; ++i) {
    Headers h;
    h.add("X-Test", "t" + std::to_string(i));
    auto r = client.request("POST", "/echo?a=1&b=2", "hello " + std::to_string(i), h);
    ASSERT_EQ(r.status, 200);
    EXPECT_EQ(r.headers.get("x-reply"), "yes");
    EXPECT_EQ(r.headers.get("content-type"), "application/json");
    auto j = nlohmann::json::parse(r.body);
    EXPECT_EQ(j["body"], "hello " + std::to_string(i));
    EXPECT_EQ(j["x"], "t" + std::to_string(i));
    EXPECT_EQ(j["path"], "/echo");
    EXPECT_EQ(j["query"], "a=1&b=2");
    EXPECT_EQ(j["addr"], "127.0.0.1");
    ports.insert(j["port"].get<int>());
  }
  // One client port: every request came over the same TCP connection.
  EXPECT_EQ(ports.size(), 1u);
  EXPECT_EQ(count.load(), 5);
}

TEST(HttpServer, ConnectionCloseIsHonoured) {
  HttpServer server(local_options());
  server.route("GET", "/x", [](const HttpRequest&, std::shared_ptr<Exchange> ex) {
    ex->respond(200, "ok", "text/plain");
  });
  server.start();
  RawConnection c(server.port());
  // Two requests in one write: after the first (Connection: close) the server must close
  // without answering the second.
  c.send(
      "GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\nGET /x HTTP/1.1\r\nHost: a\r\n\r\n");
  std::string raw = c.read_all();
  EXPECT_TRUE(c.eof());
  EXPECT_EQ(status_of(raw), 200);
  EXPECT_NE(raw.find("Connection: close\r\n"), std::string::npos) << raw;
  EXPECT_EQ(body_of(raw), "ok");
}

TEST(HttpServer, Http10GetsKeepAliveOnlyWhenAsked) {
  HttpServer server(local_options());
  server.route("GET", "/x", [](const HttpRequest&, std::shared_ptr<Exchange> ex) {
    ex->respond(200, "ok", "text/plain");
  });
  server.start();
  RawConnection c(server.port());
  c.send("GET /x HTTP/1.0\r\n\r\n");
  std::string raw = c.read_all();  // closes after the response
  EXPECT_EQ(status_of(raw), 200);
  EXPECT_EQ(body_of(raw), "ok");
}

TEST(HttpServer, ConcurrentConnections) {
  constexpr int kClients = 8;
  HttpServer server(local_options());
  // The handler holds every response until all clients have a request in flight, which only
  // completes if the server serves the connections concurrently.
  std::mutex mu;
  std::vector<std::shared_ptr<Exchange>> held;
  server.route("POST", "/gather", [&](const HttpRequest&, std::shared_ptr<Exchange> ex) {
    std::vector<std::shared_ptr<Exchange>> release;
    {
      std::lock_guard lock(mu);
      held.push_back(std::move(ex));
      if (held.size() == kClients) release.swap(held);
    }
    for (auto& e : release) e->respond(200, e->request().body, "text/plain");
  });
  server.route("POST", "/echo", [](const HttpRequest& req, std::shared_ptr<Exchange> ex) {
    ex->respond(200, req.body, "text/plain");
  });
  server.start();

  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      HttpClient client("127.0.0.1", server.port(), 10s);
      auto r = client.request("POST", "/gather", "client " + std::to_string(i));
      if (r.status == 200 && r.body == "client " + std::to_string(i)) ++ok;
      for (int k = 0; k < 20; ++k) {
        std::string body = std::to_string(i) + "/" + std::to_string(k);
        auto e = client.request("POST", "/echo", body);
        if (e.status == 200 && e.body == body) ++ok;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), kClients * 21);
}

TEST(HttpServer, NotFoundAndMethodNotAllowed) {
  HttpServer server(local_options());
  server.route("POST", "/v1/completions",
               [](const HttpRequest&, std::shared_ptr<Exchange> ex) { ex->respond(200, "{}"); });
  server.route("GET", "/v1/completions",
               [](const HttpRequest&, std::shared_ptr<Exchange> ex) { ex->respond(200, "{}"); });
  server.start();
  HttpClient client("127.0.0.1", server.port());
  auto r = client.request("POST", "/v1/nothing", "{}");
  EXPECT_EQ(r.status, 404);
  expect_openai_error(r.body, "invalid_request_error");
  EXPECT_NE(r.body.find("/v1/nothing"), std::string::npos);
  r = client.request("DELETE", "/v1/completions");
  EXPECT_EQ(r.status, 405);
  expect_openai_error(r.body, "invalid_request_error");
  EXPECT_EQ(r.headers.get("Allow"), "GET, HEAD, POST");
  // Errors keep the connection usable.
  r = client.request("POST", "/v1/completions", "{}");
  EXPECT_EQ(r.status, 200);
}

// CORS, as vLLM's server (Starlette's CORSMiddleware, allowed origins, methods and headers "*"):
// a browser page's preflight OPTIONS was a 405, and no answer carried
// Access-Control-Allow-Origin, so no page of another origin could call the API. A preflight to a
// path with routes is answered 200 with its methods and the headers asked for; every answer to a
// request with an Origin (complete, error, stream) allows any origin; a request without Origin
// gets no CORS header, nor an OPTIONS without Access-Control-Request-Method anything but 405.
TEST(HttpServer, CorsPreflightIsAnsweredAndEveryAnswerToAPageAllowsItsOrigin) {
  HttpServer server(local_options());
  server.route("POST", "/v1/chat/completions",
               [](const HttpRequest&, std::shared_ptr<Exchange> ex) { ex->respond(200, "{}"); });
  server.route("POST", "/stream", [](const HttpRequest&, std::shared_ptr<Exchange> ex) {
    ex->start_stream(200, "text/event-stream");
    ex->write("data: x\n\n");
    ex->end();
  });
  server.start();
  HttpClient client("127.0.0.1", server.port());
  Headers page;
  page.set("Origin", "https://app.example.com");
  Headers preflight = page;
  preflight.set("Access-Control-Request-Method", "POST");
  preflight.set("Access-Control-Request-Headers", "authorization,content-type");
  auto r = client.request("OPTIONS", "/v1/chat/completions", "", preflight);
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.headers.get("Access-Control-Allow-Origin"), "*");
  EXPECT_EQ(r.headers.get("Access-Control-Allow-Methods"), "POST");
  EXPECT_EQ(r.headers.get("Access-Control-Allow-Headers"), "authorization,content-type");
  EXPECT_EQ(r.headers.get("Access-Control-Max-Age"), "600");
  r = client.request("POST", "/v1/chat/completions", "{}", page);
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.headers.get("Access-Control-Allow-Origin"), "*");
  r = client.request("GET", "/v1/chat/completions", "", page);
  EXPECT_EQ(r.status, 405);
  EXPECT_EQ(r.headers.get("Access-Control-Allow-Origin"), "*");
  r = client.request_stream("POST", "/stream", "{}", page, [](std::string_view) { return true; });
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.headers.get("Access-Control-Allow-Origin"), "*");
  // Not from a page: as before.
  r = client.request("POST", "/v1/chat/completions", "{}");
  EXPECT_FALSE(r.headers.contains("Access-Control-Allow-Origin"));
  r = client.request("OPTIONS", "/v1/chat/completions", "", page);
  EXPECT_EQ(r.status, 405);
  // An unknown path is still 404.
  EXPECT_EQ(client.request("OPTIONS", "/nothing", "", preflight).status, 404);
}

// Restricted origins: a listed one is echoed (with Vary: Origin); another gets no CORS header
// and its preflight is refused (405); none at all turns CORS off.
TEST(HttpServer, CorsAllowsOnlyTheListedOrigins) {
  for (const bool off : {false, true}) {
    auto options = local_options();
    options.allowed_origins =
        off ? std::vector<std::string>{} : std::vector<std::string>{"https://app.example.com"};
    HttpServer server(options);
    server.route("POST", "/x",
                 [](const HttpRequest&, std::shared_ptr<Exchange> ex) { ex->respond(200, "{}"); });
    server.start();
    HttpClient client("127.0.0.1", server.port());
    for (const std::string origin : {"https://app.example.com", "https://evil.example.com"}) {
      Headers h;
      h.set("Origin", origin);
      const bool allowed = !off && origin == "https://app.example.com";
      auto r = client.request("POST", "/x", "{}", h);
      EXPECT_EQ(r.status, 200);
      EXPECT_EQ(r.headers.get("Access-Control-Allow-Origin"), allowed ? origin : "") << origin;
      EXPECT_EQ(r.headers.get("Vary"), allowed ? "Origin" : "") << origin;
      h.set("Access-Control-Request-Method", "POST");
      EXPECT_EQ(client.request("OPTIONS", "/x", "", h).status, allowed ? 200 : 405) << origin;
    }
  }
}

// A page opened from a file:// URL, or in a sandboxed iframe, sends "Origin: null"; the entry
// "null" was refused as no origin, so such a page could not be allowed (vLLM's list allows it by
// plain membership).
TEST(HttpServer, TheNullOriginOfFilePagesAndSandboxedFramesCanBeAllowed) {
  EXPECT_EQ(allowed_origin_error("null"), "");
  const std::vector<std::string> origins = parse_allowed_origins("null, https://app.example.com");
  EXPECT_EQ(origins, (std::vector<std::string>{"null", "https://app.example.com"}));
  auto options = local_options();
  options.allowed_origins = origins;
  HttpServer server(options);
  server.route("POST", "/x",
               [](const HttpRequest&, std::shared_ptr<Exchange> ex) { ex->respond(200, "{}"); });
  server.start();
  HttpClient client("127.0.0.1", server.port());
  Headers h;
  h.set("Origin", "null");
  const auto r = client.request("POST", "/x", "{}", h);
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.headers.get("Access-Control-Allow-Origin"), "null");
  EXPECT_EQ(r.headers.get("Vary"), "Origin");
}

// The errors the server writes itself once a request's head is read (a body too large, malformed
// or late: 413, 400, 408) carried no CORS header, so a page's fetch saw a network error instead of
// the answer. They carry it as every answer does; a head that fails was never read, so its Origin
// is not known.
TEST(HttpServer, AnErrorWrittenBeforeTheBodyIsReadAllowsThePagesOrigin) {
  HttpServerOptions options = local_options();
  options.max_body_bytes = 1024;
  options.read_timeout = 50ms;  // the late body's 408 (no timing is asserted)
  options.allowed_origins = {"https://app.example.com"};
  HttpServer server(options);
  std::atomic<int> calls{0};
  count_posts_to_x(server, calls);
  const auto head = [](const std::string& origin, const std::string& framing) {
    return "POST /x HTTP/1.1\r\nHost: a\r\nOrigin: " + origin + "\r\n" + framing + "\r\n";
  };
  struct Case {
    std::string framing, body;
    int status;
  };
  for (const Case& c : {Case{"Content-Length: 2000\r\n", std::string(2000, 'a'), 413},
                        Case{"Transfer-Encoding: chunked\r\n", "zz\r\n", 400},
                        Case{"Content-Length: 10\r\n", "abc", 408}}) {
    for (const std::string origin : {"https://app.example.com", "https://evil.example.com"}) {
      RawConnection connection(server.port());
      connection.send(head(origin, c.framing) + c.body);
      const std::string raw = connection.read_all();
      EXPECT_EQ(status_of(raw), c.status) << raw;
      const std::string allowed = "\r\nAccess-Control-Allow-Origin: " + origin + "\r\n";
      const bool want = origin == "https://app.example.com";
      EXPECT_EQ(raw.find(allowed) != std::string::npos, want) << raw;
      EXPECT_EQ(raw.find("\r\nVary: Origin\r\n") != std::string::npos, want) << raw;
    }
  }
  RawConnection bad_head(server.port());
  bad_head.send("POST /x HTTP/1.1\r\nOrigin: https://app.example.com\r\nBad Header\r\n\r\n");
  const std::string raw = bad_head.read_all();
  EXPECT_EQ(status_of(raw), 400) << raw;
  EXPECT_EQ(raw.find("Access-Control-Allow-Origin"), std::string::npos) << raw;
  EXPECT_EQ(calls.load(), 0);
}

TEST(HttpServer, ErrorsArePlainTextUnlessAnErrorBodyIsInstalled) {
  HttpServerOptions options = local_options();
  options.error_response = plain_error_response;
  HttpServer server(options);
  server.route("POST", "/x", [](const HttpRequest&, std::shared_ptr<Exchange> ex) {
    ex->send_error(422, "no such thing");
  });
  server.start();
  HttpClient client("127.0.0.1", server.port());
  auto r = client.request("GET", "/nowhere");
  EXPECT_EQ(r.status, 404);
  EXPECT_EQ(r.headers.get("Content-Type"), "text/plain; charset=utf-8");
  EXPECT_NE(r.body.find("/nowhere"), std::string::npos) << r.body;
  r = client.request("POST", "/x", "");
  EXPECT_EQ(r.status, 422);
  EXPECT_EQ(r.body, "no such thing\n");
}

// A handler that keeps the body beyond its call (a gateway's queue) takes the server's own
// buffer, so a waiting request holds its body once, not once in the exchange and once in a copy.
TEST(HttpServer, AHandlerTakesTheBodyItselfNotACopy) {
  HttpServer server(local_options());
  std::promise<bool> moved;
  std::promise<std::string> taken;
  server.route("POST", "/x", [&](const HttpRequest& request, std::shared_ptr<Exchange> ex) {
    const char* buffer = request.body.data();
    std::string body = ex->take_body();
    moved.set_value(body.data() == buffer && ex->request().body.empty());
    ex->respond(200, "{}");
    taken.set_value(std::move(body));
  });
  server.start();
  const std::string body(size_t{1} << 20, 'b');
  RawConnection c(server.port());
  c.send("POST /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\nContent-Length: " +
         std::to_string(body.size()) + "\r\n\r\n" + body);
  EXPECT_EQ(status_of(c.read_all()), 200);
  auto was_moved = moved.get_future();
  auto got = taken.get_future();
  EXPECT_TRUE(get_within(was_moved));
  EXPECT_EQ(get_within(got), body);
}

// A chunked body grows as it arrives (doubling its buffer); a request that waits for its answer
// holds no more than its body's size, not up to twice it.
TEST(HttpServer, AWaitingChunkedBodyHoldsItsSizeNotItsGrowth) {
  HttpServer server(local_options());
  std::promise<std::pair<size_t, size_t>> held;  // size, capacity
  server.route("POST", "/x", [&](const HttpRequest& request, std::shared_ptr<Exchange> ex) {
    held.set_value({request.body.size(), request.body.capacity()});
    ex->respond(200, "{}");
  });
  server.start();
  const size_t size = 1'000'000, piece = 10'000;
  std::string wire =
      "POST /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n"
      "Transfer-Encoding: chunked\r\n\r\n";
  char line[32];
  for (size_t at = 0; at < size; at += piece) {
    std::snprintf(line, sizeof line, "%zx\r\n", piece);
    wire += line + std::string(piece, 'b') + "\r\n";
  }
  wire += "0\r\n\r\n";
  RawConnection c(server.port());
  c.send(wire);
  EXPECT_EQ(status_of(c.read_all()), 200);
  auto got = held.get_future();
  const auto [body_size, capacity] = get_within(got);
  EXPECT_EQ(body_size, size);
  EXPECT_LE(capacity, size + (size_t{64} << 10));
}

// Heap bytes in use, over every arena and mmapped block.
size_t heap_in_use() {
  const struct mallinfo2 info = ::mallinfo2();
  return info.uordblks + info.hblkhd;
}

// The connection's read buffer grows with a large body's reads (to a few hundred KiB); while the
// request waits for its answer (in a queue, maybe for long) the connection must not keep it: each
// waiting request costs its body and little more.
TEST(HttpServer, AWaitingRequestDoesNotKeepTheReadBufferOfItsLargeBody) {
  HttpServer server(local_options());
  const size_t requests = 4, size = size_t{1} << 20;
  std::mutex mu;
  std::condition_variable arrived;
  std::vector<std::shared_ptr<Exchange>> waiting;
  server.route("POST", "/x", [&](const HttpRequest&, std::shared_ptr<Exchange> ex) {
    std::lock_guard lock(mu);
    waiting.push_back(std::move(ex));
    arrived.notify_all();
  });
  server.start();
  const std::string wire =
      "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: " + std::to_string(size) + "\r\n\r\n" +
      std::string(size, 'b');
  std::vector<std::unique_ptr<RawConnection>> clients;
  clients.reserve(requests);
  const size_t before = heap_in_use();
  for (size_t i = 0; i < requests; ++i) {
    clients.push_back(std::make_unique<RawConnection>(server.port()));
    clients.back()->send(wire);
  }
  {
    std::unique_lock lock(mu);
    ASSERT_TRUE(arrived.wait_for(lock, 10s, [&] { return waiting.size() == requests; }));
  }
  const size_t held = heap_in_use() - before;
  EXPECT_LE(held, requests * (size + (size_t{64} << 10))) << held / requests << " per request";
  std::lock_guard lock(mu);
  for (auto& ex : waiting) ex->respond(200, "{}");
  waiting.clear();
}

// A body's buffer grows as its bytes arrive, not to the length its head announces: a client that
// announces 8 MiB and sends a few bytes costs the server a few bytes for as long as it holds the
// connection, not 8 MiB.
TEST(HttpServer, ABodyHoldsWhatHasArrivedNotWhatItsHeadAnnounced) {
  HttpServerOptions options = local_options();
  options.threads = 1;  // one loop, for the barrier below
  HttpServer server(options);
  std::atomic<int> calls{0};
  count_posts_to_x(server, calls);
  const size_t clients = 4, announced = options.max_body_bytes;
  const size_t before = heap_in_use();
  std::vector<std::unique_ptr<RawConnection>> held;
  for (size_t i = 0; i < clients; ++i) {
    held.push_back(std::make_unique<RawConnection>(server.port()));
    held.back()->send("POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: " +
                      std::to_string(announced) + "\r\n\r\n0123456789");
  }
  // The loop has read those heads: a request on another connection, sent after them, is answered.
  RawConnection barrier(server.port());
  barrier.send("GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
  ASSERT_EQ(status_of(barrier.read_all()), 405);
  const size_t held_bytes = heap_in_use() - before;
  // Its connection, read buffer and a few bytes of body; 8 MiB before.
  EXPECT_LE(held_bytes, clients * (size_t{256} << 10)) << held_bytes / clients << " per client";
  EXPECT_EQ(calls.load(), 0);
}

// The last step of a body's buffer is exact: an 8 MiB body that has nearly all arrived holds
// 8 MiB, not the 2x growth libstdc++'s reserve() makes of a step under twice the capacity
// (16.7 MB for 8 MiB, and 25 MB live while it copied).
TEST(HttpServer, ANearlyCompleteBodyHoldsItsLengthNotTwiceIt) {
  HttpServerOptions options = local_options();
  options.threads = 1;  // one loop, for the barrier below
  HttpServer server(options);
  std::atomic<int> calls{0};
  count_posts_to_x(server, calls);
  const size_t length = options.max_body_bytes, unsent = 1000;
  const std::string wire =
      "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: " + std::to_string(length) + "\r\n\r\n" +
      std::string(length - unsent, 'b');
  RawConnection c(server.port());
  const size_t before = heap_in_use();
  c.send(wire);
  // Every byte sent has reached the server's socket (acknowledged by its kernel), so the loop has
  // been told of it before the barrier below.
  int unacknowledged = 1;
  for (auto give_up = std::chrono::steady_clock::now() + 10s;
       ::ioctl(c.fd(), SIOCOUTQ, &unacknowledged) == 0 && unacknowledged > 0 &&
       std::chrono::steady_clock::now() < give_up;) {
    std::this_thread::yield();
  }
  ASSERT_EQ(unacknowledged, 0);
  RawConnection barrier(server.port());
  barrier.send("GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
  ASSERT_EQ(status_of(barrier.read_all()), 405);
  const size_t held = heap_in_use() - before;
  // The body and the connection's read buffer (up to max_header_bytes and four reads unparsed,
  // 256 KiB as it doubles) with its connection; 10.6 MB before (a 5.2 MB buffer doubled).
  EXPECT_LE(held, length + (size_t{512} << 10)) << held << " bytes held for " << length;
  EXPECT_EQ(calls.load(), 0);
}

TEST(HttpServer, OversizedBodyIs413) {
  HttpServerOptions options = local_options();
  options.max_body_bytes = 1024;
  HttpServer server(options);
  std::atomic<int> calls{0};
  count_posts_to_x(server, calls);
  {
    // Declared length over the limit: rejected from the header alone.
    RawConnection c(server.port());
    c.send("POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 2000\r\n\r\n" + std::string(2000, 'a'));
    std::string raw = c.read_all();
    EXPECT_EQ(status_of(raw), 413) << raw;
    expect_openai_error(body_of(raw), "invalid_request_error");
  }
  {
    // Chunked: the limit applies to the de-chunked body.
    RawConnection c(server.port());
    std::string chunk(600, 'b');
    c.send("POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n258\r\n" + chunk +
           "\r\n258\r\n" + chunk + "\r\n0\r\n\r\n");
    std::string raw = c.read_all();
    EXPECT_EQ(status_of(raw), 413) << raw;
    expect_openai_error(body_of(raw), "invalid_request_error");
  }
  // At the limit is fine.
  auto r = http_request("127.0.0.1", server.port(), "POST", "/x", std::string(1024, 'c'));
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(calls.load(), 1);
}

TEST(HttpServer, MalformedRequestIs400AndHugeHeaderIs431) {
  HttpServerOptions options = local_options();
  options.max_header_bytes = 2048;
  HttpServer server(options);
  server.route("GET", "/x",
               [](const HttpRequest&, std::shared_ptr<Exchange> ex) { ex->respond(200, "{}"); });
  server.start();
  for (std::string bad : {"GARBAGE\r\n\r\n", "GET /x HTTP/1.10\r\n\r\n",
                          "GET /x HTTP/1.1\r\nHost: a\r\nBad Header\r\n\r\n",
                          "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: abc\r\n\r\n"}) {
    RawConnection c(server.port());
    c.send(bad);
    std::string raw = c.read_all();
    EXPECT_EQ(status_of(raw), 400) << bad << " -> " << raw;
    expect_openai_error(body_of(raw), "invalid_request_error");
  }
  RawConnection c(server.port());
  c.send("GET /x HTTP/1.1\r\nHost: a\r\nX-Big: " + std::string(4000, 'z') + "\r\n\r\n");
  std::string raw = c.read_all();
  EXPECT_EQ(status_of(raw), 431) << raw;
  expect_openai_error(body_of(raw), "invalid_request_error");
}

// RFC 9112 2.3: HTTP/1.2 is served as HTTP/1.1 (and answered as such); RFC 9110 15.6.6: HTTP/2.0
// on this HTTP/1 port is 505 with the error body.
TEST(HttpServer, ALaterHttp1MinorVersionIsServedAndAnotherMajorIs505) {
  HttpServer server(local_options());
  server.route("GET", "/x",
               [](const HttpRequest&, std::shared_ptr<Exchange> ex) { ex->respond(200, "{}"); });
  server.start();
  {
    RawConnection c(server.port());
    c.send("GET /x HTTP/1.2\r\nHost: a\r\nConnection: close\r\n\r\n");
    std::string raw = c.read_all();
    EXPECT_EQ(raw.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << raw;
    EXPECT_EQ(body_of(raw), "{}");
  }
  for (std::string bad : {"GET /x HTTP/2.0\r\nHost: a\r\n\r\n", "GET /x HTTP/3.0\r\n"}) {
    RawConnection c(server.port());
    c.send(bad);
    std::string raw = c.read_all();
    EXPECT_EQ(raw.rfind("HTTP/1.1 505 HTTP Version Not Supported\r\n", 0), 0u) << raw;
    expect_openai_error(body_of(raw), "server_error");
  }
}

// RFC 9112 3.2.2: an absolute-form target names the resource after its authority; RFC 3986 6.2.3:
// an empty path there is "/", also before a query.
TEST(HttpServer, AnAbsoluteFormTargetWithoutAPathIsTheRoot) {
  HttpServer server(local_options());
  std::promise<HttpRequest> seen;
  server.route("GET", "/", [&seen](const HttpRequest& request, std::shared_ptr<Exchange> ex) {
    seen.set_value(request);
    ex->respond(200, "{}");
  });
  server.start();
  RawConnection c(server.port());
  c.send("GET http://gw:8080?a=1&b=x HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(status_of(c.read_all()), 200);
  std::future<HttpRequest> future = seen.get_future();
  const HttpRequest request = get_within(future);
  EXPECT_EQ(request.target, "/?a=1&b=x");
  EXPECT_EQ(request.path, "/");
  EXPECT_EQ(request.query, "a=1&b=x");
}

// RFC 3986 6.2.2.2: /v1/%6dodels is /v1/models, so it is routed there (the path the handler sees
// decoded, the target as sent); an escaped '/' is no segment break and finds no route.
TEST(HttpServer, APathIsRoutedWithItsEscapesOfUnreservedCharactersDecoded) {
  HttpServer server(local_options());
  std::promise<HttpRequest> seen;
  server.route("GET", "/v1/models",
               [&seen](const HttpRequest& request, std::shared_ptr<Exchange> ex) {
                 seen.set_value(request);
                 ex->respond(200, "{}");
               });
  server.start();
  HttpClient client("127.0.0.1", server.port());
  EXPECT_EQ(client.request("GET", "/v1/%6dodels?x=%41").status, 200);
  std::future<HttpRequest> future = seen.get_future();
  const HttpRequest request = get_within(future);
  EXPECT_EQ(request.path, "/v1/models");
  EXPECT_EQ(request.target, "/v1/%6dodels?x=%41");
  EXPECT_EQ(request.query, "x=%41");
  auto r = client.request("GET", "/v1%2Fmodels");
  EXPECT_EQ(r.status, 404);
  expect_openai_error(r.body, "invalid_request_error");
}

// GET /v1/models/{id}: a prefix route takes the paths under its prefix that have no route of
// their own (the longest prefix wins); its methods are answered as an exact route's are.
TEST(HttpServer, APrefixRouteTakesThePathsUnderItThatHaveNoRouteOfTheirOwn) {
  HttpServer server(local_options());
  auto echo = [](std::string who) {
    return [who](const HttpRequest& request, std::shared_ptr<Exchange> ex) {
      ex->respond(200, who + " " + request.path, "text/plain");
    };
  };
  server.route_prefix("GET", "/v1/models/", echo("prefix"));
  server.route_prefix("GET", "/v1/models/special/", echo("longer"));
  server.route("GET", "/v1/models/exact", echo("exact"));
  EXPECT_THROW(server.route_prefix("GET", "/v1/models", echo("no slash")), Error);
  EXPECT_THROW(server.route_prefix("GET", "/v1/models/", echo("twice")), Error);
  server.start();
  HttpClient client("127.0.0.1", server.port());
  for (const auto& [path, body] :
       {std::pair{"/v1/models/sim:tiny", "prefix /v1/models/sim:tiny"},
        std::pair{"/v1/models/Qwen/Qwen3-8B", "prefix /v1/models/Qwen/Qwen3-8B"},
        std::pair{"/v1/models/Qwen%2FQwen3-8B", "prefix /v1/models/Qwen%2FQwen3-8B"},
        std::pair{"/v1/models/exact", "exact /v1/models/exact"},
        std::pair{"/v1/models/special/x", "longer /v1/models/special/x"}}) {
    const auto r = client.request("GET", path);
    EXPECT_EQ(r.status, 200) << path;
    EXPECT_EQ(r.body, body) << path;
  }
  // The prefix itself is no path under it.
  EXPECT_EQ(client.request("GET", "/v1/models/").status, 404);
  EXPECT_EQ(client.request("GET", "/v1/model/x").status, 404);
  const auto r = client.request("POST", "/v1/models/x", "{}");
  EXPECT_EQ(r.status, 405);
  EXPECT_EQ(r.headers.get("Allow"), "GET, HEAD");
}

// The server's listen said "HttpServer: cannot listen on 127.0.0.1:P: Address already in use" and
// the check before an engine's load said it otherwise: one helper binds both (and the KV transfer
// listener), naming the flag and the address.
// A port in use may hold no listener: a connection made from it (the ports' kernel pick of an
// outbound connection) takes it too, so the error says either. The server names the flags its
// options say set the address (the gateway's "--port/listen.port").
TEST(HttpServer, AListenAddressThatCannotBeTakenIsRefusedNamingTheFlagAndTheAddress) {
  HttpServer held(local_options());
  held.start();
  const std::string port = std::to_string(held.port());
  const std::string in_use = "--port " + port + ": 127.0.0.1:" + port +
                             " is in use (another socket holds it: a listener, or a connection "
                             "made from that port)";
  HttpServerOptions same = local_options();
  same.port = held.port();
  HttpServer second(same);
  EXPECT_EQ(testing::error_of([&] { second.start(); }), in_use);
  EXPECT_EQ(testing::error_of(
                [&] { check_listen_address("--host", "127.0.0.1", "--port", held.port()); }),
            in_use);
  same.host_flag = "--host/listen.host";
  same.port_flag = "--port/listen.port";
  HttpServer from_topology(same);
  EXPECT_EQ(testing::error_of([&] { from_topology.start(); }),
            "--port/listen.port" + in_use.substr(6));
  // A connection to the server, made from a port of its own: nothing listens on that port.
  const int client = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(client, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  socklen_t length = sizeof a;
  ::getsockname(client, reinterpret_cast<sockaddr*>(&a), &length);
  const uint16_t from = ntohs(a.sin_port);
  a.sin_port = htons(held.port());
  ASSERT_EQ(::connect(client, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  const std::string from_port = std::to_string(from);
  EXPECT_EQ(testing::error_of([&] { check_listen_address("--host", "127.0.0.1", "--port", from); }),
            "--port " + from_port + ": 127.0.0.1:" + from_port +
                " is in use (another socket holds it: a listener, or a connection made from "
                "that port)");
  ::close(client);
  // An address of no interface here is the host's fault, named by its flag.
  const std::string elsewhere =
      testing::error_of([&] { check_listen_address("--engine-host", "192.0.2.1", "--x", 0); });
  EXPECT_EQ(elsewhere.rfind("--engine-host '192.0.2.1': cannot listen on 192.0.2.1:0: ", 0), 0u)
      << elsewhere;
  held.stop();
}

TEST(HttpServer, HandlerExceptionIs500AndServerKeepsRunning) {
  HttpServerOptions options = local_options();
  ServerLog log;
  options.log = log.sink();
  HttpServer server(options);
  server.route("GET", "/throw", [](const HttpRequest&, std::shared_ptr<Exchange>) {
    throw std::runtime_error("boom");
  });
  server.route("GET", "/ok",
               [](const HttpRequest&, std::shared_ptr<Exchange> ex) { ex->respond(200, "{}"); });
  server.start();
  HttpClient client("127.0.0.1", server.port());
  auto r = client.request("GET", "/throw");
  EXPECT_EQ(r.status, 500);
  expect_openai_error(r.body, "server_error");
  EXPECT_NE(r.body.find("boom"), std::string::npos);
  r = client.request("GET", "/ok");
  EXPECT_EQ(r.status, 200);
  const auto logged = log.lines();
  ASSERT_EQ(logged.size(), 1u);
  EXPECT_NE(logged[0].find("boom"), std::string::npos);
}

TEST(HttpServer, DroppedExchangeIs500) {
  HttpServer server(local_options());
  server.route("GET", "/forget", [](const HttpRequest&, std::shared_ptr<Exchange>) {});
  server.start();
  auto r = http_request("127.0.0.1", server.port(), "GET", "/forget");
  EXPECT_EQ(r.status, 500);
  expect_openai_error(r.body, "server_error");
}

// A stand-in for the engine's step loop: one thread that finishes requests handed to it.
class Producer {
 public:
  ~Producer() { join(); }
  void join() {
    for (auto& t : threads_) t.join();
    threads_.clear();
  }
  template <class F>
  void run(F f) {
    threads_.emplace_back(std::move(f));
  }

 private:
  std::vector<std::thread> threads_;
};

TEST(HttpServer, ResponseCompletedLaterFromAnotherThread) {
  Producer producer;
  std::atomic<int> close_calls{0};
  auto server = std::make_unique<HttpServer>(local_options());
  server->route("POST", "/later", [&](const HttpRequest& req, std::shared_ptr<Exchange> ex) {
    // Must not run: the response completes before the client goes.
    ex->on_close([&] { ++close_calls; });
    std::string body = req.body;
    producer.run([ex, body] {
      std::this_thread::sleep_for(20ms);
      EXPECT_FALSE(ex->closed());
      EXPECT_TRUE(ex->respond(201, "done: " + body, "text/plain"));
      EXPECT_TRUE(ex->complete());
      EXPECT_FALSE(ex->respond(200, "twice"));  // one response only
      EXPECT_FALSE(ex->write("x"));
    });
  });
  server->start();
  HttpClient client("127.0.0.1", server->port());
  for (int i = 0; i < 3; ++i) {
    auto r = client.request("POST", "/later", std::to_string(i));
    EXPECT_EQ(r.status, 201);
    EXPECT_EQ(r.body, "done: " + std::to_string(i));
    EXPECT_FALSE(r.headers.get("Date").empty());
  }
  client.close();
  producer.join();
  server.reset();  // stop() closes what is left; completed exchanges stay quiet
  EXPECT_EQ(close_calls.load(), 0);
}

TEST(HttpServer, StreamingFromAnotherThread) {
  constexpr int kEvents = 200;
  Producer producer;
  HttpServer server(local_options());
  server.route("POST", "/stream", [&](const HttpRequest&, std::shared_ptr<Exchange> ex) {
    producer.run([ex] {
      SseWriter sse(ex);
      EXPECT_TRUE(sse.start());
      for (int i = 0; i < kEvents; ++i) {
        EXPECT_TRUE(
            sse.send(nlohmann::json{{"i", i}, {"text", "tok\n" + std::to_string(i)}}.dump()));
        if (i % 50 == 0) std::this_thread::yield();
      }
      EXPECT_TRUE(sse.done());
      EXPECT_FALSE(sse.send("late"));
    });
  });
  server.route("GET", "/ok",
               [](const HttpRequest&, std::shared_ptr<Exchange> ex) { ex->respond(200, "{}"); });
  server.start();

  HttpClient client("127.0.0.1", server.port());
  SseParser parser;
  std::vector<std::string> events;
  size_t pieces = 0;
  auto r = client.request_stream("POST", "/stream", "{}", {}, [&](std::string_view piece) {
    ++pieces;
    for (auto& e : parser.feed(piece)) events.push_back(std::move(e));
    return true;
  });
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.headers.get("Content-Type"), "text/event-stream");
  EXPECT_EQ(r.headers.get("Transfer-Encoding"), "chunked");
  EXPECT_EQ(r.headers.get("Cache-Control"), "no-cache");
  EXPECT_GT(pieces, 0u);
  ASSERT_EQ(events.size(), size_t{kEvents} + 1);
  for (int i = 0; i < kEvents; ++i) {
    auto j = nlohmann::json::parse(events[i]);
    EXPECT_EQ(j["i"], i);
    EXPECT_EQ(j["text"], "tok\n" + std::to_string(i));
  }
  EXPECT_TRUE(SseParser::is_done(events.back()));
  // The connection survives a completed stream.
  EXPECT_EQ(client.request("GET", "/ok").status, 200);
}

TEST(HttpServer, StreamToHttp10ClientIsUnframed) {
  Producer producer;
  HttpServer server(local_options());
  server.route("GET", "/s", [&](const HttpRequest&, std::shared_ptr<Exchange> ex) {
    producer.run([ex] {
      ex->start_stream(200, "text/plain");
      ex->write("ab");
      ex->write("cd");
      ex->end();
    });
  });
  server.start();
  RawConnection c(server.port());
  c.send("GET /s HTTP/1.0\r\n\r\n");
  std::string raw = c.read_all();
  EXPECT_EQ(status_of(raw), 200);
  EXPECT_EQ(raw.find("chunked"), std::string::npos) << raw;
  EXPECT_EQ(body_of(raw), "abcd");
}

TEST(HttpServer, ClientDisconnectMidStreamReachesTheProducer) {
  Producer producer;
  HttpServer server(local_options());
  std::promise<void> callback_fired;
  std::promise<int> producer_stopped;
  server.route("POST", "/stream", [&](const HttpRequest&, std::shared_ptr<Exchange> ex) {
    ex->on_close([&] { callback_fired.set_value(); });
    producer.run([ex, &producer_stopped] {
      SseWriter sse(ex);
      sse.start();
      int sent = 0;
      // Like the engine: produce until the client is gone.
      while (sse.send(R"({"token":"x"})")) {
        ++sent;
        std::this_thread::sleep_for(1ms);
      }
      EXPECT_TRUE(sse.closed());
      EXPECT_FALSE(sse.done());
      producer_stopped.set_value(sent);
    });
  });
  server.start();
  int seen = 0;
  SseParser parser;
  auto r = http_request_stream("127.0.0.1", server.port(), "POST", "/stream", "{}", {},
                               [&](std::string_view piece) {
                                 seen += static_cast<int>(parser.feed(piece).size());
                                 return seen < 3;  // hang up after three events
                               });
  EXPECT_EQ(r.status, 200);
  auto fired = callback_fired.get_future();
  get_within(fired);
  auto stopped = producer_stopped.get_future();
  EXPECT_GE(get_within(stopped), 3);
}

// A streaming client that never reads: without a bound the server would queue the producer's
// whole output (an engine's stream at full speed) until the write timeout. Past the high-water
// mark the client counts as stalled: the producer's write fails and the exchange closes, long
// before the write timeout (an hour here).
TEST(HttpServer, AStreamingClientThatNeverReadsIsCutAtTheHighWaterMark) {
  HttpServerOptions options = local_options();
  options.max_unsent_bytes = size_t{1} << 20;
  options.write_timeout = std::chrono::hours(1);
  Producer producer;
  HttpServer server(options);
  std::promise<void> callback_fired;
  std::promise<size_t> producer_stopped;
  std::shared_ptr<Exchange> held;
  server.route("POST", "/stream", [&](const HttpRequest&, std::shared_ptr<Exchange> ex) {
    ex->on_close([&] { callback_fired.set_value(); });
    held = ex;
    producer.run([ex, &producer_stopped] {
      ex->start_stream();
      const std::string chunk(64 << 10, 'x');
      // Far more than the kernel's socket buffers hold: without the mark, the test ends here.
      constexpr size_t kGiveUp = size_t{256} << 20;
      size_t sent = 0;
      while (sent < kGiveUp && ex->write(chunk)) sent += chunk.size();
      producer_stopped.set_value(sent);
    });
  });
  server.start();
  RawConnection client(server.port());
  client.send("POST /stream HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}");
  auto stopped = producer_stopped.get_future();
  EXPECT_LT(get_within(stopped), size_t{256} << 20);
  auto fired = callback_fired.get_future();
  get_within(fired);
  EXPECT_TRUE(held->closed());
  EXPECT_FALSE(held->write("more"));
  EXPECT_FALSE(held->end());
}

// POST /slow keeps each exchange, as an engine still computing its answer does, and says when
// one came and when its client went.
struct SlowRoute {
  std::shared_ptr<Exchange> held;
  std::promise<void> received, closed;
  explicit SlowRoute(HttpServer& server) {
    server.route("POST", "/slow", [this](const HttpRequest&, std::shared_ptr<Exchange> ex) {
      ex->on_close([this] { closed.set_value(); });
      held = ex;
      received.set_value();
    });
  }
};

TEST(HttpServer, ClientDisconnectWhileWaitingForResponse) {
  HttpServer server(local_options());
  SlowRoute slow(server);
  server.start();
  {
    RawConnection c(server.port());
    c.send("POST /slow HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}");
    auto f = slow.received.get_future();
    get_within(f);
  }  // the client gives up
  auto f = slow.closed.get_future();
  get_within(f);
  EXPECT_TRUE(slow.held->closed());
  EXPECT_FALSE(slow.held->respond(200, "{}"));
  // A callback registered after the close runs at once.
  bool late = false;
  slow.held->on_close([&] { late = true; });
  EXPECT_TRUE(late);
}

// A client that sends its request and closes at once: on the edge-triggered socket its close
// comes in the same event as the request's bytes, and the server must still see it go (an
// engine would otherwise compute the whole answer for nobody).
TEST(HttpServer, AClientThatClosesRightAfterItsRequestIsSeenGone) {
  HttpServerOptions options = local_options();
  options.threads = 1;
  HttpServer server(options);
  std::promise<void> loop_held, release;
  std::shared_future<void> released = release.get_future().share();
  // The server's only thread is busy while the other client sends and closes. `released` by
  // value: in a test that fails before the release, the handler is let go as the locals end
  // (`release` dropped unset), and must not be waiting on one of them then.
  server.route("POST", "/hold",
               [&loop_held, released](const HttpRequest&, std::shared_ptr<Exchange> ex) {
                 loop_held.set_value();
                 released.wait();
                 ex->respond(200, "{}");
               });
  SlowRoute slow(server);
  server.start();
  RawConnection busy(server.port());
  busy.send("POST /hold HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}");
  auto h = loop_held.get_future();
  get_within(h);
  {
    RawConnection gone(server.port());
    gone.send("POST /slow HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}");
  }  // closed before the server read a byte of it
  release.set_value();
  auto f = slow.closed.get_future();
  get_within(f);
  ASSERT_TRUE(slow.held);
  EXPECT_TRUE(slow.held->closed());
}

// A client that pipelines more than a head's worth of its next request while its response is
// pending, then closes: the server holds no more than that while it waits (max_header_bytes), so
// the rest stays unread and the close is known only from epoll's hang-up, never from a recv that
// returns 0. It must still count as the client gone, or the producer works on for nobody until its
// answer fails to write.
TEST(HttpServer, AClientThatClosesWithMoreThanAHeadPipelinedIsSeenGone) {
  HttpServerOptions options = local_options();
  options.max_header_bytes = 1024;
  HttpServer server(options);
  SlowRoute slow(server);
  server.start();
  {
    RawConnection c(server.port());
    c.send("POST /slow HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}");
    auto f = slow.received.get_future();
    get_within(f);
    // The next request's head and the start of its body: far beyond what the server reads now.
    c.send("POST /slow HTTP/1.1\r\nHost: a\r\nContent-Length: 500000\r\n\r\n" +
           std::string(size_t{32} << 10, 'x'));
  }  // the client gives up
  auto f = slow.closed.get_future();
  get_within(f);
  EXPECT_TRUE(slow.held->closed());
}

// An `Expect: 100-continue` whose interim answer cannot be written at once (the connection's send
// side is full, as when the client has not read for a while) must not lift the body's deadline:
// once the 100 is written, a client that never sends the body is still answered 408 and closed
// within read_timeout of the head, not held for ever.
TEST(HttpServer, ABodyAfterAnInterimAnswerThatWaitedIsStillBoundByTheReadTimeout) {
  HttpServerOptions options = local_options();
  options.read_timeout = 3s;  // room to fill the server's side, then to read it
  options.threads = 1;        // one loop, for the barrier below
  HttpServer server(options);
  std::atomic<int> calls{0};
  count_posts_to_x(server, calls);
  RawConnection c(server.port(), nullptr, 4096);
  const int server_fd = server_end_of(c, server.port());
  ASSERT_GE(server_fd, 0);
  // All of the head but its last byte first: every segment the client sends tells the server how
  // much room the client has, and the head's last byte must not open any.
  c.send("POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\nExpect: 100-continue\r\n\r");
  // Fill the server's side until not one more byte fits: its next write, the 100, must wait.
  set_buffer(server_fd, SO_SNDBUF, 16 << 10);
  // Acknowledgements and window updates still on their way free room after a fill, so fill
  // again until three rounds in a row find none, the last just before the request.
  const std::string junk(size_t{64} << 10, 'j');
  for (int round = 0, empty = 0; empty < 3; ++round) {
    ASSERT_LT(round, 100) << "the server's side never stays full";
    if (round > 0) std::this_thread::sleep_for(100ms);
    size_t sent = 0;
    for (size_t piece : {size_t{64} << 10, size_t{4} << 10, size_t{256}, size_t{16}, size_t{1}}) {
      for (ssize_t n; (n = ::send(server_fd, junk.data(), piece, MSG_NOSIGNAL)) > 0;) sent += n;
    }
    ASSERT_TRUE(errno == EAGAIN || errno == EWOULDBLOCK) << std::strerror(errno);
    empty = sent == 0 ? empty + 1 : 0;
  }
  c.send("\n");
  // The server must have tried the 100 before the client reads: a request on another connection
  // of the same loop is answered after the loop took the head's last byte (it arrived first).
  RawConnection barrier(server.port());
  barrier.send("GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
  ASSERT_EQ(status_of(barrier.read_all()), 405);
  std::string got;
  ASSERT_TRUE(c.read_until(got, "HTTP/1.1 100 Continue\r\n\r\n"));
  // No body: the server answers 408 and closes (RawConnection's own 10 s read timeout would
  // leave eof() false).
  const std::string rest =
      got.substr(got.find("HTTP/1.1 100 Continue\r\n\r\n") + 25) + c.read_all();
  EXPECT_EQ(status_of(rest), 408) << rest;
  EXPECT_TRUE(c.eof());
  EXPECT_EQ(calls.load(), 0);
}

// The write timeout runs between two writes that make progress (nginx's send_timeout), not over
// the whole response: a client that reads slowly but steadily gets all of a body that takes it
// several write timeouts to read.
TEST(HttpServer, ASlowButSteadyReaderGetsABodyThatTakesLongerThanTheWriteTimeout) {
  HttpServerOptions options = local_options();
  options.write_timeout = 250ms;
  HttpServer server(options);
  const std::string body(size_t{1} << 20, 'b');
  server.route("GET", "/big", [&](const HttpRequest&, std::shared_ptr<Exchange> ex) {
    ex->respond(200, body, "text/plain");
  });
  server.start();
  RawConnection c(server.port(), nullptr, 16 << 10);
  const int server_fd = server_end_of(c, server.port());
  ASSERT_GE(server_fd, 0);
  // Small kernel buffers on both sides, as on a slow path: the server's writes keep waiting for
  // the reader, each a little at a time.
  set_buffer(server_fd, SO_SNDBUF, 16 << 10);
  c.send("GET /big HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
  std::string raw;
  std::vector<char> buf(size_t{16} << 10);
  for (;;) {
    const ssize_t n = ::recv(c.fd(), buf.data(), buf.size(), 0);
    if (n <= 0) break;
    raw.append(buf.data(), static_cast<size_t>(n));
    // At most 16 KiB per 20 ms: the 1 MiB take the reader 1.3 s or more, five write timeouts,
    // while the server's next write can go after one or two reads.
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_EQ(status_of(raw), 200);
  EXPECT_EQ(body_of(raw).size(), body.size());
}

TEST(HttpServer, IdleKeepAliveConnectionIsClosed) {
  HttpServerOptions options = local_options();
  // Armed at accept too: the request must arrive within it, however slowly a loaded machine
  // sends it.
  options.idle_timeout = 1s;
  HttpServer server(options);
  server.route("GET", "/x",
               [](const HttpRequest&, std::shared_ptr<Exchange> ex) { ex->respond(200, "{}"); });
  server.start();
  RawConnection c(server.port());
  c.send("GET /x HTTP/1.1\r\nHost: a\r\n\r\n");
  // The response arrives, then the idle connection is closed by the server (EOF, not the 10 s
  // read timeout of RawConnection, which would leave the response without its close).
  std::string raw = c.read_all();
  EXPECT_TRUE(c.eof());
  EXPECT_EQ(status_of(raw), 200);
  EXPECT_EQ(body_of(raw), "{}");
}

TEST(HttpServer, GracefulStopWithOpenConnections) {
  Producer producer;
  auto server = std::make_unique<HttpServer>(local_options());
  std::shared_ptr<Exchange> pending;
  std::promise<void> pending_in, pending_closed, stream_in, stream_closed;
  std::atomic<bool> stream_done{false};
  server->route("POST", "/pending", [&](const HttpRequest&, std::shared_ptr<Exchange> ex) {
    ex->on_close([&] { pending_closed.set_value(); });
    pending = ex;
    pending_in.set_value();
  });
  server->route("POST", "/stream", [&](const HttpRequest&, std::shared_ptr<Exchange> ex) {
    ex->on_close([&] { stream_closed.set_value(); });
    producer.run([ex, &stream_in, &stream_done] {
      SseWriter sse(ex);
      sse.start();
      sse.send("{}");
      stream_in.set_value();
      while (sse.send("{}")) std::this_thread::sleep_for(1ms);
      stream_done = true;
    });
  });
  server->route("GET", "/ok",
                [](const HttpRequest&, std::shared_ptr<Exchange> ex) { ex->respond(200, "{}"); });
  server->start();
  uint16_t port = server->port();

  // An idle keep-alive connection.
  HttpClient idle("127.0.0.1", port);
  EXPECT_EQ(idle.request("GET", "/ok").status, 200);
  // A request waiting for its response.
  RawConnection waiting(port);
  waiting.send("POST /pending HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n");
  auto f1 = pending_in.get_future();
  get_within(f1);
  // A stream being read.
  std::thread reader([port] {
    try {
      http_request_stream("127.0.0.1", port, "POST", "/stream", "{}", {},
                          [](std::string_view) { return true; });
    } catch (const Error&) {
      // Cut by the stop: expected.
    }
  });
  auto f2 = stream_in.get_future();
  get_within(f2);

  auto stopped = std::async(std::launch::async, [&] { server->stop(); });
  get_within(stopped);
  server->stop();  // again: nothing happens

  auto c1 = pending_closed.get_future();
  get_within(c1);
  auto c2 = stream_closed.get_future();
  get_within(c2);
  EXPECT_TRUE(pending->closed());
  EXPECT_FALSE(pending->respond(200, "{}"));
  reader.join();
  EXPECT_EQ(waiting.read_all(), "");  // closed without a response
  EXPECT_THROW(idle.request("GET", "/ok"), Error);
  // The exchanges outlive the server without harm.
  server.reset();
  EXPECT_FALSE(pending->respond(200, "{}"));
  pending.reset();
  producer.join();
  EXPECT_TRUE(stream_done.load());
}

// A client whose socket has not yet taken its whole answer when the server stops. `body_bytes`:
// the answer's size, far more than the small kernel buffers on both sides hold, so most of it is
// still the server's to write when the stop begins.
class SlowReader {
 public:
  SlowReader(HttpServer& server, size_t body_bytes)
      : body_(body_bytes, 'b'), connection_(start(server), nullptr, 16 << 10) {
    const int server_fd = server_end_of(connection_, server.port());
    EXPECT_GE(server_fd, 0);
    set_buffer(server_fd, SO_SNDBUF, 16 << 10);
    // Keep-alive: the stop, not the response, ends the connection.
    connection_.send("GET /big HTTP/1.1\r\nHost: a\r\n\r\n");
    // The head is here: the response is complete (respond()) and being written.
    EXPECT_TRUE(connection_.read_until(raw_, "\r\n\r\n"));
  }
  // Everything until the server closes, then this side closes too.
  void read_the_rest() {
    raw_ += connection_.read_all();
    closed_by_server_ = connection_.eof();
    connection_.close();
  }
  size_t body_bytes_received() const { return body_of(raw_).size(); }
  size_t body_bytes() const { return body_.size(); }
  bool closed_by_server() const { return closed_by_server_; }

 private:
  uint16_t start(HttpServer& server) {
    server.route("GET", "/big", [this](const HttpRequest&, std::shared_ptr<Exchange> ex) {
      ex->respond(200, body_, "text/plain");
    });
    server.start();
    return server.port();
  }

  const std::string body_;
  RawConnection connection_;
  std::string raw_;
  bool closed_by_server_ = false;
};

// A stop with time to flush lets a complete answer that a slow reader's socket has not yet taken
// go out whole, then half-closes (the reader sees an orderly end, not a reset); what has nothing
// complete to write (a request still waiting for its producer) is closed at once, and the stop
// returns once the reader has its answer, not at the flush's end. Before, stop() closed every
// connection at once and the answer was cut: the engine's and the gateway's drains lost a
// finished answer to a slow reader at shutdown.
TEST(HttpServer, AStopLetsASlowReaderTakeItsWholeAnswerAndClosesTheRestAtOnce) {
  HttpServer server(local_options());
  std::shared_ptr<Exchange> pending;
  std::promise<void> pending_in;
  server.route("POST", "/pending", [&](const HttpRequest&, std::shared_ptr<Exchange> ex) {
    pending = ex;
    pending_in.set_value();
  });
  SlowReader reader(server, size_t{4} << 20);
  RawConnection waiting(server.port());
  waiting.send("POST /pending HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n");
  auto in = pending_in.get_future();
  get_within(in);

  // Ten minutes to flush: get_within's minute fails the test if the stop waits for them.
  auto stopped = std::async(std::launch::async, [&] { server.stop(std::chrono::minutes(10)); });
  EXPECT_EQ(waiting.read_all(), "");  // closed without a response
  EXPECT_TRUE(waiting.eof());
  reader.read_the_rest();
  EXPECT_EQ(reader.body_bytes_received(), reader.body_bytes());
  EXPECT_TRUE(reader.closed_by_server());
  get_within(stopped);
  EXPECT_TRUE(pending->closed());
}

// A reader that never reads holds the stop for the flush's time at most: then its answer is cut
// and the stop returns. The write timeout is an hour here, so only the flush's end can cut the
// answer within get_within's minute.
TEST(HttpServer, AStopCutsAnAnswerThatItsReaderNeverTakesWhenTheFlushEnds) {
  HttpServerOptions options = local_options();
  options.write_timeout = std::chrono::hours(1);
  HttpServer server(options);
  SlowReader reader(server, size_t{8} << 20);
  auto stopped = std::async(std::launch::async, [&] { server.stop(100ms); });
  get_within(stopped);
  reader.read_the_rest();
  EXPECT_LT(reader.body_bytes_received(), reader.body_bytes());
}

// end_flush (an operator's second stop signal) ends the flush at once, before or during the stop.
// The write timeout is an hour: the default (a minute, get_within's too) would cut the reader and
// end the stop in time even if end_flush did nothing.
TEST(HttpServer, EndingTheFlushStopsAtOnce) {
  HttpServerOptions options = local_options();
  options.write_timeout = std::chrono::hours(1);
  for (const bool before : {true, false}) {
    HttpServer server(options);
    SlowReader reader(server, size_t{8} << 20);
    if (before) server.end_flush();
    auto stopped = std::async(std::launch::async, [&] { server.stop(std::chrono::minutes(10)); });
    if (!before) server.end_flush();
    get_within(stopped);
    reader.read_the_rest();
    EXPECT_LT(reader.body_bytes_received(), reader.body_bytes()) << "end_flush before: " << before;
  }
}

TEST(HttpServer, StartAndRouteMisuseThrow) {
  HttpServer server(local_options());
  auto h = [](const HttpRequest&, std::shared_ptr<Exchange>) {};
  server.route("GET", "/a", h);
  EXPECT_THROW(server.route("GET", "/a", h), Error);
  EXPECT_THROW(server.route("GET", "no-slash", h), Error);
  server.start();
  EXPECT_THROW(server.route("GET", "/b", h), Error);
  EXPECT_THROW(server.start(), Error);
  HttpServerOptions taken = local_options();
  taken.port = server.port();
  HttpServer second(taken);
  EXPECT_THROW(second.start(), Error);
}

TEST(HttpServer, ExpectContinue) {
  HttpServer server(local_options());
  server.route("POST", "/x", [](const HttpRequest& req, std::shared_ptr<Exchange> ex) {
    ex->respond(200, req.body, "text/plain");
  });
  server.start();
  RawConnection c(server.port());
  c.send(
      "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nExpect: 100-continue\r\n"
      "Connection: close\r\n\r\n");
  std::string got;
  ASSERT_TRUE(c.read_until(got, "\r\n\r\n"));
  EXPECT_EQ(got, "HTTP/1.1 100 Continue\r\n\r\n");
  c.send("hello");
  std::string raw = c.read_all();
  EXPECT_EQ(status_of(raw), 200);
  EXPECT_EQ(body_of(raw), "hello");
}

TEST(HttpServer, SmugglingAttemptsAndBadChunksAre400) {
  HttpServer server(local_options());
  std::atomic<int> calls{0};
  count_posts_to_x(server, calls);
  for (std::string bad : {
           "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nTransfer-Encoding: "
           "chunked\r\n\r\n0\r\n\r\n",
           "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nContent-Length: 5\r\n\r\nabcde",
           "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n",
           "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXX0\r\n\r\n",
           "POST /x HTTP/1.1\r\nHost: a\r\n folded: x\r\nContent-Length: 0\r\n\r\n",
           "POST /x HTTP/1.1\r\nHost: a\r\nX-A: 1\nX-B: 2\r\nContent-Length: 0\r\n\r\n",
       }) {
    RawConnection c(server.port());
    c.send(bad);
    std::string raw = c.read_all();
    EXPECT_TRUE(c.eof()) << bad;
    EXPECT_EQ(status_of(raw), 400) << bad << " -> " << raw;
    EXPECT_NE(raw.find("Connection: close\r\n"), std::string::npos) << raw;
    expect_openai_error(body_of(raw), "invalid_request_error");
  }
  RawConnection c(server.port());
  c.send("POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n");
  std::string raw = c.read_all();
  EXPECT_EQ(status_of(raw), 501) << raw;
  expect_openai_error(body_of(raw), "server_error");
  EXPECT_EQ(calls.load(), 0);
}

TEST(HttpServer, PipelinedRequestsAreAnsweredInOrder) {
  Producer producer;
  HttpServer server(local_options());
  // The first answer comes late from another thread; the second must still follow it.
  server.route("POST", "/slow", [&](const HttpRequest& req, std::shared_ptr<Exchange> ex) {
    std::string body = req.body;
    producer.run([ex, body] {
      std::this_thread::sleep_for(20ms);
      ex->respond(200, "slow:" + body, "text/plain");
    });
  });
  server.route("POST", "/fast", [](const HttpRequest& req, std::shared_ptr<Exchange> ex) {
    ex->respond(200, "fast:" + req.body, "text/plain");
  });
  server.start();
  RawConnection c(server.port());
  c.send(
      "POST /slow HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\n\r\naPOST /fast HTTP/1.1\r\nHost: "
      "a\r\n"
      "Transfer-Encoding: chunked\r\n\r\n1\r\nb\r\n0\r\n\r\n"
      "POST /fast HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nConnection: close\r\n\r\nc");
  std::string raw = c.read_all();
  size_t a = raw.find("slow:a"), b = raw.find("fast:b"), d = raw.find("fast:c");
  ASSERT_NE(a, std::string::npos) << raw;
  ASSERT_NE(b, std::string::npos) << raw;
  ASSERT_NE(d, std::string::npos) << raw;
  EXPECT_LT(a, b);
  EXPECT_LT(b, d);
}

// Holds the server's only io thread in a handler (GET /hold) until the test releases it, so that
// what clients do meanwhile reaches the server as one batch of events.
struct HeldLoop {
  std::promise<void> held, release;
  std::shared_future<void> released = release.get_future().share();
  explicit HeldLoop(HttpServer& server) {
    // `released` by value: in a test that fails before the release, the handler is let go as
    // this ends (`release` dropped unset), and must not be waiting on a member of it then.
    server.route("GET", "/hold",
                 [this, released = released](const HttpRequest&, std::shared_ptr<Exchange> ex) {
                   held.set_value();
                   released.wait();
                   ex->respond(200, "held", "text/plain");
                 });
  }
  // Returns once the loop is held by `client`'s request.
  void hold(RawConnection& client) {
    client.send("GET /hold HTTP/1.1\r\nHost: a\r\n\r\n");
    auto f = held.get_future();
    get_within(f);
  }
};

// What has arrived on `client` (waits for the first bytes, then takes what is there): the room
// its reading makes for the server to write again.
std::string read_what_arrived(RawConnection& client) {
  std::string raw;
  std::vector<char> buf(size_t{64} << 10);
  for (int flags = 0;; flags = MSG_DONTWAIT) {
    const ssize_t n = ::recv(client.fd(), buf.data(), buf.size(), flags);
    if (n <= 0) return raw;
    raw.append(buf.data(), static_cast<size_t>(n));
  }
}

// A response the client reads slowly, and its next request sent while the server still waits to
// write: the kernel reports the room to write and the new input in one event. The write waiting
// again must not drop the input's report, or the second request waits unread. (Before 5bf499a
// this passed too: Linux's next room-to-write report carries the input again. It guards the
// pipelined read; the hang-up below is what the fix changed.)
TEST(HttpServer, ARequestThatArrivesWithRoomToWriteAWaitingResponseIsRead) {
  HttpServerOptions options = local_options();
  options.threads = 1;  // one loop, for HeldLoop and the barrier below
  HttpServer server(options);
  const std::string body(size_t{1} << 20, 'b');
  server.route("GET", "/big", [&](const HttpRequest&, std::shared_ptr<Exchange> ex) {
    ex->respond(200, body, "text/plain");
  });
  server.route("GET", "/small", [](const HttpRequest&, std::shared_ptr<Exchange> ex) {
    ex->respond(200, "small", "text/plain");
  });
  HeldLoop loop(server);
  server.start();
  RawConnection c(server.port(), nullptr, 4096);
  const int server_fd = server_end_of(c, server.port());
  ASSERT_GE(server_fd, 0);
  set_buffer(server_fd, SO_SNDBUF, 16 << 10);
  c.send("GET /big HTTP/1.1\r\nHost: a\r\n\r\n");
  // The server has tried to write the body (and waits for room) once a request on another
  // connection that arrived later is answered.
  RawConnection barrier(server.port());
  barrier.send("GET /small HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
  ASSERT_EQ(body_of(barrier.read_all()), "small");
  RawConnection holder(server.port());
  loop.hold(holder);
  // While the loop is held: read what the kernels hold of the body (room for the server to write
  // again), then send the next request.
  std::string raw = read_what_arrived(c);
  ASSERT_FALSE(raw.empty());
  ASSERT_LT(raw.size(), body.size());
  c.send("GET /small HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
  loop.release.set_value();
  // The rest of the body, then the second response, then the close. Were the second request left
  // unread, RawConnection's 10 s read timeout would end this without the answer.
  raw += c.read_all();
  const size_t first_end = raw.find("\r\n\r\n") + 4 + body.size();
  ASSERT_EQ(status_of(raw), 200);
  ASSERT_GE(raw.size(), first_end);
  EXPECT_EQ(raw.substr(raw.find("\r\n\r\n") + 4, body.size()), body);
  const std::string rest = raw.substr(first_end);
  EXPECT_EQ(status_of(rest), 200) << ascii_excerpt(rest);
  EXPECT_EQ(body_of(rest), "small");
}

// The same event with the client's hang-up instead: a streaming client that stopped reading and
// closed its side is gone at once, not after the write timeout (an hour here), which is all that
// would tell if the hang-up's report were dropped: nothing wakes the connection again.
TEST(HttpServer, AStreamingClientThatHangsUpWhileItsStreamWaitsToBeWrittenIsSeenGone) {
  HttpServerOptions options = local_options();
  options.threads = 1;
  options.write_timeout = std::chrono::hours(1);
  HttpServer server(options);
  std::shared_ptr<Exchange> held;
  std::promise<void> closed;
  server.route("GET", "/stream", [&](const HttpRequest&, std::shared_ptr<Exchange> ex) {
    ex->on_close([&] { closed.set_value(); });
    ex->start_stream();
    ex->write(std::string(size_t{1} << 20, 's'));  // far more than the kernels hold
    held = ex;                                     // and the stream goes on
  });
  server.route("GET", "/small", [](const HttpRequest&, std::shared_ptr<Exchange> ex) {
    ex->respond(200, "small", "text/plain");
  });
  HeldLoop loop(server);
  server.start();
  RawConnection c(server.port(), nullptr, 4096);
  const int server_fd = server_end_of(c, server.port());
  ASSERT_GE(server_fd, 0);
  set_buffer(server_fd, SO_SNDBUF, 16 << 10);
  c.send("GET /stream HTTP/1.1\r\nHost: a\r\n\r\n");
  RawConnection barrier(server.port());  // as above: the server waits to write the stream
  barrier.send("GET /small HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
  ASSERT_EQ(body_of(barrier.read_all()), "small");
  RawConnection holder(server.port());
  loop.hold(holder);
  ASSERT_FALSE(read_what_arrived(c).empty());
  ASSERT_EQ(::shutdown(c.fd(), SHUT_WR), 0);
  loop.release.set_value();
  auto f = closed.get_future();
  ASSERT_EQ(f.wait_for(10s), std::future_status::ready) << "the hang-up was not seen";
  EXPECT_TRUE(held->closed());
}

// A client that pipelines two requests and half-closes (`printf '...' | nc -N`): both are already
// whole in the server's input when it sees the close, and both are answered before it closes.
TEST(HttpServer, RequestsBufferedBeforeTheClientHalfClosesAreAllAnswered) {
  HttpServerOptions options = local_options();
  options.threads = 1;
  HttpServer server(options);
  server.route("GET", "/a", [](const HttpRequest&, std::shared_ptr<Exchange> ex) {
    ex->respond(200, "first", "text/plain");
  });
  server.route("GET", "/b", [](const HttpRequest&, std::shared_ptr<Exchange> ex) {
    ex->respond(200, "second", "text/plain");
  });
  HeldLoop loop(server);
  server.start();
  RawConnection holder(server.port());
  loop.hold(holder);
  // The requests and the half-close reach the server in one read.
  RawConnection c(server.port());
  c.send("GET /a HTTP/1.1\r\nHost: a\r\n\r\nGET /b HTTP/1.1\r\nHost: a\r\n\r\n");
  ASSERT_EQ(::shutdown(c.fd(), SHUT_WR), 0);
  loop.release.set_value();
  const std::string raw = c.read_all();
  EXPECT_TRUE(c.eof());
  const size_t second = raw.find("HTTP/1.1", 1);
  ASSERT_NE(second, std::string::npos) << raw;
  EXPECT_EQ(status_of(raw), 200) << raw;
  EXPECT_EQ(body_of(raw.substr(0, second)), "first");
  EXPECT_EQ(status_of(raw.substr(second)), 200) << raw;
  EXPECT_EQ(body_of(raw.substr(second)), "second");
}

// A body that stops arriving is answered 408 (the server's error body) and closed, as nginx's
// client_body_timeout does: the client learns why, instead of a bare close (a broken pipe).
TEST(HttpServer, AStalledBodyIsAnswered408AfterTheReadTimeout) {
  HttpServerOptions options = local_options();
  options.read_timeout = 50ms;
  HttpServer server(options);
  std::atomic<int> calls{0};
  count_posts_to_x(server, calls);
  RawConnection c(server.port());
  c.send("POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\nabc");  // 7 bytes never come
  const std::string raw = c.read_all();
  EXPECT_TRUE(c.eof());
  EXPECT_EQ(status_of(raw), 408) << raw;
  // The answer names the bound that fired, and only it.
  EXPECT_NE(raw.find("within 50 ms of the last"), std::string::npos) << raw;
  EXPECT_EQ(raw.find("bytes per second"), std::string::npos) << raw;
  EXPECT_EQ(raw.find("of the request's head"), std::string::npos) << raw;
  EXPECT_NE(raw.find("Connection: close\r\n"), std::string::npos) << raw;
  expect_openai_error(body_of(raw), "invalid_request_error");
  EXPECT_EQ(calls.load(), 0);
}

// A head that stops arriving is closed without an answer, as before (slowloris: nothing is
// written to a client that never sent a request).
TEST(HttpServer, AStalledHeadIsClosedWithoutAnAnswer) {
  HttpServerOptions options = local_options();
  options.read_timeout = 50ms;
  HttpServer server(options);
  std::atomic<int> calls{0};
  count_posts_to_x(server, calls);
  RawConnection c(server.port());
  c.send("POST /x HTTP/1.1\r\nHost: a\r\n");
  EXPECT_EQ(c.read_all(), "");
  EXPECT_TRUE(c.eof());
  EXPECT_EQ(calls.load(), 0);
}

// The read timeout runs between reads of the body that make progress (nginx's
// client_body_timeout), not over the whole body: a client that uploads slowly but steadily gets
// a body in that takes it several read timeouts to send.
TEST(HttpServer, ASlowButSteadyUploadTakesLongerThanTheReadTimeout) {
  HttpServerOptions options = local_options();
  options.read_timeout = 250ms;
  HttpServer server(options);
  std::promise<size_t> got;
  server.route("POST", "/x", [&](const HttpRequest& request, std::shared_ptr<Exchange> ex) {
    got.set_value(request.body.size());
    ex->respond(200, "{}");
  });
  server.start();
  const size_t piece = 2048, pieces = 20;
  RawConnection c(server.port());
  c.send("POST /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\nContent-Length: " +
         std::to_string(piece * pieces) + "\r\n\r\n");
  // A piece per 40 ms: the body takes 800 ms or more, three read timeouts, while each piece
  // comes well within one.
  for (size_t i = 0; i < pieces; ++i) {
    std::this_thread::sleep_for(40ms);
    c.send(std::string(piece, 'b'));
  }
  const std::string raw = c.read_all();
  EXPECT_EQ(status_of(raw), 200) << raw;
  auto size = got.get_future();
  EXPECT_EQ(get_within(size), piece * pieces);
}

// A client that sends a byte within every read timeout, but far below the least average rate
// (HttpServerOptions::min_body_bytes_per_second), is answered 408 all the same: it cannot hold a
// connection for ever.
TEST(HttpServer, ABodyDrippedBelowTheLeastRateIsAnswered408) {
  HttpServerOptions options = local_options();
  options.read_timeout = 200ms;
  options.min_body_bytes_per_second = 1000;  // a byte earns 1 ms
  HttpServer server(options);
  std::atomic<int> calls{0};
  count_posts_to_x(server, calls);
  RawConnection c(server.port());
  c.send("POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 100000\r\n\r\n");
  // A byte per 20 ms, well within the read timeout, until the server answers: 200 ms plus a
  // millisecond per byte is spent after about ten bytes. 500 bytes would take 10 s.
  const std::string raw = upload_paced_until_answered(c, "b", 500, 20ms).raw;
  EXPECT_EQ(status_of(raw), 408) << raw;
  expect_openai_error(body_of(raw), "invalid_request_error");
  EXPECT_EQ(calls.load(), 0);
}

// Chunk framing earns no time at the least rate: only body data counts, as only data counts
// toward max_body_bytes. A chunk-size line may carry thousands of bytes of extensions for one
// byte of data; were those counted, a client could hold a connection for days on a few bytes.
TEST(HttpServer, AChunkedBodyWhoseFramingOutweighsItsDataIsAnswered408) {
  HttpServerOptions options = local_options();
  options.read_timeout = 2s;  // far over the pace below: only the least rate can bind
  options.min_body_bytes_per_second = 1000;  // a byte of data earns 1 ms
  HttpServer server(options);
  std::atomic<int> calls{0};
  count_posts_to_x(server, calls);
  RawConnection c(server.port());
  c.send("POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n");
  // A 1-byte chunk with 1000 bytes of extensions per 100 ms, well within the read timeout: about
  // 10 KB/s on the wire, 10 bytes/s of body. 2 s plus a millisecond per byte of data is spent
  // after about twenty chunks; counting the framing, each chunk would earn a second.
  const std::string chunk = "1;" + std::string(1000, 'e') + "\r\nb\r\n";
  const int chunks = 50;  // 5 s
  const auto [sent, raw] = upload_paced_until_answered(c, chunk, chunks, 100ms);
  // Answered while the client was still sending, not only once it stopped (a stop is 408 too).
  EXPECT_LT(sent, chunks) << "still open after " << chunks << " chunks";
  EXPECT_EQ(status_of(raw), 408) << raw;
  expect_openai_error(body_of(raw), "invalid_request_error");
  // The answer names the bound that fired, and only it.
  EXPECT_NE(raw.find("1000 bytes per second"), std::string::npos) << raw;
  EXPECT_EQ(raw.find("of the last"), std::string::npos) << raw;
  EXPECT_EQ(raw.find("of the request's head"), std::string::npos) << raw;
  EXPECT_EQ(calls.load(), 0);
}

// A body that keeps well above the least rate is answered 408 all the same once max_body_time has
// passed since its head: what a connection holds while its body arrives is held for a bounded time.
TEST(HttpServer, ABodyStillArrivingAtMaxBodyTimeIsAnswered408) {
  HttpServerOptions options = local_options();
  options.read_timeout = 2s;              // far over the pace below: it never binds
  options.min_body_bytes_per_second = 1;  // a byte earns a second: the least rate never binds
  options.max_body_time = 300ms;
  // Small enough that the total bound is max_body_time as set, not scaled up to the time
  // max_body_bytes takes at the slowest upload rate (8000 bytes: 286 ms).
  options.max_body_bytes = 8000;
  HttpServer server(options);
  std::atomic<int> calls{0};
  count_posts_to_x(server, calls);
  RawConnection c(server.port());
  c.send("POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 8000\r\n\r\n");
  // 100 bytes per 50 ms, until the server answers: 80 pieces would take 4 s.
  const std::string piece(100, 'b');
  const int pieces = 80;
  const auto [sent, raw] = upload_paced_until_answered(c, piece, pieces, 50ms);
  EXPECT_LT(sent, pieces) << "still open after " << pieces << " pieces";
  EXPECT_EQ(status_of(raw), 408) << raw;
  expect_openai_error(body_of(raw), "invalid_request_error");
  // The answer names the bound that fired, and only it.
  EXPECT_NE(raw.find("within 300 ms of the request's head"), std::string::npos) << raw;
  EXPECT_EQ(raw.find("of the last"), std::string::npos) << raw;
  EXPECT_EQ(raw.find("bytes per second"), std::string::npos) << raw;
  EXPECT_EQ(calls.load(), 0);
}

// The policy itself, on a clock of numbers (milliseconds).
TEST(BodyReadDeadline, ABodyWithNoBytesIsDueOneTimeoutAfterItsHead) {
  detail::BodyReadDeadline d(1000, 30s, 4096, 0ms);
  EXPECT_EQ(d.due_ms(), 31000);
  d.received(20000, 0, 0);  // a read that made no progress extends nothing
  EXPECT_EQ(d.due_ms(), 31000);
}

TEST(BodyReadDeadline, ASteadySlowUploadNeverFallsDueThoughItTakesLongerThanTheTimeout) {
  // The user trial's client: 1 MB at 25 KB/s, 40 s, past the 30 s that once bounded the whole.
  detail::BodyReadDeadline d(0, 30s, 4096, 0ms);
  int64_t now = 0;
  for (int second = 1; second <= 40; ++second) {
    now = second * 1000;
    ASSERT_LT(now, d.due_ms()) << "at " << second << " s";
    d.received(now, 25000, 25000);
  }
  EXPECT_GT(now, 30000);
  // It stops: due one timeout after the last bytes.
  EXPECT_EQ(d.due_ms(), now + 30000);
}

TEST(BodyReadDeadline, ADripWithinEveryTimeoutIsDueByTheLeastAverageRate) {
  // A byte every 29 s never misses the timeout between reads, but earns only 1/4096 s each.
  detail::BodyReadDeadline d(0, 30s, 4096, 0ms);
  d.received(29000, 1, 1);
  EXPECT_EQ(d.due_ms(), 30000);
  // 4096 bytes earn one second more.
  d.received(29500, 4095, 4095);
  EXPECT_EQ(d.due_ms(), 31000);
}

TEST(BodyReadDeadline, ChunkFramingMovesTheTimeBetweenReadsButEarnsNothingAtTheLeastRate) {
  // The review's client: a 1-byte chunk with ~4000 bytes of extensions once a second. Counted by
  // wire bytes it earned about a second per chunk (8 MiB of body in ~97 days).
  detail::BodyReadDeadline d(0, 30s, 4096, 0ms);
  for (int second = 1; second <= 29; ++second) d.received(second * 1000, 4010, 1);
  EXPECT_EQ(d.due_ms(), 30000 + 29 * 1000 / 4096);  // 30 s and 29 bytes' worth, 7 ms
  // A read of framing alone (a chunk-size line, a trailer) is progress between reads.
  detail::BodyReadDeadline between(0, 30s, 0, 0ms);
  between.received(20000, 6, 0);
  EXPECT_EQ(between.due_ms(), 50000);
}

TEST(BodyReadDeadline, AWholeBodyIsDueByTheTotalBoundHoweverFastItCame) {
  // The review's client: all but the last 70 bytes of an 8 MiB body at once, then a byte per
  // 29 s. The least rate alone gave it 30 s + 2048 s (34 minutes).
  detail::BodyReadDeadline d(0, 30s, 4096, 5min);
  d.received(1000, (8 << 20) - 70, (8 << 20) - 70);
  for (int64_t now = 30000; now < 300000; now += 29000) {
    ASSERT_LT(now, d.due_ms());
    d.received(now, 1, 1);
  }
  EXPECT_EQ(d.due_ms(), 300000);
  // The bound is the earliest of the three: one that stops is still due one timeout after.
  detail::BodyReadDeadline stopped(0, 30s, 4096, 5min);
  stopped.received(1000, 1 << 20, 1 << 20);
  EXPECT_EQ(stopped.due_ms(), 31000);
}

TEST(BodyReadDeadline, TheTotalBoundScalesWithTheLargestBodyAtTheSlowestUploadRate) {
  using detail::total_body_time;
  // The defaults: 8 MiB at 28 KB/s is 299.6 s, under the 5 minutes set.
  EXPECT_EQ(total_body_time(5min, 8 << 20), 5min);
  // A gateway that takes 50 MiB bodies: 50 MiB at 28 KB/s, 1872 s. A 125 KB/s upload of it
  // (400 s) was refused at 5 minutes.
  EXPECT_EQ(total_body_time(5min, 50 << 20), std::chrono::milliseconds((50 << 20) / 28));
  EXPECT_GT(total_body_time(5min, 50 << 20), 400s);
  // A bound set above the scaled one stays; 0 (no total bound) stays none.
  EXPECT_EQ(total_body_time(1h, 50 << 20), 1h);
  EXPECT_EQ(total_body_time(0ms, 50 << 20), 0ms);
  // The largest max_body_bytes does not overflow.
  EXPECT_EQ(total_body_time(5min, std::numeric_limits<size_t>::max()),
            std::chrono::milliseconds(std::numeric_limits<size_t>::max() / 28));
}

TEST(BodyReadDeadline, WithoutALeastRateOnlyTheTimeBetweenReadsCounts) {
  detail::BodyReadDeadline d(0, 30s, 0, 0ms);
  d.received(29000, 1, 1);
  EXPECT_EQ(d.due_ms(), 59000);
}

TEST(HttpServer, ResponseHeadersCannotInjectLines) {
  HttpServer server(local_options());
  std::promise<bool> threw;
  server.route("GET", "/x", [&](const HttpRequest&, std::shared_ptr<Exchange> ex) {
    HttpResponse r;
    try {
      r.headers.add("X-Evil", "a\r\nSet-Cookie: b");
      threw.set_value(false);
    } catch (const Error&) {
      threw.set_value(true);
    }
    ex->respond(std::move(r));
  });
  server.start();
  auto r = http_request("127.0.0.1", server.port(), "GET", "/x");
  EXPECT_EQ(r.status, 200);
  EXPECT_FALSE(r.headers.contains("Set-Cookie"));
  auto f = threw.get_future();
  EXPECT_TRUE(get_within(f));
}

// Input that cannot be HTTP is refused as soon as it arrives, not after a timeout: the
// timeouts here are an hour, the test's reads give up after 10 s.
TEST(HttpServer, BytesThatCannotStartARequestAre400AtOnce) {
  HttpServerOptions options = local_options();
  options.header_timeout = options.read_timeout = std::chrono::hours(1);
  HttpServer server(options);
  std::atomic<int> calls{0};
  count_posts_to_x(server, calls);
  const std::string tls_hello("\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 11);
  for (const std::string& bad :
       {tls_hello, std::string("\x00\x01\x02junk", 7), std::string("SSH-2.0-OpenSSH_9.2\r\n"),
        std::string("GET /x HTTP/1.1 and more\r\n"), std::string(40, 'A')}) {
    RawConnection c(server.port());
    c.send(bad);
    std::string raw = c.read_all();
    EXPECT_TRUE(c.eof()) << ascii_excerpt(bad);
    EXPECT_EQ(status_of(raw), 400) << ascii_excerpt(bad) << " -> " << raw;
    expect_openai_error(body_of(raw), "invalid_request_error");
  }
  RawConnection c(server.port());
  c.send(tls_hello);
  EXPECT_NE(c.read_all().find("not TLS"), std::string::npos);
  EXPECT_EQ(calls.load(), 0);
}

// Blank lines before a request are allowed, but not without end: past max_header_bytes they are
// a head too large (before, they were skipped for as long as they came, rescanned on every read).
TEST(HttpServer, EndlessBlankLinesBeforeARequestAre431) {
  HttpServerOptions options = local_options();
  options.header_timeout = options.read_timeout = std::chrono::hours(1);
  options.max_header_bytes = 8192;
  HttpServer server(options);
  std::atomic<int> calls{0};
  count_posts_to_x(server, calls);
  std::string flood;
  for (int i = 0; i < 5000; ++i) flood += "\r\n";
  RawConnection c(server.port());
  c.send(flood);
  std::string raw = c.read_all();
  EXPECT_TRUE(c.eof());
  EXPECT_EQ(status_of(raw), 431) << raw;
  expect_openai_error(body_of(raw), "invalid_request_error");

  RawConnection fine(server.port());  // a few are skipped, as RFC 9112 2.2 allows
  fine.send(
      "\r\n\r\nPOST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}");
  raw = fine.read_all();
  EXPECT_EQ(status_of(raw), 200) << raw;
  EXPECT_EQ(calls.load(), 1);
}

// A head or chunk header with bare LF line endings gets 400 at once, not silence until the
// header or read timeout (an hour here; the test's reads give up after 10 s).
TEST(HttpServer, BareLineFeedsAre400AtOnce) {
  HttpServerOptions options = local_options();
  options.header_timeout = options.read_timeout = std::chrono::hours(1);
  HttpServer server(options);
  std::atomic<int> calls{0};
  count_posts_to_x(server, calls);
  for (const std::string bad :
       {"POST /x HTTP/1.1\nHost: a\nContent-Length: 2\n\n{}", "GET /x HTTP/1.1\r\nHost: a\n",
        "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\n{}\n0\n\n"}) {
    RawConnection c(server.port());
    c.send(bad);
    std::string raw = c.read_all();
    EXPECT_TRUE(c.eof()) << bad;
    EXPECT_EQ(status_of(raw), 400) << bad << " -> " << raw;
    EXPECT_NE(raw.find("bare LF line ending"), std::string::npos) << raw;
    expect_openai_error(body_of(raw), "invalid_request_error");
  }
  EXPECT_EQ(calls.load(), 0);
}

// RFC 9112 3.2: no Host on HTTP/1.1, two Host fields or a Host that is no host[:port], on any
// version, is 400.
TEST(HttpServer, ARequestWithoutOneValidHostIs400) {
  HttpServer server(local_options());
  server.route("GET", "/x",
               [](const HttpRequest&, std::shared_ptr<Exchange> ex) { ex->respond(200, "{}"); });
  server.start();
  for (std::string bad :
       {"GET /x HTTP/1.1\r\n\r\n", "GET /x HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        "GET /x HTTP/1.0\r\nHost: a\r\nHost: a\r\n\r\n",
        "GET /x HTTP/1.1\r\nHost: exa mple.com\r\n\r\n", "GET /x HTTP/1.1\r\nHost: a:b:c/d\r\n\r\n",
        "GET /x HTTP/1.0\r\nHost: a/b\r\n\r\n"}) {
    RawConnection c(server.port());
    c.send(bad);
    std::string raw = c.read_all();
    EXPECT_EQ(status_of(raw), 400) << ascii_excerpt(bad) << " -> " << raw;
    expect_openai_error(body_of(raw), "invalid_request_error");
    EXPECT_NE(body_of(raw).find("Host"), std::string::npos) << raw;
  }
  // HTTP/1.0 has no Host requirement.
  RawConnection c(server.port());
  c.send("GET /x HTTP/1.0\r\n\r\n");
  EXPECT_EQ(status_of(c.read_all()), 200);
}

TEST(HttpServer, HeadIsAnsweredByTheGetHandlerWithTheHeadOnly) {
  HttpServer server(local_options());
  server.route("GET", "/x", [](const HttpRequest&, std::shared_ptr<Exchange> ex) {
    ex->respond(200, "hello", "text/plain");
  });
  server.route("GET", "/stream", [](const HttpRequest&, std::shared_ptr<Exchange> ex) {
    ex->start_stream();
    ex->write("data: 1\n\n");
    ex->end();
  });
  server.start();
  {
    RawConnection c(server.port());
    c.send("HEAD /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
    std::string raw = c.read_all();
    EXPECT_EQ(status_of(raw), 200) << raw;
    EXPECT_NE(raw.find("Content-Length: 5\r\n"), std::string::npos) << raw;
    EXPECT_EQ(body_of(raw), "") << raw;
  }
  {
    // Keep-alive: the next request's answer follows the head directly.
    RawConnection c(server.port());
    c.send(
        "HEAD /stream HTTP/1.1\r\nHost: a\r\n\r\nGET /x HTTP/1.1\r\nHost: a\r\nConnection: "
        "close\r\n\r\n");
    std::string raw = c.read_all();
    EXPECT_EQ(status_of(raw), 200) << raw;
    size_t second = raw.find("HTTP/1.1", 1);
    ASSERT_NE(second, std::string::npos) << raw;
    EXPECT_EQ(raw.substr(second - 4, 4), "\r\n\r\n") << raw;  // the first head, nothing after it
    EXPECT_EQ(raw.find("data:"), std::string::npos) << raw;
    EXPECT_EQ(body_of(raw.substr(second)), "hello") << raw;
  }
  auto r = http_request("127.0.0.1", server.port(), "POST", "/x", "{}");
  EXPECT_EQ(r.status, 405);
  EXPECT_EQ(r.headers.get("Allow"), "GET, HEAD");
}

// A HEAD whose GET handler throws or drops its exchange gets the 500 as a head only: a body
// after it would be read by a keep-alive client as the start of its next response.
TEST(HttpServer, AHeadAnsweredByTheAbortPathGetsTheHeadOnly) {
  HttpServer server(local_options());
  server.route("GET", "/throw", [](const HttpRequest&, std::shared_ptr<Exchange>) {
    throw std::runtime_error("boom");
  });
  server.route("GET", "/forget", [](const HttpRequest&, std::shared_ptr<Exchange>) {});
  server.route("GET", "/x", [](const HttpRequest&, std::shared_ptr<Exchange> ex) {
    ex->respond(200, "hello", "text/plain");
  });
  server.start();
  for (const char* path : {"/throw", "/forget"}) {
    RawConnection c(server.port());
    c.send("HEAD " + std::string(path) +
           " HTTP/1.1\r\nHost: a\r\n\r\nGET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
    std::string raw = c.read_all();
    EXPECT_EQ(status_of(raw), 500) << raw;
    EXPECT_NE(raw.find("Content-Length: "), std::string::npos) << raw;
    const size_t second = raw.find("\r\n\r\n") + 4;
    EXPECT_EQ(raw.compare(second, 12, "HTTP/1.1 200"), 0) << path << ": " << raw;
    EXPECT_EQ(body_of(raw.substr(second)), "hello") << raw;
  }
}

TEST(HttpServer, TraceConnectAndUnknownMethodsAre501) {
  HttpServer server(local_options());
  server.route("GET", "/x",
               [](const HttpRequest&, std::shared_ptr<Exchange> ex) { ex->respond(200, "{}"); });
  server.start();
  for (std::string method : {"TRACE", "CONNECT", "BREW"}) {
    RawConnection c(server.port());
    c.send(method + " /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
    std::string raw = c.read_all();
    EXPECT_EQ(status_of(raw), 501) << raw;
    EXPECT_NE(body_of(raw).find(method), std::string::npos) << raw;
  }
}

TEST(HttpServer, AHeadSentSlowlyIsClosedAfterTheHeaderTimeout) {
  HttpServerOptions options = local_options();
  options.header_timeout = 50ms;
  options.read_timeout = std::chrono::hours(1);
  HttpServer server(options);
  std::atomic<int> calls{0};
  count_posts_to_x(server, calls);
  RawConnection c(server.port());
  c.send("POST /x HTTP/1.1\r\nHost: a\r\nContent-Le");  // the rest never comes
  EXPECT_EQ(c.read_all(), "");
  EXPECT_TRUE(c.eof());
  EXPECT_EQ(calls.load(), 0);
}

TEST(HttpServer, ConnectionsPastTheCapAreClosedAndLoggedOnce) {
  HttpServerOptions options = local_options();
  options.threads = 1;
  options.max_connections = 2;
  ServerLog log;
  options.log = log.sink();
  HttpServer server(options);
  std::atomic<int> calls{0};
  count_posts_to_x(server, calls);
  EXPECT_EQ(server.max_connections(), 2u);
  RawConnection a(server.port()), b(server.port());
  std::string got;
  a.send(kPostToX);
  ASSERT_TRUE(a.read_until(got, "{}"));  // both are accepted and held
  got.clear();
  b.send(kPostToX);
  ASSERT_TRUE(b.read_until(got, "{}"));
  for (int i = 0; i < 3; ++i) {
    RawConnection refused(server.port());
    EXPECT_EQ(refused.read_all(), "");
    EXPECT_TRUE(refused.eof());
  }
  got.clear();
  a.send(kPostToX);  // the connections it holds are still served
  EXPECT_TRUE(a.read_until(got, "{}"));
  const auto logged = log.lines();
  ASSERT_EQ(logged.size(), 1u);
  EXPECT_NE(logged[0].find("connection cap reached (2 connections)"), std::string::npos);
}

TEST(HttpServer, OneAddressHoldsAtMostItsOwnCapAndOthersAreStillServed) {
  HttpServerOptions options = local_options();
  options.threads = 1;
  options.max_connections_per_address = 2;
  ServerLog log;
  options.log = log.sink();
  HttpServer server(options);
  std::atomic<int> calls{0};
  count_posts_to_x(server, calls);
  // Two connections from one address that send nothing (a slowloris's) are held.
  auto a = std::make_unique<RawConnection>(server.port(), "127.0.0.1");
  RawConnection b(server.port(), "127.0.0.1");
  ASSERT_TRUE(post_to_x_answered(b));
  for (int i = 0; i < 3; ++i) {
    RawConnection refused(server.port(), "127.0.0.1");
    EXPECT_EQ(refused.read_all(), "");
    EXPECT_TRUE(refused.eof());
  }
  // Another address is served, up to its own cap.
  RawConnection other(server.port(), "127.0.0.2");
  EXPECT_TRUE(post_to_x_answered(other));
  // A connection that closes gives its address a place back.
  a.reset();
  bool readmitted = false;
  for (int i = 0; i < 200 && !readmitted; ++i) {  // the close reaches the server's loop first
    RawConnection again(server.port(), "127.0.0.1");
    readmitted = post_to_x_answered(again);
  }
  EXPECT_TRUE(readmitted);
  EXPECT_TRUE(post_to_x_answered(b));
  const auto logged = log.lines();
  ASSERT_GE(logged.size(), 1u);
  EXPECT_NE(logged[0].find("per-address connection cap reached (2 from 127.0.0.1)"),
            std::string::npos)
      << logged[0];
  EXPECT_LE(logged.size(), 2u) << "refusals are logged once per interval, not each";
}

// Gateway replicas behind one port are servers of their own; each counted an address's
// connections for itself, so one address held the cap on every replica (N times it). Servers that
// share one count hold the cap between them.
TEST(HttpServer, ServersSharingAPerAddressCountHoldItsCapBetweenThem) {
  const auto shared = std::make_shared<ConnectionsPerAddress>(2);
  std::vector<std::unique_ptr<HttpServer>> servers;
  std::atomic<int> calls{0};
  for (int i = 0; i < 2; ++i) {
    HttpServerOptions options = local_options();
    options.threads = 1;
    options.max_connections_per_address = 5;  // the shared count's limit applies instead
    options.connections_per_address = shared;
    options.log = [](const std::string&) {};
    servers.push_back(std::make_unique<HttpServer>(options));
    count_posts_to_x(*servers.back(), calls);
  }
  auto a = std::make_unique<RawConnection>(servers[0]->port(), "127.0.0.1");
  ASSERT_TRUE(post_to_x_answered(*a));
  RawConnection b(servers[1]->port(), "127.0.0.1");
  ASSERT_TRUE(post_to_x_answered(b));
  // The address holds 2: a third connection is refused by either server.
  for (const auto& server : servers) {
    RawConnection refused(server->port(), "127.0.0.1");
    EXPECT_EQ(refused.read_all(), "");
    EXPECT_TRUE(refused.eof());
  }
  RawConnection other(servers[0]->port(), "127.0.0.2");
  EXPECT_TRUE(post_to_x_answered(other));
  // A connection closed on one server gives the address a place on the other.
  a.reset();
  bool readmitted = false;
  for (int i = 0; i < 200 && !readmitted; ++i) {  // the close reaches the server's loop first
    RawConnection again(servers[1]->port(), "127.0.0.1");
    readmitted = post_to_x_answered(again);
  }
  EXPECT_TRUE(readmitted);
}

// A shared count's limit applies in place of max_connections_per_address, whose 0 is no limit; a
// count of 0 refused every connection, and each refusal left an entry for its address, so the
// count grew with every address that called.
TEST(HttpServer, ASharedPerAddressCountOfZeroLimitsNoAddress) {
  const auto shared = std::make_shared<ConnectionsPerAddress>(0);
  HttpServerOptions options = local_options();
  options.threads = 1;
  options.connections_per_address = shared;
  options.log = [](const std::string&) {};
  HttpServer server(options);
  std::atomic<int> calls{0};
  count_posts_to_x(server, calls);
  std::vector<std::unique_ptr<RawConnection>> held;
  for (const char* address : {"127.0.0.1", "127.0.0.1", "127.0.0.1", "127.0.0.2"}) {
    held.push_back(std::make_unique<RawConnection>(server.port(), address));
    std::string got;
    held.back()->send(kPostToX);
    EXPECT_TRUE(held.back()->read_until(got, "{}")) << address;
  }
  EXPECT_EQ(calls.load(), 4);
  EXPECT_EQ(shared->addresses(), 0u);
}

TEST(ConnectionsPerAddress,
     AnAddressIsCountedUntilItsLastConnectionClosesAndALimitOfZeroCountsNone) {
  ConnectionsPerAddress count(1);
  EXPECT_TRUE(count.admit("a"));
  EXPECT_FALSE(count.admit("a"));
  EXPECT_EQ(count.addresses(), 1u);
  count.release("a");
  EXPECT_EQ(count.addresses(), 0u);
  count.release("never admitted");
  EXPECT_EQ(count.addresses(), 0u);
  ConnectionsPerAddress unlimited(0);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(unlimited.admit("b"));
  EXPECT_EQ(unlimited.addresses(), 0u);
}

TEST(HttpServer, TheDefaultConnectionCapIsThreeQuartersOfTheDescriptorLimit) {
  HttpServer server(local_options());
  server.start();
  rlimit limit{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &limit), 0);
  if (limit.rlim_cur != RLIM_INFINITY) {
    EXPECT_EQ(server.max_connections(), std::max<size_t>(16, limit.rlim_cur / 4 * 3));
  }
}

}  // namespace
}  // namespace tandem::net
