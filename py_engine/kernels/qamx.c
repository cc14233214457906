/* qrow.c's rows of x (a speculative step's k + 1, a batch, a short prompt chunk) on Intel AMX where the CPU has it
 * and Linux grants it: the exact integers I_b of every sub-block from tile dot products, then quant.h's canonical
 * float steps as qrow.c takes them, so a row gets the same bits here as alone in a decode step.
 *
 * Why (issue 32): a verify row cost ~0.14 of a decode step on AVX-512 VNNI, almost all of it the integer dots
 * (per x row and sub-block of 16 W rows: 8 vpdpbusd, then unpacks and adds to reduce them). One tdpbusd (16 W rows x
 * 16 x rows x one sub-block of 32) leaves the 256 integers in a tile; what stays per x row is the float work.
 *
 * Tiles (palette 1): A = 16 W rows x 32 code bytes (4-bit: unpacked to a buffer, low nibbles = columns 0-15, high =
 * 16-31; 8-bit: read in place, signed), B = x of one sub-block in VNNI order ([8][16 x rows][4 bytes]), C = [16 W
 * rows][16 x rows] int32. 4-bit codes (0-15) x signed x: tdpbusd; 8-bit codes c: tdpbssd gives sum c x, and + 128
 * sum x (exact) is qrow.c's sum (c + 128) x, so float(I) and the +128 s in mn are the same. Accumulators are one
 * vector per W row (lanes: x rows): per element the same chain, acc = fma(float(I_b), dx_mb * s_g, acc), then at
 * a group's end acc = fnma(mn_g, X_mg, acc); products commute bit for bit, so the layout changes no bit.
 *
 * Permission: Linux gives AMX's 8 KB of tile state only after arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
 * (once a process); without it (older kernels, a CPU without AMX) or with RUVLLM_AMX=0 qrow.c does everything.
 */
#define _GNU_SOURCE
#include <cpuid.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "quant.h"

#if Q_AMX_BUILT
#define AMX __attribute__((target("amx-tile,amx-int8")))
#define A_LANES 16 /* W rows a block, x rows a pass */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static _Atomic int amx_state; /* 0: not asked yet, 1: granted, -1: not */

int q_amx_ready(void) {
  int s = atomic_load(&amx_state);
  if (s) return s > 0;
  unsigned a, b, c, d;
  const char *env = getenv("RUVLLM_AMX");
  s = -1;
  if (!(env && env[0] == '0') && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1) &&
      syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0)
    s = 1;
  atomic_store(&amx_state, s);
  return s > 0;
}

typedef struct {
  uint8_t palette, start;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tilecfg_t;

/* Tiles 0-3: C (two halves of 2 sub-blocks), 4-5: A, 6-7: B; mt x rows (C's and B's columns). */
AMX static void configure(int mt) {
  tilecfg_t cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 4; ++t) cfg.rows[t] = A_LANES, cfg.colsb[t] = (uint16_t)(4 * mt);
  for (int t = 4; t < 6; ++t) cfg.rows[t] = A_LANES, cfg.colsb[t] = 32;
  for (int t = 6; t < 8; ++t) cfg.rows[t] = 8, cfg.colsb[t] = (uint16_t)(4 * mt);
  _tile_loadconfig(&cfg);
}

/* x rows m0.. (mt <= 16) for the tiles: xb [nb][8][16] int32 (dword k4 of sub-block b of row m at [b][k4][m], zero
 * for m >= mt), dxt [nb][16] and xgt [ng][16] their scales and X_g by lane, xst [nb][16] 128 sum x (8-bit codes). */
static void lay_x(const qjob_t *j, const qpart_t *a, int64_t m0, int mt, int32_t *xb, float *dxt, float *xgt,
                  int32_t *xst) {
  const qmat_t *w = &a->w;
  const int64_t nb = nb_of(w), ng = w->ng;
  memset(xb, 0, (size_t)(nb * 8 * A_LANES * 4));
  memset(dxt, 0, (size_t)(nb * A_LANES * 4));
  memset(xgt, 0, (size_t)(ng * A_LANES * 4));
  memset(xst, 0, (size_t)(nb * A_LANES * 4));
  for (int m = 0; m < mt; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t *q = j->qx + ((m0 + m) * nb + b) * 32;
      int32_t sum = 0;
      for (int k = 0; k < 32; ++k) sum += q[k];
      for (int k4 = 0; k4 < 8; ++k4) memcpy(xb + (b * 8 + k4) * A_LANES + m, q + 4 * k4, 4);
      dxt[b * A_LANES + m] = j->dx[(m0 + m) * nb + b];
      xst[b * A_LANES + m] = 128 * sum;
    }
  if (a->xg)
    for (int m = 0; m < mt; ++m)
      for (int64_t g = 0; g < ng; ++g) xgt[g * A_LANES + m] = a->xg[(m0 + m) * ng + g];
}

