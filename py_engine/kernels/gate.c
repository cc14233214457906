/* The SiLU gate of a gated MLP, gated = silu(gate) * up, for every count of rows: rk_gate (prefill, after one
 * gate/up product; py_engine.kernels' silu_gate) and rk_gate_rows (quant.c's gated products, into column blocks).
 * Each value goes through vmath.h's silu_mul8, the one SiLU arithmetic of the kernels (torch's roundings in bf16). */
#include <immintrin.h>
#include <stdint.h>

#include "gate.h"
#include "linear.h"
#include "pool.h"
#include "vmath.h"

/* gated [M, N] = silu(y[:, :N]) * y[:, N:] for y [M, 2N], each value by vmath.h's silu_mul8 (torch's roundings
 * in bf16). Vectorized: on one thread, scalar expf took ~3 us per 1000 values, ~0.4 ms of a 24-layer token. */
static void gate_block(const void *y, void *gated, int bf16, int64_t M, int64_t N, int64_t ldo) {
  for (int64_t m = 0; m < M; ++m) {
    int64_t n = 0;
    for (; n + 8 <= N; n += 8) {
      const __m256 g = load8(y, bf16, m * 2 * N + n);
      const __m256 u = load8(y, bf16, m * 2 * N + N + n);
      const __m256 v = silu_mul8(g, u, bf16);
      if (bf16) {
        const __m256i h = _mm256_srli_epi32(_mm256_castps_si256(v), 16); /* already rounded: the top halves */
        const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        _mm_storeu_si128((__m128i *)((uint16_t *)gated + m * ldo + n), packed);
      } else {
        _mm256_storeu_ps((float *)gated + m * ldo + n, v);
      }
    }
    if (n < N) { /* the tail as one padded vector: the same operations as the lanes above */
      float g[8], u[8], v[8];
      for (int64_t i = n; i < N; ++i) g[i - n] = load1(y, bf16, m * 2 * N + i), u[i - n] = load1(y, bf16, m * 2 * N + N + i);
      silu_mul_n(g, u, v, (int)(N - n), bf16);
      for (int64_t i = n; i < N; ++i) {
        if (bf16) ((uint16_t *)gated)[m * ldo + i] = to_bf16(v[i - n]);
        else ((float *)gated)[m * ldo + i] = v[i - n];
      }
    }
  }
}

typedef struct {
  const void *y;
  void *gated;
  int bf16;
  int64_t M, N, ldo, rows;
} gate_t;

static void gate_chunk(const void *context, int64_t c) {
  const gate_t *a = context;
  const int64_t m0 = c * a->rows, m1 = m0 + a->rows < a->M ? m0 + a->rows : a->M;
  const int64_t in = a->bf16 ? 2 : 4;
  gate_block((const char *)a->y + m0 * 2 * a->N * in, (char *)a->gated + m0 * a->ldo * in, a->bf16, m1 - m0, a->N, a->ldo);
}

void rk_gate_rows(const void *y, void *gated, int bf16, int64_t M, int64_t N, int64_t ldo) {
  gate_t a = {y, gated, bf16, M, N, ldo, 0};
  a.rows = 16384 / N + 1; /* ~64 KB of output a chunk */
  if (a.rows >= M) gate_block(y, gated, bf16, M, N, ldo); /* decode: no pool wake-up for one chunk */
  else pool_run((M + a.rows - 1) / a.rows, gate_chunk, &a, sizeof a);
}

/* gated [M, N] = silu(y[:, :N]) * y[:, N:] for y [M, 2N] (fp32 or bf16: the dtype's roundings, as gate_block()),
 * rows split over the pool: in a 128-token prefill torch's single-threaded silu and product took ~7% of the CPU. */
int rk_gate(const void *y, void *gated, int bf16, int64_t M, int64_t N) {
  if (M < 1 || N < 1) return -1;
  rk_gate_rows(y, gated, bf16, M, N, N);
  return 0;
}
