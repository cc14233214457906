/* ggml's block types read as the file holds them (py_engine/quant/ggml.py): Q5_0, Q5_1 and the K-quants
 * Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, against x rounded to int8 per 32 values (the decode path's x: quant.c).
 * Since issue 31's second pass, Q5_0/Q5_1 and every K-quant (Q2_K-Q6_K) product run quant.h's canonical sum (qtile_k.c's
 * q5_tiles and qk_tiles, qpanel.c's panels for prompt chunks), which let the panels take their prefill: 4-6x
 * at 128 rows, decode 1.4-2x against this file's tiles (`KQ_OWN_ORDER=1` builds them back, an A/B). This file
 * keeps their unpacking (the panels' pack_blocks, the exact path) and its own tiles below for that A/B build. *
 * Every type is w = s_j (q - z) - m_j per sub-block j of 16 or 32 values, s_j = D * c_j with D the block's
 * fp16 scale and c_j a small integer (6-bit, 4-bit, int8), so a sub-block of 32 is
 *
 *   Σ w x = D (dx_b Σ_lanes madd(maddubs(u, q_x), c16)) - Σ_j Z_j X_j
 *
 * u the 32 unsigned codes in value order, q_x x's int8 and dx_b its scale, c16 the sub-block's one or two
 * integer scales as 16 int16 lanes (lanes 0-7: values 0-15), Z_j = m_j + s_j z the zero term of sub-scale j
 * and X_j = dx Σ q_x over its values (per 32: quant.c's xs; per 16: xs16 here). The integer scale rides
 * the madd that sums maddubs' pairs anyway (llama.cpp's own K-quant dot products do the same); the
 * pair sums stay below 2 * 63 * 127, far from int16's limit. Per block: the scales decoded once per row
 * of W (kq_head), then every sub-block's codes unpacked once per row of W and met by every row of x of
 * the tile, so a row of x gets the same arithmetic in a batch as alone. AVX-512 builds (KQ_512) take two
 * sub-blocks a step in 512-bit lanes (kdecode2, ktile2: the same steps for decode and every batch); AVX2 builds
 * one a step. The two orders differ in float rounding (a build is one order for every count of rows).
 * 2 threads, 4096 x 2048, loaded 2-vCPU Xeon, us per GEMV before -> after: Q3_K ~7500 -> ~3900,
 * Q2_K ~2100 -> ~1000, Q6_K ~4200 -> ~3100, Q5_K ~3600 -> ~2900, Q4_K about even; 16 rows 0-40% faster.
 *
 * kq_dequantize_rows is gguf.quants.dequantize's arithmetic in float32 (no contraction): the exact path
 * (fp32 x) multiplies the very weights the reference gives.
 */
#include <math.h>
#include <string.h>

#include "quant.h"

enum { KQ_Q5_0 = 6, KQ_Q5_1 = 7, KQ_Q2_K = 10, KQ_Q3_K = 11, KQ_Q4_K = 12, KQ_Q5_K = 13, KQ_Q6_K = 14 };

