/* The kernels of qdot.h. */
#include "qdot.h"

static inline float hsum(v128_t v) {
  return wasm_f32x4_extract_lane(v, 0) + wasm_f32x4_extract_lane(v, 1) + wasm_f32x4_extract_lane(v, 2) +
         wasm_f32x4_extract_lane(v, 3);
}

/* Per block of 32, in SIMD128 (a scalar loop's values exactly): amax by max (order-free for numbers), the float
 * sum in k order (the order its bits depend on), x * inv rounded half to even (f32x4.nearest, as cvtps2dq under
 * the default rounding mode: onnxruntime's x64 kernels), narrowed to int8 (|v| <= 127: no saturation), and the
 * integer sum. */
void rk_quantize_act(const float *x, qact_t *a) {
  const int32_t blocks = a->K / QBLOCK;
  for (int32_t b = 0; b < blocks; b++) {
    const float *xb = x + b * QBLOCK;
    v128_t xv[8], m = wasm_f32x4_splat(0.f);
    for (int j = 0; j < 8; j++) m = wasm_f32x4_pmax(m, wasm_f32x4_abs(xv[j] = wasm_v128_load(xb + 4 * j))); /* |x| >= +0 */
    float amax = 0.f, sum = 0.f;
    for (int j = 0; j < 4; j++) {
      const float v = wasm_f32x4_extract_lane(m, 0);
      amax = v > amax ? v : amax;
      m = wasm_i32x4_shuffle(m, m, 1, 2, 3, 0);
    }
    for (int j = 0; j < QBLOCK; j++) sum += xb[j];
    const float s = amax / 127.f, inv = amax != 0.f ? 127.f / amax : 0.f;
    const v128_t iv = wasm_f32x4_splat(inv);
    v128_t q[8], qs = wasm_i32x4_splat(0);
    for (int j = 0; j < 8; j++) {
      q[j] = wasm_i32x4_trunc_sat_f32x4(wasm_f32x4_nearest(wasm_f32x4_mul(xv[j], iv)));
      qs = wasm_i32x4_add(qs, q[j]);
    }
    const v128_t lo = wasm_i8x16_narrow_i16x8(wasm_i16x8_narrow_i32x4(q[0], q[1]), wasm_i16x8_narrow_i32x4(q[2], q[3]));
    const v128_t hi = wasm_i8x16_narrow_i16x8(wasm_i16x8_narrow_i32x4(q[4], q[5]), wasm_i16x8_narrow_i32x4(q[6], q[7]));
    int8_t *out = a->q + b * QBLOCK;
    if (a->bits == 4) { /* 4-bit layout: even k first, then odd k (the nibbles of one code byte) */
      wasm_v128_store(out, wasm_i8x16_shuffle(lo, hi, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30));
      wasm_v128_store(out + 16, wasm_i8x16_shuffle(lo, hi, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31));
    } else {
      wasm_v128_store(out, lo);
      wasm_v128_store(out + 16, hi);
    }
    const int32_t qsum = wasm_i32x4_extract_lane(qs, 0) + wasm_i32x4_extract_lane(qs, 1) +
                         wasm_i32x4_extract_lane(qs, 2) + wasm_i32x4_extract_lane(qs, 3);
    a->s[b] = s;
    a->sum[b] = sum;
    a->sq[b] = s * (float)qsum;
  }
}

/* A code byte's two nibbles. The high ones by a 16-bit shift and the low nibbles' mask: V8 lowers i8x16.shr_u
 * to that shift plus a mask it builds anew each time (5 x86 instructions against 2) */
static inline v128_t nibbles_lo(v128_t v) { return wasm_v128_and(v, wasm_i8x16_splat(0x0f)); }
static inline v128_t nibbles_hi(v128_t v) { return wasm_v128_and(wasm_u16x8_shr(v, 4), wasm_i8x16_splat(0x0f)); }

