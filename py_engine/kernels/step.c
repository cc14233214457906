/* One decode step of the whole decoder stack, one token of one sequence, in one call.
 *
 * After use_cpu_layers a decode step is still ~10 Python-level calls per layer
 * (modules, ctypes, torch.empty, residual adds): ~4.5 ms per token of
 * Qwen2.5-0.5B, 15-20% of an int8 token. Here the same kernels run in the same
 * order on the same buffers, layer after layer, as llama.cpp runs its graph:
 *
 *   h = norm_attn(x); x += o(attend(qkv(h)));  h = norm_mlp(x); x += down(silu(gate(h)) * up(h))
 *
 * and finally out = norm(x). Every product is rk_qlinear_parts (quant.c) or
 * rk_linear_parts / rk_linear_gated (linear.c), every norm rk_rms_norm and the
 * attention rk_attend_one (decode.c), each exactly as the modules call them, so
 * the result is bit for bit the per-module path's (py_engine/cpu/stack.py; tests/test_cpu_stack.py checks it).
 * The residual adds round to the dtype as torch's `x + y` does.
 *
 * A projection may carry LoRA columns (lora_t, set per step by stack.py: the
 * adapter the sequence uses, or every loaded adapter's columns weighted by this
 * token's X-LoRA scalings): y += B (s * (A x)), computed in fp32 (AVX2 dot
 * products for A x, column updates for B) and rounded to the dtype as the torch
 * path's `y + delta` does. A gated gate/up projection with LoRA computes gate and
 * up unfused into `wide`, adds the delta to both, then the SiLU product, since
 * the delta must land before the activation.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "decode.h"
#include "linear.h"
#include "paged.h"
#include "quant.h"
#include "vmath.h"

typedef struct { /* LoRA columns on one projection, fp32: A [r, in], Bt = B^T [r, out] with the scaling folded in */
  const float *A, *Bt;
  int64_t r;
  const int64_t *lo, *hi; /* column j reaches rows lo[j]..hi[j] of y (a fused projection's segment) */
  const float *scale;     /* NULL, or column j's weight for this step (X-LoRA: y += B (scale * (A x))) */
} lora_t;

typedef struct { /* one projection, as py_engine/cpu/stack.py's Proj */
  const void *parts;         /* quantized: qmat_t[n_parts] (quant.c); float: const void *[n_parts], the weights */
  const void *const *biases; /* float: [n_parts], entries may be NULL */
  const int64_t *ns;         /* float: rows of each weight */
  int32_t quant, n_parts, mode, gated; /* gated: two parts, the result is silu(first) * second */
  int64_t out;               /* columns of the result (gated: one part's) */
  const lora_t *lora;        /* NULL: no adapter on this projection for this step */
} proj_t;

typedef struct { /* one decoder layer */
  const void *norm_attn, *norm_mlp; /* RMSNorm weights [hidden] */
  proj_t qkv, o, gate_up, down;
  void *keys, *values; /* this layer's cache [KV, max_len, D] */
  int64_t window;      /* sliding window, 0 for none */
  float scale, softcap;
  cold_t cold;         /* its cold tier; tokens, bits, bs and max_blocks come from step_t */
} step_layer_t;

typedef struct {
  const step_layer_t *layers;
  const void *final_norm;
  int64_t n_layers, hidden, H, KV, D, max_len, inter;
  float eps;
  int32_t unit_offset, bf16;
  void *h, *qkv, *attn, *wide, *act, *tmp; /* work rows of the dtype (wide: 2 inter) */
  float *scratch;                          /* rk_attend_one's */
  float *lora_h;                           /* [the largest r of the adapters set]: A x */
  float *lora_x, *lora_d;                  /* [the widest input] x in fp32, [the widest output] the delta */
  int64_t cold_tokens, cold_bits, cold_bs, cold_max_blocks; /* two-tier cache: tokens read from codes (0: none) */
  /* A paged cache (the server's single-stream step) instead of the dense one: its one row's table, length
   * and cold count, H, KV, D, bs, bf16 and bits; each layer's keys, values, window, scale, softcap and cold
   * pool (the cold_t's six pointers, in the ColdPool's layout) are filled in per layer. NULL: dense. */
  const paged_t *paged;
  void *q;      /* paged: the rotated queries, H * D of the dtype */
  int64_t slot; /* paged: where the new key and value go */
} step_t;

