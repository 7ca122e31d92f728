// Safetensors: write/read round trips (single file and shards), strict reader errors that name
// the file and tensor, and an independent Python reader of what the writer produces.
#include "model/safetensors.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <numeric>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "kernels/cpu/ops.h"
#include "model/deepseek.h"
#include "model/latent_cache.h"
#include "model/model_test_support.h"
#include "model/random_checkpoint.h"
#include "model/tensor_binder.h"
#include "text/oracle_support.h"
#include "util/error.h"
#include "util/fifo.h"

namespace tandem::model {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

// Deterministic contents: element i of a tensor is a small value derived from its name.
void fill_pattern(const TensorSpec& s, std::span<std::byte> out) {
  const size_t n = out.size() / dtype_size(s.dtype);
  const float base = static_cast<float>(s.name.size() % 7);
  for (size_t i = 0; i < n; ++i) {
    const float v = base + 0.25f * static_cast<float>(i % 13) - 1.5f;
    std::byte* p = out.data() + i * dtype_size(s.dtype);
    switch (s.dtype) {
      case DType::kF32:
        std::memcpy(p, &v, 4);
        break;
      case DType::kBF16: {
        const uint16_t b = f32_to_bf16(v);
        std::memcpy(p, &b, 2);
        break;
      }
      case DType::kF16: {
        const uint16_t b = f32_to_f16(v);
        std::memcpy(p, &b, 2);
        break;
      }
      case DType::kF8E4M3:
        *p = static_cast<std::byte>(f32_to_f8e4m3(v));
        break;
      case DType::kI8:
        *p = static_cast<std::byte>(static_cast<int8_t>(i % 255) - 127);
        break;
    }
  }
}

std::vector<TensorSpec> mixed_specs(int copies) {
  std::vector<TensorSpec> specs;
  for (int k = 0; k < copies; ++k) {
    const std::string p = "model.layers." + std::to_string(k) + ".";
    specs.push_back({p + "norm.weight", DType::kBF16, {33}});  // odd: tests alignment ordering
    specs.push_back({p + "proj.weight", DType::kF8E4M3, {17, 129}});
    specs.push_back({p + "proj.weight_scale_inv", DType::kF32, {1, 2}});
    specs.push_back({p + "q.weight", DType::kI8, {5, 7}});
    specs.push_back({p + "q.weight_scale", DType::kF32, {5, 1}});
    specs.push_back({p + "half.weight", DType::kF16, {3, 3}});
    specs.push_back({p + "big.weight", DType::kF32, {64, 40}});
  }
  specs.push_back({"scalar", DType::kF32, {}});
  specs.push_back({"empty", DType::kBF16, {0, 4}});
  return specs;
}

void expect_matches(const Checkpoint& ck, const std::vector<TensorSpec>& specs) {
  ASSERT_EQ(ck.tensors().size(), specs.size());
  size_t total = 0;
  for (const auto& s : specs) {
    const TensorInfo* t = ck.find(s.name);
    ASSERT_NE(t, nullptr) << s.name;
    EXPECT_EQ(t->dtype, s.dtype) << s.name;
    EXPECT_EQ(t->shape, s.shape) << s.name;
    ASSERT_EQ(t->nbytes, s.nbytes()) << s.name;
    EXPECT_EQ(t->numel() * static_cast<int64_t>(dtype_size(s.dtype)),
              static_cast<int64_t>(s.nbytes()));
    std::vector<std::byte> want(s.nbytes());
    fill_pattern(s, want);
    EXPECT_TRUE(s.nbytes() == 0 || std::memcmp(t->data, want.data(), s.nbytes()) == 0) << s.name;
    // Natural alignment in the mapping, so kernels may read F32/BF16 in place.
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t->data) % dtype_size(s.dtype), 0u) << s.name;
    total += s.nbytes();
  }
  EXPECT_EQ(ck.total_bytes(), total);
}

