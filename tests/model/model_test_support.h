#pragma once
// Helpers for the model tests: temporary folders, raw file access, logits against a reference.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <vector>

#include "model/make_model.h"
#include "model/safetensors.h"

namespace tandem::test {

// A fresh folder in the system temp folder, removed with its contents when destroyed.
class TempDir {
 public:
  explicit TempDir(const std::string& stem) {
    static int counter = 0;
    path_ = std::filesystem::temp_directory_path() /
            ("tandem-" + stem + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

inline std::string read_bytes(const std::filesystem::path& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

inline void write_bytes(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

struct CommandResult {
  int status = -1;
  std::string output;  // stdout only; stderr passes through to the test log
};

inline CommandResult run_capture(const std::string& command) {
  CommandResult r;
  FILE* p = ::popen(command.c_str(), "r");
  if (!p) return r;
  std::array<char, 65536> buf;
  for (size_t n; (n = std::fread(buf.data(), 1, buf.size(), p)) > 0;)
    r.output.append(buf.data(), n);
  const int rc = ::pclose(p);
  r.status = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  return r;
}

// Block tables for sequences of these lengths in one cache: consecutive blocks, one run each.
inline std::vector<std::vector<int32_t>> block_tables(const std::vector<std::vector<int32_t>>& seqs,
                                                      int64_t block) {
  std::vector<std::vector<int32_t>> tables;
  int32_t next = 0;
  for (const auto& s : seqs) {
    std::vector<int32_t> t((static_cast<int64_t>(s.size()) + block - 1) / block);
    for (auto& b : t) b = next++;
    tables.push_back(t);
  }
  return tables;
}

// Largest |ours - ref| over the first `count` rows of logits [count, vocab], relative to the
// reference's largest magnitude (at least 1).
inline double logit_deviation(const std::vector<std::vector<float>>& ref, const float* ours,
                              int64_t vocab, size_t count) {
  double worst = 0, scale = 1;
  for (size_t r = 0; r < count; ++r)
    for (int64_t v = 0; v < vocab; ++v) {
      worst = std::max(worst, std::fabs(static_cast<double>(ours[r * vocab + v]) - ref[r][v]));
      scale = std::max(scale, std::fabs(static_cast<double>(ref[r][v])));
    }
  return worst / scale;
}

// Copies the model folder `from` to `to` with `extra` F32 tensors (filled with 0.5) added to its
// checkpoint, which becomes one model.safetensors; the other files are copied as they are.
inline void copy_with_tensors(const std::filesystem::path& from, const std::filesystem::path& to,
                              const std::vector<model::TensorSpec>& extra) {
  const model::Checkpoint source = model::Checkpoint::open(from);
  std::vector<model::TensorSpec> specs = extra;
  for (const auto& [name, info] : source.tensors()) specs.push_back({name, info.dtype, info.shape});
  model::write_checkpoint(
      to, specs,
      [&](const model::TensorSpec& s, std::span<std::byte> out) {
        if (const model::TensorInfo* t = source.find(s.name)) {
          std::memcpy(out.data(), t->data, out.size());
          return;
        }
        const float half = 0.5f;
        for (size_t i = 0; i + 4 <= out.size(); i += 4) std::memcpy(out.data() + i, &half, 4);
      },
      size_t{1} << 40);
  for (const auto& entry : std::filesystem::directory_iterator(from)) {
    const std::string name = entry.path().filename().string();
    if (name.ends_with(".safetensors") || name == "model.safetensors.index.json") continue;
    std::filesystem::copy(entry.path(), to / name, std::filesystem::copy_options::recursive);
  }
}

// The tiny-v3 preset with a vocabulary of 3000 (BOS 0, EOS 1): loading tests whose random
// checkpoints need no tokenizer and whose LM heads should stay small.
inline model::ModelConfig small_vocab_tiny_v3() {
  model::ModelConfig c = model::preset_config("tiny-v3");
  c.vocab_size = 3000;
  c.bos_token_id = 0;
  c.eos_token_ids = {1};
  return c;
}

}  // namespace tandem::test
