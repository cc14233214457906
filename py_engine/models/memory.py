"""The process's memory: resident set figures, and giving freed heap pages back to the system.

Loading and quantizing a model frees many large temporaries (unpacked codes, float blocks) between the
tensors it keeps. glibc's malloc serves blocks under its mmap threshold, which rises to 32 MB as large
blocks are freed, from the heap, and keeps freed heap pages resident: quantizing Qwen2.5-0.5B to int8
left ~240 MB of free heap resident beside 473 MB of codes. `trim_heap()` (glibc's malloc_trim) hands
those pages back; elsewhere (musl, macOS, Windows) it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys
from functools import lru_cache


@lru_cache(maxsize=1)
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def trim_heap() -> bool:
    """Return the heap's free pages to the system (glibc); whether it could."""
    fn = _malloc_trim()
    return bool(fn is not None and fn(0) is not None)


def peak_rss_mb() -> float:
    """The process's peak resident set so far, MiB (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def rss_mb() -> dict[str, float]:
    """{"rss", "peak", "anon", "file"} MiB from /proc/self/status (Linux); {} elsewhere."""
    keys = {"VmRSS": "rss", "VmHWM": "peak", "RssAnon": "anon", "RssFile": "file"}
    try:
        with open("/proc/self/status") as f:
            return {keys[k]: int(v.split()[0]) / 1024 for k, _, v in (line.partition(":") for line in f) if k in keys}
    except OSError:
        return {}
