/* autoxla.h - the one public header of the AutoXLA C core.
 *
 * Plain C11 functions over caller-owned buffers. Every function that can fail returns an
 * axl_status; axl_strerror() explains it. Nothing here aborts, allocates memory in a hot
 * path, or keeps global state. AutoXLA/_native.py is the only caller in the package.
 */
#ifndef AUTOXLA_H
#define AUTOXLA_H

#include <stdint.h>

#if defined(_WIN32)
#define AXL_API __declspec(dllexport)
#else
#define AXL_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped on any incompatible change of a signature, enum value or semantics below;
 * _native.py refuses a library whose axl_abi_version() differs from its own. */
#define AXL_ABI_VERSION 1

/* Threads a single call may use; larger requests are clamped to this. */
#define AXL_MAX_THREADS 256

/* Status codes. Values are part of the ABI: append, never renumber. */
typedef enum axl_status {
    AXL_OK = 0,
    AXL_ERR_NULL_POINTER = 1,    /* a required pointer is NULL */
    AXL_ERR_BAD_DTYPE = 2,       /* unknown dtype, or one this function does not take */
    AXL_ERR_BAD_SIZE = 3,        /* negative element count or inconsistent shape */
    AXL_ERR_UNSUPPORTED_ISA = 4, /* unknown ISA, or one this CPU (or build) lacks */
    AXL_ERR_BAD_THREADS = 5,     /* negative thread count */
    AXL_ERR_RESOURCE = 6,        /* out of memory, or a thread could not be created */
    AXL_ERR_NON_FINITE = 7,      /* NaN or Inf where the function forbids them */
    AXL_ERR_MISALIGNED = 8,      /* pointer not aligned to its element size */
    AXL_ERR_OVERLAP = 9,         /* input and output buffers overlap */
    AXL_STATUS_COUNT             /* number of codes above; not a status */
} axl_status;

/* Element types. I8/U8 are reserved for the quantization kernels. */
typedef enum axl_dtype {
    AXL_F32 = 0,
    AXL_BF16 = 1,
    AXL_F16 = 2,
    AXL_I8 = 3,
    AXL_U8 = 4,
    AXL_DTYPE_COUNT
} axl_dtype;

/* Instruction sets a kernel can be asked to use. AUTO picks the best this CPU has. */
typedef enum axl_isa {
    AXL_ISA_AUTO = 0,
    AXL_ISA_SCALAR = 1, /* portable C reference, always available */
    AXL_ISA_AVX2 = 2,   /* needs AVX2 + F16C + FMA */
    AXL_ISA_AVX512 = 3, /* needs AVX-512 F + BW + DQ + VL */
    AXL_ISA_COUNT
} axl_isa;

/* Bits of axl_cpu_features(); set only when the OS also saves the registers involved. */
#define AXL_CPU_AVX2 (1u << 0)
#define AXL_CPU_F16C (1u << 1)
#define AXL_CPU_FMA (1u << 2)
#define AXL_CPU_AVX512F (1u << 3)
#define AXL_CPU_AVX512BW (1u << 4)
#define AXL_CPU_AVX512VL (1u << 5)
#define AXL_CPU_AVX512DQ (1u << 6)
#define AXL_CPU_AVX512VNNI (1u << 7)
#define AXL_CPU_AVX512BF16 (1u << 8)

/* Message for a status code; never NULL, also for unknown codes. Static storage. */
AXL_API const char *axl_strerror(int code);

/* AXL_ABI_VERSION of the compiled library. */
AXL_API int axl_abi_version(void);

/* AXL_CPU_* bits of the running CPU (0 on non-x86 builds). */
AXL_API uint32_t axl_cpu_features(void);

/* The axl_isa that AXL_ISA_AUTO resolves to on this CPU. */
AXL_API int axl_best_isa(void);

/* "auto", "scalar", "avx2", "avx512"; "unknown" for any other value. Never NULL. */
AXL_API const char *axl_isa_name(int isa);

/* CPUs this process may run on (its affinity mask), at least 1. */
AXL_API int axl_num_cpus(void);

/* Convert n elements from src (src_dtype) to dst (dst_dtype), both dense 1-D arrays of n
 * elements. Takes F32, BF16 and F16 in all 9 pairs; equal dtypes copy.
 *
 * Semantics are those of PyTorch's tensor.to(dtype) on CPU, bit for bit, for every
 * non-NaN input: round to nearest even, f16 overflow to +-Inf (|x| >= 65520), subnormals
 * kept exactly in both directions (no flush to zero, whatever the MXCSR says), and
 * bf16 <-> f16 goes through f32. NaNs stay NaN with one fixed rule per pair:
 *   to bf16:          0x7FC0 (sign and payload dropped, as c10::BFloat16 does)
 *   f32 -> f16:       sign kept, quiet bit set, top 9 payload bits kept (F16C)
 *   f16 -> f32:       sign kept, quiet bit set, payload kept (F16C)
 *   bf16 -> f32:      bits shifted unchanged (a signalling NaN stays signalling)
 * PyTorch itself is not consistent for NaN bit patterns (its result depends on the CPU
 * capability and on the element's position in the tensor), so no single rule matches it.
 *
 * nthreads: 0 = axl_num_cpus(), > 0 = at most that many (clamped to AXL_MAX_THREADS),
 * < 0 = AXL_ERR_BAD_THREADS. Small n runs on the calling thread. isa: an axl_isa.
 * src and dst must be aligned to their element size and must not overlap; they may be
 * NULL only when n == 0. If a worker thread cannot be created the call returns
 * AXL_ERR_RESOURCE and dst is partly written. */
AXL_API int axl_convert(const void *src, int src_dtype, void *dst, int dst_dtype, int64_t n,
                        int nthreads, int isa);

#ifdef __cplusplus
}
#endif

#endif /* AUTOXLA_H */
