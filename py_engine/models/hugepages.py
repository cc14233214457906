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
from collections.abc import Callable

import torch
from torch import Tensor

HUGE_PAGE = 2 << 20
CHUNK_BYTES = 32 << 20  # source bytes copied (and released) at a time


def huge_pages_enabled() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("RUVLLM_HUGE_PAGES", "1") != "0"


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
