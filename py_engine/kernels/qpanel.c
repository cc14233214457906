/* Prefill (Q_PANEL_ROWS = 32 rows of x or more) against quantized codes (4-bit and 8-bit, any group), in
 * integer panels: AVX-512 VNNI builds. Per output the float steps are quant.h's canonical sum (one fma by
 * d_b * s_g per sub-block's exact integer, the mins term at each group's end), which qtile.c's virtual panels
 * repeat lane for lane: a prompt chunk's rows get the bits decode gives them.
 *
 * (History: qtile.c's earlier tiles kept the sub-block's 32 columns in the vector lanes and sum them at the end, so every
 * pair (x row, W row) pays a convert, a multiply and an FMA per 64 codes beside its one vpdpbusd: at
 * 128 rows they ran at 95-102 GFLOP/s-equivalent per core, slower than dequantize + MKL sgemm (128-131).)
 * Here the lanes are 16 rows of W instead (a panel), as in a GEMM's micro-kernel: 4 codes of a row sit
 * in one int32 lane as bytes (4-bit: columns j..j + 3 from the low nibbles, then j + 16..j + 19 from the
 * high ones, the Q4_0 order; 8-bit: 4 consecutive columns), and 4 int8 of x broadcast to all lanes meet
 * them in one vpdpbusd. A sub-block (32 columns) is 8 vpdpbusd per (x row, panel) into int32, then one
 * convert and one FMA by d_x * s_w (16 rows' scales in one vector): 3 float instructions per 8 dot
 * products instead of 3 per 1, and no horizontal sums. Each chunk of W rows is first copied into panel
 * order (a gather of 16 rows' 4 bytes per 64 bytes, 4-bit codes unpacked there once, into a per-thread
 * buffer that stays in L2) and then meets every row of x, 6 rows by 2 panels at a time (measured best
 * of 4x2, 8x1, 4x3). x is the decode path's (int8 per sub-block of 32, d = max|x| / 127), so the products
 * are those of the reference on rounded x, as for batches, and so is the float order (the canonical sum).
 * One thread, 128 rows, GFLOP/s-equivalent (benchmarks/qtile_bench.py): int4 g128 4864x896 418 against
 * 131 for dequantize + sgemm, int8 per channel 413 against 127.
 */
#include <stdlib.h>
#include <string.h>

#include "quant.h"

#if Q_PANELS_BUILT
#ifndef P_MT
#define P_MT 6 /* rows of x per micro-kernel */
#endif
#ifndef P_NP
#define P_NP 2 /* panels of 16 W rows per micro-kernel */
#endif
#define P_LANES 16

typedef struct { /* one chunk of W rows in panel order, in the calling thread's buffer */
  const uint8_t *codes; /* [panels][nb * 8][16] int32 lanes: 4 codes of each row as bytes (8-bit: unsigned c) */
  const float *scales;  /* [panels][ng][16] */
  const float *mins;    /* [panels][ng][16] what comes off per group times X_g: mins, + 128 s for 8-bit; or NULL */
  int64_t panels, nb, ng, spg;
  int halves; /* groups of 16 values (ggml's Q2_K/Q3_K/Q6_K): two a sub-block, columns 0-15 then 16-31; 2: Q6_K,
              * the zero term folded into the integers (ia starts at xz16's -32 Σ q, no mins) */
} packed_t;

static __thread void *p_buffer; /* the calling thread's panels */
static __thread int64_t p_size;
static void *p_scratch(int64_t bytes) { return pool_scratch(&p_buffer, &p_size, bytes); }

/* Rows n0..n1 of w in panel order; lanes past n1 get zero codes and scales (their outputs are not stored).
 * 8-bit codes are stored as c - 128 (int8); vpdpbusd takes them as unsigned c (the sign bit flipped), so
 * Σ (c - 128) q = Σ c q - 128 Σ q, and 128 s X_g comes off per group with the mins (X_g = Σ d_b Σ q_b). */
