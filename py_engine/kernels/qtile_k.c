/* ggml's Q5_0/Q5_1 and K-quant blocks read in place in qtile.h's virtual panels, in the canonical sum. */
#include "qtile.h"

/* ggml's Q5_0 and Q5_1 blocks (kquant.c's layout: kind 6 or 7, a block is one sub-block of 32 values), read in
 * place in the same virtual panels. Q5_0 is [d fp16][qh 4][qs 16], Q5_1 [d fp16][m fp16][qh 4][qs 16]: qs is
 * Q4_0's nibble order, so a sub-block's 16 rows turn as 4-bit codes do, then bit k of qh (value k's fifth bit)
 * adds 16 to code k. Per block b of row n, w = d_b (c - 16) (Q5_0) or d_b c + m_b (Q5_1), so the canonical sum
 * with s = d_b and mn = 16 d_b or -m_b (the group is the block; X_b is quant.c's xs):
 *     acc = fma(float(I_b), dx_b * d_b, acc);  acc = fnma(mn_b, X_b, acc)
 * lane for lane as qpanel.c's panels of the same blocks (pack_blocks: s_j = d * 1, Z_j = kquant.c's z[0]), so
 * decode, batches and prompt chunks give a row the same bits. The scales come in by one gather a block (d, and
 * m beside it), qh by another. */
#ifdef __AVX512BW__
static inline vi vi_gather(const uint8_t *base, vi at) { return _mm512_i32gather_epi32(at, (const void *)base, 1); }
static inline vf half_lo(vi v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); } /* the low half of each dword */
static inline vi vi_srl16(vi v) { return _mm512_srli_epi32(v, 16); }
static inline vf vf_neg(vf v) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u))); }

static inline void codes4_at(const uint8_t *const *row, int64_t off, vi *c) { /* codes_of's 4-bit turn at off */
  vi a[4], d[4];
  for (int i = 0; i < 4; ++i) a[i] = load4x128(row, i, off);
  transpose4(a, d);
  const vi low = _mm512_set1_epi8(0x0f);
  for (int t = 0; t < 4; ++t) {
    c[t] = _mm512_and_si512(d[t], low);
    c[4 + t] = _mm512_and_si512(_mm512_srli_epi16(d[t], 4), low);
  }
}

/* c[t] (columns 4t'..4t'+3 of XOFF4's order: qh bits 4t..4t + 3) += 16 where the lane's qh bit is set: byte t/2 of
 * each dword spread over its 4 bytes, then each byte tests its own bit. */
static inline void fifth_bits(vi qh, vi *c) {
  for (int t = 0; t < 8; t += 2) {
    const vi rep = _mm512_shuffle_epi8(qh, _mm512_add_epi8(_mm512_set4_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0),
                                                           _mm512_set1_epi8((char)(t >> 1))));
    for (int h = 0; h < 2; ++h) {
      const __mmask64 k = _mm512_test_epi8_mask(rep, _mm512_set1_epi32((int)(0x08040201u << (4 * h))));
      c[t + h] = _mm512_mask_add_epi8(c[t + h], k, c[t + h], _mm512_set1_epi8(16));
    }
  }
}
#else
static inline vi vi_gather(const uint8_t *base, vi at) { return _mm256_i32gather_epi32((const int *)base, at, 1); }
static inline vf half_lo(vi v) { /* the low half of each dword as float, exactly (integer AVX2: no F16C here) */
  const vi h = _mm256_and_si256(v, _mm256_set1_epi32(0xffff)), em = _mm256_and_si256(h, _mm256_set1_epi32(0x7fff));
  const vf normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(em, 13), _mm256_set1_epi32(0x38000000)));
  const vf tiny = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(0x1p-24f)); /* subnormals: m 2^-24, exact */
  vf f = _mm256_blendv_ps(normal, tiny, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(0x400), em)));
  const vi special = _mm256_cmpgt_epi32(em, _mm256_set1_epi32(0x7bff)); /* inf, NaN */
  f = _mm256_or_ps(f, _mm256_castsi256_ps(_mm256_and_si256(special, _mm256_set1_epi32(0x7f800000))));
  return _mm256_or_ps(f, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0x8000)), 16)));
}
static inline vi vi_srl16(vi v) { return _mm256_srli_epi32(v, 16); }
static inline vf vf_neg(vf v) { return _mm256_xor_ps(v, _mm256_set1_ps(-0.f)); }

