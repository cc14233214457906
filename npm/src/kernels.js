// The page's own kernels (web/kernels: C compiled to wasm SIMD128 + threads): loading the module, its
// shared memory and its threads. The relaxed-SIMD build (i8 dot products) runs where the engine validates
// it (Chrome 114+, Node 21+), the plain SIMD128 build elsewhere.

import { IS_NODE } from './ort.js';
import { readBytes } from './files.js';
import { UnsupportedRuntimeError } from './errors.js';

const KERNELS = { relaxed: new URL('./kernels/rkw-relaxed.wasm', import.meta.url),
  plain: new URL('./kernels/rkw.wasm', import.meta.url) };
const WORKER_URL = new URL('./kernel_worker.js', import.meta.url);
const STACK = 256 << 10; // each worker's stack
const MAX_PAGES = 65535; // the module's maximum (4 GiB less one page)
// (module (func (result v128) v128.const i32x4 0 0 0 0 v128.const i32x4 0 0 0 0 v128.const i32x4 0 0 0 0
//   i32x4.relaxed_dot_i8x16_i7x16_add_s))
const RELAXED_PROBE = new Uint8Array([0, 97, 115, 109, 1, 0, 0, 0, 1, 5, 1, 96, 0, 1, 123, 3, 2, 1, 0, 10, 61, 1,
  59, 0, 253, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 253, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
  0, 0, 0, 253, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 253, 147, 2, 11]);

/** Whether this JavaScript engine can run the kernels at all (wasm SIMD and shared memory). */
export function kernelsSupported() {
  try {
    new WebAssembly.Memory({ initial: 1, maximum: 1, shared: true });
    return typeof SharedArrayBuffer !== 'undefined';
  } catch {
    return false;
  }
}

export function relaxedSimd() {
  try {
    return WebAssembly.validate(RELAXED_PROBE);
  } catch {
    return false;
  }
}

/**
 * @param {{threads?: number, kernelsURL?: string}} [options] kernelsURL: a folder holding rkw*.wasm
 * @returns {Promise<Kernels>}
 */
export async function loadKernels(options = {}) {
  if (!kernelsSupported()) {
    throw new UnsupportedRuntimeError('ruvllm\'s wasm kernels need shared memory: serve the page cross-origin ' +
      'isolated (COOP/COEP headers)');
  }
  const relaxed = relaxedSimd();
  const name = relaxed ? 'rkw-relaxed.wasm' : 'rkw.wasm';
  const url = options.kernelsURL ? new URL(name, absolute(options.kernelsURL)) : KERNELS[relaxed ? 'relaxed' : 'plain'];
  const module = await WebAssembly.compile(await readBytes(url));
  const memory = new WebAssembly.Memory({ initial: 32, maximum: MAX_PAGES, shared: true });
  const { exports } = await WebAssembly.instantiate(module, { env: { memory } });
  const cores = globalThis.navigator?.hardwareConcurrency ?? 2;
  const threads = Math.max(1, Math.min(options.threads ?? Math.min(4, cores), 16));
  const kernels = new Kernels(exports, memory, relaxed);
  await kernels._startWorkers(module, threads);
  return kernels;
}

export class Kernels {
  constructor(exports, memory, relaxed) {
    this.exports = exports;
    this.memory = memory;
    this.relaxed = relaxed;
    this.workers = [];
    this.threads = 1;
  }

  async _startWorkers(module, threads) {
    const { exports, memory } = this;
    for (let id = 1; id < threads; id++) {
      const stack = this.alloc(STACK);
      const data = { module, memory, id, stackTop: stack + STACK };
      if (IS_NODE) {
        const { Worker } = await import('node:worker_threads');
        const worker = new Worker(new URL(WORKER_URL), { workerData: data });
        worker.unref();
        this.workers.push(worker);
      } else {
        const worker = new Worker(WORKER_URL, { type: 'module' });
        worker.postMessage(data);
        this.workers.push(worker);
      }
    }
    const deadline = performance.now() + 30_000;
    while (exports.rk_workers_started() < threads - 1) {
      if (performance.now() > deadline) throw new UnsupportedRuntimeError('the wasm kernels\' threads did not start');
      await new Promise((resolve) => setTimeout(resolve, 2));
    }
    exports.rk_set_threads(threads);
    exports.rk_set_caller_waits(threads > 1 && canBlock() ? 1 : 0);
    this.threads = threads;
  }

  /** `bytes` of the module's memory, 64-byte aligned; throws when wasm's 4 GiB is full. */
  alloc(bytes) {
    const at = this.exports.rk_alloc(bytes);
    if (!at) throw new RangeError(`out of wasm memory allocating ${bytes} bytes`);
    return at;
  }

  bytes(at, length) {
    return new Uint8Array(this.memory.buffer, at, length);
  }

  dispose() {
    for (const w of this.workers) w.terminate();
    this.workers = [];
  }
}

/** Whether this thread may block on a futex (a Worker, Node): then rk_parallel's caller sleeps while a preempted
 * thread finishes its chunk, instead of spinning on the core it needs. A page's main thread may not. */
function canBlock() {
  try {
    Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 1, 0);
    return true;
  } catch {
    return false;
  }
}

function absolute(url) {
  const u = new URL(String(url), globalThis.location?.href);
  if (!u.pathname.endsWith('/')) u.pathname += '/';
  return u;
}