static int pack(const qmat_t *w, int64_t n0, int64_t n1, packed_t *p) {
  const int64_t nb = nb_of(w), rb = row_bytes(w), ng = w->ng, panels = (n1 - n0 + P_LANES - 1) / P_LANES;
  const int64_t code_bytes = panels * nb * 8 * 64, float_bytes = panels * ng * P_LANES * 4;
  const int corr = has_mins(w) || !w->bits4;
  uint8_t *buf = p_scratch(code_bytes + float_bytes * (corr ? 2 : 1));
  if (!buf) return -1;
  float *sc = (float *)(buf + code_bytes), *mn = corr ? sc + panels * ng * P_LANES : NULL;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t q = 0; q < panels; ++q) {
    const int64_t n = n0 + q * P_LANES, live = n1 - n < P_LANES ? n1 - n : P_LANES;
    const __mmask16 k = (__mmask16)((1u << live) - 1u);
    const __m512i off = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)rb));
    const uint8_t *c = w->codes + n * rb;
    uint8_t *o = buf + q * nb * 8 * 64;
    if (w->bits4) /* unpacked here once, not in the kernel for every block of x rows: 4 bytes of a row's codes
                   * as two dwords, the low nibbles (columns j..j + 3) then the high ones (j + 16..j + 19) */
      for (int64_t t = 0; t < nb * 4; ++t) {
        const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, off, c + 4 * t, 1);
        const __m512i low = _mm512_set1_epi8(0x0f);
        _mm512_store_si512((void *)(o + 2 * t * 64), _mm512_and_si512(v, low));
        _mm512_store_si512((void *)(o + (2 * t + 1) * 64), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
      }
    else
      for (int64_t t = 0; t < nb * 8; ++t) {
        const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, off, c + 4 * t, 1);
        _mm512_store_si512((void *)(o + t * 64), _mm512_maskz_xor_epi32(k, v, _mm512_set1_epi8((char)0x80)));
      }
    for (int64_t g = 0; g < ng; ++g)
      for (int64_t l = 0; l < P_LANES; ++l) {
        const int64_t i = (n + l) * ng + g;
        sc[(q * ng + g) * P_LANES + l] = l < live ? w->scales[i] : 0.f;
        if (mn) mn[(q * ng + g) * P_LANES + l] = l < live ? (w->mins ? w->mins[i] : w->zp * w->scales[i]) + (w->bits4 ? 0.f : 128.f * w->scales[i]) : 0.f;
      }
  }
  *p = (packed_t){buf, sc, mn, panels, nb, ng, w->spg, 0};
  return 0;
}

/* 4 bits of each lane's qh (bits 4e..4e + 3: values 4e..4e + 3 of the block) as 16 in their bytes */
static inline __m512i fifth16(__m512i qh, int e) {
  const __m512i rep = _mm512_shuffle_epi8(qh, _mm512_add_epi8(_mm512_set4_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0),
                                                              _mm512_set1_epi8((char)(e >> 1))));
  const __mmask64 k = _mm512_test_epi8_mask(rep, _mm512_set1_epi32((int)(0x08040201u << (4 * (e & 1)))));
  return _mm512_maskz_mov_epi8(k, _mm512_set1_epi8(16));
}

/* Q5_0 / Q5_1 rows n0..n1 (kind 6 / 7) in the 4-bit panels' order (their qs is Q4_0's nibble order), each code
 * with its fifth bit (+16) from qh; per block s = d and mn = 16 d (Q5_0) or -m (Q5_1), as qtile_k.c's q5_tiles. */
