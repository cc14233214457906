/* The kernels of qdot.h. */
#include "qdot.h"

static inline float hsum(v128_t v) {
  return wasm_f32x4_extract_lane(v, 0) + wasm_f32x4_extract_lane(v, 1) + wasm_f32x4_extract_lane(v, 2) +
         wasm_f32x4_extract_lane(v, 3);
}


/* round half to even, as cvtps2dq under the default rounding mode (onnxruntime's x64 kernels) */
static inline int32_t round_even(float v) { return (int32_t)__builtin_nearbyintf(v); }

void rk_quantize_act(const float *x, qact_t *a) {
  const int32_t blocks = a->K / QBLOCK;
  for (int32_t b = 0; b < blocks; b++) {
    const float *xb = x + b * QBLOCK;
    float amax = 0.f, sum = 0.f;
    for (int j = 0; j < QBLOCK; j++) {
      float v = xb[j] < 0 ? -xb[j] : xb[j];
      amax = v > amax ? v : amax;
      sum += xb[j];
    }
    const float s = amax / 127.f, inv = amax != 0.f ? 127.f / amax : 0.f;
    int8_t *q = a->q + b * QBLOCK;
    int32_t qsum = 0;
    for (int j = 0; j < QBLOCK; j++) {
      int32_t v = round_even(xb[j] * inv);
      /* 4-bit layout: even k first, then odd k (the nibbles of one code byte) */
      int32_t at = a->bits == 4 ? (j & 1) * 16 + (j >> 1) : j;
      q[at] = (int8_t)v;
      qsum += v;
    }
    a->s[b] = s;
    a->sum[b] = sum;
    a->sq[b] = s * (float)qsum;
  }
}

/* sum_j q[j] xq[j] of one 32-code block, as 4 int32 lanes */
static inline v128_t dot4(const uint8_t *c, const int8_t *xq) {
  const v128_t v = wasm_v128_load(c);
  const v128_t lo = wasm_v128_and(v, wasm_i8x16_splat(0x0f)), hi = wasm_u8x16_shr(v, 4);
  const v128_t xe = wasm_v128_load(xq), xo = wasm_v128_load(xq + 16);
#ifdef RKW_RELAXED
  v128_t acc = __builtin_wasm_relaxed_dot_i8x16_i7x16_add_s_i32x4(xe, lo, wasm_i32x4_splat(0));
  return __builtin_wasm_relaxed_dot_i8x16_i7x16_add_s_i32x4(xo, hi, acc);
#else
  v128_t p = wasm_i16x8_add(wasm_i16x8_extmul_low_i8x16(lo, xe), wasm_i16x8_extmul_high_i8x16(lo, xe));
  p = wasm_i16x8_add(p, wasm_i16x8_add(wasm_i16x8_extmul_low_i8x16(hi, xo), wasm_i16x8_extmul_high_i8x16(hi, xo)));
  return wasm_i32x4_extadd_pairwise_i16x8(p); /* |lane| <= 4 * 15 * 128 before the pairwise add */
#endif
}

static inline v128_t dot8_16(v128_t q, v128_t x) {
  v128_t a = wasm_i32x4_dot_i16x8(wasm_u16x8_extend_low_u8x16(q), wasm_i16x8_extend_low_i8x16(x));
  return wasm_i32x4_add(a, wasm_i32x4_dot_i16x8(wasm_u16x8_extend_high_u8x16(q), wasm_i16x8_extend_high_i8x16(x)));
}

static inline v128_t dot8(const uint8_t *c, const int8_t *xq) {
  return wasm_i32x4_add(dot8_16(wasm_v128_load(c), wasm_v128_load(xq)),
                        dot8_16(wasm_v128_load(c + 16), wasm_v128_load(xq + 16)));
}

static inline float block_dot(const float *v, const float *u, int32_t blocks) {
  v128_t acc = wasm_f32x4_splat(0.f);
  int32_t b = 0;
  for (; b + 4 <= blocks; b += 4) acc = wasm_f32x4_add(acc, wasm_f32x4_mul(wasm_v128_load(v + b), wasm_v128_load(u + b)));
  float t = hsum(acc);
  for (; b < blocks; b++) t += v[b] * u[b];
  return t;
}

/* the per-block float terms of one row: the zero point's -zp sum_b d s sum(q), and the minimums' sum_b m xsum */
static inline float row_terms(const float *d, const float *m, const qact_t *a, int32_t blocks, float zp) {
  const float t = -zp * block_dot(d, a->sq, blocks);
  return m ? t + block_dot(m, a->sum, blocks) : t;
}

static inline float row_dot(const qmat_t *w, const qact_t *a, int32_t n, int32_t blocks, int32_t bytes, float zp) {
  const uint8_t *c = w->codes + (int64_t)n * blocks * bytes;
  const float *d = w->d + (int64_t)n * blocks;
  v128_t acc = wasm_f32x4_splat(0.f);
  for (int32_t b = 0; b < blocks; b++) {
    const v128_t i = w->bits == 4 ? dot4(c + b * bytes, a->q + b * QBLOCK) : dot8(c + b * bytes, a->q + b * QBLOCK);
    acc = wasm_f32x4_add(acc, wasm_f32x4_mul(wasm_f32x4_convert_i32x4(i), wasm_f32x4_splat(d[b] * a->s[b])));
  }
  return hsum(acc) + row_terms(d, w->m ? w->m + (int64_t)n * blocks : 0, a, blocks, zp);
}