static inline float rounded(float v, int bf16) { /* the value a tensor of the dtype would hold */
  if (!bf16) return v;
  uint16_t h = to_bf16(v);
  return load1(&h, 1, 0);
}

static inline void put1(void *y, int bf16, int64_t i, float v) {
  if (bf16) ((uint16_t *)y)[i] = to_bf16(v);
  else ((float *)y)[i] = v;
}


/* y[n] += B (scale * (A x)) for x of k values: the LoRA delta in fp32, rounded to the dtype, then the
 * sum rounded (h = A x is rounded to the dtype first, and again after the scale, as torch's h.mul_). */
static void lora_add(const step_t *s, const lora_t *q, const void *x, int64_t k, void *y, int64_t n, int bf16) {
  float *h = s->lora_h, *d = s->lora_d;
  const float *xf = x;
  if (bf16) {
    for (int64_t i = 0; i < k; ++i) s->lora_x[i] = load1(x, 1, i);
    xf = s->lora_x;
  }
  for (int64_t j = 0; j < q->r; ++j) {
    h[j] = rounded(dot_f32(q->A + j * k, xf, k), bf16);
    if (q->scale) h[j] = rounded(h[j] * q->scale[j], bf16);
  }
  memset(d, 0, (size_t)n * sizeof(float));
  for (int64_t j0 = 0, j1; j0 < q->r; j0 = j1) { /* a run of columns with the same rows (one segment) */
    const int64_t lo = q->lo[j0], hi = q->hi[j0];
    for (j1 = j0 + 1; j1 < q->r && q->lo[j1] == lo && q->hi[j1] == hi; ++j1) {}
    int64_t o = lo;
    for (; o + 32 <= hi; o += 32) { /* 32 rows of the delta stay in registers over the run's columns */
      __m256 a0 = _mm256_loadu_ps(d + o), a1 = _mm256_loadu_ps(d + o + 8), a2 = _mm256_loadu_ps(d + o + 16),
             a3 = _mm256_loadu_ps(d + o + 24);
      for (int64_t j = j0; j < j1; ++j) {
        if (h[j] == 0.f) continue; /* a column of weight 0 (top-k X-LoRA, another adapter's) adds nothing */
        const __m256 hj = _mm256_set1_ps(h[j]);
        const float *b = q->Bt + j * n + o;
        a0 = _mm256_fmadd_ps(hj, _mm256_loadu_ps(b), a0);
        a1 = _mm256_fmadd_ps(hj, _mm256_loadu_ps(b + 8), a1);
        a2 = _mm256_fmadd_ps(hj, _mm256_loadu_ps(b + 16), a2);
        a3 = _mm256_fmadd_ps(hj, _mm256_loadu_ps(b + 24), a3);
      }
      _mm256_storeu_ps(d + o, a0), _mm256_storeu_ps(d + o + 8, a1);
      _mm256_storeu_ps(d + o + 16, a2), _mm256_storeu_ps(d + o + 24, a3);
    }
    for (; o + 8 <= hi; o += 8) {
      __m256 a = _mm256_loadu_ps(d + o);
      for (int64_t j = j0; j < j1; ++j)
        if (h[j] != 0.f) a = _mm256_fmadd_ps(_mm256_set1_ps(h[j]), _mm256_loadu_ps(q->Bt + j * n + o), a);
      _mm256_storeu_ps(d + o, a);
    }
    for (; o < hi; ++o)
      for (int64_t j = j0; j < j1; ++j) d[o] += h[j] * q->Bt[j * n + o];
  }
  if (!bf16) {
    float *yf = y;
    int64_t o = 0;
    for (; o + 8 <= n; o += 8) _mm256_storeu_ps(yf + o, _mm256_add_ps(_mm256_loadu_ps(yf + o), _mm256_loadu_ps(d + o)));
    for (; o < n; ++o) yf[o] += d[o];
    return;
  }
  for (int64_t o = 0; o < n; ++o) put1(y, bf16, o, load1(y, bf16, o) + rounded(d[o], bf16));
}

