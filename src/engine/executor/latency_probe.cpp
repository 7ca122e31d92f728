#include "engine/executor/latency_probe.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <numeric>

#include "util/error.h"

namespace tandem::engine {
namespace {

struct ProbeSequence {
  std::vector<int32_t> tokens;  // context followed by the new tokens
  std::vector<int32_t> blocks;
  std::unique_ptr<Sampler> sampler;
};

double time_step(Executor& executor, std::vector<ProbeSequence>& seqs, int64_t new_tokens,
                 bool decode, int repeats) {
  std::vector<ExecItem> items;
  for (auto& s : seqs) {
    ExecItem item;
    const auto context = static_cast<int64_t>(s.tokens.size()) - new_tokens;
    item.tokens = std::span<const int32_t>(s.tokens).subspan(size_t(context));
    item.start = context;
    item.blocks = s.blocks;
    item.sample = true;
    item.sampler = s.sampler.get();
    item.prompt = std::span<const int32_t>(s.tokens).first(size_t(context));
    // A decode step has generated tokens before it (the simulated executor tells decode from
    // prefill this way).
    if (decode) item.generated = std::span<const int32_t>(s.tokens).subspan(size_t(context));
    items.push_back(item);
  }
  executor.execute(items);  // warm-up
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    executor.execute(items);
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

std::vector<LatencySample> probe_step_latencies(
    Executor& executor, const ProbeOptions& options,
    const std::function<void(const LatencySample&)>& on_sample) {
  const ExecutorInfo& info = executor.info();
  const int64_t bs = info.block_size;
  SamplingParams greedy;
  greedy.temperature = 0;
  std::vector<LatencySample> samples;
  // Sequences take consecutive blocks of the cache; shapes that do not fit are skipped.
  auto make = [&](int64_t count, int64_t length, std::vector<ProbeSequence>& out) {
    const int64_t per = (length + bs - 1) / bs;
    if (count * per > info.num_blocks || length > info.max_model_len) return false;
    for (int64_t i = 0; i < count; ++i) {
      ProbeSequence s;
      s.tokens.resize(size_t(length));
      for (int64_t k = 0; k < length; ++k)
        s.tokens[size_t(k)] =
            static_cast<int32_t>((1000 + 7919 * (k + 31 * i)) % (info.vocab_size - 1));
      s.blocks.resize(size_t(per));
      std::iota(s.blocks.begin(), s.blocks.end(), static_cast<int32_t>(i * per));
      s.sampler = std::make_unique<Sampler>(greedy, 0);
      out.push_back(std::move(s));
    }
    return true;
  };
  auto record = [&](LatencySample sample) {
    if (on_sample) on_sample(sample);
    samples.push_back(std::move(sample));
  };
  for (auto [n, context] : options.prefills) {
    std::vector<ProbeSequence> seqs;
    if (!make(1, context + n, seqs)) continue;
    LatencySample s;
    s.shape.prefills.push_back({n, context});
    s.seconds = time_step(executor, seqs, n, false, options.repeats);
    record(std::move(s));
  }
  for (int64_t context : options.decode_contexts)
    for (int64_t batch : options.decode_batches) {
      std::vector<ProbeSequence> seqs;
      if (!make(batch, context + 1, seqs)) continue;
      LatencySample s;
      s.shape.decode_seqs = batch;
      s.shape.decode_tokens = batch;
      s.shape.decode_context_tokens = batch * context;
      s.seconds = time_step(executor, seqs, 1, true, options.repeats);
      record(std::move(s));
    }
  if (samples.empty()) throw Error("sim-fit: no probe shape fits the executor's KV cache");
  return samples;
}

}  // namespace tandem::engine
