/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) on AVX2 + FMA, split over pool.h's threads.
 * rk_linear_parts does several such products on the same x as one job, each
 * writing its columns of one output (a fused qkv or gate/up projection
 * without copying the weights into one matrix).
 *
 * Why not torch's matmul (measured on a 2-core AVX2 EPYC, see benchmarks/README.md):
 * - torch's OpenMP regions stall on a busy machine (see pool.h): under load a
 *   [1, 896] x [4864, 896] product took 15-25 ms instead of 0.5. In prefill,
 *   every elementwise op on a [T, 4864] activation is such a region too, so
 *   with these kernels torch itself can run single-threaded.
 * - bf16 products of many rows have no fast path without AVX-512 BF16 (~10
 *   GFLOP/s against ~65 for fp32 at M = 512). Here bf16 weights are widened
 *   to fp32 in registers and fed to FMA; decode still reads half the bytes.
 * - One arithmetic per output for every count of rows (see "One arithmetic" below); MKL's
 *   sgemm (prefill until issue 32) summed in an order that depends on the shapes.
 *
 * Arithmetic: fp32 products and sums; a bf16 output is rounded once, after
 * the bias is added, as torch's bf16 addmm does. In the avx512-bf16 build,
 * bf16 x against bf16 weights runs
 * vdpbf16ps: 32 products a step from the stored halves, no widening (the
 * products of two bf16 are exact in fp32; the sums are fp32 in another order;
 * subnormal bf16 inputs count as zero, as the instruction does). x, w, bias and y are each
 * fp32 or bf16. Requires K % 8 == 0; the Python side checks.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "linear.h"
#include "pool.h"
#include "vmath.h"

/* Weight bytes per claimed chunk: about a quarter of each thread's share, within
 * these bounds. Long runs let the prefetchers stream (fp32 decode went from
 * 24.5 to 27.7 GB/s, bf16 from 17.9 to 20.8, going from 32 KiB to 512 KiB);
 * several chunks per thread let one thread take over from a descheduled one. */
#define MIN_CHUNK_BYTES 32768
#ifndef MAX_CHUNK_BYTES
#define MAX_CHUNK_BYTES 524288
#endif
#define MR 4              /* x rows per tile */
#define NR 3              /* w rows per tile: 12 accumulators + 3 weights + 1 x = 16 ymm registers */

#define MAX_PARTS 8

typedef struct {
  int n_parts;
  int64_t first_chunk[MAX_PARTS + 1]; /* part p owns chunks [first_chunk[p], first_chunk[p + 1]) */
  linear_t part[MAX_PARTS];
} parts_t;
_Static_assert(sizeof(parts_t) <= POOL_MAX_CONTEXT, "the pool copies at most POOL_MAX_CONTEXT bytes");

/* 16 bf16 weights as two fp32 vectors, by interleaving zero low halves:
 * lo holds w0-3 and w8-11, hi w4-7 and w12-15 (unpack works per 128-bit lane).
 * One load and two shuffles per 16 weights, half the work of widening 8 at a
 * time, which kept bf16 decode below the bytes/s fp32 reached. */
static inline __m256 bf16_lo(__m256i w) { return _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), w)); }
static inline __m256 bf16_hi(__m256i w) { return _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), w)); }
static inline __m256i load16(const void *p, int64_t i) { return _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)); }


/* One arithmetic per output, whatever the rows of x (decode's one, a server batch, a speculative step's k + 1, a
 * prompt chunk): every path below computes y[m, n] with the same operations in the same order, so a row of x gets
 * the same bits alone or with others, and greedy tokens do not depend on the batch, the chunking or the prefix cache.
 * fp32 weights (AVX-512 builds): one 512-bit chain per output, k ascending 16 at a time (the last masked), summed by
 * reduce4's fixed tree. AVX2 builds and bf16 weights widened in registers: one 256-bit chain per output, 8 (or 16 as
 * two halves, perm) at a time, summed by hsum8. bf16 x and weights in the avx512-bf16 build: vdpbf16ps (tile_bf16).
 * Decode is a tile of one row of x: NR rows of w side by side are NR independent chains (the FMA latency hidden).
 * There is no sgemm: MKL's order depends on the shapes (prefill cost, benchmarks/README.md). */
#define NR_MAX 4

/* Rows m0.. (mr <= MR) of x against rows n0.. (nr <= NR) of w: each loaded vector
 * feeds several FMAs. With constant mr, nr (the full tile) the loops unroll. */
