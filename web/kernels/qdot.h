/* Quantized matrix-vector products over the web weight layout, in wasm SIMD128.
 *
 * A weight W [N, K] is held as MatMulNBits stores it (export/packing.py): codes [N, K/32, 32*bits/8]
 * (4 bits: byte j of a block holds k = 2j in its low nibble and k = 2j+1 in its high one), a scale d
 * [N, K/32] and optionally a float minimum m [N, K/32], so that
 *
 *     w[n, k] = (q[n, k] - zp) * d[n, b] + m[n, b]       b = k / 32, zp = 8 / 128 (MatMulNBits' default)
 *
 * where m is the export's minimum centred (m + zp d, as export/web_weights.py's graph folds it).
 *
 * Scales and minimums are read as the data file stores them: float16 (half = 1; a GGUF's are halves, so the
 * tab holds them once, at 2 bytes) or float32 (half = 0, minimums centred at load by rk_centre_mins). Halves
 * are widened 4 at a time with SIMD128 integer ops (wasm has no f16 lanes) and the minimums centred on the fly,
 * in the float32 path's order, so both give the same bits. Halves must be finite (rk_halves_finite; the loader
 * widens a tensor holding an infinity or NaN into float32 instead).
 *
 * Activations are quantized per block of 32 as onnxruntime's MatMulNBits accuracy_level 4 does (int8,
 * scale amax / 127, round to nearest even), so that the page's logits are those of onnxruntime on the
 * same graph (export/web_weights.py) up to the order of float sums:
 *
 *     y[n] = sum_b d[n,b] xs[b] (sum_j q xq - zp sum_j xq) + sum_b m[n,b] xsum[b]      xsum: the float block sum
 *
 * rk_qmatmul runs M activation rows against each weight row while its codes are in L1 (prefill).
 *
 * The integer sums run 16 lanes at a time: relaxed SIMD's i8 x i7 dot where the build has it (4-bit codes
 * are 7-bit), else widening multiplies (exact: |q xq| <= 255 * 127 fits the i16/i32 lanes used).
 */
#ifndef RKW_QDOT_H
#define RKW_QDOT_H
#include <stdint.h>
#include <wasm_simd128.h>

#define QBLOCK 32

typedef struct {
  const uint8_t *codes; /* [N, K/32, 32 * bits / 8] */
  const void *d;        /* [N, K/32] float32, or float16 when half */
  const void *m;        /* [N, K/32] float32 centred minimums, or float16 raw ones when half; or 0 */
  int32_t N, K, bits, half;
} qmat_t;

typedef struct {     /* one activation row, quantized */
  int8_t *q;         /* [K]: 4-bit layout: per block the 16 even k, then the 16 odd k; 8-bit: in order */
  float *s;          /* [K/32] scale */
  float *sum;        /* [K/32] float sum of the block (for m) */
  float *sq;         /* [K/32] s * sum(q) (for the zero point) */
  int32_t K, bits;
} qact_t;

void rk_quantize_act(const float *x, qact_t *a);
void rk_qmatvec(const qmat_t *w, const qact_t *a, float *y, int32_t n0, int32_t n1);
/* y [M, ldy] += nothing: y[m, n] = row m of a (M rows, a[m]) times row n of w, for n in [n0, n1) */
void rk_qmatmul(const qmat_t *w, const qact_t *a, int32_t M, float *y, int32_t ldy, int32_t n0, int32_t n1);

/* 4 float16 values (finite) as float32 lanes, exactly: (exponent, mantissa) << 13 read as a float32 and scaled
 * by 2^112 (rebiases normal halves, and makes subnormal halves' denormal floats their value), then the sign */
static inline v128_t half4v(v128_t s) { /* s: 4 halves sign-extended to int32 lanes (bit 31: the sign) */
  const v128_t mag = wasm_f32x4_mul(wasm_u32x4_shr(wasm_i32x4_shl(s, 17), 4), wasm_f32x4_splat(5.192296858534828e+33f));
  return wasm_v128_or(mag, wasm_v128_and(s, wasm_i32x4_splat((int32_t)0x80000000u)));
}

static inline v128_t half4(const uint16_t *h) { return half4v(wasm_i32x4_load16x4(h)); }

/* one finite float16 as float32, exactly (the scalar tail of half4) */
static inline float half1(uint16_t h) {
  union { uint32_t u; float f; } m = {(uint32_t)(h & 0x7fff) << 13}, s;
  s.f = m.f * 5.192296858534828e+33f;
  s.u |= (uint32_t)(h & 0x8000) << 16;
  return s.f;
}
#endif