TEST(Safetensors, SingleFileRoundTrip) {
  test::TempDir dir("st-single");
  const auto specs = mixed_specs(2);
  size_t last = 0, total = 0;
  write_checkpoint(dir.path(), specs, fill_pattern, size_t{1} << 30, [&](size_t done, size_t all) {
    EXPECT_GE(done, last);
    last = done;
    total = all;
  });
  EXPECT_EQ(last, total);
  EXPECT_TRUE(fs::exists(dir / "model.safetensors"));
  EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  const auto ck = Checkpoint::open(dir.path());
  expect_matches(ck, specs);
  EXPECT_EQ(ck.find("scalar")->file, "model.safetensors");
  EXPECT_EQ(ck.dir(), dir.path());
  // The header: 8-byte length, JSON padded with spaces to a multiple of 8, format metadata.
  const std::string raw = test::read_bytes(dir / "model.safetensors");
  uint64_t n = 0;
  std::memcpy(&n, raw.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  const auto header = nlohmann::json::parse(raw.substr(8, n));
  EXPECT_EQ(header["__metadata__"], nlohmann::json({{"format", "pt"}}));
}

TEST(Safetensors, ShardedRoundTripAndIndex) {
  test::TempDir dir("st-sharded");
  const auto specs = mixed_specs(6);
  write_checkpoint(dir.path(), specs, fill_pattern, 12000);
  ASSERT_TRUE(fs::exists(dir / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(dir / "model.safetensors"));
  const auto index = nlohmann::json::parse(test::read_bytes(dir / "model.safetensors.index.json"));
  size_t total = 0;
  for (const auto& s : specs) total += s.nbytes();
  EXPECT_EQ(index["metadata"]["total_size"], total);
  std::set<std::string> files;
  for (const auto& [name, file] : index["weight_map"].items()) files.insert(file);
  ASSERT_GT(files.size(), 2u);
  const std::string count = std::to_string(files.size());
  EXPECT_EQ(*files.begin(),
            "model-00001-of-" + std::string(5 - count.size(), '0') + count + ".safetensors");
  for (const auto& f : files) EXPECT_TRUE(fs::exists(dir / f)) << f;
  const auto ck = Checkpoint::open(dir.path());
  expect_matches(ck, specs);
  // A tensor larger than the limit (big.weight: 10 KB < 12 KB, so use a tighter limit) gets a
  // shard of its own rather than being split.
  test::TempDir dir2("st-big");
  write_checkpoint(dir2.path(), specs, fill_pattern, 1000);
  const auto ck2 = Checkpoint::open(dir2.path());
  expect_matches(ck2, specs);
  const std::string big_file = ck2.find("model.layers.0.big.weight")->file;
  for (const auto& [name, t] : ck2.tensors())
    if (name != "model.layers.0.big.weight") {
      EXPECT_NE(t.file, big_file) << name;
    }
}

TEST(Safetensors, WriterIsDeterministicAndReplacesEarlierCheckpoints) {
  test::TempDir a("st-det-a"), b("st-det-b");
  const auto specs = mixed_specs(3);
  write_checkpoint(a.path(), specs, fill_pattern, 5000);
  write_checkpoint(b.path(), specs, fill_pattern, 5000);
  for (const auto& e : fs::directory_iterator(a.path()))
    EXPECT_EQ(test::read_bytes(e.path()), test::read_bytes(b / e.path().filename().string()))
        << e.path();
  // Rewriting as one file removes the shards and the index.
  write_checkpoint(a.path(), specs, fill_pattern, size_t{1} << 30);
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(a.path())) left.push_back(e.path().filename());
  EXPECT_EQ(left, std::vector<std::string>{"model.safetensors"});
  expect_matches(Checkpoint::open(a.path()), specs);
}

// An interrupted quantize or make-model leaves its shard half-written under a temporary name
// (NAME.tmp.PID.N); the next write into the folder removes those of writers no longer running,
// and leaves a running writer's, and files that are no temporary shard, alone.
TEST(Safetensors, WriterRemovesTheTemporaryShardsOfWritersNoLongerRunning) {
  test::TempDir dir("st-orphans");
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);  // reaped: its pid names no process now
  const std::string dead = std::to_string(child), alive = std::to_string(::getpid());
  const std::vector<std::string> orphans = {"model-00002-of-00006.safetensors.tmp." + dead + ".0",
                                            "model.safetensors.tmp." + dead + ".17"};
  const std::vector<std::string> kept = {
      "model-00001-of-00006.safetensors.tmp." + alive + ".3",  // this process is writing it
      "notes.txt.tmp." + dead + ".0",                          // not a shard
      "model.safetensors.tmp." + dead,                         // not create_temporary_beside's
      "model.safetensors.tmp.x" + dead + ".0"};
  for (const auto& n : orphans) test::write_bytes(dir / n, "half a shard");
  for (const auto& n : kept) test::write_bytes(dir / n, "keep");
  write_checkpoint(dir.path(), mixed_specs(3), fill_pattern, 5000);
  for (const auto& n : orphans) EXPECT_FALSE(fs::exists(dir / n)) << n;
  for (const auto& n : kept) EXPECT_EQ(test::read_bytes(dir / n), "keep") << n;
  expect_matches(Checkpoint::open(dir.path()), mixed_specs(3));
}

TEST(Safetensors, WriterRejectsBadSpecs) {
  test::TempDir dir("st-bad");
  EXPECT_THROW(write_checkpoint(dir.path(), {{"a", DType::kF32, {1}}, {"a", DType::kF32, {1}}},
                                fill_pattern, 100),
               Error);
  EXPECT_THROW(
      write_checkpoint(dir.path(), {{"__metadata__", DType::kF32, {1}}}, fill_pattern, 100), Error);
  EXPECT_THROW(write_checkpoint(dir.path(), {}, fill_pattern, 100), Error);
}

TEST(Safetensors, GetChecksShapes) {
  test::TempDir dir("st-get");
  write_checkpoint(dir.path(), {{"w", DType::kF32, {2, 3}}}, fill_pattern, 1000);
  const auto ck = Checkpoint::open(dir.path());
  EXPECT_EQ(ck.get("w", {2, 3}).numel(), 6);
  try {
    ck.get("w", {3, 2});
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("'w'"), HasSubstr("[2, 3]"), HasSubstr("expected [3, 2]"),
                                HasSubstr("model.safetensors")));
  }
  try {
    ck.get("missing.weight", {4});
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("missing tensor 'missing.weight'"), HasSubstr("[4]")));
  }
  EXPECT_EQ(ck.find("nope"), nullptr);
}

