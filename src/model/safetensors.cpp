#include "model/safetensors.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <set>

#include <nlohmann/json.hpp>

#include "util/error.h"
#include "util/file.h"
#include "util/json.h"
#include "util/utf8.h"

namespace tandem::model {

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}
namespace fs = std::filesystem;
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";
// The safetensors library refuses headers above 100 MB; so do we, before parsing anything.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// An index names each tensor once, in about 100 bytes: room for a million tensors, where released
// checkpoints have under 100,000.
constexpr uint64_t kMaxIndexBytes = 100'000'000;

// Reading a header costs about 800 bytes a tensor (the parsed document and the tensor table:
// 880 MB for a million empty ones), and one near the byte limit can list 1.6 million. Released
// checkpoints hold up to about 140,000 tensors in all (Kimi K2's 60 MoE layers of 384 experts
// alone have 60 x 384 x 3 FP8 projections and as many scales, 138,240), and one file may hold a
// whole checkpoint: the limit leaves twice that, about 250 MB to read. An index lists as many.
constexpr size_t kMaxHeaderEntries = 300'000;

// The byte limits alone let a document hold 50 million values: one shape of 45 million 1s (a
// 90 MB header) took 3 GB and 35 s to read, and its error message, which writes the shape, was
// 135 MB. Its separators (',' and ':') bound the values a text can hold, counted before parsing:
// a tensor's header entry has its rank + 7 (four ':', two ',' between its fields, rank - 1 in its
// shape, one in data_offsets, one before the next entry), so 24 a tensor at the entry limit is an
// average rank of 17; an index has two a tensor (its weight_map entry and the ',' after it).
constexpr size_t kMaxHeaderSeparators = 24 * kMaxHeaderEntries;
constexpr size_t kMaxIndexSeparators = 2 * kMaxHeaderEntries + 64;

// A shape of more dimensions than numpy (2.x) allows is no tensor a framework wrote.
constexpr size_t kMaxRank = 64;

// Separators bound the values only of a shallow document: empty arrays nested 61 deep hold 61
// values and no separator, so a 100 MB header of them was 50 million values (4 GB) again. A header
// nests three deep (the document, a tensor's entry, its shape) and an index as much (the
// document, weight_map or metadata, a value); one more level is room for a tool's metadata.
constexpr size_t kMaxNesting = 4;

// What a JSON text holds, counted without building anything: bounds checked before parsing.
// Exact for valid JSON; malformed text is refused by the parser.
struct JsonTally {
  size_t top_level_members = 0;
  size_t separators = 0;  // ',' and ':' outside strings, at every depth
};

JsonTally tally(std::string_view text) {
  JsonTally t;
  size_t depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\')
        ++i;  // the escaped character cannot end the string
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      ++depth;
    } else if ((c == '}' || c == ']') && depth > 0) {
      --depth;
    } else if (c == ':') {
      ++t.separators;
      if (depth == 1) ++t.top_level_members;
    } else if (c == ',') {
      ++t.separators;
    }
  }
  return t;
}

// A read-only mapping of one shard; unmapped when the checkpoint goes away.
struct Mapping {
  void* addr = nullptr;
  size_t size = 0;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (addr) ::munmap(addr, size);
  }
};

std::unique_ptr<Mapping> map_file(const fs::path& path) {
  const RegularFile file(path);
  auto m = std::make_unique<Mapping>();
  m->size = static_cast<size_t>(file.size());
  if (m->size > 0) {
    void* addr = ::mmap(nullptr, m->size, PROT_READ, MAP_PRIVATE, file.fd(), 0);
    if (addr == MAP_FAILED) throw Error(path.string() + ": cannot map: " + std::strerror(errno));
    m->addr = addr;
  }
  return m;
}

// A header or weight_map that repeats a key would silently lose a tensor's first entry, so a
// repeated key is an error naming it. util/json's reader finds a repeat as it inserts the key;
// nlohmann's callback parser rescans an object's members at its end, which is quadratic in the
// tensors (3 s for 10,000, hours for a header near the limit).
json parse_rejecting_duplicates(std::string_view text, const std::string& where) {
  try {
    return parse_untrusted_json(text, kMaxNesting, DuplicateKeys::kRefuse);
  } catch (const Error& e) {
    throw Error(where + ": " + e.what());
  }
}

