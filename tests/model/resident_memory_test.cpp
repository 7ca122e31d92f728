// The engine holds one copy of the weights: a checkpoint loaded and run (prefill and decode, so
// every matrix and expert is read) grows the process by at most 1.1x its tensor bytes plus the
// latent cache it was given and a fixed allowance for buffers, at the end and at the peak of
// loading (packing matrix by matrix never holds two copies of the model). An FP8 checkpoint's
// matrices are held once too, as BF16: it grows by at most 1.1x the same model's BF16 bytes.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "model/deepseek.h"
#include "model/latent_cache.h"
#include "model/layout.h"
#include "model/make_model.h"
#include "model/mapped_pages.h"
#include "model/model_test_support.h"
#include "model/random_checkpoint.h"
#include "model/weights.h"
#include "util/proc_fields.h"

namespace tandem::model {
namespace {

// VmRSS and VmHWM (peak) of this process, in bytes.
struct Resident {
  int64_t now = 0, peak = 0;
};

Resident resident() {
  return {static_cast<int64_t>(util::proc_kb_field("/proc/self/status", "VmRSS")),
          static_cast<int64_t>(util::proc_kb_field("/proc/self/status", "VmHWM"))};
}

// The bench preset's widths (hidden 2048, experts of 1408) with few experts and a small
// vocabulary: 250 MB, most of it in matrices that get packed.
ModelConfig config() {
  ModelConfig c = preset_config("bench");
  c.vocab_size = 4096;
  c.num_hidden_layers = 2;
  c.intermediate_size = 2816;
  c.n_routed_experts = 8;
  c.bos_token_id = 0;
  c.eos_token_ids = {1};
  return c;
}

// Loads the checkpoint in `dir` and runs a prompt and four decode steps; expects the process to
// have grown by at most 1.1x `weight_bytes` plus the cache and buffers, after use and at the peak.
void expect_one_copy(const std::filesystem::path& dir, int64_t checkpoint_bytes,
                     int64_t weight_bytes) {
  // The peak (VmHWM) restarts from here, not from an earlier test's model ("5": Linux >= 4.0).
  std::ofstream("/proc/self/clear_refs") << "5";
  const Resident before = resident();
  const DeepSeekModel model = DeepSeekModel::load(dir);
  const Resident loaded = resident();
  constexpr int64_t kBlock = 16, kBlocks = 4;
  LatentCache cache(model.cache_shape(kBlock), kBlocks);
  const int64_t cache_bytes = model.cache_shape(kBlock).block_bytes() * kBlocks;
  std::vector<int32_t> prompt(40);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(7 + 97 * i % 4000);
  const std::vector<int32_t> table = {0, 1, 2, 3};
  SequenceStep step{prompt, 0, table};
  model.forward(std::span(&step, 1), cache);
  for (int64_t i = 0; i < 4; ++i) {
    const int32_t token = static_cast<int32_t>(11 + i);
    SequenceStep d{std::span(&token, 1), static_cast<int64_t>(prompt.size()) + i, table};
    model.forward(std::span(&d, 1), cache);
  }
  const Resident used = resident();
  // Activations of a 40-token prompt, thread buffers, oneDNN's compiled kernels.
  constexpr int64_t kBuffers = int64_t{32} << 20;
  const double limit = 1.1 * static_cast<double>(weight_bytes) + cache_bytes + kBuffers;
  const auto mb = [](double b) { return std::to_string(static_cast<int64_t>(b / 1e6)) + " MB"; };
  const std::string figures = "checkpoint " + mb(checkpoint_bytes) + ", after load +" +
                              mb(loaded.now - before.now) + ", after use +" +
                              mb(used.now - before.now) + ", peak +" + mb(used.peak - before.now) +
                              ", limit " + mb(limit);
  ::testing::Test::RecordProperty("figures", figures);
  // Every matrix was read, so most of the weights are resident: the figures are real.
  ASSERT_GT(used.now - before.now, weight_bytes / 2) << figures;
  EXPECT_LE(used.now - before.now, limit) << figures;
  EXPECT_LE(used.peak - before.now, limit) << figures;
}

// Resident memory says nothing about copies of the weights under the sanitizers.
#if defined(__SANITIZE_THREAD__)
// ThreadSanitizer keeps shadow and meta memory for every byte touched (about 5x resident).
#define SKIP_UNDER_SANITIZERS() GTEST_SKIP() << "resident memory is not measurable under TSan"
#elif defined(__SANITIZE_ADDRESS__)
// AddressSanitizer pads every allocation and keeps freed memory in quarantine (256 MB by
// default) instead of giving it back: the run's freed activations stayed resident (+388 MB
// against a limit of 359 MB for a 296 MB checkpoint in the ASan build).
#define SKIP_UNDER_SANITIZERS() GTEST_SKIP() << "resident memory is not measurable under ASan"
#else
#define SKIP_UNDER_SANITIZERS() (void)0
#endif

TEST(ResidentMemory, OneCopyOfTheWeightsAfterLoadAndUse) {
  SKIP_UNDER_SANITIZERS();
  const test::TempDir dir("resident-memory");
  const int64_t tensor_bytes = test::write_random_checkpoint(dir.path(), config());
  ASSERT_GT(tensor_bytes, int64_t{200} << 20);
  expect_one_copy(dir.path(), tensor_bytes, tensor_bytes);
}

// An FP8 checkpoint's matrices are dequantised to BF16 and packed: the process holds them once,
// packed, as it holds a BF16 checkpoint's, so it grows by what the same model takes in BF16 (about
// twice the FP8 file), not by a packed and a plain BF16 copy besides the mapped FP8 bytes.
TEST(ResidentMemory, OneBf16CopyOfAnFp8CheckpointsMatricesAfterLoadAndUse) {
  SKIP_UNDER_SANITIZERS();
  const test::TempDir dir("resident-memory-fp8");
  const int64_t fp8_bytes = test::write_random_checkpoint(dir.path(), config(), DType::kF8E4M3);
  int64_t bf16_bytes = 0;
  for (const TensorSpec& s : checkpoint_layout(config(), DType::kBF16))
    bf16_bytes += static_cast<int64_t>(s.nbytes());
  ASSERT_GT(bf16_bytes, int64_t{200} << 20);
  ASSERT_LT(fp8_bytes, bf16_bytes * 6 / 10);
  expect_one_copy(dir.path(), fp8_bytes, bf16_bytes);
}

// An F16 checkpoint's matrices are widened to F32 at load, and the kernels read the F32 rows (or
// the packed copy made from them): the F16 rows in the mapping are not read again, so their pages
// are given back, as a misaligned matrix's copied-from pages and an FP8 one's are. They stayed
// mapped in, holding the file's bytes beside the F32 copy. Counted in the page table (see
// mapped_pages.h), so it holds under the sanitizers too.
TEST(ResidentMemory, AnF16CheckpointsWidenedMatricesGiveBackTheirMappedRows) {
  const ModelConfig c = test::small_vocab_tiny_v3();
  const test::TempDir dir("resident-memory-f16");
  test::write_random_checkpoint(dir.path(), c, DType::kF16);
  const Weights w = Weights::load(Checkpoint::open(dir.path()), c);
  int64_t pages = 0;
  std::string kept;
  const TensorInfo* largest = nullptr;
  for (const auto& [name, t] : w.checkpoint.tensors()) {
    if (t.dtype != DType::kF16 || t.shape.size() != 2) continue;
    pages += test::whole_pages(t.data, t.nbytes).count;
    if (const int64_t present = test::present_pages(t.data, t.nbytes); present > 0)
      kept += " " + name + " (" + std::to_string(present) + " of " +
              std::to_string(test::whole_pages(t.data, t.nbytes).count) + " pages)";
    if (!largest || t.nbytes > largest->nbytes) largest = &t;
  }
  ASSERT_GT(pages, 100);  // the tiny model's matrices fill that many whole pages
  EXPECT_TRUE(kept.empty()) << "F16 rows still mapped in after load:" << kept;
  // Read again, they come back: what present_pages counts is real.
  volatile std::byte sink{};
  for (size_t i = 0; i < largest->nbytes; i += 512) sink = sink ^ largest->data[i];
  EXPECT_EQ(test::present_pages(largest->data, largest->nbytes),
            test::whole_pages(largest->data, largest->nbytes).count);
}

}  // namespace
}  // namespace tandem::model
