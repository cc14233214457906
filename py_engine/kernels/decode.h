/* The decode kernels of decode.c: RMSNorm, one token's attention over a dense (or two-tier) cache and over
 * the paged one, and the argmax, as step.c and kernels/__init__.py's bindings call them. */
#pragma once

#include <stdint.h>

#include "paged.h"

/* The cold tier of a two-tier cache (py_engine/models/kv_quant.py), one layer of one sequence: tokens
 * before `tokens` are read from codes instead of the buffers. Keys per channel: codes [KV, blocks, bs,
 * D * bits / 8], scales and zeros [KV, blocks, D]; values per token: codes [KV, max_len, D * bits / 8],
 * scales and zeros [KV, max_len]. int4 packs two codes a byte, the even channel in the low nibble. */
typedef struct {
  const uint8_t *kc, *vc;
  const float *ks, *kz, *vs, *vz;
  int64_t tokens, bits, bs, max_blocks;
} cold_t;

void rk_rms_norm(const void *x, const void *w, void *y, int64_t rows, int64_t dim, float eps, int unit_offset,
                 int bf16);
int rk_attend_one(const void *qkv, const void *cos, const void *sin, void *keys, void *values, void *out, int64_t H,
                  int64_t KV, int64_t D, int64_t rot, int64_t pos, int64_t start, int64_t max_len, float scale,
                  float softcap, int bf16, float *scratch, const cold_t *cold);
int rk_attend_rows(const void *qkv, const void *cos, const void *sin, void *keys, void *values, void *out,
                   int64_t T, int64_t H, int64_t KV, int64_t D, int64_t rot, int64_t pos, int64_t window,
                   int64_t max_len, float scale, float softcap, int bf16);
int rk_paged_attend_one(const void *qkv, const void *cos, const void *sin, int64_t rot, int64_t slot, void *q,
                        float *scratch, paged_t *p);
int64_t rk_argmax(const float *x, int64_t n);
