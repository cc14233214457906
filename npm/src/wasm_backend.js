// The forward pass on the page's own wasm kernels (kernels.js, web/kernels/engine.c), over a web export's
// data files as they are: the codes and their float16 scales are loaded into the kernels' memory once and
// read in place (float32 copies only of small tensors, or of halves holding an infinity or NaN). Same interface
// as OnnxBackend (prefill / decode / warm / dispose), plus speculative decoding's verify (the logits of every
// fed token, each the bits decode gives) and rollback.

import { loadKernels } from './kernels.js';
import { fetchInto } from './files.js';
import { RuvllmError } from './errors.js';

const PROJS = ['qkv', 'o', 'gate_up', 'down'];
export const MAX_VERIFY_ROWS = 17; // 1 + py_engine.speculative's MAX_SPECULATIVE_TOKENS (engine.c's MAX_ROWS, 24, must stay >= it)

export class WasmBackend {
  /**
   * @param {URL} base the export folder
   * @param {{file: string, engine: object}} graph the contract's web graph entry (its `engine` says where
   *   each weight is; export/web_engine.py)
   */
  static async load(base, graph, { onProgress, threads, kernelsURL, cache = true, mark = () => {} } = {}) {
    const kernels = await loadKernels({ threads, kernelsURL });
    mark('kernels');
    try {
      const e = graph.engine;
      const dir = new URL('.', new URL(graph.file, base));
      const regions = [];
      for (const name of e.files) {
        const label = `${graph.file.replace(/[^/]*$/, '')}${name}`;
        const alloc = Object.assign((n) => kernels.alloc(n), { view: (at, n) => kernels.bytes(at, n) });
        regions.push(await fetchInto(new URL(name, dir), alloc, { onProgress, cache, label }));
      }
      mark('download');
      return new WasmBackend(kernels, setUp(kernels, e, regions));
    } catch (error) {
      kernels.dispose();
      throw error;
    }
  }

  constructor(kernels, config) {
    this.kernels = kernels;
    this.config = config;
    this.ids = kernels.alloc(4 * config.max_pos);
    this.rows = 0; // verify's logits buffer [MAX_VERIFY_ROWS, vocab], allocated on the first verify
    this.length = 0;
    this.tokens = [];
    this.switchLength = null;
  }

  get runtimeName() {
    return `ruvllm-wasm (${this.kernels.relaxed ? 'relaxed SIMD' : 'SIMD128'}, ${this.kernels.threads} threads)`;
  }

  _forward(ids, all = false) {
    const { exports, memory } = this.kernels;
    const { vocab, max_pos: maxPos } = this.config;
    if (this.length + ids.length > maxPos) {
      throw new RuvllmError(`the sequence would reach ${this.length + ids.length} tokens; the model takes ${maxPos}`);
    }
    new Int32Array(memory.buffer, this.ids, ids.length).set(ids);
    const rc = all ? exports.rk_forward_rows(this.ids, ids.length, this.length, this.rows)
      : exports.rk_forward(this.ids, ids.length, this.length);
    if (rc === -1) throw new RangeError('out of wasm memory for the KV cache');
    if (rc !== 0) throw new RuvllmError(`the wasm kernels refused the step (${rc})`);
    this.length += ids.length;
    return new Float32Array(memory.buffer, all ? this.rows : exports.rk_logits(), all ? ids.length * vocab : vocab)
      .slice();
  }

  async prefill(ids) {
    this.tokens = [...ids];
    this.length = 0;
    return this._forward(ids);
  }

  async decode(tokenId) {
    this.tokens.push(tokenId);
    return this._forward([tokenId]);
  }

