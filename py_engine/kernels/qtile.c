/* The virtual panels of 4-bit and 8-bit codes (qtile.h): decode, batches and short prompt chunks. */
#include "qtile.h"

/* Rows n..n + live - 1 of W (live <= VT_ROWS) against rows m0..m0 + mt - 1 of x (mt <= VT_X). */
static inline __attribute__((always_inline)) void vblock(const qjob_t *j, const qpart_t *a, int64_t n, int live,
                                                          int64_t m0, const int mt, const int bits4) {
  const qmat_t *w = &a->w;
  const int64_t nb = nb_of(w), rb = row_bytes(w), ng = w->ng, xrow = nb * 32;
  const int corr = has_mins(w) || !bits4;
  const uint8_t *row[VT_ROWS];
  for (int L = 0; L < VT_ROWS; ++L) row[L] = w->codes + (n + (L < live ? L : live - 1)) * rb;
  const vi groups = vi_rows(ng, live); /* lane L: PERM(L)'s first scale, relative to row n's */
  const int64_t pf = q_prefetch_at(rb, VT_ROWS);
  const float *s0 = w->scales + n * ng, *m0s = w->mins ? w->mins + n * ng : NULL;
  vf acc[VT_X];
  for (int m = 0; m < mt; ++m) acc[m] = vf_zero();
  for (int64_t g = 0, b = 0; g < ng; ++g) {
    const vi at = vi_add(groups, (int32_t)g);
    const vf s = vf_gather(s0, at);
    for (int64_t e = b + w->spg; b < e; ++b) {
      if (!(b & (bits4 ? 3 : 1))) /* a line of each row, one block of rows ahead (q_prefetch_at) */
        for (int L = 0; L < live; ++L) _mm_prefetch((const char *)row[L] + b * (bits4 ? 16 : 32) + pf, Q_HINT);
      vi c[8];
      codes_of(row, b, bits4, c);
      for (int m = 0; m < mt; ++m) {
        const int8_t *q = j->qx + (m0 + m) * xrow + b * 32;
        acc[m] = vf_fold(acc[m], dot_block(c, q, bits4), vf_set1(j->dx[(m0 + m) * nb + b]), s);
      }
    }
    if (corr) { /* mn = (mins, or zp s) + 128 s for 8-bit codes: qpanel.c's pack() in the same roundings */
      vf mn = m0s ? vf_gather(m0s, at) : vf_mul(vf_set1(w->zp), s);
      if (!bits4) mn = vf_add(mn, vf_mul(vf_set1(128.f), s));
      for (int m = 0; m < mt; ++m) acc[m] = vf_mins(acc[m], mn, vf_set1(a->xg[(m0 + m) * ng + g]));
    }
  }
  store_tile(j, a, n, live, m0, mt, acc);
}

void q_tiles(const qjob_t *j, const qpart_t *a, int64_t n0, int64_t n1) {
  _Static_assert(VT_X == 4, "TILE_CASES spells out 1..3 and VT_X");
#if Q_ROWS_BUILT
  if (j->M <= Q_ROWS_MAX && q_rows(j, a, n0, n1) == 0) return; /* qrow.c: the same bits, no codes turned */
#endif
  FOR_TILES(if (a->w.bits4) { TILE_CASES(vblock, 1) } else { TILE_CASES(vblock, 0) })
}
