/* autoxla.h - the one public header of the AutoXLA C core.
 *
 * Plain C11 functions over caller-owned buffers. Every function that can fail returns an
 * axl_status; axl_strerror() explains it. Nothing here aborts, allocates memory in a hot
 * path, or keeps global state. AutoXLA/_native/ is the only caller in the package.
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
 * AutoXLA/_native/ refuses a library whose axl_abi_version() differs from its own. */
#define AXL_ABI_VERSION 8

/* Threads a single call may use; larger requests are clamped to this. */
#define AXL_MAX_THREADS 256

/* Most dimensions a tensor passed to the shard slicing functions below may have. */
#define AXL_MAX_NDIM 8

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
    AXL_ERR_IO = 10,             /* a file cannot be opened or read, or ends too early */
    AXL_ERR_BAD_FORMAT = 11,     /* quantization format: bits not 4 or 8, symmetric not 0/1 */
    AXL_ERR_BAD_HEADER = 12,     /* invalid safetensors header; axl_st_error says what and where */
    AXL_ERR_BAD_VALUE = 13,      /* an importance weight is negative, NaN or Inf */
    AXL_STATUS_COUNT             /* number of codes above; not a status */
} axl_status;

/* Element types. I8/U8 are quantized data: the shard slicing functions copy them
 * (same dtype in and out); axl_convert does not take them. */
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

/* ---- shard slicing ---------------------------------------------------------------------
 * A dense row-major tensor of `shape` (ndim 1..AXL_MAX_NDIM dims) is cut into a grid of
 * grid[d] equal blocks along each dim d: grid[d] >= 1 divides shape[d] (1 = dim not split).
 * Block k, in row-major order over the grid (the last grid dim varies fastest), is written
 * to dsts[k] as a dense row-major array, converted to dst_dtype:
 *   src is (shape[0], ..., shape[ndim-1]) of src_dtype;
 *   dsts[k] is (shape[0]/grid[0], ..., shape[ndim-1]/grid[ndim-1]) of dst_dtype, for
 *   k = 0 .. prod(grid)-1, and block k holds the elements whose index i satisfies
 *   k == sum_d (i[d] / (shape[d]/grid[d])) * prod(grid[d+1 .. ndim-1]).
 * The conversion is axl_convert's (same kernels, same bits; F32/BF16/F16 in all 9 pairs).
 * I8 and U8 (quantized data) are taken only with src_dtype == dst_dtype: a plain copy into
 * the grid. Any other pair with I8 or U8: AXL_ERR_BAD_DTYPE.
 *
 * Argument rules shared by axl_scatter_shards, axl_read_shards and axl_read_blocks:
 *   ndim outside 1..AXL_MAX_NDIM, shape[d] < 0, grid[d] < 1, grid[d] not dividing
 *   shape[d], or more than PTRDIFF_MAX/4 elements: AXL_ERR_BAD_SIZE. shape and grid are
 *   never NULL. A tensor with 0 elements is valid and nothing is done: then src, dsts,
 *   path and scratch may be NULL and no file is opened. Otherwise every pointer must be
 *   non-NULL and aligned to its element size (AXL_ERR_MISALIGNED), and no two of the
 *   buffers (src or scratch, and the blocks) may overlap (AXL_ERR_OVERLAP).
 *   nthreads and isa as for axl_convert; a tensor with few elements stays on the calling
 *   thread. If a worker thread cannot be created the call returns AXL_ERR_RESOURCE and
 *   the blocks are partly written. The overlap check allocates prod(grid) + 1 entries
 *   when there are more than 63 blocks (axl_read_blocks: more than 63 wanted ones; the
 *   only allocation, before any work); if that fails: AXL_ERR_RESOURCE. */

/* Blocks of the in-memory tensor src. Threads split the elements of src evenly,
 * whatever the shape and grid. */
AXL_API int axl_scatter_shards(const void *src, int src_dtype, int ndim, const int64_t *shape,
                               const int64_t *grid, void *const *dsts, int dst_dtype,
                               int nthreads, int isa);