static inline __attribute__((always_inline)) void tile(const linear_t *a, int64_t m0, int mr, int64_t n0, int nr,
                                                        float out[MR][NR_MAX]) {
  const int64_t K = a->K;
  const float *x = a->xf + m0 * K;
  __m256 acc[MR][NR], wv[NR];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) acc[i][j] = _mm256_setzero_ps();
  if (a->perm) { /* per 16 weights: the lo halves against x's first 8, then the hi halves */
    for (int64_t k = 0; k < K; k += 16) {
      for (int j = 0; j < nr; ++j) wv[j] = bf16_lo(load16(a->w, (n0 + j) * K + k));
      for (int i = 0; i < mr; ++i) {
        __m256 xv = _mm256_loadu_ps(x + i * K + k);
        for (int j = 0; j < nr; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
      }
      for (int j = 0; j < nr; ++j) wv[j] = bf16_hi(load16(a->w, (n0 + j) * K + k));
      for (int i = 0; i < mr; ++i) {
        __m256 xv = _mm256_loadu_ps(x + i * K + k + 8);
        for (int j = 0; j < nr; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
      }
    }
  } else {
    for (int64_t k = 0; k < K; k += 8) {
      for (int j = 0; j < nr; ++j) wv[j] = load8(a->w, a->w_bf16, (n0 + j) * K + k);
      for (int i = 0; i < mr; ++i) {
        __m256 xv = _mm256_loadu_ps(x + i * K + k);
        for (int j = 0; j < nr; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) out[i][j] = hsum8(acc[i][j]);
}

#ifdef __AVX512F__
#define HAVE_TILE32 1
#define MR32 4
#define NR32 4
/* The sums of 4 512-bit chains, each in one fixed order: per 128-bit block j, B_j = (l0 + l2) + (l1 + l3) of its
 * lanes, then (B0 + B2) + (B1 + B3). The same tree for an output whichever 3 chains come with it (zeros past a
 * tile's last row), at 13 instructions for 4 outputs where _mm512_reduce_add_ps took about 10 for one: at the
 * built-in model's K = 192 the reductions cost as much as the products. */
static inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)); /* [a0+a2 b0+b2 a1+a3 b1+b3] */
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  const __m512 v = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),  /* block j: B_j of a, b, c, d */
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); /* B0+B2, B1+B3 */
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* fp32 x against fp32 w, one 512-bit chain per output (k ascending, the last 16 masked), summed by reduce4. */
static inline __attribute__((always_inline)) void tile32(const linear_t *a, int64_t m0, int mr, int64_t n0, int nr,
                                                          float out[MR][NR_MAX]) {
  const int64_t K = a->K, whole = K / 16 * 16;
  const float *x = a->xf + m0 * K, *w = (const float *)a->w + n0 * K;
  __m512 acc[MR32][NR32], wv[NR32];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < NR32; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < whole; k += 16) {
    for (int j = 0; j < nr; ++j) wv[j] = _mm512_loadu_ps(w + j * K + k);
    for (int i = 0; i < mr; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * K + k);
      for (int j = 0; j < nr; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  if (whole < K) { /* K % 16 == 8: the last 8 masked (zero products: the chain as one masked step) */
    const __mmask16 live = (__mmask16)((1u << (K - whole)) - 1u);
    for (int j = 0; j < nr; ++j) wv[j] = _mm512_maskz_loadu_ps(live, w + j * K + whole);
    for (int i = 0; i < mr; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(live, x + i * K + whole);
      for (int j = 0; j < nr; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < mr; ++i) {
    float v[4];
    _mm_storeu_ps(v, reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
    for (int j = 0; j < nr; ++j) out[i][j] = v[j];
  }
}
#else
#define HAVE_TILE32 0
#define MR32 MR
#define NR32 NR
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_DPBF16 1
/* 32 bf16 from p + i, the ones past `left` (< 32) zero. */
static inline __m512bh load32bh(const uint16_t *p, int64_t i, int64_t left) {
  if (left >= 32) return (__m512bh)_mm512_loadu_si512((const void *)(p + i));
  return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1u << left) - 1u), p + i);
}

/* vdpbf16ps adds two products per fp32 lane. Each dot product below runs four chains over the whole blocks
 * of 128 (block c mod 4 into chain c: the instruction's latency hidden), adds them as (0 + 1) + (2 + 3), then
 * takes the rest 32 at a time and sums the lanes. */
#define MR_B 2 /* x rows per tile: 4 chains x MR_B x NR_B accumulators */
#define NR_B 3

#ifndef BF16_PREFETCH
#define BF16_PREFETCH 4096 /* bytes ahead of a bf16 row's loads that decode prefetches (0: none) */
#endif
/* The 4 lines of the 256 bytes (128 bf16) at p, BF16_PREFETCH ahead (into the next rows of the chunk: its
 * rows are one stream). A core streams a bf16 GEMV at ~11.9 GB/s without, ~15 GB/s with (1-4 lines per
 * 256 bytes, 2-8 KiB ahead measured; the Qwen2.5-0.5B step's GEMVs, 2 MiB pages, one thread). */
static inline void prefetch_ahead(const uint16_t *p) {
  if (!BF16_PREFETCH) return;
  const char *c = (const char *)p + BF16_PREFETCH;
  _mm_prefetch(c, _MM_HINT_T0), _mm_prefetch(c + 64, _MM_HINT_T0);
  _mm_prefetch(c + 128, _MM_HINT_T0), _mm_prefetch(c + 192, _MM_HINT_T0);
}

/* Rows m0.. (mr <= MR_B) of bf16 x against rows n0.. (nr <= NR_B) of bf16 w. */
static inline __attribute__((always_inline)) void tile_bf16(const linear_t *a, int64_t m0, int mr, int64_t n0, int nr,
                                                             float out[MR][NR_MAX]) {
  const int64_t K = a->K;
  const uint16_t *x = a->xb + m0 * K, *w = (const uint16_t *)a->w + n0 * K;
  __m512 acc[4][MR_B][NR_B];
  __m512bh wv[NR_B];
  for (int c = 0; c < 4; ++c)
    for (int i = 0; i < mr; ++i)
      for (int j = 0; j < nr; ++j) acc[c][i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 128 <= K; k += 128) {
    if (mr == 1) /* decode: a stream of weights */
      for (int j = 0; j < nr; ++j) prefetch_ahead(w + j * K + k);
    for (int c = 0; c < 4; ++c) {
      for (int j = 0; j < nr; ++j) wv[j] = load32bh(w + j * K, k + 32 * c, 32);
      for (int i = 0; i < mr; ++i) {
        const __m512bh xv = load32bh(x + i * K, k + 32 * c, 32);
        for (int j = 0; j < nr; ++j) acc[c][i][j] = _mm512_dpbf16_ps(acc[c][i][j], wv[j], xv);
      }
    }
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j)
      acc[0][i][j] = _mm512_add_ps(_mm512_add_ps(acc[0][i][j], acc[1][i][j]), _mm512_add_ps(acc[2][i][j], acc[3][i][j]));
  for (; k < K; k += 32) {
    for (int j = 0; j < nr; ++j) wv[j] = load32bh(w + j * K, k, K - k);
    for (int i = 0; i < mr; ++i) {
      const __m512bh xv = load32bh(x + i * K, k, K - k);
      for (int j = 0; j < nr; ++j) acc[0][i][j] = _mm512_dpbf16_ps(acc[0][i][j], wv[j], xv);
    }
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) out[i][j] = _mm512_reduce_add_ps(acc[0][i][j]);
}

#else
#define HAVE_DPBF16 0
#define MR_B MR
#define NR_B NR
static inline void tile_bf16(const linear_t *a, int64_t m0, int mr, int64_t n0, int nr, float out[MR][NR_MAX]) {
  tile(a, m0, mr, n0, nr, out); /* not built: never taken (xb is NULL) */
}
#endif


/* The tile shape of a product: (rows of x, rows of w) per call of sums(). */
static inline void tile_shape(const linear_t *a, int *mr, int *nr) {
  if (a->xb) *mr = MR_B, *nr = NR_B;
  else if (HAVE_TILE32 && !a->w_bf16) *mr = MR32, *nr = NR32;
  else *mr = MR, *nr = NR;
}

/* out[i][j] = x[m0 + i] . w[n0 + j] (no bias) in the product's one arithmetic; full tiles unrolled. */
static void sums(const linear_t *a, int64_t m0, int mr, int64_t n0, int nr, float out[MR][NR_MAX]) {
  int fm, fn;
  tile_shape(a, &fm, &fn);
  const int full = mr == fm && nr == fn;
  if (a->xb) {
    if (full) tile_bf16(a, m0, MR_B, n0, NR_B, out);
    else tile_bf16(a, m0, mr, n0, nr, out);
  } else if (HAVE_TILE32 && !a->w_bf16) {
#if HAVE_TILE32
    if (full) tile32(a, m0, MR32, n0, NR32, out);
    else if (mr == 1 && nr == NR32) tile32(a, m0, 1, n0, NR32, out); /* decode */
    else tile32(a, m0, mr, n0, nr, out);
#endif
  } else {
    if (full) tile(a, m0, MR, n0, NR, out);
    else if (mr == 1 && nr == NR) tile(a, m0, 1, n0, NR, out);
    else tile(a, m0, mr, n0, nr, out);
  }
}

#ifndef X_BLOCK_BYTES
#define X_BLOCK_BYTES 32768 /* bytes of x a pass over the chunk's rows of w takes: they stay in L1 */
#endif

static void run_part_chunk(const linear_t *a, int64_t c) {
  int64_t n0 = c * a->rows_per_chunk, n1 = n0 + a->rows_per_chunk;
  if (n1 > a->N) n1 = a->N;
  int fm, fn;
  tile_shape(a, &fm, &fn);
  const int64_t xbytes = a->K * (a->xb ? 2 : 4);
  int64_t block = X_BLOCK_BYTES / xbytes / fm * fm;
  if (block < fm) block = fm;
  float out[MR][NR_MAX];
  for (int64_t b0 = 0; b0 < a->M; b0 += block) { /* the chunk's w rows stay in L2 while each block of x passes */
    const int64_t b1 = a->M - b0 < block ? a->M : b0 + block;
    for (int64_t n = n0; n < n1; n += fn) {
      const int nr = n1 - n < fn ? (int)(n1 - n) : fn;
      for (int64_t m = b0; m < b1; m += fm) {
        const int mr = b1 - m < fm ? (int)(b1 - m) : fm;
        sums(a, m, mr, n, nr, out);
        if (nr == 4 && !a->y_bf16 && !(a->bias && a->bias_bf16)) { /* store()'s one add, 4 outputs at a time */
          const __m128 bias = a->bias ? _mm_loadu_ps((const float *)a->bias + n) : _mm_setzero_ps();
          for (int i = 0; i < mr; ++i) {
            const __m128 v = _mm_loadu_ps(out[i]);
            _mm_storeu_ps((float *)a->y + (m + i) * a->ldy + n, a->bias ? _mm_add_ps(v, bias) : v);
          }
          continue;
        }
        for (int i = 0; i < mr; ++i)
          for (int j = 0; j < nr; ++j) store(a, m + i, n + j, out[i][j]);
      }
    }
  }
}

static void run_chunk(const void *context, int64_t c) {
  const parts_t *job = context;
  int p = 0;
  while (c >= job->first_chunk[p + 1]) ++p;
  run_part_chunk(&job->part[p], c - job->first_chunk[p]);
}

static int64_t chunk_rows(int64_t n_rows, int64_t row_bytes) {
  int64_t bytes = n_rows * row_bytes / (4 * pool_threads());
  bytes = bytes < MIN_CHUNK_BYTES ? MIN_CHUNK_BYTES : bytes > MAX_CHUNK_BYTES ? MAX_CHUNK_BYTES : bytes;
  return bytes / row_bytes < 1 ? 1 : bytes / row_bytes;
}

/* x as the kernels read it: fp32, and for bf16 weights each block of 16 in the
 * order bf16_lo/bf16_hi produce (0-3, 8-11, 4-7, 12-15). Converted once per call
 * by the caller's thread into its own buffer (jobs run one at a time per thread). */
static const float *prepare_x(const void *x, int x_bf16, int64_t M, int64_t K, int perm) {
  static __thread void *scratch;
  static __thread int64_t capacity;
  if (!x_bf16 && !perm) return x;
  float *buffer = pool_scratch(&scratch, &capacity, M * K * 4);
  if (!buffer) return NULL;
  if (!perm) { /* bf16 x against bf16 w read 8 at a time (K % 16 != 0): widened 8 a step on the caller's thread */
    int64_t i = 0;
    for (; i + 8 <= M * K; i += 8) _mm256_storeu_ps(buffer + i, load8(x, 1, i));
    for (; i < M * K; ++i) buffer[i] = load1(x, 1, i);
    return buffer;
  }
  static const int order[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
  for (int64_t i = 0; i < M * K; i += 16)
    for (int j = 0; j < 16 && i + j < M * K; ++j)
      buffer[i + j] = load1(x, x_bf16, perm ? i + order[j] : i + j);
  return buffer;
}

/* y[M, sum N_p] = x @ concat(w_p)^T (+ concat(bias_p)); ws, biases and ns hold
 * n_parts entries (a bias may be NULL). One dtype flag each for x, w, bias, y. */
int rk_linear_parts(const void *x, int x_bf16, int n_parts, const void *const *ws, int w_bf16,
                    const void *const *biases, int bias_bf16, const int64_t *ns,
                    void *y, int y_bf16, int64_t M, int64_t K) {
  if (M < 1 || K < 8 || K % 8 || n_parts < 1 || n_parts > MAX_PARTS) return -1;
  const int dp = HAVE_DPBF16 && w_bf16 && x_bf16; /* vdpbf16ps on x as it is */
  const int perm = w_bf16 && K % 16 == 0 && !dp;
  const float *xf = dp ? NULL : prepare_x(x, x_bf16, M, K, perm);
  if (!xf && !dp) return -2;
  parts_t job = {.n_parts = n_parts};
  int64_t ldy = 0;
  for (int p = 0; p < n_parts; ++p) ldy += ns[p];
  int64_t rows = chunk_rows(ldy, K * (w_bf16 ? 2 : 4));
  rows = (rows + 11) / 12 * 12; /* whole tiles of 3 or 4 rows of w */
  int64_t column = 0;
  for (int p = 0; p < n_parts; ++p) {
    if (ns[p] < 1) return -1;
    char *y_part = (char *)y + column * (y_bf16 ? 2 : 4);
    job.part[p] = (linear_t){xf, ws[p], biases[p], y_part, perm, w_bf16, bias_bf16, y_bf16, M, ns[p], K, ldy, rows,
                             dp ? (const uint16_t *)x : NULL};
    job.first_chunk[p + 1] = job.first_chunk[p] + (ns[p] + rows - 1) / rows;
    column += ns[p];
  }
  pool_run(job.first_chunk[n_parts], run_chunk, &job, sizeof job);
  return 0;
}

typedef struct {
  linear_t gate, up; /* the two halves of a gate/up projection, M == 1 */
} gated_t;

static inline float rounded(float v, int bf16) { /* the value a bf16 tensor would hold */
  if (!bf16) return v;
  uint16_t h = to_bf16(v);
  return load1(&h, 1, 0);
}

static void run_gated_chunk(const void *context, int64_t c) {
  const gated_t *a = context;
  const linear_t *g = &a->gate, *u = &a->up;
  int64_t n0 = c * g->rows_per_chunk, n1 = n0 + g->rows_per_chunk;
  if (n1 > g->N) n1 = g->N;
  const int bf = g->y_bf16;
  int fm, fn;
  tile_shape(g, &fm, &fn);
  (void)fm;
  for (int64_t n = n0; n < n1; n += 8) { /* 8 at a time through vmath.h's silu_mul8, as rk_gate */
    const int live = n1 - n < 8 ? (int)(n1 - n) : 8;
    float gv[8], uv[8], v[8], out[MR][NR_MAX];
    for (int o = 0; o < live; o += fn) { /* the products as rk_linear_parts computes them (one row of x) */
      const int nr = live - o < fn ? live - o : fn;
      sums(g, 0, 1, n + o, nr, out);
      for (int j = 0; j < nr; ++j) gv[o + j] = rounded(out[0][j] + (g->bias ? load1(g->bias, g->bias_bf16, n + o + j) : 0.f), bf);
      sums(u, 0, 1, n + o, nr, out);
      for (int j = 0; j < nr; ++j) uv[o + j] = rounded(out[0][j] + (u->bias ? load1(u->bias, u->bias_bf16, n + o + j) : 0.f), bf);
    }
    silu_mul_n(gv, uv, v, live, bf);
    for (int i = 0; i < live; ++i) put(g, 0, n + i, v[i]);
  }
}

/* y[N] = silu(x @ w_gate^T + b_gate) * (x @ w_up^T + b_up) for one row of x,
 * with the roundings torch's MLP makes in bf16 (gate, up, silu, product). */
int rk_linear_gated(const void *x, int x_bf16, const void *w_gate, const void *w_up, int w_bf16,
                    const void *b_gate, const void *b_up, int bias_bf16, void *y, int y_bf16, int64_t N, int64_t K) {
  if (N < 1 || K < 8 || K % 8) return -1;
  const int dp = HAVE_DPBF16 && w_bf16 && x_bf16;
  const int perm = w_bf16 && K % 16 == 0 && !dp;
  const float *xf = dp ? NULL : prepare_x(x, x_bf16, 1, K, perm);
  if (!xf && !dp) return -2;
  const uint16_t *xb = dp ? x : NULL;
  int64_t rows = (chunk_rows(N, 2 * K * (w_bf16 ? 2 : 4)) + 23) / 24 * 24; /* whole groups of 8, tiles of 3/4 */
  gated_t a = {{xf, w_gate, b_gate, y, perm, w_bf16, bias_bf16, y_bf16, 1, N, K, N, rows, xb},
               {xf, w_up, b_up, y, perm, w_bf16, bias_bf16, y_bf16, 1, N, K, N, rows, xb}};
  pool_run((N + rows - 1) / rows, run_gated_chunk, &a, sizeof a);
  return 0;
}

int rk_set_threads(int n) { return pool_set_threads(n); }
