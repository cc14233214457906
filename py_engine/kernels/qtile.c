/* Rows of x (decode, batches, short prompt chunks) against quantized weights in "virtual panels": V rows of W
 * (16 on AVX-512 builds, 8 on AVX2) read in place and turned in registers so that each vector lane is one row
 * of W, as qpanel.c's packed panels hold them. A sub-block's 32 codes of the V rows become 8 vectors of 4 bytes
 * per lane (4-bit: 4 low nibbles, then the 4 high ones of the same dword; 8-bit: 4 codes), each meeting 4 bytes
 * of x broadcast to every lane in one u8 x s8 dot (vpdpbusd, or maddubs + madd): lane r then holds the exact
 * integer I = Σ_j c_j q_j of row r and the x row's sub-block.
 *
 * One arithmetic wherever a token is computed (quant.h, "the canonical sum"): after each sub-block b,
 *   acc = fma(float(I_b), d_b * s_g, acc)      and, at the end of each group g,   acc = acc - mn_g * X_g  (fused)
 * the same operations, in the same order, as qpanel.c's panels (prefill) per lane. The integers are exact and the
 * float steps are per lane, so a row of x gets the same bits whether it comes alone (decode), in a batch of the
 * server, in a speculative step's k + 1 rows or in a prompt chunk of any length, and on every variant of the
 * build: AVX2 lanes do what AVX-512 lanes do. 8-bit codes are stored c - 128; the unsigned code c + 128 goes into
 * the dot (VNNI: a sign-bit flip; maddubs would saturate, so there |c - 128| meets x with c's sign, and 128 Σq
 * is added back as an integer) and mn_g carries the 128 s_g X_g that comes off.
 *
 * Lane L of a block holds row PERM(L) of it (the 4 x 4 dword transposes below leave that order); the scales are
 * gathered and the outputs stored in the same order, and rows past the matrix's end repeat its last row (read,
 * never stored).
 */
#include "quant.h"

#ifndef VT_X
#define VT_X 4 /* rows of x per pass over a block of W rows (the codes are turned once per pass) */
#endif

/* The unsigned codes of a sub-block as 8 dword vectors: 4-bit t = 0..3 low nibbles (columns 4t..4t+3) and t = 4..7
 * their high nibbles (16 + 4(t - 4)..); 8-bit t = 0..7 columns 4t..4t+3 (c + 128 with VNNI, else c - 128 as stored,
 * signed). xoff[t]: the byte of x's sub-block that dword t meets. */
static const int XOFF4[8] = {0, 4, 8, 12, 16, 20, 24, 28}; /* 4-bit: lo t at 4t, hi t at 16 + 4t: the same list */

#ifdef __AVX512BW__
#define VT_ROWS 16
#define PERM(L) (4 * ((L) % 4) + (L) / 4)
typedef __m512i vi;
typedef __m512 vf;

/* Four 128-bit rows per vector, a[i] = [r(4i) | r(4i + 1) | r(4i + 2) | r(4i + 3)], transposed by dwords within
 * each 128-bit lane: out[t] lane 4k + i = dword t of row 4i + k. */
static inline void transpose4(const vi *a, vi *out) {
  const vi t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
  const vi t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
  out[0] = _mm512_unpacklo_epi64(t0, t2), out[1] = _mm512_unpackhi_epi64(t0, t2);
  out[2] = _mm512_unpacklo_epi64(t1, t3), out[3] = _mm512_unpackhi_epi64(t1, t3);
}

static inline vi load4x128(const uint8_t *const *row, int i, int64_t off) {
  vi v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(row[4 * i] + off)));
  v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(row[4 * i + 1] + off)), 1);
  v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(row[4 * i + 2] + off)), 2);
  return _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(row[4 * i + 3] + off)), 3);
}

/* Sub-block b of the 16 rows as 8 dword vectors (see XOFF4). */
static inline void codes_of(const uint8_t *const *row, int64_t b, int bits4, vi *c) {
  vi a[4];
  if (bits4) {
    for (int i = 0; i < 4; ++i) a[i] = load4x128(row, i, b * 16);
    vi d[4];
    transpose4(a, d);
    const vi low = _mm512_set1_epi8(0x0f);
    for (int t = 0; t < 4; ++t) {
      c[t] = _mm512_and_si512(d[t], low);
      c[4 + t] = _mm512_and_si512(_mm512_srli_epi16(d[t], 4), low);
    }
    return;
  }
  for (int h = 0; h < 2; ++h) { /* columns 0-15, then 16-31 */
    for (int i = 0; i < 4; ++i) a[i] = load4x128(row, i, b * 32 + 16 * h);
    transpose4(a, c + 4 * h);
  }
#ifdef __AVX512VNNI__
  for (int t = 0; t < 8; ++t) c[t] = _mm512_xor_si512(c[t], _mm512_set1_epi8((char)0x80));
#endif
}

