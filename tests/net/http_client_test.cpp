// The synchronous HTTP client against scripted servers: what it does when a kept-alive connection
// fails, and how it ends bodies that a reset cuts. Every server binds port 0 on 127.0.0.1.
#include "net/http_client.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "scripted_server.h"
#include "util/error.h"

namespace tandem::net {
namespace {

// A client that reuses its connection however long the test pauses between requests: the tests
// that need the reuse must not depend on the machine's speed.
HttpClientOptions ageless() {
  HttpClientOptions options;
  options.max_idle_age = std::chrono::milliseconds(0);
  return options;
}

// A server that read a whole POST on a reused connection and closed without answering may have
// run it: the client reports the failure rather than run it a second time.
TEST(HttpClient, APostTheServerReadWholeIsNotSentAgain) {
  std::atomic<int> posts{0};
  ScriptedServer server(closes_first_connection_at(2, posts));
  HttpClient client("127.0.0.1", server.port(), ageless());
  EXPECT_EQ(client.request("POST", "/v1/completions", "{}").body, "answer 1");
  try {
    const HttpClientResponse r = client.request("POST", "/v1/completions", "{}");
    ADD_FAILURE() << "sent again and answered: " << r.body;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("connection closed by the server"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(posts.load(), 2);
}

// A GET is sent again: the usual cause is a keep-alive connection the server closed.
TEST(HttpClient, AGetOnAConnectionClosedUnansweredIsSentAgain) {
  std::atomic<int> gets{0};
  ScriptedServer server(closes_first_connection_at(2, gets));
  HttpClient client("127.0.0.1", server.port(), ageless());
  EXPECT_EQ(client.request("GET", "/health").body, "answer 1");
  EXPECT_EQ(client.request("GET", "/health").body, "answer 3");
  EXPECT_EQ(gets.load(), 3);
}

// A kept-alive connection idle for max_idle_age is not reused: the server may be closing it at
// its keep-alive timeout (uvicorn's 5 s), and a POST that went out whole as it closed would not be
// sent again. The test's clock stands still between requests unless the test moves it.
TEST(HttpClient, AConnectionIdlePastTheMaxAgeIsNotReused) {
  std::atomic<int> posts{0};
  ScriptedServer server(closes_first_connection_at(3, posts, true));
  std::atomic<int64_t> now_ms{0};
  HttpClientOptions options;
  options.max_idle_age = std::chrono::hours(1);
  options.clock = [&] {
    return std::chrono::steady_clock::time_point(std::chrono::milliseconds(now_ms.load()));
  };
  HttpClient client("127.0.0.1", server.port(), options);
  const auto post_after = [&](std::chrono::milliseconds idle) {
    now_ms += idle.count();
    try {
      return client.request("POST", "/v1/completions", "{}").body;
    } catch (const Error& e) {
      return std::string("error: ") + e.what();
    }
  };
  EXPECT_EQ(post_after(std::chrono::milliseconds(0)), "answer 1 on connection 0");
  EXPECT_EQ(post_after(std::chrono::minutes(59)), "answer 2 on connection 0");  // reused
  // Without the fix: error: ... connection closed by the server.
  EXPECT_EQ(post_after(std::chrono::hours(1)), "answer 3 on connection 1");
  EXPECT_EQ(posts.load(), 3);
}

// A server that refuses a large body from its head answers, then closes with the body unread (a
// reset), while the client is still sending. The answer is the outcome, not the failed send.
TEST(HttpClient, AnAnswerBeforeAResetIsTheOutcomeNotTheFailedSend) {
  std::atomic<int> connections{0};
  ScriptedServer server([&](int& fd, int) {
    ++connections;
    std::string buffer;
    if (ScriptedServer::read_head(fd, buffer).empty()) return;
    ScriptedServer::write(fd,
                          "HTTP/1.1 413 Content Too Large\r\nContent-Length: 8\r\n\r\ntoo long");
    // In the client's socket before the reset, whenever the client looks.
    EXPECT_TRUE(ScriptedServer::wait_acknowledged(fd));
  });
  HttpClient client("127.0.0.1", server.port(), std::chrono::seconds(10));
  try {
    // More than the socket buffers hold: the client is still sending when the reset comes.
    const HttpClientResponse r =
        client.request("POST", "/v1/completions", std::string(size_t{16} << 20, 'a'));
    EXPECT_EQ(r.status, 413);
    EXPECT_EQ(r.body, "too long");
  } catch (const Error& e) {
    ADD_FAILURE() << e.what();  // without the fix: cannot send the request: Connection reset...
  }
  EXPECT_EQ(connections.load(), 1);
}

// A 101 the client never asked for is an error, and the connection is not used again.
TEST(HttpClient, An101IsAnError) {
  ScriptedServer server([&](int& fd, int connection) {
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
  HttpClient client("127.0.0.1", server.port());
  try {
    const HttpClientResponse r = client.request("GET", "/v1/models");
    ADD_FAILURE() << "taken as an answer: " << r.status;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("switched protocols"), std::string::npos) << e.what();
  }
  EXPECT_EQ(client.request("GET", "/v1/models").body, "models");
}

// A body that ends with the connection is whole only if the connection closed; a reset cuts it,
// and the client says so instead of handing back the part as if it were all.
TEST(HttpClient, ABodyUntilCloseCutByAResetIsAnError) {
  std::atomic<bool> got_part{false};
  ScriptedServer server([&](int& fd, int) {
    std::string buffer;
    if (!read_request(fd, buffer)) return;
    ScriptedServer::write(fd, "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\npart");
    for (int i = 0; i < 5000 && !got_part; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const linger reset{1, 0};  // close with RST
    ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof reset);
  });
  HttpClient client("127.0.0.1", server.port());
  std::string body;
  try {
    client.request_stream("GET", "/v1/models", {}, {}, [&](std::string_view piece) {
      body += piece;
      got_part = true;
      return true;
    });
    ADD_FAILURE() << "a cut body came back as whole: " << body;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("connection reset by the server"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(body, "part");
}

// bench stops when nothing listens at --base-url but only warns when a server is slow to answer:
// the client tells a failed connection (refused, a host that does not resolve) from a timeout of
// a server that took the connection.
TEST(HttpClient, AFailedConnectionIsAConnectErrorAndATimeoutIsNot) {
  // Port 1 refuses at once.
  EXPECT_THROW(http_request("127.0.0.1", 1, "GET", "/v1/models"), HttpConnectError);
  EXPECT_THROW(http_request("999.1.1.1", 80, "GET", "/v1/models"), HttpConnectError);
  // A listener that never accepts: the kernel completes the connection, no answer comes.
  uint16_t port = 0;
  const int listener = listen_on_loopback(port, 65536);
  try {
    http_request("127.0.0.1", port, "GET", "/v1/models", {}, {}, std::chrono::milliseconds(50));
    ADD_FAILURE() << "answered";
  } catch (const HttpConnectError& e) {
    ADD_FAILURE() << "a timeout taken for no server: " << e.what();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("timed out"), std::string::npos) << e.what();
  }
  ::close(listener);
}

// A host that never completes the handshake (SYN dropped: firewalled, down) is no server either:
// bench stops rather than run the whole benchmark against it. Linux drops a SYN to a listener
// whose accept queue is full, as such a host does.
TEST(HttpClient, AConnectionNeverCompletedIsAConnectError) {
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof at;
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_EQ(::bind(listener, reinterpret_cast<const sockaddr*>(&at), sizeof at), 0);
  ASSERT_EQ(::listen(listener, 0), 0);  // room for one connection, never accepted
  ASSERT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&at), &length), 0);
  const int first = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_EQ(::connect(first, reinterpret_cast<const sockaddr*>(&at), sizeof at), 0);
  try {
    http_request("127.0.0.1", ntohs(at.sin_port), "GET", "/v1/models", {}, {},
                 std::chrono::milliseconds(50));
    ADD_FAILURE() << "answered";
  } catch (const HttpConnectError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot connect"), std::string::npos) << e.what();
  } catch (const Error& e) {
    ADD_FAILURE() << "a host that drops the connection taken for a slow server: " << e.what();
  }
  ::close(first);
  ::close(listener);
}

}  // namespace
}  // namespace tandem::net
