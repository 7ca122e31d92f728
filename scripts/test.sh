#!/usr/bin/env bash
# The whole test suite: installs dependencies, builds (ccache, Ninja) and runs every test.
#   scripts/test.sh              release-with-debug-info build in build/
#   scripts/test.sh --sanitize   AddressSanitizer + UndefinedBehaviorSanitizer build in build-asan/
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

build="$root/build"
flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DTANDEM_SANITIZE=OFF)
for arg in "$@"; do
  case "$arg" in
    --sanitize) build="$root/build-asan"; flags=(-DCMAKE_BUILD_TYPE=Debug -DTANDEM_SANITIZE=ON) ;;
    *) echo "usage: scripts/test.sh [--sanitize]" >&2; exit 2 ;;
  esac
done

"$root/scripts/install-deps.sh"
cmake -S "$root" -B "$build" -G Ninja "${flags[@]}" >/dev/null
cmake --build "$build" -j "$(nproc)"
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1" UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
ctest --test-dir "$build" --output-on-failure -j "$(nproc)"
