#pragma once
// Fields of the kernel's per-process text files (/proc/self/status, /proc/self/smaps_rollup),
// for the memory figures the engine, its benchmarks and tests report.
#include <cstddef>
#include <filesystem>
#include <string_view>

namespace tandem::util {

// The value of the line "`name`: N kB" in `file`, in bytes; 0 where the file or line is absent.
size_t proc_kb_field(const std::filesystem::path& file, std::string_view name);

}  // namespace tandem::util
