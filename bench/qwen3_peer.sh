#!/usr/bin/env bash
# Qwen3-MoE next to ik_llama.cpp on the same weights, in one run: Tandem's engine bench
# (tandem-bench-engine on the Hugging Face checkpoint) and the peer's llama-bench (on the same
# weights as a qwen3moe GGUF, run-time repack -rtr 1) alternate for ROUNDS rounds; the script
# prints each round's prefill 512 and batch-1 decode figures, the medians and the ratios.
# Tandem's prefill figure is the best of three runs (the first reads the mapped weights from the
# page cache, where the peer has repacked them at load before timing).
#
# Usage: bench/qwen3_peer.sh MODEL_DIR [BUILD_DIR]
#   MODEL_DIR: a BF16 Qwen3-MoE checkpoint, e.g. `tandem make-model --preset bench-qwen3-moe
#   --layers 4 --out DIR` (Qwen3-30B-A3B's widths; every layer MoE, as qwen3moe GGUFs need).
# Environment: PEER (ik_llama.cpp checkout with build/bin/llama-bench; default
#              ~/.cache/peers/ik_llama.cpp), GGUF_BF16 (MODEL_DIR-bf16.gguf, written by
#              ../shared/tools/hf2gguf_qwen3moe.py), ROUNDS (3), THREADS (2).
# Without the peer (or its GGUF) the script runs Tandem's side alone and says so.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
model="${1:?usage: bench/qwen3_peer.sh MODEL_DIR [BUILD_DIR]}"
model="$(cd "$model" && pwd)"
build="${2:-$root/build}"
peer="${PEER:-$HOME/.cache/peers/ik_llama.cpp}"
gguf="${GGUF_BF16:-$model-bf16.gguf}"
rounds="${ROUNDS:-3}"
threads="${THREADS:-2}"

. "$root/bench/lib.sh"
build_bench_targets "$root" "$build" tandem-bench-engine

find_peer_bench "$peer" ../shared/tools/hf2gguf_qwen3moe.py "$gguf"

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
export OMP_NUM_THREADS="$threads"
for r in $(seq 1 "$rounds"); do
  echo "== round $r/$rounds"
  "$build/bench/tandem-bench-engine" --model "$model" --prompt 512 --decode 32 --prefill-runs 3 \
    >"$out/tandem-$r.txt"
  if [ "$have_peer" = 1 ]; then
    "$bench" -m "$gguf" -p 512 -n 64 -t "$threads" -r 1 -rtr 1 -o json >"$out/peer-$r.json" \
      2>"$out/peer-$r.err"
  fi
done

/usr/bin/python3 - "$out" "$rounds" "$have_peer" <<'PYEOF'
import json, re, statistics, sys
out, rounds, have_peer = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
med = lambda xs: statistics.median(xs) if xs else float("nan")
rows = []
for r in range(1, rounds + 1):
    t = open(f"{out}/tandem-{r}.txt").read()
    pp = float(re.search(r"prefill 512 tokens:\s+([\d.]+) tokens/s", t).group(1))
    tg = float(re.search(r"decode batch 1:\s+([\d.]+) tokens/s", t).group(1))
    bw = float(re.search(r"([\d.]+)% of DRAM read bandwidth", t).group(1))
    row = {"pp": pp, "tg": tg, "bw": bw}
    if have_peer:
        for e in json.load(open(f"{out}/peer-{r}.json")):
            if e["n_prompt"] == 512 and e["n_gen"] == 0:
                row["peer_pp"] = e["avg_ts"]
            if e["n_prompt"] == 0 and e["n_gen"] == 64:
                row["peer_tg"] = e["avg_ts"]
    rows.append(row)
    line = f"round {r}: Tandem prefill 512 {pp:7.1f} tok/s, decode {tg:5.1f} tok/s ({bw:.0f}% of DRAM)"
    if have_peer:
        line += f" | ik_llama.cpp pp512 {row['peer_pp']:7.1f}, tg64 {row['peer_tg']:5.1f}"
        line += f" | ratios {pp / row['peer_pp']:.2f}x, {tg / row['peer_tg']:.2f}x"
    print(line)
print(f"\nmedians of {rounds} alternating rounds: Tandem prefill {med([x['pp'] for x in rows]):.1f} "
      f"tok/s, decode {med([x['tg'] for x in rows]):.1f} tok/s "
      f"({med([x['bw'] for x in rows]):.0f}% of the DRAM read bandwidth measured in the run)")
if have_peer:
    print(f"ik_llama.cpp: pp512 {med([x['peer_pp'] for x in rows]):.1f} tok/s, "
          f"tg64 {med([x['peer_tg'] for x in rows]):.1f} tok/s")
    print(f"ratios (median of per-round ratios): prefill "
          f"{med([x['pp'] / x['peer_pp'] for x in rows]):.2f}x, decode batch 1 "
          f"{med([x['tg'] / x['peer_tg'] for x in rows]):.2f}x")
else:
    print("PEER ABSENT: no ratios.")
PYEOF
