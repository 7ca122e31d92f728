#!/usr/bin/env bash
# The cost of batch-invariant numerics (tandem engine --batch-invariant): tandem-bench-engine's
# prefill (512 tokens) and decode (batch 1 and 16) tokens/s with and without it on the same
# checkpoint, alternating rounds, medians and ratios.
# Usage: bench/batch_invariant.sh [BUILD_DIR]
# Environment: MODEL (default: the make-model `bench` preset in BF16, written once into
#              BUILD_DIR/models), ROUNDS (3).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
. "$root/bench/lib.sh"
build_bench_targets "$root" "$build" tandem tandem-bench-engine
model="${MODEL:-$build/models/bench-bf16}"
[ -f "$model/config.json" ] || "$build/tandem" make-model --preset bench --dtype bf16 --out "$model"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
rounds="${ROUNDS:-3}"
for r in $(seq 1 "$rounds"); do
  order="plain invariant"
  [ $((r % 2)) -eq 0 ] && order="invariant plain"
  for mode in $order; do
    flag=""
    [ "$mode" = invariant ] && flag="--batch-invariant"
    "$build/bench/tandem-bench-engine" --model "$model" --prefill-runs 3 $flag > "$work/$mode.$r"
  done
done
python3 - "$work" "$rounds" <<'PY'
import re, statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
def figures(path):
    text = open(path).read()
    out = {"prefill": float(re.search(r"^prefill \d+ tokens:\s+([\d.]+) tokens/s", text, re.M).group(1))}
    for batch, tps in re.findall(r"^decode batch (\d+)\S*\s+([\d.]+) tokens/s", text, re.M):
        out[f"decode batch {batch}"] = float(tps)
    return out
runs = {m: [figures(f"{work}/{m}.{r}") for r in range(1, rounds + 1)] for m in ("plain", "invariant")}
print(f"{'':18} {'plain tok/s':>12} {'invariant':>10} {'ratio':>7}   (medians of {rounds} alternating rounds)")
for key in runs["plain"][0]:
    p = statistics.median(x[key] for x in runs["plain"])
    i = statistics.median(x[key] for x in runs["invariant"])
    print(f"{key:18} {p:12.1f} {i:10.1f} {i / p:6.2f}x")
PY
