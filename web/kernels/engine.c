/* The page's decoder: a Llama-family forward pass over the web export's codes, in wasm (export/web_engine.py
 * says which models it takes). The same arithmetic as the export's graph, layer by layer:
 *
 *   x = embed(ids);  per layer: h = rms(x) ; qkv = W_qkv h (+ b) ; rope(q, k) ; cache k, v ; a = attend(q)
 *                               x += W_o a ; h = rms(x) ; g, u = W_gu h ; x += W_down (silu(g) * u)
 *   logits = W_head rms(x)                         (the last row only)
 *
 * Every product is qdot.c's (int8 activations per block of 32, as MatMulNBits accuracy_level 4), rope reads
 * the export's cos/sin tables [max_pos, D/2] (GroupQueryAttention's, rotary_interleaved 0), attention is
 * causal over the cache. The cache grows in chunks of CHUNK positions per layer ([KV, CHUNK, D] each), so a
 * short chat holds a short cache. Products and attention heads are split across the pool's threads.
 */
#include <stdint.h>

#include "pool.h"
#include "qdot.h"
#include "vmath.h"

/* 16 positions: a cache grows by ~0.35 MiB at a time for SmolLM2 (30 layers, 3 heads of 64), and a chat holds
 * at most 15 positions it does not use (256 held ~11 MiB for a 64-token chat, 1/9 of the model's file; 32 up to
 * 0.7 MiB more than 16, what stands between the tab and 1.5x the file) */
#define CHUNK 16
#define MAX_ROWS 24 /* prompt tokens per batched pass (>= 17, a verify pass); longer prompts run in such pieces.
                     * 24 rows of scratch: SmolLM2 0.9 MiB, a 1.5B shape 4.7 MiB (64 held 2.5x that) */

void *rk_alloc(uint32_t bytes);

typedef struct {
  qmat_t w;
  const float *bias; /* [N] or 0 */
} proj_t;

typedef struct {
  const float *attn_norm, *mlp_norm;
  proj_t qkv, o, gate_up, down;
  float **k, **v; /* [max_chunks] chunks [KV, CHUNK, D], allocated as the sequence reaches them */
} layer_t;

typedef struct {
  int32_t hidden, heads, kv, dim, inter, n_layers, vocab, max_pos, max_chunks, chunks;
  float eps, scale;
  layer_t *layers;
  proj_t embed, head;
  const float *norm, *cos, *sin;
  float *x, *h, *qkv, *att, *gu, *mid, *logits, *scores; /* [MAX_ROWS, ...] scratch; scores [T, heads, max_pos] */
  qact_t *act;                                         /* [MAX_ROWS] */
} model_t;

static model_t M;

static qact_t new_act(int32_t K) {
  qact_t a = {rk_alloc(K), rk_alloc(K), rk_alloc(K), rk_alloc(K), K, 0};
  return a;
}

/* Sizes first; the weights' places follow through rk_set_*. Returns 0 when memory ran out. */
int32_t rk_model_init(int32_t hidden, int32_t heads, int32_t kv, int32_t dim, int32_t inter, int32_t n_layers,
                      int32_t vocab, int32_t max_pos, float eps, float scale) {
  M = (model_t){hidden, heads, kv, dim, inter, n_layers, vocab, max_pos, (max_pos + CHUNK - 1) / CHUNK, 0, eps, scale};
  const int32_t wide = (heads + 2 * kv) * dim, widest = 2 * inter > wide ? 2 * inter : wide;
  M.layers = rk_alloc(sizeof(layer_t) * n_layers);
  for (int32_t i = 0; M.layers && i < n_layers; i++) {
    M.layers[i].k = rk_alloc(sizeof(float *) * M.max_chunks);
    M.layers[i].v = rk_alloc(sizeof(float *) * M.max_chunks);
  }
  M.x = rk_alloc(4 * MAX_ROWS * hidden);
  M.h = rk_alloc(4 * MAX_ROWS * (inter > hidden ? inter : hidden));
  M.qkv = rk_alloc(4 * MAX_ROWS * wide);
  M.att = rk_alloc(4 * MAX_ROWS * heads * dim);
  M.gu = rk_alloc(4 * MAX_ROWS * widest);
  M.mid = rk_alloc(4 * MAX_ROWS * inter);
  M.logits = rk_alloc(4 * vocab);
  M.scores = rk_alloc(4 * heads * max_pos);
  M.act = rk_alloc(sizeof(qact_t) * MAX_ROWS);
  const int32_t kmax = inter > hidden ? inter : hidden;
  for (int32_t m = 0; M.act && m < MAX_ROWS; m++) M.act[m] = new_act(kmax);
  return M.layers && M.x && M.h && M.qkv && M.att && M.gu && M.mid && M.logits && M.scores && M.act &&
         M.act[MAX_ROWS - 1].sq;
}

