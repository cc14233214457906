/* The pool of pool.h. Job e hands out its chunks through one atomic ticket, (e << 20) | next chunk, taken by
 * compare-and-swap: a thread that woke for an older job finds another epoch in the ticket and takes nothing,
 * so no chunk runs twice and none is lost, however late a thread comes. */
#include "pool.h"

#define SPINS (1 << 16)
#define CALLER_SPINS (1 << 13) /* ~10-20 us: a chunk's work (a running straggler ends within that) */
#define CHUNK_BITS 20
#define EPOCHS (1 << (32 - CHUNK_BITS - 1))

/* Each word the threads write while others read it sits in its own cache line: the ticket (taken per chunk), the
 * count of chunks done (added to per chunk, read by the waiting caller) and the generation (read by spinning
 * workers) would otherwise move one line between the cores at every chunk. */
#define LINE __attribute__((aligned(64)))
static int32_t n_threads = 1, caller_waits = 0; /* may the caller sleep (not a page's main thread) */
static LINE int32_t generation = 0;
static LINE int32_t sleepers = 0, started = 0;
static LINE uint32_t ticket = 0;
static LINE int32_t done_chunks = 0;
static LINE int32_t caller_asleep = 0; /* the caller sleeps on done_chunks */
static LINE struct { job_fn fn; void *arg; int32_t chunks; } jobs[2]; /* by epoch parity */

int32_t rk_threads(void) { return n_threads; }
void rk_set_threads(int32_t t) { n_threads = t < 1 ? 1 : t; }
int32_t rk_workers_started(void) { return __atomic_load_n(&started, __ATOMIC_ACQUIRE); }
/* 1: rk_parallel's caller may sleep on a futex while other threads finish their chunks (a Web Worker, Node);
 * a page's main thread may not block, so it spins (0, the default) */
void rk_set_caller_waits(int32_t on) { caller_waits = on != 0; }

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
    if (__atomic_add_fetch(&done_chunks, 1, __ATOMIC_SEQ_CST) == chunks && __atomic_load_n(&caller_asleep, __ATOMIC_SEQ_CST))
      __builtin_wasm_memory_atomic_notify(&done_chunks, 1);
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

/* Until every chunk is done. The caller spins a chunk's time; past that a thread holding a chunk is likely
 * preempted (a busy machine: more runnable threads than cores), and a spinning caller would keep the core it
 * needs, so the caller sleeps (where it may) and the last chunk's thread wakes it. seq_cst on both flags: either
 * the finisher sees caller_asleep, or the caller sees the final count before it sleeps. */
static void wait_done(int32_t chunks) {
  int32_t spins = 0;
  for (;;) {
    const int32_t d = __atomic_load_n(&done_chunks, __ATOMIC_SEQ_CST);
    if (d >= chunks) return;
    if (!caller_waits || ++spins < CALLER_SPINS) continue;
    __atomic_store_n(&caller_asleep, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&done_chunks, __ATOMIC_SEQ_CST) == d)
      __builtin_wasm_memory_atomic_wait32(&done_chunks, d, 1000000); /* 1 ms at most: a lost wake costs that */
    __atomic_store_n(&caller_asleep, 0, __ATOMIC_SEQ_CST);
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
  wait_done(chunks);
}
