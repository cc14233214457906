/* Round-to-nearest quantization of a weight in one pass (py_engine/quant/rtn.py's quantize_rtn drives it through
 * py_engine.quant.kernels), rows split over pool.h's threads. */
#include <math.h>
#include <stdint.h>

#include "linear.h"
#include "pool.h"

/* Round-to-nearest quantization of W [N, K] (fp32 or bf16) in blocks along K, with the
 * arithmetic of py_engine/quant/rtn.py's quantize_rtn step for step in fp32 (and so the same
 * bytes; tests/test_quant_transform.py checks): K zero-padded to whole blocks; symmetric:
 * s = m / -2^(bits-1) for m the value of largest magnitude (the minimum on a tie), z = 2^(bits-1);
 * asymmetric: s = (max(w, 0) - min(w, 0)) / top, z = roundf(-min / s); q = roundf(w * (1 / s) + z)
 * clamped to [0, top]. quantize_rtn's ~20 torch passes took 30-50 s for a 0.5B model on a busy
 * 2-core machine; this is one pass, rows split over the pool. */
typedef struct {
  const void *w;
  int w_bf16, bits, symmetric;
  int64_t N, K, block, blocks, rows_per_chunk;
  uint8_t *codes, *zeros;
  float *scales;
} rtn_t;

static inline float round_away(float x) { return roundf(x); } /* C's roundf: ties away from zero */

static void rtn_chunk(const void *context, int64_t c) {
  const rtn_t *a = context;
  const int64_t n0 = c * a->rows_per_chunk, n1 = n0 + a->rows_per_chunk < a->N ? n0 + a->rows_per_chunk : a->N;
  const float top = (float)((1 << a->bits) - 1), mid = (float)(1 << (a->bits - 1));
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t b = 0; b < a->blocks; ++b) {
      const int64_t k0 = b * a->block, k1 = k0 + a->block < a->K ? k0 + a->block : a->K;
      float lo = k1 - k0 < a->block ? 0.f : INFINITY, hi = k1 - k0 < a->block ? 0.f : -INFINITY; /* padding */
      for (int64_t k = k0; k < k1; ++k) {
        const float v = load1(a->w, a->w_bf16, n * a->K + k);
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
      }
      float scale, zero;
      if (a->symmetric) {
        const float m = fabsf(hi) > fabsf(lo) ? hi : lo;
        scale = m / -mid;
        zero = mid;
      } else {
        lo = lo < 0.f ? lo : 0.f;
        hi = hi > 0.f ? hi : 0.f;
        scale = (hi - lo) / top;
        const float zf = scale != 0.f ? 0.f - lo / scale : lo;
        zero = round_away(zf);
        zero = zero < 0.f ? 0.f : zero > top ? top : zero;
      }
      const float r = scale != 0.f ? 1.f / scale : 0.f;
      uint8_t *q = a->codes + n * a->blocks * a->block + k0;
      for (int64_t k = k0; k < k0 + a->block; ++k) {
        const float v = k < k1 ? load1(a->w, a->w_bf16, n * a->K + k) : 0.f;
        const float p = v * r;
        float x = round_away(p + zero);
        x = x < 0.f ? 0.f : x > top ? top : x;
        q[k - k0] = (uint8_t)x;
      }
      a->scales[n * a->blocks + b] = scale;
      a->zeros[n * a->blocks + b] = (uint8_t)zero;
    }
  }
}

int rk_quantize_rtn(const void *w, int w_bf16, int64_t N, int64_t K, int bits, int64_t block, int symmetric,
                    uint8_t *codes, float *scales, uint8_t *zeros) {
  if (N < 1 || K < 1 || block < 1 || bits < 2 || bits > 8) return -1;
  rtn_t a = {w, w_bf16, bits, symmetric, N, K, block, (K + block - 1) / block, 0, codes, zeros, scales};
  a.rows_per_chunk = 65536 / K + 1;
  pool_run((N + a.rows_per_chunk - 1) / a.rows_per_chunk, rtn_chunk, &a, sizeof a);
  return 0;
}