// Reads a non-negative integer from a JSON header value.
bool as_size(const json& v, uint64_t& out) {
  if (v.is_number_unsigned()) {
    out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer() && v.get<int64_t>() >= 0) {
    out = static_cast<uint64_t>(v.get<int64_t>());
    return true;
  }
  return false;
}

// Parses and validates one safetensors file, adding its tensors to `out`. Rules (those of the
// safetensors library): 8-byte little-endian header length, a JSON object header, every tensor
// with a known dtype, a shape whose byte size equals its data_offsets span, and data that covers
// the data section exactly: no overlap, no gap, nothing after the last tensor.
void parse_shard(const fs::path& path, const std::string& file, const Mapping& map,
                 std::map<std::string, TensorInfo>& out) {
  const std::string where = path.string();
  if (map.size < 8)
    throw Error(where + ": file is " + std::to_string(map.size) +
                " bytes, too short for the 8-byte header length (truncated?)");
  const auto* base = static_cast<const std::byte*>(map.addr);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(base[i]);
  if (header_len > map.size - 8)
    throw Error(where + ": header length " + std::to_string(header_len) +
                " runs past the end of the " + std::to_string(map.size) +
                "-byte file (truncated?)");
  if (header_len > kMaxHeaderBytes)
    throw Error(where + ": header length " + std::to_string(header_len) + " exceeds " +
                std::to_string(kMaxHeaderBytes) + " bytes");
  const char* header_begin = reinterpret_cast<const char*>(base + 8);
  if (header_len == 0 || header_begin[0] != '{')
    throw Error(where + ": header does not start with '{' (not a safetensors file?)");
  const std::string_view header_text(header_begin, header_len);
  const JsonTally counts = tally(header_text);
  if (counts.top_level_members > kMaxHeaderEntries)
    throw Error(where + ": header has " + std::to_string(counts.top_level_members) +
                " entries, above the limit of " + std::to_string(kMaxHeaderEntries) + " tensors");
  if (counts.separators > kMaxHeaderSeparators)
    throw Error(where + ": header has " + std::to_string(counts.separators) +
                " JSON separators (',' and ':'), above the limit of " +
                std::to_string(kMaxHeaderSeparators) + " (24 per tensor of the " +
                std::to_string(kMaxHeaderEntries) + " allowed)");
  const json header = parse_rejecting_duplicates(header_text, where + ": header");
  if (!header.is_object()) throw Error(where + ": header is not a JSON object");

  const std::byte* data = base + 8 + header_len;
  const uint64_t data_size = map.size - 8 - header_len;
  struct Span {
    uint64_t begin, end;
    std::string name;
  };
  std::vector<Span> spans;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) throw Error(where + ": __metadata__ must be an object of strings");
      for (const auto& [k, v] : entry.items())
        if (!v.is_string())
          throw Error(where + ": __metadata__ value " + utf8::quote_escaped(k) +
                      " must be a string");
      continue;
    }
    const std::string at = where + ": tensor " + utf8::quote_escaped(name);
    if (!entry.is_object()) throw Error(at + ": header entry is not an object");
    for (const auto& [k, v] : entry.items())
      if (k != "dtype" && k != "shape" && k != "data_offsets")
        throw Error(at + ": unknown header field " + utf8::quote_escaped(k));
    if (!entry.contains("dtype") || !entry["dtype"].is_string())
      throw Error(at + ": missing string field 'dtype'");
    if (!entry.contains("shape") || !entry["shape"].is_array())
      throw Error(at + ": missing list field 'shape'");
    if (!entry.contains("data_offsets") || !entry["data_offsets"].is_array() ||
        entry["data_offsets"].size() != 2)
      throw Error(at + ": 'data_offsets' must be a list [begin, end]");
    const std::string dtype_str = entry["dtype"].get<std::string>();
    const auto dtype = parse_dtype(dtype_str);
    if (!dtype)
      throw Error(at + ": unsupported dtype " + utf8::quote_escaped(dtype_str) +
                  " (supported: F32, BF16, F16, F8_E4M3, I8)");
    TensorInfo info;
    info.name = name;
    info.dtype = *dtype;
    info.file = file;
    if (entry["shape"].size() > kMaxRank)
      throw Error(at + ": shape has " + std::to_string(entry["shape"].size()) +
                  " dimensions, more than " + std::to_string(kMaxRank));
    uint64_t numel = 1;
    for (const auto& d : entry["shape"]) {
      uint64_t dim = 0;
      if (!as_size(d, dim) || dim > (uint64_t{1} << 48))
        throw Error(at + ": shape entries must be non-negative integers");
      info.shape.push_back(static_cast<int64_t>(dim));
      if (dim != 0 && numel > (uint64_t{1} << 62) / dim)
        throw Error(at + ": shape " + shape_string(info.shape) + " is too large");
      numel *= dim;
    }
    uint64_t begin = 0, end = 0;
    if (!as_size(entry["data_offsets"][0], begin) || !as_size(entry["data_offsets"][1], end) ||
        begin > end)
      throw Error(at + ": 'data_offsets' must be non-negative integers with begin <= end");
    // The element cap alone still lets a 4-byte dtype reach 2^64 bytes, which wraps to a small
    // (even zero) size that a crafted data_offsets span could match.
    uint64_t expected = 0;
    if (__builtin_mul_overflow(numel, uint64_t{dtype_size(*dtype)}, &expected))
      throw Error(at + ": shape " + shape_string(info.shape) + " of " + dtype_str +
                  " is too large (its byte size overflows 64 bits)");
    if (end - begin != expected)
      throw Error(at + ": shape " + shape_string(info.shape) + " of " + dtype_str + " needs " +
                  std::to_string(expected) + " bytes but data_offsets [" + std::to_string(begin) +
                  ", " + std::to_string(end) + "] span " + std::to_string(end - begin));
    if (end > data_size)
      throw Error(at + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                  "] run past the end of the " + std::to_string(data_size) +
                  "-byte data section (truncated file?)");
    info.data = data + begin;
    info.nbytes = static_cast<size_t>(expected);
    if (out.count(name))
      throw Error(where + ": tensor " + utf8::quote_escaped(name) + " also appears in " +
                  out[name].file);
    out.emplace(name, std::move(info));
    spans.push_back({begin, end, name});
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t pos = 0;
  std::string prev;
  for (const Span& s : spans) {
    if (s.begin < pos)
      throw Error(where + ": tensors " + utf8::quote_escaped(prev) + " and " +
                  utf8::quote_escaped(s.name) + " overlap (data_offsets of " +
                  utf8::quote_escaped(s.name) + " start at " + std::to_string(s.begin) +
                  ", before " + std::to_string(pos) + ")");
    if (s.begin > pos)
      throw Error(where + ": " + std::to_string(s.begin - pos) + " unused bytes before tensor " +
                  utf8::quote_escaped(s.name) + " (data must be contiguous)");
    pos = s.end;
    prev = s.name;
  }
  if (pos != data_size)
    throw Error(where + ": " + std::to_string(data_size - pos) +
                " bytes after the last tensor's data (data must end with the last tensor)");
}

