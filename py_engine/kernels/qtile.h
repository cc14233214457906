/* What qtile.c and qtile_k.c share. Rows of x (decode, batches, short prompt chunks) against quantized weights in "virtual panels": V rows of W
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
#pragma once
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

/* The outputs of a block: acc[m] lane L is row n + PERM(L)'s output for row m0 + m of x. */
static inline void store_tile(const qjob_t *j, const qpart_t *a, int64_t n, int live, int64_t m0, int mt, const vf *acc) {
  for (int m = 0; m < mt; ++m) {
    float v[VT_ROWS];
    vf_store(v, acc[m]);
    for (int L = 0; L < VT_ROWS; ++L)
      if (PERM(L) < live) put_q(j, a, m0 + m, n + PERM(L), v[L]);
  }
}

/* BLOCK(j, a, n, live, m0, mt, ARG) with mt a constant (1, 2, 3 or VT_X), so that each count of x rows unrolls. */
#define TILE_CASES(BLOCK, ARG)                                                                               \
  switch (mt) {                                                                                              \
  case 1: BLOCK(j, a, n, live, m0, 1, ARG); break;                                                           \
  case 2: BLOCK(j, a, n, live, m0, 2, ARG); break;                                                           \
  case 3: BLOCK(j, a, n, live, m0, 3, ARG); break;                                                           \
  default: BLOCK(j, a, n, live, m0, VT_X, ARG); break;                                                       \
  }

/* Every block of VT_ROWS rows of W in n0..n1 against every pass of up to VT_X rows of x: DISPATCH (TILE_CASES). */
#define FOR_TILES(DISPATCH)                                                                                  \
  for (int64_t n = n0; n < n1; n += VT_ROWS) {                                                               \
    const int live = n1 - n < VT_ROWS ? (int)(n1 - n) : VT_ROWS;                                             \
    for (int64_t m0 = 0; m0 < j->M; m0 += VT_X) {                                                            \
      const int mt = j->M - m0 < VT_X ? (int)(j->M - m0) : VT_X;                                             \
      DISPATCH                                                                                               \
    }                                                                                                        \
  }
