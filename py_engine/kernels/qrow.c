/* Decode, batches and short prompt chunks (1-31 rows of x) against quantized codes on AVX-512 VNNI builds:
 * quant.h's canonical sum, lane for lane the float steps of qtile.c's virtual panels and qpanel.c's panels, with the exact integers
 * I_b found row by row instead of from codes turned into panel order.
 *
 * Why (issue 32, the cost of batch invariance): qtile.c turns every sub-block of 16 W rows into panel order in
 * registers (16 128-bit loads, 12 inserts, 8 unpacks) and gathers each group's 16 scales (and mins), work that a
 * decode step (one row of x) pays for one use. Decode ran at half the speed of the tiles before 93e4dc4 (int4 g32
 * 896x4864, one thread: 19 against 40 GFLOP/s-equivalent). Here each W row's codes are read as they lie, 4
 * sub-blocks (64 bytes of 4-bit codes, 128 of 8-bit) a step: one vpdpbusd pair per row gives 16 partial sums,
 * 4 per sub-block, and a fixed reduction of 16 rows (unpack + add twice, then a 4 x 4 transpose of 128-bit
 * blocks) leaves 4 vectors whose lane r is I_b of row r: exact integers, so any order of additions gives the same
 * ones. The scales and mins of 16 rows are transposed 4 groups at a time (128-bit loads, one permute, the same
 * block transpose) into a per-thread buffer. Then, per sub-block b of group g, per row of x m:
 *     acc_m = fma(float(I_b), d_mb * s_g, acc_m)        and at each group's end   acc_m = fnma(mn_g, X_mg, acc_m)
 * with mn_g = (mins, or zp * s) (+ 128 s for 8-bit codes), in the same roundings as qtile.c's vblock: the bits a
 * row gets here are the bits it gets in a prompt chunk (qpanel.c), in a batch and on the AVX2 build.
 */
#include <stdlib.h>
#include <string.h>

#include "quant.h"

#if Q_ROWS_BUILT
#define R_LANES 16 /* W rows per block: lane r of the float accumulators is row n + r */
#ifndef R_XROWS
#define R_XROWS 8 /* rows of x a pass over the codes takes (RBLOCK_CASES spells out 1..7) */
#endif

/* x rows m0.. (mt of them) in the order the codes meet them, per step of 4 sub-blocks (128 bytes): columns 0-15
 * of the 4 sub-blocks (4-bit: what the low nibbles hold; 8-bit: the first 16 bytes of each, gathered by
 * rblock's block shuffle), then columns 16-31. Sub-blocks past nb are zero. */
static void arrange_x(const int8_t *qx, int64_t nb, int mt, int8_t *out) {
  const int64_t steps = (nb + 3) / 4;
  memset(out, 0, (size_t)(mt * steps * 128));
  for (int m = 0; m < mt; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t *q = qx + (m * nb + b) * 32;
      int8_t *o = out + m * steps * 128 + b / 4 * 128;
      memcpy(o + 16 * (b % 4), q, 16);
      memcpy(o + 64 + 16 * (b % 4), q + 16, 16);
    }
}

/* R[c] (c = 0..3), 128-bit block k of R[c] = 4 values of sub-block k for rows 4c..4c + 3, into V[k]: lane 4c + i of
 * V[k] = lane i of block k of R[c] (a 4 x 4 transpose of 128-bit blocks). */
static inline void blocks_transpose(const __m512i *R, __m512i *V) {
  const __m512i t0 = _mm512_shuffle_i32x4(R[0], R[1], 0x44), t1 = _mm512_shuffle_i32x4(R[0], R[1], 0xee);
  const __m512i t2 = _mm512_shuffle_i32x4(R[2], R[3], 0x44), t3 = _mm512_shuffle_i32x4(R[2], R[3], 0xee);
  V[0] = _mm512_shuffle_i32x4(t0, t2, 0x88), V[1] = _mm512_shuffle_i32x4(t0, t2, 0xdd);
  V[2] = _mm512_shuffle_i32x4(t1, t3, 0x88), V[3] = _mm512_shuffle_i32x4(t1, t3, 0xdd);
}

