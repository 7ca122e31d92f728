// Fuzzes the safetensors reader (model/safetensors.h) on a whole model.safetensors file: the
// 8-byte header length, the JSON header, dtypes, shapes and data offsets. Checkpoint::open is the
// production entry point and maps a file, so each input is written to model.safetensors in a
// private temporary folder first. Every byte of every tensor it accepts is read back (an offset
// past the mapping would fault). tandem::Error is the documented error; anything else escaping
// is a finding.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "model/safetensors.h"
#include "util/error.h"

namespace {

std::filesystem::path folder;

void write_input(const uint8_t* data, size_t size) {
  const std::string path = (folder / "model.safetensors").string();
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || (size > 0 && std::fwrite(data, 1, size, f) != size) || std::fclose(f) != 0) {
    std::perror(path.c_str());
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Memory-backed (/dev/shm) when there is one: on a disk file system, writing and mapping a
  // file per input ran ten times slower.
  const char* tmp = std::getenv("TMPDIR");
  std::string base = std::filesystem::is_directory("/dev/shm") ? "/dev/shm"
                     : tmp && *tmp                             ? tmp
                                                               : "/tmp";
  std::string pattern = base + "/tandem-safetensors-fuzz-XXXXXX";
  if (!::mkdtemp(pattern.data())) {
    std::perror("mkdtemp");
    std::abort();
  }
  folder = pattern;
  std::atexit([] { std::filesystem::remove_all(folder); });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  write_input(data, size);
  try {
    const auto checkpoint = tandem::model::Checkpoint::open(folder);
    uint8_t sum = 0;
    for (const auto& [name, info] : checkpoint.tensors()) {
      if (info.nbytes != 0 && !info.data) __builtin_trap();
      for (size_t i = 0; i < info.nbytes; ++i) sum += static_cast<uint8_t>(info.data[i]);
      (void)tandem::model::shape_string(info.shape);
      (void)info.numel();
    }
    if (checkpoint.total_bytes() > size) __builtin_trap();  // tensors lie inside the file
    asm volatile("" : : "r"(sum));
  } catch (const tandem::Error&) {
  }
  return 0;
}
