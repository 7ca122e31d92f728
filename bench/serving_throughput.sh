#!/usr/bin/env bash
# Serving benchmark: output tokens/s and TTFT versus concurrency (1..64) for `tandem engine` on a
# simulated preset (deepseek-v3-h800) and on the CPU `bench` checkpoint.
# Usage: bench/serving_throughput.sh [BUILD_DIR]   (after scripts/test.sh or a build)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
levels="${LEVELS:-1,2,4,8,16,32,64}"

engine_pid=""
engine_port=""
start_engine() {  # starts an engine with the given arguments; sets engine_pid and engine_port
  local log
  log="$(mktemp)"
  "$build/tandem" engine --host 127.0.0.1 --port 0 "$@" >"$log" 2>/dev/null &
  engine_pid=$!
  for _ in $(seq 1 600); do
    engine_port="$(sed -n 's/.*listening on http:\/\/[^:]*:\([0-9]*\).*/\1/p' "$log" | head -1)"
    [ -n "$engine_port" ] && return
    kill -0 "$engine_pid" 2>/dev/null || break
    sleep 0.5
  done
  echo "engine did not start" >&2
  exit 1
}
stop_engine() { kill "$engine_pid" 2>/dev/null || true; wait "$engine_pid" 2>/dev/null || true; }
trap stop_engine EXIT

echo "== sim:deepseek-v3-h800 (prompt 1024 tokens, 128 output tokens, 4 requests per client)"
start_engine --model sim:deepseek-v3-h800 --max-num-seqs 256 --max-num-batched-tokens 16384
"$build/bench/tandem-bench-serving" --port "$engine_port" --concurrency "$levels" --prompt-tokens 1024 \
  --max-tokens 128 --requests-per-client 4 --sim-preset deepseek-v3-h800
stop_engine

dir="$build/models/bench-bf16"
[ -f "$dir/config.json" ] || "$build/tandem" make-model --preset bench --dtype bf16 --out "$dir"
echo "== CPU bench-bf16 (prompt 128 tokens, 32 output tokens, 1 request per client)"
start_engine --model "$dir" --max-num-seqs 64 --max-num-batched-tokens 2048
"$build/bench/tandem-bench-serving" --port "$engine_port" --concurrency "$levels" --prompt-tokens 128 \
  --max-tokens 32 --requests-per-client 1
stop_engine
