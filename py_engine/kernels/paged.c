/* Paged attention of the server's decode rows: one query per sequence over its block table.
 *
 * The paged cache (native_server/engine/attention/interface.py) keeps per layer keys and
 * values [num_blocks, block_size, KV, D]; sequence s's tokens are its table's
 * blocks in order. The torch path gathers those blocks into a padded copy
 * every layer and calls attention(); here each (sequence, KV head) is one
 * chunk of the pool: its G query heads walk the table once, reading hot
 * blocks in place, and with a two-tier cache (int8/int4 KV) the table's
 * leading n_cold ids are blocks of the cold pool (native_server/engine/kv_cache.py's
 * ColdPool: codes [blocks, bs, KV, D * bits / 8], key scales and zero points
 * [blocks, 1, KV, D] per channel, value ones [blocks, bs, KV, 1] per token),
 * dequantized on the fly as decode.c reads the dense cache's cold tier:
 *   q . (code * scale + zero) = (q * scale) . code + q . zero.
 * Softmax is online, block by block (running max and sum, the accumulator
 * rescaled when the max grows), in fp32 as attention.py's; the output is
 * rounded once to q's dtype. The hot blocks hold fp32, bf16 or fp16 (a->kv:
 * --kv-cache-dtype fp16 / bf16 stores them apart from the model's dtype),
 * widened to fp32 as they are read.
 */
#include <math.h>
#include <stdint.h>

#include "attend.h"
#include "paged.h"
#include "pool.h"
#include "vmath.h"


/* The sums of a[0..7] (8 lanes each) as one vector: 8 dot products finished at once. */
static inline __m256 hsum8x8(const __m256 *a) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* q . key for keys rows[0], rows[stride], ... rows[7 stride] (elements of type t). */
static inline __m256 dot8(const float *q, const void *rows, int64_t stride, int t, int64_t D) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, load8_kv(rows, t, j * stride + i), acc[j]);
  }
  return hsum8x8(acc);
}

/* qs . codes for 8 cold key rows `stride` bytes apart. */
static inline __m256 cold_dot8(const float *qs, const uint8_t *codes, int64_t stride, int bits, int64_t D) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 qv = _mm256_loadu_ps(qs + i);
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, codes8(codes + j * stride, bits, i), acc[j]);
  }
  return hsum8x8(acc);
}

/* One block's keys against the G queries: sc[h * bs + o] for its tokens lo..hi - 1 (offsets in the
 * block), eight tokens a step where they are there. */
static void block_scores(const paged_t *a, int64_t id, int cold, int64_t g, int64_t lo, int64_t hi, const float *q,
                         float *qs, float *qz, float *sc) {
  const int64_t D = a->D, G = a->H / a->KV, esz = elem_size(a->kv), bs = a->bs;
  if (cold) {
    const int64_t packed = D * a->bits / 8, stride = a->KV * packed;
    const float *ks = a->ks + (id * a->KV + g) * D, *kz = a->kz + (id * a->KV + g) * D;
    const uint8_t *codes = a->kc + ((id * bs) * a->KV + g) * packed; /* token o's row: codes + o * stride */
    for (int64_t h = 0; h < G; ++h) { /* per block: q * scale and q . zero, as decode.c's cold_scores */
      __m256 z = _mm256_setzero_ps();
      for (int64_t i = 0; i < D; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + h * D + i);
        _mm256_storeu_ps(qs + h * D + i, _mm256_mul_ps(qv, _mm256_loadu_ps(ks + i)));
        z = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kz + i), z);
      }
      qz[h] = hsum8(z);
    }
    for (int64_t h = 0; h < G; ++h) {
      int64_t o = lo;
      for (; o + 8 <= hi; o += 8)
        _mm256_storeu_ps(sc + h * bs + o, _mm256_add_ps(cold_dot8(qs + h * D, codes + o * stride, stride, a->bits, D),
                                                        _mm256_set1_ps(qz[h])));
      for (; o < hi; ++o) sc[h * bs + o] = cold_dot(qs + h * D, codes + o * stride, a->bits, D) + qz[h];
    }
  } else {
    const int64_t stride = a->KV * D; /* elements from one token's key to the next */
    const char *keys = (const char *)a->keys + ((id * bs) * a->KV + g) * D * esz;
    for (int64_t h = 0; h < G; ++h) {
      int64_t o = lo;
      const float *qh = q + h * D;
      if (a->kv == KV_F16) /* each type its own loop: load8 inlined without a branch */
        for (; o + 8 <= hi; o += 8) _mm256_storeu_ps(sc + h * bs + o, dot8(qh, keys + o * stride * 2, stride, KV_F16, D));
      else if (a->kv == KV_BF16)
        for (; o + 8 <= hi; o += 8) _mm256_storeu_ps(sc + h * bs + o, dot8(qh, keys + o * stride * 2, stride, KV_BF16, D));
      else
        for (; o + 8 <= hi; o += 8) _mm256_storeu_ps(sc + h * bs + o, dot8(qh, keys + o * stride * 4, stride, KV_F32, D));
      for (; o < hi; ++o) sc[h * bs + o] = dot(q + h * D, keys + o * stride * esz, a->kv, D);
    }
  }
  for (int64_t h = 0; h < G; ++h)
    for (int64_t o = lo; o < hi; ++o) {
      float v = sc[h * bs + o] * a->scale;
      if (a->softcap > 0.f) v = tanhf(v / a->softcap) * a->softcap;
      sc[h * bs + o] = v;
    }
}

