"""Ring 0 runs without torch or numpy: the same code must run in Pyodide."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.paths import REPO

# The shared layer, every module of the tokenizer package, and the stdlib-only parts of hub/ and importers/.
RING0 = ["py_engine", "py_engine.config", "py_engine.chat", "py_engine.chat_sandbox", "py_engine.sampling",
         "py_engine.sampling_params", "py_engine.stopping", "py_engine.generate",
         *sorted(f"py_engine.tokenizer.{p.stem}".removesuffix(".__init__")
                 for p in (REPO / "py_engine" / "tokenizer").glob("*.py")),
         "py_engine.hub", "py_engine.hub.resolve", "py_engine.adapters", "py_engine.adapters.config",
         "py_engine.adapters.xlora_config", "py_engine.importers", "py_engine.importers.llama2c_tokenizer",
         "py_engine.importers.llama2c_sampler", "py_engine.learning", "py_engine.learning.config",
         "py_engine.learning.bank", "py_engine.learning.bank.index", "py_engine.learning.bank.patterns",
         "py_engine.learning.bank.gate",
         *sorted(f"py_engine.speculative.{p.stem}".removesuffix(".__init__")
                 for p in (REPO / "py_engine" / "speculative").glob("*.py")),
         *sorted(".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
                 for p in (REPO / "py_engine" / "guided").rglob("*.py"))]  # structured outputs, every module


def test_shared_layer_imports_without_torch_or_numpy():
    code = textwrap.dedent(f"""
        import sys
        sys.modules['torch'] = None
        sys.modules['numpy'] = None
        import importlib
        for name in {RING0!r}:
            importlib.import_module(name)
        heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'transformers', 'tokenizers')
                       and sys.modules[m] is not None)
        assert not heavy, heavy
        print('ok')
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
