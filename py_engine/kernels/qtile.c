/* Several rows of x (a decode batch, a prefill chunk) against quantized weights, in integer
 * tiles: T_R rows of W by T_X rows of x. Each sub-block of codes is loaded and unpacked once
 * per tile and multiplied with every row of x in it (u8 x s8 dot products: vpdpbusd with
 * AVX-512 VNNI, maddubs on AVX2), so the weights stream from memory once for all rows and
 * their unpacking is shared; the one-row path (rows_q) unpacked them again for every row.
 *
 * The 256-bit tile's arithmetic is rows_q's step for step (per sub-block: int32 dot, converted,
 * times the x block's d into the group's sum; per group: times s; then the mins term), so a row
 * of a batch gets the value it would get alone, bit for bit. AVX-512 builds take two sub-blocks a
 * step (ztile) and scale each by d * s, for the layouts ztile_fits names (then one row takes it too,
 * so rows still do not depend on their batch).
 *
 * ztile's costs (benchmarks/qtile_bench.py, 1 thread, shared 2-vCPU Xeon with AVX-512 VNNI, GFLOP/s-
 * equivalent at 16 rows, 4864x896 / 896x4864): int4 g32 62 / 49 before, 94-101 / 112-126 after; int8
 * g32 76 / 82 before, 87-95 / 104-111 after; int4 g128 (now ztile) 86 / 89 before, 100 / 127 after.
 * What it took: (1) x in row blocks of Z_XBYTES that stay in L1 (all of a 128-row x per tile of W
 * ran from L2: 128 rows were 30% slower than 16); (2) the mins term (asymmetric groups) as a 16-wide
 * dot over groups after the loop (the scalar loop per output cost as much as the dot products);
 * (3) scales and x's d as one broadcast load + permute per step, int4 unpacked from one broadcast
 * load; (4) VNNI: 8-bit codes fed to vpdpbusd as unsigned bytes, 128 * sum(x) taken off after the
 * loop (no sign moved onto x per row pair). The inner step is now vpdpbusd, convert, d * s, FMA
 * per row pair: the per-sub-block float scaling, not the integer dot, bounds it, which is why
 * dequantize + MKL sgemm still wins from ~64 rows on 4864x896 (Q_TILE_ROWS stays 32).
 */
#include "quant.h"

#ifndef T_X
#define T_X 4 /* rows of x per tile */
#endif
#ifndef T_R
#define T_R 2 /* rows of W per tile */
#endif
#if T_X > 8 || T_X < 1 || T_R < 1
#error "1 <= T_X <= 8, T_R >= 1"
#endif