static inline vi bcast(const int8_t *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

/* I for one x row's sub-block (q: its 32 int8) against the codes. */
static inline vi dot_block(const vi *c, const int8_t *q, int bits4) {
  vi acc = _mm512_setzero_si512();
#ifdef __AVX512VNNI__
  (void)bits4;
  for (int t = 0; t < 8; ++t) acc = _mm512_dpbusd_epi32(acc, c[t], bcast(q + XOFF4[t]));
#else
  const vi ones = _mm512_set1_epi16(1);
  if (bits4) {
    for (int t = 0; t < 8; ++t)
      acc = _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(c[t], bcast(q + XOFF4[t])), ones));
  } else { /* |c - 128| against x with its sign, then 128 Σq back (integers: exact) */
    for (int t = 0; t < 8; ++t) {
      const vi x = bcast(q + XOFF4[t]);
      const __mmask64 neg = _mm512_movepi8_mask(c[t]), zero = _mm512_testn_epi8_mask(c[t], c[t]);
      const vi xs = _mm512_maskz_mov_epi8(~zero, _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x));
      acc = _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(c[t]), xs), ones));
    }
    int32_t sum = 0;
    for (int k = 0; k < 32; ++k) sum += q[k];
    acc = _mm512_add_epi32(acc, _mm512_set1_epi32(128 * sum));
  }
#endif
  return acc;
}

static inline vf vf_gather(const float *base, vi idx) { return _mm512_i32gather_ps(idx, base, 4); }
static inline vf vf_set1(float v) { return _mm512_set1_ps(v); }
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_fold(vf acc, vi I, vf d, vf s) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(d, s), acc); }
static inline vf vf_mins(vf acc, vf mn, vf xg) { return _mm512_fnmadd_ps(mn, xg, acc); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vi vi_rows(int64_t stride, int live) { /* lane L: row min(PERM(L), live - 1) times stride */
  int32_t r[VT_ROWS];
  for (int L = 0; L < VT_ROWS; ++L) r[L] = (int32_t)((PERM(L) < live ? PERM(L) : live - 1) * stride);
  return _mm512_loadu_si512((const void *)r);
}
static inline vi vi_add(vi a, int32_t b) { return _mm512_add_epi32(a, _mm512_set1_epi32(b)); }

#else /* AVX2: 8 rows a block */
#define VT_ROWS 8
#define PERM(L) (2 * ((L) % 4) + (L) / 4)
typedef __m256i vi;
typedef __m256 vf;

/* a[i] = [r(2i) | r(2i + 1)] (128 bits each): out[t] lane 4k + i = dword t of row 2i + k. */
static inline void transpose4(const vi *a, vi *out) {
  const vi t0 = _mm256_unpacklo_epi32(a[0], a[1]), t1 = _mm256_unpackhi_epi32(a[0], a[1]);
  const vi t2 = _mm256_unpacklo_epi32(a[2], a[3]), t3 = _mm256_unpackhi_epi32(a[2], a[3]);
  out[0] = _mm256_unpacklo_epi64(t0, t2), out[1] = _mm256_unpackhi_epi64(t0, t2);
  out[2] = _mm256_unpacklo_epi64(t1, t3), out[3] = _mm256_unpackhi_epi64(t1, t3);
}

static inline vi load2x128(const uint8_t *const *row, int i, int64_t off) {
  return _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(row[2 * i + 1] + off)),
                          _mm_loadu_si128((const __m128i *)(row[2 * i] + off)));
}

static inline void codes_of(const uint8_t *const *row, int64_t b, int bits4, vi *c) {
  vi a[4];
  if (bits4) {
    for (int i = 0; i < 4; ++i) a[i] = load2x128(row, i, b * 16);
    vi d[4];
    transpose4(a, d);
    const vi low = _mm256_set1_epi8(0x0f);
    for (int t = 0; t < 4; ++t) {
      c[t] = _mm256_and_si256(d[t], low);
      c[4 + t] = _mm256_and_si256(_mm256_srli_epi16(d[t], 4), low);
    }
    return;
  }
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 4; ++i) a[i] = load2x128(row, i, b * 32 + 16 * h);
    transpose4(a, c + 4 * h);
  }
}

static inline vi bcast(const int8_t *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

static inline vi dot_block(const vi *c, const int8_t *q, int bits4) {
  vi acc = _mm256_setzero_si256();
  const vi ones = _mm256_set1_epi16(1);
  if (bits4) {
    for (int t = 0; t < 8; ++t)
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(c[t], bcast(q + XOFF4[t])), ones));
    return acc;
  }
  for (int t = 0; t < 8; ++t) /* |c - 128| against x with c's sign (sign_epi8 zeroes where c is 0) */
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(c[t], c[t]),
                                                                       _mm256_sign_epi8(bcast(q + XOFF4[t]), c[t])), ones));
  int32_t sum = 0;
  for (int k = 0; k < 32; ++k) sum += q[k];
  return _mm256_add_epi32(acc, _mm256_set1_epi32(128 * sum));
}

