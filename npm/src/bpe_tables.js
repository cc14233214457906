// A BPE tokenizer.json's vocabulary and merges as one binary file of int32 arrays, for the page's Python.
//
// Pyodide's heap never shrinks, and a 49k-token vocabulary parsed into Python (49k token strings, 49k merge
// strings, a token -> id dict and a merge -> rank dict: ~7 MiB for SmolLM2) was past the ~3.3 MiB a
// restored heap has free, so it grew the heap by 20% (30 -> 36 MiB) for good. Built here, in JS (its heap is
// collected), the same tables are ~2 MiB of one bytes object in Python, never a Python object per token.
// py_engine/tokenizer/tables.py reads it; the layout is its docstring's, little-endian:
//   header, 8 int32: "RBPE", version 1, n_tokens, n_merges, token_bits, pair_bits, blob_len, 0
//   offsets[n_tokens + 1]         token i = blob[offsets[i] .. offsets[i + 1]) in UTF-8
//   token_slots[1 << token_bits]  an id or -1: open addressing from crc32(UTF-8) & mask, linear probing
//   merges[3 * n_merges]          (left id, right id, merged id) in rank order
//   pair_slots[1 << pair_bits]    a rank or -1: from (left * P1 ^ right * P2) mod 2^32 >>> (32 - pair_bits)
//   blob[blob_len]

export const TABLES_FILE = 'tokenizer.bpe';
const MAGIC = 0x45504252; // "RBPE" read as a little-endian int32
const VERSION = 1;
const HEADER_WORDS = 8;
const P1 = 0x9e3779b1;
const P2 = 0x85ebca77;
const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;

const LITTLE_ENDIAN = new Uint8Array(Int32Array.of(1).buffer)[0] === 1;
let CRC_TABLE = null;

/** zlib's CRC-32 (Python's zlib.crc32) of bytes[start, end). */
export function crc32(bytes, start = 0, end = bytes.length) {
  if (!CRC_TABLE) {
    CRC_TABLE = new Int32Array(256);
    for (let n = 0; n < 256; n++) {
      let c = n;
      for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
      CRC_TABLE[n] = c;
    }
  }
  let c = -1;
  for (let i = start; i < end; i++) c = CRC_TABLE[(c ^ bytes[i]) & 0xff] ^ (c >>> 8);
  return (c ^ -1) >>> 0;
}

/** The slot a merge's (left, right) ids hash to in a table of 1 << bits slots. */
export function pairSlot(left, right, bits) {
  return ((Math.imul(left, P1) ^ Math.imul(right, P2)) >>> 0) >>> (32 - bits);
}

/** Bits of a power-of-two table at most half full (at least 16 slots). */
function tableBits(n) {
  let bits = 4;
  while ((1 << bits) < 2 * n) bits++;
  return bits;
}

/**
 * The binary tables of a BPE model spec whose vocabulary lists the tokens in id order (ids 0 .. n - 1), or
 * null where they cannot say the same as the JSON: a token that is not well-formed UTF-16, a merge that is
 * not two tokens of the vocabulary, or one whose merged token is not in it (Python then reads the JSON and
 * reports what it finds).
 * @param {string[]} tokens the vocabulary in id order
 * @param {Object<string, number>} vocab token -> id, the inverse of tokens (tokenizer.json's own object)
 * @param {Array<string|string[]>} merges "a b" strings or [a, b] pairs, in rank order
 * @param {string} prefix continuing_subword_prefix ('' when none)
 * @returns {Uint8Array|null}
 */
export function bpeTables(tokens, vocab, merges, prefix = '') {
  const n = tokens.length;
  let units = 0;
  for (let i = 0; i < n; i++) {
    const token = tokens[i];
    if (typeof token !== 'string' || (/[\uD800-\uDFFF]/.test(token) && LONE_SURROGATE.test(token))) return null;
    units += token.length;
  }
  const idOf = (token) => { // an own property: "constructor" or "__proto__" only where the vocabulary has them
    const id = vocab[token];
    return Number.isInteger(id) && tokens[id] === token ? id : undefined;
  };
  const m = merges.length;
  const merged = new Int32Array(3 * m);
  for (let r = 0; r < m; r++) {
    const merge = merges[r];
    let a;
    let b;
    if (typeof merge === 'string') {
      const space = merge.indexOf(' ');
      if (space < 0 || merge.indexOf(' ', space + 1) >= 0) return null;
      a = merge.slice(0, space);
      b = merge.slice(space + 1);
    } else if (Array.isArray(merge) && merge.length === 2) {
      [a, b] = merge;
    } else {
      return null;
    }
    if (typeof a !== 'string' || typeof b !== 'string') return null;
    const left = idOf(a);
    const right = idOf(b);
    const both = idOf(a + (prefix && b.startsWith(prefix) ? b.slice(prefix.length) : b)); // bpe.py's _merge
    if (left === undefined || right === undefined || both === undefined) return null;
    merged[3 * r] = left;
    merged[3 * r + 1] = right;
    merged[3 * r + 2] = both;
  }
  // UTF-8 of every token into one scratch buffer (at most 3 bytes per UTF-16 unit), offsets as they go.
  const scratch = new Uint8Array(3 * units);
  const offsets = new Int32Array(n + 1);
  const encoder = new TextEncoder();
  for (let i = 0, at = 0; i < n; i++) {
    at += encoder.encodeInto(tokens[i], scratch.subarray(at)).written;
    offsets[i + 1] = at;
  }
  const blobLen = offsets[n];
  const tokenSlots = new Int32Array(1 << tableBits(n)).fill(-1);
  const tokenMask = tokenSlots.length - 1;
  for (let i = 0; i < n; i++) {
    let slot = crc32(scratch, offsets[i], offsets[i + 1]) & tokenMask;
    while (tokenSlots[slot] !== -1) slot = (slot + 1) & tokenMask; // ids are distinct tokens
    tokenSlots[slot] = i;
  }
  const pairBits = tableBits(m);
  const pairSlots = new Int32Array(1 << pairBits).fill(-1);
  const pairMask = pairSlots.length - 1;
  for (let r = 0; r < m; r++) {
    const left = merged[3 * r];
    const right = merged[3 * r + 1];
    let slot = pairSlot(left, right, pairBits);
    for (;;) {
      const rank = pairSlots[slot];
      if (rank === -1 || (merged[3 * rank] === left && merged[3 * rank + 1] === right)) break;
      slot = (slot + 1) & pairMask;
    }
    pairSlots[slot] = r; // a later duplicate takes the pair's rank, as in tokenizers' HashMap
  }
  const header = Int32Array.of(MAGIC, VERSION, n, m, Math.log2(tokenSlots.length), pairBits, blobLen, 0);
  const parts = [header, offsets, tokenSlots, merged, pairSlots];
  const words = parts.reduce((sum, part) => sum + part.length, 0);
  const out = new Uint8Array(4 * words + blobLen);
  const view = new DataView(out.buffer);
  let at = 0;
  for (const part of parts) {
    if (LITTLE_ENDIAN) {
      new Int32Array(out.buffer, at, part.length).set(part);
    } else {
      for (let i = 0; i < part.length; i++) view.setInt32(at + 4 * i, part[i], true);
    }
    at += 4 * part.length;
  }
  out.set(scratch.subarray(0, blobLen), at);
  return out;
}
