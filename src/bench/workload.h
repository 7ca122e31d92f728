#pragma once
// Workloads of `tandem bench`: lists of requests (prompt, output length, arrival time) built
// from synthetic generators that mirror vLLM's `vllm bench serve` datasets (random,
// prefix_repetition, sharegpt) and from the Mooncake and Azure request traces.
//
// Synthetic token content is "text-safe": every token is a vocabulary entry that decodes to one
// space-led ASCII word and encodes back to exactly itself, so any concatenation round-trips:
// tokenizer.encode(prompt_text, false) == prompt_ids. A driver may therefore send either the
// ids (tokens-in) or the text and the server sees the same prompt. Every generator is
// deterministic for a given seed, on every platform (bench/rng.h).
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <istream>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "text/tokenizer.h"

namespace tandem::bench {

// Bounds on what a workload may ask for, so that a typo or a corrupt trace row is an error that
// names it, not an allocation failure or a clock overflow far from it.
// Tokens of one request's prompt or output (the largest context of any served model is ~1M).
constexpr int64_t kMaxRequestTokens = 10'000'000;
// Requests of a synthetic workload (--num-prompts).
constexpr int64_t kMaxRequests = 10'000'000;
// A send time, seconds from the start (~31 years); the clocks count int64 nanoseconds (~292).
constexpr double kMaxArrivalSeconds = 1e9;
// One line of a trace or an access log: far above any real record.
constexpr size_t kMaxLineBytes = size_t{64} << 20;
// Prompt tokens of a workload made whole, ids and text (~25 bytes a token: ~2.5 GB): a synthetic
// one, or a trace window that `tandem bench` replays (100 Azure rows of 10^7 tokens ran 107 s
// into an allocation failure). `tandem simulate` makes a trace's requests as it sends them.
constexpr int64_t kMaxWorkloadPromptTokens = 100'000'000;

// Text from a file as an error message quotes it: in double quotes, its first 40 bytes (cut at
// a character boundary) and "..." when cut. A line may be 64 MiB.
std::string excerpt(std::string_view text);
// A JSON parser's error as an error message quotes it: its words and position (line, column)
// whole, the text it last read cut as excerpt() cuts it. nlohmann's message holds the whole
// token, so a line with a 50 MB string made a 50 MB error line.
std::string json_error_text(const std::exception& error);

// One line of `in` without its '\n' (and '\r'). False at the end of the input; throws
// tandem::Error naming `what` and the line number `line_no` (1-based) when the line is longer
// than kMaxLineBytes or the read fails.
bool read_line(std::istream& in, std::string& line, const std::string& what, int64_t line_no);
// Throws tandem::Error "`what`: ..." unless `path` is something to read: it exists, is not a
// directory (reading one failed deep in the stream library with a message naming nothing) and
// opens. Pipes and devices pass: a trace may come through one.
void check_input_file(const std::filesystem::path& path, const std::string& what);

struct BenchRequest {
  double arrival_s = 0;  // send time relative to the start of the run
  std::vector<int32_t> prompt_ids;
  std::string prompt_text;  // encodes (no BOS / special tokens) to exactly prompt_ids
  int64_t output_len = 0;   // tokens to generate (send with ignore_eos to force it)
};

// A workload whose requests are made when they are sent: the arrival times up front, each
// request on demand, so a whole trace is never in memory at once. `make(i)` returns request i
// with arrival_s[i]; its prompt_text may be empty (drivers that send ids need none).
struct LazyWorkload {
  std::vector<double> arrival_s;
  std::function<BenchRequest(size_t)> make;
  size_t size() const { return arrival_s.size(); }
};
// The requests as a LazyWorkload (copies on demand).
LazyWorkload lazy(std::vector<BenchRequest> requests);

// The text-safe token vocabulary of a tokenizer: ids whose bytes are ' ' followed by ASCII
// letters only, that are not special, and that the tokenizer encodes back to that single id
// (checked for every candidate when built). Building it encodes ~100k short strings.
class TokenVocab {
 public:
  // Throws tandem::Error when the tokenizer has fewer than 1000 such tokens.
  static TokenVocab build(const text::Tokenizer& tokenizer);

  size_t size() const { return ids_.size(); }
  int32_t id(size_t index) const { return ids_[index]; }
  // The text of `ids`, each of which must be in this vocabulary (else tandem::Error).
  std::string render(std::span<const int32_t> ids) const;
  bool contains(int32_t id) const;

