// Build time (`ruvllm web build` runs it): a gzipped heap of Pyodide with a wheels folder installed and
// ruvllm_bridge preloaded, written beside the wheels with the manifest src/python.js checks before restoring it.
//
//   node scripts/python-snapshot.mjs WHEELS_DIR    # writes WHEELS_DIR/python.snapshot.gz, python-snapshot.json

import { writeFileSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { pathToFileURL } from 'node:url';
import { gzipSync } from 'node:zlib';
import { makeShippedSnapshot, SHIPPED_MANIFEST } from '../src/python.js';

const dir = process.argv[2];
if (!dir) {
  console.error('usage: node scripts/python-snapshot.mjs WHEELS_DIR');
  process.exit(2);
}
const { key, heap } = await makeShippedSnapshot(pathToFileURL(resolve(dir) + '/'));
const file = 'python.snapshot.gz';
const gz = gzipSync(heap, { level: 6 });
writeFileSync(join(dir, file), gz);
writeFileSync(join(dir, SHIPPED_MANIFEST), JSON.stringify({ key, file, heap_bytes: heap.length, bytes: gz.length }) + '\n');
console.log(JSON.stringify({ key, file, heap_bytes: heap.length, bytes: gz.length }));