static proj_t *proj_of(int32_t layer, int32_t which) {
  if (layer < 0) return which ? &M.head : &M.embed;
  layer_t *l = &M.layers[layer];
  proj_t *all[] = {&l->qkv, &l->o, &l->gate_up, &l->down};
  return all[which];
}

/* which: 0 qkv, 1 o, 2 gate_up, 3 down; layer -1: 0 embedding, 1 untied head. half: d and m are the data
 * file's float16 values (m raw), else float32 (m centred by rk_centre_mins) */
void rk_set_proj(int32_t layer, int32_t which, const uint8_t *codes, const void *d, const void *m,
                 const float *bias, int32_t bits, int32_t N, int32_t K, int32_t half) {
  proj_t *p = proj_of(layer, which);
  p->w = (qmat_t){codes, d, m, N, K, bits, half != 0};
  p->bias = bias;
}

void rk_set_norms(int32_t layer, const float *attn_norm, const float *mlp_norm) {
  M.layers[layer].attn_norm = attn_norm;
  M.layers[layer].mlp_norm = mlp_norm;
}

void rk_set_tables(const float *final_norm, const float *cos, const float *sin, int32_t tied) {
  M.norm = final_norm;
  M.cos = cos;
  M.sin = sin;
  if (tied) M.head = M.embed;
}

float *rk_logits(void) { return M.logits; }

/* ---- products over the pool ---- */

typedef struct {
  const proj_t *p;
  int32_t rows;
  float *y;
} product_t;

#define ROWS_PER_CHUNK 64 /* weight rows a chunk of a product takes: small enough to balance, large to amortize */

static void product_job(void *arg, int32_t chunk) {
  const product_t *j = arg;
  const int32_t n0 = chunk * ROWS_PER_CHUNK, n1 = n0 + ROWS_PER_CHUNK < j->p->w.N ? n0 + ROWS_PER_CHUNK : j->p->w.N;
  if (j->rows == 1) rk_qmatvec(&j->p->w, &M.act[0], j->y, n0, n1);
  else rk_qmatmul(&j->p->w, M.act, j->rows, j->y, j->p->w.N, n0, n1);
}