// ---- Reader errors on hand-made files ----

std::string safetensors_bytes(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

std::string open_error(const fs::path& dir) {
  try {
    Checkpoint::open(dir);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(SafetensorsErrors, TruncatedFile) {
  test::TempDir dir("st-trunc");
  write_checkpoint(dir.path(), {{"a.weight", DType::kF32, {4}}, {"b.weight", DType::kBF16, {8}}},
                   fill_pattern, 1000);
  std::string raw = test::read_bytes(dir / "model.safetensors");
  test::write_bytes(dir / "model.safetensors", raw.substr(0, raw.size() - 3));
  EXPECT_THAT(open_error(dir.path()), AllOf(HasSubstr("model.safetensors"), HasSubstr("'b.weight'"),
                                            HasSubstr("truncated")));
  test::write_bytes(dir / "model.safetensors", raw.substr(0, 5));
  EXPECT_THAT(open_error(dir.path()),
              AllOf(HasSubstr("model.safetensors"), HasSubstr("too short")));
}

TEST(SafetensorsErrors, HeaderLengthBeyondFile) {
  test::TempDir dir("st-hlen");
  std::string raw = safetensors_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                                      std::string(4, '\0'));
  const uint64_t bogus = 1 << 20;
  std::memcpy(raw.data(), &bogus, 8);
  test::write_bytes(dir / "model.safetensors", raw);
  EXPECT_THAT(open_error(dir.path()),
              AllOf(HasSubstr("model.safetensors"), HasSubstr("header length 1048576")));
}

TEST(SafetensorsErrors, OverlappingOffsets) {
  test::TempDir dir("st-overlap");
  test::write_bytes(
      dir / "model.safetensors",
      safetensors_bytes(R"({"first":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                        R"("second":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                        std::string(12, '\0')));
  EXPECT_THAT(open_error(dir.path()), AllOf(HasSubstr("model.safetensors"), HasSubstr("'first'"),
                                            HasSubstr("'second'"), HasSubstr("overlap")));
}

TEST(SafetensorsErrors, GapBetweenTensorsAndTrailingBytes) {
  test::TempDir dir("st-gap");
  test::write_bytes(dir / "model.safetensors",
                    safetensors_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                      R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                                      std::string(12, '\0')));
  EXPECT_THAT(open_error(dir.path()), AllOf(HasSubstr("'b'"), HasSubstr("unused bytes")));
  test::write_bytes(dir / "model.safetensors",
                    safetensors_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                                      std::string(6, '\0')));
  EXPECT_THAT(open_error(dir.path()), HasSubstr("2 bytes after the last tensor"));
}

TEST(SafetensorsErrors, UnknownDtype) {
  test::TempDir dir("st-dtype");
  test::write_bytes(
      dir / "model.safetensors",
      safetensors_bytes(R"({"x.weight":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})",
                        std::string(8, '\0')));
  EXPECT_THAT(open_error(dir.path()), AllOf(HasSubstr("model.safetensors"), HasSubstr("'x.weight'"),
                                            HasSubstr("unsupported dtype 'F64'")));
}

TEST(SafetensorsErrors, ShapeDoesNotMatchBytes) {
  test::TempDir dir("st-shape");
  test::write_bytes(
      dir / "model.safetensors",
      safetensors_bytes(R"({"x.weight":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,10]}})",
                        std::string(10, '\0')));
  EXPECT_THAT(open_error(dir.path()),
              AllOf(HasSubstr("model.safetensors"), HasSubstr("'x.weight'"), HasSubstr("[2, 3]"),
                    HasSubstr("needs 12 bytes"), HasSubstr("span 10")));
}

TEST(SafetensorsErrors, ShapeWhoseByteSizeOverflowsIsRejectedNotWrappedToZero) {
  test::TempDir dir("st-overflow");
  // 2^31 * 2^31 elements of 4 bytes is 2^64 bytes: wrapped to 0 it would match [0, 0].
  test::write_bytes(dir / "model.safetensors",
                    safetensors_bytes(R"({"huge.weight":{"dtype":"F32",)"
                                      R"("shape":[2147483648,2147483648],"data_offsets":[0,0]}})",
                                      ""));
  EXPECT_THAT(open_error(dir.path()),
              AllOf(HasSubstr("model.safetensors"), HasSubstr("'huge.weight'"),
                    HasSubstr("[2147483648, 2147483648]"), HasSubstr("too large")));
}

// nlohmann keeps the last of repeated keys: a header or weight_map listing a tensor twice would
// silently lose one entry.
TEST(SafetensorsErrors, ARepeatedKeyIsRefusedNamingIt) {
  test::TempDir dir("st-dup");
  test::write_bytes(dir / "model.safetensors",
                    safetensors_bytes(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                      R"("w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                                      std::string(4, '\0')));
  EXPECT_THAT(open_error(dir.path()),
              AllOf(HasSubstr("model.safetensors"), HasSubstr("'w'"), HasSubstr("twice")));

  test::TempDir sharded("st-dup-index");
  write_checkpoint(sharded.path(), {{"a", DType::kF32, {64}}, {"b", DType::kF32, {64}}},
                   fill_pattern, 300);
  const std::string first = "model-00001-of-00002.safetensors";
  test::write_bytes(sharded / "model.safetensors.index.json",
                    R"({"weight_map": {"a": ")" + first + R"(", "b": "model-00002-of-00002.)" +
                        R"(safetensors", "a": ")" + first + R"("}})");
  EXPECT_THAT(open_error(sharded.path()), AllOf(HasSubstr("model.safetensors.index.json"),
                                                HasSubstr("'a'"), HasSubstr("twice")));
}

