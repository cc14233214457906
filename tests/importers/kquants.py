"""ggml's K-quants made here, for test files: the `gguf` package dequantizes K types but cannot quantize them.

    blocks = quantize(w, "Q4_K")  # w float32 [N, K], K a multiple of 256 -> uint8 [N, K / 256 * 144]

Written after llama.cpp's reference quantizers (ggml-quants.c: quantize_row_q2_K_ref ... q6_K_ref and
their make_qkx2_quants / make_qx_quants / make_q3_quants searches, no importance matrix), in numpy
float32 over all sub-blocks at once: the same scale searches, the same 6-bit / 4-bit / int8 scale
rounding against the super-block's fp16 scale, the same re-rounding of the values against the rounded
scales, and the same bit layouts. Sums are numpy's (pairwise), not C's running ones, so a byte may
differ from llama-quantize's where a search's two candidates tie to the last bit; the tests hold
these files to gguf's dequantization and to the error a K-quant should have, not to llama.cpp's bytes.
"""
from __future__ import annotations

import numpy as np

QK = 256
EPS = np.float32(1e-15)  # GROUP_MAX_EPS


def quantize(w: np.ndarray, type_name: str) -> np.ndarray:
    """w float32 [N, K] -> ggml blocks uint8 [N, K / 256 * bytes] of type_name (Q2_K ... Q6_K)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    n, k = w.shape
    if k % QK:
        raise ValueError(f"{type_name} needs rows of whole blocks of {QK}, not {k}")
    x = w.reshape(-1, QK)  # [blocks, 256]
    out = {"Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}[type_name](x)
    return out.reshape(n, -1)


def _rint(v: np.ndarray) -> np.ndarray:
    """nearest_int: round half to even, as int32 (in its range: callers clip further)."""
    return np.rint(np.clip(v, -4194303, 4194303)).astype(np.int32)


def _f16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16)


def _qkx2(x: np.ndarray, weights: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int,
          use_mad: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """make_qkx2_quants over rows of x [B, n]: (scale [B], min [B] as a positive offset, L [B, n])."""
    f = np.float32
    lo = np.minimum(x.min(axis=1), 0).astype(f)
    hi = x.max(axis=1).astype(f)
    lo0 = lo
    sum_w, sum_x = weights.sum(axis=1, dtype=f), (weights * x).sum(axis=1, dtype=f)
    flat = hi == lo
    span = np.where(flat, f(1), hi - lo)
    iscale = f(nmax) / span
    scale = f(1) / iscale
    L = np.clip(_rint(iscale[:, None] * (x - lo[:, None])), 0, nmax)
    diff = scale[:, None] * L + lo[:, None] - x
    best = (weights * (np.abs(diff) if use_mad else diff * diff)).sum(axis=1, dtype=f)
    for step in range(nstep + 1):
        iscale = (f(rmin) + f(rdelta) * f(step) + f(nmax)) / span
        la = np.clip(_rint(iscale[:, None] * (x - lo[:, None])), 0, nmax).astype(f)
        sum_l, sum_l2, sum_xl = (weights * la).sum(1, dtype=f), (weights * la * la).sum(1, dtype=f), (
            weights * la * x).sum(1, dtype=f)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe = np.where(ok, det, f(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        positive = this_min > 0
        this_min = np.where(positive, f(0), this_min)
        this_scale = np.where(positive, sum_xl / np.where(sum_l2 > 0, sum_l2, f(1)), this_scale)
        diff = this_scale[:, None] * la + this_min[:, None] - x
        err = (weights * (np.abs(diff) if use_mad else diff * diff)).sum(axis=1, dtype=f)
        better = ok & (err < best)
        L = np.where(better[:, None], la.astype(np.int32), L)
        best = np.where(better, err, best)
        scale = np.where(better, this_scale, scale)
        lo = np.where(better, this_min, lo)
    L = np.where(flat[:, None], 0, L)
    scale, lo = np.where(flat, f(0), scale), np.where(flat, lo0, lo)
    return scale.astype(f), (-lo).astype(f), L


def _qx(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """make_qx_quants(rmse_type 1) over rows of x [B, 16]: (scale [B], L [B, 16] in 0..2 nmax - 1)."""
    f = np.float32
    idx = np.abs(x).argmax(axis=1)
    mx = x[np.arange(len(x)), idx]
    zero = np.abs(mx) < EPS
    mx = np.where(zero, f(1), mx)
    wgt = x * x

    def trial(iscale):
        l = np.clip(_rint(iscale[:, None] * x), -nmax, nmax - 1)
        return l, (wgt * x * l).sum(1, dtype=f), (wgt * l * l).sum(1, dtype=f)

    iscale = f(-nmax) / mx
    L, sumlx, suml2 = trial(iscale)
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, f(1)), f(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        l, slx, sl2 = trial(-(f(nmax) + f(0.1) * f(step)) / mx)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        L = np.where(better[:, None], l, L)
        scale = np.where(better, slx / np.where(sl2 > 0, sl2, f(1)), scale)
        best = np.where(better, scale * slx, best)
    return np.where(zero, f(0), scale).astype(f), np.where(zero[:, None], 0, L + nmax)


def _q3(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """make_q3_quants(do_rmse) over rows of x [B, 16]: (scale [B], L [B, 16] in 0..2 nmax - 1)."""
    f = np.float32
    idx = np.abs(x).argmax(axis=1)
    mx = x[np.arange(len(x)), idx]
    zero = np.abs(mx) < EPS
    mx = np.where(zero, f(1), mx)
    L = np.clip(_rint((f(-nmax) / mx)[:, None] * x), -nmax, nmax - 1)
    w = x * x
    sumlx, suml2 = (w * x * L).sum(1, dtype=f), (w * L * L).sum(1, dtype=f)
    for _ in range(5):  # each value in turn, with the running sums (as the C loop)
        for i in range(x.shape[1]):
            xi, wi, li = x[:, i], w[:, i], L[:, i]
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            new = np.clip(_rint(xi * sl2 / np.where(slx > 0, slx, f(1))), -nmax, nmax - 1)
            slx2, sl22 = slx + wi * xi * new, sl2 + wi * new * new
            take = (slx > 0) & (new != li) & (sl22 > 0) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            L[:, i] = np.where(take, new, li)
            sumlx, suml2 = np.where(take, slx2, sumlx), np.where(take, sl22, suml2)
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, f(1)), f(0))
    return np.where(zero, f(0), scale).astype(f), np.where(zero[:, None], 0, L + nmax)


def _requantize(x: np.ndarray, L: np.ndarray, d: np.ndarray, dm: np.ndarray | None, lo: int, hi: int,
                shift: int) -> np.ndarray:
    """Values against the rounded scales d [B, S] (and mins dm): clip(nearest((x + dm) / d)) + shift; where
    d is 0 the search's codes stay (the C loops `continue`). x, L: [B, S, sub]."""
    f = np.float32
    num = x if dm is None else x + dm[..., None]
    safe = np.where(d != 0, d, f(1))[..., None]
    new = np.clip(_rint(num / safe), lo, hi) + shift
    return np.where((d != 0)[..., None], new, L)


