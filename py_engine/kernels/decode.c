/* The small ops of one decode step, each one call instead of ~10 torch ops.
 *
 * In a decode step torch spends ~15 ms of CPU per token of Qwen2.5-0.5B on
 * dispatching ~1,800 tiny ops (norms, rope, the cache write, one query's
 * attention), about half the time the weights take to stream at 30 GB/s in
 * bf16. These do the same arithmetic in the same order of roundings: every
 * intermediate torch would hold in bf16 is rounded to bf16 here too (`r`),
 * and everything else is fp32, so the torch path stays the oracle.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attend.h"
#include "decode.h"
#include "paged.h"
#include "pool.h"

/* RMSNorm over the last dim of x [rows, dim], as layers.RMSNorm: Llama casts
 * x / rms to the dtype, then multiplies by w; Gemma multiplies by (1 + w) in fp32. */
void rk_rms_norm(const void *x, const void *w, void *y, int64_t rows, int64_t dim, float eps,
                 int unit_offset, int bf16) {
  for (int64_t m = 0; m < rows; ++m) {
    float ss = 0.f;
    for (int64_t i = 0; i < dim; ++i) {
      float v = load1(x, bf16, m * dim + i);
      ss += v * v;
    }
    float inv = 1.f / sqrtf(ss / (float)dim + eps);
    for (int64_t i = 0; i < dim; ++i) {
      float h = load1(x, bf16, m * dim + i) * inv;
      float v = unit_offset ? h * (1.f + load1(w, bf16, i)) : load1(w, bf16, i) * r(h, bf16);
      st(y, bf16, m * dim + i, v);
    }
  }
}

typedef struct {
  const void *qkv, *cos, *sin;     /* [T, (H + 2 KV) * D]; [T, rot] each */
  void *keys, *values, *out;       /* [KV, max_len, D] each; [T, H * D] */
  int64_t H, KV, D, rot, pos, start, max_len;
  float scale, softcap;            /* softcap 0: none */
  int bf16;
  float *scratch;                  /* [KV, (G + 1) * D + max_len] floats: q, one key, scores (per chunk) */
  const cold_t *cold;              /* NULL: every token from the buffers */
  int64_t T, window;               /* rows at positions pos..pos + T - 1; window 0: none (rows > 1: start by row) */
  int *failed;                     /* rk_attend_rows: set when a thread's scratch cannot be had */
} attend_t;

/* Rotate the first rot channels of one head as rope.apply_rotary does:
 * x * cos + rotate_half(x) * sin, each product and the sum in the dtype. */
static void rope_row(const attend_t *a, const void *src, int64_t off, int64_t t, float *dst) {
  const int64_t half = a->rot / 2;
  for (int64_t i = 0; i < a->D; ++i) {
    float x = load1(src, a->bf16, off + i);
    if (i >= a->rot) {
      dst[i] = x;
      continue;
    }
    float rh = i < half ? -load1(src, a->bf16, off + i + half) : load1(src, a->bf16, off + i - half);
    float c = load1(a->cos, a->bf16, t * a->rot + i), s = load1(a->sin, a->bf16, t * a->rot + i);
    dst[i] = r(r(x * c, a->bf16) + r(rh * s, a->bf16), a->bf16);
  }
}

static void rope(const attend_t *a, const void *src, int64_t off, float *dst) { rope_row(a, src, off, 0, dst); }

/* Scores of query qh against the cold tokens start..cold->tokens - 1 of KV head g: q . (code * scale + zero)
 * summed as (q * scale) . code + q . zero, the products by block (qs: D floats of scratch). */
