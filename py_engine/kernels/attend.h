/* Attention's small vector pieces, shared by the dense decode step (decode.c) and paged decode
 * (paged.c): loads of fp32, bf16 or fp16 rows widened to fp32, dot products, and the int8/int4 codes of a
 * two-tier cache's cold blocks (py_engine/models/kv_quant.py) read as floats.
 *
 * Element types (`t` below; a 0/1 "bf16" flag is the same argument): 0 fp32, 1 bf16, 2 fp16 (IEEE half, the
 * server's --kv-cache-dtype fp16 cache, llama.cpp's default -ctk/-ctv f16). fp16 converts with F16C where the
 * build has it (the AVX-512 variants: every AVX-512 CPU has F16C) and otherwise with integer AVX2 (the plain
 * avx2 variant, the portable one): both exact, and stores round to nearest even as torch's .to(float16). */
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "linear.h" /* load1, hsum8 */

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };

static inline int64_t elem_size(int t) { return t == KV_F32 ? 4 : 2; }

static inline uint16_t f32_to_f16(float f) { /* round to nearest even, as torch's .to(torch.float16) */
#ifdef __F16C__
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  uint32_t x;
  memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x >= 0x47800000u) return (uint16_t)(sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u)); /* >= 2^16: inf, NaN */
  if (x < 0x38800000u) { /* below 2^-14: a subnormal half; adding 0.5 rounds the bits into place */
    float g;
    memcpy(&g, &x, 4);
    g += 0.5f;
    memcpy(&x, &g, 4);
    return (uint16_t)(sign | (x - 0x3f000000u));
  }
  x += 0xc8000fffu + ((x >> 13) & 1u); /* rebias the exponent (15 - 127), round to nearest even */
  return (uint16_t)(sign | (x >> 13));   /* a carry out of 65504 gives inf, as it should */
#endif
}

static inline __m256 f16x8(const uint16_t *p) { /* 8 halves as floats */
#ifdef __F16C__
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
  /* Normals: (exponent, mantissa) moved into a float's place, the exponent rebiased (127 - 15); subnormals
   * (exponent 0): the mantissa as an integer times 2^-24, with no subnormal float arithmetic (exact under
   * flush-to-zero / denormals-are-zero too); an all-ones exponent (inf, NaN) gets the float's all-ones one. */
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
  const __m256i em = _mm256_and_si256(h, _mm256_set1_epi32(0x7fff));
  const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(em, 13), _mm256_set1_epi32(0x38000000)));
  const __m256 tiny = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(0x1p-24f));
  __m256 f = _mm256_blendv_ps(normal, tiny, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(0x400), em)));
  const __m256i special = _mm256_cmpgt_epi32(em, _mm256_set1_epi32(0x7bff));
  f = _mm256_or_ps(f, _mm256_castsi256_ps(_mm256_and_si256(special, _mm256_set1_epi32(0x7f800000))));
  return _mm256_or_ps(f, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0x8000)), 16)));
#endif
}

static inline float r(float f, int bf16) { /* the value torch would hold in the tensor's dtype */
  if (!bf16) return f;
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return f;
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u; /* round to nearest even */
  memcpy(&f, &u, 4);
  return f;
}
static inline void st(void *p, int bf16, int64_t i, float v) { /* bf16: the element type t */
  if (bf16 == KV_F16) {
    ((uint16_t *)p)[i] = f32_to_f16(v);
    return;
  }
  if (!bf16) {
    ((float *)p)[i] = v;
    return;
  }
  uint32_t u;
  memcpy(&u, &v, 4);
  ((uint16_t *)p)[i] = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0 : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline __m256 load8_kv(const void *p, int dtype, int64_t i) { /* linear.h's load8, and fp16 (KV_F16) */
  return dtype == KV_F16 ? f16x8((const uint16_t *)p + i) : load8(p, dtype, i);
}

static inline float dot(const float *q, const void *k, int bf16, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8_kv(k, bf16, i), acc);
  return hsum8(acc);
}

/* dot() of q against 8 rows k, k + stride, ... (stride in elements), each the same bits as dot() gives it: the
 * same chain per row, and hsum8's tree ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)) for 8 rows at once
 * (3 shuffle-and-add steps instead of 8 hsum8s): 8 independent FMA chains where one row's was latency-bound. */