// Finding repeated keys rescanned an object's members at each member's end (nlohmann's callback
// parser): quadratic in the entries, so loading these 50,000 tensors took over a minute and
// refusing the 200,000 entries below minutes each. Now each is a linear pass, well under a second.
TEST(Safetensors, AHeaderOrIndexOfManyEntriesIsReadInLinearTime) {
  test::TempDir dir("st-many");
  constexpr int kTensors = 50000;
  std::string header = "{";
  for (int i = 0; i < kTensors; ++i)
    header += (i ? ",\"t" : "\"t") + std::to_string(i) + R"(":{"dtype":"F32","shape":[1],)" +
              R"("data_offsets":[)" + std::to_string(4 * i) + "," + std::to_string(4 * i + 4) +
              "]}";
  test::write_bytes(dir / "model.safetensors",
                    safetensors_bytes(header + "}", std::string(4 * kTensors, '\0')));
  EXPECT_EQ(Checkpoint::open(dir.path()).tensors().size(), size_t{kTensors});

  std::string empty_entries;
  for (int i = 0; i < 200000; ++i)
    empty_entries += (i ? ",\"t" : "\"t") + std::to_string(i) + "\":{}";
  test::write_bytes(dir / "model.safetensors", safetensors_bytes("{" + empty_entries + "}", ""));
  EXPECT_EQ(open_error(dir.path()),
            (dir / "model.safetensors").string() + ": tensor 't0': missing string field 'dtype'");
  test::write_bytes(dir / "model.safetensors.index.json",
                    R"({"weight_map": {)" + empty_entries + "}}");
  EXPECT_EQ(open_error(dir.path()), (dir / "model.safetensors.index.json").string() +
                                        ": weight_map entry for 't0' is not a file name string");
}

// The index has no size in its format; like the safetensors library's 100 MB limit on headers,
// one above 100 MB is refused before it is read.
TEST(SafetensorsErrors, AnIndexAbove100MbIsRefusedUnread) {
  test::TempDir dir("st-big-index");
  test::write_bytes(dir / "model.safetensors.index.json", "");
  fs::resize_file(dir / "model.safetensors.index.json", 100'000'001);  // sparse: nothing written
  EXPECT_EQ(open_error(dir.path()), (dir / "model.safetensors.index.json").string() +
                                        ": is 100000001 bytes, above the limit of 100000000");
}

TEST(SafetensorsErrors, MalformedHeaders) {
  test::TempDir dir("st-json");
  test::write_bytes(dir / "model.safetensors", safetensors_bytes(R"({"x": )", ""));
  EXPECT_THAT(open_error(dir.path()),
              AllOf(HasSubstr("model.safetensors"), HasSubstr("malformed")));
  test::write_bytes(
      dir / "model.safetensors",
      safetensors_bytes(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"extra":1}})",
                        std::string(4, '\0')));
  EXPECT_THAT(open_error(dir.path()), AllOf(HasSubstr("'x'"), HasSubstr("'extra'")));
  test::write_bytes(dir / "model.safetensors",
                    safetensors_bytes(R"({"x":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})",
                                      std::string(4, '\0')));
  EXPECT_THAT(open_error(dir.path()), AllOf(HasSubstr("'x'"), HasSubstr("shape")));
  test::write_bytes(dir / "model.safetensors", safetensors_bytes("[1, 2]", ""));
  EXPECT_THAT(open_error(dir.path()), HasSubstr("does not start with '{'"));
}

TEST(SafetensorsErrors, MissingShardAndIndexMismatches) {
  test::TempDir dir("st-index");
  const std::vector<TensorSpec> specs = {{"a.weight", DType::kF32, {64}},
                                         {"b.weight", DType::kF32, {64}},
                                         {"c.weight", DType::kF32, {64}},
                                         {"d.weight", DType::kF32, {64}}};
  write_checkpoint(dir.path(), specs, fill_pattern, 600);  // two tensors per shard
  const std::string first = "model-00001-of-00002.safetensors";
  const std::string second = "model-00002-of-00002.safetensors";
  ASSERT_TRUE(fs::exists(dir / second));
  const std::string index_text = test::read_bytes(dir / "model.safetensors.index.json");

  fs::rename(dir / second, dir / "moved.safetensors");
  EXPECT_THAT(open_error(dir.path()),
              AllOf(HasSubstr("model.safetensors.index.json"), HasSubstr("'c.weight'"),
                    HasSubstr(second), HasSubstr("does not exist")));
  fs::rename(dir / "moved.safetensors", dir / second);
  EXPECT_NO_THROW(Checkpoint::open(dir.path()));

  auto index = nlohmann::json::parse(index_text);
  index["weight_map"]["e.weight"] = first;
  test::write_bytes(dir / "model.safetensors.index.json", index.dump());
  EXPECT_THAT(open_error(dir.path()),
              AllOf(HasSubstr("'e.weight'"), HasSubstr(first), HasSubstr("no such tensor")));

  index = nlohmann::json::parse(index_text);
  index["weight_map"].erase("d.weight");
  test::write_bytes(dir / "model.safetensors.index.json", index.dump());
  EXPECT_THAT(open_error(dir.path()),
              AllOf(HasSubstr(second), HasSubstr("'d.weight'"), HasSubstr("not listed")));

  index = nlohmann::json::parse(index_text);
  index["weight_map"]["d.weight"] = first;
  test::write_bytes(dir / "model.safetensors.index.json", index.dump());
  EXPECT_THAT(open_error(dir.path()), AllOf(HasSubstr("'d.weight'"), HasSubstr("no such tensor")));

  index = nlohmann::json::parse(index_text);
  index["weight_map"]["c.weight"] = "../elsewhere.safetensors";
  test::write_bytes(dir / "model.safetensors.index.json", index.dump());
  EXPECT_THAT(open_error(dir.path()), AllOf(HasSubstr("'c.weight'"), HasSubstr("not a file name")));

  test::write_bytes(dir / "model.safetensors.index.json", "{\"weight_map\": [}");
  EXPECT_THAT(open_error(dir.path()),
              AllOf(HasSubstr("model.safetensors.index.json"), HasSubstr("malformed")));
}

