#!/usr/bin/env bash
# Expert parallelism on one host: tandem-bench-expert-parallel runs the same steps on the
# single-process CPU executor (EP 1) and on an engine's expert-parallel executor of RANKS rank
# processes, in alternating rounds (medians): prefill and decode tokens/s, the exchange per MoE
# layer (bytes, copies, barrier waits, experts; the link time per GB/s), and routed rows per rank
# under a placement that puts the most-routed experts on rank 0, then after a live rebalance.
#
# Usage: bench/expert_parallel.sh [BUILD_DIR]
# Environment: MODELS (checkpoint folders, space-separated; default: the make-model `bench`
#              preset, 3 layers, written to a temporary folder), RANKS (2), ROUNDS (3),
#              BATCH (8), PROMPT (64), DECODE (16).
# docs/benchmarks.md names the checkpoints of the recorded run (the 8-layer decode-issue shape and
# a DeepSeek-V3-routing-shaped one with skewed routing) and the commands that write them.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
. "$root/bench/lib.sh"
build_bench_targets "$root" "$build" tandem tandem-bench-expert-parallel

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
models="${MODELS:-}"
if [ -z "$models" ]; then
  "$build/tandem" make-model --preset bench --out "$work/bench" >/dev/null
  models="$work/bench"
fi
for model in $models; do
  "$build/bench/tandem-bench-expert-parallel" --model "$model" --tandem "$build/tandem" \
    --ranks "${RANKS:-2}" --rounds "${ROUNDS:-3}" --batch "${BATCH:-8}" --prompt "${PROMPT:-64}" \
    --decode "${DECODE:-16}"
  echo
done