/* Blocks of the tensor whose bytes lie in the file `path` from byte `offset` on, laid out
 * as src would be in memory (as in a safetensors file, little-endian), without ever holding
 * the whole tensor in memory: the file is read with pread in chunks of whole rows, staged
 * in the caller's scratch buffer, and each chunk is converted straight into the blocks.
 * A row is one slab of dim 0:
 *   row_bytes = shape[1] * ... * shape[ndim-1] * size of src_dtype (one element if ndim 1).
 * The call uses T threads, which take chunks in file order, each reading into its own
 * part of scratch:
 *   T = min(nthreads (0: axl_num_cpus()), AXL_MAX_THREADS,
 *           max(1, shape[0] / ceil(1 MiB / row_bytes)))
 * i.e. at least 1 MiB of the file per thread. scratch (scratch_bytes, aligned to the
 * src_dtype size) must hold T rows: scratch_bytes >= T * row_bytes, else AXL_ERR_BAD_SIZE.
 * A chunk is scratch_bytes / T rounded down to whole rows, but at most ceil(shape[0] / T)
 * rows; more scratch means fewer, larger reads. axl_read_shards_scratch_bytes gives a size.
 * offset < 0, scratch_bytes < 0, or offset + the tensor's bytes above INT64_MAX:
 * AXL_ERR_BAD_SIZE (also for a tensor with 0 elements). The file
 * is opened once (O_RDONLY | O_CLOEXEC | O_NONBLOCK, so opening a FIFO cannot block), shared
 * by the threads, and closed before the call returns, on every path. A FIFO, socket or
 * directory (checked with fstat on the open descriptor), a file that cannot be opened or
 * read, or one that ends before offset + the tensor's bytes: AXL_ERR_IO, and the blocks are
 * partly written. */
AXL_API int axl_read_shards(const char *path, int64_t offset, int src_dtype, int ndim,
                            const int64_t *shape, const int64_t *grid, void *const *dsts,
                            int dst_dtype, void *scratch, int64_t scratch_bytes, int nthreads,
                            int isa);

/* A scratch_bytes for axl_read_shards with the same src_dtype (any axl_dtype), ndim, shape and nthreads:
 * T (as above) times up to 8 MiB of whole rows, at least one row, at most a thread's
 * share of the rows; always enough, and 0 for a tensor with 0 elements. A bad argument
 * (dtype, ndim, shape, nthreads; a NULL shape) gives the negated axl_status instead. */
AXL_API int64_t axl_read_shards_scratch_bytes(int src_dtype, int ndim, const int64_t *shape,
                                              int nthreads);

/* Some blocks of the tensor in the file, as axl_read_shards reads all of them, reading only
 * the bytes that hold them: for a host of a multi-host slice, which needs a few blocks of
 * each tensor. dsts[k] == NULL means block k is not wanted: it is not written, and its
 * bytes are read only inside a bridged gap (below). Everything else is as for
 * axl_read_shards: the arguments, checks and statuses (overlap only among the non-NULL
 * blocks and scratch; scratch's size rule below), the file's opening and refusals, and
 * the conversion.
 *
 * What is read: the bytes of the wanted blocks' elements, as the maximal ranges of
 * consecutive such bytes in file order, with any two ranges at most gap_bytes apart
 * merged into one (gap_bytes >= 0, else AXL_ERR_BAD_SIZE), the gap read and dropped: 0
 * reads exactly the wanted bytes; a larger gap trades bytes for fewer, longer preads.
 * These are exactly the ranges axl_block_ranges gives for the same arguments. Let R be
 * their total bytes. Each range is read with pread in chunks of at most C bytes, handed
 * to T threads in file order, each reading into its own C bytes of scratch and converting
 * its chunk's wanted elements into their blocks (a chunk may end inside a run):
 *   T = min(T of axl_read_shards for this shape and nthreads, max(1, R / 1 MiB))
 *   C = scratch_bytes / T, rounded down to whole src elements, at most ceil(R / T) bytes
 *       rounded up to whole src elements
 * scratch must hold one element per thread: scratch_bytes / T >= size of src_dtype, else
 * AXL_ERR_BAD_SIZE. T is at most axl_read_shards' T, so axl_read_shards_scratch_bytes
 * (which holds T rows) is always enough.
 *
 * With no block wanted (all dsts[k] NULL) or a tensor with 0 elements nothing is read:
 * AXL_OK, the file is not opened and path and scratch may be NULL; dsts itself must not
 * be NULL when the tensor has elements. A file that ends before the end of a range read:
 * AXL_ERR_IO, and the wanted blocks are partly written; a file that ends inside the bytes
 * of unwanted blocks only is fine. *bytes_read (when bytes_read is not NULL) is set on
 * every return: the bytes read, which is R on AXL_OK; after a failure the bytes of the
 * chunks read in full (0 when the arguments are refused). The walk that finds the
 * ranges allocates nothing and runs twice (R first); a part of the grid whose blocks are
 * all wanted or all unwanted costs a look at their pointers, never a step per run. The
 * threads take chunks under one lock. */
AXL_API int axl_read_blocks(const char *path, int64_t offset, int src_dtype, int ndim,
                            const int64_t *shape, const int64_t *grid, void *const *dsts,
                            int dst_dtype, int64_t gap_bytes, void *scratch,
                            int64_t scratch_bytes, int nthreads, int isa, int64_t *bytes_read);

