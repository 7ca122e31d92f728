#include "util/proc_fields.h"

#include <exception>
#include <fstream>
#include <string>

namespace tandem::util {

size_t proc_kb_field(const std::filesystem::path& file, std::string_view name) {
  std::ifstream f(file);
  std::string line;
  while (std::getline(f, line)) {
    if (line.size() <= name.size() || line.compare(0, name.size(), name) != 0 ||
        line[name.size()] != ':')
      continue;
    try {
      return static_cast<size_t>(std::stoull(line.substr(name.size() + 1))) * 1024;
    } catch (const std::exception&) {
      return 0;  // a line we do not understand: as if absent
    }
  }
  return 0;
}

}  // namespace tandem::util
