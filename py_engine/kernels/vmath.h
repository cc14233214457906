/* Vector math shared by the kernels (gate.c's SiLU gate, paged.c's softmax). */
#pragma once
#include <immintrin.h>

/* e^x for 8 floats (Cephes' expf as in avx_mathfun: ~1 ulp), clamped to fp32's range. */
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
  __m256 fx = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                            _mm256_set1_ps(0.5f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
  const float c[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                      1.6666665459e-1f, 5.0000001201e-1f};
  __m256 y = _mm256_set1_ps(c[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(c[i]));
  y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, _mm256_mul_ps(x, x)), x), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* What a bf16 tensor would hold of 8 floats (round to nearest even); bf16 0: the floats. */
static inline __m256 stored8(__m256 v, int bf16) {
  if (!bf16) return v;
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd);
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u)));
}

/* silu(g) * u for 8 values (g, u as stored in the dtype) with torch's roundings in bf16: silu in fp32, stored;
 * the product stored. Every SiLU gate of the kernels (prefill's rk_gate, decode's rk_linear_gated, the decode
 * step's LoRA gate) computes each value with this, also in its tail, so a value does not depend on the call. */
static inline __m256 silu_mul8(__m256 g, __m256 u, int bf16) {
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
  const __m256 act = stored8(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), bf16);
  return stored8(_mm256_mul_ps(act, u), bf16);
}

/* silu_mul8 of n <= 8 values from arrays (the rest of a vector padded with zeros). */
static inline void silu_mul_n(const float *g, const float *u, float *out, int n, int bf16) {
  float gb[8] = {0}, ub[8] = {0}, ob[8];
  for (int i = 0; i < n; ++i) gb[i] = g[i], ub[i] = u[i];
  _mm256_storeu_ps(ob, silu_mul8(_mm256_loadu_ps(gb), _mm256_loadu_ps(ub), bf16));
  for (int i = 0; i < n; ++i) out[i] = ob[i];
}
