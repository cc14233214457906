/* What quant.c (the job, x's rounding, the exact path), qtile.c and qpanel.c (the int8-x products) share: one
 * quantized matrix, one job over several, and the one arithmetic of an output (below). */
#pragma once
#include <immintrin.h>
#include <stdint.h>

#include "linear.h"
#include "pool.h"

#define Q_MAX_PARTS 8
/* The canonical sum (one arithmetic for a row of x however many rows come with it: decode, a server batch, the
 * k + 1 rows of a speculative step, a prompt chunk of any length). With int8 x (per sub-block of 32, or one d per
 * row for W8A8) and I_b = Σ c q the exact integer dot of sub-block b (codes c unsigned: 4-bit as stored, 8-bit
 * c + 128), each output is
 *     acc = 0;  for b: acc = fma(float(I_b), d_b * s_g(b), acc);  at each group's end: acc = fnma(mn_g, X_g, acc)
 * with mn_g = (mins_g, or zp * s_g) (+ 128 s_g for 8-bit codes) and X_g = Σ_b d_b Σ q_b (xs summed in order),
 * then the bias is added once (put_q). Q6_K (kq_zero_folded) has no zero term: its z = 32 is folded into the
 * integer of each group of 16, I_j = Σ (c - 32) q = Σ c q - 32 Σ q (exact: |I_j| <= 16 * 32 * 127), so per group
 *     acc = fma(float(I_j), d_b * s_j, acc)
 * one float step a group instead of two (as llama.cpp's vec_dot_q6_K takes the 32 off in integers). qpanel.c (prefill, AVX-512 VNNI) and qtile.c (everything else, every
 * build) do exactly these float operations per output, so greedy tokens do not depend on the prefix cache, the
 * chunking, the batch or speculation. The exact path (mode 2, fp32 x) is rows2f's, per row of x alone. */
/* Prompt chunks of Q_PANEL_ROWS rows or more run qpanel.c's packed panels on AVX-512 VNNI builds (Q_PANELS=0:
 * never, an A/B build). Both kernels give the same bits, so this only picks the faster one. */
#ifndef Q_PANELS
#define Q_PANELS 1
#endif
#if Q_PANELS && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q_PANELS_BUILT 1
#else
#define Q_PANELS_BUILT 0
#endif
#ifndef Q_PANEL_ROWS
#define Q_PANEL_ROWS 32
#endif
/* Up to Q_ROWS_MAX rows of x (decode, a speculative step's k + 1, server batches, short prompt chunks) run qrow.c's
 * row-wise integer dots on AVX-512 VNNI builds (Q_ROWS_MAX=0: never, an A/B build); the same bits as qtile.c's.
 * One thread, 4864x896 and 896x4864, GFLOP/s-equivalent, qtile.c -> qrow.c: int4 g32 at 1 row 19 -> 37-42, 5
 * rows 45-68 -> 108-116, 16 rows 66 -> 93-102; int4 g128 31 rows 75-85 -> 108; int8 g32 16 rows 80 -> 105-114. */
#ifndef Q_ROWS_MAX
#define Q_ROWS_MAX (Q_PANEL_ROWS - 1)
#endif
#if Q_ROWS_MAX > 0 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q_ROWS_BUILT 1
#else
#define Q_ROWS_BUILT 0
#endif
#define Q_MIN_CHUNK_BYTES 32768
#define Q_MAX_CHUNK_BYTES 524288
/* bytes of packed panels a chunk takes (qpanel.c's per-thread buffer stays in L2) */
#ifndef Q_MAX_DEQUANT
#define Q_MAX_DEQUANT (1 << 18)
#endif
#define Q_ROWS 16 /* chunks are whole multiples of this: qtile.c's blocks of W rows */
#ifndef Q_HINT
#define Q_HINT _MM_HINT_T0
#endif
#ifndef Q_PREFETCH
#define Q_PREFETCH 2048 /* bytes ahead in each row's codes */
#endif
/* Bytes ahead of a row's reads that a kernel reading `rows` rows of codes side by side (qrow.c's blocks of 16, the
 * virtual panels' 16 or 8) prefetches: by default the same row's bytes one block of rows on (Q_PREFETCH_BLOCKS=0:
 * Q_PREFETCH bytes on, as before; an A/B build). The block reads its rows in steps side by side, so a fixed
 * distance within a row lands, for rows shorter than ~2 KB (SmolLM2's 576 values: 576 bytes of 8-bit codes, 396 of
 * Q5_0), in rows the block is reading already, and each block began cold. A decode step, one thread, paired tokens
 * (2026-11-28): SmolLM2 Q6_K 0.86x the CPU time, Q5_K_M 0.83x, Q4_1 0.87x; Llama-3.2-1B's shape Q6_K 0.89x (rows of
 * 1680 and 6720 bytes: 27 and 107 KB ahead, still better than 2 KB). */
#ifndef Q_PREFETCH_BLOCKS
#define Q_PREFETCH_BLOCKS 1
#endif
static inline int64_t q_prefetch_at(int64_t rb, int rows) {
  return Q_PREFETCH_BLOCKS ? Q_PREFETCH_BLOCKS * rows * rb : Q_PREFETCH;
}

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
  const float *xs16; /* [M, nb * 2] dx * Σ q_x per 16 values, for ggml blocks with per-16 scales, or NULL */
  const int32_t *xz16; /* [M, nb * 2] -32 Σ q_x per 16 values (beside xs16): Q6_K's zero folded into I_j */
  const float *xp;  /* [M, nb * 32] fp32 x zero-padded, for the exact path */
  int y_bf16, n_parts, exact;
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

