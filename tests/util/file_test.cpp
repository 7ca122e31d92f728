// Reading files: read_regular_file's limit and its refusal, without blocking, of what is not a
// regular file. Writing them: write_file_atomically's temporary file.
#include "util/file.h"

#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <functional>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "model/model_test_support.h"
#include "util/error_of.h"
#include "util/fifo.h"

namespace tandem {
namespace {

using ::testing::AllOf;
using testing::error_of;
using ::testing::HasSubstr;

TEST(ReadRegularFile, ReadsAFileWholeUpToTheLimit) {
  test::TempDir dir("file");
  test::write_bytes(dir / "a", "0123456789");
  EXPECT_EQ(read_regular_file(dir / "a"), "0123456789");
  EXPECT_EQ(read_regular_file(dir / "a", 10), "0123456789");
  EXPECT_EQ(error_of([&] { read_regular_file(dir / "a", 9); }),
            (dir / "a").string() + ": is 10 bytes, above the limit of 9");
  test::write_bytes(dir / "empty", "");
  EXPECT_EQ(read_regular_file(dir / "empty", 0), "");
  // Files of /proc say they are empty; they are read to their end all the same.
  EXPECT_THAT(read_regular_file("/proc/self/status"), HasSubstr("Name:"));
}

// A FIFO blocked the model loader's open() until a writer came: tandem generate hung on a model
// folder whose config.json was one.
TEST(ReadRegularFile, WhatIsNotARegularFileIsRefusedNamingItsKind) {
  test::TempDir dir("file-kinds");
  const test::Fifo fifo(dir / "fifo");
  EXPECT_EQ(error_of([&] { read_regular_file(dir / "fifo"); }),
            (dir / "fifo").string() + ": not a regular file (it is a FIFO)");
  EXPECT_EQ(error_of([&] { RegularFile f(dir / "fifo"); }),
            (dir / "fifo").string() + ": not a regular file (it is a FIFO)");
  EXPECT_EQ(error_of([&] { read_regular_file(dir.path()); }),
            dir.path().string() + ": not a regular file (it is a directory)");
  EXPECT_EQ(error_of([&] { read_regular_file("/dev/null"); }),
            "/dev/null: not a regular file (it is a character device)");
  EXPECT_THAT(error_of([&] { read_regular_file(dir / "absent"); }),
              AllOf(HasSubstr((dir / "absent").string()), HasSubstr("No such file")));
}

size_t entries_in(const std::filesystem::path& dir) {
  return static_cast<size_t>(std::distance(std::filesystem::directory_iterator(dir),
                                           std::filesystem::directory_iterator()));
}

// The temporary file was always `<path>.tmp`: a link left under that name was followed (a file
// elsewhere overwritten), and two writers of one path shared it, so one renamed the other's
// half-written bytes into place or failed to find it. Each write has a file of its own now,
// made with O_EXCL.
TEST(WriteFileAtomically, ALinkUnderTheOldTemporaryNameIsNotFollowed) {
  test::TempDir dir("write-link");
  test::write_bytes(dir / "victim", "keep");
  std::filesystem::create_symlink(dir / "victim", dir / "out.json.tmp");
  write_file_atomically(dir / "out.json", "new");
  EXPECT_EQ(read_regular_file(dir / "victim"), "keep");
  EXPECT_EQ(read_regular_file(dir / "out.json"), "new");
}

TEST(WriteFileAtomically, WritersOfOnePathNeverMixTheirBytes) {
  test::TempDir dir("write-race");
  const std::string a(1 << 20, 'a'), b(1 << 20, 'b');
  for (int round = 0; round < 50; ++round) {
    std::string error_a, error_b;
    const auto write = [&](const std::string& bytes, std::string* error) {
      try {
        write_file_atomically(dir / "f", bytes);
      } catch (const Error& e) {
        *error = e.what();
      }
    };
    std::thread ta(write, std::cref(a), &error_a);
    std::thread tb(write, std::cref(b), &error_b);
    ta.join();
    tb.join();
    EXPECT_EQ(error_a, "");
    EXPECT_EQ(error_b, "");
    const std::string got = read_regular_file(dir / "f");
    ASSERT_TRUE(got == a || got == b) << "round " << round << ": " << got.size() << " bytes, "
                                      << std::count(got.begin(), got.end(), 'a') << " of them a";
  }
  EXPECT_EQ(entries_in(dir.path()), 1u);  // no temporary file left behind
}

TEST(WriteFileAtomically, AReplacedFileKeepsItsPermissions) {
  test::TempDir dir("write-mode");
  test::write_bytes(dir / "secret", "old");
  ASSERT_EQ(::chmod((dir / "secret").c_str(), 0600), 0);
  write_file_atomically(dir / "secret", "new");
  struct stat st {};
  ASSERT_EQ(::stat((dir / "secret").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

// A write that fails (here: past the file size limit, in a child so the limit stays there)
// throws naming the file and leaves neither the target nor a temporary file.
TEST(WriteFileAtomically, AFailedWriteLeavesNothingBehind) {
  test::TempDir dir("write-fail");
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::signal(SIGXFSZ, SIG_IGN);
    const rlimit limit{100, 100};
    ::setrlimit(RLIMIT_FSIZE, &limit);
    const std::string error =
        error_of([&] { write_file_atomically(dir / "big", std::string(1000, 'x')); });
    const bool named = error.find((dir / "big").string()) != std::string::npos &&
                       error.find("File too large") != std::string::npos;
    ::_exit(named && entries_in(dir.path()) == 0 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_EQ(entries_in(dir.path()), 0u);
}

}  // namespace
}  // namespace tandem