// A shard name from an index: a plain file name in the checkpoint folder. Control bytes are
// refused: a NUL ends the name where it becomes a path (a C string), so "<shard>\0x" opened
// <shard> and "..\0x" the parent; Python's open refuses an embedded NUL.
void check_shard_name(const fs::path& index, const std::string& file, const std::string& tensor) {
  if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos ||
      file.find('\\') != std::string::npos || utf8::has_control_bytes(file))
    throw Error(index.string() + ": tensor " + utf8::quote_escaped(tensor) + " maps to " +
                utf8::quote_escaped(file) + ", which is not a file name in the checkpoint folder");
}

// Hugging Face's names: one file, or 1-based, five-digit zero-padded shard numbers.
std::string shard_file_name(size_t index, size_t count) {
  if (count == 1) return kSingleFile;
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return buf;
}

// "model-<digits>-of-<digits>.safetensors", a shard of an earlier sharded checkpoint.
bool is_shard_name(const std::string& n) {
  const std::string prefix = "model-", suffix = ".safetensors", of = "-of-";
  if (n.size() <= prefix.size() + suffix.size() || n.compare(0, prefix.size(), prefix) != 0 ||
      n.compare(n.size() - suffix.size(), suffix.size(), suffix) != 0)
    return false;
  const std::string mid = n.substr(prefix.size(), n.size() - prefix.size() - suffix.size());
  const size_t at = mid.find(of);
  if (at == std::string::npos || at == 0 || at + of.size() == mid.size()) return false;
  auto digits = [](std::string_view v) {
    return std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  return digits(std::string_view(mid).substr(0, at)) &&
         digits(std::string_view(mid).substr(at + of.size()));
}

// "<checkpoint file>.tmp.<pid>.<n>", create_temporary_beside's name for a shard being written,
// whose writer is no longer running: what an interrupted quantize or make-model left. A running
// writer's (this process's, or a pid that exists, even another user's) is not touched.
bool is_orphaned_temporary(const std::string& n) {
  const size_t at = n.find(".tmp.");
  if (at == std::string::npos) return false;
  const std::string base = n.substr(0, at);
  if (base != kSingleFile && !is_shard_name(base)) return false;
  const std::string_view rest = std::string_view(n).substr(at + 5);
  const size_t dot = rest.find('.');
  if (dot == std::string_view::npos || dot + 1 == rest.size() ||
      !std::all_of(rest.begin() + dot + 1, rest.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return false;
  pid_t pid = 0;
  const auto [end, ec] = std::from_chars(rest.data(), rest.data() + dot, pid);
  if (ec != std::errc() || end != rest.data() + dot || pid <= 0) return false;
  return ::kill(pid, 0) == -1 && errno == ESRCH;
}

void write_text(const fs::path& path, const std::string& text) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) throw Error(path.string() + ": cannot create: " + std::strerror(errno));
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if (std::fclose(f) != 0 || !ok)
    throw Error(path.string() + ": cannot write: " + std::strerror(errno));
}

}  // namespace