static inline void codes4_at(const uint8_t *const *row, int64_t off, vi *c) {
  vi a[4], d[4];
  for (int i = 0; i < 4; ++i) a[i] = load2x128(row, i, off);
  transpose4(a, d);
  const vi low = _mm256_set1_epi8(0x0f);
  for (int t = 0; t < 4; ++t) {
    c[t] = _mm256_and_si256(d[t], low);
    c[4 + t] = _mm256_and_si256(_mm256_srli_epi16(d[t], 4), low);
  }
}

static inline void fifth_bits(vi qh, vi *c) {
  for (int t = 0; t < 8; t += 2) {
    const vi ctl = _mm256_add_epi8(_mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c, 0, 0x04040404, 0x08080808,
                                                     0x0c0c0c0c), _mm256_set1_epi8((char)(t >> 1)));
    const vi rep = _mm256_shuffle_epi8(qh, ctl);
    for (int h = 0; h < 2; ++h) {
      const vi bit = _mm256_set1_epi32((int)(0x08040201u << (4 * h)));
      const vi set = _mm256_cmpeq_epi8(_mm256_and_si256(rep, bit), bit);
      c[t + h] = _mm256_or_si256(c[t + h], _mm256_and_si256(set, _mm256_set1_epi8(16)));
    }
  }
}
#endif

/* Rows n..n + live - 1 of a Q5_0 (kind 6) or Q5_1 (7) matrix against rows m0..m0 + mt - 1 of x. */
static inline __attribute__((always_inline)) void vblock5(const qjob_t *j, const qpart_t *a, int64_t n, int live,
                                                           int64_t m0, const int mt, const int kind) {
  const qmat_t *w = &a->w;
  const int64_t nb = nb_of(w), rb = row_bytes(w), xrow = nb * 32, bb = kind == 6 ? 22 : 24, qs = kind == 6 ? 6 : 8;
  const float *xs = j->dx + j->M * nb; /* X_b = dx_b Σ q_x (quant.c's xs) */
  const uint8_t *base = w->codes + n * rb, *row[VT_ROWS];
  for (int L = 0; L < VT_ROWS; ++L) row[L] = base + (L < live ? L : live - 1) * rb;
  const vi at = vi_rows(rb, live); /* lane L: row PERM(L)'s offset */
  const int64_t pf = q_prefetch_at(rb, VT_ROWS);
  vf acc[VT_X];
  for (int m = 0; m < mt; ++m) acc[m] = vf_zero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t *blk = base + b * bb;
    if (!(b & 1)) /* 44 or 48 bytes of each row per 2 blocks: every line, one block of rows ahead */
      for (int L = 0; L < live; ++L) _mm_prefetch((const char *)row[L] + b * bb + pf, Q_HINT);
    const vi head = vi_gather(blk, at), qh = vi_gather(blk + qs - 4, at); /* [d | m or qh's low half], qh */
    const vf d = half_lo(head);
    const vf mn = kind == 6 ? vf_mul(vf_set1(16.f), d) : vf_neg(half_lo(vi_srl16(head)));
    vi c[8];
    codes4_at(row, b * bb + qs, c);
    fifth_bits(qh, c);
    for (int m = 0; m < mt; ++m) {
      const int64_t r = (m0 + m) * nb + b;
      acc[m] = vf_fold(acc[m], dot_block(c, j->qx + (m0 + m) * xrow + b * 32, 1), vf_set1(j->dx[r]), d);
      acc[m] = vf_mins(acc[m], mn, vf_set1(xs[r]));
    }
  }
  store_tile(j, a, n, live, m0, mt, acc);
}