  /**
   * Speculative decoding's verify pass: append ids (the last kept token and the drafts after it) in one pass.
   * @returns {Promise<Float32Array>} [ids.length, V]: row i the logits after ids[i], the bits decode(ids[i]) gives
   */
  async verify(ids) {
    if (ids.length > MAX_VERIFY_ROWS) throw new RuvllmError(`verify takes at most ${MAX_VERIFY_ROWS} tokens`);
    if (!this.rows) this.rows = this.kernels.alloc(4 * MAX_VERIFY_ROWS * this.config.vocab);
    this.tokens.push(...ids);
    return this._forward(ids, true);
  }

  /** Forget the last n tokens (rejected drafts): the next pass writes their cache positions over. */
  rollback(n) {
    if (!(n >= 0 && n <= this.length)) throw new RuvllmError(`cannot roll back ${n} of ${this.length} tokens`);
    this.length -= n;
    this.tokens.length -= n;
  }

  /** One throwaway step at load, so the first reply does not pay for first-touch pages. */
  async warm() {
    await this.prefill([0]);
    this.length = 0;
  }

  dispose() {
    this.length = 0;
  }

  release() {
    this.kernels.dispose();
  }
}

/** Hand the kernels each weight's place; float16 norms and biases are widened into float32 copies. */
function setUp(kernels, e, regions) {
  const x = kernels.exports;
  const c = e.config;
  const place = (name) => {
    const [file, offset, length, dtype] = e.tensors[name];
    return { at: regions[file] + offset, length, dtype };
  };
  const f32 = (name) => {
    if (!name) return 0;
    const t = place(name);
    if (t.dtype === 'float32') return t.at;
    if (t.dtype !== 'float16') throw new RuvllmError(`${name}: ${t.dtype} where the kernels read floats`);
    const out = kernels.alloc(t.length * 2);
    x.rk_f16_to_f32(t.at, out, t.length / 2);
    return out;
  };
  const copy = (name) => { // a float32 copy of its own (the minimums are centred in place)
    const t = place(name);
    const n = t.length / (t.dtype === 'float16' ? 2 : 4);
    const out = kernels.alloc(4 * n);
    if (t.dtype === 'float16') x.rk_f16_to_f32(t.at, out, n);
    else kernels.bytes(out, 4 * n).set(kernels.bytes(t.at, 4 * n));
    return [out, n];
  };
  // float16 scales and minimums (a GGUF's) stay as the file has them: the kernels widen them as they read
  // (qdot.h), so the tab holds them once at 2 bytes, not again as float32 copies
  const halves = (...names) => names.every((name) => {
    if (!name) return true;
    const t = place(name);
    return t.dtype === 'float16' && x.rk_halves_finite(t.at, t.length / 2);
  });
  const proj = (layer, which, p) => {
    if (halves(p.scales, p.mins)) {
      const mins = p.mins ? place(p.mins).at : 0;
      x.rk_set_proj(layer, which, place(p.codes).at, place(p.scales).at, mins, f32(p.bias), p.bits, p.N, p.K, 1);
      return;
    }
    const scales = f32(p.scales);
    let mins = 0;
    if (p.mins) { // m + zp d, as the graph folds it (export/web_weights.py centred_mins)
      const [at, n] = copy(p.mins);
      x.rk_centre_mins(at, scales, n, p.bits);
      mins = at;
    }
    x.rk_set_proj(layer, which, place(p.codes).at, scales, mins, f32(p.bias), p.bits, p.N, p.K, 0);
  };
  if (!x.rk_model_init(c.hidden, c.heads, c.kv_heads, c.head_dim, c.inter, c.layers, c.vocab, c.max_pos, c.eps,
    c.scale)) throw new RangeError('out of wasm memory for the model\'s buffers');
  e.layers.forEach((l, i) => {
    PROJS.forEach((name, which) => proj(i, which, l[name]));
    x.rk_set_norms(i, f32(l.attn_norm), f32(l.mlp_norm));
  });
  proj(-1, 0, e.embed);
  if (e.head !== 'tied') proj(-1, 1, e.head);
  x.rk_set_tables(f32(e.norm), f32(e.rope.cos), f32(e.rope.sin), e.head === 'tied' ? 1 : 0);
  return c;
}
