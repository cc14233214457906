/* What quant.c (decode rows, prefill, the job) and qtile.c (batched integer tiles) share:
 * one quantized matrix, one job over several, and the integer dot product of 32 u8 x s8. */
#pragma once
#include <immintrin.h>
#include <stdint.h>

#include "linear.h"
#include "pool.h"

#define Q_MAX_PARTS 8
#define QUANT_BLAS_ROWS 16 /* the exact path's prefill: sgemm over dequantized rows from this many rows of x */
/* With int8 x, batches of 2 to Q_TILE_ROWS - 1 rows run integer tiles (qtile.c), more rows MKL's sgemm
 * over dequantized rows (on fp32 x: exact). Measured per core (CPU time on the shared 2-vCPU Xeon, 4864x896
 * and 896x4864, avx512-vnni build): 16 rows tiles 1.6-3.5 ms, sgemm 4.7-4.9; 64 rows tiles 6.4-15.9, sgemm
 * 7.6-7.8 (benchmarks/quant_kernels.py --rows). */
#ifndef Q_TILE_ROWS
#define Q_TILE_ROWS 32
#endif
/* Quantized codes (per-sub-block int8 x, mode 0) from Q_PANEL_ROWS rows of x: integer panels (qpanel.c) on AVX-512
 * VNNI builds, instead of sgemm over dequantized rows; Q_PANELS=0 builds keep sgemm (A/B). */
#ifndef Q_PANELS
#define Q_PANELS 1
#endif
#ifndef Q_PANEL_ROWS
#define Q_PANEL_ROWS Q_TILE_ROWS /* fewer: faster batches (16 rows ~2x the tiles), but a row of one no longer equals it alone */
#endif
#if Q_PANELS && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q_PANELS_BUILT 1
#else
#define Q_PANELS_BUILT 0
#endif
#define Q_MIN_CHUNK_BYTES 32768
#define Q_MAX_CHUNK_BYTES 524288
/* fp32 values of dequantized rows per sgemm chunk: 1 MB, so the buffer sgemm reads stays in L2 (linear.c's
 * BLAS_CHUNK_FLOATS says why; 8 MB chunks were ~1.3x slower per core here) */
#ifndef Q_MAX_DEQUANT
#define Q_MAX_DEQUANT (1 << 18)
#endif
/* Weight rows per pass over x in decode (even: the exact path takes them in pairs); measured
 * in cache on one core: 4 rows 1.19x faster than 2 for 4-bit codes, 2 rows 1.01-1.06x faster for 8-bit. */
#ifndef Q_ROWS4
#define Q_ROWS4 4
#endif
#ifndef Q_ROWS8
#define Q_ROWS8 2
#endif
#define Q_ROWS 4 /* chunks are whole multiples of this */
#ifndef Q_HINT
#define Q_HINT _MM_HINT_T0
#endif
#ifndef Q_PREFETCH
#define Q_PREFETCH 2048 /* bytes ahead in each row's codes */
#endif

typedef struct { /* one quantized matrix, as kernels.py's QMat structure */
  const uint8_t *codes; /* [N, nb * (bits4 ? 16 : 32)] */
  const float *scales;  /* [N, ng] */
  const float *mins;    /* [N, ng] s * z' per group (a float offset m folded in: s * z' - m), or NULL: s * zp */
  const uint8_t *zeros; /* [N, ng] the zero points z, or NULL: every group's z' is zp */
  const void *bias;     /* [N] or NULL */
  int64_t N, ng, spg;   /* rows, groups per row, sub-blocks per group */
  int32_t bits4, bias_bf16;
  float zp; /* with zeros NULL, every group's z' (z, or z - 128 for 8 bits): a per-tensor zero point, as
             * GGUF's Q4_0 (8) and Q8_0 (0) and symmetric RTN have, needs neither zeros nor mins; 0 with
             * a float offset (Q4_1: mins holds it) */
  int32_t kind; /* 0: the layout above; else a ggml block type (kquant.c: Q5_0, Q5_1, Q2_K-Q6_K): codes are
                 * the file's blocks, ng blocks a row of spg sub-blocks each, no scales/mins/zeros */
} qmat_t;