void q5_tiles(const qjob_t *j, const qpart_t *a, int64_t n0, int64_t n1) {
  FOR_TILES(if (a->w.kind == 6) { TILE_CASES(vblock5, 6) } else { TILE_CASES(vblock5, 7) })
}

/* ggml's Q4_K, Q5_K and Q6_K super-blocks (256 values: 8 sub-blocks of 32) in the same virtual panels, summed in
 * the canonical order qpanel.c's pack_blocks panels use: per sub-block b (its scales s_j = D c_j, zero terms Z_j
 * exactly as kquant.c's kq_head makes them: dmin m_j for Q4_K/Q5_K, 32 D c_j for Q6_K)
 *     Q4_K/Q5_K (groups of 32):  acc = fma(float(I_b), dx_b * s_b, acc);  acc = fnma(Z_b, X_b, acc)
 *     Q2_K/Q3_K (groups of 16):  the same for values 0-15 of b (group 2b, X over those 16: kq_sums16), then 16-31
 *     Q6_K (groups of 16):       acc = fma(float(I_j), dx_b * s_j, acc), I_j = Σ c q - 32 Σ q (xz16): no Z_j term.
 * A sub-block's codes lie as bytes in value order (Q4_K/Q5_K: the low or high nibbles of a 32-byte run; Q6_K: ql's
 * nibbles and qh's 2-bit pairs), so 32 bytes of 16 rows turn as 8-bit codes do (two 4 x 4 dword transposes) and
 * each run serves two or four sub-blocks. A block's scales come in by gathers of its header words. */
#ifdef __AVX512BW__
static inline void turn32(const uint8_t *const *row, int64_t off, vi *t) { /* 32 bytes of each row, 4 a lane */
  vi a[4];
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 4; ++i) a[i] = load4x128(row, i, off + 16 * h);
    transpose4(a, t + 4 * h);
  }
}
static inline vi vi_bits(vi v, int shift, int mask) { /* (byte >> shift) & mask, per byte */
  return _mm512_and_si512(_mm512_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm512_set1_epi8((char)mask));
}
static inline vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
static inline vi vi_set1(int32_t v) { return _mm512_set1_epi32(v); }
static inline vi vi_and32(vi v, int m) { return _mm512_and_si512(v, _mm512_set1_epi32(m)); }
static inline vi vi_srl32(vi v, int n) { return _mm512_srl_epi32(v, _mm_cvtsi32_si128(n)); }
static inline vi vi_sll32(vi v, int n) { return _mm512_sll_epi32(v, _mm_cvtsi32_si128(n)); }
static inline vi vi_sub32(vi v, int k) { return _mm512_sub_epi32(v, _mm512_set1_epi32(k)); }
static inline vi vi_shl4(vi v) { return _mm512_slli_epi16(v, 4); } /* bytes below 16 only: no carry across */
static inline vi add_where(vi c, vi v, int bit, int add) { /* c + add in the bytes where v has bit `bit` */
  return _mm512_mask_add_epi8(c, _mm512_test_epi8_mask(v, _mm512_set1_epi8((char)(1 << bit))), c, _mm512_set1_epi8((char)add));
}
static inline vi vi_field(vi v, int shift, int bits) { /* (dword >> shift) & (2^bits - 1) */
  return _mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(shift)), _mm512_set1_epi32((1 << bits) - 1));
}
static inline vi vi_sbyte(vi v, int k) { /* byte k of each dword, signed */
  return _mm512_srai_epi32(_mm512_sll_epi32(v, _mm_cvtsi32_si128(24 - 8 * k)), 24);
}
static inline vf vf_int(vi v) { return _mm512_cvtepi32_ps(v); }
static inline vi vi_hi16(vi v) { return _mm512_srli_epi32(v, 16); }
static inline vi dot_part(const vi *c, const int8_t *q, int t0, int t1, vi acc) { /* acc + dwords t0..t1 - 1 */
  for (int t = t0; t < t1; ++t)
#ifdef __AVX512VNNI__
    acc = _mm512_dpbusd_epi32(acc, c[t], bcast(q + XOFF4[t]));
#else
    acc = _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(c[t], bcast(q + XOFF4[t])), _mm512_set1_epi16(1)));