static int pack_q5(const qmat_t *w, int64_t n0, int64_t n1, packed_t *p) {
  const int64_t nb = nb_of(w), rb = row_bytes(w), bb = kq_block_bytes(w->kind), qs = w->kind == 6 ? 6 : 8;
  const int64_t panels = (n1 - n0 + P_LANES - 1) / P_LANES, code_bytes = panels * nb * 8 * 64;
  const int64_t float_bytes = panels * nb * P_LANES * 4;
  uint8_t *buf = p_scratch(code_bytes + 2 * float_bytes);
  if (!buf) return -1;
  float *sc = (float *)(buf + code_bytes), *mn = sc + panels * nb * P_LANES;
  const __m512i low = _mm512_set1_epi8(0x0f), zero = _mm512_setzero_si512();
  const __m512i off = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32((int)rb));
  for (int64_t q = 0; q < panels; ++q) {
    const int64_t n = n0 + q * P_LANES, live = n1 - n < P_LANES ? n1 - n : P_LANES;
    const __mmask16 k = (__mmask16)((1u << live) - 1u); /* lanes past n1: zero codes and scales */
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t *blk = w->codes + n * rb + b * bb;
      const __m512i head = _mm512_mask_i32gather_epi32(zero, k, off, blk, 1);
      const __m512i qh = _mm512_mask_i32gather_epi32(zero, k, off, blk + qs - 4, 1);
      const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
      const __m512 m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)));
      _mm512_store_ps(sc + (q * nb + b) * P_LANES, d);
      _mm512_store_ps(mn + (q * nb + b) * P_LANES, w->kind == 6 ? _mm512_mul_ps(_mm512_set1_ps(16.f), d)
                                                                : _mm512_xor_ps(m, _mm512_set1_ps(-0.f)));
      uint8_t *o = buf + q * nb * 8 * 64 + b * 8 * 64;
      for (int t = 0; t < 4; ++t) { /* dword t of qs: values 4t.. (low nibbles), 16 + 4t.. (high) */
        const __m512i v = _mm512_mask_i32gather_epi32(zero, k, off, blk + qs + 4 * t, 1);
        _mm512_store_si512((void *)(o + 2 * t * 64), _mm512_or_si512(_mm512_and_si512(v, low), fifth16(qh, t)));
        _mm512_store_si512((void *)(o + (2 * t + 1) * 64),
                           _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), fifth16(qh, 4 + t)));
      }
    }
  }
  *p = (packed_t){buf, sc, mn, panels, nb, nb, 1, 0};
  return 0;
}

#ifndef P_TRANSPOSE
#define P_TRANSPOSE 1 /* 0: pack_blocks turns its rows into panel order a word at a time (an A/B build) */
#endif
/* out[i][l] = in[l * stride + i] for 16 rows l and 16 words i (a 16 x 16 dword transpose, 64 shuffles where the
 * word-at-a-time loop took 256 loads and stores: SmolLM2's and Llama-3.2-1B's K-quant prefills spent ~5% there). */
static inline void transpose16(const uint32_t *in, int64_t stride, uint32_t *out) {
  __m512i r[16], t[16];
  for (int l = 0; l < 16; ++l) r[l] = _mm512_loadu_si512((const void *)(in + l * stride));
  for (int l = 0; l < 16; l += 2) { /* pairs of rows interleaved by dwords */
    t[l] = _mm512_unpacklo_epi32(r[l], r[l + 1]);
    t[l + 1] = _mm512_unpackhi_epi32(r[l], r[l + 1]);
  }
  for (int l = 0; l < 16; l += 4) { /* then by qwords: each 128-bit lane holds one word of 4 rows */
    r[l] = _mm512_unpacklo_epi64(t[l], t[l + 2]);
    r[l + 1] = _mm512_unpackhi_epi64(t[l], t[l + 2]);
    r[l + 2] = _mm512_unpacklo_epi64(t[l + 1], t[l + 3]);
    r[l + 3] = _mm512_unpackhi_epi64(t[l + 1], t[l + 3]);
  }
  /* r[4g + k], 128-bit lane c: word 4c + w(k) of rows 4g..4g + 3, w = (0, 1, 2, 3)[k]; gather lane c of the four
   * groups into one vector: words 4c + w of rows 0..15 */
  for (int k = 0; k < 4; ++k) {
    const __m512i a = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x88), b = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xdd);
    const __m512i c = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x88), d = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xdd);
    t[k] = _mm512_shuffle_i32x4(a, c, 0x88);      /* lane 0: words 0 + k */
    t[4 + k] = _mm512_shuffle_i32x4(b, d, 0x88);  /* lane 1: words 4 + k */
    t[8 + k] = _mm512_shuffle_i32x4(a, c, 0xdd);  /* lane 2: words 8 + k */
    t[12 + k] = _mm512_shuffle_i32x4(b, d, 0xdd); /* lane 3: words 12 + k */
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512((void *)(out + i * 16), t[i]);
}

/* ggml blocks (kquant.c): rows n0..n1 unpacked a row at a time (codes unsigned in value order, s_j = D c_j and
 * the zero term Z_j per group of 32 or 16 values), then laid out as the 8-bit codes are (4 consecutive columns
 * a lane), so the kernel is the same but for the groups of 16 (halves). X_g: quant.c's xs, or xs16. */
