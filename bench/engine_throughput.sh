#!/usr/bin/env bash
# CPU engine benchmark: writes the `bench` preset (V2-Lite widths, ~3.6 GB BF16 / ~2.3 GB INT8)
# once into BUILD_DIR/models, then measures prefill (512 tokens) and decode (batch 1 and 16)
# against this machine's peaks measured in the same run.
# Usage: bench/engine_throughput.sh [BUILD_DIR]   (after scripts/test.sh or a build)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
for dtype in bf16 int8; do
  dir="$build/models/bench-$dtype"
  [ -f "$dir/config.json" ] || "$build/tandem" make-model --preset bench --dtype "$dtype" --out "$dir"
done
"$build/bench/tandem-bench-engine" --model "$build/models/bench-bf16" --model "$build/models/bench-int8"
