#pragma once
// A KV-event publisher for gateway tests (prefix index consumers): an engine's live PUB socket
// and its replay ROUTER, whose seqs and history the test scripts.
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <iterator>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace tandem::testing {

// A publisher whose seqs the test chooses: it can skip a batch on the live socket (lost), keep
// a batch out of its replay history (gone for good), or count from 0 again (restart). Answers
// replay requests as the engine does, on its own thread.
class ScriptedPublisher {
 public:
  ScriptedPublisher() {
    pub_.set(zmq::sockopt::linger, 0);
    pub_.bind("tcp://127.0.0.1:*");
    endpoint_ = pub_.get(zmq::sockopt::last_endpoint);
    router_.set(zmq::sockopt::linger, 0);
    router_.bind("tcp://127.0.0.1:*");
    replay_endpoint_ = router_.get(zmq::sockopt::last_endpoint);
    thread_ = std::thread([this] { serve(); });
  }
  ~ScriptedPublisher() {
    stop_ = true;
    thread_.join();
  }

  void publish(uint64_t seq, const std::string& payload, bool live = true, bool keep = true) {
    if (keep) {
      std::lock_guard lock(mutex_);
      history_.emplace_back(seq, payload);
    }
    if (!live) return;
    pub_.send(zmq::buffer(std::string("kv@test")), zmq::send_flags::sndmore);
    pub_.send(zmq::buffer(be64(seq)), zmq::send_flags::sndmore);
    pub_.send(zmq::buffer(payload), zmq::send_flags::none);
  }
  void forget_history() {
    std::lock_guard lock(mutex_);
    history_.clear();
  }
  int replay_requests() const { return replay_requests_; }
  const std::string& endpoint() const { return endpoint_; }
  const std::string& replay_endpoint() const { return replay_endpoint_; }

  static std::string be64(uint64_t v) {
    std::string out(8, '\0');
    for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(v >> (56 - 8 * i));
    return out;
  }

 private:
  void serve() {
    zmq_pollitem_t item{router_.handle(), 0, ZMQ_POLLIN, 0};
    while (!stop_) {
      if (zmq::poll(&item, 1, std::chrono::milliseconds(20)) == 0) continue;
      std::vector<zmq::message_t> frames;
      if (!zmq::recv_multipart(router_, std::back_inserter(frames))) continue;
      if (frames.size() != 3 || frames[2].size() != 8) continue;
      ++replay_requests_;
      const auto* p = static_cast<const unsigned char*>(frames[2].data());
      uint64_t start = 0;
      for (int i = 0; i < 8; ++i) start = (start << 8) | p[i];
      std::vector<std::pair<uint64_t, std::string>> send;
      {
        std::lock_guard lock(mutex_);
        for (const auto& [seq, payload] : history_)
          if (seq >= start) send.emplace_back(seq, payload);
      }
      send.emplace_back(~uint64_t{0}, "");
      for (const auto& [seq, payload] : send) {
        router_.send(zmq::buffer(frames[0].to_string()), zmq::send_flags::sndmore);
        router_.send(zmq::message_t(), zmq::send_flags::sndmore);
        router_.send(zmq::buffer(be64(seq)), zmq::send_flags::sndmore);
        router_.send(zmq::buffer(payload), zmq::send_flags::none);
      }
    }
  }

  zmq::context_t context_{1};
  zmq::socket_t pub_{context_, zmq::socket_type::pub};
  zmq::socket_t router_{context_, zmq::socket_type::router};
  std::string endpoint_, replay_endpoint_;
  std::mutex mutex_;
  std::vector<std::pair<uint64_t, std::string>> history_;
  std::atomic<bool> stop_{false};
  std::atomic<int> replay_requests_{0};
  std::thread thread_;
};

}  // namespace tandem::testing