// Names from a file go into paths and messages as C strings: a shard name with a NUL opened the
// shard named by the part before it (Python's open refuses an embedded null byte), "..\0x"
// passed the check for "..", and each message was cut at the NUL.
TEST(SafetensorsErrors, AShardNameWithAControlByteIsRefusedAndShownEscaped) {
  test::TempDir dir("st-nul-shard");
  write_checkpoint(dir.path(), {{"a", DType::kF32, {64}}, {"b", DType::kF32, {64}}}, fill_pattern,
                   300);
  const std::string second = "model-00002-of-00002.safetensors";
  const auto index = nlohmann::json::parse(test::read_bytes(dir / "model.safetensors.index.json"));
  const std::string refused = ", which is not a file name in the checkpoint folder";
  for (const auto& [file, shown] : std::vector<std::pair<std::string, std::string>>{
           {second + std::string("\0junk", 5), second + "\\x00junk"},
           {std::string("..\0x", 4), "..\\x00x"},
           {second + "\n", second + "\\x0a"}}) {
    auto patched = index;
    patched["weight_map"]["b"] = file;
    test::write_bytes(dir / "model.safetensors.index.json", patched.dump());
    EXPECT_EQ(open_error(dir.path()), (dir / "model.safetensors.index.json").string() +
                                          ": tensor 'b' maps to '" + shown + "'" + refused);
  }
  // A tensor's own name is shown the same way.
  test::TempDir single("st-nul-tensor");
  test::write_bytes(single / "model.safetensors", safetensors_bytes("{\"a\\u0000x\":{}}", ""));
  EXPECT_EQ(open_error(single.path()), (single / "model.safetensors").string() +
                                           ": tensor 'a\\x00x': missing string field 'dtype'");
}

// A header near the 100 MB limit can list 1.6 million empty tensors, and reading it cost about
// 850 bytes each (880 MB and seconds for a million) before anything was checked against the
// model; a header is refused on its count of entries, counted before it is parsed.
TEST(SafetensorsErrors, AHeaderOfMoreTensorsThanTheLimitIsRefusedBeforeItIsParsed) {
  test::TempDir dir("st-count");
  auto header_of = [](int entries) {
    std::string header = "{\"__metadata__\":{\"format\":\"pt\"}";
    for (int i = 1; i < entries; ++i) header += ",\"t" + std::to_string(i) + "\":{}";
    return header + "}";
  };
  test::write_bytes(dir / "model.safetensors", safetensors_bytes(header_of(300001), ""));
  EXPECT_EQ(open_error(dir.path()),
            (dir / "model.safetensors").string() +
                ": header has 300001 entries, above the limit of 300000 tensors");
  // At the limit the header is read, and its first entry checked.
  test::write_bytes(dir / "model.safetensors", safetensors_bytes(header_of(300000), ""));
  EXPECT_EQ(open_error(dir.path()),
            (dir / "model.safetensors").string() + ": tensor 't1': missing string field 'dtype'");
}

// Within the byte limit a header may hold a shape of tens of millions of dimensions: one of 45
// million 1s (a 90 MB header) took 3 GB and 35 s to read, opened as a tensor of one element, and
// the loader's message writing its shape was 135 MB. A shape of more than 64 dimensions is now
// refused naming the tensor, and a header's separators are counted before it is parsed.
TEST(SafetensorsErrors, AShapeOfAbsurdRankIsRefusedNamingTheTensor) {
  test::TempDir dir("st-rank");
  const fs::path file = dir / "model.safetensors";
  auto write_rank = [&](size_t rank) {
    std::string shape = "1";
    for (size_t i = 1; i < rank; ++i) shape += ",1";
    test::write_bytes(file, safetensors_bytes(R"({"t":{"dtype":"F32","shape":[)" + shape +
                                                  R"(],"data_offsets":[0,4]}})",
                                              std::string(4, '\0')));
  };
  write_rank(64);
  EXPECT_EQ(Checkpoint::open(dir.path()).find("t")->shape.size(), 64u);
  write_rank(65);
  EXPECT_EQ(open_error(dir.path()),
            file.string() + ": tensor 't': shape has 65 dimensions, more than 64");
  // 4 ':' and rank + 2 ','.
  write_rank(8'000'000);
  EXPECT_EQ(open_error(dir.path()),
            file.string() + ": header has 8000006 JSON separators (',' and ':'), above the limit " +
                "of 7200000 (24 per tensor of the 300000 allowed)");
}

