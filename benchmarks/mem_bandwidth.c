/* Streaming-read bandwidth of this machine: the ceiling of a memory-bound decode step.
 *
 *   mem_bandwidth MB THREADS REPS
 *
 * Reads a buffer of MB megabytes (mmap'd, 2 MiB aligned) on THREADS threads and prints one line per case:
 *   split width prefetch pages gb_s_best gb_s_median gb_s_cpu huge_kb
 * Cases: how the buffer is split (two contiguous halves, or 512 KiB chunks claimed from a shared counter as
 * py_engine/kernels/pool.c does), the load width (256 or 512 bits), software prefetch ahead (0 = none), and
 * whether the pages are 4 KiB (MADV_NOHUGEPAGE) or 2 MiB (MADV_HUGEPAGE; huge_kb says how much the kernel
 * actually backed with huge pages, from /proc/self/smaps). gb_s_cpu is the median over the process's CPU time
 * times THREADS: what the threads stream while they run, which a shared machine's time slicing does not hide. The two buffers alternate within each case, so a
 * shared machine's swings hit both alike. Built and run by mem_bandwidth.py.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define CHUNK (512 * 1024)
#define MAX_THREADS 16

typedef struct {
  const char *buf;
  size_t bytes;
  int threads, split_chunks, wide, prefetch;
} case_t;

static case_t cur;
static pthread_barrier_t start_bar, end_bar;
static _Atomic int64_t next_chunk;
static volatile float sink;
static int quitting;

static double clock_s(clockid_t id) {
  struct timespec t;
  clock_gettime(id, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Sum of floats in [p, p + n): 8 accumulators so the adds never limit the loads. */
static float read_range(const char *p, size_t n, int wide, int prefetch) {
  const float *f = (const float *)p;
  const size_t count = n / 4;
#ifdef __AVX512F__
  if (wide) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < count; i += 64) {
      if (prefetch) _mm_prefetch((const char *)(f + i) + prefetch, _MM_HINT_T0);
      a0 = _mm512_add_ps(a0, _mm512_load_ps(f + i));
      a1 = _mm512_add_ps(a1, _mm512_load_ps(f + i + 16));
      a2 = _mm512_add_ps(a2, _mm512_load_ps(f + i + 32));
      a3 = _mm512_add_ps(a3, _mm512_load_ps(f + i + 48));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  }
#endif
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (size_t i = 0; i < count; i += 64) {
    if (prefetch) _mm_prefetch((const char *)(f + i) + prefetch, _MM_HINT_T0);
    a0 = _mm256_add_ps(a0, _mm256_load_ps(f + i));
    a1 = _mm256_add_ps(a1, _mm256_load_ps(f + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_load_ps(f + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_load_ps(f + i + 24));
    a4 = _mm256_add_ps(a4, _mm256_load_ps(f + i + 32));
    a5 = _mm256_add_ps(a5, _mm256_load_ps(f + i + 40));
    a6 = _mm256_add_ps(a6, _mm256_load_ps(f + i + 48));
    a7 = _mm256_add_ps(a7, _mm256_load_ps(f + i + 56));
  }
  __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                           _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
  float out[8];
  _mm256_storeu_ps(out, s);
  return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}

static void run_share(int id) {
  float acc = 0;
  if (cur.split_chunks) {
    const int64_t n = (int64_t)(cur.bytes / CHUNK);
    for (int64_t c; (c = atomic_fetch_add(&next_chunk, 1)) < n;)
      acc += read_range(cur.buf + c * CHUNK, CHUNK, cur.wide, cur.prefetch);
  } else {
    const size_t share = cur.bytes / cur.threads / 4096 * 4096;
    acc += read_range(cur.buf + id * share, share, cur.wide, cur.prefetch);
  }
  sink += acc;
}

static void *worker(void *arg) {
  const int id = (int)(intptr_t)arg;
  for (;;) {
    pthread_barrier_wait(&start_bar);
    if (quitting) return NULL;
    run_share(id);
    pthread_barrier_wait(&end_bar);
  }
}

static long huge_kb(const void *p) { /* AnonHugePages of the mapping that holds p */
  FILE *f = fopen("/proc/self/smaps", "r");
  if (!f) return -1;
  char line[512];
  int inside = 0;
  long kb = -1;
  while (fgets(line, sizeof line, f)) {
    unsigned long lo, hi;
    if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') < strchr(line, ' ')) {
      inside = (uintptr_t)p >= lo && (uintptr_t)p < hi;
    } else if (inside && sscanf(line, "AnonHugePages: %ld kB", &kb) == 1) {
      break;
    }
  }
  fclose(f);
  return kb;
}