/* The byte ranges axl_read_blocks reads, for the same src_dtype (any axl_dtype), ndim,
 * shape, grid and gap_bytes, with wanted[k] != 0 for the wanted blocks (prod(grid) flags,
 * for dsts[k] != NULL): ranges[2i] and ranges[2i+1] are the begin and end (exclusive) of
 * range i in bytes from the start of the tensor (add the file offset), sorted, disjoint,
 * and more than gap_bytes apart. Returns the number of ranges, of which the first
 * min(count, capacity) are written; call with capacity 0 (ranges may then be NULL) to
 * size the array. 0 for a tensor with 0 elements (wanted may then be NULL) or no wanted
 * block. Bad arguments give the negated axl_status: src_dtype no axl_dtype
 * (AXL_ERR_BAD_DTYPE); ndim, shape, grid as above, gap_bytes < 0 or capacity < 0
 * (AXL_ERR_BAD_SIZE); a NULL shape, grid or wanted, or a
 * NULL ranges with capacity > 0 (AXL_ERR_NULL_POINTER). */
AXL_API int64_t axl_block_ranges(int src_dtype, int ndim, const int64_t *shape,
                                 const int64_t *grid, const unsigned char *wanted,
                                 int64_t gap_bytes, int64_t *ranges, int64_t capacity);

/* ---- quantization ----------------------------------------------------------------------
 * A weight w is a dense row-major (rows, cols) matrix of F32, BF16 or F16, read in place
 * (never copied to fp32 as a whole). Each run of block_size consecutive elements of a row
 * (a "block") shares one scale, stored as F32, BF16 or F16 (scale_dtype), and, asymmetric, one
 * int8 zero point. Any block_size >= 1 is valid (and block_size == cols also when cols == 0);
 * block_size < 1 otherwise is AXL_ERR_BAD_SIZE. A row has G = ceil(cols / block_size) blocks
 * (G = 0 when cols == 0): block g holds elements [g * block_size, min((g + 1) * block_size,
 * cols)), so the last one is shorter ("ragged") when block_size does not divide cols, and
 * block_size >= cols means one block per row (per-channel). Every ISA gives the same bits for
 * every block size.
 *
 * Layouts (all dense, row-major):
 *   q, bits 8:  (rows, cols) int8.
 *   q, bits 4:  (rows, ceil(cols/2)) uint8, two 4-bit two's complement values per byte:
 *               element 2j of a row in the LOW nibble (bits 0-3) of byte j, element 2j+1
 *               in the HIGH nibble (bits 4-7). Each row starts on a new byte; with odd
 *               cols the high nibble of a row's last byte is 0.
 *   scales:     (rows, G) of scale_dtype: AXL_F32 (float32), AXL_BF16 (bfloat16) or AXL_F16
 *               (float16).
 *   zero_points:(rows, G) int8.
 *   max_err, sqnr_db: (rows,) float32.
 *
 * Arithmetic, all fp32 IEEE with round half to even, identical on every ISA:
 *   x = the element widened to fp32 (exact).
 *   symmetric (qmax = 127 or 7): amax = max |x| over the block; s = amax / qmax.
 *   asymmetric (qmin, qmax = -128, 127 or -8, 7): lo = min(min(block), 0),
 *     hi = max(max(block), 0); s = (hi - lo) / (qmax - qmin) (+Inf: AXL_ERR_NON_FINITE).
 *   scale = s (AXL_F32), or s rounded UP to bf16 (AXL_BF16) or fp16 (AXL_F16) (toward
 *     +Inf: the smallest value of the dtype >= s; a value of the dtype, 0 included, is
 *     unchanged; unlike axl_convert, which rounds to nearest even) and widened back to fp32.
 *     fp16: any s > 65504 (fp16's largest) rounds to +Inf and the row is refused,
 *     AXL_ERR_NON_FINITE; any 0 < s < 2^-24 becomes 2^-24. From here on the block uses this
 *     rounded scale, never s: it is what is stored, tested below, inverted and multiplied
 *     by. If the grid then overflows fp32 - scale * qmax (symmetric) or scale * (qmax - qmin)
 *     (asymmetric) is +Inf, which only a block within about 2^-8 of FLT_MAX can reach (or
 *     an fp16 scale beyond 65504) - the row is refused: AXL_ERR_NON_FINITE (else its top
 *     value would dequantize to +Inf).
 *   inv = 1.0f / scale.
 *   symmetric: q = clamp(nearbyint(x * inv), -qmax, qmax); zero point 0.
 *   asymmetric: zp = clamp(qmin - nearbyint(lo * inv), qmin, qmax);
 *     q = clamp(nearbyint(x * inv) + zp, qmin, qmax)   (round, then add the integer zp).
 *   A block whose scale is 0, or so small that inv = 1.0f / scale overflows to +Inf (that
 *   is s <= 2^-128, with F32 or BF16 scales; never with F16), is stored as zeros: scale 0, zero point 0,
 *   every q 0. (Its elements are all below 2^-120 in magnitude; this avoids 0 * Inf = NaN.)
 *   dequantized: y = (float)(q - zp) * scale, in fp32 (a BF16 scale widened exactly).
 * Since scale >= s (a BF16 scale is up to 2^-8 relative larger, 2^-5 for the smallest kept
 * scales, bf16 subnormals; an F16 one 2^-11, more for fp16 subnormals), the block's range fits
 * its grid of qmax - qmin steps with every scale dtype: every element of a kept block has |x - y| <= scale / 2 plus fp32
 * rounding (below 2^-13 scale, and 2^-149 for subnormal products). Of the clamps only the
 * asymmetric upper one can bind, by 1, when both ends of the range are (near) ties that
 * round away, and then too within that bound.
 * The kernels run with the default FP environment whatever the caller's (on x86 MXCSR is
 * set to round-to-nearest without FTZ/DAZ for the call and restored after), so a caller's
 * torch.set_flush_denormal or rounding mode cannot change a result.
 *
 * Shared argument rules, checked in this order: dtypes, the weight's (or output's) then
 * scale_dtype (AXL_ERR_BAD_DTYPE; scale_dtype must be AXL_F32, AXL_BF16 or AXL_F16); rows, cols < 0 or
 * more than PTRDIFF_MAX/4 elements (AXL_ERR_BAD_SIZE); bits not 4/8 or symmetric not 0/1
 * (AXL_ERR_BAD_FORMAT); block_size (AXL_ERR_BAD_SIZE); nthreads and isa as for axl_convert;
 * then, unless rows * cols == 0 (nothing is read or written, pointers may be NULL): NULL
 * required pointers (AXL_ERR_NULL_POINTER), float / int64 / 16-bit data not aligned to its
 * element size (scales: the size of scale_dtype) (AXL_ERR_MISALIGNED), an output sharing a
 * byte with any other buffer (AXL_ERR_OVERLAP).
 * Rows are split evenly over the threads; a matrix with few elements stays on the calling
 * thread. If a worker thread cannot be created the call returns AXL_ERR_RESOURCE and the
 * outputs are partly written. Nothing is allocated. */

