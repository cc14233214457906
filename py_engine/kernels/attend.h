/* Attention's small vector pieces, shared by the dense decode step (decode.c) and paged decode
 * (paged.c): loads of fp32 or bf16 rows widened to fp32, dot products, and the int8/int4 codes of a
 * two-tier cache's cold blocks (py_engine/models/kv_quant.py) read as floats. */
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "linear.h" /* load1, hsum8 */

static inline float r(float f, int bf16) { /* the value torch would hold in the tensor's dtype */
  if (!bf16) return f;
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return f;
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u; /* round to nearest even */
  memcpy(&f, &u, 4);
  return f;
}
static inline void st(void *p, int bf16, int64_t i, float v) {
  if (!bf16) {
    ((float *)p)[i] = v;
    return;
  }
  uint32_t u;
  memcpy(&u, &v, 4);
  ((uint16_t *)p)[i] = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0 : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline __m256 load8(const void *p, int bf16, int64_t i) { /* a bf16 is an fp32's top half */
  if (!bf16) return _mm256_loadu_ps((const float *)p + i);
  __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float dot(const float *q, const void *k, int bf16, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k, bf16, i), acc);
  return hsum8(acc);
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

/* acc[0..D) += w * row, row fp32 or bf16. */
static inline void axpy(float *acc, float w, const void *row, int bf16, int64_t D) {
  const __m256 ww = _mm256_set1_ps(w);
  for (int64_t i = 0; i < D; i += 8)
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(ww, load8(row, bf16, i), _mm256_loadu_ps(acc + i)));
}
