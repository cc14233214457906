// One sequence's forward pass over an exported decoder, fed as export/contract.py writes down
// (and as py_engine/backends/onnx.py feeds it): input_ids, attention_mask, position_ids and the
// past cache in; logits and the present cache out. The present tensors are fed back as the next
// call's past unchanged.

import { tensor } from './ort.js';

export class OnnxBackend {
  /**
   * @param {{ort: any, name: string}} runtime
   * @param {any} session an onnxruntime InferenceSession
   * @param {{num_layers: number, kv_heads: number, head_dim: number, vocab_size: number, kv_dtype: string}} contract
   */
  constructor(runtime, session, contract, { device = 'cpu' } = {}) {
    this.runtime = runtime;
    this.device = device; // 'webgpu': present.* come back as GPU tensors and go in again as past
    this.session = session;
    this.contract = contract;
    this.inputNames = new Set(session.inputNames);
    this.pastNames = session.inputNames.filter((n) => n.startsWith('past_key_values.'));
    this.length = 0;
    this.past = null;
    this.tokens = [];
    // LongRoPE switches to its long factors past this length; like py_engine/backends/onnx.py and transformers,
    // the whole cache is then recomputed with them (the graph picks the factors from the length).
    this.switchLength = null;
  }

  _emptyPast() {
    const { kv_heads: heads, head_dim: dim, kv_dtype: dtype } = this.contract;
    const data = dtype === 'float16' ? new Uint16Array(0) : new Float32Array(0);
    const empty = tensor(this.runtime, dtype, data, [1, heads, 0, dim]);
    return Object.fromEntries(this.pastNames.map((n) => [n, empty]));
  }

  /** @param {number[]} ids @returns {Promise<Float32Array>} the logits after the last id, [V] */
  async _forward(ids) {
    const n = ids.length;
    const total = this.length + n;
    const feeds = { input_ids: tensor(this.runtime, 'int64', BigInt64Array.from(ids, BigInt), [1, n]) };
    if (this.inputNames.has('attention_mask')) {
      feeds.attention_mask = tensor(this.runtime, 'int64', new BigInt64Array(total).fill(1n), [1, total]);
    }
    if (this.inputNames.has('position_ids')) {
      const pos = new BigInt64Array(n);
      for (let i = 0; i < n; i++) pos[i] = BigInt(this.length + i);
      feeds.position_ids = tensor(this.runtime, 'int64', pos, [1, n]);
    }
    Object.assign(feeds, this.past);
    const out = await this.session.run(feeds);
    const previous = this.past;
    this.past = Object.fromEntries(this.pastNames.map((n) => [n, out[n.replace('past_key_values.', 'present.')]]));
    disposeAll(previous);
    this.length = total;
    const logits = out.logits; // [1, n, V]
    const vocab = logits.dims[2];
    const row = logits.data.slice((n - 1) * vocab, n * vocab);
    logits.dispose?.();
    return row;
  }

  /** Start a new sequence from ids; the logits after the last one. */
  async prefill(ids) {
    this.tokens = [...ids];
    disposeAll(this.past);
    this.length = 0;
    this.past = this._emptyPast();
    return this._forward(ids);
  }

  /** One throwaway forward pass at load: onnxruntime's first run allocates and plans (~0.5 s), not the first reply. */
  async warm() {
    await this.prefill([0]);
    this.dispose();
    this.length = 0;
  }

  /** Append one token; the logits after it. */
  async decode(tokenId) {
    this.tokens.push(tokenId);
    if (this.switchLength !== null && this.tokens.length === this.switchLength + 1) return this.prefill(this.tokens);
    return this._forward([tokenId]);
  }

  dispose() {
    disposeAll(this.past);
    this.past = null;
  }
}

function disposeAll(tensors) {
  for (const t of Object.values(tensors ?? {})) t.dispose?.();
}

/** The first index holding the largest value, like numpy.argmax and the reference sampler. */
export function argmax(row) {
  let best = 0;
  let top = row[0];
  for (let i = 1; i < row.length; i++) {
    if (row[i] > top) {
      top = row[i];
      best = i;
    }
  }
  return best;
}
