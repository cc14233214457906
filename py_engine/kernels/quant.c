/* y[M, N] = x[M, K] @ W^T (+ bias) for W stored as integer codes in groups
 * (py_engine/quant), on AVX2 + FMA, split over pool.h's threads. Several
 * matrices that read the same x run as one job (fused qkv, gate/up).
 *
 * Layout (py_engine/quant/kernels.py packs it): each row is cut into
 * sub-blocks of 32 columns, zero-padded at the end; a group (one scale s and
 * zero point z) is `spg` sub-blocks. 4-bit (and 2/3-bit) codes: 16 bytes per
 * sub-block, byte j = code[j] | code[j + 16] << 4 (llama.cpp's Q4_0 order);
 * 8-bit codes: 32 bytes of code - 128 as int8. `mins` holds s * z' per group
 * (z' = z, or z - 128 for 8 bits), `zeros` the zero points themselves; a weight
 * with a float offset per group (w = s * c + m, GGUF's Q4_1) has no zeros and
 * mins = s * z' - m, which both decode paths already subtract. A weight with one
 * zero point for every group (symmetric: GGUF's Q4_0 and Q8_0, symmetric RTN)
 * has neither: its z' is the scalar zp and s * z' is taken from the scales.
 *
 * Int8 x (every count of rows): x is quantized per sub-block of 32 (d = max|x| / 127, q = round(x / d)), or
 * per row for W8A8, and each sub-block is one exact integer dot product (u8 x s8: vpdpbusd in the AVX-512 VNNI
 * build, maddubs on AVX2, as llama.cpp's Q8_0 x Q4_0), scaled by d * s and summed in quant.h's one order (the
 * canonical sum): y = sum_g (sum_b d_b s_g I_b) - mn_g X_g, with X_g = sum_b d_b sum(q_x). qtile.c (decode,
 * batches, every build) and qpanel.c (chunks of Q_PANEL_ROWS rows or more, AVX-512 VNNI) compute exactly it,
 * so a row's output does not depend on the rows beside it. Dequantizing to fp32 and using FMA took twice the
 * instructions per weight (measured below the memory's rate on these cores: see quant/kernels.py); until
 * issue 32 prompt chunks of 32+ rows ran MKL's sgemm on dequantized rows and fp32 x, so the same position got
 * other logits in a prompt than in decode.
 * The exact path (mode 2, int8_activations=False): fp32 x against the codes, rows2f per row of x alone.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "linear.h"
#include "pool.h"

#include "gate.h"
#include "quant.h"

/* 8 codes as fp32: 4-bit ones from a byte vector of nibble values, 8-bit ones straight from memory. */
static inline __m256 codes8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }
static inline __m256 codes8s(const uint8_t *c) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)c)));
}

/* The exact float path (QUANT_FLOAT): rows n, n + 1 against fp32 row m of x,
 * y = sum_g s_g (sum_i q_i x_i) - s_g z'_g X_g with X_g the group's sum of x. */
static inline __attribute__((always_inline)) void rows2f(const qjob_t *j, const qpart_t *a, int64_t m, int64_t n, int two, int bits4) {
  const qmat_t *w = &a->w;
  const int64_t nb = nb_of(w), rb = row_bytes(w), bb = bits4 ? 16 : 32;
  const float *xr = j->xp + m * nb * 32;
  const uint8_t *c0 = w->codes + n * rb, *c1 = two ? c0 + rb : c0;
  const float *s0 = w->scales + n * w->ng, *s1 = two ? s0 + w->ng : s0;
  const __m128i low = _mm_set1_epi8(0x0f);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int64_t g = 0, b = 0; g < w->ng; ++g) {
    __m256 f0[4], f1[4];
    for (int i = 0; i < 4; ++i) f0[i] = f1[i] = _mm256_setzero_ps();
    for (int64_t e = b + w->spg; b < e; ++b) {
      const float *x = xr + b * 32;
      for (int r = 0; r < 1 + two; ++r) {
        const uint8_t *c = (r ? c1 : c0) + b * bb;
        __m256 *f = r ? f1 : f0;
        if (bits4) {
          const __m128i raw = _mm_loadu_si128((const __m128i *)c);
          const __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
          f[0] = _mm256_fmadd_ps(codes8(lo), _mm256_loadu_ps(x), f[0]);
          f[1] = _mm256_fmadd_ps(codes8(_mm_srli_si128(lo, 8)), _mm256_loadu_ps(x + 8), f[1]);
          f[2] = _mm256_fmadd_ps(codes8(hi), _mm256_loadu_ps(x + 16), f[2]);
          f[3] = _mm256_fmadd_ps(codes8(_mm_srli_si128(hi, 8)), _mm256_loadu_ps(x + 24), f[3]);
        } else {
          for (int i = 0; i < 4; ++i) f[i] = _mm256_fmadd_ps(codes8s(c + 8 * i), _mm256_loadu_ps(x + 8 * i), f[i]);
        }
      }
    }
    acc0 = _mm256_fmadd_ps(_mm256_add_ps(_mm256_add_ps(f0[0], f0[1]), _mm256_add_ps(f0[2], f0[3])),
                           _mm256_broadcast_ss(s0 + g), acc0);
    if (two)
      acc1 = _mm256_fmadd_ps(_mm256_add_ps(_mm256_add_ps(f1[0], f1[1]), _mm256_add_ps(f1[2], f1[3])),
                             _mm256_broadcast_ss(s1 + g), acc1);
  }
  float y0 = hsum8(acc0), y1 = two ? hsum8(acc1) : 0.f;
  if (has_mins(w)) {
    float f;
    const float *xg = a->xg + m * w->ng, *m0 = mins_row(w, n, &f), *m1 = two ? m0 + w->ng : m0;
    for (int64_t g = 0; g < w->ng; ++g) {
      y0 -= (f * m0[g]) * xg[g];
      if (two) y1 -= (f * m1[g]) * xg[g];
    }
  }
  put_q(j, a, m, n, y0);
  if (two) put_q(j, a, m, n + 1, y1);
}