/* 4-bit codes of W rows n..n + 15, sub-blocks b0..b0 + sbs - 1, unpacked to ab [16][128]: sub-block k's 32 columns
 * at bytes 32k.. of each row (low nibbles, then high). */
static inline void unpack4(const qmat_t *w, int64_t n, int64_t b0, int64_t sbs, uint8_t *ab) {
  const int64_t rb = row_bytes(w), pf = q_prefetch_at(rb, A_LANES);
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int r = 0; r < A_LANES; ++r) {
    const uint8_t *p = w->codes + (n + r) * rb + b0 * 16;
    _mm_prefetch((const char *)p + pf, Q_HINT);
    const __m512i v = sbs == 4 ? _mm512_loadu_si512((const void *)p)
                               : _mm512_maskz_loadu_epi8(((__mmask64)1 << (16 * sbs)) - 1, p);
    const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    const __m512i t0 = _mm512_shuffle_i32x4(lo, hi, 0x44), t1 = _mm512_shuffle_i32x4(lo, hi, 0xee); /* lo0 lo1 hi0 hi1 */
    _mm512_store_si512((void *)(ab + r * 128), _mm512_shuffle_i32x4(t0, t0, 0xd8));      /* lo0 hi0 lo1 hi1 */
    _mm512_store_si512((void *)(ab + r * 128 + 64), _mm512_shuffle_i32x4(t1, t1, 0xd8)); /* lo2 hi2 lo3 hi3 */
  }
}

/* Sub-block B (< nb) into tile C (A, B_: the codes' and x's tiles), literal tile numbers. */
#define DOT(C, A, B_, B)                                                                                            \
  if ((B) < nb) {                                                                                                    \
    _tile_zero(C);                                                                                                 \
    _tile_loadd(A, bits4 ? (const void *)(ab + ((B) / 4 & 1) * A_LANES * 128 + 32 * ((B) % 4)) : (const void *)(w->codes + n * rb + (B) * 32), as);  \
    _tile_loadd(B_, xb + (B) * 8 * A_LANES, 64);                                                                   \
    if (bits4) _tile_dpbusd(C, A, B_);                                                                             \
    else _tile_dpbssd(C, A, B_);                                                                                   \
  }
#define STORE(C, B, cb)                                                                                            \
  if ((B) < nb) _tile_stored(C, cb, 64);

/* The float steps of sub-blocks b0.. (sbs of them) from their integers cb [sbs][16 W rows][16 x rows]. */
static inline __attribute__((always_inline)) void floats(const qmat_t *w, int64_t n, int64_t b0, int64_t sbs,
                                                          const int32_t *cb, const float *dxt, const float *xgt,
                                                          const int32_t *xst, const float *mnt, __m512 *acc,
                                                          __mmask16 live) {
  const int64_t ng = w->ng, spg = w->spg;
  const int bits4 = w->bits4, corr = has_mins(w) || !bits4;
  for (int64_t k = 0; k < sbs; ++k) {
    const int64_t bb = b0 + k, g = bb / spg, ends = corr && (bb + 1) % spg == 0;
    const __m512 dx = _mm512_load_ps(dxt + bb * A_LANES), xg = _mm512_load_ps(xgt + g * A_LANES);
    const __m512i xs = _mm512_load_si512((const void *)(xst + bb * A_LANES));
    const int32_t *c = cb + 256 * k;
#pragma GCC unroll 16
    for (int r = 0; r < A_LANES; ++r) {
      __m512i i = _mm512_maskz_load_epi32(live, (const void *)(c + 16 * r));
      if (!bits4) i = _mm512_add_epi32(i, xs);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(dx, _mm512_set1_ps(w->scales[(n + r) * ng + g])),
                               acc[r]);
      if (ends) acc[r] = _mm512_fnmadd_ps(_mm512_set1_ps(mnt[r * ng + g]), xg, acc[r]);
    }
  }
}

/* W rows n..n + 15 against the laid-out x rows m0..m0 + mt - 1: the canonical sum, then y. The tile dots of a step
 * of 4 sub-blocks are issued before the float steps of the one before (its integers stored to the other half of
 * cb), so the float work runs while the tiles compute. */