static inline float half(const uint8_t *p) { /* an IEEE half at p, exactly, as float */
  uint16_t h;
  memcpy(&h, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31, m = h & 1023;
  uint32_t bits;
  if (e == 31) bits = sign | 0x7f800000u | (m << 13);
  else if (e) bits = sign | ((e + 112) << 23) | (m << 13);
  else { /* zero or subnormal: m * 2^-24, exact in float */
    float v = (float)m * 0x1p-24f;
    memcpy(&bits, &v, 4);
    bits |= sign;
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
#endif
}

typedef struct { /* one block's scales for the integer path */
  float d;           /* D */
  uint8_t c[16];     /* integer scales as int8 (Q4_K/Q5_K: 8, per 32; Q2/3/6_K: 16, per 16) */
  float z[16];       /* zero terms Z_j (per 32: 8; per 16: 16; Q5_0/Q5_1: z[0]) */
  int16_t c16[16];   /* c as int16 (the AVX-512 path broadcasts pairs of them) */
} khead_t;

static inline int per16(int kind) { return kind == KQ_Q2_K || kind == KQ_Q3_K || kind == KQ_Q6_K; }

/* Q4_K/Q5_K's 12 bytes -> 8 six-bit scales (out[0..7]) and 8 mins (out[8..15]) */
static inline void scales_k4(const uint8_t *s, uint8_t *out) {
  uint32_t a[3], o[4];
  memcpy(a, s, 12);
  const uint32_t six = 0x3f3f3f3fu, four = 0x0f0f0f0fu, two = 0x03030303u;
  o[0] = a[0] & six;                                      /* scales 0-3: bytes 0-3, low 6 bits */
  o[1] = (a[2] & four) | (((a[0] >> 6) & two) << 4);      /* scales 4-7: bytes 8-11 low, 0-3 top */
  o[2] = a[1] & six;                                      /* mins 0-3: bytes 4-7, low 6 bits */
  o[3] = ((a[2] >> 4) & four) | (((a[1] >> 6) & two) << 4); /* mins 4-7: bytes 8-11 high, 4-7 top */
  memcpy(out, o, 16);
}

/* Q3_K's 12 bytes -> 16 six-bit scales minus 32 */
static inline void scales_q3(const uint8_t *s, int8_t *out) {
  uint32_t a[3], o[4];
  memcpy(a, s, 12);
  const uint32_t four = 0x0f0f0f0fu, two = 0x03030303u;
  o[0] = (a[0] & four) | ((a[2] & two) << 4);               /* scale j: low 4 bits in byte j, top 2 in byte 8 + j % 4 */
  o[1] = (a[1] & four) | (((a[2] >> 2) & two) << 4);
  o[2] = ((a[0] >> 4) & four) | (((a[2] >> 4) & two) << 4);
  o[3] = ((a[1] >> 4) & four) | (((a[2] >> 6) & two) << 4);
  uint8_t b[16];
  memcpy(b, o, 16);
  for (int j = 0; j < 16; ++j) out[j] = (int8_t)(b[j] - 32);
}

static inline __attribute__((always_inline)) void kq_head(const int kind, const uint8_t *blk, khead_t *h) {
  switch (kind) {
  case KQ_Q5_0: h->d = half(blk); h->z[0] = 16.f * h->d; break;
  case KQ_Q5_1: h->d = half(blk); h->z[0] = -half(blk + 2); break;
  case KQ_Q4_K:
  case KQ_Q5_K: {
    uint8_t sm[16];
    scales_k4(blk + 4, sm);
    h->d = half(blk);
    const float dmin = half(blk + 2);
    memcpy(h->c, sm, 8);
    for (int j = 0; j < 8; ++j) h->z[j] = dmin * (float)sm[8 + j];
    break;
  }
  case KQ_Q6_K:
    h->d = half(blk + 208);
    memcpy(h->c, blk + 192, 16);
    for (int j = 0; j < 16; ++j) h->z[j] = 32.f * h->d * (float)(int8_t)h->c[j];
    break;
  case KQ_Q3_K:
    h->d = half(blk + 108);
    scales_q3(blk + 96, (int8_t *)h->c);
    for (int j = 0; j < 16; ++j) h->z[j] = 4.f * h->d * (float)(int8_t)h->c[j];
    break;
  case KQ_Q2_K: {
    h->d = half(blk + 80);
    const float dmin = half(blk + 82);
    for (int j = 0; j < 16; ++j) {
      h->c[j] = blk[j] & 15;
      h->z[j] = dmin * (float)(blk[j] >> 4);
    }
    break;
  }
  }
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  if (kind == KQ_Q4_K || kind == KQ_Q5_K) /* unsigned 6-bit */
    _mm256_storeu_si256((__m256i *)h->c16, _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)h->c)));
  else if (kind != KQ_Q5_0 && kind != KQ_Q5_1) /* signed (Q2_K's are 0-15) */
    _mm256_storeu_si256((__m256i *)h->c16, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)h->c)));
#endif
}

/* 32 bits -> 32 bytes of 0x10 where the bit is set (Q5_0/Q5_1's fifth bits, bit i = value i) */
static inline __m256i fifth_bits(const uint8_t *p) {
  uint32_t bits;
  memcpy(&bits, p, 4);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_maskz_mov_epi8((__mmask32)bits, _mm256_set1_epi8(0x10));
#else
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                             _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                                                0x0303030303030303LL));
  const __m256i pick = _mm256_set1_epi64x((long long)0x8040201008040201ULL); /* byte k: bit k % 8 */
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, pick), pick), _mm256_set1_epi8(0x10));
#endif
}

static inline __m256i srl16(__m256i v, int n) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(n)); }

/* Sub-block b's 32 codes (unsigned, value order) of the block at blk. */
static inline __attribute__((always_inline)) __m256i kq_codes(const int kind, const uint8_t *blk, int b) {
  const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(3), m1 = _mm256_set1_epi8(1);
  switch (kind) {
  case KQ_Q5_0:
  case KQ_Q5_1: {
    const uint8_t *qs = blk + (kind == KQ_Q5_0 ? 6 : 8);
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    const __m256i lo = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), m4);
    return _mm256_or_si256(lo, fifth_bits(qs - 4));
  }
  case KQ_Q4_K:
  case KQ_Q5_K: {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + (kind == KQ_Q4_K ? 16 : 48) + 32 * (b >> 1)));
    const __m256i q = _mm256_and_si256((b & 1) ? _mm256_srli_epi16(raw, 4) : raw, m4);
    if (kind == KQ_Q4_K) return q;
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
    return _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(srl16(qh, b), m1), 4));
  }
  case KQ_Q6_K: {
    const int h = b >> 2, r = b & 3;
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (r & 1)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
    const __m256i lo = _mm256_and_si256((r >> 1) ? _mm256_srli_epi16(ql, 4) : ql, m4);
    return _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(srl16(qh, 2 * r), m2), 4));
  }
  case KQ_Q3_K: {
    const int h = b >> 2, r = b & 3;
    const __m256i qs = _mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * h));
    const __m256i hm = _mm256_loadu_si256((const __m256i *)blk);
    return _mm256_or_si256(_mm256_and_si256(srl16(qs, 2 * r), m2), _mm256_slli_epi16(_mm256_and_si256(srl16(hm, b), m1), 2));
  }
  default: { /* KQ_Q2_K */
    const int h = b >> 2, r = b & 3;
    const __m256i qs = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * h));
    return _mm256_and_si256(srl16(qs, 2 * r), m2);
  }
  }
}