/* Partial sums of 4 rows (P[i]: 16 lanes, block k = sub-block k's 4 partial sums of row i) as one vector whose
 * block k holds the 4 rows' I of sub-block k (exact integer adds). */
static inline __m512i rows4(const __m512i *P) {
  const __m512i q0 = _mm512_add_epi32(_mm512_unpacklo_epi32(P[0], P[1]), _mm512_unpackhi_epi32(P[0], P[1]));
  const __m512i q1 = _mm512_add_epi32(_mm512_unpacklo_epi32(P[2], P[3]), _mm512_unpackhi_epi32(P[2], P[3]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(q0, q1), _mm512_unpackhi_epi64(q0, q1));
}

/* Groups g..g + 3 (those below ng) of a [N, ng] float tensor for rows row[0..15], as 4 vectors (lane r: row[r]). */
static inline void groups4(const float *t, int64_t ng, const int64_t *row, int64_t g, __m512 *V) {
  const int live = ng - g < 4 ? (int)(ng - g) : 4;
  const __mmask8 k = (__mmask8)((1u << live) - 1u);
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  __m512i R[4], out[4];
  for (int c = 0; c < 4; ++c) { /* rows 4c..4c + 3 side by side, then block k = group g + k of the 4 rows */
    __m512 u = _mm512_castps128_ps512(_mm_maskz_loadu_ps(k, t + row[4 * c] * ng + g));
    u = _mm512_insertf32x4(u, _mm_maskz_loadu_ps(k, t + row[4 * c + 1] * ng + g), 1);
    u = _mm512_insertf32x4(u, _mm_maskz_loadu_ps(k, t + row[4 * c + 2] * ng + g), 2);
    u = _mm512_insertf32x4(u, _mm_maskz_loadu_ps(k, t + row[4 * c + 3] * ng + g), 3);
    R[c] = _mm512_permutexvar_epi32(idx, _mm512_castps_si512(u));
  }
  blocks_transpose(R, out);
  for (int i = 0; i < 4; ++i) V[i] = _mm512_castsi512_ps(out[i]);
}

/* The 16 rows' s_g and mn_g (qtile.c's vblock: mins, or zp * s; + 128 s for 8-bit codes) as [ng][16] each. */
static void scales_of(const qmat_t *w, const int64_t *row, int corr, float *st, float *mt) {
  for (int64_t g = 0; g < w->ng; g += 4) {
    __m512 s[4], m[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    groups4(w->scales, w->ng, row, g, s);
    if (corr && w->mins) groups4(w->mins, w->ng, row, g, m);
    for (int i = 0; i < 4 && g + i < w->ng; ++i) {
      _mm512_store_ps(st + (g + i) * R_LANES, s[i]);
      if (!corr) continue;
      __m512 mn = w->mins ? m[i] : _mm512_mul_ps(_mm512_set1_ps(w->zp), s[i]);
      if (!w->bits4) mn = _mm512_add_ps(mn, _mm512_mul_ps(_mm512_set1_ps(128.f), s[i]));
      _mm512_store_ps(mt + (g + i) * R_LANES, mn);
    }
  }
}

/* Rows n..n + live - 1 of W (live <= 16) against rows m0..m0 + mt - 1 of x (xa: arrange_x's, mt <= R_XROWS): one
 * pass over the codes for all mt rows. Each step's integers go through a small buffer on the stack (R: [x row][4 W
 * rows], 64 bytes each), so what stays in registers is the step's codes, one x row's products and the mt float
 * accumulators, however many rows of x come: a 5-9-row verify step reads and unpacks the codes once (it took two
 * passes of <= 4 rows before, the compiler spilling the 4 x 4 integers of the 4-row pass). A row's float steps
 * are its own chain (sub-block order, then its group's fnma), so the order of rows in between changes no bit. */
static inline __attribute__((always_inline)) void rblock(const qjob_t *j, const qpart_t *a, int64_t n, int live,
                                                          int64_t m0, const int mt, const int8_t *xa, const float *st,
                                                          const float *mnt, const int bits4) {
  const qmat_t *w = &a->w;
  const int64_t nb = nb_of(w), rb = row_bytes(w), steps = (nb + 3) / 4, spg = w->spg;
  const int corr = has_mins(w) || !bits4;
  const int64_t pf = q_prefetch_at(rb, R_LANES);
  const uint8_t *row[R_LANES];
  for (int r = 0; r < R_LANES; ++r) row[r] = w->codes + (n + (r < live ? r : live - 1)) * rb;
  const __m512i low = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
  __m512 acc[R_XROWS];
  __m512i R[R_XROWS][4]; /* [x row][rows 4c..4c + 3]: rows4's integers of one step */
  for (int m = 0; m < mt; ++m) acc[m] = _mm512_setzero_ps();
  int64_t g = 0, left = spg;
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t b0 = 4 * s, sbs = nb - b0 < 4 ? nb - b0 : 4; /* sub-blocks in this step */
    for (int c = 0; c < 4; ++c) {
      __m512i lo[4], hi[4];
      for (int i = 0; i < 4; ++i) {
        const uint8_t *p = row[4 * c + i];
        _mm_prefetch((const char *)p + b0 * (bits4 ? 16 : 32) + pf, Q_HINT);
        if (bits4) {
          const __m512i v = sbs == 4 ? _mm512_loadu_si512((const void *)(p + b0 * 16))
                                     : _mm512_maskz_loadu_epi8(((__mmask64)1 << (16 * sbs)) - 1, p + b0 * 16);
          lo[i] = _mm512_and_si512(v, low);
          hi[i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        } else { /* sub-blocks 0-1 and 2-3 of the step, as unsigned c + 128 */
          _mm_prefetch((const char *)p + b0 * 32 + 64 + pf, Q_HINT);
          const int64_t a1 = sbs < 2 ? 32 * sbs : 64, a2 = sbs > 2 ? 32 * (sbs - 2) : 0;
          const __m512i v0 = a1 == 64 ? _mm512_loadu_si512((const void *)(p + b0 * 32))
                                      : _mm512_maskz_loadu_epi8(((__mmask64)1 << a1) - 1, p + b0 * 32);
          const __m512i v1 = a2 == 64 ? _mm512_loadu_si512((const void *)(p + b0 * 32 + 64))
                             : a2 ? _mm512_maskz_loadu_epi8(((__mmask64)1 << a2) - 1, p + b0 * 32 + 64)
                                  : _mm512_setzero_si512();
          /* block k of lo / hi: the first / second 16 bytes of sub-block k (as arrange_x lays x out), so one
           * dpbusd pair gives block k = sub-block k, as for 4-bit codes: no shuffle per row of x */
          lo[i] = _mm512_xor_si512(_mm512_shuffle_i32x4(v0, v1, 0x88), flip);
          hi[i] = _mm512_xor_si512(_mm512_shuffle_i32x4(v0, v1, 0xdd), flip);
        }
      }
      for (int m = 0; m < mt; ++m) {
        const int8_t *x = xa + (m0 + m) * steps * 128 + s * 128;
        const __m512i x0 = _mm512_loadu_si512((const void *)x), x1 = _mm512_loadu_si512((const void *)(x + 64));
        __m512i P[4];
        for (int i = 0; i < 4; ++i)
          P[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[i], x0), hi[i], x1);
        R[m][c] = rows4(P);
      }
    }
    int64_t gk[4];
    int ends[4];
    for (int64_t k = 0; k < sbs; ++k) { /* sub-block b0 + k's group, and whether it ends it */
      gk[k] = g;
      ends[k] = --left == 0;
      if (ends[k]) ++g, left = spg;
    }
    for (int m = 0; m < mt; ++m) { /* quant.h's canonical sum of row m0 + m, sub-blocks b0.. */
      __m512i V[4];
      blocks_transpose(R[m], V);
      const float *dx = j->dx + (m0 + m) * nb + b0, *xg = a->xg + (m0 + m) * w->ng;
      for (int64_t k = 0; k < sbs; ++k) {
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(V[k]),
                                 _mm512_mul_ps(_mm512_set1_ps(dx[k]), _mm512_load_ps(st + gk[k] * R_LANES)), acc[m]);
        if (corr && ends[k])
          acc[m] = _mm512_fnmadd_ps(_mm512_load_ps(mnt + gk[k] * R_LANES), _mm512_set1_ps(xg[gk[k]]), acc[m]);
      }
    }
  }
  for (int m = 0; m < mt; ++m) {
    if (live == R_LANES && !w->bias && !j->y_bf16) {
      _mm512_storeu_ps((float *)a->y + (m0 + m) * j->ldy + n, acc[m]);
      continue;
    }
    float v[R_LANES];
    _mm512_storeu_ps(v, acc[m]);
    for (int r = 0; r < live; ++r) put_q(j, a, m0 + m, n + r, v[r]);
  }
}