/* w (rows, cols) of src_dtype -> q, scales, zero_points, and optional per-row error
 * statistics, computed in the same pass while the row is in cache:
 *   dq = the fp32 dequantized value above; err = (double)x - (double)dq;
 *   max_err[r] = (float) max |err| over the row;
 *   signal = sum (double)x * (double)x, noise = sum err * err, each accumulated in double
 *   in 16 lanes: the element at position p of its block (p = k - g * block_size for element
 *   k of block g) is added to lane p % 16, blocks in order (for block sizes that are
 *   multiples of 16, and per-channel rows, that is lane k % 16), and the lanes are summed in
 *   order, (((l0 + l1) + l2) + ...) + l15;
 *   sqnr_db[r] = noise == 0 ? +Inf : (float)(10 * log10(signal / noise)) (-Inf when
 *   signal == 0 < noise).
 * zero_points: required when asymmetric; when symmetric it may be NULL, and if given is
 * filled with 0. max_err, sqnr_db: optional (NULL skips it; the statistics are computed if
 * either is given). bad_row: optional, 8-byte aligned (checked also for an empty matrix);
 * once the arguments are checked it is set to -1, or, when the call returns
 * AXL_ERR_NON_FINITE, to the lowest row holding a NaN or Inf, (asymmetric) a block whose
 * range hi - lo overflows fp32, or a block whose grid overflows fp32 or whose fp16 scale
 * overflows (above). That row is the same for any nthreads and isa; q and the
 * other outputs are then unspecified. */
AXL_API int axl_quantize(const void *w, int src_dtype, int64_t rows, int64_t cols, int bits,
                         int symmetric, int64_t block_size, void *q, void *scales,
                         int scale_dtype, int8_t *zero_points, float *max_err, float *sqnr_db,
                         int64_t *bad_row, int nthreads, int isa);

