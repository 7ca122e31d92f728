// KV transfer benchmark, two parts:
//
//  transport  KvTransferAgents in this process with DeepSeek-V3's cache layout (61 layers x
//             1,152 bytes per token, blocks of 16): a prefill holds a prompt's blocks, a decode
//             pulls them, once over the TCP transport and once over the shared-memory one, in
//             alternating rounds with the references: the same bytes through a plain loopback
//             TCP socket pair (one buffer per layer, no protocol) and a bare memcpy of the same
//             blocks from one cache to the other (one thread, as a receive is). Medians.
//  serving    With --single-port/--prefill-port/--decode-port (engines started by
//             bench/kv_transfer.sh): request latency of a single engine versus the sequential and
//             the parallel P/D flows, per prompt length: the latency disaggregation adds.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <nlohmann/json.hpp>

#include "engine/transfer/kv_transfer.h"
#include "net/http_client.h"

namespace {

using namespace tandem;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

constexpr int64_t kLayers = 61, kTokenBytes = 1152, kBlock = 16;

// A cache in shared memory with DeepSeek-V3's layout, as the engines keep theirs.
class MemoryExecutor : public engine::Executor {
 public:
  explicit MemoryExecutor(int64_t blocks)
      : memory_(SharedSegment::create(size_t(blocks * kLayers * kBlock * kTokenBytes), "bench")),
        data_(memory_.data(), memory_.size()) {
    info_.num_blocks = blocks;
    info_.block_size = kBlock;
    info_.model_name = "bench";
    info_.kv_layout = {"bench-deepseek-v3", kLayers, kBlock, kTokenBytes};
    for (size_t i = 0; i < data_.size(); i += 4096) data_[i] = std::byte(i);
  }
  const engine::ExecutorInfo& info() const override { return info_; }
  engine::ExecResult execute(std::span<const engine::ExecItem>, const engine::LayerHook&) override {
    return {};
  }
  const std::byte* kv_bytes(int32_t block, int64_t layer) const override {
    return data_.data() + at(block, layer);
  }
  void write_kv(int32_t block, int64_t layer, std::span<const std::byte> b) override {
    std::memcpy(data_.data() + at(block, layer), b.data(), b.size());
  }
  std::byte* kv_bytes_mutable(int32_t block, int64_t layer) override {
    return data_.data() + at(block, layer);
  }
  SharedView kv_shared_memory() const override { return memory_.view(); }

