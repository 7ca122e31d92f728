#pragma once
#include <filesystem>
#include <string>
#include <string_view>

namespace tandem {

// Reads a whole file; throws tandem::Error naming the path when it cannot be read.
std::string read_file(const std::filesystem::path& path);

// Writes `bytes` to a temporary file beside `path` and renames it into place, so a reader never
// sees a half-written file; throws tandem::Error naming the path on failure.
void write_file_atomically(const std::filesystem::path& path, std::string_view bytes);

}  // namespace tandem
