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

# ik_llama.cpp's llama-bench for the peer comparisons, built outside the repository: sets `bench`
# (PEER_DIR/build/bin/llama-bench) and `have_peer` (1; or 0 after saying plainly what is missing,
# the binary or a GGUF, which WRITER writes).
#   find_peer_bench PEER_DIR WRITER GGUF...
find_peer_bench() {
  local peer="$1" writer="$2" g
  shift 2
  bench="$peer/build/bin/llama-bench"
  have_peer=1
  if [ ! -x "$bench" ]; then
    echo "PEER ABSENT: no $bench. Build ik_llama.cpp outside the repository (see"
    echo "  ../shared/tools/README.md): cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON"
    echo "  -DLLAMA_CURL=OFF && cmake --build build -j2 --target llama-bench. Running Tandem alone."
    have_peer=0
    return
  fi
  for g in "$@"; do
    if [ ! -f "$g" ]; then
      echo "PEER ABSENT: no $g ($writer writes it). Running Tandem alone."
      have_peer=0
      return
    fi
  done
}

# The workload flags of SPREAD=1 (a Mooncake timestamp's records spread up to the next one,
# drawn from SEED, default 0), for both sides of a live-vs-simulated comparison; none otherwise.
#   read -r -a spread <<<"$(trace_spread_args)"
trace_spread_args() {
  [ "${SPREAD:-0}" = 1 ] && echo "--trace-spread --seed ${SEED:-0}"
  return 0
}