static inline vf vf_gather(const float *base, vi idx) { return _mm256_i32gather_ps(base, idx, 4); }
static inline vf vf_set1(float v) { return _mm256_set1_ps(v); }
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_fold(vf acc, vi I, vf d, vf s) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_mul_ps(d, s), acc); }
static inline vf vf_mins(vf acc, vf mn, vf xg) { return _mm256_fnmadd_ps(mn, xg, acc); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vi vi_rows(int64_t stride, int live) {
  int32_t r[VT_ROWS];
  for (int L = 0; L < VT_ROWS; ++L) r[L] = (int32_t)((PERM(L) < live ? PERM(L) : live - 1) * stride);
  return _mm256_loadu_si256((const __m256i *)r);
}
static inline vi vi_add(vi a, int32_t b) { return _mm256_add_epi32(a, _mm256_set1_epi32(b)); }
#endif

/* Rows n..n + live - 1 of W (live <= VT_ROWS) against rows m0..m0 + mt - 1 of x (mt <= VT_X). */
static inline __attribute__((always_inline)) void vblock(const qjob_t *j, const qpart_t *a, int64_t n, int live,
                                                          int64_t m0, const int mt, const int bits4) {
  const qmat_t *w = &a->w;
  const int64_t nb = nb_of(w), rb = row_bytes(w), ng = w->ng, xrow = nb * 32;
  const int corr = has_mins(w) || !bits4;
  const uint8_t *row[VT_ROWS];
  for (int L = 0; L < VT_ROWS; ++L) row[L] = w->codes + (n + (L < live ? L : live - 1)) * rb;
  const vi groups = vi_rows(ng, live); /* lane L: PERM(L)'s first scale, relative to row n's */
  const float *s0 = w->scales + n * ng, *m0s = w->mins ? w->mins + n * ng : NULL;
  vf acc[VT_X];
  for (int m = 0; m < mt; ++m) acc[m] = vf_zero();
  for (int64_t g = 0, b = 0; g < ng; ++g) {
    const vi at = vi_add(groups, (int32_t)g);
    const vf s = vf_gather(s0, at);
    for (int64_t e = b + w->spg; b < e; ++b) {
      if (!(b & (bits4 ? 3 : 1))) /* a line of each row, Q_PREFETCH bytes ahead */
        for (int L = 0; L < live; ++L) _mm_prefetch((const char *)row[L] + b * (bits4 ? 16 : 32) + Q_PREFETCH, Q_HINT);
      vi c[8];
      codes_of(row, b, bits4, c);
      for (int m = 0; m < mt; ++m) {
        const int8_t *q = j->qx + (m0 + m) * xrow + b * 32;
        acc[m] = vf_fold(acc[m], dot_block(c, q, bits4), vf_set1(j->dx[(m0 + m) * nb + b]), s);
      }
    }
    if (corr) { /* mn = (mins, or zp s) + 128 s for 8-bit codes: qpanel.c's pack() in the same roundings */
      vf mn = m0s ? vf_gather(m0s, at) : vf_mul(vf_set1(w->zp), s);
      if (!bits4) mn = vf_add(mn, vf_mul(vf_set1(128.f), s));
      for (int m = 0; m < mt; ++m) acc[m] = vf_mins(acc[m], mn, vf_set1(a->xg[(m0 + m) * ng + g]));
    }
  }
  for (int m = 0; m < mt; ++m) {
    float v[VT_ROWS];
    vf_store(v, acc[m]);
    for (int L = 0; L < VT_ROWS; ++L)
      if (PERM(L) < live) put_q(j, a, m0 + m, n + PERM(L), v[L]);
  }
}

#define VBLOCK_CASES(BITS4)                                                                                  \
  switch (mt) {                                                                                              \
  case 1: vblock(j, a, n, live, m0, 1, BITS4); break;                                                        \
  case 2: vblock(j, a, n, live, m0, 2, BITS4); break;                                                        \
  case 3: vblock(j, a, n, live, m0, 3, BITS4); break;                                                        \
  default: vblock(j, a, n, live, m0, VT_X, BITS4); break;                                                    \
  }

void q_tiles(const qjob_t *j, const qpart_t *a, int64_t n0, int64_t n1) {
  _Static_assert(VT_X == 4, "VBLOCK_CASES spells out 1..3 and VT_X");
#if Q_ROWS_BUILT
  if (j->M <= Q_ROWS_MAX && q_rows(j, a, n0, n1) == 0) return; /* qrow.c: the same bits, no codes turned */
#endif
  for (int64_t n = n0; n < n1; n += VT_ROWS) {
    const int live = n1 - n < VT_ROWS ? (int)(n1 - n) : VT_ROWS;
    for (int64_t m0 = 0; m0 < j->M; m0 += VT_X) {
      const int mt = j->M - m0 < VT_X ? (int)(j->M - m0) : VT_X;
      if (a->w.bits4) { VBLOCK_CASES(1) } else { VBLOCK_CASES(0) }
    }
  }
}

/* ggml's Q5_0 and Q5_1 blocks (kquant.c's layout: kind 6 or 7, a block is one sub-block of 32 values), read in
 * place in the same virtual panels. Q5_0 is [d fp16][qh 4][qs 16], Q5_1 [d fp16][m fp16][qh 4][qs 16]: qs is
 * Q4_0's nibble order, so a sub-block's 16 rows turn as 4-bit codes do, then bit k of qh (value k's fifth bit)
 * adds 16 to code k. Per block b of row n, w = d_b (c - 16) (Q5_0) or d_b c + m_b (Q5_1), so the canonical sum
 * with s = d_b and mn = 16 d_b or -m_b (the group is the block; X_b is quant.c's xs):
 *     acc = fma(float(I_b), dx_b * d_b, acc);  acc = fnma(mn_b, X_b, acc)
 * lane for lane as qpanel.c's panels of the same blocks (pack_blocks: s_j = d * 1, Z_j = kquant.c's z[0]), so
 * decode, batches and prompt chunks give a row the same bits. The scales come in by one gather a block (d, and
 * m beside it), qh by another. */
#ifdef __AVX512BW__
static inline vi vi_gather(const uint8_t *base, vi at) { return _mm512_i32gather_epi32(at, (const void *)base, 1); }
static inline vf half_lo(vi v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); } /* the low half of each dword */
static inline vi vi_srl16(vi v) { return _mm512_srli_epi32(v, 16); }
static inline vf vf_neg(vf v) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u))); }

