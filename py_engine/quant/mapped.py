"""Give back the pages of float weights that quantization replaced, where they map the checkpoint.

A float32 model loads as views of its mapped safetensors file (models/safetensors_io.py), and
every page quantization reads stays resident while the file is mapped: quantizing Qwen2.5-0.5B
peaked at 3.4 GB (the whole 2 GB file plus the new codes) against 0.6 GB for llama.cpp's Q8_0.
The views are private, file-backed mappings, so MADV_DONTNEED drops a page and a later read maps
the file's bytes in again: nothing that still reads such a tensor sees other values, unless it
was written in place (then it reads the file's values back; quantize_model releases only weights
it has already replaced). Anonymous memory (a converted dtype, a copy) is never touched here:
it is freed when its last reference goes. Linux only; elsewhere nothing happens.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

from torch import Tensor

MADV_DONTNEED = 4


class MappedPages:
    """The process's private file-backed mappings, read once; `release(t)` drops t's whole pages."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []
        self._libc = None
        if not sys.platform.startswith("linux"):
            return
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    fields = line.split()
                    # address perms offset dev inode path: a private mapping of a regular file
                    if len(fields) >= 6 and fields[1][3] == "p" and fields[5].startswith("/") and fields[4] != "0":
                        lo, hi = (int(v, 16) for v in fields[0].split("-"))
                        self.ranges.append((lo, hi))
            self._libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
            self._libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except OSError:
            self.ranges = []

    def release(self, tensor: Tensor) -> int:
        """Drop the pages wholly inside tensor's bytes if they map a file; returns bytes released."""
        if self._libc is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
            return 0
        start, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if not any(lo <= start and start + size <= hi for lo, hi in self.ranges):
            return 0
        page = mmap.PAGESIZE
        first, last = -(-start // page) * page, (start + size) // page * page  # pages shared with a neighbour stay
        if last <= first or self._libc.madvise(first, last - first, MADV_DONTNEED) != 0:
            return 0
        return last - first
