#!/usr/bin/env bash
# The whole test suite: installs dependencies, builds (ccache, Ninja) and runs every test.
#   scripts/test.sh              release-with-debug-info build in build/
#   scripts/test.sh --sanitize   AddressSanitizer + UndefinedBehaviorSanitizer build in build-asan/
#   scripts/test.sh --tsan       ThreadSanitizer build in build-tsan/ (tests/tsan.supp: what is
#                                suppressed, and why)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

build="$root/build"
flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DTANDEM_SANITIZE=OFF)
for arg in "$@"; do
  case "$arg" in
    --sanitize) build="$root/build-asan"; flags=(-DCMAKE_BUILD_TYPE=Debug -DTANDEM_SANITIZE=ON) ;;
    --tsan)
      build="$root/build-tsan"
      flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DTANDEM_TSAN=ON)
      # ThreadSanitizer cannot see into the OpenMP runtime's synchronisation (libgomp is not
      # built with it), so kernels run on one OpenMP thread here; Tandem's own threads are all
      # checked.
      export OMP_NUM_THREADS=1
      ;;
    *) echo "usage: scripts/test.sh [--sanitize | --tsan]" >&2; exit 2 ;;
  esac
done

"$root/scripts/install-deps.sh"
cmake -S "$root" -B "$build" -G Ninja "${flags[@]}" >/dev/null
cmake --build "$build" -j "$(nproc)"
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1" UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1 suppressions=$root/tests/tsan.supp"
ctest --test-dir "$build" --output-on-failure -j "$(nproc)"