static inline void codes4_at(const uint8_t *const *row, int64_t off, vi *c) { /* codes_of's 4-bit turn at off */
  vi a[4], d[4];
  for (int i = 0; i < 4; ++i) a[i] = load4x128(row, i, off);
  transpose4(a, d);
  const vi low = _mm512_set1_epi8(0x0f);
  for (int t = 0; t < 4; ++t) {
    c[t] = _mm512_and_si512(d[t], low);
    c[4 + t] = _mm512_and_si512(_mm512_srli_epi16(d[t], 4), low);
  }
}

/* c[t] (columns 4t'..4t'+3 of XOFF4's order: qh bits 4t..4t + 3) += 16 where the lane's qh bit is set: byte t/2 of
 * each dword spread over its 4 bytes, then each byte tests its own bit. */
static inline void fifth_bits(vi qh, vi *c) {
  for (int t = 0; t < 8; t += 2) {
    const vi rep = _mm512_shuffle_epi8(qh, _mm512_add_epi8(_mm512_set4_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0),
                                                           _mm512_set1_epi8((char)(t >> 1))));
    for (int h = 0; h < 2; ++h) {
      const __mmask64 k = _mm512_test_epi8_mask(rep, _mm512_set1_epi32((int)(0x08040201u << (4 * h))));
      c[t + h] = _mm512_mask_add_epi8(c[t + h], k, c[t + h], _mm512_set1_epi8(16));
    }
  }
}
#else
static inline vi vi_gather(const uint8_t *base, vi at) { return _mm256_i32gather_epi32((const int *)base, at, 1); }
static inline vf half_lo(vi v) { /* the low half of each dword as float, exactly (integer AVX2: no F16C here) */
  const vi h = _mm256_and_si256(v, _mm256_set1_epi32(0xffff)), em = _mm256_and_si256(h, _mm256_set1_epi32(0x7fff));
  const vf normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(em, 13), _mm256_set1_epi32(0x38000000)));
  const vf tiny = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(0x1p-24f)); /* subnormals: m 2^-24, exact */
  vf f = _mm256_blendv_ps(normal, tiny, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(0x400), em)));
  const vi special = _mm256_cmpgt_epi32(em, _mm256_set1_epi32(0x7bff)); /* inf, NaN */
  f = _mm256_or_ps(f, _mm256_castsi256_ps(_mm256_and_si256(special, _mm256_set1_epi32(0x7f800000))));
  return _mm256_or_ps(f, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0x8000)), 16)));
}
static inline vi vi_srl16(vi v) { return _mm256_srli_epi32(v, 16); }
static inline vf vf_neg(vf v) { return _mm256_xor_ps(v, _mm256_set1_ps(-0.f)); }

static inline void codes4_at(const uint8_t *const *row, int64_t off, vi *c) {
  vi a[4], d[4];
  for (int i = 0; i < 4; ++i) a[i] = load2x128(row, i, off);
  transpose4(a, d);
  const vi low = _mm256_set1_epi8(0x0f);
  for (int t = 0; t < 4; ++t) {
    c[t] = _mm256_and_si256(d[t], low);
    c[4 + t] = _mm256_and_si256(_mm256_srli_epi16(d[t], 4), low);
  }
}