/* exp(s[o] - top) for o in lo..hi - 1, in place, 8 at a time (exp8: ~1 ulp). */
static void exps(float *s, int64_t lo, int64_t hi, float top) {
  const __m256 t = _mm256_set1_ps(top);
  int64_t o = lo;
  for (; o + 8 <= hi; o += 8) _mm256_storeu_ps(s + o, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + o), t)));
  if (o < hi) {
    float tail[8] = {0};
    for (int64_t j = o; j < hi; ++j) tail[j - o] = s[j];
    _mm256_storeu_ps(tail, exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), t)));
    for (int64_t j = o; j < hi; ++j) s[j] = tail[j - o];
  }
}

/* acc[0..D) += sum_o w[o] * row_o for rows `stride` apart (elements of type t, or cold codes when bits):
 * the accumulator stays in registers, 32 channels at a time. */
static inline void rows_axpy(float *acc, const float *w, int64_t lo, int64_t hi, const void *rows, int64_t stride,
                             int t, int bits, int64_t D) {
  int64_t c = 0;
  for (; c + 32 <= D; c += 32) {
    __m256 a0 = _mm256_loadu_ps(acc + c), a1 = _mm256_loadu_ps(acc + c + 8), a2 = _mm256_loadu_ps(acc + c + 16),
           a3 = _mm256_loadu_ps(acc + c + 24);
    for (int64_t o = lo; o < hi; ++o) {
      const __m256 p = _mm256_set1_ps(w[o]);
      if (bits) {
        const uint8_t *row = (const uint8_t *)rows + o * stride;
        a0 = _mm256_fmadd_ps(p, codes8(row, bits, c), a0), a1 = _mm256_fmadd_ps(p, codes8(row, bits, c + 8), a1);
        a2 = _mm256_fmadd_ps(p, codes8(row, bits, c + 16), a2), a3 = _mm256_fmadd_ps(p, codes8(row, bits, c + 24), a3);
      } else {
        const int64_t r = o * stride + c;
        a0 = _mm256_fmadd_ps(p, load8_kv(rows, t, r), a0), a1 = _mm256_fmadd_ps(p, load8_kv(rows, t, r + 8), a1);
        a2 = _mm256_fmadd_ps(p, load8_kv(rows, t, r + 16), a2), a3 = _mm256_fmadd_ps(p, load8_kv(rows, t, r + 24), a3);
      }
    }
    _mm256_storeu_ps(acc + c, a0), _mm256_storeu_ps(acc + c + 8, a1), _mm256_storeu_ps(acc + c + 16, a2);
    _mm256_storeu_ps(acc + c + 24, a3);
  }
  for (; c < D; c += 8) {
    __m256 a0 = _mm256_loadu_ps(acc + c);
    for (int64_t o = lo; o < hi; ++o)
      a0 = _mm256_fmadd_ps(_mm256_set1_ps(w[o]), bits ? codes8((const uint8_t *)rows + o * stride, bits, c)
                                                      : load8_kv(rows, t, o * stride + c), a0);
    _mm256_storeu_ps(acc + c, a0);
  }
}

/* acc_h = acc_h * exp(m_h - m'_h) + sum_o exp(sc - m'_h) v_o over one block (online softmax); sc becomes
 * the weights. */
