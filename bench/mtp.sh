#!/usr/bin/env bash
# Speculative decoding with the MTP module on a trained checkpoint (tools/train_tiny_deepseek.py,
# built on first use into ~/.cache/tandem/models/tiny-trained-v3, about 25 minutes on 2 cores):
# tandem-bench-mtp prints, for batches 1, 4 and 16 and K = 0..3 draft tokens side by side (one
# fresh process per batch size; rounds alternating the order of K, each round's speedups over its
# own plain run, medians over rounds), decode tokens/s and the acceptance per draft position; the
# cost of a verify step plus its draft passes over a plain step by part, measured in every round,
# the speedup that acceptance and cost allow next to the measured one; and a projection to
# DeepSeek-V3's shape. Prompts are cut from the trainer's held-out files.
# Usage: bench/mtp.sh [BUILD_DIR]
# Environment: MODEL (a checkpoint with an MTP module), BATCHES (1,4,16), KS (0,1,2,3),
#              ROUNDS (5), PROMPT (128), MAX_TOKENS (64).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
. "$root/bench/lib.sh"
build_bench_targets "$root" "$build" tandem tandem-bench-mtp
trainer="$root/tools/train_tiny_deepseek.py"
model="${MODEL:-$HOME/.cache/tandem/models/tiny-trained-v3}"
if [ ! -f "$model/config.json" ]; then
  echo "training $model (once; about 25 minutes on 2 cores)" >&2
  /usr/bin/python3 "$trainer" train --out "$model" --tandem "$build/tandem" >&2
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
/usr/bin/python3 "$trainer" held-out --out "$work/held-out.txt" >&2
"$build/bench/tandem-bench-mtp" --model "$model" --text "$work/held-out.txt" \
  --batches "${BATCHES:-1,4,16}" --ks "${KS:-0,1,2,3}" --rounds "${ROUNDS:-5}" \
  --prompt "${PROMPT:-128}" --max-tokens "${MAX_TOKENS:-64}"