typedef struct {
  qmat_t w;
  const float *xg; /* [M, ng] X_g of this part's groups, or NULL */
  void *y;         /* this part's first column */
  int64_t rows_per_chunk;
} qpart_t;

typedef struct { /* what the parts share */
  const int8_t *qx; /* [M, nb * 32] */
  const float *dx;  /* [M, nb] sub-block scales of x */
  const int8_t *qxp; /* [M, nb * 32] qx in pair order for 4-bit codes (see pair_x), or NULL */
  const float *dxp;  /* [M, nb / 2, 8] d of each pair's two sub-blocks, four times each */
  const float *xs16; /* [M, nb * 2] dx * Σ q_x per 16 values, for ggml blocks with per-16 scales, or NULL */
  const float *xf;  /* [M, K] fp32 x for the sgemm path */
  const float *xp;  /* [M, nb * 32] fp32 x zero-padded, for the float path */
  int y_bf16, blas, n_parts, exact;
  int panel_parts; /* bit p: part p runs qpanel.c's panels */
  int64_t M, K, ldy;
  int64_t first_chunk[Q_MAX_PARTS + 1];
  qpart_t part[Q_MAX_PARTS];
} qjob_t;
_Static_assert(sizeof(qjob_t) <= POOL_MAX_CONTEXT, "the pool copies at most POOL_MAX_CONTEXT bytes");

static inline int64_t nb_of(const qmat_t *w) { return w->ng * w->spg; }

/* Bytes of one block of a ggml type (ggml-common.h), 0 for the layout of quant.c. */
static inline int64_t kq_block_bytes(int kind) {
  switch (kind) {
  case 6: return 22;   /* Q5_0 */
  case 7: return 24;   /* Q5_1 */
  case 10: return 84;  /* Q2_K */
  case 11: return 110; /* Q3_K */
  case 12: return 144; /* Q4_K */
  case 13: return 176; /* Q5_K */
  case 14: return 210; /* Q6_K */
  default: return 0;
  }
}

/* Whether y takes a zero-point term Σ_g s_g z'_g X_g off: per-group mins, or one z' for every group
 * (ggml blocks take theirs in kquant.c). */
static inline int has_mins(const qmat_t *w) { return !w->kind && (w->mins || w->zp != 0.f); }
/* The term's factors for row n: s z' of group g is f * m[g] (mins: f = 1; else the scales, f = zp): zp * s is
 * the same one rounding of s * z' a mins tensor held, so both layouts give the same floats. */
static inline const float *mins_row(const qmat_t *w, int64_t n, float *f) {
  *f = w->mins ? 1.f : w->zp;
  return (w->mins ? w->mins : w->scales) + n * w->ng;
}
static inline int64_t row_bytes(const qmat_t *w) {
  return w->kind ? w->ng * kq_block_bytes(w->kind) : nb_of(w) * (w->bits4 ? 16 : 32);
}

/* Sum of 4 adjacent u8 x s8 products per int32 lane, added to acc: vpdpbusd where the build has
 * AVX-512 VNNI, else maddubs (pair sums in int16) and madd. The callers' operands never reach
 * int16 saturation (|u| <= 128, |s| <= 127, pairs below 32767), so both give the same integers. */
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

static inline __m256i udot2(__m256i u0, __m256i s0, __m256i u1, __m256i s1) { /* udot(u0, s0) + udot(u1, s1) */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u0, s0), u1, s1);
#else /* one madd for both: callers keep the int16 sums of both below 32767 */
  const __m256i sum = _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1));
  return _mm256_madd_epi16(sum, _mm256_set1_epi16(1));
#endif
}

