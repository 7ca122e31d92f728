#!/usr/bin/env bash
# Chaos under load: `tandem serve` with 2 prefill + 2 decode engines, CLIENTS (100) streaming
# clients for DURATION (180) seconds, and a driver that every FAULT_INTERVAL (4) seconds kills
# (SIGKILL), stalls (SIGSTOP 5-30 s, then SIGCONT) a random engine or cuts a prefill engine's KV
# transfer connections (ss -K; needs root or CAP_NET_ADMIN). serve restarts what dies. Printed per
# run: requests completed, ended with an OpenAI error, cut without one and hung (neither allowed),
# the faults and restarts, gateway memory; then, once the traffic stopped, what every engine
# still holds: KV blocks held for transfers, running requests, KV cache use (all must be zero).
# Runs the simulated engines (sim:tiny) and the CPU engine on the tiny-v3 checkpoint.
#
# Usage: bench/chaos.sh [BUILD_DIR]
# Environment: MODELS ("sim:tiny tiny-v3"), MODE (parallel; or sequential), CLIENTS (100),
#   DURATION (180), FAULT_INTERVAL (4), SEED (1), ERROR_PAUSE (1: seconds a client waits after an
#   error), BOUND (330: seconds a stream may take, the
#   gateway's first-token timeout of 300 s plus a margin).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
dir="$(mktemp -d)"
serve_pid=""
cleanup() {
  [ -n "$serve_pid" ] && kill "$serve_pid" 2>/dev/null && wait "$serve_pid" 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT

# What an engine still holds: the sum of each series named.
engine_state() {
  curl -s "$1/metrics" | python3 -c '
import re, sys
want = ("tandem:kv_transfer_held_blocks", "vllm:num_requests_running", "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc")
v = {w: 0.0 for w in want}
for line in sys.stdin:
    m = re.match(r"([a-z_:]+)\S* (\S+)$", line)
    if m and m.group(1) in v:
        v[m.group(1)] += float(m.group(2))
print(" ".join(k.partition(chr(58))[2] + "=" + format(v[k], "g") for k in want))'
}

echo "# bench/chaos.sh: $(date -u +%FT%TZ), $(nproc) cores, mode ${MODE:-parallel}"
for model in ${MODELS:-sim:tiny tiny-v3}; do
  log="$dir/serve.log"
  "$build/tandem" serve --model "$model" --mode "${MODE:-parallel}" --prefill 2 --decode 2 \
    --port 0 >"$log" 2>&1 &
  serve_pid=$!
  for _ in $(seq 1 600); do
    [ "$(grep -c 'engine http://' "$log" || true)" -ge 4 ] && break
    sleep 0.2
  done
  port="$(sed -n 's/.*listening on http:\/\/[^:]*:\([0-9]*\).*/\1/p' "$log" | head -1)"
  if [ -z "$port" ]; then
    echo "bench/chaos.sh: tandem serve did not start:" >&2
    cat "$log" >&2
    exit 1
  fi
  echo "## $model"
  python3 "$root/bench/chaos_load.py" 127.0.0.1 "$port" "$serve_pid" "$log" \
    --clients "${CLIENTS:-100}" --duration "${DURATION:-180}" \
    --fault-interval "${FAULT_INTERVAL:-4}" --seed "${SEED:-1}" --bound "${BOUND:-330}" \
    --error-pause "${ERROR_PAUSE:-1}"
  # Traffic stopped: engines that restarted or recovered must hold nothing once the transfer
  # timeouts (120 s) had their chance; ask until they are clean or 150 s passed.
  settle_start=$(date +%s)
  for _ in $(seq 1 150); do
    clean=1
    for e in $(sed -n 's/.*engine \(http:\/\/[^ ]*\) (pid.*/\1/p' "$log"); do
      engine_state "$e" | grep -qE '=([1-9]|0\.[0-9]*[1-9])' && clean=0
    done
    [ "$clean" = 1 ] && break
    sleep 1
  done
  echo "after the traffic ($(($(date +%s) - settle_start)) s later; clean: $clean):"
  for e in $(sed -n 's/.*engine \(http:\/\/[^ ]*\) (pid.*/\1/p' "$log"); do
    echo "  $e $(engine_state "$e")"
  done
  echo "serve log: $(grep -c 'was killed by signal' "$log" || true) deaths seen," \
    "$(grep -c 'restarted (pid' "$log" || true) restarts"
  kill "$serve_pid" && wait "$serve_pid" 2>/dev/null || true
  serve_pid=""
done