// Empty arrays nested in a shape hold values without separators (61 levels: 61 values a comma),
// so a header is refused past the nesting a real one has, before it is parsed into values.
TEST(SafetensorsErrors, AHeaderOrIndexNestedDeeperThanARealOneIsRefused) {
  test::TempDir dir("st-nesting");
  const fs::path file = dir / "model.safetensors";
  std::string nested = "[]";
  for (int i = 0; i < 60; ++i) nested = "[" + nested + "]";
  test::write_bytes(file, safetensors_bytes(R"({"t":{"dtype":"F32","shape":[)" + nested + "," +
                                                nested + R"(],"data_offsets":[0,4]}})",
                                            std::string(4, '\0')));
  EXPECT_EQ(open_error(dir.path()),
            file.string() + ": header: JSON nesting is deeper than 4 levels");
  fs::remove(file);
  write_checkpoint(dir.path(), {{"a", DType::kF32, {64}}, {"b", DType::kF32, {64}}}, fill_pattern,
                   300);
  const fs::path index = dir / "model.safetensors.index.json";
  nlohmann::json doc = nlohmann::json::parse(test::read_bytes(index));
  doc["metadata"]["tool"] = {{"version", 1}};  // a tool's metadata, one level more: read
  test::write_bytes(index, doc.dump());
  EXPECT_NO_THROW(Checkpoint::open(dir.path()));
  doc["metadata"]["tool"] = nlohmann::json::parse(nested);
  test::write_bytes(index, doc.dump());
  EXPECT_THAT(open_error(dir.path()), HasSubstr("JSON nesting is deeper than 4 levels"));
}

// An index near its 100 MB limit can list two million tensors, and reading one took 600 MB before
// its first entry was found wanting; an index holding more entries than a weight_map of the
// header limit's 300,000 tensors is refused on its separators, counted before it is parsed.
TEST(SafetensorsErrors, AnIndexOfMoreTensorsThanTheLimitIsRefusedBeforeItIsParsed) {
  test::TempDir dir("st-index-count");
  const fs::path index = dir / "model.safetensors.index.json";
  // One ':' for weight_map, then n ':' and n - 1 ','.
  auto write_entries = [&](int n) {
    std::string text = R"({"weight_map":{)";
    for (int i = 0; i < n; ++i) text += (i ? ",\"t" : "\"t") + std::to_string(i) + "\":\"s\"";
    test::write_bytes(index, text + "}}");
  };
  write_entries(300033);
  EXPECT_EQ(open_error(dir.path()),
            index.string() + ": has 600066 JSON separators (',' and ':'), above the limit of " +
                "600064 (a weight_map of 300000 tensors)");
  // At the limit the index is read, and its shard looked for.
  write_entries(300032);
  EXPECT_THAT(open_error(dir.path()),
              AllOf(HasSubstr("maps tensor 't0' (and 300031 more) to shard 's'"),
                    HasSubstr("does not exist")));
}

// A FIFO in the model folder blocked the load in open() until some writer came, and a directory
// as a shard was "cannot map: No such device".
TEST(SafetensorsErrors, FilesThatAreNotRegularAreRefusedNamingThem) {
  test::TempDir single("st-fifo");
  {
    const test::Fifo fifo(single / "model.safetensors");
    EXPECT_EQ(open_error(single.path()),
              (single / "model.safetensors").string() + ": not a regular file (it is a FIFO)");
  }
  test::TempDir dir("st-fifo-shards");
  write_checkpoint(dir.path(), {{"a", DType::kF32, {64}}, {"b", DType::kF32, {64}}}, fill_pattern,
                   300);
  const std::string second = "model-00002-of-00002.safetensors";
  const std::string index_text = test::read_bytes(dir / "model.safetensors.index.json");
  fs::remove(dir / second);
  {
    const test::Fifo fifo(dir / second);
    EXPECT_EQ(open_error(dir.path()),
              (dir / second).string() + ": not a regular file (it is a FIFO)");
  }
  fs::remove(dir / second);
  fs::create_directory(dir / second);
  EXPECT_EQ(open_error(dir.path()),
            (dir / second).string() + ": not a regular file (it is a directory)");
  fs::remove(dir / "model.safetensors.index.json");
  {
    const test::Fifo fifo(dir / "model.safetensors.index.json");
    EXPECT_EQ(open_error(dir.path()), (dir / "model.safetensors.index.json").string() +
                                          ": not a regular file (it is a FIFO)");
  }
}

TEST(SafetensorsErrors, NoCheckpoint) {
  test::TempDir dir("st-none");
  EXPECT_THAT(open_error(dir.path()),
              AllOf(HasSubstr(dir.path().string()), HasSubstr("model.safetensors")));
  EXPECT_THAT(open_error(dir / "absent"), HasSubstr("does not exist"));
}