/* ggml's Q5_0 / Q5_1 (one sub-block a block): summed in the canonical order by qtile_k.c's q5_tiles and qpanel.c. */
static inline int kq_q5(int kind) { return kind == 6 || kind == 7; }
/* ggml types summed in the canonical order (qtile_k.c's q5_tiles / qk_tiles, qpanel.c's panels): Q5_0, Q5_1 and the
 * K-quants Q2_K-Q6_K (kquant.c keeps its own tiles for KQ_OWN_ORDER=1 builds, an A/B). */
static inline int kq_canonical(int kind) {
#ifdef KQ_OWN_ORDER /* an A/B build: the K-quants in kquant.c's tiles at every count of rows, as before */
  return kq_q5(kind);
#else
  return kq_q5(kind) || (kind >= 10 && kind <= 14);
#endif
}
/* Whether the panels (qpanel.c) take this matrix for M rows of x in this mode. The K-quants (kquant.c) do not:
 * their decode and batch tiles sum each output in kquant.c's own order (a block's sub-blocks in lanes, then the
 * block's D and zero terms), which packed panels do not repeat, so every count of rows takes the tiles and a
 * row's output stays the same bits in a prompt chunk as in decode (issue 32's one numeric path). Q5_0 and Q5_1
 * take the canonical sum everywhere (q5_tiles), so the panels may take their prompt chunks. */
static inline int q_panels_fit(const qmat_t *w, int64_t M, int mode) {
  /* every layout of quant.c: 8-bit and 4-bit (and 2/3-bit) codes, any group; W8A8's one d a row as well */
  return Q_PANELS_BUILT && mode != 2 && M >= Q_PANEL_ROWS && (!w->kind || kq_canonical(w->kind));
}
/* Rows n0..n1 of part a against every row of x in panels (qpanel.c); -1 when its buffer cannot be had. */
int q_panels(const qjob_t *j, const qpart_t *a, int64_t n0, int64_t n1);
/* Rows n0..n1 of part a against every row of x in virtual panels (qtile.c), the panels' arithmetic. */
void q_tiles(const qjob_t *j, const qpart_t *a, int64_t n0, int64_t n1);
/* The same for a Q5_0 / Q5_1 matrix (qtile_k.c): its blocks read in place, the canonical sum with s = d, mn = 16 d
 * or -m per block. */
void q5_tiles(const qjob_t *j, const qpart_t *a, int64_t n0, int64_t n1);
/* The same for Q2_K-Q6_K (qtile_k.c): s_j = D c_j, Z_j as kquant.c's kq_head, per group of 32 (16 for Q2_K, Q3_K,
 * Q6_K; Q6_K's zero term folded into its integers). */
void qk_tiles(const qjob_t *j, const qpart_t *a, int64_t n0, int64_t n1);
/* The same for M <= Q_ROWS_MAX rows of x (qrow.c, Q_ROWS_BUILT); -1 when its buffer cannot be had. */
int q_rows(const qjob_t *j, const qpart_t *a, int64_t n0, int64_t n1);
/* qamx.c: q_rows' x rows on Intel AMX tiles where Linux grants them (the same bits); Q_AMX=0 builds without (A/B),
 * RUVLLM_AMX=0 switches it off at run time. Q_AMX_MIN: the fewest x rows worth a tile pass (fewer: qrow.c). */
#ifndef Q_AMX
#define Q_AMX 1
#endif
#ifndef Q_AMX_MIN
#define Q_AMX_MIN 16
#endif
#if Q_ROWS_BUILT && Q_AMX && defined(__x86_64__) && defined(__GNUC__) && __GNUC__ >= 11
#define Q_AMX_BUILT 1
/* Rows n0.. of part a, in whole blocks of 16 below n1, against x rows 0..done - 1: returns done (0: none; the
 * caller runs every other row and the last block of fewer than 16 W rows). */
int64_t q_amx_rows(const qjob_t *j, const qpart_t *a, int64_t n0, int64_t n1);
int q_amx_ready(void);
#else
#define Q_AMX_BUILT 0
#endif

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
/* whether a ggml type's zero point is folded into its integers (Q6_K: I_j = Σ (c - 32) q, no zero term).
 * Q6_FOLD=0 builds the sum before it (Q6_K's zero term per group, as Q2_K/Q3_K's; packed by pack_blocks): an A/B. */
#ifndef Q6_FOLD
#define Q6_FOLD 1
#endif
static inline int kq_zero_folded(int kind) { return Q6_FOLD && kind == 14; }
/* xs16 [M, nb * 2] from the int8 x: dx * Σ q_x per 16 values; xz16 beside it: -32 Σ q_x */
void kq_sums16(const int8_t *qx, const float *dx, int64_t M, int64_t nb, float *xs16, int32_t *xz16);

/* The quantized products step.c runs (quant.c): parts sharing x, optionally SiLU-gated (mode: quant.c's). */
int rk_qlinear_parts(const void *x, int x_bf16, int n_parts, const qmat_t *parts, void *y, int y_bf16, int64_t M,
                     int64_t K, int mode, void *gated);
