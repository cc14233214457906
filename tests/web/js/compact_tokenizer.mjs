// Driven by tests/web/test_compact_tokenizer.py: npm/src/model.js compactTokenizer (the tokenizer.json form the
// page hands its Python) over each file named, written to OUT_DIR/<i>/tokenizer.json, with the binary tables
// it names beside it when there are any.
//   node compact_tokenizer.mjs NPM_SRC OUT_DIR FILE...
import { mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { pathToFileURL } from 'node:url';

const [src, out, ...files] = process.argv.slice(2);
const { compactTokenizer, TABLES_FILE } = await import(pathToFileURL(`${src}/model.js`).href);
for (const [i, file] of files.entries()) {
  const { json, tables } = compactTokenizer(new Uint8Array(readFileSync(file)));
  mkdirSync(`${out}/${i}`, { recursive: true });
  writeFileSync(`${out}/${i}/tokenizer.json`, json);
  if (tables) writeFileSync(`${out}/${i}/${TABLES_FILE}`, tables);
}
