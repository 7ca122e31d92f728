#!/usr/bin/env bash
# Priority classes under load: an interactive class (short chats, a steady trickle) shares one
# prefill and one decode engine (simulated DeepSeek-V3 on H800, real time) with a batch class
# (long prompts arriving faster than the prefill engine computes them). The same traffic runs
# through `tandem serve` with priority classes (the batch key mapped to the batch class; engines
# scheduling by priority) and without them (the queue's own rule only), alternating for ROUNDS
# rounds; prints each run's interactive TTFT p50/p99 and batch TTFT p50/p99 and throughput, then
# the medians and the interactive TTFT p99 ratio (without / with).
# Usage: bench/priority_classes.sh [BUILD_DIR]
# Environment: ROUNDS (3), BATCH_RATE (2.5 req/s), BATCH_LEN (3000 tokens), BATCH_N (150),
#   CHAT_RATE (1 req/s), CHAT_LEN (800), CHAT_N (40), OUTPUT_LEN (16), MODEL
#   (sim:deepseek-v3-h800).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
. "$root/bench/lib.sh"
build_bench_targets "$root" "$build" tandem
rounds="${ROUNDS:-3}" model="${MODEL:-sim:deepseek-v3-h800}"

dir="$(mktemp -d)"
serve_pid=
cleanup() {
  [ -n "$serve_pid" ] && kill "$serve_pid" 2>/dev/null
  wait 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT
cat >"$dir/classes.yaml" <<YAML
classes:
  - {name: interactive, priority: 0, max_wait_ms: 2000, hold_ms: 0}
  - {name: batch, priority: 10, max_wait_ms: 60000}
api_keys: {sk-batch: batch}
YAML

# One run: `with` or `without` classes; writes $dir/$1-$2-{chat,batch}.json.
run() {
  local setting="$1" round="$2" extra=()
  [ "$setting" = with ] && extra=(--priority-classes "$dir/classes.yaml")
  "$build/tandem" serve --model "$model" --mode parallel --prefill 1 --decode 1 --port 0 \
    --api-key sk-chat --api-key sk-batch "${extra[@]}" >"$dir/serve.out" 2>&1 &
  serve_pid=$!
  local url=
  for _ in $(seq 1 300); do
    url="$(sed -n 's/.*listening on \(http:\/\/[^ ]*\).*/\1/p' "$dir/serve.out" | head -1)"
    [ -n "$url" ] && break
    sleep 0.2
  done
  [ -n "$url" ] || { cat "$dir/serve.out" >&2; exit 1; }
  local common=(--base-url "$url" --model "${model#sim:}" --dataset-name random
    --random-range-ratio 0.1 --random-output-len "${OUTPUT_LEN:-16}" --no-progress
    --percentile-metrics ttft --metric-percentiles 50,99)
  "$build/tandem" bench "${common[@]}" --api-key sk-batch --random-input-len "${BATCH_LEN:-3000}" \
    --num-prompts "${BATCH_N:-150}" --request-rate "${BATCH_RATE:-2.5}" --seed "$round" \
    --result-file "$dir/$setting-$round-batch.json" >"$dir/bench-batch.out" 2>&1 &
  local batch=$!
  sleep 5  # the batch backlog builds up first
  "$build/tandem" bench "${common[@]}" --api-key sk-chat --random-input-len "${CHAT_LEN:-800}" \
    --num-prompts "${CHAT_N:-40}" --request-rate "${CHAT_RATE:-1}" --seed "$((round + 100))" \
    --result-file "$dir/$setting-$round-chat.json" >"$dir/bench-chat.out" 2>&1 ||
    { cat "$dir/bench-chat.out" >&2; exit 1; }
  wait "$batch" || { cat "$dir/bench-batch.out" >&2; exit 1; }
  kill "$serve_pid" && wait "$serve_pid" 2>/dev/null || true
  serve_pid=
}

for round in $(seq 1 "$rounds"); do
  # Alternate which setting goes first, so drift in the machine hits both alike.
  if [ $((round % 2)) -eq 1 ]; then order="without with"; else order="with without"; fi
  for setting in $order; do run "$setting" "$round"; done
done

python3 - "$dir" "$rounds" <<'EOF'
import json, statistics, sys
d, rounds = sys.argv[1], int(sys.argv[2])
rows = {}
print(f'{"setting":<8} {"round":>5} {"chat_p50":>9} {"chat_p99":>9} {"batch_p50":>10} '
      f'{"batch_p99":>10} {"batch_req/s":>11} {"failed":>6}   (TTFT ms)')
for setting in ("without", "with"):
    for r in range(1, rounds + 1):
        chat = json.load(open(f"{d}/{setting}-{r}-chat.json"))
        batch = json.load(open(f"{d}/{setting}-{r}-batch.json"))
        row = (chat["p50_ttft_ms"], chat["p99_ttft_ms"], batch["p50_ttft_ms"], batch["p99_ttft_ms"],
               batch["request_throughput"], chat["failed"] + batch["failed"])
        rows.setdefault(setting, []).append(row)
        print(f"{setting:<8} {r:>5} {row[0]:9.0f} {row[1]:9.0f} {row[2]:10.0f} {row[3]:10.0f} "
              f"{row[4]:11.3f} {row[5]:6d}")
med = {s: [statistics.median(c) for c in zip(*v)] for s, v in rows.items()}
for s in ("without", "with"):
    m = med[s]
    print(f"{s:<8} {'med':>5} {m[0]:9.0f} {m[1]:9.0f} {m[2]:10.0f} {m[3]:10.0f} {m[4]:11.3f}")
print(f"interactive TTFT p99: {med['without'][1] / med['with'][1]:.1f}x lower with classes "
      f"({med['with'][1]:.0f} ms vs {med['without'][1]:.0f} ms without); batch TTFT p50 "
      f"{med['with'][2] / med['without'][2]:.2f}x, batch throughput "
      f"{med['with'][4] / med['without'][4]:.2f}x")
EOF