static int pack_blocks(const qmat_t *w, int64_t n0, int64_t n1, packed_t *p) {
  const int64_t nb = nb_of(w), panels = (n1 - n0 + P_LANES - 1) / P_LANES, halves = kq_per16(w->kind);
  const int64_t ng = halves ? 2 * nb : nb, words = nb * 8; /* int32 words of codes a row */
  const int64_t code_bytes = panels * words * 64, float_bytes = panels * ng * P_LANES * 4;
  uint8_t *buf = p_scratch(code_bytes + 2 * float_bytes + P_LANES * words * 4);
  if (!buf) return -1;
  float *sc = (float *)(buf + code_bytes), *mn = sc + panels * ng * P_LANES;
  uint32_t *rows = (uint32_t *)(mn + panels * ng * P_LANES); /* [16][words] one panel's rows, unpacked */
  for (int64_t q = 0; q < panels; ++q) {
    for (int64_t l = 0; l < P_LANES; ++l) {
      const int64_t n = n0 + q * P_LANES + l;
      float *sl = sc + q * ng * P_LANES + l, *ml = mn + q * ng * P_LANES + l;
      if (n < n1) {
        kq_unpack_row(w, n, (uint8_t *)(rows + l * words), sl, ml, P_LANES);
      } else { /* past the chunk: zero codes and scales (the outputs are not stored) */
        memset(rows + l * words, 0, (size_t)words * 4);
        for (int64_t g = 0; g < ng; ++g) sl[g * P_LANES] = ml[g * P_LANES] = 0.f;
      }
    }
    uint32_t *o = (uint32_t *)(buf + q * words * 64);
    int64_t e = 0; /* [16][words] -> [words][16]: word e of every row in one vector, 16 words at a time */
    for (; P_TRANSPOSE && e + 16 <= words; e += 16) transpose16(rows + e, words, o + e * P_LANES);
    for (; e < words; ++e)
      for (int64_t l = 0; l < P_LANES; ++l) o[e * P_LANES + l] = rows[l * words + e];
  }
  *p = (packed_t){buf, sc, mn, panels, nb, ng, 1, (int)halves};
  return 0;
}

/* 32 bytes at off of 16 rows as 8 dword vectors, lane l = row l: out[4h + t] lane l = dword 4h + t of row l's run
 * (row[] in the order [0, 4, 8, 12, 1, 5, ...]: each 128-bit lane k of a load takes row i + 4k, which the 4 x 4 dword
 * transpose within lanes leaves in lane 4k + i). */
static inline void turn32(const uint8_t *const *row, int64_t off, __m512i *out) {
  for (int h = 0; h < 2; ++h) {
    __m512i a[4];
    for (int i = 0; i < 4; ++i) {
      __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(row[4 * i] + off + 16 * h)));
      for (int k = 1; k < 4; ++k) v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(row[4 * i + k] + off + 16 * h)), k);
      a[i] = v;
    }
    const __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
    out[4 * h] = _mm512_unpacklo_epi64(t0, t2), out[4 * h + 1] = _mm512_unpackhi_epi64(t0, t2);
    out[4 * h + 2] = _mm512_unpacklo_epi64(t1, t3), out[4 * h + 3] = _mm512_unpackhi_epi64(t1, t3);
  }
}

/* Q6_K rows n0..n1 straight from their blocks into panel order (pack_blocks' row-at-a-time unpack and transpose took
 * ~17% of a one-thread Llama-3.2-1B-shape prefill): a super-block's 32-byte runs of 16 rows turned into words, each
 * sub-block's codes ql's nibble | qh's 2 bits << 4 (values in order, unsigned), per group of 16 s_j = D c_j (the
 * gathered scale bytes) and no zero term: Q6_K's 32 comes off in the integers (xz16, quant.h). Lanes past n1 read
 * the last row again with zero scales (their outputs are not stored). */
