/* The pool of pool.h. Job e hands out its chunks through one atomic ticket, (e << 20) | next chunk, taken by
 * compare-and-swap: a thread that woke for an older job finds another epoch in the ticket and takes nothing,
 * so no chunk runs twice and none is lost, however late a thread comes. */
#include "pool.h"

#define SPINS (1 << 16)
#define CHUNK_BITS 20
#define EPOCHS (1 << (32 - CHUNK_BITS - 1))

static int32_t n_threads = 1;
static int32_t generation = 0, sleepers = 0, started = 0;
static uint32_t ticket = 0;
static int32_t done_chunks = 0;
static struct { job_fn fn; void *arg; int32_t chunks; } jobs[2]; /* by epoch parity */

int32_t rk_threads(void) { return n_threads; }
void rk_set_threads(int32_t t) { n_threads = t < 1 ? 1 : t; }
int32_t rk_workers_started(void) { return __atomic_load_n(&started, __ATOMIC_ACQUIRE); }

/* take chunks of job `epoch` until none is left (or another job has begun) */
static void take_chunks(uint32_t epoch) {
  const int32_t chunks = jobs[epoch & 1].chunks;
  const job_fn fn = jobs[epoch & 1].fn;
  void *arg = jobs[epoch & 1].arg;
  for (;;) {
    uint32_t t = __atomic_load_n(&ticket, __ATOMIC_ACQUIRE);
    for (;;) {
      if (t >> CHUNK_BITS != epoch || (int32_t)(t & ((1u << CHUNK_BITS) - 1)) >= chunks) return;
      if (__atomic_compare_exchange_n(&ticket, &t, t + 1, 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) break;
    }
    fn(arg, (int32_t)(t & ((1u << CHUNK_BITS) - 1)));
    __atomic_fetch_add(&done_chunks, 1, __ATOMIC_ACQ_REL);
  }
}

void rk_worker(int32_t id) {
  (void)id;
  int32_t seen = __atomic_load_n(&generation, __ATOMIC_ACQUIRE);
  __atomic_fetch_add(&started, 1, __ATOMIC_ACQ_REL);
  for (;;) {
    int32_t spins = 0;
    while (__atomic_load_n(&generation, __ATOMIC_ACQUIRE) == seen) {
      if (++spins < SPINS) continue;
      __atomic_fetch_add(&sleepers, 1, __ATOMIC_ACQ_REL);
      __builtin_wasm_memory_atomic_wait32(&generation, seen, -1); /* returns at once if it moved on */
      __atomic_fetch_sub(&sleepers, 1, __ATOMIC_ACQ_REL);
      spins = 0;
    }
    seen = __atomic_load_n(&generation, __ATOMIC_ACQUIRE);
    take_chunks((uint32_t)seen % EPOCHS);
  }
}

void rk_parallel(job_fn fn, void *arg, int32_t chunks) {
  if (n_threads == 1 || chunks == 1) {
    for (int32_t c = 0; c < chunks; c++) fn(arg, c);
    return;
  }
  /* every chunk of the last job is done, so its slot (the other parity) is free to overwrite next time */
  const int32_t gen = generation + 1;
  const uint32_t epoch = (uint32_t)gen % EPOCHS;
  jobs[epoch & 1].fn = fn;
  jobs[epoch & 1].arg = arg;
  jobs[epoch & 1].chunks = chunks;
  __atomic_store_n(&done_chunks, 0, __ATOMIC_RELEASE);
  __atomic_store_n(&ticket, epoch << CHUNK_BITS, __ATOMIC_RELEASE);
  __atomic_store_n(&generation, gen, __ATOMIC_RELEASE);
  if (__atomic_load_n(&sleepers, __ATOMIC_ACQUIRE)) __builtin_wasm_memory_atomic_notify(&generation, n_threads);
  take_chunks(epoch);
  while (__atomic_load_n(&done_chunks, __ATOMIC_ACQUIRE) < chunks) {
  }
}