/* Row n of a ggml-block matrix against every row of the fp32 x (xp, zero-padded), a block of weights at a time,
 * dequantized exactly: the exact path (mode 2). */
static void exact_row(const qjob_t *j, const qpart_t *a, int64_t n) {
  const int64_t nb = nb_of(&a->w), values = a->w.spg * 32, bbytes = kq_block_bytes(a->w.kind);
  const uint8_t *c = a->w.codes + n * row_bytes(&a->w);
  enum { ROWS = 32 }; /* rows of x a pass over the row's blocks takes: each row's own FMA chain, as alone */
  __m256 acc[ROWS];
  for (int64_t m0 = 0; m0 < j->M; m0 += ROWS) {
    const int64_t mt = j->M - m0 < ROWS ? j->M - m0 : ROWS;
    for (int64_t m = 0; m < mt; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t s = 0; s < a->w.ng; ++s) {
      float wb[256];
      kq_dequantize_block(a->w.kind, c + s * bbytes, wb);
      for (int64_t m = 0; m < mt; ++m) {
        const float *x = j->xp + (m0 + m) * nb * 32 + s * values;
        for (int64_t k = 0; k < values; k += 8)
          acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(wb + k), _mm256_loadu_ps(x + k), acc[m]);
      }
    }
    for (int64_t m = 0; m < mt; ++m) put_q(j, a, m0 + m, n, hsum8(acc[m]));
  }
}

static void run_qpart_chunk(const qjob_t *j, const qpart_t *a, int64_t c) {
  int64_t n0 = c * a->rows_per_chunk, n1 = n0 + a->rows_per_chunk;
  if (n1 > a->w.N) n1 = a->w.N;
#if Q_PANELS_BUILT
  if (j->panel_parts >> (a - j->part) & 1) {
    if (q_panels(j, a, n0, n1) == 0) return;
    if (a->w.kind) kq_rows(j, a, n0, n1); /* no buffer for the panels: the same products in tiles */
    else q_tiles(j, a, n0, n1);
    return;
  }
#endif
  if (a->w.kind) { /* ggml blocks: int8 x in kquant.c's tiles (every count of rows), or fp32 x against the exact weights */
    if (!j->exact) {
      kq_rows(j, a, n0, n1);
      return;
    }
    for (int64_t n = n0; n < n1; ++n) exact_row(j, a, n);
    return;
  }
  if (!j->exact) { /* decode, batches, short chunks: qtile.c's virtual panels, the panels' arithmetic */
    q_tiles(j, a, n0, n1);
    return;
  }
  const int bits4 = a->w.bits4;
  for (int64_t n = n0; n < n1; n += 2) /* exact: these rows stay in L1 while every row of x passes */
    for (int64_t m = 0; m < j->M; ++m) rows2f(j, a, m, n, n + 1 < n1, bits4);
}

static void run_qchunk(const void *context, int64_t c) {
  const qjob_t *job = context;
  int p = 0;
  while (c >= job->first_chunk[p + 1]) ++p;
  run_qpart_chunk(job, &job->part[p], c - job->first_chunk[p]);
}

