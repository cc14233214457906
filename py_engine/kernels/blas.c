/* Prefill products on the sgemm that torch's own library exports (see linear.h). */
#include <immintrin.h>
#include <stdlib.h>

#include "linear.h"

typedef void (*sgemm_t)(const char *transa, const char *transb, const int *m, const int *n, const int *k,
                        const float *alpha, const float *a, const int *lda, const float *b, const int *ldb,
                        const float *beta, float *c, const int *ldc); /* Fortran BLAS, LP64 */
typedef int (*set_local_threads_t)(const int *);                      /* MKL_SET_NUM_THREADS_LOCAL, Fortran */

static sgemm_t sgemm;
static set_local_threads_t set_local_threads;

/* Both pointers from the process's libtorch_cpu (the Python side finds them), or NULL to stop. */
void rk_use_blas(void *sgemm_fn, void *set_local_threads_fn) {
  sgemm = (sgemm_t)sgemm_fn;
  set_local_threads = (set_local_threads_t)set_local_threads_fn;
}

int blas_available(void) { return sgemm != NULL && set_local_threads != NULL; }

/* A buffer per thread, grown as needed: jobs run one at a time on each thread. */
static float *scratch(int which, int64_t n) {
  static __thread float *buffers[2];
  static __thread int64_t sizes[2];
  if (sizes[which] < n) {
    free(buffers[which]);
    buffers[which] = aligned_alloc(64, (size_t)((n * 4 + 63) / 64 * 64));
    sizes[which] = buffers[which] ? n : 0;
  }
  return buffers[which];
}

int blas_rows(const linear_t *a, int64_t n0, int64_t n1) {
  if (!blas_available() || a->perm || a->K > 0x7fffffff || a->M > 0x7fffffff) return -1;
  const int64_t rows = n1 - n0, K = a->K, M = a->M;
  const float *w = (const float *)a->w + n0 * K;
  if (a->w_bf16) { /* widen this chunk's rows: O(rows K), against the product's O(M rows K) */
    float *wf = scratch(0, rows * K);
    if (!wf) return -1;
    const uint16_t *wb = (const uint16_t *)a->w + n0 * K;
    int64_t i = 0;
    for (; i + 8 <= rows * K; i += 8) /* a bf16 is an fp32's top half */
      _mm256_storeu_ps(wf + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                                   _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(wb + i))), 16)));
    for (; i < rows * K; ++i) wf[i] = load1(wb, 1, i);
    w = wf;
  }
  /* Straight into y when it is fp32 and has no bias to add; else through a buffer. */
  const int direct = !a->y_bf16 && !a->bias;
  float *c = direct ? (float *)a->y + n0 : scratch(1, M * rows);
  if (!c) return -1;
  /* Row-major y[M, rows] = x[M, K] w[rows, K]^T is column-major y^T = w^T' x^T':
   * A = w (K x rows column-major, transposed), B = x (K x M column-major). */
  const int m = (int)rows, n = (int)M, k = (int)K, ldc = direct ? (int)a->ldy : (int)rows;
  const float one = 1.f, zero = 0.f;
  const int sequential = 1;
  int before = set_local_threads(&sequential); /* sequential MKL here: the pool is the parallelism */
  sgemm("T", "N", &m, &n, &k, &one, w, &k, a->xf, &k, &zero, c, &ldc);
  set_local_threads(&before);
  if (!direct)
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < rows; ++j) store(a, i, n0 + j, c[i * rows + j]);
  return 0;
}
