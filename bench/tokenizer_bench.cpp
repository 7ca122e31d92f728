// Single-thread encode throughput of Tandem's tokenizer next to the native Hugging Face tokenizers
// binding, on the same corpus in the same run. The ids of both sides must be identical.
// Usage: tandem-bench-tokenizer --model DIR --corpus FILE.jsonl [--reference-ids FILE
// --reference-seconds S] (bench/tokenizer_throughput.sh builds the corpus, runs the reference and
// calls this program.)
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "text/tokenizer.h"
#include "util/error.h"

namespace {

using tandem::text::TokenId;

std::vector<std::string> load_corpus(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw tandem::Error("cannot read corpus " + path);
  std::vector<std::string> docs;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) docs.push_back(nlohmann::json::parse(line).get<std::string>());
  return docs;
}

std::vector<TokenId> load_ids(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw tandem::Error("cannot read reference ids " + path);
  std::vector<char> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<TokenId> ids(raw.size() / sizeof(TokenId));
  std::memcpy(ids.data(), raw.data(), ids.size() * sizeof(TokenId));
  return ids;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Tokenizer encode throughput: Tandem vs Hugging Face tokenizers"};
  std::string model, corpus, ref_ids;
  double ref_seconds = 0;
  int repeats = 3;
  app.add_option("--model", model, "Hugging Face model folder")->required();
  app.add_option("--corpus", corpus, "JSONL corpus, one document per line")->required();
  app.add_option("--reference-ids", ref_ids, "ids written by bench/hf_tokenizer_encode.js");
  app.add_option("--reference-seconds", ref_seconds, "reference encode time on the same corpus");
  app.add_option("--repeats", repeats, "timed passes over the corpus (best is reported)");
  CLI11_PARSE(app, argc, argv);

  try {
    const auto docs = load_corpus(corpus);
    size_t bytes = 0;
    for (const auto& d : docs) bytes += d.size();
    const auto tok = tandem::text::Tokenizer::from_dir(model);

    std::vector<TokenId> ours;
    double best = 1e300;
    for (int r = 0; r < repeats; ++r) {
      std::vector<TokenId> all;
      all.reserve(bytes / 2);
      auto t0 = std::chrono::steady_clock::now();
      for (const auto& d : docs) {
        auto ids = tok.encode(d, false);
        all.push_back(static_cast<TokenId>(ids.size()));
        all.insert(all.end(), ids.begin(), ids.end());
      }
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (s < best) best = s;
      ours = std::move(all);
    }
    const size_t tokens = ours.size() - docs.size();
    std::printf("corpus: %zu documents, %.1f MiB, %zu tokens\n", docs.size(), bytes / 1048576.0,
                tokens);
    std::printf("tandem:       %8.3f s  %10.0f tokens/s  %6.1f MB/s\n", best, tokens / best,
                bytes / best / 1e6);
    if (!ref_ids.empty()) {
      const auto ref = load_ids(ref_ids);
      if (ref != ours) {
        size_t at = 0;
        while (at < ref.size() && at < ours.size() && ref[at] == ours[at]) ++at;
        std::printf("MISMATCH: ids differ from the reference at position %zu\n", at);
        return 1;
      }
      std::printf("hf tokenizers: %8.3f s  %10.0f tokens/s  %6.1f MB/s\n", ref_seconds,
                  tokens / ref_seconds, bytes / ref_seconds / 1e6);
      std::printf("ids identical; speed-up tandem / hf = %.2fx\n", ref_seconds / best);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