/* Sub-block b's integer scales as 16 int16 lanes: lanes 0-7 (values 0-15) and 8-15 (values 16-31). */
static inline __attribute__((always_inline)) __m256i kq_scale16(const int kind, const khead_t *h, int b) {
  if (kind == KQ_Q5_0 || kind == KQ_Q5_1) return _mm256_set1_epi16(1);
  if (!per16(kind)) return _mm256_set1_epi16((short)h->c[b]); /* Q4_K/Q5_K: one unsigned 6-bit scale */
  return _mm256_set_m128i(_mm_set1_epi16((short)(int8_t)h->c[2 * b + 1]), _mm_set1_epi16((short)(int8_t)h->c[2 * b]));
}

/* What a block adds to one output (rows m of x, n of W): the sub-blocks' scaled integer dots f (summed per block,
 * times D), then the zero terms off. Decode and batches both end a block here, so they add the same floats. */
static inline __attribute__((always_inline)) __m256 kq_close(const qjob_t *j, const qmat_t *w, int64_t m, int64_t s,
                                                             const khead_t *h, __m256 f, __m256 acc, const int kind) {
  const int64_t nb = nb_of(w), spb = w->spg;
  __m256 v = _mm256_fmadd_ps(f, _mm256_set1_ps(h->d), acc);
  if (per16(kind)) {
    const float *xs16 = j->xs16 + m * nb * 2 + s * spb * 2;
    v = _mm256_fnmadd_ps(_mm256_loadu_ps(h->z), _mm256_loadu_ps(xs16), v);
    return _mm256_fnmadd_ps(_mm256_loadu_ps(h->z + 8), _mm256_loadu_ps(xs16 + 8), v);
  }
  const float *xs = j->dx + (j->M + m) * nb + s * spb; /* per-32 sums of x (quant.c's xs) */
  if (kind == KQ_Q5_0 || kind == KQ_Q5_1) /* one sub-block a block: its zero term in lane 0 */
    return _mm256_fnmadd_ps(_mm256_setr_ps(h->z[0], 0, 0, 0, 0, 0, 0, 0), _mm256_broadcast_ss(xs), v);
  return _mm256_fnmadd_ps(_mm256_loadu_ps(h->z), _mm256_loadu_ps(xs), v);
}

static inline __m256 kq_step(__m256i u, __m256i sc, __m256i xv, __m256 dv, __m256 f) { /* one sub-block into f */
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), sc)), dv, f);
}

#ifndef KD_R
#define KD_R 4 /* rows of W per pass over one row of x (decode) */
#endif

/* Decode: rows n..n + KD_R - 1 of W against row m of x, the type's unpacking inlined (one instance per type). */
static inline __attribute__((always_inline)) void kdecode(const qjob_t *j, const qpart_t *a, int64_t m, int64_t n,
                                                           const int kind) {
  const qmat_t *w = &a->w;
  const int64_t nb = nb_of(w), rb = row_bytes(w), bbytes = kq_block_bytes(kind);
  const int spb = kind == KQ_Q5_0 || kind == KQ_Q5_1 ? 1 : 8;
  const uint8_t *c = w->codes + n * rb;
  __m256 acc[KD_R];
  for (int r = 0; r < KD_R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t s = 0; s < w->ng; ++s) {
    khead_t h[KD_R];
    __m256 f[KD_R];
    for (int r = 0; r < KD_R; ++r) {
      const uint8_t *blk = c + r * rb + s * bbytes;
      for (int64_t o = 0; o < bbytes; o += 64) _mm_prefetch((const char *)blk + Q_PREFETCH + o, Q_HINT);
      kq_head(kind, blk, &h[r]);
      f[r] = _mm256_setzero_ps();
    }
    for (int b = 0; b < spb; ++b) {
      const int64_t sb = s * spb + b;
      const __m256i xv = _mm256_loadu_si256((const __m256i *)(j->qx + m * nb * 32 + sb * 32));
      const __m256 dv = _mm256_broadcast_ss(j->dx + m * nb + sb);
      for (int r = 0; r < KD_R; ++r)
        f[r] = kq_step(kq_codes(kind, c + r * rb + s * bbytes, b), kq_scale16(kind, &h[r], b), xv, dv, f[r]);
    }
    for (int r = 0; r < KD_R; ++r) acc[r] = kq_close(j, w, m, s, &h[r], f[r], acc[r], kind);
  }
  for (int r = 0; r < KD_R; ++r) put_q(j, a, m, n + r, hsum8(acc[r]));
}

typedef struct { /* one block of one row of W, unpacked for the batch tiles */
  __m256i u[8], sc[8];
  khead_t h;
} kblock_t;

