// Reference tokenization by the native Hugging Face tokenizers binding.
// Usage: node tokenizer_oracle.js MODEL_DIR COUNT OUT.json [STRINGS.json]
// Writes {strings, ids_plain, ids_special, decoded, decoded_skip}: the strings of STRINGS.json (a
// JSON list, for the cases a variant is about) first, then COUNT strings of the corpus. Loads tokenizer.json as the
// Rust library does and applies tokenizer_config.json the way transformers does on load.
'use strict';
const fs = require('fs');
const path = require('path');
const { Tokenizer } = require('@anush008/tokenizers');
const { makeCorpus } = require('./corpus');

const llamaStyle = new Set(['LlamaTokenizerFast', 'LlamaTokenizer', 'CodeLlamaTokenizerFast', 'GemmaTokenizerFast']);

function content(t) {
  if (t == null) return null;
  return typeof t === 'string' ? t : t.content;
}

// transformers' LlamaTokenizerFast.update_post_processor: a TemplateProcessing built from
// add_bos_token / add_eos_token replaces the post-processor of tokenizer.json.
function applyConfig(tok, cfg) {
  if (!llamaStyle.has(cfg.tokenizer_class)) return tok;
  const addBos = cfg.add_bos_token ?? true, addEos = cfg.add_eos_token ?? false;
  const bos = content(cfg.bos_token), eos = content(cfg.eos_token);
  const idOf = (t) => tok.added_tokens.find((a) => a.content === t)?.id ?? tok.model.vocab[t];
  const single = [], special = {};
  if (addBos) { single.push({ SpecialToken: { id: bos, type_id: 0 } }); special[bos] = { id: bos, ids: [idOf(bos)], tokens: [bos] }; }
  single.push({ Sequence: { id: 'A', type_id: 0 } });
  if (addEos) { single.push({ SpecialToken: { id: eos, type_id: 0 } }); special[eos] = { id: eos, ids: [idOf(eos)], tokens: [eos] }; }
  const pair = [...single, ...single.map((x) => (x.Sequence ? { Sequence: { id: 'B', type_id: 1 } } : { SpecialToken: { id: x.SpecialToken.id, type_id: 1 } }))];
  tok.post_processor = { type: 'TemplateProcessing', single, pair, special_tokens: special };
  return tok;
}

async function main() {
  const [modelDir, countArg, outPath, stringsPath] = process.argv.slice(2);
  const tokJson = JSON.parse(fs.readFileSync(path.join(modelDir, 'tokenizer.json'), 'utf8'));
  const cfgPath = path.join(modelDir, 'tokenizer_config.json');
  const cfg = fs.existsSync(cfgPath) ? JSON.parse(fs.readFileSync(cfgPath, 'utf8')) : {};
  const tokenizer = Tokenizer.fromString(JSON.stringify(applyConfig(tokJson, cfg)));
  const specials = tokJson.added_tokens.map((a) => a.content);
  const given = stringsPath ? JSON.parse(fs.readFileSync(stringsPath, 'utf8')) : [];
  const strings = [...given, ...makeCorpus(Number(countArg), specials)];
  const result = { strings, ids_plain: [], ids_special: [], decoded: [], decoded_skip: [] };
  for (const s of strings) {
    const plain = (await tokenizer.encode(s, null, { addSpecialTokens: false })).getIds();
    const special = (await tokenizer.encode(s, null, { addSpecialTokens: true })).getIds();
    result.ids_plain.push(Array.from(plain));
    result.ids_special.push(Array.from(special));
    result.decoded.push(await tokenizer.decode(Array.from(special), false));
    result.decoded_skip.push(await tokenizer.decode(Array.from(special), true));
  }
  fs.writeFileSync(outPath, JSON.stringify(result));
}

main().catch((e) => { console.error(e); process.exit(1); });
