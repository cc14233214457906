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
 */
#include <stdint.h>
#include <string.h>

#include "linear.h"

int rk_qlinear_parts(const void *x, int x_bf16, int n_parts, const void *parts, void *y, int y_bf16, int64_t M,
                     int64_t K, int mode, void *gated);
int rk_linear_parts(const void *x, int x_bf16, int n_parts, const void *const *ws, int w_bf16,
                    const void *const *biases, int bias_bf16, const int64_t *ns, void *y, int y_bf16, int64_t M,
                    int64_t K);
int rk_linear_gated(const void *x, int x_bf16, const void *w_gate, const void *w_up, int w_bf16, const void *b_gate,
                    const void *b_up, int bias_bf16, void *y, int y_bf16, int64_t N, int64_t K);
void rk_rms_norm(const void *x, const void *w, void *y, int64_t rows, int64_t dim, float eps, int unit_offset,
                 int bf16);
typedef struct { /* decode.c's: the cold tier of one layer (two-tier KV cache) */
  const uint8_t *kc, *vc;
  const float *ks, *kz, *vs, *vz;
  int64_t tokens, bits, bs, max_blocks;
} cold_t;
int rk_attend_one(const void *qkv, const void *cos, const void *sin, void *keys, void *values, void *out, int64_t H,
                  int64_t KV, int64_t D, int64_t rot, int64_t pos, int64_t start, int64_t max_len, float scale,
                  float softcap, int bf16, float *scratch, const cold_t *cold);

typedef struct { /* one projection, as py_engine/cpu/stack.py's Proj */
  const void *parts;         /* quantized: qmat_t[n_parts] (quant.c); float: const void *[n_parts], the weights */
  const void *const *biases; /* float: [n_parts], entries may be NULL */
  const int64_t *ns;         /* float: rows of each weight */
  int32_t quant, n_parts, mode, gated; /* gated: two parts, the result is silu(first) * second */
  int64_t out;               /* columns of the result (gated: one part's) */
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
  int64_t cold_tokens, cold_bits, cold_bs, cold_max_blocks; /* two-tier cache: tokens read from codes (0: none) */
} step_t;

/* y = proj(x) for x of k values; for a gated one, y = silu(gate(x)) * up(x). */
static int project(const step_t *s, const proj_t *p, const void *x, int64_t k, void *y) {
  const int b = s->bf16;
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
    if (project(s, &L->qkv, s->h, s->hidden, s->qkv) != 0
        || rk_attend_one(s->qkv, cos, sin, L->keys, L->values, s->attn, s->H, s->KV, s->D, rot, pos, start,
                         s->max_len, L->scale, L->softcap, b, s->scratch, s->cold_tokens ? &cold : NULL) != 0
        || project(s, &L->o, s->attn, s->H * s->D, s->tmp) != 0)
      return (int)-(1 + l);
    add_into(x, s->tmp, s->hidden, b);
    rk_rms_norm(x, L->norm_mlp, s->h, 1, s->hidden, s->eps, s->unit_offset, b);
    if (project(s, &L->gate_up, s->h, s->hidden, s->act) != 0 || project(s, &L->down, s->act, s->inter, s->tmp) != 0)
      return (int)-(1 + l);
    add_into(x, s->tmp, s->hidden, b);
  }
  rk_rms_norm(x, s->final_norm, out, 1, s->hidden, s->eps, s->unit_offset, b);
  return 0;
}
