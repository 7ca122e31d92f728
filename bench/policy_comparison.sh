#!/usr/bin/env bash
# Gateway scheduling policies side by side on real traffic: the same window of the Mooncake
# conversation trace replayed through `tandem serve` (simulated DeepSeek-V3 engines, engines
# publishing KV events into the gateway's prefix index) once per policy, with `tandem bench`.
# Prints one row per policy: TTFT p50/p90/p95/p99 and mean, TPOT p50/p99, goodput under the SLOs,
# prefix-cache hit rate next to the window's own upper bound (an infinite cache with the trace's
# 512-token blocks), the routing-quality split from the gateway's access log (of the measured
# requests' prompt tokens: % cached on some computing engine when routed, on the engine chosen,
# and reused as the engine reported; docs/gateway.md "Routing quality"), and load imbalance
# (largest over mean of the prompt tokens each prefill engine computed).
#
# The engines keep the simulated H800's KV capacity (524,288 tokens each, what one 80 GB rank keeps
# after its share of the weights) and its step times; only the bytes their KV transfers move are
# cut to SIM_KV_BYTES per token and layer, so eight engines' transfers fit one machine's loopback
# (transfer time is not what the policies decide). The window's longest prompts (up to 126K tokens)
# take up to 97 s of prefill on one simulated GPU, so the engines' KV transfer timeout (how long a
# decode engine waits for a prefill's KV) is KV_TIMEOUT_S (600 s) instead of the default 120 s,
# which would fail and retry them under any policy. The hit rate counts the prefill engines' prefix
# caches (in P/D modes the decode engines receive the KV and compute nothing).
#
# Usage: bench/policy_comparison.sh [BUILD_DIR]
# Environment: DATASET (mooncake; or azure, with TRACE an Azure LLM inference CSV: no prefix
#   reuse, so no bound), POLICIES ("least_load round_robin cache_aware kv_router tandem"), PREFILL (4),
#   DECODE (4), MODE (parallel), LIMIT (300 records), START (0), TIME_SCALE (2), SIM_KV_BYTES
#   (16), KV_TIMEOUT_S (600), SLO_TTFT_MS (10000), SLO_TPOT_MS (100), TRACE (the Mooncake trace,
#   ../shared/traces/mooncake_conversation_trace.jsonl beside the checkout), ENGINE_ARGS
#   (more engine flags, e.g. "--num-kv-blocks=4096"), JOBS (1: policies run one after another;
#   N: N at once, each with its own engines, which fits when the machine has cores to spare),
#   SPREAD (1: --trace-spread, a Mooncake timestamp's records spread up to the next one, drawn
#   from SEED, 0), OUT (a folder to keep every run's bench results, serve logs and engine metrics in).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
policies="${POLICIES:-least_load round_robin cache_aware kv_router tandem}"
trace="${TRACE:-$root/../shared/traces/mooncake_conversation_trace.jsonl}"
limit="${LIMIT:-300}" start="${START:-0}" scale="${TIME_SCALE:-2}"
. "$root/bench/lib.sh"
read -r -a spread <<<"$(trace_spread_args)"
if [ ! -f "$trace" ]; then
  # The trace is public data kept outside the repository: say where it comes from.
  cat >&2 <<EOF
bench/policy_comparison.sh: the Mooncake conversation trace is not at
  $trace
It is public data, not part of this repository. It is published in the kvcache-ai/Mooncake
GitHub repository (Apache-2.0), FAST'25 traces folder: FAST25-release/traces/conversation_trace.jsonl
(docs/benchmarks.md used the copy of commit 3b5a5941, sha256
b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df):
  https://github.com/kvcache-ai/Mooncake/tree/main/FAST25-release/traces
Save it beside the checkout as ../shared/traces/mooncake_conversation_trace.jsonl, or point TRACE
at it: TRACE=/path/to/conversation_trace.jsonl bench/policy_comparison.sh
EOF
  exit 1
fi