static int pack_q6(const qmat_t *w, int64_t n0, int64_t n1, packed_t *p) {
  const int64_t nb = nb_of(w), rb = row_bytes(w), words = nb * 8, ng = 2 * nb;
  const int64_t panels = (n1 - n0 + P_LANES - 1) / P_LANES, code_bytes = panels * words * 64;
  uint8_t *buf = p_scratch(code_bytes + panels * ng * P_LANES * 4);
  if (!buf) return -1;
  float *sc = (float *)(buf + code_bytes);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i low = _mm512_set1_epi8(0x0f), two = _mm512_set1_epi8(0x03);
  for (int64_t q = 0; q < panels; ++q) {
    const int64_t n = n0 + q * P_LANES, live = n1 - n < P_LANES ? n1 - n : P_LANES;
    const __mmask16 k = (__mmask16)((1u << live) - 1u);
    const __m512i at = _mm512_mullo_epi32(_mm512_min_epi32(lane, _mm512_set1_epi32((int)live - 1)), _mm512_set1_epi32((int)rb));
    const uint8_t *row[P_LANES];
    for (int l = 0; l < P_LANES; ++l) { /* the load order turn32 takes: row[4i + k] = row i + 4k */
      const int64_t r = (l % 4) * 4 + l / 4;
      row[l] = w->codes + (n + (r < live ? r : live - 1)) * rb;
    }
    uint8_t *o = buf + q * words * 64;
    float *so = sc + q * ng * P_LANES;
    for (int64_t s = 0; s < w->ng; ++s) {
      const int64_t off = s * 210;
      const uint8_t *blk = w->codes + n * rb + off;
      const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_i32gather_epi32(at, blk + 206, 1), 16)));
      for (int g4 = 0; g4 < 4; ++g4) { /* scale bytes 4 g4..4 g4 + 3 */
        const __m512i four = _mm512_i32gather_epi32(at, blk + 192 + 4 * g4, 1);
        for (int e = 0; e < 4; ++e) {
          const __m512i c = _mm512_srai_epi32(_mm512_slli_epi32(four, 24 - 8 * e), 24);
          _mm512_store_ps(so + (s * 16 + 4 * g4 + e) * P_LANES, _mm512_maskz_mul_ps(k, d, _mm512_cvtepi32_ps(c)));
        }
      }
      for (int h = 0; h < 2; ++h) { /* values 128 h..: ql's runs 64 h, 64 h + 32, qh's run 128 + 32 h */
        __m512i ql0[8], ql1[8], qh[8];
        turn32(row, off + 64 * h, ql0);
        turn32(row, off + 64 * h + 32, ql1);
        turn32(row, off + 128 + 32 * h, qh);
        for (int r = 0; r < 4; ++r) { /* sub-block 4 h + r: ql's low (r < 2) or high nibbles, qh's bits 2r, 2r + 1 */
          const __m512i *ql = r & 1 ? ql1 : ql0;
          uint8_t *ob = o + (s * 8 + 4 * h + r) * 8 * 64;
          for (int t = 0; t < 8; ++t) {
            const __m512i lo = _mm512_and_si512(_mm512_srli_epi16(ql[t], 4 * (r >> 1)), low);
            const __m512i hi = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh[t], 2 * r), two), 4);
            _mm512_store_si512((void *)(ob + t * 64), _mm512_or_si512(lo, hi));
          }
        }
      }
    }
  }
  *p = (packed_t){buf, sc, NULL, panels, nb, ng, 1, 2};
  return 0;
}

/* Panels q..q + np - 1 against P_MT rows of x (qx, dx, xg: the first row's; past the live ones, zero rows of a
 * padded copy) into rows m0..m0 + mt - 1 of y, columns n.. (at most n_live of them). One instance per np and bits4, so
 * the file compiles in seconds (one per count of rows took 37 s): the row tail is padded; 4-bit and 8-bit
 * differ only in where x is read (xs: columns per step, xh: the second dword's offset). */