def _k4_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins [B, 8] -> Q4_K/Q5_K's 12 bytes [B, 12]."""
    s = np.zeros((len(ls), 12), dtype=np.uint8)
    s[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    s[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    s[:, 8:12] = (ls[:, 4:] & 15) | ((lm[:, 4:] & 15) << 4)
    return s


def _k4_common(x: np.ndarray, nmax: int, rmin: float, nstep: int):
    """Q4_K/Q5_K's search and scale rounding: (d, dmin fp16 [B], 12 scale bytes, L [B, 256])."""
    f = np.float32
    sub = x.reshape(-1, 32)
    av = np.sqrt((sub * sub).sum(1, dtype=f) / f(32))
    scales, mins, L = _qkx2(sub, av[:, None] + np.abs(sub), nmax, rmin, 0.1, nstep, False)
    scales, mins = scales.reshape(-1, 8), mins.reshape(-1, 8)
    max_scale, max_min = scales.max(1), mins.max(1)
    inv_s = np.where(max_scale > 0, f(63) / np.where(max_scale > 0, max_scale, f(1)), f(0))
    inv_m = np.where(max_min > 0, f(63) / np.where(max_min > 0, max_min, f(1)), f(0))
    ls = np.clip(_rint(inv_s[:, None] * scales), 0, 63).astype(np.uint8)
    lm = np.clip(_rint(inv_m[:, None] * mins), 0, 63).astype(np.uint8)
    d, dmin = _f16(max_scale / f(63)), _f16(max_min / f(63))
    dd = d.astype(f)[:, None] * ls.astype(f)  # [B, 8]
    dm = dmin.astype(f)[:, None] * lm.astype(f)
    L = _requantize(x.reshape(-1, 8, 32), L.reshape(-1, 8, 32), dd, dm, 0, nmax, 0).reshape(-1, 256)
    return d, dmin, _k4_scales(ls, lm), L


def _q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, L = _k4_common(x, 15, -1.0, 20)
    L = L.reshape(-1, 4, 2, 32)
    qs = (L[:, :, 0] | (L[:, :, 1] << 4)).astype(np.uint8).reshape(-1, 128)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), sc, qs], axis=1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, L = _k4_common(x, 31, -0.5, 15)
    L = L.reshape(-1, 8, 32)
    qh = np.zeros((len(L), 32), dtype=np.uint8)
    for b in range(8):  # bit b of qh[l]: sub-block b's value l has its fifth bit
        qh |= ((L[:, b] >> 4) << b).astype(np.uint8)
    low = (L & 15).reshape(-1, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).astype(np.uint8).reshape(-1, 128)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), sc, qh, qs], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    f = np.float32
    scales, L = _qx(x.reshape(-1, 16), 32)
    scales, L = scales.reshape(-1, 16), L.reshape(-1, 16, 16)
    idx = np.abs(scales).argmax(axis=1)
    max_scale = scales[np.arange(len(scales)), idx]
    zero = np.abs(max_scale) < EPS
    iscale = f(-128) / np.where(zero, f(1), max_scale)
    d = _f16(np.where(zero, f(0), f(1) / iscale))
    sc = np.where(zero[:, None], 0, np.minimum(127, _rint(iscale[:, None] * scales))).astype(np.int8)
    dd = d.astype(f)[:, None] * sc.astype(f)
    L = _requantize(x.reshape(-1, 16, 16), L, dd, None, -32, 31, 32)
    L = np.where(zero[:, None, None], 0, L).reshape(-1, 2, 4, 32)  # [h, r, l]: value 128h + 32r + l
    ql = np.concatenate([(L[:, :, 0] & 15) | ((L[:, :, 2] & 15) << 4), (L[:, :, 1] & 15) | ((L[:, :, 3] & 15) << 4)],
                        axis=2).astype(np.uint8).reshape(-1, 128)
    qh = ((L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4) | ((L[:, :, 3] >> 4) << 6))
    return np.concatenate([ql, qh.astype(np.uint8).reshape(-1, 64), sc.view(np.uint8),
                           d.view(np.uint8).reshape(-1, 2)], axis=1)