AMX static void ablock(const qjob_t *j, const qpart_t *a, int64_t n, int64_t m0, int mt, const int32_t *xb,
                       const float *dxt, const float *xgt, const int32_t *xst, uint8_t *ab, int32_t *cbuf,
                       float *mnt) {
  const qmat_t *w = &a->w;
  const int64_t nb = nb_of(w), rb = row_bytes(w), ng = w->ng, as = w->bits4 ? 128 : rb;
  const int bits4 = w->bits4;
  const int64_t pf = q_prefetch_at(rb, A_LANES);
  if (has_mins(w) || !bits4) /* qrow.c's scales_of: (mins, or zp s) + 128 s for 8-bit codes, in the same roundings */
    for (int r = 0; r < A_LANES; ++r)
      for (int64_t g = 0; g < ng; ++g) {
        const float s = w->scales[(n + r) * ng + g];
        float mn = w->mins ? w->mins[(n + r) * ng + g] : w->zp * s;
        if (!bits4) mn = mn + 128.f * s;
        mnt[r * ng + g] = mn;
      }
  __m512 acc[A_LANES];
#pragma GCC unroll 16
  for (int r = 0; r < A_LANES; ++r) acc[r] = _mm512_setzero_ps();
  /* Halves of 2 sub-blocks: half h's dots (C tiles 0-1 or 2-3), half h - 1's integers stored (to slot (h - 1) % 3 of
   * cb), half h - 2's float steps: the tiles compute and store while the vectors work. */
  const int64_t halves = (nb + 1) / 2;
  if (bits4) unpack4(w, n, 0, nb < 4 ? nb : 4, ab);
  for (int64_t h = 0; h < halves + 2; ++h) {
    if (h < halves) {
      const int64_t b = 2 * h;
      if (b % 4 == 0) { /* a step of 4 sub-blocks begins: the next step's codes unpacked now (its slot of ab), so
                         * the stores have left for L1 by the time its tiles load them (a tile load waits for them) */
        const int64_t b4 = b + 4;
        if (bits4 && b4 < nb) unpack4(w, n, b4, nb - b4 < 4 ? nb - b4 : 4, ab + (b4 / 4 & 1) * A_LANES * 128);
        else if (!bits4)
          for (int r = 0; r < A_LANES; ++r) {
            _mm_prefetch((const char *)w->codes + (n + r) * rb + b * 32 + pf, Q_HINT);
            _mm_prefetch((const char *)w->codes + (n + r) * rb + b * 32 + 64 + pf, Q_HINT);
          }
      }
      if (h & 1) { DOT(2, 4, 6, b) DOT(3, 5, 7, b + 1) }
      else { DOT(0, 4, 6, b) DOT(1, 5, 7, b + 1) }
    }
    if (h >= 1 && h - 1 < halves) {
      const int64_t b = 2 * (h - 1);
      int32_t *cb = cbuf + ((h - 1) % 3) * 512;
      if ((h - 1) & 1) { STORE(2, b, cb) STORE(3, b + 1, cb + 256) }
      else { STORE(0, b, cb) STORE(1, b + 1, cb + 256) }
    }
    if (h >= 2) {
      const int64_t b0 = 2 * (h - 2);
      floats(w, n, b0, nb - b0 < 2 ? nb - b0 : 2, cbuf + ((h - 2) % 3) * 512, dxt, xgt, xst, mnt, acc,
             (__mmask16)((1u << mt) - 1u));
    }
  }
  float *v = (float *)cbuf; /* [16 W rows][16 x rows] */
  for (int r = 0; r < A_LANES; ++r) _mm512_store_ps(v + 16 * r, acc[r]);
  for (int m = 0; m < mt; ++m)
    for (int r = 0; r < A_LANES; ++r) put_q(j, a, m0 + m, n + r, v[16 * r + m]);
}

AMX int64_t q_amx_rows(const qjob_t *j, const qpart_t *a, int64_t n0, int64_t n1) {
  const qmat_t *w = &a->w;
  const int64_t M = j->M, nb = nb_of(w), ng = w->ng;
  if (M < Q_AMX_MIN || n1 - n0 < A_LANES || !q_amx_ready()) return 0;
  const int64_t done = M % A_LANES >= Q_AMX_MIN ? M : M - M % A_LANES; /* x rows AMX takes; qrow.c the rest */
  const int64_t xbytes = nb * 8 * A_LANES * 4, vbytes = (2 * nb + 2 * ng) * A_LANES * 4;
  static __thread void *buffer;
  static __thread int64_t size;
  char *buf = pool_scratch(&buffer, &size, 2 * A_LANES * 128 + 2048 * 4 + xbytes + vbytes);
  if (!buf) return 0;
  uint8_t *ab = (uint8_t *)buf;
  int32_t *cb = (int32_t *)(buf + 2 * A_LANES * 128), *xb = cb + 2048, *xst = xb + nb * 8 * A_LANES;
  float *dxt = (float *)(xst + nb * A_LANES), *xgt = dxt + nb * A_LANES, *mnt = xgt + ng * A_LANES;
  for (int64_t m0 = 0; m0 < done; m0 += A_LANES) {
    const int mt = done - m0 < A_LANES ? (int)(done - m0) : A_LANES;
    configure(mt);
    lay_x(j, a, m0, mt, xb, dxt, xgt, xst);
    for (int64_t n = n0; n + A_LANES <= n1; n += A_LANES) ablock(j, a, n, m0, mt, xb, dxt, xgt, xst, ab, cb, mnt);
  }
  _tile_release();
  return done;
}

/* Switch AMX off (0) or back on where granted (1), e.g. for an A/B in one process; returns whether it is on. */
int rk_amx(int on) {
  atomic_store(&amx_state, 0);
  if (!on) atomic_store(&amx_state, -1);
  return q_amx_ready();
}
#else
int rk_amx(int on) {
  (void)on;
  return 0;
}
#endif
