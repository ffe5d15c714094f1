/* cpu.c - what the running CPU can do, and how many CPUs we may use. */
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#include <sched.h>
#include <unistd.h>

#include "internal.h"

uint32_t axl_cpu_features(void) {
    uint32_t f = 0;
#if AXL_X86
    /* libgcc's checks include XGETBV, so AVX/AVX-512 bits are only set when the OS
     * saves the YMM/ZMM state. The init call makes this safe even before constructors. */
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) f |= AXL_CPU_AVX2;
    if (__builtin_cpu_supports("f16c")) f |= AXL_CPU_F16C;
    if (__builtin_cpu_supports("fma")) f |= AXL_CPU_FMA;
    if (__builtin_cpu_supports("avx512f")) f |= AXL_CPU_AVX512F;
    if (__builtin_cpu_supports("avx512bw")) f |= AXL_CPU_AVX512BW;
    if (__builtin_cpu_supports("avx512vl")) f |= AXL_CPU_AVX512VL;
    if (__builtin_cpu_supports("avx512dq")) f |= AXL_CPU_AVX512DQ;
    if (__builtin_cpu_supports("avx512vnni")) f |= AXL_CPU_AVX512VNNI;
    if (__builtin_cpu_supports("avx512bf16")) f |= AXL_CPU_AVX512BF16;
#endif
    return f;
}

static int isa_supported(int isa, uint32_t features) {
    (void)features; /* unused on non-x86 builds */
    switch (isa) {
    case AXL_ISA_SCALAR: return 1;
#if AXL_X86
    case AXL_ISA_AVX2: return (features & AXL_NEEDS_AVX2) == AXL_NEEDS_AVX2;
    case AXL_ISA_AVX512: return (features & AXL_NEEDS_AVX512) == AXL_NEEDS_AVX512;
#endif
    default: return 0;
    }
}

int axl_best_isa(void) {
    uint32_t f = axl_cpu_features();
    for (int isa = AXL_ISA_COUNT - 1; isa > AXL_ISA_SCALAR; isa--)
        if (isa_supported(isa, f)) return isa;
    return AXL_ISA_SCALAR;
}

int axl_resolve_isa(int isa, int *resolved) {
    if (isa == AXL_ISA_AUTO) {
        *resolved = axl_best_isa();
        return AXL_OK;
    }
    if (!isa_supported(isa, axl_cpu_features())) return AXL_ERR_UNSUPPORTED_ISA;
    *resolved = isa;
    return AXL_OK;
}

int axl_num_cpus(void) {
#ifdef CPU_COUNT
    /* The affinity mask, not the machine: taskset and container cpusets shrink it. */
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0) return n;
    }
#endif
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}
