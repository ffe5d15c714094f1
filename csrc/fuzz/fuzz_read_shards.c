/* fuzz_read_shards.c - libFuzzer target for axl_read_shards, axl_read_shards_scratch_bytes
 * and axl_scatter_shards (autoxla.h).
 *
 * Input: 16 parameter bytes (fault, dtypes, ndim, shape, grid, offset, file length mode,
 * threads, isa, scratch mode), then the file's bytes. The file is written to a memfd (or a
 * temporary file) reused across iterations and read through its path. At most one
 * argument is made invalid on purpose ("fault"); the status must be one of the conditions
 * the arguments meet (fuzz_util.h). When the call succeeds every block must equal the
 * split computed here element by element from the definition in autoxla.h: a plain copy
 * for equal dtypes, axl_convert with the scalar ISA for the float pairs (the header
 * promises the same bits). The same tensor from memory goes through axl_scatter_shards,
 * with the same checks. Tensors hold at most 1 << 16 elements, in at most 4096 blocks. */
#define _GNU_SOURCE /* memfd_create */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fuzz_util.h"

#define MAX_NUMEL ((int64_t)1 << 16)
#define MAX_BLOCKS 4096

enum fault {
    F_SRC_DTYPE, F_MIXED_DTYPES, F_NDIM, F_NEG_SHAPE, F_GRID, F_THREADS, F_ISA,
    F_NEG_OFFSET, F_NULL_PATH, F_NULL_SCRATCH, F_NULL_BLOCK, F_MISALIGNED_BLOCK,
    F_MISALIGNED_SCRATCH, F_OVERLAP, F_NO_FILE, F_HUGE_OFFSET, F_NEG_SCRATCH, F_NULL_SHAPE,
    F_NONE /* this and above: no fault */
};

static int file_fd = -1;
static char file_path[64];

/* The iteration's file, holding exactly the n bytes of buf. */
static void write_file(const uint8_t *buf, size_t n) {
    if (file_fd < 0) {
        file_fd = memfd_create("fuzz_read_shards", MFD_CLOEXEC);
        if (file_fd >= 0) {
            snprintf(file_path, sizeof file_path, "/proc/self/fd/%d", file_fd);
            if (access(file_path, R_OK) != 0) { /* no /proc: fall back to a file */
                close(file_fd);
                file_fd = -1;
            }
        }
        if (file_fd < 0) {
            snprintf(file_path, sizeof file_path, "/tmp/fuzz_read_shards.%ld.XXXXXX",
                     (long)getpid());
            file_fd = mkstemp(file_path);
            if (file_fd < 0) {
                perror("fuzz_read_shards: temporary file");
                exit(1);
            }
            unlink(file_path); /* gone when the process ends; reopen by fd path below */
            snprintf(file_path, sizeof file_path, "/dev/fd/%d", file_fd);
        }
    }
    if (ftruncate(file_fd, 0) != 0) {
        perror("fuzz_read_shards: ftruncate");
        exit(1);
    }
    size_t done = 0;
    while (done < n) {
        ssize_t w = pwrite(file_fd, buf + done, n - done, (off_t)done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            perror("fuzz_read_shards: pwrite");
            exit(1);
        }
        done += (size_t)w;
    }
}

/* The d-th divisor (mod their count) of n >= 1. */
static int64_t pick_divisor(int64_t n, unsigned pick) {
    int64_t divs[256];
    int count = 0;
    for (int64_t i = 1; i * i <= n && count < 254; i++) {
        if (n % i) continue;
        divs[count++] = i;
        if (i != n / i) divs[count++] = n / i;
    }
    return divs[pick % (unsigned)count];
}

/* T of autoxla.h for a tensor of rows rows of row_bytes bytes. */
static int64_t read_threads(int nthreads, int64_t rows, int64_t row_bytes) {
    int64_t t = nthreads == 0 ? axl_num_cpus() : nthreads;
    if (t > AXL_MAX_THREADS) t = AXL_MAX_THREADS;
    int64_t min_rows = ((int64_t)1 << 20) / row_bytes + (((int64_t)1 << 20) % row_bytes != 0);
    int64_t by_size = rows / min_rows;
    if (by_size < 1) by_size = 1;
    return t < by_size ? t : by_size;
}

/* The expected blocks: element i of src (dense, src dtype) goes to block k at position j,
 * as autoxla.h defines them; converted with axl_convert (scalar) for float pairs. */
