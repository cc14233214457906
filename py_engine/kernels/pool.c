/* The barrier-free pool of pool.h. Linux only (futex). */
#define _GNU_SOURCE
#include "pool.h"

#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define SPIN_NS 30000   /* an idle worker spins this long, then yields its core... */
#define IDLE_NS 1000000 /* ...until this long, then sleeps (a decode step's calls come ~0.1 ms apart) */

typedef struct {
  pool_chunk_fn fn;
  int64_t n_chunks;
  _Alignas(16) unsigned char context[POOL_MAX_CONTEXT];
} job_t;

/* Two job slots: while a late worker may still read generation g's slot, the
 * caller fills the other one for g + 1. A slot is reused only at g + 2, after
 * every chunk of g + 1 was claimed, so such a worker's claim (a CAS on a state
 * that still says g) fails, and it never runs a chunk with a stale slot. */
static job_t jobs[2];
static _Atomic uint64_t state;    /* generation << 32 | next unclaimed chunk */
static _Atomic uint32_t gen_word; /* the generation again, 32 bits for futex */
static _Atomic int64_t done;      /* chunks finished in the current generation */
static _Atomic int sleepers, quitting;
static uint32_t generation;
static int n_workers;
static pthread_t workers[POOL_MAX_THREADS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Claim and run chunks of generation g until none is left. */
static void work(uint32_t g) {
  const job_t *j = &jobs[g & 1];
  for (;;) {
    uint64_t s = atomic_load(&state);
    if ((uint32_t)(s >> 32) != g || (int64_t)(uint32_t)s >= j->n_chunks) return;
    if (!atomic_compare_exchange_weak(&state, &s, s + 1)) continue;
    j->fn(j->context, (int64_t)(uint32_t)s);
    atomic_fetch_add(&done, 1);
  }
}

/* Waiting for work yields rather than spins after a moment: when the worker
 * shares a core with the caller, spinning keeps the caller (about to post the
 * next job) off it. Sleeping sooner is worse: each job then pays a futex wake,
 * measured at ~0.4 ms on a busy machine (the woken worker preempts the caller). */
static void *worker_main(void *arg) {
  (void)arg;
  uint32_t seen = atomic_load(&gen_word), g;
  for (;;) {
    int64_t idle_since = now_ns(), idle = 0;
    for (int spins = 0; (g = atomic_load(&gen_word)) == seen && !atomic_load(&quitting); ++spins) {
      if (spins % 16 == 0) idle = now_ns() - idle_since; /* a vDSO call, ~20 ns */
      if (idle < SPIN_NS) {
        _mm_pause();
      } else if (idle < IDLE_NS) {
        sched_yield();
      } else {
        /* Dekker with the caller: it bumps gen_word then reads sleepers; we bump
         * sleepers then re-read gen_word (inside FUTEX_WAIT), so no wake is lost. */
        atomic_fetch_add(&sleepers, 1);
        syscall(SYS_futex, &gen_word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
        atomic_fetch_sub(&sleepers, 1);
        idle_since = now_ns();
        idle = 0;
      }
    }
    if (atomic_load(&quitting)) return NULL;
    seen = g;
    work(g);
  }
}

static void stop_workers(void) {
  atomic_store(&quitting, 1);
  generation = atomic_fetch_add(&gen_word, 1) + 1; /* so the next job's generation is new to fresh workers */
  syscall(SYS_futex, &gen_word, FUTEX_WAKE_PRIVATE, POOL_MAX_THREADS, NULL, NULL, 0);
  for (int i = 0; i < n_workers; ++i) pthread_join(workers[i], NULL);
  n_workers = 0;
  atomic_store(&quitting, 0);
}

int pool_set_threads(int n) {
  pthread_mutex_lock(&lock);
  int want = (n < 1 ? 1 : n > POOL_MAX_THREADS ? POOL_MAX_THREADS : n) - 1;
  if (want != n_workers) {
    stop_workers();
    for (int i = 0; i < want; ++i)
      if (pthread_create(&workers[i], NULL, worker_main, NULL) == 0) n_workers++;
  }
  pthread_mutex_unlock(&lock);
  return n_workers + 1;
}

int pool_threads(void) { return n_workers + 1; }

void pool_run(int64_t n_chunks, pool_chunk_fn fn, const void *context, int context_size) {
  pthread_mutex_lock(&lock);
  uint32_t g = ++generation;
  job_t *j = &jobs[g & 1];
  j->fn = fn;
  j->n_chunks = n_chunks;
  memcpy(j->context, context, (size_t)context_size);
  atomic_store(&done, 0);
  atomic_store(&state, (uint64_t)g << 32); /* publishes the slot (seq_cst) */
  atomic_store(&gen_word, g);
  if (atomic_load(&sleepers)) syscall(SYS_futex, &gen_word, FUTEX_WAKE_PRIVATE, POOL_MAX_THREADS, NULL, NULL, 0);
  work(g);
  /* Only chunks a worker claimed and is still running remain: yield soon, in
   * case that worker is waiting for this core. */
  for (int spins = 0; atomic_load(&done) < n_chunks; ++spins) {
    if (spins < 200) _mm_pause();
    else sched_yield();
  }
  pthread_mutex_unlock(&lock);
}

/* Whether this CPU (cpuid, and the OS's saved registers, as libgcc checks them) has every
 * instruction set this build was compiled for: kernels/__init__.py refuses a variant that says no. */
int rk_variant_supported(void) {
  __builtin_cpu_init();
  int ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#ifdef __AVX512F__
  ok = ok && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#endif
#ifdef __F16C__
  ok = ok && __builtin_cpu_supports("f16c");
#endif
#ifdef __AVX512VNNI__
  ok = ok && __builtin_cpu_supports("avx512vnni");
#endif
#ifdef __AVX512BF16__
  ok = ok && __builtin_cpu_supports("avx512bf16");
#endif
  return ok;
}
