#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace tandem {

// Reads a whole file; throws tandem::Error naming the path when it cannot be read.
std::string read_file(const std::filesystem::path& path);

// A file opened for reading that is a regular file. A FIFO where a data file is expected would
// block open() until some writer came, and reading or mapping a directory fails with a message
// that names neither ("No such device"), so anything else is refused naming the path and its
// kind. The open does not block, so there is no window between a check and a blocking open.
class RegularFile {
 public:
  explicit RegularFile(const std::filesystem::path& path);
  ~RegularFile();
  RegularFile(const RegularFile&) = delete;
  RegularFile& operator=(const RegularFile&) = delete;
  int fd() const { return fd_; }
  uint64_t size() const { return size_; }

 private:
  int fd_ = -1;
  uint64_t size_ = 0;
};

// Limits for the files of a model folder, so one of absurd size is refused naming it before it
// is read, not read until memory runs out. Its JSON files and chat templates are kilobytes
// (config.json, generation_config.json, tokenizer_config.json with its templates); tokenizer.json
// is tens of megabytes for the largest vocabularies.
inline constexpr uint64_t kMaxModelConfigBytes = uint64_t{64} << 20;
inline constexpr uint64_t kMaxTokenizerBytes = uint64_t{1} << 30;

// The whole of a regular file (RegularFile's checks) of at most `max_bytes`; throws
// tandem::Error naming the path otherwise, before reading anything when the file is too large.
std::string read_regular_file(const std::filesystem::path& path, uint64_t max_bytes = UINT64_MAX);

// A new file beside `path`, open for writing, to be renamed onto it: created with O_EXCL under a
// name of its own (the pid and a counter), so it is never a link someone left, which a plain open
// would follow, nor a file another writer of `path` is filling. Returns the descriptor and sets
// *tmp; throws tandem::Error naming `path`.
int create_temporary_beside(const std::filesystem::path& path, std::filesystem::path* tmp);

// Writes `bytes` to a temporary file beside `path` and renames it into place, so a reader never
// sees a half-written file; throws tandem::Error naming the path on failure.
void write_file_atomically(const std::filesystem::path& path, std::string_view bytes);

}  // namespace tandem