static void kq_unpack(int kind, const uint8_t *blk, kblock_t *k) {
#define KQ_UNPACK(KIND, SPB)                                         \
  case KIND:                                                         \
    kq_head(KIND, blk, &k->h);                                       \
    for (int b = 0; b < SPB; ++b) {                                  \
      k->u[b] = kq_codes(KIND, blk, b);                              \
      k->sc[b] = kq_scale16(KIND, &k->h, b);                         \
    }                                                                \
    break;
  switch (kind) {
    KQ_UNPACK(KQ_Q5_0, 1) KQ_UNPACK(KQ_Q5_1, 1) KQ_UNPACK(KQ_Q2_K, 8) KQ_UNPACK(KQ_Q3_K, 8)
    KQ_UNPACK(KQ_Q4_K, 8) KQ_UNPACK(KQ_Q5_K, 8) KQ_UNPACK(KQ_Q6_K, 8)
  }
#undef KQ_UNPACK
}

#ifndef KT_X
#define KT_X 4 /* rows of x per tile */
#endif
#ifndef KT_R
#define KT_R 2 /* rows of W per tile */
#endif

/* Batches: rows n..n + nr - 1 of W against rows m0..m0 + mt - 1 of x; each block unpacked once per row of W,
 * then met by every row of x of the tile with kdecode's arithmetic (kq_step, kq_close), step for step. */
static inline __attribute__((always_inline)) void ktile(const qjob_t *j, const qpart_t *a, int64_t m0, const int mt,
                                                         int64_t n, const int nr) {
  const qmat_t *w = &a->w;
  const int kind = w->kind;
  const int64_t nb = nb_of(w), rb = row_bytes(w), bbytes = kq_block_bytes(kind), spb = w->spg;
  const uint8_t *c = w->codes + n * rb;
  __m256 acc[KT_X][KT_R];
  for (int m = 0; m < mt; ++m)
    for (int r = 0; r < nr; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t s = 0; s < w->ng; ++s) {
    kblock_t k[KT_R];
    __m256 f[KT_X][KT_R];
    for (int r = 0; r < nr; ++r) {
      kq_unpack(kind, c + r * rb + s * bbytes, &k[r]);
      for (int m = 0; m < mt; ++m) f[m][r] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < spb; ++b) {
      const int64_t sb = s * spb + b;
      for (int m = 0; m < mt; ++m) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(j->qx + (m0 + m) * nb * 32 + sb * 32));
        const __m256 dv = _mm256_broadcast_ss(j->dx + (m0 + m) * nb + sb);
        for (int r = 0; r < nr; ++r) f[m][r] = kq_step(k[r].u[b], k[r].sc[b], xv, dv, f[m][r]);
      }
    }
    for (int m = 0; m < mt; ++m)
      for (int r = 0; r < nr; ++r) {
        /* the zero terms' layout (kq_close reads only that of the kind): per 16, one a block, per 32 */
        const int like = per16(kind) ? KQ_Q2_K : kind == KQ_Q5_0 || kind == KQ_Q5_1 ? KQ_Q5_0 : KQ_Q4_K;
        if (like == KQ_Q2_K) acc[m][r] = kq_close(j, w, m0 + m, s, &k[r].h, f[m][r], acc[m][r], KQ_Q2_K);
        else if (like == KQ_Q5_0) acc[m][r] = kq_close(j, w, m0 + m, s, &k[r].h, f[m][r], acc[m][r], KQ_Q5_0);
        else acc[m][r] = kq_close(j, w, m0 + m, s, &k[r].h, f[m][r], acc[m][r], KQ_Q4_K);
      }
  }
  for (int m = 0; m < mt; ++m)
    for (int r = 0; r < nr; ++r) put_q(j, a, m0 + m, n + r, hsum8(acc[m][r]));
}

#ifndef KT_XBYTES
#define KT_XBYTES 16384 /* bytes of int8 x a pass over a chunk's rows of W takes: they stay in L1 */
#endif

static __attribute__((unused)) void ktiles(const qjob_t *j, const qpart_t *a, int64_t n0, int64_t n1) {
  const int64_t xrow = nb_of(&a->w) * 32;
  int64_t mb = KT_XBYTES / xrow / KT_X * KT_X;
  if (mb < KT_X) mb = KT_X;
  for (int64_t b0 = 0; b0 < j->M; b0 += mb) {
    const int64_t b1 = j->M - b0 < mb ? j->M : b0 + mb;
    for (int64_t n = n0; n < n1;) {
      const int full = n1 - n >= KT_R;
      for (int64_t m0 = b0; m0 < b1; m0 += KT_X) {
        if (b1 - m0 >= KT_X) {
          if (full) ktile(j, a, m0, KT_X, n, KT_R);
          else ktile(j, a, m0, KT_X, n, 1);
        } else {
          for (int64_t m = m0; m < b1; ++m) { /* the tail rows one at a time: the same arithmetic */
            if (full) ktile(j, a, m, 1, n, KT_R);
            else ktile(j, a, m, 1, n, 1);
          }
        }
      }
      n += full ? KT_R : 1;
    }
  }
}