/* Rows n..n + nr - 1 of W against rows m0..m0 + mt - 1 of x (mt, nr compile-time where inlined). */
static inline __attribute__((always_inline)) void tile(const qjob_t *j, const qpart_t *a, int64_t m0, const int mt,
                                                        int64_t n, const int nr, const int bits4, const int pairs) {
  const qmat_t *w = &a->w;
  const int64_t nb = nb_of(w), rb = row_bytes(w), bb = bits4 ? 16 : 32;
  const uint8_t *c = w->codes + n * rb;
  const float *s = w->scales + n * w->ng;
  const int8_t *qx = (pairs ? j->qxp : j->qx) + m0 * nb * 32;
  const __m256i low = _mm256_set1_epi8(0x0f);
  __m256 acc[T_X][T_R];
  for (int m = 0; m < mt; ++m)
    for (int r = 0; r < nr; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t g = 0, b = 0; g < w->ng; ++g) {
    __m256 ga[T_X][T_R];
    for (int m = 0; m < mt; ++m)
      for (int r = 0; r < nr; ++r) ga[m][r] = _mm256_setzero_ps();
    for (int64_t e = b + w->spg; b < e; b += pairs ? 2 : 1) {
      if (bits4 ? !(b & 3) : !(b & 1))
        for (int r = 0; r < nr; ++r) _mm_prefetch((const char *)c + r * rb + b * bb + Q_PREFETCH, Q_HINT);
      __m256i lo[T_R], hi[T_R];  /* pairs: both sub-blocks' low and high nibbles; else codes, |codes| */
      for (int r = 0; r < nr; ++r) {
        const uint8_t *cr = c + r * rb + b * bb;
        if (pairs) {
          const __m256i raw = _mm256_loadu_si256((const __m256i *)cr);
          lo[r] = _mm256_and_si256(raw, low);
          hi[r] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        } else if (bits4) {
          const __m128i raw = _mm_loadu_si128((const __m128i *)cr);
          lo[r] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
        } else {
          hi[r] = _mm256_loadu_si256((const __m256i *)cr);
          lo[r] = _mm256_sign_epi8(hi[r], hi[r]);
        }
      }
      for (int m = 0; m < mt; ++m) {
        const int8_t *xm = qx + m * nb * 32 + b * 32;
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)xm);
        if (pairs) {
          const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xm + 32));
          const __m256 d = _mm256_loadu_ps(j->dxp + (m0 + m) * nb * 4 + b * 4);
          for (int r = 0; r < nr; ++r)
            ga[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(udot2(lo[r], x0, hi[r], x1)), d, ga[m][r]);
        } else {
          const __m256 d = _mm256_broadcast_ss(j->dx + (m0 + m) * nb + b);
          for (int r = 0; r < nr; ++r) {
            const __m256i p = bits4 ? udot(lo[r], x0) : udot(lo[r], _mm256_sign_epi8(x0, hi[r]));
            ga[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, ga[m][r]);
          }
        }
      }
    }
    for (int r = 0; r < nr; ++r) {
      const __m256 sv = _mm256_broadcast_ss(s + r * w->ng + g);
      for (int m = 0; m < mt; ++m) acc[m][r] = _mm256_fmadd_ps(ga[m][r], sv, acc[m][r]);
    }
  }
  for (int m = 0; m < mt; ++m)
    for (int r = 0; r < nr; ++r) {
      float y = hsum8(acc[m][r]);
      if (has_mins(w) && a->xg) {
        float f;
        const float *xg = a->xg + (m0 + m) * w->ng, *mr = mins_row(w, n + r, &f);
        for (int64_t g = 0; g < w->ng; ++g) y -= (f * mr[g]) * xg[g];
      }
      put_q(j, a, m0 + m, n + r, y);
    }
}

#define TILE_CASE(K, NR, BITS4, PAIRS) \
  case K: tile(j, a, m0, K < T_X ? K : T_X, n, NR, BITS4, PAIRS); break;
#define TILE_CASES(NR, BITS4, PAIRS)                                                                       \
  switch (mt) { /* mt <= T_X <= 8: the cases past T_X are never taken */                                \
    TILE_CASE(1, NR, BITS4, PAIRS) TILE_CASE(2, NR, BITS4, PAIRS) TILE_CASE(3, NR, BITS4, PAIRS)          \
    TILE_CASE(4, NR, BITS4, PAIRS) TILE_CASE(5, NR, BITS4, PAIRS) TILE_CASE(6, NR, BITS4, PAIRS)          \
    TILE_CASE(7, NR, BITS4, PAIRS) default: tile(j, a, m0, T_X, n, NR, BITS4, PAIRS); break;             \
  }

static void tiles_of(const qjob_t *j, const qpart_t *a, int64_t n, int full, int bits4, int pairs) {
  for (int64_t m0 = 0; m0 < j->M; m0 += T_X) {
    const int mt = j->M - m0 < T_X ? (int)(j->M - m0) : T_X;
    if (full) {
      if (pairs) { TILE_CASES(T_R, 1, 1) }
      else if (bits4) { TILE_CASES(T_R, 1, 0) }
      else { TILE_CASES(T_R, 0, 0) }
    } else {
      if (pairs) { TILE_CASES(1, 1, 1) }
      else if (bits4) { TILE_CASES(1, 1, 0) }
      else { TILE_CASES(1, 0, 0) }
    }
  }
}

#ifdef __AVX512BW__
/* AVX-512 builds, one sub-block a group: two sub-blocks per 512-bit step, each product scaled by
 * d * s per lane, so a pair costs one dot, one convert, one multiply and one FMA per row pair (m, r)
 * where the 256-bit tile spends two of each plus the group step. 4-bit codes: the 32 bytes of sub-blocks b, b + 1
 * as [low nibbles | high nibbles] against qxp's pair order (int32 lanes 0-3, 8-11: sub-block b; 4-7,
 * 12-15: b + 1); 8-bit: 64 bytes in order against qx (lanes 0-7: b, 8-15: b + 1). Needs nb even. */
#ifndef Z_X
#define Z_X 4
#endif

/* Two consecutive floats p[0], p[1] as a vector with p[0] in sub-block b's lanes and p[1] in b + 1's:
 * one 8-byte broadcast load and one permute (setting the halves from scalars took four to five). */
