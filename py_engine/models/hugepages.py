"""Float weights in 2 MiB pages, for a CPU decode step that streams every weight once per token.

Linux backs memory with 4 KiB pages unless a mapping asks for transparent huge pages
(`/sys/kernel/mm/transparent_hugepage/enabled` is `madvise` on most distributions). A decode step of a
0.5B fp32 model reads 1.98 GB: ~480,000 pages of 4 KiB, a TLB miss and a page walk each, and the
hardware prefetchers stop at each 4 KiB boundary. In 2 MiB pages a core streams the step's GEMVs 3-5%
faster (benchmarks/mem_bandwidth.py and the README's decode section have the figures). llama.cpp gets
the same effect without asking: its weights are the GGUF's page cache, mapped in 2 MiB pages where the
file system keeps large folios.

`huge_page_copy(src, dtype)` copies a tensor into its own anonymous mapping that starts on a 2 MiB
boundary: the whole 2 MiB pages of it are advised MADV_HUGEPAGE, the tail MADV_NOHUGEPAGE, so the
tensor costs no more resident memory than a plain copy, and freeing the tensor frees its pages (one
mapping per tensor: nothing outlives the weight it holds). The copy runs in chunks, and `release`
(when given) is told which bytes of the source were copied, so a source mapped from a file can drop
them as it goes instead of holding the file and the copy together.

Off when RUVLLM_HUGE_PAGES=0, and where Python's mmap has no MADV_HUGEPAGE (not Linux).
"""
from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor

HUGE_PAGE = 2 << 20
CHUNK_BYTES = 32 << 20  # source bytes copied (and released) at a time


_ARENAS = ContextVar("ruvllm_huge_arenas", default=True)


def huge_pages_enabled() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("RUVLLM_HUGE_PAGES", "1") != "0"


@contextmanager
def no_arenas() -> Iterator[None]:
    """Loads inside keep each matrix in its own tensor (no HugeArena): a tensor-parallel rank keeps a slice of
    each, and one arena would keep every matrix whole for as long as any slice of it lived."""
    token = _ARENAS.set(False)
    try:
        yield
    finally:
        _ARENAS.reset(token)


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor | None:
    """An uninitialised CPU tensor in its own 2 MiB-aligned mapping; None when huge pages are off or the
    tensor is smaller than one huge page."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if nbytes < HUGE_PAGE or not huge_pages_enabled():
        return None
    try:  # private and anonymous: Python's default for fileno -1 is a shared mapping (shmem's own THP rules)
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return None
    base = torch.frombuffer(region, dtype=torch.uint8)  # holds `region` for as long as a view lives
    start = -base.data_ptr() % HUGE_PAGE  # a multiple of the page size: mappings start on a page
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, whole)
        if nbytes > whole:  # the tail stays in small pages: a huge one would hold up to 2 MiB of nothing
            region.madvise(mmap.MADV_NOHUGEPAGE, start + whole, nbytes - whole)
    except OSError:
        return None
    return base[start:start + nbytes].view(dtype).view(shape)


def huge_page_copy(src: Tensor, dtype: torch.dtype,
                   release: Callable[[int, int], None] | None = None) -> Tensor | None:
    """src converted to dtype, in 2 MiB pages (huge_page_empty); None where that is not to be had (then
    nothing was copied or released). release(begin, end): bytes of src's storage, from its first element,
    that were copied and need not stay resident."""
    if src.device.type != "cpu" or not src.is_contiguous() or src.dim() < 1:
        return None
    out = huge_page_empty(tuple(src.shape), dtype)
    if out is None:
        return None
    flat_src, flat_out = src.view(src.shape[0], -1), out.view(src.shape[0], -1)
    row_bytes = max(1, flat_src[0].numel() * src.element_size())
    rows = max(1, CHUNK_BYTES // row_bytes)
    for first in range(0, src.shape[0], rows):
        last = min(first + rows, src.shape[0])
        flat_out[first:last].copy_(flat_src[first:last])
        if release is not None:
            release(first * row_bytes, last * row_bytes)
    return out


class HugeArena:
    """One mapping in 2 MiB pages that a model's integer codes are copied into one after another (a GGUF's
    Q8_0 / Q5_0 / K-quant matrices: each smaller than a huge page in a small model, so huge_page_copy's one
    mapping per tensor would leave them all in 4 KiB pages). A decode step streams every code once: SmolLM2's
    136 MB of codes are ~35,000 small pages, a TLB miss each; in one arena, decode took 0.92-0.95x the CPU time
    (paired tokens, one thread). The capacity is reserved, not committed (MAP_NORESERVE): only the bytes
    copied in become resident, with at most one partly used huge page at the end. The tensors handed out are
    views of one buffer, which lives as long as any of them does."""

    ALIGN = 64  # a cache line: the kernels' rows start where the tensors do

    def __init__(self, capacity: int) -> None:
        self.base: Tensor | None = None
        self.used = 0
        if capacity <= 0 or not huge_pages_enabled() or not _ARENAS.get():
            return
        try:
            region = mmap.mmap(-1, capacity + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                               | getattr(mmap, "MAP_NORESERVE", 0))
        except OSError:
            return
        base = torch.frombuffer(region, dtype=torch.uint8)  # holds `region`
        start = -base.data_ptr() % HUGE_PAGE
        try:
            region.madvise(mmap.MADV_HUGEPAGE, start, -(-capacity // HUGE_PAGE) * HUGE_PAGE)
        except OSError:
            return
        self.base = base[start:start + capacity]

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor | None:
        """An uninitialised tensor from the arena; None when it is off or full."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if self.base is None or self.used + nbytes > self.base.numel():
            return None
        out = self.base[self.used:self.used + nbytes].view(dtype).view(shape)
        self.used += -(-nbytes // self.ALIGN) * self.ALIGN
        return out

    def new(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """empty()'s tensor, or a fresh heap tensor when the arena is off or full."""
        out = self.empty(shape, dtype)
        return torch.empty(shape, dtype=dtype) if out is None else out

    def take(self, t: Tensor | None) -> Tensor | None:
        """t copied into the arena (t itself when it does not fit, is not a plain CPU tensor, or is a
        broadcast view: one zero point held as one byte)."""
        if t is None or t.device.type != "cpu" or not t.is_contiguous() or t.dim() < 1:
            return t
        out = self.empty(tuple(t.shape), t.dtype)
        if out is None:
            return t
        out.copy_(t)
        return out