/* sum_j q[j] xq[j] of one 32-code block, as 4 int32 lanes */
static inline v128_t dot4(const uint8_t *c, const int8_t *xq) {
  const v128_t v = wasm_v128_load(c);
  const v128_t lo = nibbles_lo(v), hi = nibbles_hi(v);
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

/* Block scales and centred minimums, float32 or float16 (qdot.h): `half` is a constant in each inlined copy. */
#define INLINE static inline __attribute__((always_inline))

INLINE v128_t dvec(const void *d, int32_t b, const int half) {
  return half ? half4((const uint16_t *)d + b) : wasm_v128_load((const float *)d + b);
}

INLINE float dval(const void *d, int32_t b, const int half) {
  return half ? half1(((const uint16_t *)d)[b]) : ((const float *)d)[b];
}

/* m + zp d (rk_centre_mins' arithmetic) from raw halves; float32 minimums are centred at load */
INLINE v128_t mvec_d(const void *m, v128_t dv, int32_t b, float zp, const int half) {
  if (!half) return wasm_v128_load((const float *)m + b);
  return wasm_f32x4_add(half4((const uint16_t *)m + b), wasm_f32x4_mul(dv, wasm_f32x4_splat(zp)));
}

INLINE float mval(const void *m, const void *d, int32_t b, float zp, const int half) {
  if (!half) return ((const float *)m)[b];
  const float mb = half1(((const uint16_t *)m)[b]), db = half1(((const uint16_t *)d)[b]) * zp;
  return mb + db;
}

INLINE v128_t lane(v128_t v, const int j) {
  switch (j) {
    case 0: return wasm_i32x4_shuffle(v, v, 0, 0, 0, 0);
    case 1: return wasm_i32x4_shuffle(v, v, 1, 1, 1, 1);
    case 2: return wasm_i32x4_shuffle(v, v, 2, 2, 2, 2);
    default: return wasm_i32x4_shuffle(v, v, 3, 3, 3, 3);
  }
}

INLINE const void *row_of(const void *p, int64_t at, const int half) {
  return p ? (half ? (const void *)((const uint16_t *)p + at) : (const void *)((const float *)p + at)) : 0;
}

/* acc += (integer dot of block b) * ds, ds the block's d s in every lane */
INLINE v128_t block_step(v128_t acc, const uint8_t *c, const qact_t *a, int32_t b, int32_t bytes, int32_t bits, v128_t ds) {
  const v128_t i = bits == 4 ? dot4(c + b * bytes, a->q + b * QBLOCK) : dot8(c + b * bytes, a->q + b * QBLOCK);
  return wasm_f32x4_add(acc, wasm_f32x4_mul(wasm_f32x4_convert_i32x4(i), ds));
}

/* Row terms accumulated beside the products, in row_terms' lane order (the same bits): each group of 4 blocks
 * widens its d (and m) once */
typedef struct {
  v128_t acc, t, u; /* products; d sq; centred m sum */
} sums_t;

INLINE void group_terms(sums_t *z, v128_t dv, v128_t mv, const qact_t *a, int32_t b, int has_m) {
  z->t = wasm_f32x4_add(z->t, wasm_f32x4_mul(dv, wasm_v128_load(a->sq + b)));
  if (has_m) z->u = wasm_f32x4_add(z->u, wasm_f32x4_mul(mv, wasm_v128_load(a->sum + b)));
}

/* hsum of the products + row_terms' value from the lane sums and the tail blocks from b on */
INLINE float finish(const sums_t *z, const void *d, const void *m, const qact_t *a, int32_t b, int32_t blocks,
                    float zp, const int half) {
  float t = hsum(z->t);
  for (int32_t i = b; i < blocks; i++) t += dval(d, i, half) * a->sq[i];
  t = -zp * t;
  if (m) {
    float u = hsum(z->u);
    for (int32_t i = b; i < blocks; i++) u += mval(m, d, i, zp, half) * a->sum[i];
    t = t + u;
  }
  return hsum(z->acc) + t;
}

INLINE float row_dot(const qmat_t *w, const qact_t *a, int32_t n, int32_t blocks, int32_t bytes, float zp, const int half) {
  const uint8_t *c = w->codes + (int64_t)n * blocks * bytes;
  const void *d = row_of(w->d, (int64_t)n * blocks, half), *m = row_of(w->m, (int64_t)n * blocks, half);
  sums_t z = {wasm_f32x4_splat(0.f), wasm_f32x4_splat(0.f), wasm_f32x4_splat(0.f)};
  int32_t b = 0;
  for (; b + 4 <= blocks; b += 4) { /* d s of 4 blocks at once: the same products as one at a time */
    const v128_t dv = dvec(d, b, half);
    const v128_t ds = wasm_f32x4_mul(dv, wasm_v128_load(a->s + b));
    z.acc = block_step(z.acc, c, a, b, bytes, w->bits, lane(ds, 0));
    z.acc = block_step(z.acc, c, a, b + 1, bytes, w->bits, lane(ds, 1));
    z.acc = block_step(z.acc, c, a, b + 2, bytes, w->bits, lane(ds, 2));
    z.acc = block_step(z.acc, c, a, b + 3, bytes, w->bits, lane(ds, 3));
    group_terms(&z, dv, m ? mvec_d(m, dv, b, zp, half) : dv, a, b, m != 0);
  }
  const int32_t tail = b;
  for (; b < blocks; b++) z.acc = block_step(z.acc, c, a, b, bytes, w->bits, wasm_f32x4_splat(dval(d, b, half) * a->s[b]));
  return finish(&z, d, m, a, tail, blocks, zp, half);
}

static float row_dot_any(const qmat_t *w, const qact_t *a, int32_t n, int32_t blocks, int32_t bytes, float zp) {
  return w->half ? row_dot(w, a, n, blocks, bytes, zp, 1) : row_dot(w, a, n, blocks, bytes, zp, 0);
}

/* ---- 4 weight rows at a time (decode): each row's sums as row_dot's, its tail blocks and finish vectorized
 * across the rows (lane r = row n + r), op for op in finish's order, so every output has row_dot's bits ---- */

/* lane r = ((v_r[0] + v_r[1]) + v_r[2]) + v_r[3]: hsum of each of 4 vectors, in hsum's order */
static inline v128_t hsum4(v128_t v0, v128_t v1, v128_t v2, v128_t v3) {
  const v128_t a = wasm_i32x4_shuffle(v0, v1, 0, 4, 2, 6), b = wasm_i32x4_shuffle(v0, v1, 1, 5, 3, 7); /* 0 0' 2 2', 1 1' 3 3' */
  const v128_t c = wasm_i32x4_shuffle(v2, v3, 0, 4, 2, 6), d = wasm_i32x4_shuffle(v2, v3, 1, 5, 3, 7);
  const v128_t c0 = wasm_i32x4_shuffle(a, c, 0, 1, 4, 5), c2 = wasm_i32x4_shuffle(a, c, 2, 3, 6, 7);
  const v128_t c1 = wasm_i32x4_shuffle(b, d, 0, 1, 4, 5), c3 = wasm_i32x4_shuffle(b, d, 2, 3, 6, 7);
  return wasm_f32x4_add(wasm_f32x4_add(wasm_f32x4_add(c0, c1), c2), c3);
}

/* block b's scale (or minimum) of rows n..n+3 (stride `blocks`), as float32 lanes */
INLINE v128_t gather4(const void *p, int32_t n, int32_t blocks, int32_t b, const int half) {
  const int64_t at = (int64_t)n * blocks + b;
  if (!half) {
    const float *f = (const float *)p + at;
    return wasm_f32x4_make(f[0], f[blocks], f[2 * blocks], f[3 * blocks]);
  }
  const int16_t *h = (const int16_t *)p + at;
  return half4v(wasm_i32x4_make(h[0], h[blocks], h[2 * blocks], h[3 * blocks]));
}

INLINE void rows4_dot(const qmat_t *w, const qact_t *a, int32_t n, int32_t blocks, int32_t bytes, float zp, float *y,
                      const int half) {
  sums_t z[4];
  const int32_t tail = blocks & ~3;
  for (int32_t r = 0; r < 4; r++) {
    const uint8_t *c = w->codes + (int64_t)(n + r) * blocks * bytes;
    const void *d = row_of(w->d, (int64_t)(n + r) * blocks, half), *m = row_of(w->m, (int64_t)(n + r) * blocks, half);
    z[r] = (sums_t){wasm_f32x4_splat(0.f), wasm_f32x4_splat(0.f), wasm_f32x4_splat(0.f)};
    for (int32_t b = 0; b < tail; b += 4) { /* row_dot's loop */
      const v128_t dv = dvec(d, b, half);
      const v128_t ds = wasm_f32x4_mul(dv, wasm_v128_load(a->s + b));
      z[r].acc = block_step(z[r].acc, c, a, b, bytes, w->bits, lane(ds, 0));
      z[r].acc = block_step(z[r].acc, c, a, b + 1, bytes, w->bits, lane(ds, 1));
      z[r].acc = block_step(z[r].acc, c, a, b + 2, bytes, w->bits, lane(ds, 2));
      z[r].acc = block_step(z[r].acc, c, a, b + 3, bytes, w->bits, lane(ds, 3));
      group_terms(&z[r], dv, m ? mvec_d(m, dv, b, zp, half) : dv, a, b, m != 0);
    }
  }
  v128_t t = hsum4(z[0].t, z[1].t, z[2].t, z[3].t), u = wasm_f32x4_splat(0.f);
  if (w->m) u = hsum4(z[0].u, z[1].u, z[2].u, z[3].u);
  const v128_t zpv = wasm_f32x4_splat(zp);
  for (int32_t b = tail; b < blocks; b++) {
    const v128_t dv = gather4(w->d, n, blocks, b, half), ds = wasm_f32x4_mul(dv, wasm_f32x4_splat(a->s[b]));
    const uint8_t *c = w->codes + (int64_t)n * blocks * bytes;
    for (int32_t r = 0; r < 4; r++)
      z[r].acc = block_step(z[r].acc, c + (int64_t)r * blocks * bytes, a, b, bytes, w->bits, lane(ds, r));
    t = wasm_f32x4_add(t, wasm_f32x4_mul(dv, wasm_f32x4_splat(a->sq[b])));
    if (w->m) { /* mval: m + d zp (half), or the centred float32 minimum */
      const v128_t mv = gather4(w->m, n, blocks, b, half);
      u = wasm_f32x4_add(u, wasm_f32x4_mul(half ? wasm_f32x4_add(mv, wasm_f32x4_mul(dv, zpv)) : mv,
                                           wasm_f32x4_splat(a->sum[b])));
    }
  }
  t = wasm_f32x4_mul(wasm_f32x4_splat(-zp), t);
  if (w->m) t = wasm_f32x4_add(t, u);
  wasm_v128_store(y + n, wasm_f32x4_add(hsum4(z[0].acc, z[1].acc, z[2].acc, z[3].acc), t));
}

void rk_qmatvec(const qmat_t *w, const qact_t *a, float *y, int32_t n0, int32_t n1) {
  const int32_t blocks = w->K / QBLOCK, bytes = QBLOCK * w->bits / 8;
  const float zp = (float)(1 << (w->bits - 1));
  int32_t n = n0;
  if (w->half)
    for (; n + 4 <= n1; n += 4) rows4_dot(w, a, n, blocks, bytes, zp, y, 1);
  else
    for (; n + 4 <= n1; n += 4) rows4_dot(w, a, n, blocks, bytes, zp, y, 0);
  for (; n < n1; n++) y[n] = row_dot_any(w, a, n, blocks, bytes, zp);
}

/* block b's integer dots for R rows, accumulated with each row's d s (ds[r]: every lane) */
INLINE void rows_block(const uint8_t *cb, int32_t bits, const qact_t *a, int32_t R, int32_t b, const v128_t *ds,
                       v128_t *acc) {
  if (bits == 4) {
    const v128_t v = wasm_v128_load(cb);
    const v128_t lo = nibbles_lo(v), hi = nibbles_hi(v);
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
      acc[r] = wasm_f32x4_add(acc[r], wasm_f32x4_mul(wasm_f32x4_convert_i32x4(i), ds[r]));
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
      acc[r] = wasm_f32x4_add(acc[r], wasm_f32x4_mul(wasm_f32x4_convert_i32x4(wasm_i32x4_add(i0, i1)), ds[r]));
    }
  }
}

