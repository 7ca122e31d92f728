#pragma once
#include <filesystem>
#include <string>

namespace tandem {

// Reads a whole file; throws tandem::Error naming the path when it cannot be read.
std::string read_file(const std::filesystem::path& path);

}  // namespace tandem
