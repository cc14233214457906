#include "qdot.h"
void *rk_alloc(uint32_t bytes);
static qmat_t W; static qact_t A;
qmat_t *bench_mat(int32_t N, int32_t K, int32_t bits, uint8_t *codes, float *d, float *m) {
  W.codes = codes; W.d = d; W.m = m; W.N = N; W.K = K; W.bits = bits; return &W;
}
qact_t *bench_act(int32_t K, int32_t bits, int32_t zp) {
  A.K = K; A.bits = bits; A.zp = zp; A.q = rk_alloc(K); A.s = rk_alloc(K / 8); A.sum = rk_alloc(K / 8);
  A.zterm = rk_alloc(K / 8); return &A;
}
void bench_run(const float *x, float *y, int32_t n0, int32_t n1, int32_t iters) {
  for (int i = 0; i < iters; i++) { rk_quantize_act(x, &A); rk_qmatvec(&W, &A, y, n0, n1); }
}
