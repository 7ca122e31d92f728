// Builds the tokenizer benchmark corpus: JSON lines, one document each, about SIZE_MB in all.
// Half is real text that every Debian machine with python3 has (the Python standard library:
// code, comments, docstrings); half is multilingual prose assembled deterministically from the
// conformance corpus fragments (Chinese, Japanese, Korean, Arabic, Cyrillic, emoji, digits...).
// Usage: node make_text_corpus.js OUT.jsonl [SIZE_MB]
'use strict';
const fs = require('fs');
const path = require('path');
const { makeCorpus } = require('../tests/oracle/corpus');

const [out, sizeArg] = process.argv.slice(2);
const target = Number(sizeArg || 12) * 1024 * 1024;
const docs = [];
let bytes = 0;

const libs = fs.readdirSync('/usr/lib').filter((d) => /^python3\.\d+$/.test(d)).sort();
if (libs.length === 0) throw new Error('no /usr/lib/python3.N (install python3)');
const lib = path.join('/usr/lib', libs[libs.length - 1]);
const files = [];
(function walk(dir) {
  for (const e of fs.readdirSync(dir, { withFileTypes: true }).sort((a, b) => a.name.localeCompare(b.name))) {
    const p = path.join(dir, e.name);
    if (e.isDirectory() && !['site-packages', 'dist-packages', 'test', 'tests', '__pycache__'].includes(e.name)) walk(p);
    else if (e.isFile() && e.name.endsWith('.py')) files.push(p);
  }
})(lib);
for (const f of files) {
  if (bytes >= target / 2) break;
  const text = fs.readFileSync(f, 'utf8');
  for (let i = 0; i < text.length; i += 16384) {
    const d = text.slice(i, i + 16384);
    docs.push(d);
    bytes += Buffer.byteLength(d);
  }
}

// Multilingual prose: join conformance strings into ~16 KB documents.
let doc = '';
let seed = 1;
while (bytes < target) {
  for (const s of makeCorpus(400, ['<|endoftext|>'], seed++).slice(60)) {
    doc += s + (s.length % 3 === 0 ? '\n' : ' ');
    if (doc.length > 8192) {
      docs.push(doc);
      bytes += Buffer.byteLength(doc);
      doc = '';
    }
  }
}
fs.writeFileSync(out, docs.map((d) => JSON.stringify(d)).join('\n') + '\n');
console.error(`corpus: ${docs.length} documents, ${(bytes / 1048576).toFixed(1)} MiB`);
