#!/usr/bin/env bash
# The main job: sets everything up and runs the whole serving stack on the built-in default
# model with one command, `tandem serve`: a gateway on port ${PORT:-8080} in front of one
# prefill and one decode engine (P/D disaggregated, KV handed over layer by layer, KV events
# feeding the gateway's prefix index), each a child process; its live dashboard is at
# /dashboard. With no --model, serve uses `tiny-v3` (DeepSeek-V3 architecture, random weights, the
# real DeepSeek-V3 tokenizer and chat template), written to ~/.cache/tandem on first use. It
# sends one chat request and one streaming completion through the gateway to show it working,
# then keeps serving until Ctrl-C. `--once` stops after the demonstration requests.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
port="${PORT:-8080}"
"$root/scripts/install-deps.sh"
cmake -S "$root" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$root/build" -j "$(nproc)" --target tandem

"$root/build/tandem" serve --host 127.0.0.1 --port "$port" --access-log "$root/build/access.jsonl" \
  --kv-events --engine-arg=--kv-cache-gb --engine-arg=0.25 &
stack=$!
trap 'kill $stack 2>/dev/null; wait $stack 2>/dev/null' EXIT
for _ in $(seq 1 240); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
  kill -0 $stack 2>/dev/null || { echo "run: tandem serve did not start" >&2; exit 1; }
  sleep 0.5
done

echo "== POST /v1/chat/completions (examples/chat.json, greedy, 32 tokens)"
body="$(python3 -c 'import json,sys; print(json.dumps({"model": "tiny-v3", "messages": json.load(open(sys.argv[1])), "max_tokens": 32, "temperature": 0}))' "$root/examples/chat.json")"
curl -sS "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' -d "$body"
echo
echo "== POST /v1/completions, streaming"
curl -sSN "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "tiny-v3", "prompt": "Tandem serves DeepSeek-V3", "max_tokens": 8, "stream": true, "seed": 1}'
echo
[ "${1:-}" = "--once" ] && exit 0
echo "== serving tiny-v3 on http://127.0.0.1:$port (gateway: /v1/completions, /v1/chat/completions, /v1/models, /metrics; live dashboard: http://127.0.0.1:$port/dashboard). Ctrl-C stops."
wait $stack