/* gate/up with an adapter: wide [2 out] = gate | up (the delta added), y = silu(gate) * up with torch's roundings */
static int project_gated_lora(const step_t *s, const proj_t *p, const void *x, int64_t k, void *y) {
  const int b = s->bf16;
  int status = p->quant ? rk_qlinear_parts(x, b, p->n_parts, p->parts, s->wide, b, 1, k, p->mode, NULL)
                        : rk_linear_parts(x, b, 2, p->parts, b, p->biases, b, p->ns, s->wide, b, 1, k);
  if (status != 0) return status;
  lora_add(s, p->lora, x, k, s->wide, 2 * p->out, b);
  for (int64_t n = 0; n < p->out; n += 8) { /* vmath.h's silu_mul8, as every SiLU gate of the kernels */
    const int live = p->out - n < 8 ? (int)(p->out - n) : 8;
    float g[8], u[8], v[8];
    for (int i = 0; i < live; ++i) g[i] = load1(s->wide, b, n + i), u[i] = load1(s->wide, b, p->out + n + i);
    silu_mul_n(g, u, v, live, b);
    for (int i = 0; i < live; ++i) put1(y, b, n + i, v[i]);
  }
  return 0;
}

/* y = proj(x) for x of k values; for a gated one, y = silu(gate(x)) * up(x). */
static int project(const step_t *s, const proj_t *p, const void *x, int64_t k, void *y) {
  const int b = s->bf16;
  if (p->lora && p->lora->r > 0) {
    if (p->gated) return project_gated_lora(s, p, x, k, y);
    const proj_t plain = {p->parts, p->biases, p->ns, p->quant, p->n_parts, p->mode, 0, p->out, NULL};
    const int status = project(s, &plain, x, k, y);
    if (status == 0) lora_add(s, p->lora, x, k, y, p->out, b);
    return status;
  }
  if (p->quant) return rk_qlinear_parts(x, b, p->n_parts, p->parts, p->gated ? s->wide : y, b, 1, k, p->mode,
                                        p->gated ? y : NULL);
  const void *const *ws = p->parts;
  if (p->gated) return rk_linear_gated(x, b, ws[0], ws[1], b, p->biases[0], p->biases[1], b, y, b, p->out, k);
  return rk_linear_parts(x, b, p->n_parts, ws, b, p->biases, b, p->ns, y, b, 1, k);
}

static void add_into(void *x, const void *y, int64_t n, int bf16) { /* x = x + y, rounded to the dtype */
  for (int64_t i = 0; i < n; ++i) {
    const float v = load1(x, bf16, i) + load1(y, bf16, i);
    if (bf16) ((uint16_t *)x)[i] = to_bf16(v);
    else ((float *)x)[i] = v;
  }
}

/* x [hidden] is the token's embedding on entry and its residual stream after the last layer on return;
 * out [hidden] = final_norm(x). cos, sin: [rot] for this position. Returns 0, or -(1 + layer) when a
 * kernel refused its arguments there (rk_attend_one checks pos against the cache). */
int rk_decode_step(const step_t *s, void *x, const void *cos, const void *sin, int64_t rot, int64_t pos, void *out) {
  const int b = s->bf16;
  for (int64_t l = 0; l < s->n_layers; ++l) {
    const step_layer_t *L = &s->layers[l];
    const int64_t start = L->window > 0 && pos + 1 > L->window ? pos + 1 - L->window : 0;
    cold_t cold = L->cold;
    cold.tokens = s->cold_tokens, cold.bits = s->cold_bits, cold.bs = s->cold_bs, cold.max_blocks = s->cold_max_blocks;
    rk_rms_norm(x, L->norm_attn, s->h, 1, s->hidden, s->eps, s->unit_offset, b);
    if (project(s, &L->qkv, s->h, s->hidden, s->qkv) != 0) return (int)-(1 + l);
    int status;
    if (s->paged) {
      paged_t p = *s->paged;
      p.out = s->attn, p.keys = L->keys, p.values = L->values, p.window = L->window, p.scale = L->scale;
      p.softcap = L->softcap, p.kc = L->cold.kc, p.vc = L->cold.vc, p.ks = L->cold.ks, p.kz = L->cold.kz;
      p.vs = L->cold.vs, p.vz = L->cold.vz;
      status = rk_paged_attend_one(s->qkv, cos, sin, rot, s->slot, s->q, s->scratch, &p);
    } else {
      status = rk_attend_one(s->qkv, cos, sin, L->keys, L->values, s->attn, s->H, s->KV, s->D, rot, pos, start,
                             s->max_len, L->scale, L->softcap, b, s->scratch, s->cold_tokens ? &cold : NULL);
    }
    if (status != 0 || project(s, &L->o, s->attn, s->H * s->D, s->tmp) != 0) return (int)-(1 + l);
    add_into(x, s->tmp, s->hidden, b);
    rk_rms_norm(x, L->norm_mlp, s->h, 1, s->hidden, s->eps, s->unit_offset, b);
    if (project(s, &L->gate_up, s->h, s->hidden, s->act) != 0 || project(s, &L->down, s->act, s->inter, s->tmp) != 0)
      return (int)-(1 + l);
    add_into(x, s->tmp, s->hidden, b);
  }
  rk_rms_norm(x, s->final_norm, out, 1, s->hidden, s->eps, s->unit_offset, b);
  return 0;
}

