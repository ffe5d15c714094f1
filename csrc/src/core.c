/* core.c - status messages, names and the ABI version. */
#include "internal.h"

const char *axl_strerror(int code) {
    switch (code) {
    case AXL_OK: return "success";
    case AXL_ERR_NULL_POINTER: return "a required pointer is NULL";
    case AXL_ERR_BAD_DTYPE: return "unknown dtype, or one this function does not take";
    case AXL_ERR_BAD_SIZE: return "negative element count or inconsistent shape";
    case AXL_ERR_UNSUPPORTED_ISA: return "unknown ISA, or one this CPU does not support";
    case AXL_ERR_BAD_THREADS: return "thread count must be >= 0 (0 = all CPUs)";
    case AXL_ERR_RESOURCE: return "out of memory, or a worker thread could not be created";
    case AXL_ERR_NON_FINITE: return "input holds NaN or Inf where only finite values are allowed";
    case AXL_ERR_MISALIGNED: return "pointer is not aligned to its element size";
    case AXL_ERR_OVERLAP: return "input and output buffers overlap";
    case AXL_ERR_IO: return "a file cannot be opened or read, or ends too early";
    case AXL_ERR_BAD_FORMAT:
        return "unsupported quantization format (bits must be 4 or 8, symmetric 0 or 1)";
    case AXL_ERR_BAD_HEADER:
        return "invalid safetensors header (axl_st_error says what and where)";
    case AXL_ERR_BAD_VALUE: return "an importance weight is negative, NaN or Inf";
    default: return "unknown status code";
    }
}

int axl_abi_version(void) { return AXL_ABI_VERSION; }

const char *axl_isa_name(int isa) {
    switch (isa) {
    case AXL_ISA_AUTO: return "auto";
    case AXL_ISA_SCALAR: return "scalar";
    case AXL_ISA_AVX2: return "avx2";
    case AXL_ISA_AVX512: return "avx512";
    default: return "unknown";
    }
}