/* 8 values of x from k (fewer past K: zeros), as fp32. */
static inline __m256 load_x8(const void *x, int bf16, int64_t k, int64_t K) {
  if (k + 8 <= K) {
    if (!bf16) return _mm256_loadu_ps((const float *)x + k);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  float tmp[8] = {0};
  for (int64_t j = k; j < K; ++j) tmp[j - k] = load1(x, bf16, j);
  return _mm256_loadu_ps(tmp);
}

static inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* Row m of x as int8 in sub-blocks of 32, zero-padded to nb * 32: q = round(x / d) (ties to
 * even, as torch.round) with d = max|x| / 127 per sub-block, or one d for the row (per_row).
 * dx gets the scales, xs d * sum(q) per sub-block. */
static void quantize_row(const void *x, int bf16, int64_t K, int64_t nb, int per_row, int8_t *qx, float *dx,
                         float *xs) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  float row_max = 0.f;
  if (per_row) {
    __m256 mx = _mm256_setzero_ps();
    for (int64_t k = 0; k < nb * 32; k += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, load_x8(x, bf16, k, K)));
    row_max = hmax8(mx);
  }
  for (int64_t b = 0; b < nb; ++b) {
    __m256 v[4];
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load_x8(x, bf16, b * 32 + 8 * i, K);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
    }
    const float d = per_row ? row_max / 127.f : hmax8(mx) / 127.f;
    __m256i q[4];
    const __m256 dv = _mm256_set1_ps(d > 0.f ? d : 1.f);
    for (int i = 0; i < 4; ++i) {
      __m256 r = _mm256_round_ps(_mm256_div_ps(v[i], dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      r = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f));
      q[i] = _mm256_cvtps_epi32(r);
    }
    const __m256i sum4 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    const __m256i packed = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)(qx + b * 32), packed);
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum4), _mm256_extracti128_si256(sum4, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    dx[b] = d;
    xs[b] = d * (float)_mm_cvtsi128_si32(s);
  }
}

/* x [M, K] as int8 sub-blocks (per sub-block, or one d per row for W8A8). */
static void quantize_x(const void *x, int x_bf16, int64_t M, int64_t K, int64_t nb, int per_row, int8_t *qx,
                       float *dx, float *xs) {
  for (int64_t m = 0; m < M; ++m)
    quantize_row((const char *)x + m * K * (x_bf16 ? 2 : 4), x_bf16, K, nb, per_row, qx + m * nb * 32, dx + m * nb,
                 xs + m * nb);
}

static int64_t q_chunk_rows(int64_t n_rows, int64_t bytes_per_row) {
  int64_t bytes = n_rows * bytes_per_row / (4 * pool_threads());
  bytes = bytes < Q_MIN_CHUNK_BYTES ? Q_MIN_CHUNK_BYTES : bytes > Q_MAX_CHUNK_BYTES ? Q_MAX_CHUNK_BYTES : bytes;
  int64_t rows = bytes / bytes_per_row;
  return rows < Q_ROWS ? Q_ROWS : rows / Q_ROWS * Q_ROWS;
}

/* x as fp32 rows zero-padded to nb * 32, with each sub-block's sum in xs (the exact float path). */
static void pad_x(const void *x, int x_bf16, int64_t M, int64_t K, int64_t nb, float *xp, float *xs) {
  for (int64_t m = 0; m < M; ++m) {
    const void *row = (const char *)x + m * K * (x_bf16 ? 2 : 4);
    for (int64_t b = 0; b < nb; ++b) {
      __m256 sum = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        const __m256 v = load_x8(row, x_bf16, b * 32 + 8 * i, K);
        _mm256_storeu_ps(xp + m * nb * 32 + b * 32 + 8 * i, v);
        sum = _mm256_add_ps(sum, v);
      }
      xs[m * nb + b] = hsum8(sum);
    }
  }
}

/* y[M, sum N_p] = x[M, K] @ concat(W_p)^T (+ concat(bias_p)) for n_parts matrices with the same
 * sub-block count per row. mode: 0 int8 x per sub-block, 1 W8A8 (int8 x, one d per row), 2 exact (fp32 x,
 * dequantize-then-FMA). */
/* Rows n0..n1 of w, as a matrix of their own. */
static qmat_t rows_of(const qmat_t *w, int64_t n0, int64_t n1) {
  qmat_t r = *w;
  r.codes += n0 * row_bytes(w);
  if (r.scales) r.scales += n0 * w->ng;
  if (r.mins) r.mins += n0 * w->ng;
  if (r.zeros) r.zeros += n0 * w->ng;
  if (r.bias) r.bias = (const char *)r.bias + n0 * (w->bias_bf16 ? 2 : 4);
  r.N = n1 - n0;
  return r;
}