 private:
  size_t at(int32_t block, int64_t layer) const {
    return size_t((block * kLayers + layer) * kBlock * kTokenBytes);
  }
  engine::ExecutorInfo info_;
  SharedSegment memory_;
  std::span<std::byte> data_;
};

// Runs posted tasks on the calling thread (the agents' "engine thread").
struct TaskQueue {
  std::mutex m;
  std::condition_variable cv;
  std::deque<std::function<void()>> q;
  void post(std::function<void()> t) {
    std::lock_guard l(m);
    q.push_back(std::move(t));
    cv.notify_all();
  }
  void run_until(const std::function<bool()>& done) {
    std::unique_lock l(m);
    while (!done()) {
      cv.wait(l, [&] { return !q.empty(); });
      auto t = std::move(q.front());
      q.pop_front();
      l.unlock();
      t();
      l.lock();
    }
  }
};

// The reference: `bytes` through a loopback TCP connection, `layers` writes of equal size.
double raw_tcp_seconds(size_t bytes, int layers) {
  namespace asio = boost::asio;
  using tcp = asio::ip::tcp;
  asio::io_context ctx;
  tcp::acceptor acceptor(ctx, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  const auto port = acceptor.local_endpoint().port();
  const size_t chunk = bytes / size_t(layers);
  std::vector<char> out(chunk, 'x');
  std::thread sender([&] {
    asio::io_context c2;
    tcp::socket s(c2);
    s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
    s.set_option(tcp::no_delay(true));
    for (int i = 0; i < layers; ++i) asio::write(s, asio::buffer(out));
  });
  tcp::socket r = acceptor.accept();
  std::vector<char> in(chunk);
  const auto t0 = Clock::now();
  for (int i = 0; i < layers; ++i) asio::read(r, asio::buffer(in));
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  sender.join();
  return s;
}

// Layer by layer, block by block: the copy a transfer makes from one cache to the other.
double memcpy_seconds(const MemoryExecutor& from, MemoryExecutor& to, int64_t tokens) {
  const auto t0 = Clock::now();
  for (int64_t layer = 0; layer < kLayers; ++layer)
    for (int64_t first = 0; first < tokens; first += kBlock) {
      const auto n = size_t(std::min(kBlock, tokens - first) * kTokenBytes);
      const auto block = int32_t(first / kBlock);
      std::memcpy(to.kv_bytes_mutable(block, layer), from.kv_bytes(block, layer), n);
    }
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// A counter's value in the registry's exposition (0 when it has none yet).
double counter_value(const metrics::Registry& registry, const std::string& name) {
  const std::string text = registry.render();
  for (size_t at = text.find(name); at != std::string::npos; at = text.find(name, at + 1)) {
    if (at > 0 && text[at - 1] != '\n') continue;  // a comment line naming it
    const size_t space = text.find(' ', at), end = text.find('\n', at);
    return std::stod(text.substr(space + 1, end - space - 1));
  }
  return 0;
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void transport_part(const std::vector<int64_t>& lengths, int repeats) {
  const int64_t max_len = *std::max_element(lengths.begin(), lengths.end());
  const int64_t blocks = (max_len + kBlock - 1) / kBlock + 1;
  MemoryExecutor prefill_exec(blocks), decode_exec(blocks);
  TaskQueue tasks;
  metrics::Registry reg[4];
  engine::KvTransferConfig pc;
  pc.listen_host = "127.0.0.1";
  pc.port = 0;
  pc.advertise_host = "127.0.0.1";
  pc.checksum = false;
  engine::KvTransferConfig dc = pc;
  dc.port = -1;
  auto post = [&](std::function<void()> t) { tasks.post(std::move(t)); };
  struct Pair {
    const char* name;
    std::unique_ptr<engine::KvTransferAgent> prefill, decode;
  };
  Pair pairs[] = {{"tcp",
                   std::make_unique<engine::KvTransferAgent>(
                       pc, prefill_exec, engine::make_tcp_transport(), reg[0], post),
                   std::make_unique<engine::KvTransferAgent>(
                       dc, decode_exec, engine::make_tcp_transport(), reg[1], post)},
                  {"shm",
                   std::make_unique<engine::KvTransferAgent>(
                       pc, prefill_exec, engine::make_shm_transport(), reg[2], post),
                   std::make_unique<engine::KvTransferAgent>(
                       dc, decode_exec, engine::make_shm_transport(), reg[3], post)}};
  std::printf(
      "KV transfer on one host, DeepSeek-V3 layout (61 layers x 1152 B/token), medians of %d "
      "alternating rounds\n",
      repeats);
  std::printf("%8s %10s %9s %9s %9s %9s %9s %10s %10s\n", "prompt", "MB", "tcp GB/s", "shm GB/s",
              "raw tcp", "memcpy", "shm/tcp", "shm/memcpy", "in place");
  for (int64_t len : lengths) {
    std::vector<int32_t> ids;
    for (int64_t b = 0; b < (len + kBlock - 1) / kBlock; ++b) ids.push_back(int32_t(b));
    const size_t bytes = size_t((len - 1) * kLayers * kTokenBytes);
    std::vector<double> times[4];  // tcp, shm, raw tcp, memcpy
    const double in_place_before = counter_value(reg[2], "tandem:kv_transfer_in_place_bytes_total");
    for (int r = 0; r < repeats; ++r) {
      for (int k = 0; k < 2; ++k) {
        Pair& p = pairs[k];
        const std::string id = p.prefill->hold(ids, 42, len, [] {});
        engine::KvFetch f;
        f.request_id = "bench";
        f.host = "127.0.0.1";
        f.port = p.prefill->port();
        f.engine_id = p.prefill->config().engine_id;
        f.transfer_id = id;
        f.remote_blocks = ids;
        f.prompt_hash = 42;  // what the hold was given: this bench moves bytes, not a prompt
        f.prompt_tokens = len;
        f.num_tokens = len - 1;
        f.local_blocks.assign(ids.begin(), ids.begin() + (len - 1 + kBlock - 1) / kBlock);
        bool done = false;
        std::string error;
        const auto t0 = Clock::now();
        p.decode->fetch(f, [&](const engine::KvFetchResult& res) {
          done = true;
          if (!res.ok) error = res.error;
        });
        tasks.run_until([&] { return done; });
        times[k].push_back(std::chrono::duration<double>(Clock::now() - t0).count());
        if (!error.empty()) throw Error(std::string(p.name) + " transfer failed: " + error);
      }
      times[2].push_back(raw_tcp_seconds(bytes, int(kLayers)));
      times[3].push_back(memcpy_seconds(prefill_exec, decode_exec, len - 1));
    }
    double gbs[4];
    for (int k = 0; k < 4; ++k) gbs[k] = double(bytes) / median_of(times[k]) / 1e9;
    const double in_place = counter_value(reg[2], "tandem:kv_transfer_in_place_bytes_total");
    std::printf("%8lld %10.1f %9.2f %9.2f %9.2f %9.2f %8.1fx %9.0f%% %9.0f%%\n",
                static_cast<long long>(len), double(bytes) / 1e6, gbs[0], gbs[1], gbs[2], gbs[3],
                gbs[1] / gbs[0], 100 * gbs[1] / gbs[3],
                100 * (in_place - in_place_before) / double(bytes * size_t(repeats)));
  }
}

double timed_post(uint16_t port, const json& body) {
  const auto t0 = Clock::now();
  auto r = net::http_request("127.0.0.1", port, "POST", "/v1/completions", body.dump());
  if (r.status != 200) throw Error("request failed: " + r.body);
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void serving_part(uint16_t single, uint16_t prefill, uint16_t decode, uint16_t kv_port,
                  const std::vector<int64_t>& lengths, int repeats, const std::string& label) {
  std::printf("\nRequest latency (max_tokens 2), simulated engines with zero compute time%s%s\n",
              label.empty() ? "" : ", P/D over ", label.c_str());
  std::printf("%8s %12s %14s %14s %14s %14s\n", "prompt", "single ms", "sequential ms", "added ms",
              "parallel ms", "added ms");
  uint64_t room = 1;
  int salt = 0;
  for (int64_t len : lengths) {
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    std::vector<double> one, seq, par;
    for (int r = 0; r < repeats; ++r) {
      std::vector<int32_t> prompt;
      ++salt;
      for (int64_t i = 0; i < len; ++i)
        prompt.push_back(int32_t(1000 + (i * 31 + salt * 7) % 9000));
      json body = {{"prompt", prompt}, {"max_tokens", 2}};
      one.push_back(timed_post(single, body));
      // Sequential: prefill leg, then the decode leg with the prefill's kv_transfer_params.
      prompt[0] = 2 + salt % 100;
      body["prompt"] = prompt;
      const auto t0 = Clock::now();
      json pre = body;
      pre["max_tokens"] = 1;
      pre["kv_transfer_params"] = {{"do_remote_decode", true}};
      auto pr = net::http_request("127.0.0.1", prefill, "POST", "/v1/completions", pre.dump());
      json dec = body;
      dec["kv_transfer_params"] = json::parse(pr.body)["kv_transfer_params"];
      timed_post(decode, dec);
      seq.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      // Parallel: both legs at once with a bootstrap room.
      prompt[0] = 200 + salt % 100;
      body["prompt"] = prompt;
      body["bootstrap_host"] = "127.0.0.1";
      body["bootstrap_port"] = kv_port;
      body["bootstrap_room"] = room++;
      const auto t1 = Clock::now();
      auto p = std::async(std::launch::async, [&] { return timed_post(prefill, body); });
      timed_post(decode, body);
      p.get();
      par.push_back(std::chrono::duration<double>(Clock::now() - t1).count());
    }
    const double s = median(one) * 1e3, q = median(seq) * 1e3, p = median(par) * 1e3;
    std::printf("%8lld %12.2f %14.2f %14.2f %14.2f %14.2f\n", static_cast<long long>(len), s, q,
                q - s, p, p - s);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Tandem KV transfer benchmark");
  std::vector<int64_t> lengths = {256, 1024, 4096, 8192};
  int repeats = 5;
  int single = 0, prefill = 0, decode = 0, kv_port = 0;
  bool serving_only = false;
  std::string label;
  app.add_option("--lengths", lengths, "prompt lengths (tokens)")->delimiter(',');
  app.add_option("--repeats", repeats, "alternating rounds per length (medians reported)");
  app.add_option("--single-port", single, "a --role both engine (serving part)");
  app.add_option("--prefill-port", prefill, "a --role prefill engine (serving part)");
  app.add_option("--decode-port", decode, "a --role decode engine (serving part)");
  app.add_option("--kv-port", kv_port, "the prefill engine's KV transfer port (serving part)");
  app.add_flag("--serving-only", serving_only, "skip the transport part");
  app.add_option("--label", label, "what the P/D engines' transfers run over (printed)");
  CLI11_PARSE(app, argc, argv);
  try {
    if (!serving_only) transport_part(lengths, repeats);
    if (single && prefill && decode && kv_port)
      serving_part(uint16_t(single), uint16_t(prefill), uint16_t(decode), uint16_t(kv_port),
                   lengths, repeats, label);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
