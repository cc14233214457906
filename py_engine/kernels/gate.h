/* gate.c: gated = silu(y[:, :N]) * y[:, N:] for y [M, 2N], fp32 or bf16, rows split over pool.h's threads. */
#pragma once

#include <stdint.h>

/* gated [M, N], its rows ldo values apart. */
void rk_gate_rows(const void *y, void *gated, int bf16, int64_t M, int64_t N, int64_t ldo);
/* gated [M, N] contiguous; -1 for an empty shape. */
int rk_gate(const void *y, void *gated, int bf16, int64_t M, int64_t N);