#endif
  return acc;
}
#else
static inline void turn32(const uint8_t *const *row, int64_t off, vi *t) {
  vi a[4];
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 4; ++i) a[i] = load2x128(row, i, off + 16 * h);
    transpose4(a, t + 4 * h);
  }
}
static inline vi vi_bits(vi v, int shift, int mask) {
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8((char)mask));
}
static inline vi vi_or(vi a, vi b) { return _mm256_or_si256(a, b); }
static inline vi vi_zero(void) { return _mm256_setzero_si256(); }
static inline vi vi_set1(int32_t v) { return _mm256_set1_epi32(v); }
static inline vi vi_and32(vi v, int m) { return _mm256_and_si256(v, _mm256_set1_epi32(m)); }
static inline vi vi_srl32(vi v, int n) { return _mm256_srl_epi32(v, _mm_cvtsi32_si128(n)); }
static inline vi vi_sll32(vi v, int n) { return _mm256_sll_epi32(v, _mm_cvtsi32_si128(n)); }
static inline vi vi_sub32(vi v, int k) { return _mm256_sub_epi32(v, _mm256_set1_epi32(k)); }
static inline vi vi_shl4(vi v) { return _mm256_slli_epi16(v, 4); }
static inline vi add_where(vi c, vi v, int bit, int add) { /* add is a bit c never has: or = add */
  const vi b = _mm256_set1_epi8((char)(1 << bit));
  return _mm256_or_si256(c, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, b), b), _mm256_set1_epi8((char)add)));
}
static inline vi vi_field(vi v, int shift, int bits) {
  return _mm256_and_si256(_mm256_srl_epi32(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi32((1 << bits) - 1));
}
static inline vi vi_sbyte(vi v, int k) {
  return _mm256_srai_epi32(_mm256_sll_epi32(v, _mm_cvtsi32_si128(24 - 8 * k)), 24);
}
static inline vf vf_int(vi v) { return _mm256_cvtepi32_ps(v); }
static inline vi vi_hi16(vi v) { return _mm256_srli_epi32(v, 16); }
static inline vi dot_part(const vi *c, const int8_t *q, int t0, int t1, vi acc) {
  for (int t = t0; t < t1; ++t)
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(c[t], bcast(q + XOFF4[t])), _mm256_set1_epi16(1)));
  return acc;
}
#endif

/* Q4_K/Q5_K's 12 scale bytes (dwords a0, a1, a2 of each lane) -> scale j (mins: m) as 6-bit integers:
 * j < 4: byte j (j + 4) of the 12, low 6 bits; j >= 4: the low (high) nibble of byte j + 4, the top 2 bits of
 * byte j - 4 (j) above it. */
static inline vi k4_scale(vi a0, vi a1, vi a2, int j, int mins) {
  if (j < 4) return vi_field(mins ? a1 : a0, 8 * j, 6);
  const int i = j - 4;
  return vi_or(vi_field(a2, 8 * i + (mins ? 4 : 0), 4), vi_shl4(vi_field(mins ? a1 : a0, 8 * i + 6, 2)));
}