static inline __attribute__((always_inline)) void kernel(const qjob_t *j, const qpart_t *a, const packed_t *p, int64_t q,
                                                          const int np, const int8_t *qx, const float *dx, const float *xg,
                                                          const int32_t *xz, int64_t m0, int mt, int64_t n, int64_t n_live,
                                                          const int bits4, const int halves) {
  const int64_t nb = p->nb, xrow = nb * 32, xs = bits4 ? 4 : 8, xh = bits4 ? 16 : 4;
  const uint8_t *wc = p->codes + q * nb * 8 * 64;
  __m512 acc[P_MT][P_NP];
  for (int m = 0; m < P_MT; ++m)
    for (int r = 0; r < np; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t b = 0, g = 0, left = p->spg; b < nb; ++b) {
    __m512i ia[P_MT][P_NP];
    for (int m = 0; m < P_MT; ++m)
      for (int r = 0; r < np; ++r) ia[m][r] = halves == 2 ? _mm512_set1_epi32(xz[m * 2 * nb + 2 * b]) : _mm512_setzero_si512();
    for (int t = 0; t < 4; ++t) { /* 8 columns of each row: 4-bit j..j + 3 and j + 16..; 8-bit j..j + 7 */
      __m512i lo[P_NP], hi[P_NP];
      for (int r = 0; r < np; ++r) {
        const uint8_t *wr = wc + r * nb * 8 * 64;
        lo[r] = _mm512_load_si512((const void *)(wr + (b * 8 + 2 * t) * 64));
        hi[r] = _mm512_load_si512((const void *)(wr + (b * 8 + 2 * t + 1) * 64));
      }
      for (int m = 0; m < P_MT; ++m) {
        const int8_t *xm = qx + m * xrow + b * 32 + xs * t;
        int32_t x4[2];
        memcpy(&x4[0], xm, 4);
        memcpy(&x4[1], xm + xh, 4);
        const __m512i xl = _mm512_set1_epi32(x4[0]), xr = _mm512_set1_epi32(x4[1]);
        for (int r = 0; r < np; ++r) ia[m][r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(ia[m][r], lo[r], xl), hi[r], xr);
      }
      if (halves && t == 1) { /* columns 0-15 are a group of their own: close it, as the group step below */
        const float *sg = p->scales + (q * p->ng + g) * P_LANES;
        for (int m = 0; m < P_MT; ++m) {
          const __m512 d = _mm512_set1_ps(dx[m * nb + b]);
          for (int r = 0; r < np; ++r) {
            acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[m][r]), _mm512_mul_ps(d, _mm512_load_ps(sg + r * p->ng * P_LANES)), acc[m][r]);
            if (halves == 1) {
              const float *mg = p->mins + (q * p->ng + g) * P_LANES;
              acc[m][r] = _mm512_fnmadd_ps(_mm512_load_ps(mg + r * p->ng * P_LANES), _mm512_set1_ps(xg[m * p->ng + g]), acc[m][r]);
            }
            ia[m][r] = halves == 2 ? _mm512_set1_epi32(xz[m * 2 * nb + 2 * b + 1]) : _mm512_setzero_si512();
          }
        }
        ++g;
      }
    }
    const float *sg = p->scales + (q * p->ng + g) * P_LANES;
    for (int m = 0; m < P_MT; ++m) {
      const __m512 d = _mm512_set1_ps(dx[m * nb + b]);
      for (int r = 0; r < np; ++r)
        acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[m][r]), _mm512_mul_ps(d, _mm512_load_ps(sg + r * p->ng * P_LANES)), acc[m][r]);
    }
    if (--left == 0) { /* the group's last sub-block: its mins (and 8-bit) term, then the next group */
      if (halves != 2 && p->mins) {
        const float *mg = p->mins + (q * p->ng + g) * P_LANES;
        for (int m = 0; m < P_MT; ++m) {
          const __m512 xm = _mm512_set1_ps(xg[m * p->ng + g]);
          for (int r = 0; r < np; ++r) acc[m][r] = _mm512_fnmadd_ps(_mm512_load_ps(mg + r * p->ng * P_LANES), xm, acc[m][r]);
        }
      }
      ++g;
      left = p->spg;
    }
  }
  for (int m = 0; m < mt; ++m)
    for (int r = 0; r < np; ++r) {
      const int64_t c0 = n + r * P_LANES, live = n_live - r * P_LANES < P_LANES ? n_live - r * P_LANES : P_LANES;
      if (live == P_LANES && !j->y_bf16 && !a->w.bias) {
        _mm512_storeu_ps((float *)a->y + (m0 + m) * j->ldy + c0, acc[m][r]);
      } else {
        float v[P_LANES];
        _mm512_storeu_ps(v, acc[m][r]);
        for (int64_t l = 0; l < live; ++l) put_q(j, a, m0 + m, c0 + l, v[l]);
      }
    }
}

