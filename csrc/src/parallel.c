/* parallel.c - axl_parallel_for on POSIX threads. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>

#include "internal.h"
#include "parallel.h"

#define RANGE_ALIGN 64

typedef struct range_task {
    axl_range_fn fn;
    void *ctx;
    int64_t begin, end;
} range_task;

static void *run_task(void *arg) {
    range_task *t = arg;
    t->fn(t->ctx, t->begin, t->end);
    return NULL;
}

int axl_parallel_for(int64_t n, int nthreads, int64_t min_per_thread, axl_range_fn fn,
                     void *ctx) {
    if (n <= 0) return AXL_OK;
    if (min_per_thread < 1) min_per_thread = 1;
    int64_t k = n / min_per_thread;
    if (k > nthreads) k = nthreads;
    if (k > AXL_MAX_THREADS) k = AXL_MAX_THREADS;
    if (k <= 1) {
        fn(ctx, 0, n);
        return AXL_OK;
    }

    int64_t per = (n + k - 1) / k;
    per = (per + RANGE_ALIGN - 1) / RANGE_ALIGN * RANGE_ALIGN;
    k = (n + per - 1) / per; /* rounding up `per` can leave fewer non-empty ranges */

    /* On the stack: the hot path allocates nothing. */
    range_task tasks[AXL_MAX_THREADS];
    pthread_t threads[AXL_MAX_THREADS];
    for (int64_t i = 0; i < k; i++) {
        tasks[i] = (range_task){fn, ctx, i * per, (i + 1) * per < n ? (i + 1) * per : n};
    }

    int status = AXL_OK;
    int64_t started = 1; /* threads[1 .. started-1] are running */
    for (; started < k; started++) {
        if (pthread_create(&threads[started], NULL, run_task, &tasks[started]) != 0) {
            status = AXL_ERR_RESOURCE;
            break;
        }
    }
    if (status == AXL_OK) run_task(&tasks[0]);
    for (int64_t i = 1; i < started; i++) pthread_join(threads[i], NULL);
    return status;
}
