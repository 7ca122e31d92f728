#!/usr/bin/env bash
# Omni Placement next to DeepSeek's EPLB at DeepSeek-V3's shape (58 MoE layers x 256 experts,
# 8 routed per token) on 32 and 64 ranks, in one run: tandem-bench-placement writes the load sets,
# then DeepSeek's own eplb.py (bench/eplb_reference.py, PyTorch, one thread) and Tandem's planners
# are timed in alternating rounds, and the report prints the tables with medians:
#   - same slots per layer as EPLB: step proxy, mean and worst max/mean, plan time, speed-up, and
#     agreement of Tandem's EPLB reimplementation with eplb.py (layers with identical rank loads);
#   - the same total memory spread layer-wise, evenly, or to the layers worst without redundancy;
#   - rebalancing under drift: moves and balance, incremental against fresh plans.
#
# Usage: bench/placement.sh [BUILD_DIR]
# Environment: EPLB (a checkout of github.com/deepseek-ai/EPLB holding eplb.py; default
#              ~/.cache/peers/EPLB), ROUNDS (3), RECORDED (loads recorded by
#              `tandem engine --expert-load-dump`, a [layers, experts] .npy), or RECORD_MODEL (a
#              checkpoint folder: the script serves it, sends 48 random prompts with
#              `tandem bench`, and uses the cumulative counts).
# Without eplb.py or PyTorch (Debian's python3-torch for /usr/bin/python3) the script runs
# Tandem's side alone and says so.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
eplb="${EPLB:-$HOME/.cache/peers/EPLB}"
rounds="${ROUNDS:-3}"
recorded="${RECORDED:-}"

. "$root/bench/lib.sh"
build_bench_targets "$root" "$build" tandem tandem-bench-placement
bench="$build/bench/tandem-bench-placement"
work="$(mktemp -d)"
engine_pid=""
cleanup() {
  [ -n "$engine_pid" ] && kill "$engine_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

if [ -z "$recorded" ] && [ -n "${RECORD_MODEL:-}" ]; then
  port=$((20000 + RANDOM % 20000))
  "$build/tandem" engine --model "$RECORD_MODEL" --host 127.0.0.1 --port "$port" \
    --expert-load-window 64 --expert-load-dump "$work/dump" >"$work/engine.log" 2>&1 &
  engine_pid=$!
  for _ in $(seq 1 600); do
    grep -q "listening on" "$work/engine.log" && break
    sleep 1
  done
  "$build/tandem" bench --base-url "http://127.0.0.1:$port" --model "$RECORD_MODEL" \
    --num-prompts 48 --random-input-len 256 --random-output-len 32 --max-concurrency 8 \
    --no-progress >/dev/null
  kill -TERM "$engine_pid"
  wait "$engine_pid" || true
  engine_pid=""
  recorded="$work/dump/expert_load_cumulative.npy"
  echo "recorded loads: $RECORD_MODEL served 48 random 256-token prompts (32 tokens each)"
fi

"$bench" --dir "$work" --phase write ${recorded:+--recorded "$recorded"}

have_reference=0
if [ -f "$eplb/eplb.py" ] && /usr/bin/python3 -c "import torch" 2>/dev/null; then
  have_reference=1
  echo "eplb.py: $eplb ($(git -C "$eplb" rev-parse --short HEAD 2>/dev/null || cat "$eplb/COMMIT" 2>/dev/null || echo 'unknown commit'))"
else
  echo "EPLB REFERENCE ABSENT: want $eplb/eplb.py (git clone https://github.com/deepseek-ai/EPLB" \
       "$eplb) and PyTorch for /usr/bin/python3 (Debian python3-torch); running Tandem alone"
fi
for round in $(seq 1 "$rounds"); do
  if [ "$have_reference" = 1 ]; then
    /usr/bin/python3 "$root/bench/eplb_reference.py" "$eplb" "$work/cases.json" \
      "$work/eplb_round_$round.json" 2>/dev/null
  fi
  "$bench" --dir "$work" --phase time --round "$round"
  echo "round $round of $rounds done"
done
"$bench" --dir "$work" --phase report