/* W rows a panel chunk takes: 32 (two panels) at a time, ~8 chunks a thread (896 rows at 2 threads: 14 chunks,
 * where 4 a thread gave 7 and one thread ran 4 of them), at most Q_MAX_DEQUANT bytes of panels (a byte a code). */
static int64_t panel_rows(const qmat_t *w) {
  const int64_t nb = nb_of(w);
  int64_t rows = w->N / (8 * pool_threads()) + 1;
  if (rows * nb * 32 > Q_MAX_DEQUANT) rows = Q_MAX_DEQUANT / (nb * 32) + 1;
  return (rows + 31) / 32 * 32;
}

/* The parts' products into y [M, sum of N_p] (job: x's buffers set), their rows split over the pool; panel parts
 * in chunks of panel_chunk rows (0: panel_rows). */
static void run_parts(qjob_t *job, int n_parts, const qmat_t *parts, void *y, float *xg, const float *xs,
                      int64_t panel_chunk) {
  const int64_t M = job->M, nb = nb_of(&parts[0]);
  int64_t ldy = 0, column = 0, group = 0;
  for (int p = 0; p < n_parts; ++p) ldy += parts[p].N;
  job->ldy = ldy;
  job->first_chunk[0] = 0;
  for (int p = 0; p < n_parts; ++p) {
    const qmat_t *w = &parts[p];
    float *part_xg = NULL;
    if (w->kind) { /* ggml blocks: kquant.c's tiles read quant.c's xs and xs16 themselves */
    } else if (has_mins(w) || !w->bits4) { /* X_g per row of x for this part's grouping (8-bit: the 128 s X_g term) */
      part_xg = xg + group * M;
      for (int64_t m = 0; m < M; ++m)
        for (int64_t g = 0; g < w->ng; ++g) {
          float s = 0.f;
          for (int64_t b = g * w->spg; b < (g + 1) * w->spg; ++b) s += xs[m * nb + b];
          part_xg[m * w->ng + g] = s;
        }
      group += w->ng;
    }
    int64_t rows;
    if (job->panel_parts >> p & 1) {
      rows = panel_chunk ? panel_chunk : panel_rows(w);
    } else {
      rows = q_chunk_rows(w->N, row_bytes(w));
    }
    job->part[p] = (qpart_t){*w, part_xg, (char *)y + column * (job->y_bf16 ? 2 : 4), rows};
    job->first_chunk[p + 1] = job->first_chunk[p] + (w->N + rows - 1) / rows;
    column += w->N;
  }
  pool_run(job->first_chunk[n_parts], run_qchunk, job, sizeof *job);
}

/* A gated product with both parts in panels and no y from the caller: gate and up rows c0..c1 at a time into a
 * block of about Q_GATE_BLOCK_BYTES (whole panel chunks, at least one), gated as it fills: the [M, 2N] product
 * never exists whole (a 128-token prefill of Qwen2.5-0.5B held 4.75 MiB of it beside the 2.4 MiB output). Each
 * output is the same products in the same order as in one call (a panel's rows are independent), so bit for
 * bit the same. Time against the whole product (4864 x 896 int8, 2 threads, shared machine): 0.90x at 128
 * rows (the block's gate reads stay in L2), 0.96x at 512; chunks cut to fit 256 columns were 1.06x. */
#ifndef Q_GATE_BLOCK_BYTES
#define Q_GATE_BLOCK_BYTES (1 << 19)
#endif
static int gated_blocks(qjob_t *job, const qmat_t *parts, void *gated, float *xg, const float *xs, void **buffer,
                        int64_t *size) {
  const int64_t M = job->M, N = parts[0].N, ysize = job->y_bf16 ? 2 : 4;
  const int64_t chunk = panel_rows(&parts[0]); /* the whole call's chunks: each passes over every row of x */
  int64_t cb = Q_GATE_BLOCK_BYTES / (M * 2 * ysize) / chunk * chunk;
  cb = cb < chunk ? chunk : cb > N ? N : cb;
  void *yb = pool_scratch(buffer, size, M * 2 * cb * ysize);
  if (!yb) return -2;
  for (int64_t c0 = 0; c0 < N; c0 += cb) {
    const int64_t c1 = c0 + cb < N ? c0 + cb : N;
    const qmat_t two[2] = {rows_of(&parts[0], c0, c1), rows_of(&parts[1], c0, c1)};
    run_parts(job, 2, two, yb, xg, xs, chunk);
    rk_gate_rows(yb, (char *)gated + c0 * ysize, job->y_bf16, M, c1 - c0, N);
  }
  return 0;
}