// ---- Tensors at any offset ----

// The format lets data_offsets fall anywhere (nothing in it asks for alignment; only writers
// order data by element size): here a 1-byte I8 tensor first puts every later one at an odd
// address in the mapping. Kernels read F32 and BF16 rows through float and uint16_t pointers,
// where a misaligned one is undefined behaviour (UBSan's "load of misaligned address"), so the
// binder must hand them aligned memory holding exactly the values written; an aligned tensor
// stays in place, unread until used.
TEST(TensorBinder, AMisalignedFloatTensorIsBoundAlignedWithItsValuesAndAnAlignedOneInPlace) {
  const std::vector<float> w = {1.5f, -2.25f, 3.0e-3f, 1e30f, -0.0f, 7.0f};  // F32 [2, 3]
  const std::vector<uint16_t> b = {0x3f80, 0xbf00, 0x4040,
                                   0x3e00};                      // BF16 [2, 2]: 1, -0.5, 3, 0.125
  const std::vector<float> aligned = {0.5f, -4.0f, 6.0f, 8.0f};  // F32 [1, 4]
  std::string data;
  auto append = [&](const void* p, size_t n) { data.append(static_cast<const char*>(p), n); };
  append(aligned.data(), 16);  // [0, 16)
  data += '\x05';              // pad, I8 [1]: [16, 17)
  append(w.data(), 24);        // [17, 41)
  append(b.data(), 8);         // [41, 49)
  std::string header = R"({"aligned.weight":{"dtype":"F32","shape":[1,4],"data_offsets":[0,16]},)"
                       R"("pad":{"dtype":"I8","shape":[1],"data_offsets":[16,17]},)"
                       R"("w.weight":{"dtype":"F32","shape":[2,3],"data_offsets":[17,41]},)"
                       R"("b.weight":{"dtype":"BF16","shape":[2,2],"data_offsets":[41,49]}})";
  header.append((8 - header.size() % 8) % 8, ' ');  // data 8-byte aligned, as writers pad it
  test::TempDir dir("st-misaligned");
  test::write_bytes(dir / "model.safetensors", safetensors_bytes(header, data));
  const auto ck = Checkpoint::open(dir.path());
  // The file really is misaligned where the test says: the tensors' data at odd addresses.
  ASSERT_EQ(reinterpret_cast<uintptr_t>(ck.find("w.weight")->data) % 2, 1u);
  ASSERT_EQ(reinterpret_cast<uintptr_t>(ck.find("b.weight")->data) % 2, 1u);

  const std::function<void(size_t, size_t)> progress;
  TensorBinder binder(ck, std::nullopt, progress);
  const kernels::Matrix wm = binder.matrix("w", 2, 3);
  const kernels::Matrix bm = binder.matrix("b", 2, 2);
  const kernels::Matrix am = binder.matrix("aligned", 1, 4);
  EXPECT_EQ(wm.type, kernels::WeightType::kF32);
  EXPECT_EQ(bm.type, kernels::WeightType::kBF16);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(wm.data) % alignof(float), 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(bm.data) % alignof(uint16_t), 0u);
  EXPECT_EQ(std::memcmp(wm.data, w.data(), 24), 0);
  EXPECT_EQ(std::memcmp(bm.data, b.data(), 8), 0);
  EXPECT_EQ(am.data, ck.find("aligned.weight")->data);  // zero-copy: read in place

  // What the kernels read is the values written: the same product as over an aligned copy made
  // here, and BF16 rows widened exactly.
  const std::vector<float> x = {0.25f, -1.0f, 2.0f};
  std::vector<float> got(2), want(2);
  kernels::matmul(wm, x.data(), 1, got.data());
  kernels::matmul(kernels::matrix_view(2, 3, kernels::WeightType::kF32, w.data()), x.data(), 1,
                  want.data());
  EXPECT_EQ(got, want);
  std::vector<float> row(2);
  kernels::matrix_row(bm, 1, row.data());
  EXPECT_EQ(row, (std::vector<float>{3.0f, 0.125f}));
}

// Rewrites every shard of the checkpoint in `dir` with one more space at the end of its header
// (trailing JSON whitespace: the header is still valid), so that every tensor's data starts one
// byte later, at an odd address in the mapping. Returns how many shards it rewrote.
size_t misalign_every_tensor(const fs::path& dir) {
  size_t shards = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".safetensors") continue;
    std::string raw = test::read_bytes(entry.path());
    uint64_t header_len = 0;
    std::memcpy(&header_len, raw.data(), 8);
    raw.insert(8 + header_len, " ");
    ++header_len;
    std::memcpy(raw.data(), &header_len, 8);
    test::write_bytes(entry.path(), raw);
    ++shards;
  }
  return shards;
}

// The logits of every position of a 20-token prompt.
std::vector<float> prompt_logits(const DeepSeekModel& model) {
  LatentCache cache(model.cache_shape(16), 4);
  std::vector<int32_t> prompt;
  for (int32_t i = 0; i < 20; ++i) prompt.push_back(5 + 37 * i);
  const std::vector<int32_t> table = {0, 1};
  SequenceStep step{prompt, 0, table, LogitRows::kAll};
  const auto logits = model.forward(std::span(&step, 1), cache).logits;
  return std::vector<float>(logits.begin(), logits.end());
}