void rk_qmatvec(const qmat_t *w, const qact_t *a, float *y, int32_t n0, int32_t n1) {
  const int32_t blocks = w->K / QBLOCK, bytes = QBLOCK * w->bits / 8;
  const float zp = (float)(1 << (w->bits - 1));
  for (int32_t n = n0; n < n1; n++) y[n] = row_dot(w, a, n, blocks, bytes, zp);
}

/* R activation rows (R <= 4) against weight row n, each row's result the bits row_dot gives it: a block's codes
 * are loaded and unpacked once for the R rows, and each row's float sums run in row_dot's order (the integer dot
 * products are exact). Verify passes and prompt chunks read each code once per 4 rows instead of per row. */
static inline __attribute__((always_inline)) void rows_dot(const qmat_t *w, const qact_t *a, int32_t R, int32_t n,
                                                           int32_t blocks, int32_t bytes, float zp, float *y,
                                                           int32_t ldy) {
  const uint8_t *c = w->codes + (int64_t)n * blocks * bytes;
  const float *d = w->d + (int64_t)n * blocks;
  v128_t acc[4] = {wasm_f32x4_splat(0.f), wasm_f32x4_splat(0.f), wasm_f32x4_splat(0.f), wasm_f32x4_splat(0.f)};
  for (int32_t b = 0; b < blocks; b++) {
    const uint8_t *cb = c + b * bytes;
    if (w->bits == 4) {
      const v128_t v = wasm_v128_load(cb);
      const v128_t lo = wasm_v128_and(v, wasm_i8x16_splat(0x0f)), hi = wasm_u8x16_shr(v, 4);
      for (int32_t r = 0; r < R; r++) {
        const int8_t *xq = a[r].q + b * QBLOCK;
        const v128_t xe = wasm_v128_load(xq), xo = wasm_v128_load(xq + 16);
#ifdef RKW_RELAXED
        v128_t i = __builtin_wasm_relaxed_dot_i8x16_i7x16_add_s_i32x4(xe, lo, wasm_i32x4_splat(0));
        i = __builtin_wasm_relaxed_dot_i8x16_i7x16_add_s_i32x4(xo, hi, i);
#else
        v128_t p = wasm_i16x8_add(wasm_i16x8_extmul_low_i8x16(lo, xe), wasm_i16x8_extmul_high_i8x16(lo, xe));
        p = wasm_i16x8_add(p, wasm_i16x8_add(wasm_i16x8_extmul_low_i8x16(hi, xo), wasm_i16x8_extmul_high_i8x16(hi, xo)));
        const v128_t i = wasm_i32x4_extadd_pairwise_i16x8(p);
#endif
        acc[r] = wasm_f32x4_add(acc[r], wasm_f32x4_mul(wasm_f32x4_convert_i32x4(i), wasm_f32x4_splat(d[b] * a[r].s[b])));
      }
    } else {
      const v128_t q0 = wasm_v128_load(cb), q1 = wasm_v128_load(cb + 16);
      const v128_t q0l = wasm_u16x8_extend_low_u8x16(q0), q0h = wasm_u16x8_extend_high_u8x16(q0);
      const v128_t q1l = wasm_u16x8_extend_low_u8x16(q1), q1h = wasm_u16x8_extend_high_u8x16(q1);
      for (int32_t r = 0; r < R; r++) {
        const int8_t *xq = a[r].q + b * QBLOCK;
        const v128_t x0 = wasm_v128_load(xq), x1 = wasm_v128_load(xq + 16);
        const v128_t i0 = wasm_i32x4_add(wasm_i32x4_dot_i16x8(q0l, wasm_i16x8_extend_low_i8x16(x0)),
                                         wasm_i32x4_dot_i16x8(q0h, wasm_i16x8_extend_high_i8x16(x0)));
        const v128_t i1 = wasm_i32x4_add(wasm_i32x4_dot_i16x8(q1l, wasm_i16x8_extend_low_i8x16(x1)),
                                         wasm_i32x4_dot_i16x8(q1h, wasm_i16x8_extend_high_i8x16(x1)));
        const v128_t i = wasm_i32x4_add(i0, i1);
        acc[r] = wasm_f32x4_add(acc[r], wasm_f32x4_mul(wasm_f32x4_convert_i32x4(i), wasm_f32x4_splat(d[b] * a[r].s[b])));
      }
    }
  }
  for (int32_t r = 0; r < R; r++)
    y[(int64_t)r * ldy + n] = hsum(acc[r]) + row_terms(d, w->m ? w->m + (int64_t)n * blocks : 0, &a[r], blocks, zp);
}

void rk_qmatmul(const qmat_t *w, const qact_t *a, int32_t M, float *y, int32_t ldy, int32_t n0, int32_t n1) {
  const int32_t blocks = w->K / QBLOCK, bytes = QBLOCK * w->bits / 8;
  const float zp = (float)(1 << (w->bits - 1));
  for (int32_t n = n0; n < n1; n++) {
    int32_t m = 0;
    for (; m + 4 <= M; m += 4) rows_dot(w, a + m, 4, n, blocks, bytes, zp, y + (int64_t)m * ldy, ldy);
    switch (M - m) { /* constant R: the row loops unroll */
      case 3: rows_dot(w, a + m, 3, n, blocks, bytes, zp, y + (int64_t)m * ldy, ldy); break;
      case 2: rows_dot(w, a + m, 2, n, blocks, bytes, zp, y + (int64_t)m * ldy, ldy); break;
      case 1: y[(int64_t)m * ldy + n] = row_dot(w, a + m, n, blocks, bytes, zp); break;
      default: break;
    }
  }
}
