// prepack: the tarball must carry the Pyodide wheels (py_engine's shared layer, jinja2, markupsafe).
// They are built from the repository by `npm run build:wheels` (python -m web.wheels); packing without
// them would publish a package that fails at createEngine() time, so stop here with the fix.
import { existsSync, readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import { dirname, join } from "node:path";

const wheels = join(dirname(fileURLToPath(import.meta.url)), "..", "wheels");
const index = join(wheels, "index.json");
const fix = "run `npm run build:wheels` (python -m web.wheels --out npm/wheels) from a checkout first";
if (!existsSync(index)) {
  console.error(`ruvllm prepack: ${index} is missing; ${fix}`);
  process.exit(1);
}
const names = JSON.parse(readFileSync(index, "utf8"));
const missing = names.filter((name) => !existsSync(join(wheels, name)));
if (!names.some((name) => name.startsWith("py_engine-")) || missing.length) {
  console.error(`ruvllm prepack: wheels missing (${missing.join(", ") || "py_engine"}); ${fix}`);
  process.exit(1);
}