/* As rk_qlinear_parts, then, when gated is not NULL (two parts of equal N: gate and up),
 * gated [M, N] = silu(gate) * up: a SiLU MLP's hidden layer in one call. y may then be NULL: the product is
 * the call's own (in column blocks where both parts run panels, see gated_blocks). */
int rk_qlinear_parts(const void *x, int x_bf16, int n_parts, const qmat_t *parts, void *y, int y_bf16,
                     int64_t M, int64_t K, int mode, void *gated) {
  if (M < 1 || K < 1 || n_parts < 1 || n_parts > Q_MAX_PARTS || mode < 0 || mode > 2) return -1;
  if (gated && (n_parts != 2 || parts[0].N != parts[1].N)) return -1;
  if (!y && !gated) return -1;
  const int64_t nb = nb_of(&parts[0]);
  if (nb * 32 < K) return -1;
  for (int p = 0; p < n_parts; ++p)
    if (nb_of(&parts[p]) != nb || parts[p].N < 1) return -1;
  static __thread void *buffers[9];
  static __thread int64_t sizes[9];
  const int exact = mode == 2;
  int panel_parts = 0; /* parts in panels (qpanel.c); the rest in qtile.c's virtual panels: one arithmetic */
  for (int p = 0; p < n_parts; ++p)
    if (q_panels_fit(&parts[p], M, mode)) panel_parts |= 1 << p;
  int8_t *qx = pool_scratch(&buffers[0], &sizes[0], M * nb * 32);
  float *dx = pool_scratch(&buffers[1], &sizes[1], M * nb * 4 * 2);
  float *xp = exact ? pool_scratch(&buffers[4], &sizes[4], M * nb * 32 * 4) : NULL;
  int64_t groups = 0;
  for (int p = 0; p < n_parts; ++p) groups += parts[p].ng;
  float *xg = pool_scratch(&buffers[3], &sizes[3], M * groups * 4);
  if (!qx || !dx || !xg || (exact && !xp)) return -2;
  float *xs = dx + M * nb;
  if (exact) pad_x(x, x_bf16, M, K, nb, xp, xs);
  else quantize_x(x, x_bf16, M, K, nb, mode == 1, qx, dx, xs);
  qjob_t job = {.qx = qx, .dx = dx, .xp = xp, .y_bf16 = y_bf16, .n_parts = n_parts, .exact = exact,
                .panel_parts = panel_parts, .M = M, .K = K};
  int blocks16 = 0; /* ggml parts with per-16 scales (Q2_K, Q3_K, Q6_K): their zero terms take xs16 */
  for (int p = 0; p < n_parts; ++p) blocks16 |= kq_per16(parts[p].kind);
  if (blocks16 && !exact) {
    float *xs16 = pool_scratch(&buffers[8], &sizes[8], M * nb * 2 * 8);
    if (!xs16) return -2;
    int32_t *xz16 = (int32_t *)(xs16 + M * nb * 2);
    kq_sums16(qx, dx, M, nb, xs16, xz16);
    job.xs16 = xs16, job.xz16 = xz16;
  }
  if (gated && !y && panel_parts == 3) return gated_blocks(&job, parts, gated, xg, xs, &buffers[7], &sizes[7]);
  void *whole = y ? NULL : aligned_alloc(64, (size_t)((M * (parts[0].N + parts[1].N) * (y_bf16 ? 2 : 4) + 63) / 64 * 64));
  if (!y && !whole) return -2;
  run_parts(&job, n_parts, parts, y ? y : whole, xg, xs, 0);
  const int status = gated ? rk_gate(y ? y : whole, gated, y_bf16, M, parts[0].N) : 0;
  free(whole);
  return status;
}

/* Rows of x from which the int8-x path would multiply in fp32 instead: none any more (one arithmetic for every
 * count of rows, quant.h), kept for the Python side's question. */
int64_t rk_quant_tile_rows(void) { return INT64_MAX; }

/* The same for one layout (bits4: 4-bit or fewer codes): INT64_MAX where every count of rows takes int8 x
 * (builds with qpanel.c's panels, every layout; the argument keeps room for a per-layout answer). */
int64_t rk_quant_int8_rows(int bits4) { (void)bits4; return Q_PANELS_BUILT ? INT64_MAX : rk_quant_tile_rows(); }