static inline __m512 pair_of(const float *p, int bits4) {
  const __m512 ab = _mm512_castsi512_ps(_mm512_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)p)));
  const __m512i idx = bits4 ? _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0)
                            : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(idx, ab);
}

#if defined(__AVX512VNNI__) && !defined(Z_SIGNED8)
#define Z_UNSIGNED8 1 /* 8-bit codes as unsigned bytes straight into vpdpbusd (see ztile) */
#else
#define Z_UNSIGNED8 0
#endif

static inline __m512i zdot(__m512i u, __m512i s) { /* udot, 512 bits */
#ifdef __AVX512VNNI__
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}

static inline float hsum16(__m512 v) {
  return hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

/* The mins term's sum over groups, 16 at a time (a scalar loop per output was as long as the
 * dot products themselves for asymmetric 4-bit groups of 32: K / 32 multiply-adds per output). */
static inline float zmins(const float *mr, float f, const float *xg, int64_t ng) { /* Σ (f * mr[g]) * xg[g] */
  __m512 acc = _mm512_setzero_ps();
  const __m512 fv = _mm512_set1_ps(f);
  int64_t g = 0;
  for (; g + 16 <= ng; g += 16)
    acc = _mm512_fmadd_ps(_mm512_mul_ps(fv, _mm512_loadu_ps(mr + g)), _mm512_loadu_ps(xg + g), acc);
  if (g < ng) {
    const __mmask16 k = (__mmask16)((1u << (ng - g)) - 1);
    acc = _mm512_fmadd_ps(_mm512_mul_ps(fv, _mm512_maskz_loadu_ps(k, mr + g)), _mm512_maskz_loadu_ps(k, xg + g), acc);
  }
  return hsum16(acc);
}

static inline __attribute__((always_inline)) void ztile(const qjob_t *j, const qpart_t *a, int64_t m0, const int mt,
                                                         int64_t n, const int nr, const int bits4, const int uns) {
  const qmat_t *w = &a->w;
  const int64_t nb = nb_of(w), rb = row_bytes(w), bb = bits4 ? 16 : 32;
  const uint8_t *c = w->codes + n * rb;
  const int8_t *qx = (bits4 ? j->qxp : j->qx) + m0 * nb * 32;
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512 acc[Z_X][4];
  for (int m = 0; m < mt; ++m)
    for (int r = 0; r < nr; ++r) acc[m][r] = _mm512_setzero_ps();
  const int64_t spg = w->spg; /* 1, or even (ztile_fits): sub-blocks b, b + 1 share group g */
  for (int64_t b = 0, g = 0, left = spg; b < nb; b += 2) {
    if (spg > 1 && (left -= 2) < 0) { ++g; left = spg - 2; }
    if (bits4 ? !(b & 3) : 1)
      for (int r = 0; r < nr; ++r) _mm_prefetch((const char *)c + r * rb + b * bb + Q_PREFETCH, Q_HINT);
    __m512i wu[4], ws[4];
    (void)ws;
    __m512 sc[4];
    for (int r = 0; r < nr; ++r) {
      const uint8_t *cr = c + r * rb + b * bb;
      if (bits4) {
        const __m512i both = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)cr));
        wu[r] = _mm512_and_si512(_mm512_mask_srli_epi16(both, 0xffff0000u, both, 4), low); /* [low | high] */
      } else {
        if (uns) {
        /* the stored codes c - 128 back to c (u8): Σ c q = Σ (c - 128) q + 128 Σ q, the second term
         * taken off after the loop from x's per-sub-block sums (xs); this saves moving w's sign onto x
         * (four instructions) for every row of x. Only with VNNI: maddubs' int16 pairs would saturate. */
        wu[r] = _mm512_xor_si512(_mm512_loadu_si512((const void *)cr), _mm512_set1_epi8((char)0x80));
        } else {
        ws[r] = _mm512_loadu_si512((const void *)cr);
        wu[r] = _mm512_abs_epi8(ws[r]);
        }
      }
      const float *sr = w->scales + (n + r) * w->ng;
      sc[r] = spg == 1 ? pair_of(sr + b, bits4) : _mm512_set1_ps(sr[g]); /* groups b, b + 1; or g for both */
    }
    for (int m = 0; m < mt; ++m) {
      const __m512i xv = _mm512_loadu_si512((const void *)(qx + m * nb * 32 + b * 32));
      __m512 d;
      if (bits4) {
        d = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(j->dxp + (m0 + m) * nb * 4 + b * 4))));
      } else {
        const float *dm = j->dx + (m0 + m) * nb + b;
        d = pair_of(dm, 0);
      }
      for (int r = 0; r < nr; ++r) {
        /* else x with w's sign where w < 0 (|w| carries the magnitude); zero where w is zero, as _mm256_sign_epi8 */
        const __m512i xs = bits4 || uns ? xv : _mm512_mask_sub_epi8(_mm512_maskz_mov_epi8(_mm512_test_epi8_mask(ws[r], ws[r]), xv),
                                                             _mm512_movepi8_mask(ws[r]), _mm512_setzero_si512(), xv);
        const __m512i p = zdot(wu[r], xs);
        acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(d, sc[r]), acc[m][r]);
      }
    }
  }
  for (int m = 0; m < mt; ++m)
    for (int r = 0; r < nr; ++r) {
      float y = hsum16(acc[m][r]);
      if (has_mins(w) && a->xg) {
        float f;
        const float *mr = mins_row(w, n + r, &f);
        y -= zmins(mr, f, a->xg + (m0 + m) * w->ng, w->ng);
      }
      if (uns) y -= 128.f * zmins(w->scales + (n + r) * w->ng, 1.f, j->dx + (j->M + m0 + m) * nb, nb);
      put_q(j, a, m0 + m, n + r, y);
    }
}

