#pragma once
// Safetensors checkpoints in the Hugging Face layout: one `model.safetensors`, or shards
// `model-0000K-of-0000N.safetensors` listed by `model.safetensors.index.json`. Reading maps the
// files into memory; nothing is copied until a tensor is converted.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "model/dtype.h"

namespace tandem::model {

// "[2, 3]": how messages about tensors write shapes.
std::string shape_string(const std::vector<int64_t>& shape);

struct TensorInfo {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;  // into the mapped file
  size_t nbytes = 0;
  std::string file;  // shard file name, for messages
  int64_t numel() const;
};

class Checkpoint {
 public:
  // Opens DIR/model.safetensors.index.json if present, else DIR/model.safetensors. Every error
  // (missing shard, bad header, overlapping or out-of-file data offsets, unknown dtype, a tensor
  // listed in the index but absent from its shard) names the file and tensor.
  static Checkpoint open(const std::filesystem::path& dir);
  ~Checkpoint();
  Checkpoint(Checkpoint&&) noexcept;
  Checkpoint& operator=(Checkpoint&&) noexcept;

  const TensorInfo* find(const std::string& name) const;
  // Throws tandem::Error naming the tensor (and the expected shape) when absent or mis-shaped.
  const TensorInfo& get(const std::string& name, const std::vector<int64_t>& expected_shape) const;
  const std::map<std::string, TensorInfo>& tensors() const;
  size_t total_bytes() const;
  const std::filesystem::path& dir() const;  // the folder it was opened from, for messages

 private:
  struct Impl;
  explicit Checkpoint(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Gives back the resident pages wholly inside [data, data + bytes) of a mapped checkpoint: for
// tensor bytes that were copied into another layout and are not read in place any more. Should
// they be read after all, the pages come back from the file.
void release_pages(const void* data, size_t bytes);

struct TensorSpec {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  size_t nbytes() const;
};

// Writes a checkpoint in the Hugging Face layout: tensors in the given order, split into shards of
// at most `max_shard_bytes` (one file `model.safetensors` when everything fits, else
// `model-0000K-of-0000N.safetensors` plus `model.safetensors.index.json` with
// metadata.total_size and weight_map). Each header carries {"__metadata__": {"format": "pt"}} and
// is padded with spaces to a multiple of 8 bytes; within a shard, data is ordered by element size
// (largest first, otherwise as given) like the safetensors library does, so every tensor is
// naturally aligned in a mapping. Checkpoint files already in `dir` are removed first, and so are
// the temporary shards (NAME.tmp.PID.N) of writers no longer running. `fill` writes each tensor's
// bytes (in file order); tensors are produced one at a time so a multi-GB checkpoint never sits
// in memory whole. `progress` (optional) is called with bytes written so far and the total.
void write_checkpoint(const std::filesystem::path& dir, const std::vector<TensorSpec>& specs,
                      const std::function<void(const TensorSpec&, std::span<std::byte>)>& fill,
                      size_t max_shard_bytes,
                      const std::function<void(size_t, size_t)>& progress = {});

}  // namespace tandem::model