/* y [rows, N] = x [rows, K] W^T (+ bias) */
static void product(const proj_t *p, const float *x, int32_t rows, float *y) {
  for (int32_t m = 0; m < rows; m++) {
    M.act[m].K = p->w.K;
    M.act[m].bits = p->w.bits;
    rk_quantize_act(x + (int64_t)m * p->w.K, &M.act[m]);
  }
  product_t j = {p, rows, y};
  rk_parallel(product_job, &j, (p->w.N + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK);
  if (p->bias)
    for (int32_t m = 0; m < rows; m++) vadd(y + (int64_t)m * p->w.N, p->bias, p->w.N);
}

/* ---- attention ---- */

static float *cache_at(float **chunks, int32_t kvh, int32_t pos) {
  return chunks[pos / CHUNK] + ((int64_t)kvh * CHUNK + pos % CHUNK) * M.dim;
}

static void rope(float *x, int32_t pos) {
  const int32_t half = M.dim / 2;
  const float *c = M.cos + (int64_t)pos * half, *s = M.sin + (int64_t)pos * half;
  for (int32_t i = 0; i < half; i++) {
    const float a = x[i], b = x[i + half];
    x[i] = a * c[i] - b * s[i];
    x[i + half] = b * c[i] + a * s[i];
  }
}

typedef struct {
  const layer_t *l;
  int32_t row, pos; /* the query's row in qkv and its position */
} attend_t;

static void attend_job(void *arg, int32_t h) {
  const attend_t *j = arg;
  const int32_t D = M.dim, group = M.heads / M.kv, n = j->pos + 1;
  const float *q_row = M.qkv + (int64_t)j->row * (M.heads + 2 * M.kv) * D;
  {
    const float *q = q_row + h * D;
    float *p = M.scores + (int64_t)h * M.max_pos, *out = M.att + ((int64_t)j->row * M.heads + h) * D;
    float top = -3.0e38f;
    for (int32_t s = 0; s < n; s++) {
      p[s] = vdot(q, cache_at(j->l->k, h / group, s), D) * M.scale;
      top = p[s] > top ? p[s] : top;
    }
    float sum = 0.f;
    for (int32_t s = 0; s < n; s++) sum += (p[s] = vexp(p[s] - top));
    const float inv = 1.f / sum;
    __builtin_memset(out, 0, 4 * D);
    for (int32_t s = 0; s < n; s++) vaxpy(out, cache_at(j->l->v, h / group, s), p[s] * inv, D);
  }
}

/* Below 128 positions a query's heads attend on the calling thread: their work (~15 ns a position and head, 9
 * heads for SmolLM2) is a few microseconds a thread, what a barrier and moving q, k, v between cores cost.
 * rk_set_serial_attend moves the bound (tests run both sides of it). Either way the same bits. */
static int32_t serial_attend = 128;
void rk_set_serial_attend(int32_t positions) { serial_attend = positions; }

/* q, k, v of rows tokens at positions pos0.. : rope, append k, v to the cache, attend causally */
static void attention(const layer_t *l, int32_t rows, int32_t pos0) {
  const int32_t D = M.dim, wide = (M.heads + 2 * M.kv) * D;
  for (int32_t m = 0; m < rows; m++) {
    float *q = M.qkv + (int64_t)m * wide, *k = q + M.heads * D, *v = k + M.kv * D;
    for (int32_t h = 0; h < M.heads; h++) rope(q + h * D, pos0 + m);
    for (int32_t h = 0; h < M.kv; h++) {
      rope(k + h * D, pos0 + m);
      __builtin_memcpy(cache_at(l->k, h, pos0 + m), k + h * D, 4 * D);
      __builtin_memcpy(cache_at(l->v, h, pos0 + m), v + h * D, 4 * D);
    }
  }
  for (int32_t m = 0; m < rows; m++) {
    attend_t j = {l, m, pos0 + m};
    if (pos0 + m < serial_attend)
      for (int32_t h = 0; h < M.heads; h++) attend_job(&j, h);
    else
      rk_parallel(attend_job, &j, M.heads);
  }
}

/* Cache chunks up to position `end` (exclusive); 0 when memory ran out. */
static int32_t reserve(int32_t end) {
  const int32_t need = (end + CHUNK - 1) / CHUNK, bytes = 4 * M.kv * CHUNK * M.dim;
  for (; M.chunks < need; M.chunks++)
    for (int32_t i = 0; i < M.n_layers; i++) {
      M.layers[i].k[M.chunks] = rk_alloc(bytes);
      M.layers[i].v[M.chunks] = rk_alloc(bytes);
      if (!M.layers[i].k[M.chunks] || !M.layers[i].v[M.chunks]) return 0;
    }
  return 1;
}

/* ---- the forward pass ---- */

static void embed_rows(const int32_t *ids, int32_t rows) {
  const qmat_t *e = &M.embed.w;
  for (int32_t m = 0; m < rows; m++) dequant_row(e, ids[m], M.x + (int64_t)m * M.hidden, M.hidden);
}

static void layer_forward(const layer_t *l, int32_t rows, int32_t pos0) {
  const int32_t H = M.hidden, I = M.inter;
  for (int32_t m = 0; m < rows; m++) rms_norm(M.x + (int64_t)m * H, l->attn_norm, M.h + (int64_t)m * H, H, M.eps);
  product(&l->qkv, M.h, rows, M.qkv);
  attention(l, rows, pos0);
  product(&l->o, M.att, rows, M.h);
  for (int32_t m = 0; m < rows; m++) {
    vadd(M.x + (int64_t)m * H, M.h + (int64_t)m * H, H);
    rms_norm(M.x + (int64_t)m * H, l->mlp_norm, M.h + (int64_t)m * H, H, M.eps);
  }
  product(&l->gate_up, M.h, rows, M.gu);
  for (int32_t m = 0; m < rows; m++) silu_mul(M.gu + (int64_t)m * 2 * I, M.mid + (int64_t)m * I, I);
  product(&l->down, M.mid, rows, M.h);
  for (int32_t m = 0; m < rows; m++) vadd(M.x + (int64_t)m * H, M.h + (int64_t)m * H, H);
}

/* Run `n` tokens at positions pos0..; the logits after the last are at rk_logits(). 0 ok, -1 out of memory,
 * -2 past max_pos. */
int32_t rk_forward(const int32_t *ids, int32_t n, int32_t pos0) {
  if (pos0 < 0 || n < 1 || pos0 + n > M.max_pos) return -2;
  if (!reserve(pos0 + n)) return -1;
  for (int32_t done = 0; done < n;) {
    const int32_t rows = n - done < MAX_ROWS ? n - done : MAX_ROWS;
    embed_rows(ids + done, rows);
    for (int32_t i = 0; i < M.n_layers; i++) layer_forward(&M.layers[i], rows, pos0 + done);
    done += rows;
    if (done == n) {
      float *last = M.x + (int64_t)(rows - 1) * M.hidden;
      rms_norm(last, M.norm, M.h, M.hidden, M.eps);
      product(&M.head, M.h, 1, M.logits);
    }
  }
  return 0;
}

/* Speculative decoding's verify pass: run n (<= MAX_ROWS) tokens at positions pos0.. and write every row's
 * logits to out [n, vocab]. Row i's logits are the bits decoding ids[i] alone gives: every step is per row
 * (norms, rope, qdot.c's row_dot whatever the row count, attention of a query over positions <= its own), so
 * verifying drafts changes no output. 0 ok, -1 out of memory, -2 past max_pos or more than MAX_ROWS rows. */
int32_t rk_forward_rows(const int32_t *ids, int32_t n, int32_t pos0, float *out) {
  if (pos0 < 0 || n < 1 || n > MAX_ROWS || pos0 + n > M.max_pos) return -2;
  if (!reserve(pos0 + n)) return -1;
  embed_rows(ids, n);
  for (int32_t i = 0; i < M.n_layers; i++) layer_forward(&M.layers[i], n, pos0);
  for (int32_t m = 0; m < n; m++)
    rms_norm(M.x + (int64_t)m * M.hidden, M.norm, M.h + (int64_t)m * M.hidden, M.hidden, M.eps);
  product(&M.head, M.h, n, out);
  return 0;
}

/* m + zp d in place: the export's minimums centred on MatMulNBits' default zero point (as its graph folds them) */
void rk_centre_mins(float *m, const float *d, int32_t n, int32_t bits) {
  const float zp = (float)(1 << (bits - 1));
  for (int32_t i = 0; i < n; i++) m[i] = m[i] + d[i] * zp;
}

/* fp16 -> fp32 (the data file's scales), n values */
void rk_f16_to_f32(const uint16_t *src, float *dst, int32_t n) {
  for (int32_t i = 0; i < n; i++) dst[i] = half_to_float(src[i]);
}

/* The head's product alone on x [hidden] (benchmarks/web_matmul_options.py times one projection with it). */
void rk_bench_head(const float *x) { product(&M.head, x, 1, M.logits); }