/* R activation rows (R <= 4) against weight row n, each row's result the bits row_dot gives it: a block's codes
 * are loaded and unpacked once for the R rows, and each row's float sums run in row_dot's order (the integer dot
 * products are exact). Verify passes and prompt chunks read each code once per 4 rows instead of per row. */
INLINE void rows_dot(const qmat_t *w, const qact_t *a, int32_t R, int32_t n, int32_t blocks, int32_t bytes, float zp,
                     float *y, int32_t ldy, const int half) {
  const uint8_t *c = w->codes + (int64_t)n * blocks * bytes;
  const void *d = row_of(w->d, (int64_t)n * blocks, half), *m = row_of(w->m, (int64_t)n * blocks, half);
  sums_t z[4];
  v128_t acc[4], ds[4], one[4];
  for (int32_t r = 0; r < R; r++) z[r].t = z[r].u = acc[r] = wasm_f32x4_splat(0.f);
  int32_t b = 0;
  for (; b + 4 <= blocks; b += 4) {
    const v128_t dv = dvec(d, b, half), mv = m ? mvec_d(m, dv, b, zp, half) : dv;
    for (int32_t r = 0; r < R; r++) ds[r] = wasm_f32x4_mul(dv, wasm_v128_load(a[r].s + b));
    for (int32_t r = 0; r < R; r++) one[r] = lane(ds[r], 0);
    rows_block(c + b * bytes, w->bits, a, R, b, one, acc);
    for (int32_t r = 0; r < R; r++) one[r] = lane(ds[r], 1);
    rows_block(c + (b + 1) * bytes, w->bits, a, R, b + 1, one, acc);
    for (int32_t r = 0; r < R; r++) one[r] = lane(ds[r], 2);
    rows_block(c + (b + 2) * bytes, w->bits, a, R, b + 2, one, acc);
    for (int32_t r = 0; r < R; r++) one[r] = lane(ds[r], 3);
    rows_block(c + (b + 3) * bytes, w->bits, a, R, b + 3, one, acc);
    for (int32_t r = 0; r < R; r++) group_terms(&z[r], dv, mv, &a[r], b, m != 0);
  }
  const int32_t tail = b;
  for (; b < blocks; b++) {
    const float db = dval(d, b, half);
    for (int32_t r = 0; r < R; r++) one[r] = wasm_f32x4_splat(db * a[r].s[b]);
    rows_block(c + b * bytes, w->bits, a, R, b, one, acc);
  }
  for (int32_t r = 0; r < R; r++) {
    z[r].acc = acc[r];
    y[(int64_t)r * ldy + n] = finish(&z[r], d, m, &a[r], tail, blocks, zp, half);
  }
}

