#pragma once
// The one HTTP/1.1 server of Tandem (engine API, gateway, metrics). Its own epoll event loops and
// HTTP/1.1 parser underneath (net/event_loop.h, net/http_wire.h); none of it shows here, so this
// header stays cheap to include.
//
// Threading model. `threads` io threads, each an event loop; a connection lives on the loop that
// accepted it. Handlers are called on that io thread and must return quickly: they parse the
// request, hand it to whoever does the work (the engine's step loop) and return. The work side
// answers later, from any thread, through the `Exchange` it was given: one complete response, or
// a stream of chunks (SSE). Nothing on the Exchange blocks on the socket: bytes are queued and the
// connection's io thread writes them (at the end of its current iteration when the producer is
// that thread itself, e.g. a relay from an AsyncHttpClient on the server's threads). The connection
// keeps reading while a response is pending, so a client that goes away is noticed at once, even if
// nothing is being written; the work side learns it through `Exchange::closed()` and
// `Exchange::on_close()` and can free what the request holds.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "net/http.h"

namespace tandem::net {

namespace detail {
class ExchangeState;
class LoopGroup;
class ServerImpl;
}  // namespace detail

class AsyncHttpClient;
class LoopTasks;

// One request and its response, shared between the connection and whoever produces the
// response. Hold it by shared_ptr as long as you may still write; every method may be called
// from any thread, concurrently. Methods that send return false, and do nothing, when the
// exchange cannot take that call any more: the client is gone, the server is stopping, or the
// response is already complete (or, for write/end, was never started as a stream).
//
// If the last shared_ptr is dropped before the response is complete, the server answers 500 (if
// nothing was sent yet) or cuts the connection (mid-stream), so a lost response never hangs a
// client. A status outside 200..999, or an invalid header, throws tandem::Error.
class Exchange {
 public:
  explicit Exchange(std::shared_ptr<detail::ExchangeState> state);
  ~Exchange();
  Exchange(const Exchange&) = delete;
  Exchange& operator=(const Exchange&) = delete;

  const HttpRequest& request() const;
  // Moves the request's body out (request().body is empty afterwards), for a handler that keeps
  // the body beyond its call, as a queue does: a copy would hold it twice for as long as the
  // request waits (up to max_body_bytes each). Only on the handler's thread, before anything else
  // may read request().body.
  std::string take_body();

  // A complete response.
  bool respond(HttpResponse response);
  bool respond(int status, std::string body, std::string content_type = "application/json");
  // `status` with the server's error body (HttpServerOptions::error_response) for this message,
  // type and code.
  bool send_error(int status, std::string_view message, std::string_view type = {},
                  std::string_view code = {});

  // Streaming: start_stream sends the status line and headers (chunked transfer encoding; for an
  // HTTP/1.0 client the body is unframed and the connection closes at the end), write() queues
  // one chunk (empty chunks are skipped), end() sends the terminating chunk.
  bool start_stream(int status = 200, std::string content_type = "text/event-stream",
                    Headers headers = {});
  bool write(std::string_view chunk);
  bool end();

  // True once nothing more can reach the client: it disconnected (or half-closed its side), a
  // write failed or timed out, it read too slowly for a stream (HttpServerOptions::
  // max_unsent_bytes), or the server is stopping. Stays false after a response completed
  // normally.
  bool closed() const;
  // `callback` runs once if the exchange closes (as closed()) before the response is complete.
  // It runs on an io thread, so it must be quick and must not block (queue an abort, set a flag).
  // If the exchange is already closed it runs right away on the calling thread; mind the locks
  // you hold. Registered after the response is complete, it is dropped without running.
  void on_close(std::function<void()> callback);
  // True once respond() or end() was accepted.
  bool complete() const;

  // Marks the exchange as failed: as if the last reference had been dropped (see above). For the
  // server's own use when a handler throws; callable by producers that give up.
  void abort();

 private:
  std::shared_ptr<detail::ExchangeState> state_;
};

// This process's file descriptor limit (RLIMIT_NOFILE); nullopt when unknown or unlimited.
std::optional<size_t> descriptor_limit();
// The connection cap of a server without max_connections, for a process whose descriptor limit
// is `limit` (descriptor_limit()): three quarters of it, so that a flood of connections leaves
// the process descriptors for its upstream connections and files.
size_t default_max_connections(std::optional<size_t> limit);

// Client connections held at once per peer address, counted for one server or for several that
// share it (gateway replicas behind one port, each with a server of its own: the kernel spreads an
// address's connections over them, so only a count they share bounds the address). Thread-safe.
class ConnectionsPerAddress {
 public:
  explicit ConnectionsPerAddress(size_t limit) : limit_(limit) {}
  size_t limit() const { return limit_; }
  // Takes a place for a new connection from `address`: false when it holds `limit` already.
  // A limit of 0 is no limit (as max_connections_per_address 0): every connection is admitted
  // and none is counted.
  bool admit(const std::string& address);
  // A connection admit() took a place for has closed.
  void release(const std::string& address);
  // How many addresses hold a connection now.
  size_t addresses() const;