static void reference_split(const uint8_t *src, int src_dtype, int dst_dtype, int ndim,
                            const int64_t *shape, const int64_t *grid, int64_t numel,
                            int64_t nblocks, uint8_t **ref) {
    size_t ss = dtype_size(src_dtype), ds = dtype_size(dst_dtype);
    int64_t bsize[AXL_MAX_NDIM];
    for (int d = 0; d < ndim; d++) bsize[d] = shape[d] / grid[d];
    int64_t block_elems = numel / nblocks;
    uint8_t *tmp = xmalloc((size_t)block_elems * ss * (size_t)nblocks);
    for (int64_t i = 0; i < numel; i++) {
        int64_t rest = i, k = 0, j = 0, kmul = 1, jmul = 1;
        for (int d = ndim - 1; d >= 0; d--) {
            int64_t id = rest % shape[d];
            rest /= shape[d];
            k += (id / bsize[d]) * kmul;
            kmul *= grid[d];
            j += (id % bsize[d]) * jmul;
            jmul *= bsize[d];
        }
        memcpy(tmp + ((size_t)k * (size_t)block_elems + (size_t)j) * ss, src + (size_t)i * ss,
               ss);
    }
    for (int64_t k = 0; k < nblocks; k++) {
        const uint8_t *from = tmp + (size_t)k * (size_t)block_elems * ss;
        if (src_dtype == dst_dtype) {
            memcpy(ref[k], from, (size_t)block_elems * ds);
            continue;
        }
        int st = axl_convert(from, src_dtype, ref[k], dst_dtype, block_elems, 1,
                             AXL_ISA_SCALAR);
        if (st != AXL_OK) fail("reference axl_convert failed: %d", st);
    }
    free(tmp);
}

