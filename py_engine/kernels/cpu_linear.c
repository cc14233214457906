/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) for a few rows M: the decode-time GEMV.
 *
 * Why this exists (measured on a 2-core AVX2 EPYC, see benchmarks/README.md):
 * - torch's bf16 matmul has no fast path without AVX-512 BF16: a [1, 896] x
 *   [4864, 896] product takes ~15-25 ms, 20x the fp32 one. Here bf16 weights
 *   are widened to fp32 in registers (a 16-bit shift) and fed to FMA, so bf16
 *   reads half the bytes of fp32 and decode stays memory-bound.
 * - OpenMP ends each parallel region with a barrier. On a shared machine the
 *   second thread is often descheduled, and the barrier then waits for a
 *   scheduler slice (p90 ~20 ms for a 4 MB GEMV vs 0.1 ms single-threaded).
 *   This pool has no barrier: rows are cut into chunks that threads claim
 *   with a CAS, and the caller waits only for chunks someone has claimed; a
 *   worker that wakes up late finds nothing left and goes back to sleep.
 *
 * Arithmetic: fp32 accumulation; a bf16 output is rounded once, after the
 * bias is added (what torch's bf16 addmm does). x may be bf16 or fp32.
 * Requires K % 8 == 0 and M <= RK_MAX_M; the Python side checks both.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define RK_MAX_M 8
#define RK_MAX_THREADS 64
#define SPIN_NS 30000           /* an idle worker spins this long, then yields its core... */
#define IDLE_NS 1000000         /* ...until this long, then sleeps (a decode step's calls come ~0.1 ms apart) */
#define CHUNK_BYTES 32768       /* weight bytes per claimed chunk: small enough to balance */

typedef struct {
  const void *x, *w, *bias;
  void *y;
  int x_bf16, w_bf16, bias_bf16, y_bf16;
  int64_t M, N, K, rows_per_chunk, n_chunks;
  const float *xf; /* x widened to fp32, [M, K] */
} job_t;

/* Two job slots: while a late worker may still read generation g's slot, the
 * caller fills the other one for g + 1 (a slot is reused only at g + 2, after
 * every chunk of g + 1 has been claimed, so such a worker's CAS then fails). */
static job_t jobs[2];
static _Atomic uint64_t state;   /* generation << 32 | next unclaimed chunk */
static _Atomic uint32_t gen_word; /* the generation again, 32 bits for futex */
static _Atomic int64_t done;      /* chunks finished in the current generation */
static _Atomic int sleepers, quitting;
static uint32_t generation;
static int n_workers;
static pthread_t workers[RK_MAX_THREADS];
static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;
static float *xbuf;
static int64_t xbuf_len;

static inline __m256 load_bf16(const uint16_t *p) { /* 8 bf16 -> 8 fp32: a bf16 is an fp32's top half */
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline __m256 load_w(const void *w, int bf16, int64_t i) {
  return bf16 ? load_bf16((const uint16_t *)w + i) : _mm256_loadu_ps((const float *)w + i);
}
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as c10::BFloat16 does */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static void store(const job_t *j, int64_t m, int64_t n, float acc) {
  if (j->bias) acc += j->bias_bf16 ? bf16_to_f32(((const uint16_t *)j->bias)[n]) : ((const float *)j->bias)[n];
  if (j->y_bf16) ((uint16_t *)j->y)[m * j->N + n] = f32_to_bf16(acc);
  else ((float *)j->y)[m * j->N + n] = acc;
}

static void run_chunk(const job_t *j, int64_t c) {
  int64_t n0 = c * j->rows_per_chunk, n1 = n0 + j->rows_per_chunk, K = j->K;
  if (n1 > j->N) n1 = j->N;
  const int bf = j->w_bf16;
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t row = n * K;
    if (j->M == 1) { /* four accumulators hide the FMA latency */
      const float *x = j->xf;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      int64_t k = 0;
      for (; k + 32 <= K; k += 32) {
        a0 = _mm256_fmadd_ps(load_w(j->w, bf, row + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(load_w(j->w, bf, row + k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(load_w(j->w, bf, row + k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(load_w(j->w, bf, row + k + 24), _mm256_loadu_ps(x + k + 24), a3);
      }
      for (; k < K; k += 8) a0 = _mm256_fmadd_ps(load_w(j->w, bf, row + k), _mm256_loadu_ps(x + k), a0);
      store(j, 0, n, hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))));
      continue;
    }
    __m256 acc[RK_MAX_M]; /* one accumulator per input row: each weight vector is loaded once */
    for (int64_t m = 0; m < j->M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      __m256 wv = load_w(j->w, bf, row + k);
      for (int64_t m = 0; m < j->M; ++m) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(j->xf + m * K + k), acc[m]);
    }
    for (int64_t m = 0; m < j->M; ++m) store(j, m, n, hsum(acc[m]));
  }
}

/* Claim and run chunks of generation g until none is left. */
static void work(uint32_t g) {
  const job_t *j = &jobs[g & 1];
  for (;;) {
    uint64_t s = atomic_load(&state);
    if ((uint32_t)(s >> 32) != g || (int64_t)(uint32_t)s >= j->n_chunks) return;
    if (!atomic_compare_exchange_weak(&state, &s, s + 1)) continue;
    run_chunk(j, (int64_t)(uint32_t)s);
    atomic_fetch_add(&done, 1);
  }
}

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Waiting for work. Yielding instead of spinning matters on a busy machine:
 * when the worker shares a core with the caller, a spinning worker keeps the
 * caller (who is about to post the next job) off the core. And an idle worker
 * that sleeps costs the caller a futex wake per job, which was measured at
 * ~0.4 ms there: the woken worker preempts the caller on its own core. */
static void *worker_main(void *arg) {
  (void)arg;
  uint32_t seen = atomic_load(&gen_word);
  for (;;) {
    uint32_t g;
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
  syscall(SYS_futex, &gen_word, FUTEX_WAKE_PRIVATE, RK_MAX_THREADS, NULL, NULL, 0);
  for (int i = 0; i < n_workers; ++i) pthread_join(workers[i], NULL);
  n_workers = 0;
  atomic_store(&quitting, 0);
}

/* Use n_threads threads in all (the caller plus n_threads - 1 workers). */
int rk_set_threads(int n_threads) {
  pthread_mutex_lock(&call_lock);
  int want = n_threads < 1 ? 0 : (n_threads > RK_MAX_THREADS ? RK_MAX_THREADS : n_threads) - 1;
  if (want != n_workers) {
    stop_workers();
    for (int i = 0; i < want; ++i)
      if (pthread_create(&workers[i], NULL, worker_main, NULL) == 0) n_workers++;
  }
  pthread_mutex_unlock(&call_lock);
  return n_workers + 1;
}

int rk_linear(const void *x, int x_bf16, const void *w, int w_bf16, const void *bias, int bias_bf16,
              void *y, int y_bf16, int64_t M, int64_t N, int64_t K) {
  if (M < 1 || M > RK_MAX_M || K % 8 || N < 1) return -1;
  pthread_mutex_lock(&call_lock); /* one job at a time: the pool has one queue */
  if (xbuf_len < M * K) {
    free(xbuf);
    xbuf = aligned_alloc(32, (size_t)((M * K * 4 + 31) / 32 * 32));
    xbuf_len = xbuf ? M * K : 0;
    if (!xbuf) {
      pthread_mutex_unlock(&call_lock);
      return -2;
    }
  }
  for (int64_t i = 0; i < M * K; ++i)
    xbuf[i] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
  uint32_t g = ++generation;
  job_t *j = &jobs[g & 1];
  int64_t row_bytes = K * (w_bf16 ? 2 : 4), rows = CHUNK_BYTES / row_bytes;
  *j = (job_t){x, w, bias, y, x_bf16, w_bf16, bias_bf16, y_bf16, M, N, K, rows < 1 ? 1 : rows, 0, xbuf};
  j->n_chunks = (N + j->rows_per_chunk - 1) / j->rows_per_chunk;
  atomic_store(&done, 0);
  atomic_store(&state, (uint64_t)g << 32);
  atomic_store(&gen_word, g);
  if (atomic_load(&sleepers)) syscall(SYS_futex, &gen_word, FUTEX_WAKE_PRIVATE, RK_MAX_THREADS, NULL, NULL, 0);
  work(g);
  /* Only chunks a worker claimed and is still running remain; yield soon, in
   * case that worker is waiting for this core. */
  for (int spins = 0; atomic_load(&done) < j->n_chunks; ++spins) {
    if (spins < 200) _mm_pause();
    else sched_yield();
  }
  pthread_mutex_unlock(&call_lock);
  return 0;
}
