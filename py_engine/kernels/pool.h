/* A thread pool without barriers, for memory-bound kernels on shared machines.
 *
 * OpenMP ends each parallel region with a barrier. On a busy machine the
 * second thread is often descheduled, and the barrier then waits for a
 * scheduler slice: a 4 MB GEMV measured p90 ~20 ms with 2 OpenMP threads
 * against 0.1 ms with one. Here a job is cut into chunks that threads claim
 * with a CAS; the caller claims chunks too and then waits only for chunks a
 * worker has claimed and not finished. A worker that wakes up late finds
 * nothing left. Jobs run one at a time (a mutex), from any thread.
 */
#pragma once
#include <stdint.h>
#include <stdlib.h>

#define POOL_MAX_THREADS 64
#define POOL_MAX_CONTEXT 1024 /* bytes of job context the pool copies */

typedef void (*pool_chunk_fn)(const void *context, int64_t chunk);

/* Use n threads in all: the caller plus n - 1 workers. Returns the count in effect. */
int pool_set_threads(int n);

/* The count in effect. */
int pool_threads(void);

/* Run fn(context, c) for every c in [0, n_chunks) and return when all are done.
 * The context (at most POOL_MAX_CONTEXT bytes) is copied: a worker that reads it
 * late never sees the next job's. */
void pool_run(int64_t n_chunks, pool_chunk_fn fn, const void *context, int context_size);

/* A thread's own scratch: *buffer grown (64-byte aligned, old contents dropped) to hold at least `bytes`; NULL when
 * the allocation fails. Each caller keeps its buffer and size in `static __thread` variables. */
static inline void *pool_scratch(void **buffer, int64_t *size, int64_t bytes) {
  if (*size < bytes) {
    free(*buffer);
    *buffer = aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64));
    *size = *buffer ? bytes : 0;
  }
  return *buffer;
}