static void block_values(const paged_t *a, int64_t id, int cold, int64_t g, int64_t lo, int64_t hi, float *sc,
                         float *m, float *l, float *acc) {
  const int64_t D = a->D, G = a->H / a->KV, esz = elem_size(a->kv), bs = a->bs;
  for (int64_t h = 0; h < G; ++h) {
    float *s = sc + h * bs, *ah = acc + h * D, top = m[h];
    for (int64_t o = lo; o < hi; ++o) top = s[o] > top ? s[o] : top;
    if (top > m[h]) { /* the running max grew: what was summed so far shrinks by exp(old - new) */
      const float c = m[h] == -INFINITY ? 0.f : expf(m[h] - top);
      l[h] *= c;
      for (int64_t i = 0; i < D; ++i) ah[i] *= c;
      m[h] = top;
    }
    exps(s, lo, hi, top);
    for (int64_t o = lo; o < hi; ++o) l[h] += s[o];
    const int64_t first = (id * bs) * a->KV + g; /* token o's row: first + o * KV */
    if (cold) {
      const int64_t packed = D * a->bits / 8;
      float w[bs], zsum = 0.f;
      for (int64_t o = lo; o < hi; ++o) {
        w[o] = s[o] * a->vs[first + o * a->KV];
        zsum += s[o] * a->vz[first + o * a->KV];
      }
      rows_axpy(ah, w, lo, hi, a->vc + first * packed, a->KV * packed, 0, a->bits, D);
      for (int64_t i = 0; i < D; ++i) ah[i] += zsum;
    } else if (a->kv == KV_F16) {
      rows_axpy(ah, s, lo, hi, (const char *)a->values + first * D * esz, a->KV * D, KV_F16, 0, D);
    } else if (a->kv == KV_BF16) {
      rows_axpy(ah, s, lo, hi, (const char *)a->values + first * D * esz, a->KV * D, KV_BF16, 0, D);
    } else {
      rows_axpy(ah, s, lo, hi, (const char *)a->values + first * D * esz, a->KV * D, 0, 0, D);
    }
  }
}

static void attend_row_head(const void *context, int64_t chunk) {
  const paged_t *a = context;
  const int64_t row = chunk / a->KV, g = chunk % a->KV, G = a->H / a->KV, D = a->D;
  const int64_t len = a->lens[row], token = a->tokens[row];
  const int64_t start = a->window > 0 && len > a->window ? len - a->window : 0;
  const int64_t *table = a->tables + a->seqs[row] * a->table_stride;
  const int64_t n_cold = a->n_cold ? a->n_cold[row] : 0;
  float q[G * D], qs[G * D], acc[G * D], sc[G * a->bs], m[G], l[G], qz[G];
  for (int64_t h = 0; h < G; ++h) {
    const int64_t off = token * a->q_token_stride + (g * G + h) * a->q_head_stride;
    for (int64_t i = 0; i < D; ++i) q[h * D + i] = load1(a->q, a->bf16, off + i);
    m[h] = -INFINITY, l[h] = 0.f;
  }
  for (int64_t i = 0; i < G * D; ++i) acc[i] = 0.f;
  for (int64_t b = start / a->bs; b * a->bs < len; ++b) {
    const int64_t lo = b * a->bs < start ? start - b * a->bs : 0;
    const int64_t hi = (b + 1) * a->bs > len ? len - b * a->bs : a->bs;
    const int cold = b < n_cold;
    block_scores(a, table[b], cold, g, lo, hi, q, qs, qz, sc);
    block_values(a, table[b], cold, g, lo, hi, sc, m, l, acc);
  }
  for (int64_t h = 0; h < G; ++h)
    for (int64_t i = 0; i < D; ++i) st(a->out, a->bf16, (token * a->H + g * G + h) * D + i, acc[h * D + i] / l[h]);
}

/* Every decode row of a, each (row, KV head) a chunk of the pool. Returns 0, or -1 for shapes it does
 * not take (the caller checked them; this guards the stack arrays). */
int rk_paged_decode(const paged_t *a) {
  if (a->D % 8 || a->D > 512 || a->KV < 1 || a->H % a->KV || (a->H / a->KV) * a->D > 8192 || a->bs < 1
      || (a->H / a->KV) * a->bs > 8192 || (a->n_cold && a->bits != 8 && a->bits != 4) || a->kv < KV_F32
      || a->kv > KV_F16)
    return -1;
  pool_run(a->rows * a->KV, attend_row_head, a, sizeof *a);
  return 0;
}