#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define KQ_512 1
/* AVX-512 builds: two sub-blocks (b, b + 1, b even) a step, 64 codes in one vector: a K-quant's codes for a pair of
 * sub-blocks sit in the same 32 or 64 bytes (Q4_K/Q5_K: low and high nibbles of one 32-byte run; Q6_K: one
 * 64-byte run of ql; Q2_K/Q3_K: two shifts of one 32-byte run), so the pair costs about what one sub-block did.
 * Lanes 0-15 (int32 after the madd: 0-7) are sub-block b, 16-31 (8-15) b + 1, x in its natural order. */
static inline __m512i bcast256(const uint8_t *p) { return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p)); }
static inline __m512i srl16x(__m512i v, int lo, int hi) { /* >> lo in the low half, >> hi in the high one */
  return _mm512_mask_srli_epi16(_mm512_srli_epi16(v, lo), 0xffff0000u, v, hi);
}

static inline __attribute__((always_inline)) __m512i kq_codes2(const int kind, const uint8_t *blk, int b) {
  const __m512i m4 = _mm512_set1_epi8(0x0f), m2 = _mm512_set1_epi8(3);
  const __m512i bits = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << b)), _mm256_set1_epi8((char)(1 << (b + 1))), 1);
  switch (kind) {
  case KQ_Q4_K:
  case KQ_Q5_K: {
    const __m512i q = _mm512_and_si512(srl16x(bcast256(blk + (kind == KQ_Q4_K ? 16 : 48) + 16 * b), 0, 4), m4);
    if (kind == KQ_Q4_K) return q;
    const __mmask64 k = _mm512_test_epi8_mask(bcast256(blk + 16), bits); /* qh bit b: sub-block b's fifth bits */
    return _mm512_mask_add_epi8(q, k, q, _mm512_set1_epi8(16));
  }
  case KQ_Q6_K: {
    const int h = b >> 2, r = b & 3; /* r is 0 or 2: ql's 64 bytes, low or high nibbles */
    const __m512i ql = _mm512_loadu_si512((const void *)(blk + 64 * h));
    const __m512i lo = _mm512_and_si512(r ? _mm512_srli_epi16(ql, 4) : ql, m4);
    const __m512i hi = _mm512_and_si512(srl16x(bcast256(blk + 128 + 32 * h), 2 * r, 2 * r + 2), m2);
    return _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
  }
  case KQ_Q3_K: {
    const int h = b >> 2, r = b & 3;
    const __m512i lo = _mm512_and_si512(srl16x(bcast256(blk + 32 + 32 * h), 2 * r, 2 * r + 2), m2);
    const __mmask64 k = _mm512_test_epi8_mask(bcast256(blk), bits);
    return _mm512_mask_add_epi8(lo, k, lo, _mm512_set1_epi8(4));
  }
  default: { /* Q2_K */
    const int h = b >> 2, r = b & 3;
    return _mm512_and_si512(srl16x(bcast256(blk + 16 + 32 * h), 2 * r, 2 * r + 2), m2);
  }
  }
}

/* The pair's integer scales as 32 int16 lanes: per 32, [c_b x16 | c_b+1 x16]; per 16, [c_2b x8 | c_2b+1 x8 | ...]. */
static inline __attribute__((always_inline)) __m512i kq_scale2(const int kind, const khead_t *h, int b) {
  if (per16(kind)) {
    const __m512i idx = _mm512_set_epi64(0x0003000300030003LL, 0x0003000300030003LL, 0x0002000200020002LL,
                                         0x0002000200020002LL, 0x0001000100010001LL, 0x0001000100010001LL, 0, 0);
    return _mm512_permutexvar_epi16(idx, _mm512_castsi128_si512(_mm_loadl_epi64((const __m128i *)(h->c16 + 2 * b))));
  }
  const __m512i idx = _mm512_set_epi64(0x0001000100010001LL, 0x0001000100010001LL, 0x0001000100010001LL,
                                       0x0001000100010001LL, 0, 0, 0, 0);
  int32_t pair;
  memcpy(&pair, h->c16 + b, 4);
  return _mm512_permutexvar_epi16(idx, _mm512_castsi128_si512(_mm_cvtsi32_si128(pair)));
}

static inline __m512 dx_pair(const float *dx) { /* [dx[0] x8 | dx[1] x8] */
  const __m512 ab = _mm512_castsi512_ps(_mm512_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)dx)));
  return _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), ab);
}

static inline __m512 kq_step2(__m512i u, __m512i sc, __m512i xv, __m512 dv, __m512 f) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(_mm512_maddubs_epi16(u, xv), sc)), dv, f);
}

