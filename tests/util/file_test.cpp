// Reading files: read_regular_file's limit and its refusal, without blocking, of what is not a
// regular file.
#include "util/file.h"

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

}  // namespace
}  // namespace tandem
