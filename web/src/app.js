// The demo page: a chat over ruvllm's engine in a Web Worker, or over the server's /v1/chat/completions.
import { clearModelCache, createEngine } from './ruvllm/index.js';

const $ = (id) => document.getElementById(id);
const here = (path) => new URL(path, location.href).href;
const state = { engine: null, history: [], controller: null, busy: false, lastRun: null, loads: 0 };
window.ruvllmDemo = state; // for tests and the console

function showError(error) {
  const box = $('error');
  box.textContent = error ? `${error.name ?? 'Error'}: ${error.message ?? error}` : '';
  box.hidden = !error;
  if (error) setStatus('error');
}

function setStatus(text) {
  $('status').textContent = text;
  document.body.dataset.status = text;
}

function checkBrowser() {
  const missing = ['WebAssembly', 'Worker', 'fetch', 'ReadableStream'].filter((name) => !(name in globalThis));
  if (missing.length) throw Object.assign(new Error(`this browser lacks ${missing.join(', ')}; use a current Chrome, ` +
    'Edge, Firefox or Safari'), { name: 'UnsupportedRuntimeError' });
  $('isolation').textContent = crossOriginIsolated ? 'wasm threads on' : 'single-threaded (page not cross-origin isolated)';
}

async function fillModels() {
  const res = await fetch('models/index.json');
  const models = res.ok ? await res.json() : [];
  for (const m of models) $('model').append(new Option(m.name, m.url));
  if (!models.length) $('model').append(new Option('(none built: ruvllm web build)', ''));
}

function progressRow(p) {
  const id = `file-${p.file.replace(/[^\w]/g, '_')}`;
  let row = document.getElementById(id);
  if (!row) {
    row = document.createElement('div');
    row.id = id;
    row.className = 'file';
    row.innerHTML = '<span></span><progress max="1" value="0"></progress>';
    $('progress').append(row);
  }
  const mb = (n) => (n / 1e6).toFixed(2);
  const total = p.total ? `${mb(p.total)} MB` : '? MB';
  row.querySelector('span').textContent = `${p.file}: ${mb(p.loaded)} / ${total}${p.cached ? ' (cache)' : ''}`;
  row.querySelector('progress').value = p.total ? p.loaded / p.total : 0;
}

// The status while loading: files still downloading say so, whatever else has started meanwhile.
function loadProgress(p, pending) {
  if (p.stage === 'download') {
    progressRow(p);
    if (p.total && p.loaded >= p.total) pending.delete(p.file); else pending.add(p.file); // total 0: not known yet
  }
  setStatus(pending.size ? 'downloading' : p.stage === 'boot' ? 'starting Python' : 'loading');
}

async function loadModel() {
  const url = $('model-url').value.trim() || $('model').value;
  if (!url) return showError(new Error('choose a model or type the URL of an exported model folder'));
  showError(null);
  $('send').disabled = true;
  $('progress').textContent = '';
  $('loadtime').textContent = '-'; // not the previous model's
  await state.engine?.dispose();
  state.engine = null;
  setStatus('loading');
  const started = performance.now();
  const pending = new Set(); // files still downloading
  try {
    state.engine = await createEngine({
      model: here(url), worker: true, precision: $('precision').value, modelName: url,
      device: $('device-choice').value,
      // prompt lookup on the wasm kernels; each request turns it on or off (the toggle), which changes no output
      speculative: { method: 'ngram' },
      pyodideURL: here('pyodide/'), wasmPaths: here('ort/'), ortURL: here('ort/ort.wasm.min.mjs'),
      ortWebgpuURL: here('ort/ort.webgpu.min.mjs'),
      wheelsURL: here('wheels/'), workerURL: here('ruvllm/worker.js'),
      onProgress: (p) => loadProgress(p, pending),
    });
    state.loads += 1;
    state.loadMs = performance.now() - started;
    state.readyMs = performance.now(); // since navigation start: how soon the page is usable
    $('loadtime').textContent = `${(state.loadMs / 1000).toFixed(1)} s`;
    $('device').textContent = state.engine.stats.runtime;
    document.body.dataset.device = state.engine.stats.device;
    setStatus('ready');
    $('send').disabled = false;
  } catch (error) {
    showError(error);
  }
}

function addMessage(role, text = '') {
  const div = document.createElement('div');
  div.className = `msg ${role}`;
  div.innerHTML = '<span class="who"></span><span class="text"></span>';
  div.querySelector('.who').textContent = role;
  div.querySelector('.text').textContent = text;
  $('log').append(div);
  return div.querySelector('.text');
}

function request(messages) {
  const num = (id) => Number($(id).value);
  return { messages, stream: true, temperature: num('temperature'), top_p: num('top_p'), max_tokens: num('max_tokens'),
    return_token_ids: true, speculative: $('speculative').checked };
}