static void cold_scores(const attend_t *a, const float *qh, int64_t g, int64_t start, float *qs, float *scores) {
  const cold_t *c = a->cold;
  const int64_t D = a->D, packed = D * c->bits / 8;
  float qz = 0.f;
  int64_t block = -1;
  for (int64_t s = start; s < c->tokens; ++s) {
    if (s / c->bs != block) {
      block = s / c->bs;
      const float *ks = c->ks + (g * c->max_blocks + block) * D, *kz = c->kz + (g * c->max_blocks + block) * D;
      __m256 z = _mm256_setzero_ps();
      for (int64_t i = 0; i < D; i += 8) {
        const __m256 q = _mm256_loadu_ps(qh + i);
        _mm256_storeu_ps(qs + i, _mm256_mul_ps(q, _mm256_loadu_ps(ks + i)));
        z = _mm256_fmadd_ps(q, _mm256_loadu_ps(kz + i), z);
      }
      qz = hsum8(z);
    }
    const uint8_t *code = c->kc + ((g * c->max_blocks + block) * c->bs + s % c->bs) * packed;
    scores[s - start] = cold_dot(qs, code, (int)c->bits, D) + qz;
  }
}

/* acc += sum over the cold tokens of p[s] * (code * scale_s + zero_s), p = weights from `start`. */
static void cold_values(const attend_t *a, int64_t g, int64_t start, const float *p, float *acc) {
  const cold_t *c = a->cold;
  const int64_t D = a->D, packed = D * c->bits / 8;
  float zsum = 0.f;
  for (int64_t s = start; s < c->tokens; ++s) {
    const int64_t row = g * a->max_len + s;
    zsum += p[s - start] * c->vz[row];
    cold_axpy(acc, p[s - start] * c->vs[row], c->vc + row * packed, (int)c->bits, D);
  }
  for (int64_t i = 0; i < D; ++i) acc[i] += zsum;
}

/* Row t's new key and value for KV head g, rotated and stored at pos + t (k: D floats of scratch). */
static void store_kv(const attend_t *a, int64_t t, int64_t g, float *k) {
  const int64_t D = a->D, width = (a->H + 2 * a->KV) * D, row = (g * a->max_len + a->pos + t) * D;
  rope_row(a, a->qkv, t * width + (a->H + g) * D, t, k);
  for (int64_t i = 0; i < D; ++i) {
    st(a->keys, a->bf16, row + i, k[i]);
    st(a->values, a->bf16, row + i, load1(a->qkv, a->bf16, t * width + (a->H + a->KV + g) * D + i));
  }
}

/* Row t's G query heads of KV head g over keys start..pos + t (softmax in fp32, as attention.py): the same
 * operations for a row whether it comes alone (decode) or with others (a prompt chunk, a speculative step's
 * k + 1 rows), so its output does not depend on them. q: [G * D + D + max_len] floats of scratch. */
static void attend_query(const attend_t *a, int64_t t, int64_t g, float *q) {
  const int64_t D = a->D, G = a->H / a->KV, width = (a->H + 2 * a->KV) * D, pos = a->pos + t;
  const int64_t start = a->T > 1 ? (a->window > 0 && pos + 1 > a->window ? pos + 1 - a->window : 0) : a->start;
  const int64_t n = pos + 1 - start;
  float *k = q + G * D, *scores = k + D;
  const int esz = a->bf16 ? 2 : 4;
  const char *keys = (const char *)a->keys + (g * a->max_len + start) * D * esz;
  const char *values = (const char *)a->values + (g * a->max_len + start) * D * esz;
  /* tokens start..start + n_cold - 1 are cold (read from codes), the rest from the buffers */
  const int64_t n_cold = a->cold && a->cold->tokens > start ? a->cold->tokens - start : 0;
  for (int64_t h = 0; h < G; ++h) {
    float *qh = q + h * D;
    rope_row(a, a->qkv, t * width + (g * G + h) * D, t, qh);
    float top = -INFINITY, sum = 0.f;
    if (n_cold) cold_scores(a, qh, g, start, k, scores); /* k: the key row is free as scratch here */
    int64_t s8 = n_cold;
    for (; s8 + 8 <= n; s8 += 8) dot8_rows(qh, keys + s8 * D * esz, D, a->bf16, D, scores + s8); /* dot()'s bits */
    for (int64_t s = 0; s < n; ++s) {
      float v = s < s8 ? scores[s] : dot(qh, keys + s * D * esz, a->bf16, D);
      v *= a->scale;
      if (a->softcap > 0.f) v = tanhf(v / a->softcap) * a->softcap;
      scores[s] = v;
      top = v > top ? v : top;
    }
    for (int64_t s = 0; s < n; ++s) sum += scores[s] = expf(scores[s] - top);
    float acc[D] __attribute__((aligned(32))); /* the weighted sum of values */
    for (int64_t i = 0; i < D; ++i) acc[i] = 0.f;
    if (n_cold) {
      for (int64_t s = 0; s < n_cold; ++s) scores[s] /= sum;
      cold_values(a, g, start, scores, acc);
    }
    axpy_rows(acc, scores + n_cold, sum, (const char *)values + n_cold * D * esz, a->bf16, D, n - n_cold);
    for (int64_t i = 0; i < D; ++i) st(a->out, a->bf16, t * a->H * D + (g * G + h) * D + i, acc[i]);
  }
}

