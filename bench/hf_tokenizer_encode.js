// Reference side of the tokenizer benchmark: encodes every document of a JSONL corpus with the
// native Hugging Face tokenizers binding, one call at a time, and writes the ids (int32, each
// document's ids preceded by their count) so the caller can check that both sides agree.
// Prints {"seconds": S, "tokens": N}; only the encode calls are timed.
// Usage: node hf_tokenizer_encode.js MODEL_DIR CORPUS.jsonl OUT_IDS.bin
'use strict';
const fs = require('fs');
const path = require('path');
// The binding is installed with the test oracles (tests/oracle, pinned by its lock file).
const { Tokenizer } = require(require.resolve('@anush008/tokenizers', { paths: [path.join(__dirname, '..', 'tests', 'oracle')] }));

async function main() {
  const [modelDir, corpus, outIds] = process.argv.slice(2);
  const tokenizer = Tokenizer.fromFile(path.join(modelDir, 'tokenizer.json'));
  const docs = fs.readFileSync(corpus, 'utf8').split('\n').filter((l) => l.length).map((l) => JSON.parse(l));
  await tokenizer.encode('warm up', null, { addSpecialTokens: false });
  const chunks = [];
  let tokens = 0;
  let seconds = 0;
  for (const d of docs) {
    const t0 = process.hrtime.bigint();
    const enc = await tokenizer.encode(d, null, { addSpecialTokens: false });
    const ids = enc.getIds();
    seconds += Number(process.hrtime.bigint() - t0) / 1e9;
    tokens += ids.length;
    chunks.push(Int32Array.of(ids.length), Int32Array.from(ids));
  }
  const total = chunks.reduce((n, c) => n + c.length, 0);
  const all = new Int32Array(total);
  let at = 0;
  for (const c of chunks) { all.set(c, at); at += c.length; }
  fs.writeFileSync(outIds, Buffer.from(all.buffer));
  console.log(JSON.stringify({ seconds, tokens }));
}
main().catch((e) => { console.error(e); process.exit(1); });
