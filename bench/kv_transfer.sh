#!/usr/bin/env bash
# KV transfer benchmark: throughput on one host (in-process agents over the shared-memory and the
# TCP transports, next to a raw TCP socket and a bare memcpy, alternating rounds, medians) and the
# latency prefill/decode disaggregation adds per request, in both dialects, on simulated
# DeepSeek-V3 engines with zero compute time (so only transfer and HTTP remain), with the P/D
# engines moving KV over shared memory (the default) and over TCP.
# Usage: bench/kv_transfer.sh [BUILD_DIR]   (configures it with the benchmarks on and builds)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
. "$root/bench/lib.sh"
build_bench_targets "$root" "$build" tandem tandem-bench-kv-transfer
lengths="${LENGTHS:-256,1024,4096,8192}"

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

start() {  # start LOGFILE ARGS...: starts an engine, waits for its first line
  local log="$1"
  shift
  "$build/tandem" engine --host 127.0.0.1 --port 0 --model sim:deepseek-v3-h800 \
    --sim-time-scale 0 --num-kv-blocks 4096 --max-num-batched-tokens 16384 "$@" >"$log" 2>/dev/null &
  pids+=($!)
  for _ in $(seq 1 200); do
    [ -s "$log" ] && [ "$(wc -l <"$log")" -ge 2 ] && return
    sleep 0.1
  done
  echo "engine did not start" >&2
  exit 1
}
port_of() { sed -n 's/.*listening on http:\/\/[^:]*:\([0-9]*\).*/\1/p' "$1" | head -1; }

dir="$(mktemp -d)"
start "$dir/single" --role both
for t in shm tcp; do
  start "$dir/prefill-$t" --role prefill --kv-transfer-port 0 --kv-transport "$t"
  start "$dir/decode-$t" --role decode --kv-transport "$t"
done
"$build/bench/tandem-bench-kv-transfer" --lengths "$lengths"
for t in shm tcp; do
  kv_port="$(sed -n 's/.*KV transfer on [^:]*:\([0-9]*\).*/\1/p' "$dir/prefill-$t" | head -1)"
  "$build/bench/tandem-bench-kv-transfer" --lengths "$lengths" --serving-only --label "$t" \
    --single-port "$(port_of "$dir/single")" --prefill-port "$(port_of "$dir/prefill-$t")" \
    --decode-port "$(port_of "$dir/decode-$t")" --kv-port "$kv_port"
done
rm -rf "$dir"