// Files written before the safetensors library padded its header to 8 bytes start their data at
// any offset, so every tensor of them may be misaligned. Such a checkpoint (here tandem's own
// with one more space in each header) loads into the same model: every matrix, packed or read in
// place, gives the logits the aligned file gives.
TEST(TensorBinder, AModelWhoseTensorsAreAllMisalignedComputesTheSameLogits) {
  test::TempDir aligned("st-model-aligned"), shifted("st-model-shifted");
  const ModelConfig c = test::small_vocab_tiny_v3();
  test::write_random_checkpoint(aligned.path(), c);
  test::write_random_checkpoint(shifted.path(), c);
  ASSERT_GT(misalign_every_tensor(shifted.path()), 0u);
  const Checkpoint ck = Checkpoint::open(shifted.path());
  ASSERT_EQ(reinterpret_cast<uintptr_t>(ck.find("model.embed_tokens.weight")->data) % 2, 1u);

  const std::vector<float> want = prompt_logits(DeepSeekModel::load(aligned.path()));
  ASSERT_FALSE(want.empty());
  EXPECT_EQ(prompt_logits(DeepSeekModel::load(shifted.path())), want);
}

// With tie_word_embeddings the LM head is the embedding: a misaligned embedding is copied once,
// aligned, and the lookup and the head both read that copy (it was copied a second time for the
// head: a whole vocabulary x hidden matrix more, 311 MB for Qwen3-0.6B's 151936 x 1024 in BF16).
TEST(TensorBinder, ATiedEmbeddingThatIsMisalignedIsCopiedOnceForTheLookupAndTheHead) {
  test::TempDir aligned("st-tied-aligned"), shifted("st-tied-shifted");
  ModelConfig c = test::small_vocab_tiny_v3();
  c.tie_word_embeddings = true;
  test::write_random_checkpoint(aligned.path(), c);
  test::write_random_checkpoint(shifted.path(), c);
  ASSERT_GT(misalign_every_tensor(shifted.path()), 0u);

  const DeepSeekModel in_place = DeepSeekModel::load(aligned.path());
  const DeepSeekModel copied = DeepSeekModel::load(shifted.path());
  const kernels::Matrix& embed = copied.weights().embed;
  const kernels::Matrix& head = copied.weights().lm_head;
  ASSERT_FALSE(embed.storage.empty()) << "the embedding was not copied: the file is aligned";
  EXPECT_EQ(reinterpret_cast<uintptr_t>(embed.data) % alignof(uint16_t), 0u);
  EXPECT_EQ(head.data, embed.data);
  EXPECT_TRUE(head.storage.empty()) << head.storage.size() << " bytes copied for the head";
  EXPECT_EQ(head.rows, embed.rows);
  EXPECT_EQ(head.cols, embed.cols);
  EXPECT_EQ(head.type, embed.type);
  // An aligned tied embedding is read in place by both, as before.
  EXPECT_EQ(in_place.weights().lm_head.data, in_place.weights().embed.data);
  EXPECT_TRUE(in_place.weights().embed.storage.empty());

  const std::vector<float> want = prompt_logits(in_place);
  ASSERT_FALSE(want.empty());
  EXPECT_EQ(prompt_logits(copied), want);
}

// The files the writer produces, read by an independent Python reader that also checks the
// Hugging Face conventions (index format, shard names, header padding, alignment).
TEST(Safetensors, PythonReaderAgrees) {
  for (size_t max_shard : {size_t{1} << 30, size_t{6000}}) {
    test::TempDir dir("st-python");
    const auto specs = mixed_specs(4);
    write_checkpoint(dir.path(), specs, fill_pattern, max_shard);
    const auto r = test::run_capture("/usr/bin/python3 " +
                                     test::quote(test::oracle_dir() / "safetensors_check.py") +
                                     " " + test::quote(dir.path()));
    ASSERT_EQ(r.status, 0) << "safetensors_check.py rejected the checkpoint (see stderr)";
    const auto doc = nlohmann::json::parse(r.output);
    EXPECT_EQ(doc["index"].is_null(), max_shard > 6000);
    const auto ck = Checkpoint::open(dir.path());
    ASSERT_EQ(doc["tensors"].size(), specs.size());
    for (const auto& s : specs) {
      const auto& t = doc["tensors"][s.name];
      const TensorInfo& info = *ck.find(s.name);
      EXPECT_EQ(t["dtype"], std::string(dtype_name(s.dtype))) << s.name;
      EXPECT_EQ(t["shape"].get<std::vector<int64_t>>(), s.shape) << s.name;
      EXPECT_EQ(t["file"], info.file) << s.name;
      std::vector<float> ours(static_cast<size_t>(info.numel()));
      to_f32(info.dtype, info.data, ours.data(), ours.size());
      const auto theirs = t["values"];
      ASSERT_EQ(theirs.size(), ours.size()) << s.name;
      for (size_t i = 0; i < ours.size(); ++i)
        ASSERT_EQ(theirs[i].get<double>(), static_cast<double>(ours[i]))
            << s.name << "[" << i << "]";
    }
  }
}

}  // namespace
}  // namespace tandem::model