static inline void fifth_bits(vi qh, vi *c) {
  for (int t = 0; t < 8; t += 2) {
    const vi ctl = _mm256_add_epi8(_mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c, 0, 0x04040404, 0x08080808,
                                                     0x0c0c0c0c), _mm256_set1_epi8((char)(t >> 1)));
    const vi rep = _mm256_shuffle_epi8(qh, ctl);
    for (int h = 0; h < 2; ++h) {
      const vi bit = _mm256_set1_epi32((int)(0x08040201u << (4 * h)));
      const vi set = _mm256_cmpeq_epi8(_mm256_and_si256(rep, bit), bit);
      c[t + h] = _mm256_or_si256(c[t + h], _mm256_and_si256(set, _mm256_set1_epi8(16)));
    }
  }
}
#endif

/* Rows n..n + live - 1 of a Q5_0 (kind 6) or Q5_1 (7) matrix against rows m0..m0 + mt - 1 of x. */
static inline __attribute__((always_inline)) void vblock5(const qjob_t *j, const qpart_t *a, int64_t n, int live,
                                                           int64_t m0, const int mt, const int kind) {
  const qmat_t *w = &a->w;
  const int64_t nb = nb_of(w), rb = row_bytes(w), xrow = nb * 32, bb = kind == 6 ? 22 : 24, qs = kind == 6 ? 6 : 8;
  const float *xs = j->dx + j->M * nb; /* X_b = dx_b Σ q_x (quant.c's xs) */
  const uint8_t *base = w->codes + n * rb, *row[VT_ROWS];
  for (int L = 0; L < VT_ROWS; ++L) row[L] = base + (L < live ? L : live - 1) * rb;
  const vi at = vi_rows(rb, live); /* lane L: row PERM(L)'s offset */
  vf acc[VT_X];
  for (int m = 0; m < mt; ++m) acc[m] = vf_zero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t *blk = base + b * bb;
    if (!(b & 1)) /* 44 or 48 bytes of each row per 2 blocks: every line, Q_PREFETCH bytes ahead */
      for (int L = 0; L < live; ++L) _mm_prefetch((const char *)row[L] + b * bb + Q_PREFETCH, Q_HINT);
    const vi head = vi_gather(blk, at), qh = vi_gather(blk + qs - 4, at); /* [d | m or qh's low half], qh */
    const vf d = half_lo(head);
    const vf mn = kind == 6 ? vf_mul(vf_set1(16.f), d) : vf_neg(half_lo(vi_srl16(head)));
    vi c[8];
    codes4_at(row, b * bb + qs, c);
    fifth_bits(qh, c);
    for (int m = 0; m < mt; ++m) {
      const int64_t r = (m0 + m) * nb + b;
      acc[m] = vf_fold(acc[m], dot_block(c, j->qx + (m0 + m) * xrow + b * 32, 1), vf_set1(j->dx[r]), d);
      acc[m] = vf_mins(acc[m], mn, vf_set1(xs[r]));
    }
  }
  for (int m = 0; m < mt; ++m) {
    float v[VT_ROWS];
    vf_store(v, acc[m]);
    for (int L = 0; L < VT_ROWS; ++L)
      if (PERM(L) < live) put_q(j, a, m0 + m, n + PERM(L), v[L]);
  }
}

#define VBLOCK5_CASES(KIND)                                                                                  \
  switch (mt) {                                                                                              \
  case 1: vblock5(j, a, n, live, m0, 1, KIND); break;                                                        \
  case 2: vblock5(j, a, n, live, m0, 2, KIND); break;                                                        \
  case 3: vblock5(j, a, n, live, m0, 3, KIND); break;                                                        \
  default: vblock5(j, a, n, live, m0, VT_X, KIND); break;                                                    \
  }

void q5_tiles(const qjob_t *j, const qpart_t *a, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += VT_ROWS) {
    const int live = n1 - n < VT_ROWS ? (int)(n1 - n) : VT_ROWS;
    for (int64_t m0 = 0; m0 < j->M; m0 += VT_X) {
      const int mt = j->M - m0 < VT_X ? (int)(j->M - m0) : VT_X;
      if (a->w.kind == 6) { VBLOCK5_CASES(6) } else { VBLOCK5_CASES(7) }
    }
  }
}

/* ggml's Q4_K, Q5_K and Q6_K super-blocks (256 values: 8 sub-blocks of 32) in the same virtual panels, summed in
 * the canonical order qpanel.c's pack_blocks panels use: per sub-block b (its scales s_j = D c_j, zero terms Z_j
 * exactly as kquant.c's kq_head makes them: dmin m_j for Q4_K/Q5_K, 32 D c_j for Q6_K)
 *     Q4_K/Q5_K (groups of 32):  acc = fma(float(I_b), dx_b * s_b, acc);  acc = fnma(Z_b, X_b, acc)
 *     Q6_K (groups of 16):       the same for values 0-15 of b (group 2b, X over those 16: kq_sums16), then 16-31.
 * A sub-block's codes lie as bytes in value order (Q4_K/Q5_K: the low or high nibbles of a 32-byte run; Q6_K: ql's
 * nibbles and qh's 2-bit pairs), so 32 bytes of 16 rows turn as 8-bit codes do (two 4 x 4 dword transposes) and
 * each run serves two or four sub-blocks. A block's scales come in by gathers of its header words. */