/* The inverse: q, scales of scale_dtype (AXL_F32, AXL_BF16 or AXL_F16), zero_points (layouts above;
 * zero_points NULL = symmetric, i.e. all 0) -> out (rows, cols) of dst_dtype (F32, BF16 or
 * F16): y = (float)(q - zp) * scale in fp32 (a bf16 / fp16 scale widened exactly), then converted
 * exactly as axl_convert converts f32 to dst_dtype. out must not overlap the inputs; the
 * inputs may overlap each other. */
AXL_API int axl_dequantize(const void *q, const void *scales, int scale_dtype,
                           const int8_t *zero_points, int64_t rows, int64_t cols, int bits,
                           int64_t block_size, void *out, int dst_dtype, int nthreads, int isa);

/* ---- quantization formats and the error-minimising search ------------------------------
 * axl_quantize_spec / axl_dequantize_spec take the format as one axl_qspec, with a third
 * scheme and an optional search; axl_quantize / axl_dequantize above are the same calls with
 * scheme = symmetric ? AXL_Q_SYMMETRIC : AXL_Q_ZERO_POINT, search 0, importance NULL.
 *
 * AXL_Q_OFFSET (as llama.cpp's Q4_1 / Q8_1 ideas): y = (float)q * scale + offset, q in
 * [qmin, qmax] (full two's complement range), one offset per block of scale_dtype in
 * `offsets` (rows, G), no zero points. Without the search: lo = min(block), hi = max(block)
 * (0 not included); scale = (hi - lo) / (qmax - qmin) rounded UP to scale_dtype (as above; fp16
 * beyond 65504 refuses the row); offset = lo - (float)qmin * scale in fp32, rounded to NEAREST
 * (even) scale_dtype (fp16 beyond 65504 refuses the row); inv = 1 / scale;
 * q = clamp(nearbyint((x - offset) * inv), qmin, qmax). A block whose scale is 0 or whose inv
 * overflows (a constant block) stores scale 0 and q 0, so y = offset. Every element of a kept
 * block is within scale / 2 + |offset rounding| (plus fp32 rounding) of y.
 * dequantized (offset): y = (float)q * scale + offset in fp32 (no FMA).
 *
 * search = 1: per block, a fixed set of candidate (inverse scale, level shift, zero point)
 * triples, computed by one scalar routine on every ISA from the block's range, each giving
 * levels L = clamp(nearbyint((x - a) * inv) + zp, qmin, qmax) with qmin = -qmax - 1 for every
 * scheme (a symmetric block may then use -8 / -128 and store a negative scale); for each,
 * the least-squares scale (and offset, AXL_Q_OFFSET) of those levels under the importance
 * weights, rounded to NEAREST scale_dtype; the candidate with the lowest weighted squared
 * error (predicted in double from its fp32 sums, each summed in element order) is then
 * measured exactly, sum imp[k] * ((double)x - (double)y)^2 in 16 double lanes (position in
 * block % 16, the lanes added as a fixed tree: halves, quarters, eighths), against the plain
 * (absmax / min-max) result, and kept only if below (1 - 2^-30) times the plain one's error,
 * so a searched block is never worse than the plain one in float64 whatever the summation
 * order (for blocks below 2^21 elements); ties and near-ties keep the plain result, bit for
 * bit. Searched blocks have no half-step bound (clipping outliers is the point). The
 * candidates, documented in csrc/src/quant_search.c, and every result are the same on every
 * ISA and thread count.
 * importance: NULL (every weight 1) or cols floats, one per input column (e.g. the mean
 * squared activation from calibration), each finite and >= 0 (else AXL_ERR_BAD_VALUE,
 * checked before any work); only the search reads it.
 *
 * Argument rules are those of axl_quantize, with: spec NULL (AXL_ERR_NULL_POINTER); bits,
 * scheme or search (0/1) out of range (AXL_ERR_BAD_FORMAT); zero_points required with
 * AXL_Q_ZERO_POINT (else may be NULL; filled with 0 when given and symmetric; must be NULL
 * for AXL_Q_OFFSET), offsets required with AXL_Q_OFFSET (else ignored, not written);
 * offsets aligned to the scale dtype and not overlapping any other buffer. */
typedef enum axl_qscheme {
    AXL_Q_SYMMETRIC = 0,  /* y = q * scale, q in [-qmax, qmax] (search: [qmin, qmax]) */
    AXL_Q_ZERO_POINT = 1, /* y = (q - zp) * scale, int8 zp per block */
    AXL_Q_OFFSET = 2,     /* y = q * scale + offset, offset of scale_dtype per block */
    AXL_Q_SCHEME_COUNT
} axl_qscheme;

