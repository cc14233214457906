/* Small float helpers of the engine (no libm in a freestanding wasm module). */
#ifndef RKW_VMATH_H
#define RKW_VMATH_H
#include <stdint.h>
#include <wasm_simd128.h>

#include "qdot.h"

static inline float bits_float(uint32_t u) {
  union { uint32_t u; float f; } v = {u};
  return v.f;
}

/* e^x to ~2 ulp: x = n ln2 + r, a degree-6 polynomial in r, 2^n from the exponent bits */
static inline float vexp(float x) {
  if (x < -87.0f) return 0.f;
  if (x > 88.0f) x = 88.0f;
  const float n = __builtin_nearbyintf(x * 1.44269504088896341f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  const float p = 1.f + r * (1.f + r * (0.5f + r * (0.16666667f + r * (0.041666668f + r * (0.008333334f +
                  r * 0.0013888889f)))));
  return p * bits_float((uint32_t)((int32_t)n + 127) << 23);
}

static inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));
  if (exp) return bits_float(sign | ((exp + 112) << 23) | (man << 13));
  const float v = (float)man * 5.9604644775390625e-08f; /* 2^-24: subnormal halves */
  return sign ? -v : v;
}

static inline void vadd(float *y, const float *x, int32_t n) {
  int32_t i = 0;
  for (; i + 4 <= n; i += 4) wasm_v128_store(y + i, wasm_f32x4_add(wasm_v128_load(y + i), wasm_v128_load(x + i)));
  for (; i < n; i++) y[i] += x[i];
}

static inline float vdot(const float *a, const float *b, int32_t n) {
  v128_t acc = wasm_f32x4_splat(0.f);
  int32_t i = 0;
  for (; i + 4 <= n; i += 4) acc = wasm_f32x4_add(acc, wasm_f32x4_mul(wasm_v128_load(a + i), wasm_v128_load(b + i)));
  float s = wasm_f32x4_extract_lane(acc, 0) + wasm_f32x4_extract_lane(acc, 1) + wasm_f32x4_extract_lane(acc, 2) +
            wasm_f32x4_extract_lane(acc, 3);
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

/* y += a x */
static inline void vaxpy(float *y, const float *x, float a, int32_t n) {
  const v128_t s = wasm_f32x4_splat(a);
  int32_t i = 0;
  for (; i + 4 <= n; i += 4) wasm_v128_store(y + i, wasm_f32x4_add(wasm_v128_load(y + i), wasm_f32x4_mul(s, wasm_v128_load(x + i))));
  for (; i < n; i++) y[i] += a * x[i];
}

/* y = x / sqrt(mean(x^2) + eps) * w, as SimplifiedLayerNormalization */
static inline void rms_norm(const float *x, const float *w, float *y, int32_t n, float eps) {
  const float ms = vdot(x, x, n) / (float)n;
  const float inv = 1.f / __builtin_sqrtf(ms + eps);
  for (int32_t i = 0; i < n; i++) y[i] = x[i] * inv * w[i];
}

/* out[i] = silu(gu[i]) * gu[n + i]: gate and up as one projection, gate first */
static inline void silu_mul(const float *gu, float *out, int32_t n) {
  for (int32_t i = 0; i < n; i++) {
    const float g = gu[i];
    out[i] = g / (1.f + vexp(-g)) * gu[n + i];
  }
}

/* row `r` of a quantized table, (q - zp) d + m (m centred), its first n values */
static inline void dequant_row(const qmat_t *e, int32_t r, float *out, int32_t n) {
  const int32_t blocks = e->K / QBLOCK, bytes = QBLOCK * e->bits / 8;
  const uint8_t *c = e->codes + (int64_t)r * blocks * bytes;
  const float zp = (float)(1 << (e->bits - 1));
  for (int32_t k = 0; k < n; k++) {
    const int32_t b = k / QBLOCK, j = k % QBLOCK;
    const int64_t at = (int64_t)r * blocks + b;
    const int32_t q = e->bits == 8 ? c[b * bytes + j] : (c[b * bytes + j / 2] >> (4 * (j & 1))) & 15;
    const float d = e->half ? half1(((const uint16_t *)e->d)[at]) : ((const float *)e->d)[at];
    const float v = ((float)q - zp) * d;
    if (!e->m) out[k] = v;
    else if (!e->half) out[k] = v + ((const float *)e->m)[at];
    else { /* centred as rk_centre_mins does */
      const float m = half1(((const uint16_t *)e->m)[at]), dz = d * zp;
      out[k] = v + (m + dz);
    }
  }
}
#endif
