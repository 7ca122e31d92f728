#!/usr/bin/env bash
# The default policy against kv_router over every window of a trace, in simulation: each
# WINDOW-record window of the Mooncake trace (or the first WINDOWS of them), at each time scale
# and simulated-engine seed, through `tandem simulate` once per policy (4P+4D, parallel mode by
# default). Prints per run TTFT p50/p99 and goodput of both, the ratios, and at the end the mean
# ratios and the worst run: the figures the default policy is judged by (lead kv_router by 10%
# in TTFT p99 and goodput on average, never more than 2% behind).
#
# Usage: bench/policy_windows.sh [BUILD_DIR]
# Environment: TRACE, WINDOW (300), WINDOWS (0: all), TIME_SCALES ("4 8"), SEEDS ("0": each is
#   both the workload's --seed and --sim-seed), SPREAD (1: --trace-spread, the records sharing a
#   timestamp arrive spread up to the next one, drawn from the seed),
#   PREFILL (4), DECODE (4), MODE (parallel), POLICIES ("tandem kv_router": the first against the
#   second), SLO_TTFT_MS (10000), SLO_TPOT_MS (100), JOBS (2 runs at once), OUT (keep results),
#   TOPOLOGY (a topology file for every run: its `scheduling` section tunes the policies),
#   PEER_RUNS (a folder OUT kept: the second policy's runs found there are not run again).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
. "$root/bench/lib.sh"
build_bench_targets "$root" "$build" tandem
trace="${TRACE:-$root/../shared/traces/mooncake_conversation_trace.jsonl}"
if [ ! -f "$trace" ]; then
  echo "bench/policy_windows.sh: no trace at $trace (set TRACE)" >&2
  exit 1
fi
window="${WINDOW:-300}"
records="$(wc -l <"$trace")"
count=$((records / window))
[ "${WINDOWS:-0}" -gt 0 ] && [ "${WINDOWS}" -lt "$count" ] && count="$WINDOWS"
read -r -a policies <<<"${POLICIES:-tandem kv_router}"

dir="$(mktemp -d)"
trap '[ -n "${OUT:-}" ] && mkdir -p "$OUT" && cp -r "$dir"/. "$OUT"/; rm -rf "$dir"' EXIT
for ((w = 0; w < count; ++w)); do
  for ts in ${TIME_SCALES:-4 8}; do
    for seed in ${SEEDS:-0}; do
      for p in "${policies[@]}"; do
        kept="${PEER_RUNS:-}/$((w * window))-$ts-$seed-$p.json"
        if [ "$p" = "${policies[1]}" ] && [ -n "${PEER_RUNS:-}" ] && [ -f "$kept" ]; then
          cp "$kept" "$dir/"
        else
          echo "$((w * window)) $ts $seed $p"
        fi
      done
    done
  done
done | SPREAD_FLAG="$([ "${SPREAD:-0}" = 1 ] && echo --trace-spread)" \
  TOPOLOGY_FLAG="${TOPOLOGY:+--topology $TOPOLOGY}" xargs -P "${JOBS:-2}" -L 1 sh -c '
  # $1..$9: the fixed settings; ${10}..${13}: start, time scale, seed, policy from the line.
  "$1" simulate --dataset-name mooncake --dataset-path "$2" --trace-limit "$3" --mode "$4" \
    --prefill "$5" --decode "$6" --goodput ttft:"$7" --goodput tpot:"$8" \
    --metric-percentiles 50,99 --trace-start "${10}" --time-scale "${11}" --sim-seed "${12}" \
    --seed "${12}" ${SPREAD_FLAG} ${TOPOLOGY_FLAG} --policy "${13}" \
    --result-file "$9/${10}-${11}-${12}-${13}.json" >/dev/null 2>&1 ||
    echo "run failed: start ${10}, time scale ${11}, seed ${12}, policy ${13}" >&2
' run "$build/tandem" "$trace" "$window" "${MODE:-parallel}" "${PREFILL:-4}" "${DECODE:-4}" \
  "${SLO_TTFT_MS:-10000}" "${SLO_TPOT_MS:-100}" "$dir"

python3 - "$dir" "${policies[0]}" "${policies[1]}" <<'PY'
import glob, json, os, statistics, sys
d, ours, peer = sys.argv[1], sys.argv[2], sys.argv[3]
runs = {}
for f in glob.glob(os.path.join(d, "*.json")):
    start, ts, seed, policy = os.path.basename(f)[:-5].split("-", 3)
    runs.setdefault((int(start), float(ts), int(seed)), {})[policy] = json.load(open(f))
print(f"{'start':>6} {'scale':>5} {'seed':>4} | {ours+' p50/p99 s':>20} {'goodput':>7} | "
      f"{peer+' p50/p99 s':>20} {'goodput':>7} | {'p99 ratio':>9} {'goodput ratio':>13}")
p99s, goods, worst = [], [], []
for key in sorted(runs):
    r = runs[key]
    if ours not in r or peer not in r:
        print(f"{key}: missing a run"); continue
    a, b = r[ours], r[peer]
    p99 = a["p99_ttft_ms"] / b["p99_ttft_ms"]
    good = a["request_goodput"] / b["request_goodput"] if b["request_goodput"] > 0 else float("nan")
    p99s.append(p99); goods.append(good)
    # How far behind the peer, the worse of the two (TTFT p99 higher, goodput lower).
    worst.append((max(p99 - 1, 1 - good), key))
    print(f"{key[0]:>6} {key[1]:>5g} {key[2]:>4} | {a['p50_ttft_ms']/1e3:>9.1f}/{a['p99_ttft_ms']/1e3:<10.1f} "
          f"{a['request_goodput']:>7.3f} | {b['p50_ttft_ms']/1e3:>9.1f}/{b['p99_ttft_ms']/1e3:<10.1f} "
          f"{b['request_goodput']:>7.3f} | {p99:>9.3f} {good:>13.3f}")
if p99s:
    good_ok = [g for g in goods if g == g]
    print(f"\n{len(p99s)} runs: {ours}/{peer} TTFT p99 mean {statistics.mean(p99s):.3f} "
          f"(median {statistics.median(p99s):.3f}), goodput mean {statistics.mean(good_ok):.3f} "
          f"(median {statistics.median(good_ok):.3f})")
    w, key = max(worst)
    print(f"worst run: start {key[0]}, time scale {key[1]:g}, seed {key[2]}: {100*w:.1f}% behind")
PY