 private:
  const size_t limit_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, size_t> held_;  // under mu_; addresses holding none are absent
};

// Runs on an io thread; see the threading model above. `request` is exchange->request(), valid as
// long as the exchange. An exception escaping the handler becomes a 500 (or cuts a stream it
// started) and is logged; the server keeps running.
using Handler = std::function<void(const HttpRequest& request, std::shared_ptr<Exchange> exchange)>;

struct HttpServerOptions {
  std::string host = "0.0.0.0";
  uint16_t port = 0;  // 0: an ephemeral port, see HttpServer::port()
  // What set host and port, as start()'s listen errors name them (the gateway's may come from its
  // topology file: "--port/listen.port").
  std::string host_flag = "--host";
  std::string port_flag = "--port";
  // SO_REUSEPORT: other servers (gateway replicas) may listen on the same port; the kernel
  // spreads connections over them.
  bool reuse_port = false;
  int threads = 1;  // io threads
  size_t max_body_bytes = size_t{8} << 20;
  size_t max_header_bytes = size_t{64} << 10;
  // A request's head must arrive completely within this time of its first byte, so that a client
  // sending its head a byte at a time (slowloris) cannot hold a connection for long.
  std::chrono::milliseconds header_timeout = std::chrono::seconds(10);
  // A request's body, once its head arrived, must make progress within this time of its head and
  // then of each read that brought body bytes (between two successive reads, as nginx's
  // client_body_timeout), also while a 100 Continue waits to be written. A client that uploads
  // slowly but steadily (at min_body_bytes_per_second or more) gets its whole body in, up to
  // max_body_time; one whose body stops is answered 408 (error_response) and closed. The head is
  // bound by header_timeout and by this time from its first byte, whichever is shorter, and closed
  // without an answer.
  std::chrono::milliseconds read_timeout = std::chrono::seconds(30);
  // The least average rate of a body: it must be complete within read_timeout of its head plus
  // one second per this many bytes of body data received (as Apache's mod_reqtimeout MinRate;
  // chunk framing earns nothing, as it counts nothing toward max_body_bytes), else 408. So a
  // client that sends a byte within every read_timeout cannot hold a connection, and the body
  // buffer it holds, for ever. 4 KiB/s is below any working link (GPRS is about 5 KB/s). 0: no
  // least rate (only read_timeout between reads, and max_body_time).
  size_t min_body_bytes_per_second = 4096;
  // A body must be complete within this time of its head, however fast it comes (as Apache's
  // mod_reqtimeout body=...-maxtimeout), else 408. The least rate alone lets a client that sent
  // all but the last bytes of an 8 MiB body hold it, and its connection, for 34 minutes, dripping
  // the rest; with this bound a connection holds a body for 5 minutes at the most. 5 minutes is
  // what an 8 MiB body (max_body_bytes) takes at 28 KB/s, a slow mobile upload. The bound the
  // server applies is this or the time max_body_bytes takes at 28 KB/s, whichever is longer
  // (total_body_time in body_read_deadline.h): a server that takes larger bodies takes them from
  // slow clients too (50 MiB: 1872 s), with no second setting to raise. 0: no total bound.
  std::chrono::milliseconds max_body_time = std::chrono::minutes(5);
  // A keep-alive connection waiting for its next request is closed after this time.
  std::chrono::milliseconds idle_timeout = std::chrono::seconds(60);
  // While output waits for the client, each send must make progress within this time of the
  // last one that did (between two successive writes, as nginx's send_timeout), otherwise the
  // client is taken as gone. A client that reads slowly but steadily gets its whole response,
  // however long it takes. No timeout while the server waits for a handler.
  std::chrono::milliseconds write_timeout = std::chrono::seconds(60);
  // The most response bytes one exchange may hold unsent (queued by its producer plus what its
  // connection is still writing). A stream's write() that would go past it takes the client as
  // stalled, as the write timeout does, but before the server holds a write timeout's worth of a
  // fast producer's output: the exchange closes (its on_close callbacks run, so the producer stops
  // its work) and write() returns false. A chunk written while nothing is unsent always goes,
  // whatever its size. Complete responses (respond()) are not limited: their size is their own.
  size_t max_unsent_bytes = size_t{16} << 20;
  // Client connections held at once. Past it a new connection is closed as soon as it is
  // accepted (and logged once per 10 s with a count), so the process keeps file descriptors for
  // its own work and the connections it serves keep being served. 0: three quarters of the
  // process's file descriptor limit (RLIMIT_NOFILE).
  size_t max_connections = 0;
  // Client connections held at once from one peer address, within max_connections; past it a
  // new connection from that address is closed as it is accepted (logged like the cap), so one
  // host cannot take every connection (slowloris from one machine). 0: no per-address limit,
  // for servers behind a proxy or load balancer, where every client shares its address.
  size_t max_connections_per_address = 0;
  // The count of connections per address shared with other servers, whose limit then applies in
  // place of max_connections_per_address (0: no limit). Null: the server counts its own.
  std::shared_ptr<ConnectionsPerAddress> connections_per_address;
  // Where the server reports what only an operator can act on (handler exceptions, accept
  // failures, the connection cap). Empty: standard error.
  std::function<void(const std::string&)> log;
  // The body of every error the server sends (net/http.h).
  ErrorFormatter error_response = plain_error_response;
  // CORS, for pages in a browser: the origins (e.g. "https://app.example.com") whose requests
  // (with an Origin header) are answered with Access-Control-Allow-Origin; "*": any, as vLLM's
  // default --allowed-origins. Such a page's preflight (OPTIONS with
  // Access-Control-Request-Method) to a path with routes is answered 200 with the path's
  // methods and the headers it asked for. Empty: no CORS (OPTIONS is a 405 as any other method).
  std::vector<std::string> allowed_origins = {"*"};
};

// Why `origin` can be no entry of HttpServerOptions::allowed_origins, which browsers compare
// whole with their Origin header: "*", "null" (the Origin of a file:// page or a sandboxed
// iframe), or scheme://host[:port] without a path (a trailing '/' never matches); empty when it
// can.
std::string allowed_origin_error(std::string_view origin);
// `--allowed-origins`' value as `tandem gateway`, `engine` and `serve` take it: origins separated
// by commas, or vLLM's JSON list (["https://app.example.com"]); "" allows none (no CORS). Throws
// tandem::Error naming the entry that is no origin.
std::vector<std::string> parse_allowed_origins(std::string_view value);

class HttpServer {
 public:
  explicit HttpServer(HttpServerOptions options = {});
  ~HttpServer();  // stop()
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Registers `handler` for `method` (e.g. "POST") on `path` (exact match, e.g.
  // "/v1/completions"). Only before start(). A request for a known path with another method gets
  // 405 with an Allow header; TRACE, CONNECT and unknown methods get 501. HEAD is answered
  // by the GET handler where there is no HEAD route: the client gets the head of its response
  // (status, fields, Content-Length), never the body.
  void route(std::string method, std::string path, Handler handler);
  // Registers `handler` for `method` on every path under `prefix` (which ends with '/', e.g.
  // "/v1/models/" for /v1/models/{id}) that has no route of its own; the longest prefix that
  // matches wins. Methods are answered as for route(). Only before start().
  void route_prefix(std::string method, std::string prefix, Handler handler);

  // Binds, listens and starts the io threads; returns once the server accepts connections.
  // Throws tandem::Error if the address cannot be bound. Only once per server.
  void start();
  // The bound port (useful with port 0); 0 before start().
  uint16_t port() const;
  // The connection cap in force (HttpServerOptions::max_connections, resolved); 0 before start().
  size_t max_connections() const;
  // Closes the listener at once, and every connection that has no complete response left to
  // write: idle ones, requests being read, exchanges still waiting for their producer or still
  // streaming (they become closed() and their on_close callbacks run). A complete response that a
  // slow reader's socket has not yet taken goes on being written for up to `flush`; once written,
  // its connection half-closes and reads what the client still sends until the client closes, so
  // that no reset destroys the answer's tail. Whatever is left at `flush`'s end, or when
  // end_flush() comes, is closed, cutting it. Then joins the io threads. Returns within `flush`
  // (0: at once, after writing what the sockets take now). Idempotent. Must not be called from a
  // handler or an on_close callback (it would join its own thread).
  void stop(std::chrono::milliseconds flush = {});
  // Ends stop()'s flush at once, or the next one before it begins. From any thread: an operator's
  // second stop signal.
  void end_flush();

 private:
  // The io loops: for an AsyncHttpClient that shares them (async_http_client.h), so a proxy's
  // upstream calls stay on the threads of its connections.
  friend class AsyncHttpClient;
  friend class LoopTasks;
  detail::LoopGroup& loops();

  std::unique_ptr<detail::ServerImpl> impl_;
};

}  // namespace tandem::net
