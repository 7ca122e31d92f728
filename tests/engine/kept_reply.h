#pragma once
// A Reply that keeps what an API handler answered, for tests that call the handler in process.
#include <functional>
#include <string>
#include <string_view>

#include "net/reply.h"

namespace tandem::testing {

class KeptReply final : public net::Reply {
 public:
  bool respond(int s, std::string b, std::string) override {
    status = s;
    body = std::move(b);
    done = true;
    return true;
  }
  bool send_error(int s, std::string_view message, std::string_view, std::string_view) override {
    return respond(s, std::string(message), "text/plain");
  }
  bool start_stream(int s, std::string) override {
    status = s;
    return true;
  }
  bool write(std::string_view chunk) override {
    body += chunk;
    return true;
  }
  bool end() override { return done = true; }
  void abort() override { done = true; }
  void on_close(std::function<void()>) override {}

  int status = 0;
  std::string body;
  bool done = false;
};

}  // namespace tandem::testing