static inline void dot8_rows(const float *q, const void *k, int64_t stride, int bf16, int64_t n, float *out) {
  const int64_t esz = bf16 == KV_F32 ? 4 : 2;
  __m256 acc[8];
  for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int r = 0; r < 8; ++r)
      acc[r] = _mm256_fmadd_ps(qv, load8_kv((const char *)k + r * stride * esz, bf16, i), acc[r]);
  }
  __m256 t[4], u[2];
  for (int p = 0; p < 4; ++p) /* [a0+a4 a1+a5 a2+a6 a3+a7 | b0+b4 ...] for rows 2p (a), 2p + 1 (b) */
    t[p] = _mm256_add_ps(_mm256_permute2f128_ps(acc[2 * p], acc[2 * p + 1], 0x20),
                         _mm256_permute2f128_ps(acc[2 * p], acc[2 * p + 1], 0x31));
  for (int p = 0; p < 2; ++p) { /* per 128 bits: [s0+s2 s1+s3] of rows 4p, 4p + 2 | 4p + 1, 4p + 3 */
    const __m256d x = _mm256_castps_pd(t[2 * p]), y = _mm256_castps_pd(t[2 * p + 1]);
    u[p] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  float v[8]; /* hadd: rows 0, 2, 4, 6 | 1, 3, 5, 7 */
  _mm256_storeu_ps(v, _mm256_hadd_ps(u[0], u[1]));
  out[0] = v[0], out[2] = v[1], out[4] = v[2], out[6] = v[3], out[1] = v[4], out[3] = v[5], out[5] = v[6], out[7] = v[7];
}

static inline __m256 codes8(const uint8_t *c, int bits, int64_t i) { /* codes i..i+7 as floats */
  if (bits == 8) return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + i))));
  uint32_t x;
  memcpy(&x, c + i / 2, 4); /* 8 nibbles: code j is (x >> 4 j) & 15 */
  const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)x), sh), _mm256_set1_epi32(15)));
}

/* (q * scale) . codes of one cold key row: qs holds q * scale (the block's per-channel scales). */
static inline float cold_dot(const float *qs, const uint8_t *code, int bits, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qs + i), codes8(code, bits, i), acc);
  return hsum8(acc);
}

/* acc[0..D) += w * codes of one cold value row (w: the weight times the row's scale). */
static inline void cold_axpy(float *acc, float w, const uint8_t *code, int bits, int64_t D) {
  const __m256 ww = _mm256_set1_ps(w);
  for (int64_t i = 0; i < D; i += 8)
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(ww, codes8(code, bits, i), _mm256_loadu_ps(acc + i)));
}

/* acc[0..D) += w * row, row of element type t (fp32, bf16, fp16). */
static inline void axpy(float *acc, float w, const void *row, int bf16, int64_t D) {
  const __m256 ww = _mm256_set1_ps(w);
  for (int64_t i = 0; i < D; i += 8)
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(ww, load8_kv(row, bf16, i), _mm256_loadu_ps(acc + i)));
}

/* C vectors (8 columns each) of acc from column i0, over rows s = 0..n - 1 in order: acc += (p[s] / sum) row_s,
 * axpy's operations with the vectors held in registers (axpy stores and reloads acc for every row). */
static inline __attribute__((always_inline)) void axpy_cols(float *acc, const float *p, float sum, const char *rows,
                                                             int64_t row_bytes, int bf16, int64_t i0, const int C,
                                                             int64_t n) {
  __m256 r[8];
  for (int j = 0; j < C; ++j) r[j] = _mm256_loadu_ps(acc + i0 + 8 * j);
  for (int64_t s = 0; s < n; ++s) {
    const __m256 ww = _mm256_set1_ps(p[s] / sum);
    for (int j = 0; j < C; ++j) r[j] = _mm256_fmadd_ps(ww, load8_kv(rows + s * row_bytes, bf16, i0 + 8 * j), r[j]);
  }
  for (int j = 0; j < C; ++j) _mm256_storeu_ps(acc + i0 + 8 * j, r[j]);
}

/* acc[0..D) += (p[s] / sum) * rows[s] for s = 0..n - 1 (rows D elements apart), exactly as n axpy calls in order. */
static inline void axpy_rows(float *acc, const float *p, float sum, const void *rows, int bf16, int64_t D, int64_t n) {
  const char *r = rows;
  const int64_t row_bytes = D * (bf16 == KV_F32 ? 4 : 2);
  int64_t i0 = 0;
  for (; i0 + 64 <= D; i0 += 64) axpy_cols(acc, p, sum, r, row_bytes, bf16, i0, 8, n);
  for (; i0 + 32 <= D; i0 += 32) axpy_cols(acc, p, sum, r, row_bytes, bf16, i0, 4, n);
  for (; i0 < D; i0 += 8) axpy_cols(acc, p, sum, r, row_bytes, bf16, i0, 1, n);
}
