// The grid of `tandem simulate --sweep`: every combination, in order, and clear errors.
#include "sim/sweep.h"

#include <gtest/gtest.h>

#include "util/error.h"

namespace tandem::sim {
namespace {

std::vector<std::string> describe(const std::vector<SweepPoint>& points) {
  std::vector<std::string> out;
  for (const auto& p : points)
    out.push_back(std::to_string(p.prefill) + "/" + std::to_string(p.decode) + "/" + p.policy);
  return out;
}

TEST(Sweep, WithoutSpecsItIsTheBasePoint) {
  EXPECT_EQ(describe(sweep_points({}, {2, 4, "tandem"})), std::vector<std::string>{"2/4/tandem"});
}

TEST(Sweep, EveryCombinationPrefillFirstThenDecodeThenPolicy) {
  EXPECT_EQ(describe(sweep_points({"policy=a,b", "prefill=1,2", "decode=3"}, {9, 9, "x"})),
            (std::vector<std::string>{"1/3/a", "1/3/b", "2/3/a", "2/3/b"}));
}

TEST(Sweep, RangesDoubleOrStep) {
  EXPECT_EQ(describe(sweep_points({"prefill=2..16"}, {0, 1, "p"})),
            (std::vector<std::string>{"2/1/p", "4/1/p", "8/1/p", "16/1/p"}));
  // The end is included only when the doubling reaches it.
  EXPECT_EQ(describe(sweep_points({"decode=3..20"}, {1, 0, "p"})),
            (std::vector<std::string>{"1/3/p", "1/6/p", "1/12/p"}));
  EXPECT_EQ(describe(sweep_points({"decode=4..12/4"}, {1, 0, "p"})),
            (std::vector<std::string>{"1/4/p", "1/8/p", "1/12/p"}));
}

TEST(Sweep, RangesEndingNearTheLargestCountStopThere) {
  // Doubling or stepping past INT_MAX overflowed an int (undefined; in practice it wrapped
  // negative and the range went on until the point limit).
  EXPECT_EQ(describe(sweep_points({"decode=1073741824..2147483647"}, {1, 0, "p"})),
            (std::vector<std::string>{"1/1073741824/p"}));
  EXPECT_EQ(describe(sweep_points({"decode=2147483640..2147483647/4"}, {1, 0, "p"})),
            (std::vector<std::string>{"1/2147483640/p", "1/2147483644/p"}));
}

TEST(Sweep, BadSpecsNameTheSpec) {
  for (const std::string bad :
       {"prefill", "prefill=", "nodes=1,2", "prefill=x", "prefill=-1", "prefill=8..2",
        "prefill=0..4", "decode=1..9/0", "prefill=1..2000/1"}) {
    try {
      sweep_points({bad}, {1, 1, "p"});
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--sweep"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(sweep_points({"prefill=1", "prefill=2"}, {1, 1, "p"}), Error);
  // A value listed twice ran its points twice.
  for (const std::string twice : {"decode=1,1", "prefill=2,4,2", "policy=tandem,tandem"}) {
    try {
      sweep_points({twice}, {1, 1, "p"});
      ADD_FAILURE() << twice << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--sweep " + twice + ": "), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find(" is listed twice"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(sweep_points({"prefill=1..64/1", "decode=1..64/1"}, {1, 1, "p"}), Error);
}

// An empty value is refused wherever it is in a list: a trailing one ("decode=1,2,") passed as
// if it were not there, while a leading one was refused.
TEST(Sweep, AnEmptyValueInAListIsRefusedWhereverItIs) {
  for (const std::string bad : {"decode=1,2,", "decode=,1,2", "decode=1,,2", "prefill=4,",
                                "policy=tandem,", "policy=,tandem", "policy=a,,b", "decode=,"}) {
    try {
      sweep_points({bad}, {1, 1, "p"});
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()),
                "--sweep " + bad + ": an empty value in the list (a comma too many?)");
    }
  }
  EXPECT_EQ(describe(sweep_points({"decode=1,2", "policy=a"}, {1, 1, "p"})),
            (std::vector<std::string>{"1/1/a", "1/2/a"}));
}

}  // namespace
}  // namespace tandem::sim