#ifdef __AVX512BW__
static inline void turn32(const uint8_t *const *row, int64_t off, vi *t) { /* 32 bytes of each row, 4 a lane */
  vi a[4];
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 4; ++i) a[i] = load4x128(row, i, off + 16 * h);
    transpose4(a, t + 4 * h);
  }
}
static inline vi vi_bits(vi v, int shift, int mask) { /* (byte >> shift) & mask, per byte */
  return _mm512_and_si512(_mm512_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm512_set1_epi8((char)mask));
}
static inline vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
static inline vi vi_and32(vi v, int m) { return _mm512_and_si512(v, _mm512_set1_epi32(m)); }
static inline vi vi_srl32(vi v, int n) { return _mm512_srl_epi32(v, _mm_cvtsi32_si128(n)); }
static inline vi vi_sll32(vi v, int n) { return _mm512_sll_epi32(v, _mm_cvtsi32_si128(n)); }
static inline vi vi_sub32(vi v, int k) { return _mm512_sub_epi32(v, _mm512_set1_epi32(k)); }
static inline vi vi_shl4(vi v) { return _mm512_slli_epi16(v, 4); } /* bytes below 16 only: no carry across */
static inline vi add_where(vi c, vi v, int bit, int add) { /* c + add in the bytes where v has bit `bit` */
  return _mm512_mask_add_epi8(c, _mm512_test_epi8_mask(v, _mm512_set1_epi8((char)(1 << bit))), c, _mm512_set1_epi8((char)add));
}
static inline vi vi_field(vi v, int shift, int bits) { /* (dword >> shift) & (2^bits - 1) */
  return _mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(shift)), _mm512_set1_epi32((1 << bits) - 1));
}
static inline vi vi_sbyte(vi v, int k) { /* byte k of each dword, signed */
  return _mm512_srai_epi32(_mm512_sll_epi32(v, _mm_cvtsi32_si128(24 - 8 * k)), 24);
}
static inline vf vf_int(vi v) { return _mm512_cvtepi32_ps(v); }
static inline vi vi_hi16(vi v) { return _mm512_srli_epi32(v, 16); }
static inline vi dot_part(const vi *c, const int8_t *q, int t0, int t1) { /* dwords t0..t1 - 1 of a sub-block */
  vi acc = _mm512_setzero_si512();
  for (int t = t0; t < t1; ++t)
#ifdef __AVX512VNNI__
    acc = _mm512_dpbusd_epi32(acc, c[t], bcast(q + XOFF4[t]));
#else
    acc = _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(c[t], bcast(q + XOFF4[t])), _mm512_set1_epi16(1)));
#endif
  return acc;
}
#else
static inline void turn32(const uint8_t *const *row, int64_t off, vi *t) {
  vi a[4];
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 4; ++i) a[i] = load2x128(row, i, off + 16 * h);
    transpose4(a, t + 4 * h);
  }
}
static inline vi vi_bits(vi v, int shift, int mask) {
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8((char)mask));
}
static inline vi vi_or(vi a, vi b) { return _mm256_or_si256(a, b); }
static inline vi vi_zero(void) { return _mm256_setzero_si256(); }
static inline vi vi_and32(vi v, int m) { return _mm256_and_si256(v, _mm256_set1_epi32(m)); }
static inline vi vi_srl32(vi v, int n) { return _mm256_srl_epi32(v, _mm_cvtsi32_si128(n)); }
static inline vi vi_sll32(vi v, int n) { return _mm256_sll_epi32(v, _mm_cvtsi32_si128(n)); }
static inline vi vi_sub32(vi v, int k) { return _mm256_sub_epi32(v, _mm256_set1_epi32(k)); }
static inline vi vi_shl4(vi v) { return _mm256_slli_epi16(v, 4); }
static inline vi add_where(vi c, vi v, int bit, int add) { /* add is a bit c never has: or = add */
  const vi b = _mm256_set1_epi8((char)(1 << bit));
  return _mm256_or_si256(c, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, b), b), _mm256_set1_epi8((char)add)));
}
static inline vi vi_field(vi v, int shift, int bits) {
  return _mm256_and_si256(_mm256_srl_epi32(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi32((1 << bits) - 1));
}
static inline vi vi_sbyte(vi v, int k) {
  return _mm256_srai_epi32(_mm256_sll_epi32(v, _mm_cvtsi32_si128(24 - 8 * k)), 24);
}
static inline vf vf_int(vi v) { return _mm256_cvtepi32_ps(v); }
static inline vi vi_hi16(vi v) { return _mm256_srli_epi32(v, 16); }
static inline vi dot_part(const vi *c, const int8_t *q, int t0, int t1) {
  vi acc = _mm256_setzero_si256();
  for (int t = t0; t < t1; ++t)
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(c[t], bcast(q + XOFF4[t])), _mm256_set1_epi16(1)));
  return acc;
}
#endif

