"""ruvllm's engine.

Ring 0 (this package's config, tokenizer, chat, sampling and generation
modules) is pure Python with the standard library only at import time, so it
runs unchanged in CPython and in Pyodide. Ring 1 (`py_engine.models`, the
quantizers) needs torch and is imported only when used.
"""
__version__ = "0.1.0"