async function* serverChunks(body, signal) {
  const models = await (await fetch('/v1/models', { signal })).json();
  const res = await fetch('/v1/chat/completions', { method: 'POST', signal, headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ ...body, model: models.data?.[0]?.id, return_token_ids: undefined }) });
  if (!res.ok) throw new Error(`server: HTTP ${res.status} ${(await res.text()).slice(0, 300)}`);
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = '';
  for (;;) {
    const { done, value } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf('\n\n')) >= 0) {
      const event = buffer.slice(0, cut).replace(/^data: ?/, '');
      buffer = buffer.slice(cut + 2);
      if (event === '[DONE]') return;
      if (event) yield JSON.parse(event);
    }
  }
}

async function send(text) {
  if (state.busy || !text.trim()) return;
  const system = $('system').value.trim();
  state.history.push({ role: 'user', content: text });
  addMessage('user', text);
  const out = addMessage('assistant');
  const messages = [...(system ? [{ role: 'system', content: system }] : []), ...state.history];
  const onServer = $('target').value === 'server';
  state.busy = true;
  state.controller = new AbortController();
  $('send').disabled = true;
  $('stop').disabled = false;
  setStatus('generating');
  const run = { target: onServer ? 'server' : 'browser', tokens: 0, text: '', finish: null, started: performance.now() };
  state.lastRun = run;
  try {
    const chunks = onServer ? serverChunks(request(messages), state.controller.signal)
      : await state.engine.chat.completions.create(request(messages), { signal: state.controller.signal });
    for await (const chunk of chunks) {
      const choice = chunk.choices?.[0];
      if (!choice) continue;
      const piece = choice.delta?.content ?? '';
      if (piece || choice.token_ids?.length) {
        run.tokens += choice.token_ids?.length ?? 1;
        run.first ??= performance.now();
        run.last = performance.now();
      }
      run.text += piece;
      out.textContent = run.text;
      run.finish = choice.finish_reason ?? run.finish;
      showMetrics(run);
    }
  } catch (error) {
    if (error.name === 'AbortError') run.finish = 'abort';
    else showError(error);
  } finally {
    state.history.push({ role: 'assistant', content: run.text });
    state.busy = false;
    state.controller = null;
    $('send').disabled = !state.engine && !onServer;
    $('stop').disabled = true;
    run.speculative = onServer ? null : state.engine?.lastStats?.speculative ?? null;
    $('accepted').textContent = run.speculative?.num_draft_tokens
      ? `${run.speculative.num_accepted_tokens}/${run.speculative.num_draft_tokens}` : '-';
    run.done = true;
    if ($('status').textContent !== 'error') setStatus('ready');
  }
}

function showMetrics(run) {
  if (!run.first) return;
  $('ttft').textContent = `${(run.first - run.started).toFixed(0)} ms`;
  const rate = run.tokens > 1 ? (run.tokens - 1) / ((run.last - run.first) / 1000) : 0;
  $('tps').textContent = rate ? `${rate.toFixed(1)} tok/s` : '-';
  $('ntok').textContent = String(run.tokens);
  run.ttftMs = run.first - run.started;
  run.tokensPerSecond = rate;
}

function wire() {
  $('load').onclick = loadModel;
  $('composer').onsubmit = (e) => {
    e.preventDefault();
    const text = $('input').value;
    $('input').value = '';
    send(text);
  };
  $('input').onkeydown = (e) => {
    if (e.key === 'Enter' && !e.shiftKey) {
      e.preventDefault();
      $('composer').requestSubmit();
    }
  };
  $('stop').onclick = () => state.controller?.abort();
  $('target').onchange = () => { $('send').disabled = $('target').value === 'browser' && !state.engine; };
  $('clear-chat').onclick = () => { state.history = []; $('log').textContent = ''; };
  $('clear-cache').onclick = async () => {
    const had = await clearModelCache();
    setStatus(had ? 'cache cleared' : 'cache was empty');
  };
  window.addEventListener('unhandledrejection', (e) => showError(e.reason));
  window.addEventListener('error', (e) => showError(e.error ?? new Error(e.message)));
}

try {
  wire();
  checkBrowser();
  await fillModels();
  const wanted = new URLSearchParams(location.search);
  if (wanted.has('model')) $('model-url').value = wanted.get('model');
  if (wanted.has('precision')) $('precision').value = wanted.get('precision');
  if (wanted.has('device')) $('device-choice').value = wanted.get('device');
  if (wanted.has('speculative')) $('speculative').checked = wanted.get('speculative') === '1';
  // A model named in the URL, or the only one built, loads at once; with a menu the user picks first.
  const only = $('model').options.length === 1 && $('model').value;
  if (wanted.get('autoload') !== '0' && (wanted.has('model') || only)) await loadModel();
  else if (state.loads === 0) setStatus('choose a model');
} catch (error) {
  showError(error);
}
