// Driven by tests/web/test_compact_tokenizer.py: npm/src/model.js compactTokenizer (the tokenizer.json form the
// page hands its Python) over each file named, written beside it as <name>.compact.json.
//   node compact_tokenizer.mjs NPM_SRC OUT_DIR FILE...
import { readFileSync, writeFileSync } from 'node:fs';
import { basename } from 'node:path';
import { pathToFileURL } from 'node:url';

const [src, out, ...files] = process.argv.slice(2);
const { compactTokenizer } = await import(pathToFileURL(`${src}/model.js`).href);
for (const [i, file] of files.entries()) {
  writeFileSync(`${out}/${i}-${basename(file)}.compact.json`, compactTokenizer(new Uint8Array(readFileSync(file))));
}