static inline __m256i udot(__m256i u, __m256i s) { /* dpbusd from zero */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline void put_q(const qjob_t *j, const qpart_t *a, int64_t m, int64_t n, float v) {
  if (a->w.bias) v += load1(a->w.bias, a->w.bias_bf16, n);
  if (j->y_bf16) ((uint16_t *)a->y)[m * j->ldy + n] = to_bf16(v);
  else ((float *)a->y)[m * j->ldy + n] = v;
}

/* Whether qtile.c's 512-bit tiles take this matrix (for every count of rows, one included, so a row of a
 * batch gets the value it gets alone): AVX-512 builds, one sub-block a group (GGUF's Q4_0 / Q4_1 / Q8_0, RTN
 * groups of 32), an even count of sub-blocks. Measured per core, one row: 4-bit 0.24 vs rows_q's 0.31 ms,
 * 8-bit the same. 4-bit groups of an even count of sub-blocks (RTN's g128) too: both sub-blocks of a
 * step share the group's scale; one row as fast as rows_q, 16 rows 1.2-1.4x the 256-bit tile. 8-bit
 * groups of several sub-blocks (per-channel int8) keep the 256-bit paths: one row was 5% slower here
 * (benchmarks/qtile_bench.py). */
static inline int ztile_fits(const qmat_t *w) {
#ifdef __AVX512BW__
  return !w->kind && (w->spg == 1 || (w->bits4 && !(w->spg & 1))) && !(nb_of(w) & 1);
#else
  (void)w;
  return 0;
#endif
}

/* Whether the panels (qpanel.c) take this matrix for M rows of x in this mode. */
static inline int q_panels_fit(const qmat_t *w, int64_t M, int mode) {
  (void)w; /* every layout: 8-bit and 4-bit (and 2/3-bit) codes, any group, and ggml's blocks */
  return Q_PANELS_BUILT && mode == 0 && M >= Q_PANEL_ROWS;
}
/* Rows n0..n1 of part a against every row of x in panels (qpanel.c); -1 when its buffer cannot be had. */
int q_panels(const qjob_t *j, const qpart_t *a, int64_t n0, int64_t n1);
/* Rows n0..n1 of part a against rows of x in tiles, for several rows of x (qtile.c). */
void q_tiles(const qjob_t *j, const qpart_t *a, int64_t n0, int64_t n1);

/* ggml blocks (kquant.c): rows n0..n1 of part a against every row of the int8 x, in tiles (decode and batches) */
void kq_rows(const qjob_t *j, const qpart_t *a, int64_t n0, int64_t n1);
/* rows r0..r1 of a ggml-block matrix as fp32 [rows, K], exactly gguf.quants.dequantize */
void kq_dequantize_rows(const qmat_t *w, int64_t r0, int64_t r1, int64_t K, float *out);
/* one block of a ggml type (32 or 256 values) as fp32, exactly gguf.quants.dequantize */
void kq_dequantize_block(int kind, const uint8_t *blk, float *out);
/* row n of a ggml-block matrix unpacked for the panels: codes [K], per group (32 values, or 16) s_j and Z_j */
void kq_unpack_row(const qmat_t *w, int64_t n, uint8_t *codes, float *scales, float *zeros, int64_t stride);
/* whether a ggml type's scales are per 16 values (Q2_K, Q3_K, Q6_K) */
static inline int kq_per16(int kind) { return kind == 10 || kind == 11 || kind == 14; }
/* xs16 [M, nb * 2] from the int8 x: dx * Σ q_x per 16 values */
void kq_sums16(const int8_t *qx, const float *dx, int64_t M, int64_t nb, float *xs16);

/* The quantized products step.c runs (quant.c): parts sharing x, optionally SiLU-gated (mode: quant.c's). */
int rk_qlinear_parts(const void *x, int x_bf16, int n_parts, const qmat_t *parts, void *y, int y_bf16, int64_t M,
                     int64_t K, int mode, void *gated);