typedef struct axl_qspec {
    int32_t bits;             /* 4 or 8 */
    int32_t scheme;           /* an axl_qscheme */
    int64_t block_size;       /* as for axl_quantize */
    int32_t scale_dtype;      /* AXL_F32, AXL_BF16 or AXL_F16 (scales and offsets) */
    int32_t search;           /* 0: absmax / min-max; 1: the error-minimising search */
    const float *importance;  /* NULL, or cols weights (search only) */
} axl_qspec;

AXL_API int axl_quantize_spec(const void *w, int src_dtype, int64_t rows, int64_t cols,
                              const axl_qspec *spec, void *q, void *scales, int8_t *zero_points,
                              void *offsets, float *max_err, float *sqnr_db, int64_t *bad_row,
                              int nthreads, int isa);

/* The inverse for any scheme: y = (float)(q - zp) * scale (zero_points NULL: zp 0), or, for
 * AXL_Q_OFFSET, (float)q * scale + offset; then converted to dst_dtype as axl_dequantize
 * does. spec->search and spec->importance are ignored. */
AXL_API int axl_dequantize_spec(const void *q, const void *scales, const int8_t *zero_points,
                                const void *offsets, int64_t rows, int64_t cols,
                                const axl_qspec *spec, void *out, int dst_dtype, int nthreads,
                                int isa);

/* ---- safetensors headers ---------------------------------------------------------------
 * A .safetensors file is: an 8-byte little-endian length n, n bytes of JSON (the header),
 * then the data section. axl_st_parse_header validates the header, strictly and in one
 * place, before any byte of tensor data is read, and returns one record per tensor.
 *
 * JSON: RFC 8259 with no extensions. The header must start with '{' (no leading
 * whitespace, as safetensors requires) and hold one object; after it only spaces, tabs,
 * CR and LF (safetensors pads headers with spaces). Strings must be valid UTF-8 (no
 * overlong forms, no surrogates, nothing above U+10FFFF) with control characters escaped;
 * escapes are \" \\ \/ \b \f \n \r \t and \uXXXX, a surrogate only as a high-low pair.
 * Containers nest at most AXL_ST_MAX_DEPTH deep (the top object is depth 1).
 *
 * Schema (safetensors' own rules, or stricter):
 *   every key but "__metadata__" names a tensor, and its value is an object with
 *     "dtype":        a string, one of the axl_st_dtype names below;
 *     "shape":        an array of at most AXL_ST_MAX_NDIM integers >= 0;
 *     "data_offsets": an array of exactly 2 integers, begin <= end;
 *   other fields are ignored (any JSON value), a field given twice is an error.
 *   "__metadata__" (at most once): null, or an object whose values are strings (not null:
 *     safetensors refuses that too).
 *   Where an integer is required only 0 or [1-9][0-9]* up to INT64_MAX is taken: no sign,
 *   fraction, exponent or leading zero.
 *   elements = the product of shape (1 for []), computed left to right, never above
 *   INT64_MAX; bytes = elements * bits of dtype / 8, never above INT64_MAX and whole
 *   bytes (for the 4- and 6-bit dtypes); end - begin == bytes.
 *   No tensor name twice (compared after decoding escapes).
 *   Sorted by (begin, end), the tensors tile the data section [0, D) with no gap and no
 *   overlap, and 8 + n + D == file_size.
 *
 * Time: the parse is linear in n; the two cross-tensor checks sort the records in place
 * (heapsort, O(k log k) comparisons, names compared bytewise), nothing is allocated.
 *
 * Buffers (all caller-owned; the parser never reads header[n] or beyond and never writes
 * past a cap). These caps always suffice for a header of n bytes:
 *   records_cap >= n / AXL_ST_MIN_ENTRY_BYTES + 1, names_cap >= n, dims_cap >= n / 2 + 1.
 * Or size them exactly: a call with records, names and dims all NULL (caps 0) parses and
 * checks everything but the cross-tensor rules (duplicates, tiling, file size) and sets
 * count, names_used and dims_used; a second call with buffers of those sizes does it all. */

/* Most dims of a tensor in a safetensors header (PyTorch's own limit is 64 too). */
#define AXL_ST_MAX_NDIM 64
/* Deepest nesting of JSON containers accepted in a header. */
#define AXL_ST_MAX_DEPTH 64
/* Fewest header bytes a tensor entry takes: "":{"dtype":"U8","shape":[],"data_offsets":[0,0]} */
#define AXL_ST_MIN_ENTRY_BYTES 48

