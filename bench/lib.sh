# Shared by the benchmark scripts (source it): configure BUILD_DIR with the benchmarks on (Ninja
# for a fresh folder) and build the given targets.
#   build_bench_targets ROOT BUILD_DIR TARGET...
build_bench_targets() {
  local root="$1" build="$2"
  shift 2
  if [ -f "$build/CMakeCache.txt" ]; then
    cmake -S "$root" -B "$build" -DTANDEM_BUILD_BENCH=ON >/dev/null
  else
    cmake -S "$root" -B "$build" -G Ninja -DTANDEM_BUILD_BENCH=ON >/dev/null
  fi
  cmake --build "$build" --target "$@" >/dev/null
}
