// The text vLLM serves for a stream of generated ids: its FastIncrementalDetokenizer calls the
// Hugging Face tokenizers library's DecodeStream.step once per id and appends what it returns (None
// adds nothing), and adds nothing when the request finishes. The Node binding has no DecodeStream,
// so step() below is DecodeStream's step (tokenizers/src/tokenizer/mod.rs, step_decode_stream)
// written over the binding's own decode.
// Usage: node decode_stream_oracle.js MODEL_DIR STREAMS.json OUT.json
// STREAMS.json: [{"ids": [...], "skip_special_tokens": bool}, ...]; OUT.json: one list per stream,
// the text each step returned ("" for None).
'use strict';
const fs = require('fs');
const path = require('path');
const { Tokenizer } = require('@anush008/tokenizers');

const utf8Length = (s) => Buffer.byteLength(s, 'utf8');

// DecodeStream keeps the ids since the start of the last text it returned (`ids`), that text's
// decode (`prefix`) and where in `ids` the ids after it begin (`prefixIndex`).
async function step(tokenizer, state, id, skip) {
  state.ids.push(id);
  const string = await tokenizer.decode(state.ids, skip);
  if (utf8Length(string) > utf8Length(state.prefix) && !string.endsWith('\uFFFD')) {
    if (!string.startsWith(state.prefix)) throw new Error('Invalid prefix encountered');
    const text = string.slice(state.prefix.length);
    const newPrefixIndex = state.ids.length - state.prefixIndex;
    state.ids = state.ids.slice(state.prefixIndex);
    state.prefix = await tokenizer.decode(state.ids, skip);
    state.prefixIndex = newPrefixIndex;
    return text;
  }
  return '';
}

async function main() {
  const [modelDir, streamsPath, outPath] = process.argv.slice(2);
  const tokenizer = Tokenizer.fromFile(path.join(modelDir, 'tokenizer.json'));
  const streams = JSON.parse(fs.readFileSync(streamsPath, 'utf8'));
  const result = [];
  for (const { ids, skip_special_tokens: skip } of streams) {
    const state = { ids: [], prefix: '', prefixIndex: 0 };
    const pieces = [];
    for (const id of ids) pieces.push(await step(tokenizer, state, id, skip));
    result.push(pieces);
  }
  fs.writeFileSync(outPath, JSON.stringify(result));
}

main().catch((e) => { console.error(e); process.exit(1); });