#define ROWS_DOT(R) \
  (w->half ? rows_dot(w, a + m, R, n, blocks, bytes, zp, y + (int64_t)m * ldy, ldy, 1) \
           : rows_dot(w, a + m, R, n, blocks, bytes, zp, y + (int64_t)m * ldy, ldy, 0))

void rk_qmatmul(const qmat_t *w, const qact_t *a, int32_t M, float *y, int32_t ldy, int32_t n0, int32_t n1) {
  const int32_t blocks = w->K / QBLOCK, bytes = QBLOCK * w->bits / 8;
  const float zp = (float)(1 << (w->bits - 1));
  for (int32_t n = n0; n < n1; n++) {
    int32_t m = 0;
    for (; m + 4 <= M; m += 4) ROWS_DOT(4);
    switch (M - m) { /* constant R: the row loops unroll */
      case 3: ROWS_DOT(3); break;
      case 2: ROWS_DOT(2); break;
      case 1: y[(int64_t)m * ldy + n] = row_dot_any(w, a + m, n, blocks, bytes, zp); break;
      default: break;
    }
  }
}

/* 1 when none of n halves is an infinity or NaN (exponent 31): the kernels may read them as stored */
int32_t rk_halves_finite(const uint16_t *h, int32_t n) {
  v128_t bad = wasm_i16x8_splat(0);
  int32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v128_t e = wasm_v128_and(wasm_v128_load(h + i), wasm_i16x8_splat(0x7c00));
    bad = wasm_v128_or(bad, wasm_i16x8_eq(e, wasm_i16x8_splat(0x7c00)));
  }
  int32_t ok = !wasm_v128_any_true(bad);
  for (; i < n; i++) ok &= (h[i] & 0x7c00) != 0x7c00;
  return ok;
}

/* dst = n finite halves at src as float32, widened as the kernels read scales (half4, then half1 for the tail);
 * tests/web/test_wasm_kernels.py checks every finite half against numpy's conversion */
void rk_widen_halves(const uint16_t *src, float *dst, int32_t n) {
  int32_t i = 0;
  for (; i + 4 <= n; i += 4) wasm_v128_store(dst + i, half4(src + i));
  for (; i < n; i++) dst[i] = half1(src[i]);
}