static void compare_blocks(const char *what, uint8_t **got, uint8_t **ref, int64_t nblocks,
                           size_t block_bytes) {
    for (int64_t k = 0; k < nblocks; k++) {
        if (memcmp(got[k], ref[k], block_bytes) == 0) continue;
        size_t b = 0;
        while (got[k][b] == ref[k][b]) b++;
        fail("%s: block %lld differs from the reference split at byte %zu (got 0x%02x, want "
             "0x%02x)",
             what, (long long)k, b, got[k][b], ref[k][b]);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_input in = {data, size};
    int fault = take(&in) % 32;
    if (fault > F_NONE) fault = F_NONE;

    int src_dtype = take(&in) % 5;
    uint8_t b = take(&in);
    int dst_dtype = (b & 0x80) || !is_float(src_dtype) ? src_dtype : b % 3;
    if (fault == F_SRC_DTYPE) src_dtype = (b & 1) ? -1 : 5 + b % 4;
    if (fault == F_MIXED_DTYPES) {
        src_dtype = (b & 1) ? AXL_I8 : AXL_F32;
        dst_dtype = (b & 1) ? AXL_F16 + (b & 2) / 2 * 2 : (b & 2) ? AXL_I8 : AXL_U8;
        if (src_dtype == AXL_I8 && dst_dtype == AXL_I8) dst_dtype = AXL_U8;
    }

    int ndim = 1 + take(&in) % AXL_MAX_NDIM;
    int64_t shape[AXL_MAX_NDIM + 1], grid[AXL_MAX_NDIM + 1];
    uint8_t shape_bytes[AXL_MAX_NDIM], grid_bytes[AXL_MAX_NDIM];
    for (int d = 0; d < AXL_MAX_NDIM; d++) shape_bytes[d] = take(&in);
    for (int d = 0; d < AXL_MAX_NDIM; d++) grid_bytes[d] = take(&in);
    for (int d = 0; d < ndim; d++) {
        b = shape_bytes[d];
        if (b == 0xFF) shape[d] = 0;
        else if (b >= 0xF0) shape[d] = 1 + (int64_t)(b - 0xF0) * 4099; /* long dims */
        else shape[d] = 1 + b % 16;
    }
    for (;;) { /* at most MAX_NUMEL elements, also in the non-zero dims of an empty
                * tensor (whose block counts must stay small): halve the largest dim */
        int64_t n = 1;
        int big = 0;
        for (int d = 0; d < ndim; d++) {
            if (shape[d]) n = n > MAX_NUMEL ? n : n * shape[d];
            if (shape[d] > shape[big]) big = d;
        }
        if (n <= MAX_NUMEL) break;
        shape[big] /= 2;
    }
    int64_t numel = 1, nblocks = 1;
    for (int d = 0; d < ndim; d++) {
        grid[d] = shape[d] ? pick_divisor(shape[d], grid_bytes[d]) : 1 + grid_bytes[d] % 4;
        numel *= shape[d];
    }
    for (int d = 0; d < ndim; d++) nblocks *= grid[d];
    for (int d = 0; nblocks > MAX_BLOCKS && d < ndim; d++) {
        nblocks /= grid[d];
        grid[d] = 1;
    }

    size_t ss = dtype_size(src_dtype), ds = dtype_size(dst_dtype);
    int64_t offset = take(&in), data_offset = offset; /* the argument may be made bad */
    int file_mode = take(&in) % 4;
    int nthreads = take(&in) % 4;
    int isa = take(&in) % 4;
    int scratch_mode = take(&in) % 4;
    uint8_t extra = take(&in);

    /* The file: the rest of the input, or that extended to the tensor's end (and beyond,
     * or cut short) so that large tensors are read too. */
    int64_t tensor_bytes = ss ? numel * (int64_t)ss : 0;
    int64_t need = offset + tensor_bytes;
    int64_t flen = (int64_t)in.n;
    if (file_mode == 1) flen = need;
    if (file_mode == 2) flen = need - 1 - extra % 8 < 0 ? 0 : need - 1 - extra % 8;
    if (file_mode == 3) flen = need + extra % 8;
    int64_t glen = flen > need ? flen : need;
    uint8_t *content = xmalloc((size_t)glen);
    for (int64_t i = 0; i < glen; i++) content[i] = stream_byte(in.p, in.n, (size_t)i);
    write_file(content, (size_t)flen);

    /* Rows of dim 0 and their bytes, before a fault may change the shape. */
    int64_t rows = numel ? shape[0] : 0, row_bytes = numel && ss ? tensor_bytes / rows : 0;

    /* The one argument made invalid, if any (after the file and sizes are fixed). */
    int64_t *shape_arg = shape;
    if (fault == F_NDIM) ndim = (extra & 1) ? 0 : (extra & 2) ? -1 : AXL_MAX_NDIM + 1;
    if (fault == F_NDIM && ndim == AXL_MAX_NDIM + 1) {
        shape[AXL_MAX_NDIM] = 1;
        grid[AXL_MAX_NDIM] = 1;
    }
    if (fault == F_NEG_SHAPE) shape[extra % ndim] = -1 - (extra & 3);
    if (fault == F_GRID) {
        int d = extra % ndim;
        grid[d] = (extra & 0x80) || shape[d] == 0 ? -(int64_t)(extra & 1) : shape[d] + 1;
    }
    if (fault == F_THREADS) nthreads = -1 - (extra & 7);
    if (fault == F_ISA) isa = (extra & 1) ? -1 : AXL_ISA_COUNT + extra % 3;
    if (fault == F_NEG_OFFSET) offset = -1 - (int64_t)extra;
    if (fault == F_HUGE_OFFSET) /* offset + the tensor's bytes just above INT64_MAX */
        offset = tensor_bytes > 0 ? INT64_MAX - tensor_bytes + 1 + (tensor_bytes > 1 && extra & 1)
                                  : INT64_MAX; /* (valid for an empty tensor) */
    if (fault == F_NULL_SHAPE) shape_arg = NULL;

    /* Status conditions of the arguments, for both entry points. */
    uint32_t common = 0;
    int dtypes_ok = (is_float(src_dtype) && is_float(dst_dtype)) ||
                    (src_dtype == dst_dtype && (src_dtype == AXL_I8 || src_dtype == AXL_U8));
    if (!dtypes_ok) common |= BIT(AXL_ERR_BAD_DTYPE);
    if (ndim < 1 || ndim > AXL_MAX_NDIM) common |= BIT(AXL_ERR_BAD_SIZE);
    if (fault == F_NEG_SHAPE || fault == F_GRID) common |= BIT(AXL_ERR_BAD_SIZE);
    if (fault == F_NULL_SHAPE) common |= BIT(AXL_ERR_NULL_POINTER);
    if (nthreads < 0) common |= BIT(AXL_ERR_BAD_THREADS);
    if (!isa_available(isa)) common |= BIT(AXL_ERR_UNSUPPORTED_ISA);
    int structural = common != 0; /* then nothing below is looked at */
    int valid_shape = ndim >= 1 && ndim <= AXL_MAX_NDIM && fault != F_NEG_SHAPE &&
                      fault != F_NULL_SHAPE;

    /* axl_read_shards_scratch_bytes: checked against autoxla.h, then the scratch size. */
    int64_t threads = numel && ss && nthreads >= 0 ? read_threads(nthreads, rows, row_bytes) : 1;
    int64_t sb = axl_read_shards_scratch_bytes(src_dtype, ndim, shape_arg, nthreads);
    {
        uint32_t m = 0;
        if (src_dtype < 0 || src_dtype >= AXL_DTYPE_COUNT) m |= BIT(AXL_ERR_BAD_DTYPE);
        if (!valid_shape) m |= BIT(AXL_ERR_BAD_SIZE) | BIT(AXL_ERR_NULL_POINTER);
        if (fault == F_NULL_SHAPE) m = (m & ~BIT(AXL_ERR_BAD_SIZE)) | BIT(AXL_ERR_NULL_POINTER);
        if (nthreads < 0) m |= BIT(AXL_ERR_BAD_THREADS);
        if (fault == F_NDIM || fault == F_NEG_SHAPE) m &= ~BIT(AXL_ERR_NULL_POINTER);
        if (m) {
            if (sb >= 0) fail("scratch_bytes gave %lld for bad arguments (mask 0x%x)",
                              (long long)sb, m);
            expect_status("axl_read_shards_scratch_bytes", (int)-sb, m);
        } else if (numel == 0 ? sb != 0
                              : sb < threads * row_bytes || sb % row_bytes ||
                                    sb > tensor_bytes ||
                                    (row_bytes <= (8 << 20) && sb > threads * (8 << 20))) {
            fail("scratch_bytes gave %lld for %lld rows of %lld bytes, T = %lld", (long long)sb,
                 (long long)rows, (long long)row_bytes, (long long)threads);
        }
    }
    int64_t scratch_bytes = sb > 0 ? sb : 0;
    if (scratch_mode == 1) scratch_bytes = threads * row_bytes;
    if (scratch_mode == 2) scratch_bytes += (int64_t)(extra % 16) * (int64_t)(ss ? ss : 1);
    if (scratch_mode == 3) scratch_bytes = threads * row_bytes - 1 - extra % 4; /* too small */
    if (scratch_bytes < 0) scratch_bytes = 0;
    if (fault == F_NEG_SCRATCH) scratch_bytes = -1 - (int64_t)extra;

    /* Buffers, each of its exact size. */
    int64_t block_elems = numel && !structural ? numel / nblocks : 0;
    size_t block_bytes = (size_t)block_elems * ds;
    int64_t nalloc = structural || numel == 0 ? 0 : nblocks;
    uint8_t **blocks = xmalloc(sizeof *blocks * (size_t)(nalloc + 1));
    uint8_t **ref = xmalloc(sizeof *ref * (size_t)(nalloc + 1));
    void **dsts = xmalloc(sizeof *dsts * (size_t)(nalloc + 1));
    for (int64_t k = 0; k < nalloc; k++) {
        blocks[k] = xmalloc(block_bytes);
        ref[k] = xmalloc(block_bytes);
        dsts[k] = blocks[k];
    }
    size_t scratch_alloc = scratch_bytes > 0 ? (size_t)scratch_bytes : 0;
    uint8_t *scratch_mem = xmalloc(scratch_alloc + 1);
    void *scratch = scratch_mem;
    uint8_t *src_mem = xmalloc((size_t)(tensor_bytes > 0 ? tensor_bytes : 0) + 1);
    void *src = src_mem;
    if (tensor_bytes > 0) memcpy(src_mem, content + data_offset, (size_t)tensor_bytes);

    const char *path = file_path;
    uint32_t rd = common, sc = common; /* read_shards, scatter_shards */
    if (fault == F_NEG_OFFSET || (fault == F_HUGE_OFFSET && tensor_bytes > 0) ||
        fault == F_NEG_SCRATCH)
        rd |= BIT(AXL_ERR_BAD_SIZE);
    int work = !structural && numel > 0;
    if (fault == F_NULL_PATH) path = NULL;
    if (fault == F_NO_FILE) path = "/nonexistent/fuzz_read_shards/no such file";
    if (fault == F_NULL_SCRATCH) {
        scratch = NULL;
        src = NULL;
    }
    if (fault == F_NULL_BLOCK && nalloc > 0) dsts[extra % nalloc] = NULL;
    if (fault == F_MISALIGNED_BLOCK && nalloc > 0 && ds > 1) {
        int64_t k = extra % nalloc;
        free(blocks[k]);
        blocks[k] = xmalloc(block_bytes + 1);
        dsts[k] = blocks[k] + 1;
    }
    if (fault == F_MISALIGNED_SCRATCH && ss > 1) {
        free(scratch_mem);
        scratch_mem = xmalloc(scratch_alloc + 1);
        scratch = scratch_mem + 1;
        free(src_mem);
        src_mem = xmalloc((size_t)tensor_bytes + 1);
        src = src_mem + 1;
        memcpy(src, content + data_offset, (size_t)tensor_bytes);
    }
    if (fault == F_OVERLAP && nalloc > 0) {
        if (nalloc >= 2) {
            int64_t k = 1 + extra % (nalloc - 1);
            dsts[k] = dsts[k - 1]; /* two blocks on the same memory */
        } else {
            dsts[0] = scratch; /* the block on the scratch (or src) buffer */
            src = scratch;
        }
    }
    if (work) {
        /* Conditions only looked at when there is work (autoxla.h: a tensor with 0
         * elements is valid, no pointer is looked at and no file opened). */
        if (scratch_bytes >= 0 && scratch_bytes / threads < row_bytes) rd |= BIT(AXL_ERR_BAD_SIZE);
        if (!path || !scratch) rd |= BIT(AXL_ERR_NULL_POINTER);
        if (!src) sc |= BIT(AXL_ERR_NULL_POINTER);
        for (int64_t k = 0; k < nalloc; k++) {
            if (!dsts[k]) {
                rd |= BIT(AXL_ERR_NULL_POINTER);
                sc |= BIT(AXL_ERR_NULL_POINTER);
            } else if ((uintptr_t)dsts[k] % ds) {
                rd |= BIT(AXL_ERR_MISALIGNED);
                sc |= BIT(AXL_ERR_MISALIGNED);
            }
        }
        if (scratch && (uintptr_t)scratch % ss) rd |= BIT(AXL_ERR_MISALIGNED);
        if (src && (uintptr_t)src % ss) sc |= BIT(AXL_ERR_MISALIGNED);
        for (int64_t k = 0; k < nalloc; k++) {
            if (!dsts[k]) continue;
            if (scratch && ranges_overlap(dsts[k], block_bytes, scratch, (size_t)scratch_bytes))
                rd |= BIT(AXL_ERR_OVERLAP);
            if (src && ranges_overlap(dsts[k], block_bytes, src, (size_t)tensor_bytes))
                sc |= BIT(AXL_ERR_OVERLAP);
            if (k > 0 && dsts[k - 1] && ranges_overlap(dsts[k], block_bytes, dsts[k - 1],
                                                       block_bytes)) {
                rd |= BIT(AXL_ERR_OVERLAP);
                sc |= BIT(AXL_ERR_OVERLAP);
            }
        }
        if (fault == F_NO_FILE || flen < need) rd |= BIT(AXL_ERR_IO);
    }

    if (work && (rd == 0 || sc == 0))
        reference_split(content + data_offset, src_dtype, dst_dtype, ndim, shape, grid, numel,
                        nblocks, ref);

    for (int64_t k = 0; k < nalloc; k++) memset(blocks[k], 0xA5, block_bytes);
    int st = axl_read_shards(path, offset, src_dtype, ndim, shape_arg, grid,
                             (void *const *)dsts, dst_dtype, scratch, scratch_bytes, nthreads,
                             isa);
    expect_status("axl_read_shards", st, rd);
    if (st == AXL_OK && work) compare_blocks("axl_read_shards", blocks, ref, nalloc, block_bytes);

    /* The same tensor from memory (the read-only faults leave its arguments valid). */
    for (int64_t k = 0; k < nalloc; k++) memset(blocks[k], 0x5A, block_bytes);
    st = axl_scatter_shards(src, src_dtype, ndim, shape_arg, grid, (void *const *)dsts,
                            dst_dtype, nthreads, isa);
    expect_status("axl_scatter_shards", st, sc);
    if (st == AXL_OK && work) compare_blocks("axl_scatter_shards", blocks, ref, nalloc, block_bytes);

    for (int64_t k = 0; k < nalloc; k++) {
        free(blocks[k]);
        free(ref[k]);
    }
    free(blocks);
    free(ref);
    free(dsts);
    free(scratch_mem);
    free(src_mem);
    free(content);
    return 0;
}
