// Runs a Python file inside the real Pyodide (the page's Python) with the repository mounted at /repo.
// usage: node bank_pyodide.mjs PYODIDE_DIR REPO SCRIPT.py INPUT.json -> prints the script's last stdout line
import { pathToFileURL } from 'node:url';

const [pyodideDir, repo, script, input] = process.argv.slice(2);
const { loadPyodide } = await import(pathToFileURL(`${pyodideDir}/pyodide.mjs`).href);
const pyodide = await loadPyodide({ indexURL: `${pyodideDir}/` });
pyodide.FS.mkdir('/repo');
pyodide.FS.mount(pyodide.FS.filesystems.NODEFS, { root: repo }, '/repo');
const fs = await import('node:fs');
pyodide.FS.writeFile('/input.json', fs.readFileSync(input));
pyodide.globals.set('INPUT', '/input.json');
let out = '';
pyodide.setStdout({ batched: (line) => { out = line; } });
try {
  await pyodide.runPythonAsync(`import sys; sys.path.insert(0, '/repo')\n` +
    fs.readFileSync(script, 'utf8'));
} catch (e) { // only the message: a stack through pyodide.asm.mjs prints its minified source
  console.error(String(e.message || e).slice(-3000));
  process.exit(1);
}
console.log(out);
