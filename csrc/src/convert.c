/* convert.c - axl_convert: argument checks, kernel choice, split over threads. */
#include <string.h>

#include "internal.h"
#include "parallel.h"

/* Below two of these per thread a call stays on the calling thread: thread start-up
 * (tens of microseconds) would cost more than the conversion. */
#define MIN_PER_THREAD ((int64_t)1 << 15)

#define CONVERT_TABLE(suffix)                                                        \
    {                                                                                \
        [AXL_F32] = {[AXL_BF16] = axl_convert_f32_bf16_##suffix,                     \
                     [AXL_F16] = axl_convert_f32_f16_##suffix},                      \
        [AXL_BF16] = {[AXL_F32] = axl_convert_bf16_f32_##suffix,                     \
                      [AXL_F16] = axl_convert_bf16_f16_##suffix},                    \
        [AXL_F16] = {[AXL_F32] = axl_convert_f16_f32_##suffix,                       \
                     [AXL_BF16] = axl_convert_f16_bf16_##suffix},                    \
    }

/* [isa][src dtype][dst dtype]; the diagonal is NULL and means a plain copy. */
static const axl_convert_fn convert_kernels[AXL_ISA_COUNT][3][3] = {
    [AXL_ISA_SCALAR] = CONVERT_TABLE(ref),
#if AXL_X86
    [AXL_ISA_AVX2] = CONVERT_TABLE(avx2),
    [AXL_ISA_AVX512] = CONVERT_TABLE(avx512),
#endif
};

axl_convert_fn axl_convert_kernel(int isa, int src_dtype, int dst_dtype) {
    return convert_kernels[isa][src_dtype][dst_dtype];
}

typedef struct convert_job {
    axl_convert_fn fn; /* NULL: copy */
    const char *src;
    char *dst;
    size_t src_size, dst_size;
} convert_job;

static void convert_range(void *arg, int64_t begin, int64_t end) {
    const convert_job *job = arg;
    const char *s = job->src + (size_t)begin * job->src_size;
    char *d = job->dst + (size_t)begin * job->dst_size;
    if (job->fn)
        job->fn(s, d, end - begin);
    else
        memcpy(d, s, (size_t)(end - begin) * job->src_size);
}

static int is_float_dtype(int dtype) {
    return dtype == AXL_F32 || dtype == AXL_BF16 || dtype == AXL_F16;
}

int axl_convert(const void *src, int src_dtype, void *dst, int dst_dtype, int64_t n,
                int nthreads, int isa) {
    if (!is_float_dtype(src_dtype) || !is_float_dtype(dst_dtype)) return AXL_ERR_BAD_DTYPE;
    size_t ss = axl_dtype_size(src_dtype), ds = axl_dtype_size(dst_dtype);
    /* The byte count of either buffer must fit in a ptrdiff_t. */
    if (n < 0 || (uint64_t)n > (uint64_t)PTRDIFF_MAX / 4) return AXL_ERR_BAD_SIZE;
    if (nthreads < 0) return AXL_ERR_BAD_THREADS;
    int status = axl_resolve_isa(isa, &isa);
    if (status != AXL_OK) return status;
    if (n == 0) return AXL_OK; /* empty tensors may carry NULL data pointers */
    if (!src || !dst) return AXL_ERR_NULL_POINTER;

    uintptr_t s0 = (uintptr_t)src, d0 = (uintptr_t)dst;
    if (s0 % ss || d0 % ds) return AXL_ERR_MISALIGNED;
    if (s0 < d0 + (uint64_t)n * ds && d0 < s0 + (uint64_t)n * ss) return AXL_ERR_OVERLAP;

    convert_job job = {axl_convert_kernel(isa, src_dtype, dst_dtype), src, dst, ss, ds};
    if (nthreads == 0) nthreads = axl_num_cpus();
    return axl_parallel_for(n, nthreads, MIN_PER_THREAD, convert_range, &job);
}
