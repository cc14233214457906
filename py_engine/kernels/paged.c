/* Paged attention of the server's decode rows: one query per sequence over its block table.
 *
 * The paged cache (native_server/paged_attention.py) keeps per layer keys and
 * values [num_blocks, block_size, KV, D]; sequence s's tokens are its table's
 * blocks in order. The torch path gathers those blocks into a padded copy
 * every layer and calls attention(); here each (sequence, KV head) is one
 * chunk of the pool: its G query heads walk the table once, reading hot
 * blocks in place, and with a two-tier cache (int8/int4 KV) the table's
 * leading n_cold ids are blocks of the cold pool (native_server/kv_cache.py's
 * ColdPool: codes [blocks, bs, KV, D * bits / 8], key scales and zero points
 * [blocks, 1, KV, D] per channel, value ones [blocks, bs, KV, 1] per token),
 * dequantized on the fly as decode.c reads the dense cache's cold tier:
 *   q . (code * scale + zero) = (q * scale) . code + q . zero.
 * Softmax is online, block by block (running max and sum, the accumulator
 * rescaled when the max grows), in fp32 as attention.py's; the output is
 * rounded once to the cache's dtype.
 */
#include <math.h>
#include <stdint.h>

#include "attend.h"
#include "pool.h"

typedef struct {
  const void *q;                 /* [N, H, D]: token t, head h at t * q_token_stride + h * q_head_stride */
  void *out;                     /* [N, H, D] contiguous, the dtype of q */
  const void *keys, *values;     /* [num_blocks, bs, KV, D] of the dtype */
  const int64_t *tables;         /* [S, table_stride] block ids */
  const int64_t *seqs, *tokens;  /* [rows]: each decode row's sequence (its table) and token (its q row) */
  const int64_t *lens;           /* [rows]: context length after this step's write; the query is at lens - 1 */
  const int64_t *n_cold;         /* [rows]: leading table ids that are cold-pool blocks; NULL: none */
  int64_t q_token_stride, q_head_stride, table_stride, rows, H, KV, D, bs, window; /* window 0: none */
  float scale, softcap;          /* softcap 0: none */
  int32_t bf16, bits;            /* bits: 8 or 4 where n_cold is set */
  const uint8_t *kc, *vc;        /* the layer's cold pool, as above */
  const float *ks, *kz, *vs, *vz;
} paged_t;

/* One block's keys against the G queries: sc[h * bs + o] for its tokens lo..hi - 1 (offsets in the block). */
static void block_scores(const paged_t *a, int64_t id, int cold, int64_t g, int64_t lo, int64_t hi, const float *q,
                         float *qs, float *qz, float *sc) {
  const int64_t D = a->D, G = a->H / a->KV, esz = a->bf16 ? 2 : 4;
  if (cold) {
    const int64_t packed = D * a->bits / 8;
    const float *ks = a->ks + (id * a->KV + g) * D, *kz = a->kz + (id * a->KV + g) * D;
    for (int64_t h = 0; h < G; ++h) { /* per block: q * scale and q . zero, as decode.c's cold_scores */
      __m256 z = _mm256_setzero_ps();
      for (int64_t i = 0; i < D; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + h * D + i);
        _mm256_storeu_ps(qs + h * D + i, _mm256_mul_ps(qv, _mm256_loadu_ps(ks + i)));
        z = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kz + i), z);
      }
      qz[h] = hsum(z);
    }
    for (int64_t o = lo; o < hi; ++o) {
      const uint8_t *code = a->kc + ((id * a->bs + o) * a->KV + g) * packed;
      for (int64_t h = 0; h < G; ++h) sc[h * a->bs + o] = cold_dot(qs + h * D, code, a->bits, D) + qz[h];
    }
  } else {
    for (int64_t o = lo; o < hi; ++o) {
      const char *key = (const char *)a->keys + ((id * a->bs + o) * a->KV + g) * D * esz;
      for (int64_t h = 0; h < G; ++h) sc[h * a->bs + o] = dot(q + h * D, key, a->bf16, D);
    }
  }
  for (int64_t h = 0; h < G; ++h)
    for (int64_t o = lo; o < hi; ++o) {
      float v = sc[h * a->bs + o] * a->scale;
      if (a->softcap > 0.f) v = tanhf(v / a->softcap) * a->softcap;
      sc[h * a->bs + o] = v;
    }
}

/* acc_h = acc_h * exp(m_h - m'_h) + sum_o exp(sc - m'_h) v_o over one block (online softmax). */
static void block_values(const paged_t *a, int64_t id, int cold, int64_t g, int64_t lo, int64_t hi, const float *sc,
                         float *m, float *l, float *acc) {
  const int64_t D = a->D, G = a->H / a->KV, esz = a->bf16 ? 2 : 4, packed = D * a->bits / 8;
  for (int64_t h = 0; h < G; ++h) {
    const float *s = sc + h * a->bs;
    float *ah = acc + h * D, top = m[h];
    for (int64_t o = lo; o < hi; ++o) top = s[o] > top ? s[o] : top;
    if (top > m[h]) { /* the running max grew: what was summed so far shrinks by exp(old - new) */
      const float c = m[h] == -INFINITY ? 0.f : expf(m[h] - top);
      l[h] *= c;
      for (int64_t i = 0; i < D; ++i) ah[i] *= c;
      m[h] = top;
    }
    float zsum = 0.f;
    for (int64_t o = lo; o < hi; ++o) {
      const float p = expf(s[o] - top);
      l[h] += p;
      const int64_t row = (id * a->bs + o) * a->KV + g;
      if (cold) {
        zsum += p * a->vz[row];
        cold_axpy(ah, p * a->vs[row], a->vc + row * packed, a->bits, D);
      } else {
        axpy(ah, p, (const char *)a->values + row * D * esz, a->bf16, D);
      }
    }
    for (int64_t i = 0; i < D && cold; ++i) ah[i] += zsum;
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
    for (int64_t i = 0; i < D; ++i) q[h * D + i] = ld(a->q, a->bf16, off + i);
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
      || (a->H / a->KV) * a->bs > 8192 || (a->n_cold && a->bits != 8 && a->bits != 4) || (a->n_cold && a->bits == 4 && a->D % 8))
    return -1;
  pool_run(a->rows * a->KV, attend_row_head, a, sizeof *a);
  return 0;
}