#define RBLOCK_CASES(BITS4) \
  switch (mt) { \
  case 1: rblock(j, a, n, live, m0, 1, xa, st, mnt, BITS4); break; \
  case 2: rblock(j, a, n, live, m0, 2, xa, st, mnt, BITS4); break; \
  case 3: rblock(j, a, n, live, m0, 3, xa, st, mnt, BITS4); break; \
  case 4: rblock(j, a, n, live, m0, 4, xa, st, mnt, BITS4); break; \
  case 5: rblock(j, a, n, live, m0, 5, xa, st, mnt, BITS4); break; \
  case 6: rblock(j, a, n, live, m0, 6, xa, st, mnt, BITS4); break; \
  case 7: rblock(j, a, n, live, m0, 7, xa, st, mnt, BITS4); break; \
  default: rblock(j, a, n, live, m0, R_XROWS, xa, st, mnt, BITS4); break; \
  }

int q_rows(const qjob_t *j, const qpart_t *a, int64_t n0, int64_t n1) {
  const qmat_t *w = &a->w;
  const int64_t nb = nb_of(w), steps = (nb + 3) / 4, M = j->M;
  const int64_t xbytes = M * steps * 128, fbytes = w->ng * R_LANES * 4;
  static __thread void *buffer;
  static __thread int64_t size;
  char *buf = pool_scratch(&buffer, &size, 2 * fbytes + xbytes);
  if (!buf) return -1;
  float *st = (float *)buf, *mnt = st + w->ng * R_LANES;
  int8_t *xa = (int8_t *)(buf + 2 * fbytes);
  arrange_x(j->qx, nb, (int)M, xa);
  const int corr = has_mins(w) || !w->bits4;
#if Q_AMX_BUILT
  const int64_t m_amx = q_amx_rows(j, a, n0, n1); /* x rows qamx.c took for every whole block of 16 W rows */
#else
  const int64_t m_amx = 0;
#endif
  for (int64_t n = n0; n < n1; n += R_LANES) {
    const int live = n1 - n < R_LANES ? (int)(n1 - n) : R_LANES;
    const int64_t m_first = live == R_LANES ? m_amx : 0;
    if (m_first >= M) continue;
    int64_t row[R_LANES];
    for (int r = 0; r < R_LANES; ++r) row[r] = n + (r < live ? r : live - 1);
    scales_of(w, row, corr, st, mnt);
    for (int64_t m0 = m_first; m0 < M; m0 += R_XROWS) {
      const int mt = M - m0 < R_XROWS ? (int)(M - m0) : R_XROWS;
      if (w->bits4) { RBLOCK_CASES(1) } else { RBLOCK_CASES(0) }
    }
  }
  return 0;
}
#endif