void release_pages(const void* data, size_t bytes) {
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t first = (begin + page - 1) / page * page, end = (begin + bytes) / page * page;
  // The mapping is private and never written, so dropping its pages loses nothing; a failure only
  // leaves them resident.
  if (end > first) ::madvise(reinterpret_cast<void*>(first), end - first, MADV_DONTNEED);
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

size_t TensorSpec::nbytes() const {
  size_t n = dtype_size(dtype);
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

struct Checkpoint::Impl {
  fs::path dir;
  std::vector<std::unique_ptr<Mapping>> maps;
  std::map<std::string, TensorInfo> tensors;
  size_t total = 0;
};

Checkpoint::Checkpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Checkpoint::~Checkpoint() = default;
Checkpoint::Checkpoint(Checkpoint&&) noexcept = default;
Checkpoint& Checkpoint::operator=(Checkpoint&&) noexcept = default;

Checkpoint Checkpoint::open(const fs::path& dir) {
  auto impl = std::make_unique<Impl>();
  impl->dir = dir;
  const fs::path index_path = dir / kIndexFile;
  const fs::path single_path = dir / kSingleFile;
  if (fs::exists(index_path)) {
    const std::string index_text = read_regular_file(index_path, kMaxIndexBytes);
    if (const size_t separators = tally(index_text).separators; separators > kMaxIndexSeparators)
      throw Error(index_path.string() + ": has " + std::to_string(separators) +
                  " JSON separators (',' and ':'), above the limit of " +
                  std::to_string(kMaxIndexSeparators) + " (a weight_map of " +
                  std::to_string(kMaxHeaderEntries) + " tensors)");
    const json index = parse_rejecting_duplicates(index_text, index_path.string());
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
      throw Error(index_path.string() + ": expected an object with a \"weight_map\" object");
    if (index.contains("metadata") && !index["metadata"].is_object() &&
        !index["metadata"].is_null())
      throw Error(index_path.string() + ": \"metadata\" must be an object");
    std::map<std::string, std::vector<std::string>> by_file;  // file -> tensors
    for (const auto& [name, file] : index["weight_map"].items()) {
      if (!file.is_string())
        throw Error(index_path.string() + ": weight_map entry for " + utf8::quote_escaped(name) +
                    " is not a file name string");
      check_shard_name(index_path, file.get<std::string>(), name);
      by_file[file.get<std::string>()].push_back(name);
    }
    if (by_file.empty()) throw Error(index_path.string() + ": weight_map is empty");
    for (const auto& [file, names] : by_file) {
      const fs::path shard = dir / file;
      if (!fs::exists(shard))
        throw Error(index_path.string() + " maps tensor " + utf8::quote_escaped(names.front()) +
                    (names.size() > 1 ? " (and " + std::to_string(names.size() - 1) + " more)"
                                      : std::string()) +
                    " to shard " + utf8::quote_escaped(file) + ", but " + shard.string() +
                    " does not exist");
      impl->maps.push_back(map_file(shard));
      std::map<std::string, TensorInfo> found;
      parse_shard(shard, file, *impl->maps.back(), found);
      const std::set<std::string> listed(names.begin(), names.end());
      for (const auto& name : names)
        if (!found.count(name))
          throw Error(index_path.string() + " maps tensor " + utf8::quote_escaped(name) + " to " +
                      utf8::quote_escaped(file) + ", but " + shard.string() +
                      " has no such tensor");
      for (auto& [name, info] : found) {
        if (!listed.count(name)) {
          const auto& wm = index["weight_map"];
          throw Error(shard.string() + ": tensor " + utf8::quote_escaped(name) +
                      (wm.contains(name)
                           ? " is mapped to " + utf8::quote_escaped(wm[name].get<std::string>()) +
                                 " by " + index_path.string()
                           : " is not listed in " + index_path.string()));
        }
        impl->tensors.emplace(name, std::move(info));
      }
    }
  } else if (fs::exists(single_path)) {
    impl->maps.push_back(map_file(single_path));
    parse_shard(single_path, kSingleFile, *impl->maps.back(), impl->tensors);
  } else {
    throw Error(dir.string() + ": no " + kIndexFile + " or " + kSingleFile +
                (fs::is_directory(dir) ? std::string() : " (the folder does not exist)"));
  }
  for (const auto& [name, info] : impl->tensors) impl->total += info.nbytes;
  return Checkpoint(std::move(impl));
}

const TensorInfo* Checkpoint::find(const std::string& name) const {
  auto it = impl_->tensors.find(name);
  return it == impl_->tensors.end() ? nullptr : &it->second;
}

const TensorInfo& Checkpoint::get(const std::string& name,
                                  const std::vector<int64_t>& expected_shape) const {
  const TensorInfo* t = find(name);
  if (!t)
    throw Error("checkpoint " + impl_->dir.string() + ": missing tensor " +
                utf8::quote_escaped(name) + " (expected shape " + shape_string(expected_shape) +
                ")");
  if (t->shape != expected_shape)
    throw Error("checkpoint " + impl_->dir.string() + ": tensor " + utf8::quote_escaped(name) +
                " in " + t->file + " has shape " + shape_string(t->shape) + ", expected " +
                shape_string(expected_shape));
  return *t;
}

const std::map<std::string, TensorInfo>& Checkpoint::tensors() const {
  return impl_->tensors;
}
size_t Checkpoint::total_bytes() const {
  return impl_->total;
}
const fs::path& Checkpoint::dir() const {
  return impl_->dir;
}

void write_checkpoint(const fs::path& dir, const std::vector<TensorSpec>& specs,
                      const std::function<void(const TensorSpec&, std::span<std::byte>)>& fill,
                      size_t max_shard_bytes, const std::function<void(size_t, size_t)>& progress) {
  std::set<std::string> names;
  size_t total = 0;
  for (const auto& s : specs) {
    if (s.name.empty() || s.name == "__metadata__")
      throw Error("write_checkpoint: invalid tensor name " + utf8::quote_escaped(s.name));
    if (!names.insert(s.name).second)
      throw Error("write_checkpoint: tensor " + utf8::quote_escaped(s.name) + " given twice");
    for (int64_t d : s.shape)
      if (d < 0)
        throw Error("write_checkpoint: tensor " + utf8::quote_escaped(s.name) +
                    " has a negative dim");
    total += s.nbytes();
  }
  if (specs.empty()) throw Error("write_checkpoint: no tensors");

  // Shards in the order given: a new shard starts when the next tensor would overflow the
  // current one (a tensor larger than the limit gets a shard of its own), as transformers does.
  std::vector<std::vector<const TensorSpec*>> shards(1);
  size_t shard_bytes = 0;
  for (const auto& s : specs) {
    if (!shards.back().empty() && shard_bytes + s.nbytes() > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(&s);
    shard_bytes += s.nbytes();
  }

  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw Error(dir.string() + ": cannot create folder: " + ec.message());
  // Files of an earlier checkpoint in the folder would be mistaken for part of this one; shards an
  // interrupted writer left half-written only take space (a failure to remove one is no error).
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string n = entry.path().filename().string();
    if (n == kSingleFile || n == kIndexFile || is_shard_name(n))
      fs::remove(entry.path());
    else if (is_orphaned_temporary(n) && !entry.is_directory(ec))
      fs::remove(entry.path(), ec);
  }

  size_t written = 0;
  std::vector<std::byte> buffer;
  ordered_json weight_map = ordered_json::object();
  std::map<std::string, std::string> file_of;
  for (size_t si = 0; si < shards.size(); ++si) {
    const std::string file = shard_file_name(si, shards.size());
    // Within a shard, larger elements first (stable otherwise), as the safetensors library
    // orders data: with the 8-byte aligned header every tensor is then naturally aligned in
    // the mapping, so F32/BF16 data can be read in place.
    std::vector<const TensorSpec*> order = shards[si];
    std::stable_sort(order.begin(), order.end(), [](const TensorSpec* a, const TensorSpec* b) {
      return dtype_size(a->dtype) > dtype_size(b->dtype);
    });
    ordered_json header = ordered_json::object();
    header["__metadata__"] = {{"format", "pt"}};
    size_t offset = 0;
    for (const TensorSpec* s : order) {
      header[s->name] = {{"dtype", std::string(dtype_name(s->dtype))},
                         {"shape", s->shape},
                         {"data_offsets", {offset, offset + s->nbytes()}}};
      offset += s->nbytes();
      file_of[s->name] = file;
    }
    std::string header_text = header.dump();
    // Pad with spaces (allowed trailing JSON whitespace) so the data starts 8-byte aligned.
    header_text.append((8 - header_text.size() % 8) % 8, ' ');

    const fs::path path = dir / file;
    fs::path tmp;
    const int fd = create_temporary_beside(path, &tmp);
    std::FILE* f = ::fdopen(fd, "wb");
    if (!f) {
      const int err = errno;
      ::close(fd);
      fs::remove(tmp);
      throw Error(path.string() + ": cannot write: " + std::strerror(err));
    }
    auto fail = [&](const std::string& what) {
      const std::string msg = path.string() + ": " + what + ": " + std::strerror(errno);
      std::fclose(f);
      fs::remove(tmp);
      throw Error(msg);
    };
    uint8_t len_bytes[8];
    for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<uint8_t>(header_text.size() >> (8 * i));
    if (std::fwrite(len_bytes, 1, 8, f) != 8 ||
        std::fwrite(header_text.data(), 1, header_text.size(), f) != header_text.size())
      fail("cannot write header");
    for (const TensorSpec* s : order) {
      const size_t n = s->nbytes();
      buffer.assign(n, std::byte{0});
      try {
        fill(*s, std::span<std::byte>(buffer.data(), n));
      } catch (...) {
        std::fclose(f);
        fs::remove(tmp);
        throw;
      }
      if (n > 0 && std::fwrite(buffer.data(), 1, n, f) != n) fail("cannot write " + s->name);
      written += n;
      if (progress) progress(written, total);
    }
    if (std::fclose(f) != 0) {
      const int err = errno;
      fs::remove(tmp);
      throw Error(path.string() + ": cannot write: " + std::strerror(err));
    }
    fs::rename(tmp, path, ec);
    if (ec) {
      std::error_code ignored;
      fs::remove(tmp, ignored);  // its name is this write's alone: nothing else would remove it
      throw Error(path.string() + ": cannot rename from " + tmp.string() + ": " + ec.message());
    }
  }
  buffer = {};
  if (shards.size() > 1) {
    // As transformers writes it: sorted keys, two-space indent, trailing newline.
    for (const auto& [name, file] : file_of) weight_map[name] = file;
    ordered_json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    write_text(dir / kIndexFile, index.dump(2) + "\n");
  }
}

}  // namespace tandem::model
