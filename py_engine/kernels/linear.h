/* What linear.c and blas.c share: one product's description and how results are stored. */
#pragma once
#include <stdint.h>
#include <string.h>

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

static inline void put(const linear_t *a, int64_t m, int64_t n, float v) {
  if (a->y_bf16) ((uint16_t *)a->y)[m * a->ldy + n] = to_bf16(v);
  else ((float *)a->y)[m * a->ldy + n] = v;
}

static inline void store(const linear_t *a, int64_t m, int64_t n, float v) { /* adds the bias */
  put(a, m, n, a->bias ? v + load1(a->bias, a->bias_bf16, n) : v);
}

/* Rows n0..n1 of one product with M > 1 by the BLAS sgemm torch ships (MKL), when
 * rk_use_blas was given one: MKL's GEMM is ~1.4x our tiles per core, and here it
 * runs single-threaded inside our pool, so it never waits at an OpenMP barrier.
 * Returns 0 when it did the work. */
int blas_rows(const linear_t *a, int64_t n0, int64_t n1);
int blas_available(void);