def _pack2(L: np.ndarray) -> np.ndarray:
    """2-bit values [B, 256] -> Q2_K/Q3_K's qs [B, 64]: byte 32h + l holds values 128h + 32r + l at bits 2r."""
    L = L.reshape(-1, 2, 4, 32).astype(np.uint8)
    return (L[:, :, 0] | (L[:, :, 1] << 2) | (L[:, :, 2] << 4) | (L[:, :, 3] << 6)).reshape(-1, 64)


def _q3_k(x: np.ndarray) -> np.ndarray:
    f = np.float32
    scales, L = _q3(x.reshape(-1, 16), 4)
    scales, L = scales.reshape(-1, 16), L.reshape(-1, 16, 16)
    idx = np.abs(scales).argmax(axis=1)
    max_scale = scales[np.arange(len(scales)), idx]
    some = max_scale != 0
    iscale = f(-32) / np.where(some, max_scale, f(1))
    l6 = np.where(some[:, None], np.clip(_rint(iscale[:, None] * scales), -32, 31) + 32, 0).astype(np.uint8)
    s = np.zeros((len(l6), 12), dtype=np.uint8)
    s[:, 0:8] = (l6[:, 0:8] & 15) | ((l6[:, 8:16] & 15) << 4)
    for j in range(16):
        s[:, 8 + j % 4] |= (l6[:, j] >> 4) << (2 * (j // 4))
    d = _f16(np.where(some, f(1) / iscale, f(0)))
    sc = np.where(some[:, None], l6.astype(np.int32) - 32, 0)
    dd = d.astype(f)[:, None] * sc.astype(f)
    L = _requantize(x.reshape(-1, 16, 16), L, dd, None, -4, 3, 4).reshape(-1, 8, 32)  # [sub-block b, l]
    hmask = np.zeros((len(L), 32), dtype=np.uint8)
    for b in range(8):
        hmask |= ((L[:, b] > 3).astype(np.uint8) << b)
    low = np.where(L > 3, L - 4, L)
    return np.concatenate([hmask, _pack2(low), s, d.view(np.uint8).reshape(-1, 2)], axis=1)


def _q2_k(x: np.ndarray) -> np.ndarray:
    f = np.float32
    sub = x.reshape(-1, 16)
    scales, mins, L = _qkx2(sub, np.abs(sub), 3, -0.5, 0.1, 15, True)
    scales, mins, L = scales.reshape(-1, 16), mins.reshape(-1, 16), L.reshape(-1, 16, 16)
    max_scale, max_min = scales.max(1), mins.max(1)
    ls = np.where(max_scale[:, None] > 0, _rint((f(15) / np.where(max_scale > 0, max_scale, f(1)))[:, None] * scales), 0)
    lm = np.where(max_min[:, None] > 0, _rint((f(15) / np.where(max_min > 0, max_min, f(1)))[:, None] * mins), 0)
    sc = ((ls & 15) | ((lm & 15) << 4)).astype(np.uint8)
    d = _f16(np.where(max_scale > 0, max_scale / f(15), f(0)))
    dmin = _f16(np.where(max_min > 0, max_min / f(15), f(0)))
    dd = d.astype(f)[:, None] * (sc & 15).astype(f)
    dm = dmin.astype(f)[:, None] * (sc >> 4).astype(f)
    L = _requantize(x.reshape(-1, 16, 16), L, dd, dm, 0, 3, 0)
    return np.concatenate([sc, _pack2(L.reshape(-1, 256)), d.view(np.uint8).reshape(-1, 2),
                           dmin.view(np.uint8).reshape(-1, 2)], axis=1)
