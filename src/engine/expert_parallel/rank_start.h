#pragma once
// The front of an expert-parallel engine starts its ranks and waits for each to print "ready"
// (it has mapped the segment and loaded its model). A rank that exits first is seen at once (its
// output ends); one that is alive but never gets there (stopped, frozen by its cgroup, stuck on a
// hung filesystem) would otherwise hold the engine's start forever, with no port printed and
// nothing said. The wait has a deadline shared by all ranks, and the error names the rank.
#include <chrono>
#include <memory>
#include <span>

#include "util/child_process.h"

namespace tandem::engine::ep {

// Reads each rank's first line; ranks[i] is rank i + 1 (rank 0 is the front). Throws
// tandem::Error naming the first rank that ended without "ready", or that had not said it within
// `timeout` of the call (a timeout of zero waits as long as it takes). Kills that rank; the
// caller's ChildProcess objects stop the others.
void await_ranks_ready(std::span<const std::unique_ptr<ChildProcess>> ranks,
                       std::chrono::milliseconds timeout);

}  // namespace tandem::engine::ep