/* T rows of one sequence at positions pos..pos + T - 1 over the dense cache, in one call: a speculative step's
 * k + 1 rows (issue 32), a short prompt chunk. The module path runs these same kernels in this same order for T
 * rows (rk_rms_norm of T rows, rk_qlinear_parts with M = T, rk_attend_rows, the residual adds), ~10 Python calls a
 * layer (~5 ms a step on SmolLM2's 30 layers, a third of a decode); each row gets the bits the module path gives it,
 * which are decode's. Quantized projections without adapters only, no cold tier, no paged cache: stack.py takes
 * this path only then. b: work rows for T (h, qkv, attn: [T, width]; wide [T, 2 inter]; act [T, inter]; tmp
 * [T, hidden]). x [T, hidden]: the embeddings on entry, the residual stream on return; out [T, hidden] =
 * final_norm(x). cos, sin: [T, rot]. Returns 0, -(1 + layer) where a kernel refused, or -1000 for a projection
 * this path does not take. */
int rk_rows_step(const step_t *s, void *const *b, void *x, const void *cos, const void *sin, int64_t rot, int64_t pos,
                 int64_t T, void *out) {
  const int bf = s->bf16;
  void *h = b[0], *qkv = b[1], *attn = b[2], *wide = b[3], *act = b[4], *tmp = b[5];
  for (int64_t l = 0; l < s->n_layers; ++l) {
    const step_layer_t *L = &s->layers[l];
    const proj_t *ps[4] = {&L->qkv, &L->o, &L->gate_up, &L->down};
    for (int i = 0; i < 4; ++i)
      if (!ps[i]->quant || (ps[i]->lora && ps[i]->lora->r > 0) || ps[i]->gated != (i == 2)) return -1000;
    rk_rms_norm(x, L->norm_attn, h, T, s->hidden, s->eps, s->unit_offset, bf);
    if (rk_qlinear_parts(h, bf, L->qkv.n_parts, L->qkv.parts, qkv, bf, T, s->hidden, L->qkv.mode, NULL) != 0 ||
        rk_attend_rows(qkv, cos, sin, L->keys, L->values, attn, T, s->H, s->KV, s->D, rot, pos, L->window, s->max_len,
                       L->scale, L->softcap, bf) != 0 ||
        rk_qlinear_parts(attn, bf, L->o.n_parts, L->o.parts, tmp, bf, T, s->H * s->D, L->o.mode, NULL) != 0)
      return (int)-(1 + l);
    add_into(x, tmp, T * s->hidden, bf);
    rk_rms_norm(x, L->norm_mlp, h, T, s->hidden, s->eps, s->unit_offset, bf);
    if (rk_qlinear_parts(h, bf, L->gate_up.n_parts, L->gate_up.parts, wide, bf, T, s->hidden, L->gate_up.mode, act) != 0 ||
        rk_qlinear_parts(act, bf, L->down.n_parts, L->down.parts, tmp, bf, T, s->inter, L->down.mode, NULL) != 0)
      return (int)-(1 + l);
    add_into(x, tmp, T * s->hidden, bf);
  }
  rk_rms_norm(x, s->final_norm, out, T, s->hidden, s->eps, s->unit_offset, bf);
  return 0;
}