/* safetensors dtypes; the names are the header's strings. Values are part of the ABI. */
typedef enum axl_st_dtype {
    AXL_ST_BOOL = 0,    /* 8 bits */
    AXL_ST_U8 = 1,
    AXL_ST_I8 = 2,
    AXL_ST_I16 = 3,
    AXL_ST_U16 = 4,
    AXL_ST_F16 = 5,
    AXL_ST_BF16 = 6,
    AXL_ST_I32 = 7,
    AXL_ST_U32 = 8,
    AXL_ST_F32 = 9,
    AXL_ST_F64 = 10,
    AXL_ST_I64 = 11,
    AXL_ST_U64 = 12,
    AXL_ST_F8_E4M3 = 13,
    AXL_ST_F8_E5M2 = 14,
    AXL_ST_F8_E4M3FNUZ = 15,
    AXL_ST_F8_E5M2FNUZ = 16,
    AXL_ST_F8_E8M0 = 17,
    AXL_ST_F4 = 18,      /* 4 bits, two per byte */
    AXL_ST_F6_E2M3 = 19, /* 6 bits */
    AXL_ST_F6_E3M2 = 20, /* 6 bits */
    AXL_ST_C64 = 21,     /* complex64, 64 bits */
    AXL_ST_DTYPE_COUNT
} axl_st_dtype;

/* What is wrong with a header (axl_st_error.kind). Values are part of the ABI: append. */
typedef enum axl_st_error_kind {
    AXL_ST_OK = 0,
    AXL_ST_ERR_EOF = 1,                /* the header ends inside a value */
    AXL_ST_ERR_SYNTAX = 2,             /* a byte that is not valid JSON here */
    AXL_ST_ERR_UTF8 = 3,               /* invalid UTF-8 in a string */
    AXL_ST_ERR_CONTROL_CHAR = 4,       /* unescaped control character in a string */
    AXL_ST_ERR_ESCAPE = 5,             /* invalid escape sequence */
    AXL_ST_ERR_SURROGATE = 6,          /* \u escape of a lone or reversed surrogate */
    AXL_ST_ERR_TOO_DEEP = 7,           /* containers nested deeper than AXL_ST_MAX_DEPTH */
    AXL_ST_ERR_TRAILING_DATA = 8,      /* something other than whitespace after the object */
    AXL_ST_ERR_NOT_OBJECT = 9,         /* the header does not start with '{' */
    AXL_ST_ERR_ENTRY_NOT_OBJECT = 10,  /* a tensor's value is not an object */
    AXL_ST_ERR_METADATA_NOT_OBJECT = 11, /* "__metadata__" is neither an object nor null */
    AXL_ST_ERR_METADATA_VALUE = 12,    /* a metadata value is not a string */
    AXL_ST_ERR_DUPLICATE_METADATA = 13, /* "__metadata__" twice */
    AXL_ST_ERR_MISSING_DTYPE = 14,     /* a tensor without "dtype" */
    AXL_ST_ERR_MISSING_SHAPE = 15,     /* a tensor without "shape" */
    AXL_ST_ERR_MISSING_OFFSETS = 16,   /* a tensor without "data_offsets" */
    AXL_ST_ERR_DUPLICATE_FIELD = 17,   /* "dtype", "shape" or "data_offsets" twice */
    AXL_ST_ERR_DTYPE_NOT_STRING = 18,  /* "dtype" is not a string */
    AXL_ST_ERR_UNKNOWN_DTYPE = 19,     /* "dtype" is no safetensors dtype */
    AXL_ST_ERR_SHAPE_NOT_ARRAY = 20,   /* "shape" is not an array */
    AXL_ST_ERR_TOO_MANY_DIMS = 21,     /* more than AXL_ST_MAX_NDIM dims; value = the limit */
    AXL_ST_ERR_OFFSETS_NOT_ARRAY = 22, /* "data_offsets" is not an array */
    AXL_ST_ERR_OFFSETS_LENGTH = 23,    /* "data_offsets" does not hold exactly 2 values */
    AXL_ST_ERR_EXPECTED_INTEGER = 24,  /* a non-number where an integer is required */
    AXL_ST_ERR_NOT_INTEGER = 25,       /* a number with a fraction or exponent there */
    AXL_ST_ERR_NEGATIVE = 26,          /* a negative number (or -0) there */
    AXL_ST_ERR_LEADING_ZERO = 27,      /* a number with a leading zero (invalid JSON) */
    AXL_ST_ERR_INT_OVERFLOW = 28,      /* an integer above INT64_MAX */
    AXL_ST_ERR_OFFSETS_REVERSED = 29,  /* data_offsets begin > end */
    AXL_ST_ERR_SIZE_OVERFLOW = 30,     /* element count or byte size above INT64_MAX */
    AXL_ST_ERR_PARTIAL_BYTE = 31,      /* a 4- or 6-bit tensor that does not fill whole bytes */
    AXL_ST_ERR_SIZE_MISMATCH = 32,     /* end - begin != bytes of dtype * shape; value = bytes */
    AXL_ST_ERR_DUPLICATE_NAME = 33,    /* two tensors of one name; other = the first */
    AXL_ST_ERR_GAP = 34,               /* unused bytes before the tensor; value = where it should begin */
    AXL_ST_ERR_OVERLAP = 35,           /* the tensor overlaps other; value = where it should begin */
    AXL_ST_ERR_SAME_BYTES = 36,        /* the tensor has the very bytes of other */
    AXL_ST_ERR_HEADER_BEYOND_FILE = 37, /* 8 + n > file_size */
    AXL_ST_ERR_TRUNCATED = 38,         /* the file ends inside the tensor's bytes; value = D */
    AXL_ST_ERR_TRAILING_BYTES = 39,    /* bytes after the last tensor's; value = D */
    AXL_ST_ERR_CAPACITY = 40,          /* a caller buffer is too small (status AXL_ERR_BAD_SIZE) */
    AXL_ST_ERROR_KIND_COUNT
} axl_st_error_kind;

