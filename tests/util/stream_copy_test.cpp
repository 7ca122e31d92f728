// The copies the shared-memory KV transport makes: stream_copy and SplitCopier against memcpy.
#include <cstring>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "util/split_copier.h"
#include "util/stream_copy.h"

namespace tandem {
namespace {

TEST(StreamCopy, CopiesExactlyWhatMemcpyCopiesAtEveryAlignmentAndLength) {
  std::vector<unsigned char> from(600), to(700), want(700);
  for (size_t i = 0; i < from.size(); ++i) from[i] = static_cast<unsigned char>(i * 7 + 3);
  for (size_t src = 0; src < 20; ++src)
    for (size_t dst = 0; dst < 20; ++dst)
      for (size_t n : {0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 300, 511}) {
        std::fill(to.begin(), to.end(), 0xEE);
        std::fill(want.begin(), want.end(), 0xEE);
        std::memcpy(want.data() + dst, from.data() + src, n);
        stream_copy(to.data() + dst, from.data() + src, n);
        ASSERT_TRUE(to == want) << "src " << src << " dst " << dst << " n " << n;
      }
}

TEST(SplitCopier, CopiesEveryRangeWhereverTheHalfFalls) {
  // Ranges of uneven sizes: the half falls inside one of them for some totals, between two
  // for others; a split minimum of 1 makes every list split.
  std::vector<unsigned char> from(5000), to(5000);
  for (size_t i = 0; i < from.size(); ++i) from[i] = static_cast<unsigned char>(i * 31 + i / 97);
  SplitCopier copier(1);
  for (size_t cut : {1, 10, 999, 1000, 1001, 2500, 4999}) {
    std::fill(to.begin(), to.end(), 0);
    auto* f = reinterpret_cast<const std::byte*>(from.data());
    auto* t = reinterpret_cast<std::byte*>(to.data());
    // Two ranges [0, cut) and [cut, 5000) given in reverse order, and an empty one.
    copier.run({{t + cut, f + cut, 5000 - cut}, {t, f, 0}, {t, f, cut}});
    ASSERT_TRUE(to == from) << "cut " << cut;
  }
  copier.run({});
}

TEST(SplitCopier, CallersAtTheSameTimeEachGetTheirCopy) {
  SplitCopier copier(1);
  std::vector<std::vector<unsigned char>> from(4, std::vector<unsigned char>(1 << 16)),
      to(4, std::vector<unsigned char>(1 << 16));
  for (size_t k = 0; k < 4; ++k)
    for (size_t i = 0; i < from[k].size(); ++i) from[k][i] = static_cast<unsigned char>(i + k);
  std::vector<std::thread> callers;
  for (size_t k = 0; k < 4; ++k)
    callers.emplace_back([&, k] {
      for (int round = 0; round < 50; ++round)
        copier.run({{reinterpret_cast<std::byte*>(to[k].data()),
                     reinterpret_cast<const std::byte*>(from[k].data()), to[k].size()}});
    });
  for (auto& c : callers) c.join();
  for (size_t k = 0; k < 4; ++k) EXPECT_TRUE(to[k] == from[k]) << "caller " << k;
}

}  // namespace
}  // namespace tandem
