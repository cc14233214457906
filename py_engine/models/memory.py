"""The process's memory: resident set figures, and giving freed heap pages back to the system.

Loading and quantizing a model frees many large temporaries (unpacked codes, float blocks) between the
tensors it keeps. glibc's malloc serves blocks under its mmap threshold, which rises to 32 MB as large
blocks are freed, from the heap, and keeps freed heap pages resident: quantizing Qwen2.5-0.5B to int8
left ~240 MB of free heap resident beside 473 MB of codes. `trim_heap()` (glibc's malloc_trim) hands
those pages back; elsewhere (musl, macOS, Windows) it does nothing.

`release_library_pages()` unmaps the resident pages of shared libraries that were only ever read. Loading
libtorch runs static initialisers spread over its whole 430 MB text: `import torch` leaves ~60 MB of
library pages resident (RssFile) that a CPU decode never executes again, and they count in the peak RSS
beside the weights. MADV_DONTNEED on a private file mapping drops its pages from this process's page
tables; the page cache keeps them and a later call faults back in the few it needs (~20 MB for a
decode on the kernels). A page a mapping has written (copy-on-write: relocations) would be lost, so
only mappings that are not writable and hold no anonymous page are touched, and only `.so` files,
never a mapped checkpoint. RUVLLM_KEEP_LIBRARY_PAGES=1 turns it off.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import re
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
    if fn is None:
        return False
    fn(0)  # 1 when it released memory, 0 when there was none to release
    return True


MADV_DONTNEED = 4
_MAPPING = re.compile(r"[0-9a-f]+-[0-9a-f]+ [r-][w-][x-][ps] ")


@lru_cache(maxsize=1)
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def library_mappings(smaps: str = "/proc/self/smaps") -> list[tuple[int, int, int]]:
    """(start, end, resident bytes) of each shared-library mapping whose pages are all the file's own:
    not writable, no anonymous (copy-on-write) page, some page resident; [] off Linux."""
    mappings: list[list] = []  # [header fields, Rss bytes, Anonymous bytes]
    try:
        with open(smaps) as f:
            for line in f:
                if _MAPPING.match(line):  # "lo-hi perms offset dev inode [path]", then "Key: value kB" lines
                    mappings.append([line.split(), 0, 0])
                elif mappings and line.startswith(("Rss:", "Anonymous:")):
                    mappings[-1][1 if line.startswith("Rss:") else 2] = int(line.split()[1]) * 1024
    except OSError:
        return []
    return [(*(int(v, 16) for v in head[0].split("-")), rss) for head, rss, anon in mappings
            if _clean_library(head, rss, anon)]


def _clean_library(head: list[str], rss: int, anon: int) -> bool:
    # address perms offset dev inode path: a private, read-only mapping of a shared object, every page clean
    if len(head) < 6 or not rss or anon or head[1][1] == "w" or head[1][3] != "p" or head[4] == "0":
        return False
    name = head[5].rsplit("/", 1)[-1]
    return name.endswith(".so") or ".so." in name


def release_library_pages() -> int:
    """Drop the resident pages of read-only shared-library mappings (see the module's docstring); returns
    the bytes that were resident there. A no-op (0) off Linux or with RUVLLM_KEEP_LIBRARY_PAGES=1."""
    fn = _madvise()
    if fn is None or os.environ.get("RUVLLM_KEEP_LIBRARY_PAGES", "") not in ("", "0"):
        return 0
    released = 0
    for start, end, rss in library_mappings():
        if fn(start, end - start, MADV_DONTNEED) == 0:
            released += rss
    return released


def drop_pages(start: int, end: int) -> bool:
    """MADV_DONTNEED on the whole pages of [start, end) of a read-only file mapping: they leave this process's RSS
    and stay in the page cache (a later read maps the same bytes again). For a weights file whose tensors were
    copied: touching a few KiB of it (a norm) maps whole large folios of the page cache around it, which then
    count in the RSS beside the copies. False off Linux or when madvise refuses."""
    fn = _madvise()
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page
    return fn is not None and last > first and fn(first, last - first, MADV_DONTNEED) == 0


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
