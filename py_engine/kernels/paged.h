/* paged.c's job: the decode rows of a paged batch (py_engine/kernels/paged.py's PagedDecode). */
#pragma once
#include <stdint.h>

typedef struct {
  const void *q;                 /* [N, H, D]: token t, head h at t * q_token_stride + h * q_head_stride */
  void *out;                     /* [N, H, D] contiguous, the dtype of q */
  const void *keys, *values;     /* [num_blocks, bs, KV, D] of element type kv */
  const int64_t *tables;         /* [S, table_stride] block ids */
  const int64_t *seqs, *tokens;  /* [rows]: each decode row's sequence (its table) and token (its q row) */
  const int64_t *lens;           /* [rows]: context length after this step's write; the query is at lens - 1 */
  const int64_t *n_cold;         /* [rows]: leading table ids that are cold-pool blocks; NULL: none */
  int64_t q_token_stride, q_head_stride, table_stride, rows, H, KV, D, bs, window; /* window 0: none */
  float scale, softcap;          /* softcap 0: none */
  int32_t bf16, bits;            /* bf16: q and out are bf16 (else fp32); bits: 8 or 4 where n_cold is set */
  const uint8_t *kc, *vc;        /* the layer's cold pool, as above */
  const float *ks, *kz, *vs, *vz;
  int32_t kv;                    /* the hot blocks' element type: 0 fp32, 1 bf16, 2 fp16 (attend.h's KV_*) */
} paged_t;

int rk_paged_decode(const paged_t *a);
