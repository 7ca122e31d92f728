#!/usr/bin/env bash
# How many connections the gateway holds and what it does past its limits: two simulated engines
# behind `tandem gateway` (aggregated), and bench/connection_load.py as thousands of clients:
# IDLE (10,000) idle keep-alive connections held while STREAMS (2,000) streams run and ordinary
# requests are served; the gateway's resident memory per idle connection; connections past its
# cap (CAP, 12,500) closed at once with one log line per 10 s; SLOW (1,000) slowloris connections
# cut by the 10 s header timeout while ordinary requests are served; a burst past what the gateway
# queues answered 429 with OpenAI errors. The gateway routes by least load (the tandem policy would
# hold a burst of 2,000 new prompts in its queue, by design). Prints one JSON line per phase and
# the gateway's log lines about the cap.
#
# Usage: bench/connections.sh [BUILD_DIR]
# Environment: IDLE (10000), STREAMS (2000), CAP (12500), SLOW (1000), BURST (6000: past the
#   2 x 1,100 requests the engines take and the 2,500 the gateway queues),
#   STREAM_TOKENS (32). Needs a file descriptor limit above CAP + 1,000 (ulimit -Hn).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
idle="${IDLE:-10000}" streams="${STREAMS:-2000}" cap="${CAP:-12500}" slow="${SLOW:-1000}"
burst="${BURST:-6000}"
if [ "$(ulimit -Hn)" != unlimited ] && [ "$(ulimit -Hn)" -lt $((cap + 1000)) ]; then
  echo "bench/connections.sh: the hard file descriptor limit ($(ulimit -Hn)) is below CAP + 1000;" \
    "raise it (e.g. in /etc/security/limits.conf) or lower CAP and IDLE" >&2
  exit 1
fi
ulimit -n "$(ulimit -Hn)"

dir="$(mktemp -d)"
cleanup() {
  for f in "$dir"/*.pid; do [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null; done
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT

# Starts a tandem command in the background (its pid in LOG.pid, for the cleanup: this runs in a
# command substitution) and prints the port of its "listening on" line.
start() {
  local log="$1"
  shift
  "$build/tandem" "$@" >"$log" 2>&1 &
  echo $! >"$log.pid"
  for _ in $(seq 1 200); do
    if grep -qs 'listening on http://' "$log"; then
      sed -n 's/.*listening on http:\/\/[^:]*:\([0-9]*\).*/\1/p' "$log" | head -1
      return
    fi
    sleep 0.1
  done
  echo "bench/connections.sh: $* did not start:" >&2
  cat "$log" >&2
  exit 1
}

engine_ports=()
for i in 1 2; do
  engine_ports+=("$(start "$dir/engine$i.log" engine --model sim:tiny --host 127.0.0.1 --port 0 \
    --max-num-seqs 1024 --num-kv-blocks 16384)")
done
cat >"$dir/topology.yaml" <<EOF
listen: {host: 127.0.0.1, port: 8080, io_threads: 2, max_connections: $cap}
mode: aggregated
policy: least_load
max_queue: 2500
decode:
  dialect: tandem
  max_in_flight: 1100
  endpoints: ["127.0.0.1:${engine_ports[0]}", "127.0.0.1:${engine_ports[1]}"]
EOF
port="$(start "$dir/gateway.log" gateway --config "$dir/topology.yaml" --port 0)"
gateway_pid="$(cat "$dir/gateway.log.pid")"
for _ in $(seq 1 100); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  sleep 0.1
done

echo "# bench/connections.sh: $(date -u +%FT%TZ), $(nproc) cores, fd limit $(ulimit -n)"
python3 "$root/bench/connection_load.py" 127.0.0.1 "$port" "$gateway_pid" --idle "$idle" \
  --streams "$streams" --stream-tokens "${STREAM_TOKENS:-32}" --cap "$cap" --over-cap 500 \
  --slowloris "$slow" --burst "$burst"
echo "# gateway log lines about the connection cap and accept failures:"
grep -E 'connection cap|accept failed' "$dir/gateway.log" || echo "(none)"
