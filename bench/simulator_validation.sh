#!/usr/bin/env bash
# `tandem simulate` against the live stack on the same traffic: one trace window through
# `tandem serve` with simulated engines and `tandem bench` (bench/policy_comparison.sh, every
# policy), and through `tandem simulate` with the same engines, settings and window. Prints, per
# policy, TTFT p50/p90/p99, TPOT p50/p99, goodput and prefix hit rate live and simulated, and the
# simulated value's error relative to the live one; a row is within the target when every error
# is at most 10% (hit rates: at most 10% relative or 0.5 points absolute; goodputs: 10% of the
# live goodput or 0.005 req/s).
#
# Both sides run the same engines (sim:deepseek-v3-h800 step times, KV transfers moving
# SIM_KV_BYTES per token and layer, KV_TIMEOUT_S for a held prefill) and the same gateway
# defaults. The simulator's KV links are LINK_GB_PER_S (loopback-like) with LINK_LATENCY_US.
#
# Usage: bench/simulator_validation.sh [BUILD_DIR]
# Environment: as bench/policy_comparison.sh (DATASET mooncake|azure, TRACE, POLICIES, PREFILL,
#   DECODE, MODE, LIMIT, START, TIME_SCALE, SIM_KV_BYTES, KV_TIMEOUT_S, SLO_TTFT_MS, SLO_TPOT_MS,
#   SPREAD, SEED),
#   plus LINK_GB_PER_S (5), LINK_LATENCY_US (50) and OUT (keep the live and simulated results).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
. "$root/bench/lib.sh"
dataset="${DATASET:-mooncake}"
if [ "$dataset" = azure ]; then
  default_trace="$root/../shared/traces/AzureLLMInferenceTrace_code_2023.csv"
else
  default_trace="$root/../shared/traces/mooncake_conversation_trace.jsonl"
fi
export DATASET="$dataset" TRACE="${TRACE:-$default_trace}"
policies="${POLICIES:-least_load round_robin cache_aware kv_router tandem}"
export POLICIES="$policies"
if [ ! -f "$TRACE" ]; then
  echo "bench/simulator_validation.sh: no trace at $TRACE (set TRACE; see bench/policy_comparison.sh)" >&2
  exit 1
fi

dir="$(mktemp -d)"
trap '[ -n "${OUT:-}" ] && mkdir -p "$OUT" && cp -r "$dir"/. "$OUT"/; rm -rf "$dir"' EXIT

echo "== live: bench/policy_comparison.sh ($dataset, ${LIMIT:-300} records from ${START:-0})" >&2
OUT="$dir/live" "$root/bench/policy_comparison.sh" "$build" >"$dir/live.txt"
cat "$dir/live.txt" >&2

echo "== simulated: tandem simulate" >&2
for policy in $policies; do
  "$build/tandem" simulate --dataset-name "$dataset" --dataset-path "$TRACE" \
    --trace-start "${START:-0}" --trace-limit "${LIMIT:-300}" --time-scale "${TIME_SCALE:-2}" \
    $(trace_spread_args) \
    --mode "${MODE:-parallel}" --prefill "${PREFILL:-4}" --decode "${DECODE:-4}" \
    --policy "$policy" --model sim:deepseek-v3-h800 \
    --sim-kv-token-bytes "${SIM_KV_BYTES:-16}" --kv-transfer-timeout "${KV_TIMEOUT_S:-600}" \
    --kv-link-gb-per-s "${LINK_GB_PER_S:-5}" --kv-link-latency-us "${LINK_LATENCY_US:-50}" \
    --percentile-metrics ttft,tpot --metric-percentiles 50,90,95,99 \
    --goodput "ttft:${SLO_TTFT_MS:-10000}" --goodput "tpot:${SLO_TPOT_MS:-100}" \
    --result-file "$dir/sim-$policy.json" >"$dir/sim-$policy.out" 2>&1
done

python3 - "$dir" $policies <<'EOF'
import json, math, os, sys
d, policies = sys.argv[1], sys.argv[2:]
metrics = [("ttft p50", "p50_ttft_ms"), ("ttft p90", "p90_ttft_ms"), ("ttft p99", "p99_ttft_ms"),
           ("tpot p50", "p50_tpot_ms"), ("tpot p99", "p99_tpot_ms"),
           ("goodput", "request_goodput"), ("hit %", "prefix_cache_hit_rate")]
print(f'{"policy":<12} ' + " ".join(f"{m:>22}" for m, _ in metrics) + "  within 10%")
worst_all = 0.0
for p in policies:
    live_path = os.path.join(d, "live", f"{p}.json")
    if not os.path.exists(live_path):
        print(f"{p:<12} live run failed (see the serve and bench logs)")
        continue
    live = json.load(open(live_path))
    sim = json.load(open(os.path.join(d, f"sim-{p}.json")))
    cells, ok = [], True
    for name, key in metrics:
        a, b = live.get(key), sim.get(key)
        a = float(a) if a is not None else float("nan")
        b = float(b) if b is not None else float("nan")
        scale = 100 if key == "prefix_cache_hit_rate" else 1
        if key == "prefix_cache_hit_rate":
            err_ok = abs(b - a) * 100 <= 0.5 or (a > 0 and abs(b - a) / a <= 0.10)
        elif key == "request_goodput":
            err_ok = abs(b - a) <= max(0.10 * abs(a), 0.005)
        else:
            err_ok = a > 0 and abs(b - a) / a <= 0.10
        err = (b - a) / a * 100 if a else float("nan")
        if not math.isnan(err):
            worst_all = max(worst_all, abs(err))
        ok &= err_ok
        fmt = "{:.1f}" if key.startswith("p") and "tpot" in key else "{:.3f}" if key == "request_goodput" else "{:.2f}" if scale == 100 else "{:.0f}"
        cells.append(f'{fmt.format(a * scale)}/{fmt.format(b * scale)} ({err:+.0f}%)')
    print(f"{p:<12} " + " ".join(f"{c:>22}" for c in cells) + ("  yes" if ok else "  NO"))
print("(live/simulated, simulated error relative to live)")

# Request by request: the same trace record live and simulated. Aggregate percentiles can move
# while most requests agree; the arrivals where they disagree most show where to look.
print("\nper request (TTFT, simulated against live):")
for p in policies:
    live_path = os.path.join(d, "live", f"{p}.json")
    if not os.path.exists(live_path):
        continue
    live = json.load(open(live_path))
    sim = json.load(open(os.path.join(d, f"sim-{p}.json")))
    pairs = [(t, a, b) for t, a, b in zip(live.get("start_times", []), live.get("ttfts", []),
                                           sim.get("ttfts", [])) if a and b and a > 0 and b > 0]
    if not pairs:
        print(f"{p:<12} no per-request TTFTs in the results")
        continue
    ratios = sorted(b / a for _, a, b in pairs)
    close = sum(1 for _, a, b in pairs if abs(b - a) <= max(0.10 * a, 0.5))
    by_arrival = {}
    for t, a, b in pairs:
        by_arrival.setdefault(round(t), []).append(b - a)
    worst = sorted(by_arrival.items(), key=lambda kv: -sum(abs(x) for x in kv[1]))[:3]
    print(f"{p:<12} median ratio {ratios[len(ratios) // 2]:.2f}; within 10% or 0.5 s: "
          f"{close} of {len(pairs)}; largest differences at arrivals "
          + ", ".join(f"{t} s ({len(v)} requests, {sum(v) / len(v):+.1f} s mean)" for t, v in worst))
EOF
