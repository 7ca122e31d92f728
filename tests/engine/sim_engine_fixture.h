#pragma once
// What tests that run an engine in process on the simulated tiny model share: the tokenizer they
// load once, the engine itself (its options, its executor, its end-of-sequence ids) and the
// loopback options of the HTTP server in front of it.
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/engine.h"
#include "engine/executor/sim_executor.h"
#include "engine/output_processor.h"
#include "net/http_server.h"
#include "text/oracle_support.h"
#include "text/tokenizer.h"
#include "util/metrics.h"

namespace tandem::test {

// The DeepSeek-V3 tokenizer (the lenml copy among the tests' oracle models), loaded at its first
// use and kept for the process: loading takes far longer than the tests that use it.
inline const text::Tokenizer& deepseek_v3_tokenizer() {
  static const text::Tokenizer tok = text::Tokenizer::from_dir(lenml_model("deepseek_v3"));
  return tok;
}

// `tok` as the shared_ptr an engine takes, owning nothing: the tokenizers tests pass outlive the
// engines (a process-wide one, or a suite's that is freed after its last test).
inline std::shared_ptr<const text::Tokenizer> borrowed(const text::Tokenizer& tok) {
  return {&tok, [](const text::Tokenizer*) {}};
}

// An engine of `config` on the simulated tiny model (model name "tiny", blocks of 16 tokens) with
// `num_blocks` blocks and `max_model_len` (0: the preset's), in virtual time: its steps take none,
// so the test's own calls to run_once (or its clock in `config`) are all that moves it.
// `tok` is read for the model's ids and its end-of-sequence id, and must outlive the engine.
inline std::unique_ptr<engine::Engine> sim_engine(const engine::EngineConfig& config,
                                                  const text::Tokenizer& tok,
                                                  metrics::Registry& registry,
                                                  int64_t num_blocks = 64,
                                                  int64_t max_model_len = 0) {
  engine::SimExecutorOptions x;
  x.preset = "tiny";
  x.model_name = "tiny";
  x.block_size = 16;
  x.num_blocks = num_blocks;
  x.max_model_len = max_model_len;
  x.time_scale = 0;
  return std::make_unique<engine::Engine>(config, std::make_unique<engine::SimExecutor>(tok, x),
                                          borrowed(tok), engine::eos_ids(tok, {}), registry);
}

// An HTTP server on the loopback, on an ephemeral port with one io thread (the defaults): tests
// reach it at 127.0.0.1, and nothing outside the machine can.
inline net::HttpServerOptions loopback_server_options() {
  net::HttpServerOptions o;
  o.host = "127.0.0.1";
  return o;
}

// `n` prompt tokens from `base`, distinct within 5000 of them (so no two blocks of a prompt are
// alike), and the same for the same arguments (so prompts with one base share their prefix).
inline std::vector<int32_t> tokens(int n, int base) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(base + (i * 7919) % 5000);
  return t;
}

}  // namespace tandem::test