static void panels_of(const qjob_t *j, const qpart_t *a, const packed_t *p, int64_t n0, int64_t n1, const int8_t *qx,
                      const float *dx, const float *xg, const int32_t *xz, int64_t m0, int mt) {
#define P_CALL(np, bits4, halves) kernel(j, a, p, q, np, qx, dx, xg, xz, m0, mt, n0 + q * P_LANES, n1 - n0 - q * P_LANES, bits4, halves)
  int64_t q = 0;
  for (; q + P_NP <= p->panels; q += P_NP) {
    if (a->w.bits4 || kq_q5(a->w.kind)) P_CALL(P_NP, 1, 0);
    else if (p->halves == 2) P_CALL(P_NP, 0, 2);
    else if (p->halves) P_CALL(P_NP, 0, 1);
    else P_CALL(P_NP, 0, 0);
  }
  for (; q < p->panels; ++q) {
    if (a->w.bits4 || kq_q5(a->w.kind)) P_CALL(1, 1, 0);
    else if (p->halves == 2) P_CALL(1, 0, 2);
    else if (p->halves) P_CALL(1, 0, 1);
    else P_CALL(1, 0, 0);
  }
#undef P_CALL
}

int q_panels(const qjob_t *j, const qpart_t *a, int64_t n0, int64_t n1) {
  packed_t p;
  const int kind = a->w.kind;
  const int status = !kind ? pack(&a->w, n0, n1, &p) : kq_q5(kind) ? pack_q5(&a->w, n0, n1, &p)
                     : kq_zero_folded(kind) ? pack_q6(&a->w, n0, n1, &p) : pack_blocks(&a->w, n0, n1, &p);
  if (status) return -1;
  const int64_t nb = p.nb, ng = p.ng, whole = j->M / P_MT * P_MT;
  static float zeros[1]; /* xg for parts with no mins term (never read: p.mins is NULL) */
  const float *xg = a->xg ? a->xg : zeros;
  int64_t xg_row = a->xg ? ng : 0;
  if (a->w.kind) { /* ggml blocks: X_j per group of 32 is quant.c's xs, per 16 kq_sums16's */
    xg = p.halves ? j->xs16 : j->dx + j->M * nb;
    xg_row = ng;
  }
  const int32_t *xz = p.halves == 2 ? j->xz16 : NULL; /* Q6_K: -32 Σ q per 16 values, [M, nb * 2] */
  for (int64_t m0 = 0; m0 < whole; m0 += P_MT) /* these rows of x stay in L1 while the chunk's panels pass */
    panels_of(j, a, &p, n0, n1, j->qx + m0 * nb * 32, j->dx + m0 * nb, xg + m0 * xg_row, xz ? xz + m0 * nb * 2 : NULL,
              m0, P_MT);
  if (whole < j->M) { /* the last rows, with zero rows after them */
    const int mt = (int)(j->M - whole);
    static __thread void *pad_buffer;
    static __thread int64_t pad_bytes;
    const int64_t qbytes = P_MT * nb * 32, bytes = qbytes + (P_MT * nb + P_MT * ng + P_MT * nb * 2) * 4;
    int8_t *pad = pool_scratch(&pad_buffer, &pad_bytes, bytes);
    if (!pad) return -1;
    float *pdx = (float *)(pad + qbytes), *pxg = pdx + P_MT * nb;
    int32_t *pxz = (int32_t *)(pxg + P_MT * ng); /* zero rows of x: Σ q = 0 */
    memset(pad, 0, (size_t)bytes);
    memcpy(pad, j->qx + whole * nb * 32, (size_t)(mt * nb * 32));
    memcpy(pdx, j->dx + whole * nb, (size_t)(mt * nb) * 4);
    if (xg_row) memcpy(pxg, xg + whole * ng, (size_t)(mt * ng) * 4);
    if (xz) memcpy(pxz, xz + whole * nb * 2, (size_t)(mt * nb * 2) * 4);
    panels_of(j, a, &p, n0, n1, pad, pdx, xg_row ? pxg : zeros, xz ? pxz : NULL, whole, mt);
  }
  return 0;
}
#endif