/* Where a header went wrong. Tensors are named by index and by the byte span of their key
 * in the header, quotes included (so a caller can decode the name even when the call kept
 * no records); -1 when there is none. */
typedef struct axl_st_error {
    int64_t kind;       /* an axl_st_error_kind; AXL_ST_OK after success */
    int64_t position;   /* byte in the header where the problem is, -1 for file-level ones */
    int64_t tensor;     /* index of the tensor concerned in records (as left by the call:
                         * sorted as described at axl_st_header), or the index it would have
                         * had when found while parsing; -1 if none */
    int64_t tensor_pos, tensor_len; /* its key's span in the header */
    int64_t other;      /* a second tensor (duplicate, overlap), same conventions */
    int64_t other_pos, other_len;
    int64_t value;      /* a number for the message, as documented per kind; else 0 */
} axl_st_error;

/* One tensor of the header. */
typedef struct axl_st_tensor {
    int64_t name_off, name_len; /* the decoded name (UTF-8, may hold NUL) in names */
    int64_t key_pos, key_len;   /* the key's span in the header, quotes included */
    int64_t dtype;              /* an axl_st_dtype */
    int64_t ndim;               /* 0..AXL_ST_MAX_NDIM */
    int64_t dims_off;           /* shape = dims[dims_off .. dims_off + ndim) */
    int64_t begin, end;         /* data_offsets: bytes [8 + n + begin, 8 + n + end) of the file */
} axl_st_tensor;

/* Buffers in, results out of axl_st_parse_header. On success records[0 .. count) are
 * sorted by (begin, end) then key position, i.e. in file order. */
typedef struct axl_st_header {
    axl_st_tensor *records; /* in: records_cap entries, or NULL */
    int64_t records_cap;
    char *names;            /* in: names_cap bytes for the decoded names, or NULL */
    int64_t names_cap;
    int64_t *dims;          /* in: dims_cap entries for all tensors' shapes, or NULL */
    int64_t dims_cap;
    int64_t count;          /* out: tensors */
    int64_t names_used;     /* out: bytes of names used */
    int64_t dims_used;      /* out: entries of dims used */
    int64_t data_bytes;     /* out: D, the size of the data section (full mode only) */
    axl_st_error error;     /* out: AXL_ST_OK, or what went wrong */
} axl_st_header;

/* Validates the n bytes of header (those after the 8-byte length) of a file of file_size
 * bytes, against every rule above. AXL_OK; AXL_ERR_BAD_HEADER with out->error set;
 * AXL_ERR_NULL_POINTER (out NULL, header NULL with n > 0, or only some buffers given);
 * AXL_ERR_BAD_SIZE for n < 0, file_size < 0 or a negative cap, and, with error.kind
 * AXL_ST_ERR_CAPACITY, for a buffer found too small. The outputs hold partial results
 * after an error. */
AXL_API int axl_st_parse_header(const uint8_t *header, int64_t n, int64_t file_size,
                                axl_st_header *out);

/* Short English text of an axl_st_error_kind; never NULL ("unknown error kind" for others). */
AXL_API const char *axl_st_error_text(int kind);

/* The header string of an axl_st_dtype ("F32", ...); NULL for an unknown value. */
AXL_API const char *axl_st_dtype_name(int dtype);

/* Bits per element of an axl_st_dtype (4, 6, 8, 16, 32 or 64); 0 for an unknown value. */
AXL_API int axl_st_dtype_bits(int dtype);

#ifdef __cplusplus
}
#endif

#endif /* AUTOXLA_H */
