#!/usr/bin/env bash
# Gateway scheduling policies side by side on real traffic: the same window of the Mooncake
# conversation trace replayed through `tandem serve` (simulated DeepSeek-V3 engines, engines
# publishing KV events into the gateway's prefix index) once per policy, with `tandem bench`.
# Prints one row per policy: TTFT and TPOT p50/p99, goodput under the SLOs, prefix-cache hit
# rate next to the window's own upper bound (an infinite cache with the trace's 512-token
# blocks), and load imbalance (largest over mean of the requests each engine got).
#
# The engines keep the simulated H800's KV capacity (524,288 tokens each, what one 80 GB rank keeps
# after its share of the weights) and its step times; only the bytes their KV transfers move are
# cut to SIM_KV_BYTES per token and layer, so eight engines' transfers fit one machine's loopback
# (transfer time is not what the policies decide). The hit rate counts the prefill engines' prefix
# caches (in P/D modes the decode engines receive the KV and compute nothing).
#
# Usage: bench/policy_comparison.sh [BUILD_DIR]
# Environment: POLICIES ("least_load round_robin cache_aware kv_router tandem"), PREFILL (4),
#   DECODE (4), MODE (parallel), LIMIT (300 records), START (0), TIME_SCALE (2), SIM_KV_BYTES
#   (16), SLO_TTFT_MS (10000), SLO_TPOT_MS (100), TRACE (../shared/traces/...), ENGINE_ARGS
#   (more engine flags, e.g. "--num-kv-blocks=4096").
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
policies="${POLICIES:-least_load round_robin cache_aware kv_router tandem}"
trace="${TRACE:-$root/../shared/traces/mooncake_conversation_trace.jsonl}"
limit="${LIMIT:-300}" start="${START:-0}" scale="${TIME_SCALE:-2}"
[ -f "$trace" ] || { echo "no trace at $trace (set TRACE)" >&2; exit 1; }

dir="$(mktemp -d)"
serve_pid=""
cleanup() {
  [ -n "$serve_pid" ] && kill "$serve_pid" 2>/dev/null && wait "$serve_pid" 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT

bound="$(python3 - "$trace" "$start" "$limit" <<'EOF'
import json, sys
path, start, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
seen, hit, total = set(), 0, 0
with open(path) as f:
    for i, line in enumerate(f):
        if i < start:
            continue
        if limit and i >= start + limit:
            break
        r = json.loads(line)
        n, k = r["input_length"], 0
        for h in r["hash_ids"]:
            if h not in seen:
                break
            k += 1
        hit += min(512 * k, n)
        total += n
        seen.update(r["hash_ids"])
print(f"{100.0 * hit / max(total, 1):.2f}")
EOF
)"

printf '%-12s %9s %9s %9s %9s %10s %9s %9s %9s\n' policy ttft_p50 ttft_p99 tpot_p50 tpot_p99 \
  goodput hit_% bound_% imbalance
for policy in $policies; do
  log="$dir/serve-$policy.out"
  engine_args=(--engine-arg="--sim-kv-token-bytes=${SIM_KV_BYTES:-16}")
  for a in ${ENGINE_ARGS:-}; do engine_args+=(--engine-arg="$a"); done
  "$build/tandem" serve --model sim:deepseek-v3-h800 --mode "${MODE:-parallel}" \
    --prefill "${PREFILL:-4}" --decode "${DECODE:-4}" --port 0 --kv-events --policy "$policy" \
    --admin-api-key bench "${engine_args[@]}" >"$log" 2>&1 &
  serve_pid=$!
  for _ in $(seq 1 300); do
    n="$(grep -c 'engine http://' "$log" || true)"
    [ "$n" -ge $((${PREFILL:-4} + ${DECODE:-4})) ] && break
    sleep 0.2
  done
  url="$(sed -n 's/.*listening on \(http:\/\/[^ ]*\).*/\1/p' "$log" | head -1)"
  metrics=()
  computes="prefill engine"
  [ "${MODE:-parallel}" = aggregated ] && computes="decode engine"
  for e in $(sed -n "s/.*$computes \\(http:\\/\\/[^ ]*\\).*/\\1/p" "$log"); do
    metrics+=(--metrics-url "$e")
  done
  "$build/tandem" bench --base-url "$url" --model deepseek-v3-h800 --dataset-name mooncake \
    --dataset-path "$trace" --trace-start "$start" --trace-limit "$limit" --time-scale "$scale" \
    "${metrics[@]}" --percentile-metrics ttft,tpot --metric-percentiles 50,99 \
    --goodput "ttft:${SLO_TTFT_MS:-10000}" --goodput "tpot:${SLO_TPOT_MS:-100}" \
    --result-file "$dir/$policy.json" --no-progress >"$dir/bench-$policy.out" 2>&1
  curl -s -H 'Authorization: Bearer bench' "$url/metrics" >"$dir/metrics-$policy.txt"
  kill "$serve_pid" && wait "$serve_pid" 2>/dev/null || true
  serve_pid=""
  python3 - "$dir/$policy.json" "$dir/metrics-$policy.txt" "$policy" "$bound" <<'EOF'
import json, re, sys
r = json.load(open(sys.argv[1]))
sent = {}
for line in open(sys.argv[2]):
    m = re.match(r'tandem:gateway_endpoint_requests_total\{pool="(\w+)",endpoint="([^"]+)"\} (\S+)', line)
    if m:
        sent.setdefault(m.group(1), []).append(float(m.group(3)))
pool = sent.get("prefill") or sent.get("decode") or [0]
imbalance = max(pool) / (sum(pool) / len(pool)) if sum(pool) else 0
hit = r.get("prefix_cache_hit_rate")
print(f'{sys.argv[3]:<12} {r["p50_ttft_ms"]:9.0f} {r["p99_ttft_ms"]:9.0f} {r["p50_tpot_ms"]:9.1f} '
      f'{r["p99_tpot_ms"]:9.1f} {r["request_goodput"] or 0:10.3f} '
      f'{(100 * hit if hit is not None else float("nan")):9.2f} {float(sys.argv[4]):9.2f} '
      f'{imbalance:9.2f}  ({r["completed"]} ok, {r["failed"]} failed)')
EOF
done