/* Q4_K/Q5_K's 12 scale bytes (dwords a0, a1, a2 of each lane) -> scale j (mins: m) as 6-bit integers:
 * j < 4: byte j (j + 4) of the 12, low 6 bits; j >= 4: the low (high) nibble of byte j + 4, the top 2 bits of
 * byte j - 4 (j) above it. */
static inline vi k4_scale(vi a0, vi a1, vi a2, int j, int mins) {
  if (j < 4) return vi_field(mins ? a1 : a0, 8 * j, 6);
  const int i = j - 4;
  return vi_or(vi_field(a2, 8 * i + (mins ? 4 : 0), 4), vi_shl4(vi_field(mins ? a1 : a0, 8 * i + 6, 2)));
}

/* Rows n..n + live - 1 of a Q4_K (kind 12), Q5_K (13) or Q6_K (14) matrix against rows m0..m0 + mt - 1 of x. */
static inline __attribute__((always_inline)) void kvblock(const qjob_t *j, const qpart_t *a, int64_t n, int live,
                                                           int64_t m0, const int mt, const int kind) {
  const qmat_t *w = &a->w;
  const int64_t nb = nb_of(w), rb = row_bytes(w), xrow = nb * 32, bb = kq_block_bytes(kind);
  const float *xs = j->dx + j->M * nb; /* per 32: quant.c's xs; per 16 (Q6_K): j->xs16 */
  const uint8_t *base = w->codes + n * rb, *row[VT_ROWS];
  for (int L = 0; L < VT_ROWS; ++L) row[L] = base + (L < live ? L : live - 1) * rb;
  const vi at = vi_rows(rb, live);
  vf acc[VT_X];
  for (int m = 0; m < mt; ++m) acc[m] = vf_zero();
  vi run[8], run1[8], high[8]; /* turned 32-byte runs of codes (Q6_K: two of ql); Q5_K's qh, Q6_K's qh run */
  for (int t = 0; t < 8; ++t) run[t] = run1[t] = high[t] = vi_zero();
  for (int64_t s = 0; s < w->ng; ++s) {
    const int64_t o = s * bb;
    const uint8_t *blk = base + o;
    for (int L = 0; L < live; ++L)
      for (int64_t p = 0; p < bb; p += 64) _mm_prefetch((const char *)row[L] + o + p + Q_PREFETCH, Q_HINT);
    vf sc[16], zc[16]; /* s_j and Z_j of the lanes' blocks (8 groups of 32, or Q6_K's 16 of 16) */
    if (kind == 14) { /* ql[128] qh[64] scales[16] (int8) d: d read with the two scale bytes before it */
      const vf d = half_lo(vi_hi16(vi_gather(blk + 206, at))), d32 = vf_mul(vf_set1(32.f), d);
      for (int q = 0; q < 4; ++q) {
        const vi four = vi_gather(blk + 192 + 4 * q, at);
        for (int k = 0; k < 4; ++k) {
          const vf c = vf_int(vi_sbyte(four, k));
          sc[4 * q + k] = vf_mul(d, c), zc[4 * q + k] = vf_mul(d32, c);
        }
      }
    } else if (kind == 10) { /* Q2_K: scales[16] (scale | min << 4) qs[64] d dmin */
      const vi head = vi_gather(blk + 80, at);
      const vf d = half_lo(head), dmin = half_lo(vi_hi16(head));
      for (int q = 0; q < 4; ++q) {
        const vi four = vi_gather(blk + 4 * q, at);
        for (int k = 0; k < 4; ++k) {
          sc[4 * q + k] = vf_mul(d, vf_int(vi_field(four, 8 * k, 4)));
          zc[4 * q + k] = vf_mul(dmin, vf_int(vi_field(four, 8 * k + 4, 4)));
        }
      }
    } else if (kind == 11) { /* Q3_K: hmask[32] qs[64] scales[12] (6-bit, + 32) d; kquant.c's scales_q3 per lane */
      const vf d = half_lo(vi_hi16(vi_gather(blk + 106, at))), d4 = vf_mul(vf_set1(4.f), d);
      const vi a0 = vi_gather(blk + 96, at), a1 = vi_gather(blk + 100, at), a2 = vi_gather(blk + 104, at);
      for (int q = 0; q < 4; ++q) { /* scales 4q..4q + 3: a nibble of a0 / a1, two bits of a2 above it */
        const vi lowq = vi_and32(q & 2 ? vi_srl32(q & 1 ? a1 : a0, 4) : (q & 1 ? a1 : a0), 0x0f0f0f0f);
        const vi four = vi_or(lowq, vi_sll32(vi_and32(vi_srl32(a2, 2 * q), 0x03030303), 4));
        for (int k = 0; k < 4; ++k) {
          const vf c = vf_int(vi_sub32(vi_field(four, 8 * k, 6), 32));
          sc[4 * q + k] = vf_mul(d, c), zc[4 * q + k] = vf_mul(d4, c);
        }
      }
    } else { /* d dmin scales[12] (Q5_K: qh[32]) qs[128] */
      const vi head = vi_gather(blk, at), a0 = vi_gather(blk + 4, at), a1 = vi_gather(blk + 8, at),
               a2 = vi_gather(blk + 12, at);
      const vf d = half_lo(head), dmin = half_lo(vi_hi16(head));
      for (int g = 0; g < 8; ++g) {
        sc[g] = vf_mul(d, vf_int(k4_scale(a0, a1, a2, g, 0)));
        zc[g] = vf_mul(dmin, vf_int(k4_scale(a0, a1, a2, g, 1)));
      }
    }
    if (kind == 13) turn32(row, o + 16, high);
    for (int b = 0; b < 8; ++b) {
      vi c[8];
      if (kind == 10 || kind == 11) { /* 2-bit codes: qs's 32-byte run h, bits 2r, 2r + 1; Q3_K: hmask bit b is 4 */
        const int h = b >> 2, r = b & 3;
        if (kind == 11 && b == 0) turn32(row, o, high);
        if (r == 0) turn32(row, o + (kind == 10 ? 16 : 32) + 32 * h, run);
        for (int t = 0; t < 8; ++t) {
          c[t] = vi_bits(run[t], 2 * r, 3);
          if (kind == 11) c[t] = add_where(c[t], high[t], b, 4);
        }
      } else if (kind == 14) {
        const int h = b >> 2, r = b & 3; /* ql's runs 64h and 64h + 32: low nibbles for r = 0, 1, high for 2, 3 */
        if (r == 0) {
          turn32(row, o + 128 + 32 * h, high);
          turn32(row, o + 64 * h, run);
          turn32(row, o + 64 * h + 32, run1);
        }
        const vi *ql = r & 1 ? run1 : run;
        for (int t = 0; t < 8; ++t) c[t] = vi_or(vi_bits(ql[t], 4 * (r >> 1), 15), vi_shl4(vi_bits(high[t], 2 * r, 3)));
      } else {
        if (!(b & 1)) turn32(row, o + (kind == 12 ? 16 : 48) + 32 * (b >> 1), run);
        for (int t = 0; t < 8; ++t) {
          c[t] = vi_bits(run[t], 4 * (b & 1), 15);
          if (kind == 13) c[t] = add_where(c[t], high[t], b, 16);
        }
      }
      const int64_t sb = s * 8 + b;
      for (int m = 0; m < mt; ++m) {
        const int64_t r = (m0 + m) * nb + sb;
        const int8_t *q = j->qx + (m0 + m) * xrow + sb * 32;
        const vf dx = vf_set1(j->dx[r]);
        if (kind == 14 || kind == 10 || kind == 11) { /* two groups of 16: values 0-15 (dwords 0-3), then 16-31 */
          acc[m] = vf_fold(acc[m], dot_part(c, q, 0, 4), dx, sc[2 * b]);
          acc[m] = vf_mins(acc[m], zc[2 * b], vf_set1(j->xs16[2 * r]));
          acc[m] = vf_fold(acc[m], dot_part(c, q, 4, 8), dx, sc[2 * b + 1]);
          acc[m] = vf_mins(acc[m], zc[2 * b + 1], vf_set1(j->xs16[2 * r + 1]));
        } else {
          acc[m] = vf_fold(acc[m], dot_part(c, q, 0, 8), dx, sc[b]);
          acc[m] = vf_mins(acc[m], zc[b], vf_set1(xs[r]));
        }
      }
    }
  }
  for (int m = 0; m < mt; ++m) {
    float v[VT_ROWS];
    vf_store(v, acc[m]);
    for (int L = 0; L < VT_ROWS; ++L)
      if (PERM(L) < live) put_q(j, a, m0 + m, n + PERM(L), v[L]);
  }
}

#define KVBLOCK_CASES(KIND)                                                                                  \
  switch (mt) {                                                                                              \
  case 1: kvblock(j, a, n, live, m0, 1, KIND); break;                                                        \
  case 2: kvblock(j, a, n, live, m0, 2, KIND); break;                                                        \
  case 3: kvblock(j, a, n, live, m0, 3, KIND); break;                                                        \
  default: kvblock(j, a, n, live, m0, VT_X, KIND); break;                                                    \
  }

void qk_tiles(const qjob_t *j, const qpart_t *a, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += VT_ROWS) {
    const int live = n1 - n < VT_ROWS ? (int)(n1 - n) : VT_ROWS;
    for (int64_t m0 = 0; m0 < j->M; m0 += VT_X) {
      const int mt = j->M - m0 < VT_X ? (int)(j->M - m0) : VT_X;
      switch (a->w.kind) {
      case 10: KVBLOCK_CASES(10) break;
      case 11: KVBLOCK_CASES(11) break;
      case 12: KVBLOCK_CASES(12) break;
      case 13: KVBLOCK_CASES(13) break;
      default: KVBLOCK_CASES(14) break;
      }
    }
  }
}