dir="$(mktemp -d)"
cleanup() {
  for f in "$dir"/*.pid; do [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null; done
  wait 2>/dev/null
  [ -n "${OUT:-}" ] && mkdir -p "$OUT" && cp -r "$dir"/. "$OUT"/
  rm -rf "$dir"
}
trap cleanup EXIT

dataset="${DATASET:-mooncake}"
bound=nan
[ "$dataset" = mooncake ] && bound="$(python3 - "$trace" "$start" "$limit" <<'EOF'
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

# One policy: a fresh `tandem serve`, the replay, and the row of the table.
run_policy() {
  local policy="$1" log="$dir/serve-$1.out"
  local engine_args=(--engine-arg="--sim-kv-token-bytes=${SIM_KV_BYTES:-16}"
    --engine-arg="--kv-transfer-timeout=${KV_TIMEOUT_S:-600}")
  for a in ${ENGINE_ARGS:-}; do engine_args+=(--engine-arg="$a"); done
  "$build/tandem" serve --model sim:deepseek-v3-h800 --mode "${MODE:-parallel}" \
    --prefill "${PREFILL:-4}" --decode "${DECODE:-4}" --port 0 --kv-events --policy "$policy" \
    --admin-api-key bench --access-log "$dir/access-$policy.jsonl" "${engine_args[@]}" >"$log" 2>&1 &
  local serve_pid=$!
  echo "$serve_pid" >"$dir/$policy.pid"
  for _ in $(seq 1 300); do
    n="$(grep -c 'engine http://' "$log" || true)"
    [ "$n" -ge $((${PREFILL:-4} + ${DECODE:-4})) ] && break
    sleep 0.2
  done
  local url computes="prefill engine" metrics=() engines=()
  url="$(sed -n 's/.*listening on \(http:\/\/[^ ]*\).*/\1/p' "$log" | head -1)"
  [ "${MODE:-parallel}" = aggregated ] && computes="decode engine"
  for e in $(sed -n "s/.*$computes \\(http:\\/\\/[^ ]*\\).*/\\1/p" "$log"); do
    metrics+=(--metrics-url "$e")
    engines+=("$e")
  done
  # --ignore-eos: the replay forces the trace's output lengths, as it did before it was an opt-in
  # flag (vLLM forces them only for the random dataset); the recorded comparisons depend on it.
  "$build/tandem" bench --base-url "$url" --model deepseek-v3-h800 --dataset-name "$dataset" \
    --ignore-eos --dataset-path "$trace" --trace-start "$start" --trace-limit "$limit" \
    --time-scale "$scale" "${spread[@]}" "${metrics[@]}" --percentile-metrics ttft,tpot --metric-percentiles 50,90,95,99 \
    --goodput "ttft:${SLO_TTFT_MS:-10000}" --goodput "tpot:${SLO_TPOT_MS:-100}" \
    --result-file "$dir/$policy.json" --no-progress >"$dir/bench-$policy.out" 2>&1 ||
    true # bench exits 1 when every request failed: the row says so, and this stack must still stop
  for e in "${engines[@]}"; do curl -s "$e/metrics" >"$dir/engine-$policy-${e##*:}.txt"; done
  kill "$serve_pid" && wait "$serve_pid" 2>/dev/null || true
  rm -f "$dir/$policy.pid"
  python3 - "$dir/$policy.json" "$policy" "$bound" "$dir/access-$policy.jsonl" \
    "$dir"/engine-"$policy"-*.txt >"$dir/row-$policy.txt" <<'EOF'
import json, re, sys
r = json.load(open(sys.argv[1]))
# Routing quality from the gateway's access log: of the measured requests' prompt tokens, the
# share cached on some computing engine (available), on the one chosen, and reused as reported.
split = {"available": 0, "chosen": 0, "delivered": 0}
prompt = 0
for line in open(sys.argv[4]):
    a = json.loads(line)
    reuse = a.get("prefix_reuse")
    if a.get("status") != 200 or not reuse or min(reuse.values()) < 0:
        continue
    prompt += a["prompt_tokens"]
    for k in split:
        split[k] += reuse[k]
share = {k: 100.0 * v / prompt if prompt else float("nan") for k, v in split.items()}
# Prompt tokens each computing engine really computed (queried minus found in its prefix cache).
computed = []
for path in sys.argv[5:]:
    v = {}
    for line in open(path):
        m = re.match(r'(vllm:prefix_cache_(?:queries|hits)_total)\S* (\S+)', line)
        if m:
            v[m.group(1)] = v.get(m.group(1), 0) + float(m.group(2))
    computed.append(v.get("vllm:prefix_cache_queries_total", 0) - v.get("vllm:prefix_cache_hits_total", 0))
mean = sum(computed) / len(computed) if computed else 0
imbalance = max(computed) / mean if mean else 0
hit = r.get("prefix_cache_hit_rate")
print(f'{sys.argv[2]:<12} {r["p50_ttft_ms"]:9.0f} {r["p90_ttft_ms"]:9.0f} {r["p95_ttft_ms"]:9.0f} '
      f'{r["p99_ttft_ms"]:9.0f} {r["mean_ttft_ms"]:9.0f} {r["p50_tpot_ms"]:9.1f} '
      f'{r["p99_tpot_ms"]:9.1f} {r["request_goodput"] or 0:10.3f} '
      f'{(100 * hit if hit is not None else float("nan")):9.2f} {float(sys.argv[3]):9.2f} '
      f'{share["available"]:8.2f} {share["chosen"]:8.2f} {share["delivered"]:8.2f} '
      f'{imbalance:9.2f}  ({r["completed"]} ok, {r["failed"]} failed)')
EOF
}

# JOBS policies at once, each with its own `tandem serve` (default: one after another).
jobs_max="${JOBS:-1}"
for policy in $policies; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do sleep 1; done
  run_policy "$policy" &
done
wait
printf '%-12s %9s %9s %9s %9s %9s %9s %9s %10s %9s %9s %8s %8s %8s %9s\n' policy ttft_p50 \
  ttft_p90 ttft_p95 ttft_p99 ttft_mean tpot_p50 tpot_p99 goodput hit_% bound_% avail_% \
  chosen_% deliv_% imbalance
for policy in $policies; do
  cat "$dir/row-$policy.txt" 2>/dev/null || echo "$policy: failed (see bench output)"
done