static float *chunk_scratch(const attend_t *a, int64_t chunk) {
  return a->scratch + chunk * ((a->H / a->KV + 1) * a->D + a->max_len);
}

/* KV head g of one token: store its key and value, then attend its query heads. */
static void attend_head(const void *context, int64_t g) {
  const attend_t *a = context;
  float *q = chunk_scratch(a, g);
  store_kv(a, 0, g, q + a->H / a->KV * a->D);
  attend_query(a, 0, g, q);
}

/* The calling thread's scratch for a chunk of rk_attend_rows (chunks of several rows run at once on the pool). */
static float *thread_scratch(const attend_t *a) {
  static __thread void *buffer;
  static __thread int64_t size;
  return pool_scratch(&buffer, &size, ((a->H / a->KV + 1) * a->D + a->max_len) * 4);
}

static void store_head(const void *context, int64_t g) {
  const attend_t *a = context;
  float *k = thread_scratch(a);
  if (!k) {
    __atomic_store_n(a->failed, 1, __ATOMIC_RELAXED);
    return;
  }
  for (int64_t t = 0; t < a->T; ++t) store_kv(a, t, g, k);
}

static void attend_chunk(const void *context, int64_t c) { /* chunk c: row c / KV, KV head c % KV */
  const attend_t *a = context;
  float *q = thread_scratch(a);
  if (!q) {
    __atomic_store_n(a->failed, 1, __ATOMIC_RELAXED);
    return;
  }
  attend_query(a, c / a->KV, c % a->KV, q);
}

/* One token of one sequence: rope, cache write and attention for every head. */
int rk_attend_one(const void *qkv, const void *cos, const void *sin, void *keys, void *values, void *out,
                  int64_t H, int64_t KV, int64_t D, int64_t rot, int64_t pos, int64_t start, int64_t max_len,
                  float scale, float softcap, int bf16, float *scratch, const cold_t *cold) {
  if (D % 8 || H % KV || rot > D || rot % 2 || pos >= max_len || start > pos || start < 0) return -1;
  if (cold && (cold->tokens > pos || cold->tokens % cold->bs || (cold->bits != 8 && cold->bits != 4)
               || cold->tokens > cold->max_blocks * cold->bs))
    return -1;
  if (cold && cold->tokens == 0) cold = NULL;
  attend_t a = {qkv, cos, sin, keys, values, out, H, KV, D, rot, pos, start, max_len, scale, softcap, bf16, scratch,
                cold, 1, 0, NULL};
  pool_run(KV, attend_head, &a, sizeof a);
  return 0;
}

