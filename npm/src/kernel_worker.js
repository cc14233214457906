// One thread of the page's wasm kernels (kernels.js): an instance of the module on the shared memory, its
// own stack, then rk_worker(id), which serves rk_parallel's jobs and never returns (terminate() ends it).

const start = async ({ module, memory, id, stackTop }) => {
  const instance = await WebAssembly.instantiate(module, { env: { memory } });
  instance.exports.__stack_pointer.value = stackTop;
  instance.exports.rk_worker(id);
};

if (typeof self !== 'undefined' && typeof self.postMessage === 'function' && typeof process === 'undefined') {
  self.onmessage = (event) => start(event.data);
} else {
  const { parentPort, workerData } = await import('node:worker_threads');
  parentPort?.postMessage('up');
  start(workerData);
}
