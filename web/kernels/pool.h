/* A thread pool over wasm threads: the page starts T-1 workers, each an instance of this module on the same
 * shared memory, which call rk_worker(id) and never return. rk_parallel(fn, arg, n) runs fn(arg, c) for every
 * chunk c < n on whichever thread takes it first (the caller too), and returns when all n are done: a thread
 * the OS has not scheduled just takes no chunks, so a busy machine slows a step rather than stalling it on
 * one thread. Workers spin a while between jobs (a decode step is ~150 short jobs; waking a sleeping worker
 * costs tens of microseconds) and then sleep on a futex. The caller spins for the last chunks; where it may
 * block (rk_set_caller_waits: a Worker, Node; a page's main thread may not) it sleeps after about a chunk's
 * time, so a worker the OS preempted mid-chunk gets the core back. One caller at a time. */
#ifndef RKW_POOL_H
#define RKW_POOL_H
#include <stdint.h>

typedef void (*job_fn)(void *arg, int32_t chunk);
void rk_parallel(job_fn fn, void *arg, int32_t chunks);
int32_t rk_threads(void);
#endif