static int cmp(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
  const size_t mb = argc > 1 ? strtoul(argv[1], NULL, 10) : 1024;
  const int threads = argc > 2 ? atoi(argv[2]) : 2, reps = argc > 3 ? atoi(argv[3]) : 5;
  if (mb < 16 || mb > 65536 || threads < 1 || threads > MAX_THREADS || reps < 1 || reps > 100) {
    fprintf(stderr, "usage: mem_bandwidth MB(16-65536) THREADS(1-%d) REPS(1-100)\n", MAX_THREADS);
    return 2;
  }
  const size_t bytes = mb << 20, align = 2u << 20;
  pthread_barrier_init(&start_bar, NULL, (unsigned)threads);
  pthread_barrier_init(&end_bar, NULL, (unsigned)threads);
  pthread_t tid[MAX_THREADS];
  for (int t = 1; t < threads; ++t) pthread_create(&tid[t], NULL, worker, (void *)(intptr_t)t);
  char *raw[2], *buf[2];
  long hkb[2];
  for (int huge = 0; huge < 2; ++huge) { /* both buffers first: every case alternates between them */
    raw[huge] = mmap(NULL, bytes + align, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw[huge] == MAP_FAILED) {
      perror("mmap");
      return 1;
    }
    buf[huge] = (char *)(((uintptr_t)raw[huge] + align - 1) & ~(uintptr_t)(align - 1));
    madvise(buf[huge], bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    for (size_t i = 0; i < bytes / 4; ++i) ((float *)buf[huge])[i] = (float)(i & 1023) * 1e-3f;
    hkb[huge] = huge_kb(buf[huge]);
  }
  static const struct { int split_chunks, wide, prefetch; } cases[] = {
      {0, 0, 0}, {0, 1, 0}, {1, 0, 0}, {1, 1, 0}, {1, 0, 512}, {1, 0, 2048}, {1, 1, 512}, {1, 1, 2048}};
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ++ci) {
    double gbs[2][100], cpu[2][100];
    for (int r = 0; r < reps; ++r)
      for (int huge = 0; huge < 2; ++huge) {
        cur = (case_t){buf[huge], bytes, threads, cases[ci].split_chunks, cases[ci].wide, cases[ci].prefetch};
        atomic_store(&next_chunk, 0);
        const double t0 = clock_s(CLOCK_MONOTONIC), c0 = clock_s(CLOCK_PROCESS_CPUTIME_ID);
        pthread_barrier_wait(&start_bar);
        run_share(0);
        pthread_barrier_wait(&end_bar);
        gbs[huge][r] = bytes / (clock_s(CLOCK_MONOTONIC) - t0) / 1e9;
        cpu[huge][r] = bytes * (double)threads / (clock_s(CLOCK_PROCESS_CPUTIME_ID) - c0) / 1e9;
      }
    for (int huge = 0; huge < 2; ++huge) {
      qsort(gbs[huge], (size_t)reps, sizeof gbs[huge][0], cmp);
      qsort(cpu[huge], (size_t)reps, sizeof cpu[huge][0], cmp);
      printf("%s %d %d %s %.2f %.2f %.2f %ld\n", cases[ci].split_chunks ? "chunks" : "halves", cases[ci].wide ? 512 : 256,
             cases[ci].prefetch, huge ? "2M" : "4K", gbs[huge][reps - 1], gbs[huge][reps / 2], cpu[huge][reps / 2],
             hkb[huge]);
    }
    fflush(stdout);
  }
  for (int huge = 0; huge < 2; ++huge) munmap(raw[huge], bytes + align);
  quitting = 1;
  pthread_barrier_wait(&start_bar);
  for (int t = 1; t < threads; ++t) pthread_join(tid[t], NULL);
  return (int)(sink == 12345.f);
}
