#!/usr/bin/env bash
# Soak: `tandem serve` (PREFILL + DECODE simulated engines, parallel mode) under a steady replay by
# `tandem bench` for SECONDS (900 = 15 minutes), the resident memory of every process (serve, which
# is the gateway, and each engine) sampled every SAMPLE seconds. Prints per process the memory
# after the warm-up (WARMUP seconds), at the end, and the growth between them (the target: under
# 1%), and the bench's completed and failed requests (the target: no failures).
#
# Usage: bench/soak.sh [BUILD_DIR]
# Environment: SECONDS_TOTAL (900), WARMUP (180), SAMPLE (10), RATE (20 requests/s), PREFILL (2),
#   DECODE (2), MODEL (sim:tiny), INPUT_LEN (512), OUTPUT_LEN (64), OUT (a folder for the samples
#   and logs).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
total="${SECONDS_TOTAL:-900}" warmup="${WARMUP:-180}" sample="${SAMPLE:-10}" rate="${RATE:-20}"
dir="$(mktemp -d)"
serve_pid=""
cleanup() {
  [ -n "$serve_pid" ] && kill "$serve_pid" 2>/dev/null && wait "$serve_pid" 2>/dev/null
  [ -n "${OUT:-}" ] && mkdir -p "$OUT" && cp -r "$dir"/. "$OUT"/
  rm -rf "$dir"
}
trap cleanup EXIT

log="$dir/serve.log"
"$build/tandem" serve --model "${MODEL:-sim:tiny}" --mode parallel --prefill "${PREFILL:-2}" \
  --decode "${DECODE:-2}" --port 0 >"$log" 2>&1 &
serve_pid=$!
for _ in $(seq 1 600); do
  [ "$(grep -c 'engine http://' "$log" || true)" -ge $((${PREFILL:-2} + ${DECODE:-2})) ] && break
  sleep 0.2
done
url="$(sed -n 's/.*listening on \(http:\/\/[^ ]*\).*/\1/p' "$log" | head -1)"
[ -n "$url" ] || { cat "$log" >&2; exit 1; }
pids="$serve_pid $(sed -n 's/.*engine http:\/\/[^ ]* (pid \([0-9]*\).*/\1/p' "$log" | tr '\n' ' ')"

# RATE x SECONDS_TOTAL requests: the replay lasts about SECONDS_TOTAL.
"$build/tandem" bench --base-url "$url" --dataset-name random --num-prompts $((rate * total)) \
  --random-input-len "${INPUT_LEN:-512}" --random-output-len "${OUTPUT_LEN:-64}" \
  --random-range-ratio 0.5 --request-rate "$rate" --result-file "$dir/bench.json" \
  --no-progress >"$dir/bench.out" 2>&1 &
bench_pid=$!
start=$(date +%s)
echo "# bench/soak.sh: $(date -u +%FT%TZ), $(nproc) cores, $total s at $rate requests/s," \
  "processes $pids" >"$dir/samples.txt"
while kill -0 "$bench_pid" 2>/dev/null; do
  line="$(($(date +%s) - start))"
  for p in $pids; do line="$line $(awk '/VmRSS/ {print $2}' "/proc/$p/status" 2>/dev/null || echo 0)"; done
  echo "$line" >>"$dir/samples.txt"
  sleep "$sample"
done
wait "$bench_pid" || true
cat "$dir/samples.txt" | head -1
python3 - "$dir/samples.txt" "$warmup" "$dir/bench.json" "$dir/bench.out" <<'EOF'
import json, os, sys
rows = [l.split() for l in open(sys.argv[1]) if not l.startswith("#")]
warmup = int(sys.argv[2])
names = ["serve (gateway)"] + [f"engine {i}" for i in range(len(rows[0]) - 2)]
after = next(r for r in rows if int(r[0]) >= warmup)
end = rows[-1]
print(f"{'process':<16} {'after warm-up MiB':>18} {'end MiB':>9} {'growth':>8}")
for i, name in enumerate(names):
    a, e = int(after[i + 1]) / 1024, int(end[i + 1]) / 1024
    print(f"{name:<16} {a:18.1f} {e:9.1f} {100 * (e - a) / a:7.2f}%")
print(f"samples: {len(rows)}, from {after[0]} s to {end[0]} s")
if os.path.exists(sys.argv[3]):
    r = json.load(open(sys.argv[3]))
    print(f"bench: {r.get('completed')} completed, {r.get('failed')} failed")
else:
    tail = open(sys.argv[4]).read().strip().splitlines()[-5:]
    print("bench wrote no result; its last lines:", *tail, sep="\n  ")
EOF