/* Rows n..n + live - 1 of a Q4_K (kind 12), Q5_K (13) or Q6_K (14) matrix against rows m0..m0 + mt - 1 of x. */
static inline __attribute__((always_inline)) void kvblock(const qjob_t *j, const qpart_t *a, int64_t n, int live,
                                                           int64_t m0, const int mt, const int kind) {
  const qmat_t *w = &a->w;
  const int64_t nb = nb_of(w), rb = row_bytes(w), xrow = nb * 32, bb = kq_block_bytes(kind);
  const float *xs = j->dx + j->M * nb; /* per 32: quant.c's xs; per 16 (Q6_K): j->xs16 */
  const uint8_t *base = w->codes + n * rb, *row[VT_ROWS];
  for (int L = 0; L < VT_ROWS; ++L) row[L] = base + (L < live ? L : live - 1) * rb;
  const vi at = vi_rows(rb, live);
  const int64_t pf = q_prefetch_at(rb, VT_ROWS);
  vf acc[VT_X];
  for (int m = 0; m < mt; ++m) acc[m] = vf_zero();
  vi run[8], run1[8], high[8]; /* turned 32-byte runs of codes (Q6_K: two of ql); Q5_K's qh, Q6_K's qh run */
  for (int t = 0; t < 8; ++t) run[t] = run1[t] = high[t] = vi_zero();
  for (int64_t s = 0; s < w->ng; ++s) {
    const int64_t o = s * bb;
    const uint8_t *blk = base + o;
    for (int L = 0; L < live; ++L)
      for (int64_t p = 0; p < bb; p += 64) _mm_prefetch((const char *)row[L] + o + p + pf, Q_HINT);
    vf sc[16], zc[16]; /* s_j and Z_j of the lanes' blocks (8 groups of 32, or 16 of 16; Q6_K: no Z_j) */
    if (kind == 14) { /* ql[128] qh[64] scales[16] (int8) d: d read with the two scale bytes before it */
      const vf d = half_lo(vi_hi16(vi_gather(blk + 206, at)));
      for (int q = 0; q < 4; ++q) {
        const vi four = vi_gather(blk + 192 + 4 * q, at);
        for (int k = 0; k < 4; ++k) {
          const vf c = vf_int(vi_sbyte(four, k));
          sc[4 * q + k] = vf_mul(d, c); /* no zero terms: the 32 is in the integers (but in Q6_FOLD=0 builds) */
          if (!Q6_FOLD) zc[4 * q + k] = vf_mul(vf_mul(vf_set1(32.f), d), c);
        }
      }
    } else if (kind == 10) { /* Q2_K: scales[16] (scale | min << 4) qs[64] d dmin */
      const vi head = vi_gather(blk + 80, at);
      const vf d = half_lo(head), dmin = half_lo(vi_hi16(head));
      for (int q = 0; q < 4; ++q) {
        const vi four = vi_gather(blk + 4 * q, at);
        for (int k = 0; k < 4; ++k) {
          sc[4 * q + k] = vf_mul(d, vf_int(vi_field(four, 8 * k, 4)));
          zc[4 * q + k] = vf_mul(dmin, vf_int(vi_field(four, 8 * k + 4, 4)));
        }
      }
    } else if (kind == 11) { /* Q3_K: hmask[32] qs[64] scales[12] (6-bit, + 32) d; kquant.c's scales_q3 per lane */
      const vf d = half_lo(vi_hi16(vi_gather(blk + 106, at))), d4 = vf_mul(vf_set1(4.f), d);
      const vi a0 = vi_gather(blk + 96, at), a1 = vi_gather(blk + 100, at), a2 = vi_gather(blk + 104, at);
      for (int q = 0; q < 4; ++q) { /* scales 4q..4q + 3: a nibble of a0 / a1, two bits of a2 above it */
        const vi lowq = vi_and32(q & 2 ? vi_srl32(q & 1 ? a1 : a0, 4) : (q & 1 ? a1 : a0), 0x0f0f0f0f);
        const vi four = vi_or(lowq, vi_sll32(vi_and32(vi_srl32(a2, 2 * q), 0x03030303), 4));
        for (int k = 0; k < 4; ++k) {
          const vf c = vf_int(vi_sub32(vi_field(four, 8 * k, 6), 32));
          sc[4 * q + k] = vf_mul(d, c), zc[4 * q + k] = vf_mul(d4, c);
        }
      }
    } else { /* d dmin scales[12] (Q5_K: qh[32]) qs[128] */
      const vi head = vi_gather(blk, at), a0 = vi_gather(blk + 4, at), a1 = vi_gather(blk + 8, at),
               a2 = vi_gather(blk + 12, at);
      const vf d = half_lo(head), dmin = half_lo(vi_hi16(head));
      for (int g = 0; g < 8; ++g) {
        sc[g] = vf_mul(d, vf_int(k4_scale(a0, a1, a2, g, 0)));
        zc[g] = vf_mul(dmin, vf_int(k4_scale(a0, a1, a2, g, 1)));
      }
    }
    if (kind == 13) turn32(row, o + 16, high);
    for (int b = 0; b < 8; ++b) {
      vi c[8];
      if (kind == 10 || kind == 11) { /* 2-bit codes: qs's 32-byte run h, bits 2r, 2r + 1; Q3_K: hmask bit b is 4 */
        const int h = b >> 2, r = b & 3;
        if (kind == 11 && b == 0) turn32(row, o, high);
        if (r == 0) turn32(row, o + (kind == 10 ? 16 : 32) + 32 * h, run);
        for (int t = 0; t < 8; ++t) {
          c[t] = vi_bits(run[t], 2 * r, 3);
          if (kind == 11) c[t] = add_where(c[t], high[t], b, 4);
        }
      } else if (kind == 14) {
        const int h = b >> 2, r = b & 3; /* ql's runs 64h and 64h + 32: low nibbles for r = 0, 1, high for 2, 3 */
        if (r == 0) {
          turn32(row, o + 128 + 32 * h, high);
          turn32(row, o + 64 * h, run);
          turn32(row, o + 64 * h + 32, run1);
        }
        const vi *ql = r & 1 ? run1 : run;
        for (int t = 0; t < 8; ++t) c[t] = vi_or(vi_bits(ql[t], 4 * (r >> 1), 15), vi_shl4(vi_bits(high[t], 2 * r, 3)));
      } else {
        if (!(b & 1)) turn32(row, o + (kind == 12 ? 16 : 48) + 32 * (b >> 1), run);
        for (int t = 0; t < 8; ++t) {
          c[t] = vi_bits(run[t], 4 * (b & 1), 15);
          if (kind == 13) c[t] = add_where(c[t], high[t], b, 16);
        }
      }
      const int64_t sb = s * 8 + b;
      for (int m = 0; m < mt; ++m) {
        const int64_t r = (m0 + m) * nb + sb;
        const int8_t *q = j->qx + (m0 + m) * xrow + sb * 32;
        const vf dx = vf_set1(j->dx[r]);
        if (kq_zero_folded(kind)) { /* two groups of 16, each I_j = Σ c q - 32 Σ q exact (xz16), one fma each */
          acc[m] = vf_fold(acc[m], dot_part(c, q, 0, 4, vi_set1(j->xz16[2 * r])), dx, sc[2 * b]);
          acc[m] = vf_fold(acc[m], dot_part(c, q, 4, 8, vi_set1(j->xz16[2 * r + 1])), dx, sc[2 * b + 1]);
        } else if (kind == 10 || kind == 11 || kind == 14) { /* two groups of 16: values 0-15 (dwords 0-3), 16-31 */
          acc[m] = vf_fold(acc[m], dot_part(c, q, 0, 4, vi_zero()), dx, sc[2 * b]);
          acc[m] = vf_mins(acc[m], zc[2 * b], vf_set1(j->xs16[2 * r]));
          acc[m] = vf_fold(acc[m], dot_part(c, q, 4, 8, vi_zero()), dx, sc[2 * b + 1]);
          acc[m] = vf_mins(acc[m], zc[2 * b + 1], vf_set1(j->xs16[2 * r + 1]));
        } else {
          acc[m] = vf_fold(acc[m], dot_part(c, q, 0, 8, vi_zero()), dx, sc[b]);
          acc[m] = vf_mins(acc[m], zc[b], vf_set1(xs[r]));
        }
      }
    }
  }
  store_tile(j, a, n, live, m0, mt, acc);
}

void qk_tiles(const qjob_t *j, const qpart_t *a, int64_t n0, int64_t n1) {
  FOR_TILES(switch (a->w.kind) {
    case 10: TILE_CASES(kvblock, 10) break;
    case 11: TILE_CASES(kvblock, 11) break;
    case 12: TILE_CASES(kvblock, 12) break;
    case 13: TILE_CASES(kvblock, 13) break;
    default: TILE_CASES(kvblock, 14) break;
  })
}