/* T tokens of one sequence at positions pos..pos + T - 1 (a prompt chunk, a speculative step's k + 1 rows): every
 * key and value rotated and stored first, then each row attends exactly as rk_attend_one would at its position
 * (window > 0: over its last `window` tokens). qkv [T, (H + 2 KV) * D], cos and sin [T, rot], out [T, H * D].
 * No cold tier: a two-tier cache's chunks keep the torch path. Returns -2 when a thread's scratch cannot be had. */
int rk_attend_rows(const void *qkv, const void *cos, const void *sin, void *keys, void *values, void *out,
                   int64_t T, int64_t H, int64_t KV, int64_t D, int64_t rot, int64_t pos, int64_t window,
                   int64_t max_len, float scale, float softcap, int bf16) {
  if (T < 1 || D % 8 || H % KV || rot > D || rot % 2 || pos < 0 || pos + T > max_len || window < 0) return -1;
  int failed = 0;
  attend_t a = {qkv, cos, sin, keys, values, out, H, KV, D, rot, pos, 0, max_len, scale, softcap, bf16, NULL,
                NULL, T, window, &failed};
  pool_run(KV, store_head, &a, sizeof a);
  if (!failed) pool_run(T * KV, attend_chunk, &a, sizeof a);
  return failed ? -2 : 0;
}

/* One token of one sequence over a paged cache (the server's single-stream step, step.c): rope, the
 * new key and value written at `slot` of p's caches (TorchPagedAttention.write's layout, p->kv's type), the rotated
 * queries stored in q (H * D of the dtype, what torch's tensor would hold), then paged.c's attention
 * over p's one row. scratch: D floats. */
int rk_paged_attend_one(const void *qkv, const void *cos, const void *sin, int64_t rot, int64_t slot, void *q,
                        float *scratch, paged_t *p) {
  const int64_t H = p->H, KV = p->KV, D = p->D;
  if (D % 8 || KV < 1 || H % KV || rot > D || rot % 2 || p->rows != 1 || slot < 0 || p->kv < KV_F32 || p->kv > KV_F16)
    return -1; /* before anything is written: a cache of an unknown type is left as it was */
  attend_t a = {0};
  a.qkv = qkv, a.cos = cos, a.sin = sin, a.H = H, a.KV = KV, a.D = D, a.rot = rot, a.bf16 = p->bf16;
  for (int64_t g = 0; g < KV; ++g) {
    rope(&a, qkv, (H + g) * D, scratch);
    const int64_t row = (slot * KV + g) * D;
    for (int64_t i = 0; i < D; ++i) {
      st((void *)p->keys, p->kv, row + i, scratch[i]); /* rounded once to the cache's type */
      st((void *)p->values, p->kv, row + i, load1(qkv, p->bf16, (H + KV + g) * D + i));
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    rope(&a, qkv, h * D, scratch);
    for (int64_t i = 0; i < D; ++i) st(q, p->bf16, h * D + i, scratch[i]);
  }
  p->q = q, p->q_token_stride = H * D, p->q_head_stride = D;
  return rk_paged_decode(p);
}

/* torch.argmax of n fp32 values: the first index of the largest, or of the first NaN (torch
 * treats NaN as the largest). torch's CPU argmax of a 151,936-logit row took ~0.35 ms, ~2% of a
 * quantized decode step; this reads it twice at cache speed. */
int64_t rk_argmax(const float *x, int64_t n) {
  if (n <= 0) return -1;
  __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    top = _mm256_max_ps(top, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float lanes[8], best;
  _mm256_storeu_ps(lanes, top);
  best = lanes[0];
  for (int j = 1; j < 8; ++j) best = lanes[j] > best ? lanes[j] : best;
  int any_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t k = i; k < n; ++k) {
    if (x[k] != x[k]) any_nan = 1;
    else if (x[k] > best) best = x[k];
  }
  for (int64_t k = 0; k < n; ++k)
    if (any_nan ? x[k] != x[k] : x[k] == best) return k;
  return 0; /* not reached */
}