#define ZTILE_CASE(K, NR, BITS4, UNS) \
  case K: ztile(j, a, m0, K < Z_X ? K : Z_X, n, NR, BITS4, UNS); break;
#define ZTILE_CASES(NR, BITS4, UNS)                                                          \
  switch (mt) {                                                                              \
    ZTILE_CASE(1, NR, BITS4, UNS) ZTILE_CASE(2, NR, BITS4, UNS) ZTILE_CASE(3, NR, BITS4, UNS) \
    default: ztile(j, a, m0, Z_X, n, NR, BITS4, UNS); break;                                 \
  }

#ifndef Z_XBYTES
#define Z_XBYTES 16384 /* bytes of int8 x one pass over a chunk's rows of W takes: they stay in L1 */
#endif

static void ztiles(const qjob_t *j, const qpart_t *a, int64_t n0, int64_t n1) {
  const int bits4 = a->w.bits4, full_rows = bits4 ? 4 : 2;
  /* Rows of x in blocks that fit L1, each block against all of the chunk's rows of W (which stay in
   * L2): sweeping all of a 128-row x (114 KB at K = 896) per tile of W ran from L2 at a third of the
   * speed. Blocks are whole tiles of Z_X rows, so every row of x meets the same tiles as before. */
  const int64_t xrow = nb_of(&a->w) * 32;
  int64_t mb = Z_XBYTES / xrow / Z_X * Z_X;
  if (mb < Z_X) mb = Z_X;
  for (int64_t b0 = 0; b0 < j->M; b0 += mb) {
  const int64_t b1 = j->M - b0 < mb ? j->M : b0 + mb;
  for (int64_t n = n0; n < n1;) {
    const int full = n1 - n >= full_rows;
    for (int64_t m0 = b0; m0 < b1; m0 += Z_X) {
      const int mt = b1 - m0 < Z_X ? (int)(b1 - m0) : Z_X;
      if (bits4) {
        if (full) { ZTILE_CASES(4, 1, 0) } else { ZTILE_CASES(1, 1, 0) }
      } else if (Z_UNSIGNED8 && a->w.spg == 1) {
        if (full) { ZTILE_CASES(2, 0, 1) } else { ZTILE_CASES(1, 0, 1) }
      } else {
        if (full) { ZTILE_CASES(2, 0, 0) } else { ZTILE_CASES(1, 0, 0) }
      }
    }
    n += full ? full_rows : 1;
  }
  }
}
#endif

void q_tiles(const qjob_t *j, const qpart_t *a, int64_t n0, int64_t n1) {
  const int bits4 = a->w.bits4, pairs = bits4 && j->qxp && !(a->w.spg & 1);
#ifdef __AVX512BW__
  if (ztile_fits(&a->w) && (!bits4 || j->qxp)) {
    ztiles(j, a, n0, n1);
    return;
  }
#endif
  for (int64_t n = n0; n < n1;) { /* T_R rows of W stay in L1 while every row of x passes */
    const int full = n1 - n >= T_R;
    tiles_of(j, a, n, full, bits4, pairs);
    n += full ? T_R : 1;
  }
}
