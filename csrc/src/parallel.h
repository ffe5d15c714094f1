/* parallel.h - a small parallel-for over index ranges (private). */
#ifndef AXL_PARALLEL_H
#define AXL_PARALLEL_H

#include <stdint.h>

/* Work on the half-open index range [begin, end). Must not fail: checks come first. */
typedef void (*axl_range_fn)(void *ctx, int64_t begin, int64_t end);

/* Calls fn over [0, n) split into contiguous ranges, one per thread, the first on the
 * calling thread. Uses at most nthreads threads (>= 1; clamped to AXL_MAX_THREADS) and at
 * most one per min_per_thread indices, so small n never leaves the calling thread. Range
 * starts are multiples of 64 indices, keeping each thread's output off its neighbours'
 * cache lines. Threads are created and joined per call: no pool, no global state.
 * Returns AXL_OK, or AXL_ERR_RESOURCE if a thread could not be created; then the threads
 * already running are joined and the remaining ranges are left undone. */
int axl_parallel_for(int64_t n, int nthreads, int64_t min_per_thread, axl_range_fn fn,
                     void *ctx);

#endif /* AXL_PARALLEL_H */