 private:
  std::vector<int32_t> ids_;
  std::vector<std::string> text_by_id_;  // indexed by token id; empty when not text-safe
};

// --- random (vLLM RandomDataset) ----------------------------------------------------------
// Input length uniform over the integers [floor(L*(1-r)), ceil(L*(1+r))] with
// L = input_len - num_special_tokens; output length likewise over
// [max(1, floor(O*(1-r))), max(1, ceil(O*(1+r)))]; r = range_ratio in [0, 1). Tokens are drawn
// uniformly from the text-safe vocabulary.
struct RandomOptions {
  int64_t num_requests = 1000;
  int64_t input_len = 1024;
  int64_t output_len = 128;
  double range_ratio = 0.0;
  // Tokens the server adds to every prompt (BOS), subtracted from input_len as vLLM does with
  // tokenizer.num_special_tokens_to_add(): prompt_ids hold input_len - num_special_tokens ids,
  // and the server-side length matches the target once the BOS is added (a server adds it to
  // text; `tandem bench` puts it first in token-id prompts, DriverOptions::bos_id).
  int64_t num_special_tokens = 0;
  uint64_t seed = 0;
};
std::vector<BenchRequest> random_workload(const TokenVocab& vocab, const RandomOptions& options);

// --- prefix_repetition (vLLM PrefixRepetitionRandomDataset) ----------------------------------
// num_prefixes random prefixes of prefix_len tokens; each is followed by a fresh random suffix of
// suffix_len tokens in num_requests / num_prefixes requests (integer division, as vLLM: the
// workload has floor(num_requests / num_prefixes) * num_prefixes requests). Requests are
// shuffled unless shuffle is false (then grouped by prefix). A prompt is prefix_len + suffix_len
// ids, the length vLLM reports; the server sees the BOS too, as vLLM's text prompts get it.
struct PrefixRepetitionOptions {
  int64_t num_requests = 1000;
  int64_t prefix_len = 256;
  int64_t suffix_len = 256;
  int64_t num_prefixes = 10;
  int64_t output_len = 128;
  bool shuffle = true;
  uint64_t seed = 0;
};
std::vector<BenchRequest> prefix_repetition_workload(const TokenVocab& vocab,
                                                     const PrefixRepetitionOptions& options);

// --- sharegpt (vLLM ShareGPTDataset) -------------------------------------------------------
// A JSON list of {"conversations": [{"from", "value"}, ...]}; entries with fewer than two turns
// are dropped. Turn 0 is the prompt and turn 1 the reference completion (vLLM takes the first
// two turns by position, which in ShareGPT are the first human turn and the first gpt reply).
// Lengths are counted as vLLM counts them, with the tokenizer's special tokens (BOS) added:
// an entry is skipped when prompt_len < min_len, output_len < min_len (unless output_len is
// fixed), prompt_len > max_prompt_len or prompt_len + output_len > max_total_len.
// output_len = token count of turn 1 (BOS included, as in vLLM) unless fixed. prompt_ids are
// the prompt's ids without special tokens (the driver counts and sends the BOS with them, so the
// prompt length is vLLM's len(tokenizer(prompt).input_ids)). The kept entries are taken in a seeded
// shuffled order (our own shuffle, so not the same subset as vLLM's for the same seed); when fewer
// than num_requests pass, the list is topped up with seeded random repeats (vLLM's oversampling)
// unless oversample is false. The workload is made whole, repeats included: one of more than
// max_prompt_tokens prompt tokens in all is refused (tandem::Error naming num_requests_name and
// the count) before any repeat is made.
struct ShareGptOptions {
  std::filesystem::path path;
  int64_t num_requests = 1000;
  std::optional<int64_t> output_len;  // fixed output length for every request
  int64_t min_len = 4;
  int64_t max_prompt_len = 1024;
  int64_t max_total_len = 2048;
  bool shuffle = true;
  bool oversample = true;
  uint64_t seed = 0;
  int64_t max_prompt_tokens = kMaxWorkloadPromptTokens;
  std::string num_requests_name = "num_requests";  // how errors name it (the CLI's flag)
};
std::vector<BenchRequest> sharegpt_workload(const text::Tokenizer& tokenizer,
                                            const ShareGptOptions& options);

// --- trace replay --------------------------------------------------------------------------
// Which part of a trace to replay: `limit` records (0: all) from record `start` (0-based, in
// file order). Arrivals are offsets from the first record of the window, multiplied by
// time_scale (0.5 replays twice as fast, 2 half as fast; 0 sends everything at once).
struct TraceWindow {
  int64_t start = 0;
  int64_t limit = 0;
  double time_scale = 1.0;
};

// Mooncake FAST'25 trace (JSONL): {"timestamp": ms, "input_length", "output_length",
// "hash_ids": [...]}, one hash id per block of block_size (512) prompt tokens.
struct MooncakeRecord {
  int64_t line = 0;  // in the file, 1-based
  double timestamp_ms = 0;
  int64_t input_length = 0;
  int64_t output_length = 0;
  std::vector<int64_t> hash_ids;
  // The first timestamp in the file later than this record's, when one follows (for the window's
  // last records read_mooncake_trace looks past the window for it): the end of the gap
  // --trace-spread spreads a run of equal timestamps over.
  std::optional<double> next_timestamp_ms;
};
// Reads the window's records (timestamps as in the file). Checks that
// hash_ids.size() == ceil(input_length / block_size) and names line and field on any error.
// `records_read`, when given, is set to the records counted: the file's all unless the window
// ended before the file did (so always when the window comes out empty).
std::vector<MooncakeRecord> read_mooncake_trace(const std::filesystem::path& path,
                                                const TraceWindow& window, int64_t block_size = 512,
                                                int64_t* records_read = nullptr);

// Expands every hash id into a block of block_size text-safe tokens that depends only on
// (seed, hash id): equal hash ids give identical blocks in every request, so the trace's prefix
// sharing reaches the server's prefix cache. A request's last block is cut to input_length.
struct MooncakeOptions {
  std::filesystem::path path;
  TraceWindow window;
  int64_t block_size = 512;
  uint64_t seed = 0;
  // The published traces round timestamps to 3 s, so ~10 requests share each one; replayed as
  // they are, every group arrives at one instant. With `spread`, mooncake_arrivals spreads them.
  bool spread = false;
  // The window's prompt tokens at most: it is made whole (the bound's line is named).
  int64_t max_prompt_tokens = kMaxWorkloadPromptTokens;
};
std::vector<BenchRequest> mooncake_workload(const TokenVocab& vocab,
                                            const MooncakeOptions& options);
// The block_size tokens of one hash id (what mooncake_workload puts at that block).
std::vector<int32_t> mooncake_block(const TokenVocab& vocab, int64_t hash_id, int64_t block_size,
                                    uint64_t seed);
// One record expanded as mooncake_workload expands it (arrival_s left 0). The whole
// conversation trace is 145 M prompt tokens (~1.5 GB as ids plus text), so a driver replaying
// all of it should read the records and expand each request shortly before sending it
// (LazyWorkload).
BenchRequest mooncake_request(const TokenVocab& vocab, const MooncakeRecord& record,
                              int64_t block_size, uint64_t seed);
// The records' send times as mooncake_workload gives them: offsets from the first, in seconds,
// times time_scale. With `spread`, the records of a run of equal timestamps arrive at uniform
// random times (drawn from `seed`, sorted, so arrivals keep the file's order) between their
// timestamp and the next distinct one (the last run: its next_timestamp_ms, else the gap before
// it; a window of one timestamp with neither is refused, naming its first line); without it, at
// their timestamp.
std::vector<double> mooncake_arrivals(const std::vector<MooncakeRecord>& records, double time_scale,
                                      bool spread = false, uint64_t seed = 0);
// Its prompt's ids alone (no text).
std::vector<int32_t> mooncake_prompt(const TokenVocab& vocab, const MooncakeRecord& record,
                                     int64_t block_size, uint64_t seed);

// Azure LLM inference trace (CSV: TIMESTAMP "YYYY-MM-DD HH:MM:SS.fffffff", ContextTokens,
// GeneratedTokens). No prefix information: each prompt is random text-safe tokens.
struct AzureRecord {
  int64_t line = 0;     // in the file, 1-based
  int64_t index = 0;    // the record's place in the file, 0-based: it seeds the prompt
  double offset_s = 0;  // seconds since the first record of the file
  int64_t context_tokens = 0;
  int64_t generated_tokens = 0;
};
// `records_read` as read_mooncake_trace's.
std::vector<AzureRecord> read_azure_trace(const std::filesystem::path& path,
                                          const TraceWindow& window,
                                          int64_t* records_read = nullptr);
struct AzureOptions {
  std::filesystem::path path;
  TraceWindow window;
  uint64_t seed = 0;
  // The window's prompt tokens at most: it is made whole (the bound's line is named).
  int64_t max_prompt_tokens = kMaxWorkloadPromptTokens;
};
std::vector<BenchRequest> azure_workload(const TokenVocab& vocab, const AzureOptions& options);
// One record's prompt ids as azure_workload makes them (for a driver that makes each request as
// it sends it), and the records' send times: offsets from the first, times time_scale.
std::vector<int32_t> azure_prompt(const TokenVocab& vocab, const AzureRecord& record,
                                  uint64_t seed);
std::vector<double> azure_arrivals(const std::vector<AzureRecord>& records, double time_scale);

}  // namespace tandem::bench
