#!/usr/bin/env bash
# The main job: sets everything up and serves the built-in default model, a `tiny-v3` checkpoint
# (DeepSeek-V3 architecture, random weights, the real DeepSeek-V3 tokenizer and chat template),
# with `tandem engine` (OpenAI-compatible API) on port ${PORT:-8000}. It sends one chat request
# and one streaming completion to show the API working, then keeps serving until Ctrl-C.
# `--once` stops after the demonstration requests. (The gateway joins in a later issue.)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
port="${PORT:-8000}"
"$root/scripts/install-deps.sh"
cmake -S "$root" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$root/build" -j "$(nproc)" --target tandem
model="$root/build/models/tiny-v3"
[ -f "$model/config.json" ] || "$root/build/tandem" make-model --preset tiny-v3 --out "$model"

"$root/build/tandem" engine --model "$model" --served-model-name tiny-v3 --host 127.0.0.1 \
  --port "$port" --kv-cache-gb 0.25 &
engine=$!
trap 'kill $engine 2>/dev/null; wait $engine 2>/dev/null' EXIT
for _ in $(seq 1 120); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
  kill -0 $engine 2>/dev/null || { echo "run: the engine did not start" >&2; exit 1; }
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
echo "== serving tiny-v3 on http://127.0.0.1:$port (OpenAI API: /v1/completions, /v1/chat/completions; /metrics, /load). Ctrl-C stops."
wait $engine
