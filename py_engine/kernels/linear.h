/* What linear.c, quant.c and step.c share: one product's description and how results are stored. */
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* fp32 a [k] . x [k]: decode's fp32 weight rows (linear.c) and LoRA's A x (step.c). In AVX-512 builds 512 bits a
 * load: a core streams ~10% more bytes/s than with 256-bit loads (benchmarks/mem_bandwidth.py), and a decode
 * GEMV is a stream (the Qwen2.5-0.5B step's GEMVs: 13.3 -> 15.7 GB/s per core, weights in 2 MiB pages).
 * Four accumulators hide the FMA latency. Software prefetch measured neutral here (the hardware prefetchers
 * keep up with one fp32 stream), unlike linear.c's bf16 rows. */
static inline float dot_f32(const float *a, const float *x, int64_t k) {
#ifdef __AVX512F__
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  int64_t i = 0;
  for (; i + 64 <= k; i += 64) {
    s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(x + i), s0);
    s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(x + i + 16), s1);
    s2 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 32), _mm512_loadu_ps(x + i + 32), s2);
    s3 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 48), _mm512_loadu_ps(x + i + 48), s3);
  }
  for (; i + 16 <= k; i += 16) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(x + i), s0);
  if (i < k) {
    const __mmask16 m = (__mmask16)((1u << (k - i)) - 1u);
    s1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, x + i), s1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
#else
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(x + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(x + i + 8), s1);
    s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(x + i + 16), s2);
    s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(x + i + 24), s3);
  }
  for (; i + 8 <= k; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(x + i), s0);
  float acc = hsum8(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
  for (; i < k; ++i) acc += a[i] * x[i];
  return acc;
#endif
}

typedef struct {
  const float *xf; /* x in fp32, [M, K]; when perm, each block of 16 in unpack order (see prepare_x) */
  const void *w, *bias;
  void *y; /* this part's first column */
  int perm, w_bf16, bias_bf16, y_bf16;
  int64_t M, N, K, ldy, rows_per_chunk; /* ldy: elements between rows of y */
  const uint16_t *xb; /* x itself when it and w are bf16 and the build has AVX-512 BF16 (vdpbf16ps), else NULL */
} linear_t;

static inline float load1(const void *p, int bf16, int64_t i) {
  if (!bf16) return ((const float *)p)[i];
  uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as c10::BFloat16 does */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline __m256 load8(const void *p, int bf16, int64_t i) { /* a bf16 is an fp32's top half */
  if (!bf16) return _mm256_loadu_ps((const float *)p + i);
  __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline void put(const linear_t *a, int64_t m, int64_t n, float v) {
  if (a->y_bf16) ((uint16_t *)a->y)[m * a->ldy + n] = to_bf16(v);
  else ((float *)a->y)[m * a->ldy + n] = v;
}

static inline void store(const linear_t *a, int64_t m, int64_t n, float v) { /* adds the bias */
  put(a, m, n, a->bias ? v + load1(a->bias, a->bias_bf16, n) : v);
}

/* The float products step.c runs (linear.c): several outputs sharing x, and a SiLU-gated pair. */
int rk_linear_parts(const void *x, int x_bf16, int n_parts, const void *const *ws, int w_bf16,
                    const void *const *biases, int bias_bf16, const int64_t *ns, void *y, int y_bf16, int64_t M,
                    int64_t K);
int rk_linear_gated(const void *x, int x_bf16, const void *w_gate, const void *w_up, int w_bf16, const void *b_gate,
                    const void *b_up, int bias_bf16, void *y, int y_bf16, int64_t N, int64_t K);
