// Reference for transformers' tokenizer.decode(ids), which cleans up tokenization spaces when
// tokenizer_config.json sets clean_up_tokenization_spaces: @lenml/tokenizers, a port of
// transformers.js (itself a port of transformers' tokenizers), loads the model's tokenizer.json and
// tokenizer_config.json and decodes. It defaults the flag to true when the config leaves it out,
// as transformers did before 4.45, so tests use it on configs that set the flag.
// Usage: node transformers_decode_oracle.js MODEL_DIR IDS.json OUT.json
// IDS.json: a list of lists of token ids; OUT.json: their decodes (special tokens kept).
'use strict';
const fs = require('fs');
const path = require('path');
const { TokenizerLoader } = require('@lenml/tokenizers');

const [modelDir, idsPath, outPath] = process.argv.slice(2);
const read = (name) => JSON.parse(fs.readFileSync(path.join(modelDir, name), 'utf8'));
const tokenizer = TokenizerLoader.fromPreTrained({
  tokenizerJSON: read('tokenizer.json'),
  tokenizerConfig: read('tokenizer_config.json'),
});
const lists = JSON.parse(fs.readFileSync(idsPath, 'utf8'));
fs.writeFileSync(outPath, JSON.stringify(lists.map((ids) => tokenizer.decode(ids))));