/* A block's end, as kq_close: f times D, the zero terms off (per 16 over xs16, per 32 over xs). */
static inline __attribute__((always_inline)) __m512 kq_close2(const qjob_t *j, const qmat_t *w, int64_t m, int64_t s,
                                                              const khead_t *h, __m512 f, __m512 acc, const int kind) {
  const int64_t nb = nb_of(w);
  __m512 v = _mm512_fmadd_ps(f, _mm512_set1_ps(h->d), acc);
  if (per16(kind))
    return _mm512_fnmadd_ps(_mm512_loadu_ps(h->z), _mm512_loadu_ps(j->xs16 + m * nb * 2 + s * 16), v);
  return _mm512_fnmadd_ps(_mm512_maskz_loadu_ps(0xff, h->z), _mm512_maskz_loadu_ps(0xff, j->dx + (j->M + m) * nb + s * 8), v);
}

static inline float hsum16k(__m512 v) {
  return hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

/* Decode, AVX-512: rows n..n + KD_R - 1 against row m of x, two sub-blocks a step. */
static inline __attribute__((always_inline)) void kdecode2(const qjob_t *j, const qpart_t *a, int64_t m, int64_t n,
                                                            const int kind) {
  const qmat_t *w = &a->w;
  const int64_t nb = nb_of(w), rb = row_bytes(w), bbytes = kq_block_bytes(kind);
  const uint8_t *c = w->codes + n * rb;
  __m512 acc[KD_R];
  for (int r = 0; r < KD_R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < w->ng; ++s) {
    khead_t h[KD_R];
    __m512 f[KD_R];
    for (int r = 0; r < KD_R; ++r) {
      const uint8_t *blk = c + r * rb + s * bbytes;
      for (int64_t o = 0; o < bbytes; o += 64) _mm_prefetch((const char *)blk + Q_PREFETCH + o, Q_HINT);
      kq_head(kind, blk, &h[r]);
      f[r] = _mm512_setzero_ps();
    }
#pragma GCC unroll 4
    for (int b = 0; b < 8; b += 2) {
      const int64_t sb = s * 8 + b;
      const __m512i xv = _mm512_loadu_si512((const void *)(j->qx + m * nb * 32 + sb * 32));
      const __m512 dv = dx_pair(j->dx + m * nb + sb);
      for (int r = 0; r < KD_R; ++r)
        f[r] = kq_step2(kq_codes2(kind, c + r * rb + s * bbytes, b), kq_scale2(kind, &h[r], b), xv, dv, f[r]);
    }
    for (int r = 0; r < KD_R; ++r) acc[r] = kq_close2(j, w, m, s, &h[r], f[r], acc[r], kind);
  }
  for (int r = 0; r < KD_R; ++r) put_q(j, a, m, n + r, hsum16k(acc[r]));
}

typedef struct { /* a block of one row of W unpacked for the batch tiles, AVX-512 */
  __m512i u[4], sc[4];
  khead_t h;
} kblock2_t;

static void kq_unpack2(int kind, const uint8_t *blk, kblock2_t *k) {
#define KQ_UNPACK2(KIND)                                             \
  case KIND:                                                         \
    kq_head(KIND, blk, &k->h);                                       \
    for (int b = 0; b < 8; b += 2) {                                 \
      k->u[b / 2] = kq_codes2(KIND, blk, b);                         \
      k->sc[b / 2] = kq_scale2(KIND, &k->h, b);                      \
    }                                                                \
    break;
  switch (kind) { KQ_UNPACK2(KQ_Q2_K) KQ_UNPACK2(KQ_Q3_K) KQ_UNPACK2(KQ_Q4_K) KQ_UNPACK2(KQ_Q5_K) KQ_UNPACK2(KQ_Q6_K) }
#undef KQ_UNPACK2
}

/* Batches, AVX-512: kdecode2's arithmetic per (row of x, row of W), each block unpacked once per row of W. */
static inline __attribute__((always_inline)) void ktile2(const qjob_t *j, const qpart_t *a, int64_t m0, const int mt,
                                                          int64_t n, const int nr) {
  const qmat_t *w = &a->w;
  const int kind = w->kind, like = per16(kind) ? KQ_Q2_K : KQ_Q4_K;
  const int64_t nb = nb_of(w), rb = row_bytes(w), bbytes = kq_block_bytes(kind);
  const uint8_t *c = w->codes + n * rb;
  __m512 acc[KT_X][KT_R];
  for (int m = 0; m < mt; ++m)
    for (int r = 0; r < nr; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < w->ng; ++s) {
    kblock2_t k[KT_R];
    __m512 f[KT_X][KT_R];
    for (int r = 0; r < nr; ++r) {
      kq_unpack2(kind, c + r * rb + s * bbytes, &k[r]);
      for (int m = 0; m < mt; ++m) f[m][r] = _mm512_setzero_ps();
    }
    for (int b = 0; b < 8; b += 2) {
      const int64_t sb = s * 8 + b;
      for (int m = 0; m < mt; ++m) {
        const __m512i xv = _mm512_loadu_si512((const void *)(j->qx + (m0 + m) * nb * 32 + sb * 32));
        const __m512 dv = dx_pair(j->dx + (m0 + m) * nb + sb);
        for (int r = 0; r < nr; ++r) f[m][r] = kq_step2(k[r].u[b / 2], k[r].sc[b / 2], xv, dv, f[m][r]);
      }
    }
    for (int m = 0; m < mt; ++m)
      for (int r = 0; r < nr; ++r) {
        if (like == KQ_Q2_K) acc[m][r] = kq_close2(j, w, m0 + m, s, &k[r].h, f[m][r], acc[m][r], KQ_Q2_K);
        else acc[m][r] = kq_close2(j, w, m0 + m, s, &k[r].h, f[m][r], acc[m][r], KQ_Q4_K);
      }
  }
  for (int m = 0; m < mt; ++m)
    for (int r = 0; r < nr; ++r) put_q(j, a, m0 + m, n + r, hsum16k(acc[m][r]));
}

static void ktiles2(const qjob_t *j, const qpart_t *a, int64_t n0, int64_t n1) {
  const int64_t xrow = nb_of(&a->w) * 32;
  int64_t mb = KT_XBYTES / xrow / KT_X * KT_X;
  if (mb < KT_X) mb = KT_X;
  for (int64_t b0 = 0; b0 < j->M; b0 += mb) {
    const int64_t b1 = j->M - b0 < mb ? j->M : b0 + mb;
    for (int64_t n = n0; n < n1;) {
      const int full = n1 - n >= KT_R;
      for (int64_t m0 = b0; m0 < b1; m0 += KT_X) {
        if (b1 - m0 >= KT_X) {
          if (full) ktile2(j, a, m0, KT_X, n, KT_R);
          else ktile2(j, a, m0, KT_X, n, 1);
        } else {
          for (int64_t m = m0; m < b1; ++m) {
            if (full) ktile2(j, a, m, 1, n, KT_R);
            else ktile2(j, a, m, 1, n, 1);
          }
        }
      }
      n += full ? KT_R : 1;
    }
  }
}
#else
#define KQ_512 0
#endif

void kq_rows(const qjob_t *j, const qpart_t *a, int64_t n0, int64_t n1) {
  if (a->w.kind == KQ_Q5_0 || a->w.kind == KQ_Q5_1) {
    q5_tiles(j, a, n0, n1); /* qtile_k.c: the canonical sum, as the panels (quant.h) */
    return;
  }
  if (kq_canonical(a->w.kind)) { /* Q4_K, Q5_K, Q6_K: qtile_k.c's qk_tiles, the panels' sums */
    qk_tiles(j, a, n0, n1);
    return;
  }
#if KQ_512
  if (j->M > 1) {
    ktiles2(j, a, n0, n1);
    return;
  }
  int64_t n = n0;
  for (; n + KD_R <= n1; n += KD_R) {
    switch (a->w.kind) {
    case KQ_Q2_K: kdecode2(j, a, 0, n, KQ_Q2_K); break;
    case KQ_Q3_K: kdecode2(j, a, 0, n, KQ_Q3_K); break;
    case KQ_Q4_K: kdecode2(j, a, 0, n, KQ_Q4_K); break;
    case KQ_Q5_K: kdecode2(j, a, 0, n, KQ_Q5_K); break;
    case KQ_Q6_K: kdecode2(j, a, 0, n, KQ_Q6_K); break;
    }
  }
  for (; n < n1; ++n) ktile2(j, a, 0, 1, n, 1);
#else
  if (j->M > 1) {
    ktiles(j, a, n0, n1);
    return;
  }
  int64_t n = n0;
  for (; n + KD_R <= n1; n += KD_R) { /* one row of x: rows of W in fours, the unpacking inlined per type */
    switch (a->w.kind) {
    case KQ_Q2_K: kdecode(j, a, 0, n, KQ_Q2_K); break;
    case KQ_Q3_K: kdecode(j, a, 0, n, KQ_Q3_K); break;
    case KQ_Q4_K: kdecode(j, a, 0, n, KQ_Q4_K); break;
    case KQ_Q5_K: kdecode(j, a, 0, n, KQ_Q5_K); break;
    case KQ_Q6_K: kdecode(j, a, 0, n, KQ_Q6_K); break;
    }
  }
  for (; n < n1; ++n) ktile(j, a, 0, 1, n, 1);
#endif
}

/* Row n of a ggml-block matrix for qpanel.c's panels: its codes [K] unsigned in value order, and per group (a
 * sub-block of 32, or of 16 for Q2_K/Q3_K/Q6_K) the scale s_j = D * c_j (exact) and the zero term Z_j, at
 * scales[j * stride] and zeros[j * stride]. */
void kq_unpack_row(const qmat_t *w, int64_t n, uint8_t *codes, float *scales, float *zeros, int64_t stride) {
  const int kind = w->kind, spb = (int)w->spg, p16 = per16(kind);
  const int64_t bbytes = kq_block_bytes(kind);
  for (int64_t s = 0; s < w->ng; ++s) {
    const uint8_t *blk = w->codes + n * row_bytes(w) + s * bbytes;
    kblock_t k = {0};
    kq_unpack(kind, blk, &k);
    for (int b = 0; b < spb; ++b) _mm256_storeu_si256((__m256i *)(codes + (s * spb + b) * 32), k.u[b]);
    const int groups = p16 ? 16 : spb;
    for (int g = 0; g < groups; ++g) {
      const int64_t j = s * groups + g;
      const int c = kind == KQ_Q5_0 || kind == KQ_Q5_1 ? 1 : p16 ? (int8_t)k.h.c[g] : k.h.c[g];
      scales[j * stride] = k.h.d * (float)c;
      zeros[j * stride] = k.h.z[g];
    }
  }
}

/* xs16 [M, nb * 2]: dx_b * Σ q_x over each 16 values (the per-16 zero terms' X_j); xz16: -32 Σ q_x (Q6_K's zero
 * point, taken off its integers). */
void kq_sums16(const int8_t *qx, const float *dx, int64_t M, int64_t nb, float *xs16, int32_t *xz16) {
  for (int64_t i = 0; i < M * nb; ++i)
    for (int h = 0; h < 2; ++h) {
      int s = 0;
      for (int k = 0; k < 16; ++k) s += qx[i * 32 + 16 * h + k];
      xs16[i * 2 + h] = dx[i] * (float)s;
      xz16[i * 2 + h] = -32 * s;
    }
}

/* One block's 256 (or 32) weights, exactly as gguf.quants.dequantize: s_j = D * c_j, then s_j * q - m_j or
 * s_j * (q - z) (every product exact in float32: see py_engine/quant/ggml.py). */
void kq_dequantize_block(int kind, const uint8_t *blk, float *o) {
  if (kind == KQ_Q5_0 || kind == KQ_Q5_1) {
    const uint8_t *qs = blk + (kind == KQ_Q5_0 ? 6 : 8);
    uint32_t qh;
    memcpy(&qh, qs - 4, 4);
    const float d = half(blk), m = kind == KQ_Q5_1 ? half(blk + 2) : 0.f;
    for (int l = 0; l < 32; ++l) {
      const int q = ((l < 16 ? qs[l] & 15 : qs[l - 16] >> 4)) | (int)((qh >> l) & 1) << 4;
      o[l] = kind == KQ_Q5_0 ? d * (float)(q - 16) : d * (float)q + m;
    }
    return;
  }
  for (int b = 0; b < 8; ++b) {
    const int h = b >> 2, r = b & 3;
    for (int half16 = 0; half16 < 2; ++half16) {
      const int j = per16(kind) ? 2 * b + half16 : b; /* the sub-scale of these 16 values */
      float s, mn = 0.f;
      int z = 0;
      switch (kind) {
      case KQ_Q4_K:
      case KQ_Q5_K: {
        uint8_t sm[16];
        scales_k4(blk + 4, sm);
        s = half(blk) * (float)sm[j];
        mn = half(blk + 2) * (float)sm[8 + j];
        break;
      }
      case KQ_Q6_K: s = half(blk + 208) * (float)(int8_t)blk[192 + j]; z = 32; break;
      case KQ_Q3_K: {
        int8_t sc[16];
        scales_q3(blk + 96, sc);
        s = half(blk + 108) * (float)sc[j];
        z = 4;
        break;
      }
      default: s = half(blk + 80) * (float)(blk[j] & 15); mn = half(blk + 82) * (float)(blk[j] >> 4); break;
      }
      for (int l = 16 * half16; l < 16 * half16 + 16; ++l) {
        int q;
        switch (kind) {
        case KQ_Q4_K: q = (blk[16 + 32 * (b >> 1) + l] >> (4 * (b & 1))) & 15; break;
        case KQ_Q5_K: q = ((blk[48 + 32 * (b >> 1) + l] >> (4 * (b & 1))) & 15) | ((blk[16 + l] >> b) & 1) << 4; break;
        case KQ_Q6_K: q = ((blk[64 * h + 32 * (r & 1) + l] >> (4 * (r >> 1))) & 15) | ((blk[128 + 32 * h + l] >> (2 * r)) & 3) << 4; break;
        case KQ_Q3_K: q = ((blk[32 + 32 * h + l] >> (2 * r)) & 3) | ((blk[l] >> b) & 1) << 2; break;
        default: q = (blk[16 + 32 * h + l] >> (2 * r)) & 3; break;
        }
        o[32 * b + l] = z ? s * (float)(q - z) : s * (float)q - mn;
      }
    }
  }
}

void kq_dequantize_rows(const qmat_t *w, int64_t r0, int64_t r1, int64_t K, float *out) {
  const int64_t rb = row_bytes(w), bbytes = kq_block_bytes(w->kind), values = w->spg * 32;
  for (int64_t n = r0; n < r1; ++n)
    for (int64_t s = 0; s < w->ng; ++s) {
      const int64_t k0 = s * values;
      if (k0 + values <= K) {
        kq_dequantize_block(w->kind, w->codes + n * rb + s * bbytes, out + (n - r0) * K + k0);
      } else if (k0 < K) {
        float tmp[256];
        kq_dequantize_block(w->kind, w->codes + n * rb + s * bbytes, tmp);
        memcpy(out + (n - r0) * K + k0, tmp, (size_t)(K - k0) * 4);
      }
    }
}
