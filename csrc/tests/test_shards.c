/* test_shards.c - axl_scatter_shards and axl_read_shards against a naive per-element
 * reference (for ndim 1..4, every grid of small shapes, odd shapes, all 9 float dtype pairs
 * and the I8 / U8 copies,
 * every ISA this CPU has, 1/2/3/all threads), read_shards from a file at a non-zero offset,
 * truncated and missing files, scratch sizes, and bad arguments. axl_read_blocks and
 * axl_block_ranges likewise, for subsets of the blocks (all of them for up to 4 blocks),
 * with their ranges checked against ranges found element by element. */
#define _POSIX_C_SOURCE 200809L /* mkstemp, ftruncate */
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"
#include "test.h"

#define MAX_BLOCKS 4096
#define GUARD 64 /* bytes after each block that must stay untouched */
#define GUARD_BYTE 0xA5

static const int float_dtypes[] = {AXL_F32, AXL_BF16, AXL_F16};
static const int int_dtypes[] = {AXL_I8, AXL_U8}; /* copied to themselves only */
static const char *const dtype_names[] = {"f32", "bf16", "f16", "i8", "u8"};
static const int thread_counts[] = {1, 2, 3, 0};

static uint64_t rng_state = 0x2545F4914F6CDD1Du;
static uint32_t rng_u32(void) { return axl_test_rng(&rng_state); }

static int isa_available(int isa) {
    return axl_convert(NULL, AXL_F32, NULL, AXL_F32, 0, 1, isa) == AXL_OK;
}

static int64_t prod(const int64_t *v, int n) {
    int64_t p = 1;
    for (int i = 0; i < n; i++) p *= v[i];
    return p;
}

static void format_dims(char *out, size_t size, const int64_t *v, int n) {
    size_t at = 0;
    out[0] = 0;
    for (int i = 0; i < n && at < size; i++)
        at += (size_t)snprintf(out + at, size - at, i ? "x%lld" : "%lld", (long long)v[i]);
}

/* ---- the naive reference ---------------------------------------------------------------
 * The whole tensor converted by the scalar axl_convert, then each element copied on its
 * own to block sum_d (i[d] / b[d]) * prod(grid[d+1..]) at offset sum_d (i[d] % b[d]) *
 * prod(b[d+1..]), b = shape / grid. */
typedef struct blocks {
    int64_t count, elems; /* blocks, elements per block */
    size_t ds;
    char *mem;            /* count blocks of elems * ds + GUARD bytes each */
    void *ptrs[MAX_BLOCKS];
} blocks;

static void blocks_init(blocks *b, const int64_t *shape, const int64_t *grid, int ndim,
                        int dtype) {
    b->count = prod(grid, ndim);
    b->elems = prod(shape, ndim) / b->count;
    b->ds = axl_dtype_size(dtype);
    size_t stride = (size_t)b->elems * b->ds + GUARD;
    b->mem = xmalloc(stride * (size_t)b->count);
    memset(b->mem, GUARD_BYTE, stride * (size_t)b->count);
    for (int64_t k = 0; k < b->count; k++) b->ptrs[k] = b->mem + (size_t)k * stride;
}

/* Index of the first block that differs from want (or whose guard was written), or -1. */
static int64_t blocks_diff(const blocks *got, const blocks *want) {
    for (int64_t k = 0; k < got->count; k++) {
        size_t n = (size_t)got->elems * got->ds;
        if (memcmp(got->ptrs[k], want->ptrs[k], n) != 0) return k;
        const unsigned char *guard = (const unsigned char *)got->ptrs[k] + n;
        for (size_t i = 0; i < GUARD; i++)
            if (guard[i] != GUARD_BYTE) return k;
    }
    return -1;
}

static void reference(const void *src, int sd, const int64_t *shape, const int64_t *grid,
                      int ndim, int dd, blocks *out) {
    int64_t numel = prod(shape, ndim);
    size_t ds = axl_dtype_size(dd);
    char *converted = xmalloc((size_t)numel * ds);
    if (sd == dd) /* also I8 and U8, which axl_convert does not take */
        memcpy(converted, src, (size_t)numel * ds);
    else
        CHECK_EQ(axl_convert(src, sd, converted, dd, numel, 1, AXL_ISA_SCALAR), AXL_OK);
    int64_t b[AXL_MAX_NDIM];
    for (int d = 0; d < ndim; d++) b[d] = shape[d] / grid[d];
    for (int64_t e = 0; e < numel; e++) {
        int64_t rest = e, k = 0, at = 0, kmul = 1, amul = 1;
        for (int d = ndim - 1; d >= 0; d--) {
            int64_t i = rest % shape[d];
            rest /= shape[d];
            k += i / b[d] * kmul;
            at += i % b[d] * amul;
            kmul *= grid[d];
            amul *= b[d];
        }
        memcpy((char *)out->ptrs[k] + (size_t)at * ds, converted + (size_t)e * ds, ds);
    }
    free(converted);
}

/* numel random source elements of dtype: all bit patterns, NaNs included. */
static void *random_source(int dtype, int64_t numel) {
    size_t bytes = (size_t)numel * axl_dtype_size(dtype);
    uint32_t *p = xmalloc((bytes + 3) / 4 * 4);
    for (size_t i = 0; i < (bytes + 3) / 4; i++) p[i] = rng_u32();
    return p;
}

/* ---- files ------------------------------------------------------------------------------ */

/* A temp file holding `offset` bytes of junk, then bytes of data, then `tail` junk bytes.
 * Writes its path to path (PATH_SIZE bytes); returns 1 on success. */
#define PATH_SIZE 256
static int write_temp_file(char *path, int64_t offset, const void *data, size_t bytes,
                           size_t tail) {
    const char *dir = getenv("TMPDIR");
    snprintf(path, PATH_SIZE, "%s/axl_test_shards_XXXXXX", dir && *dir ? dir : "/tmp");
    int fd = mkstemp(path);
    if (fd < 0) return 0;
    unsigned char junk[64];
    memset(junk, 0x5A, sizeof junk);
    int ok = 1;
    for (int64_t i = 0; i < offset && ok; i += (int64_t)sizeof junk) {
        size_t n = offset - i < (int64_t)sizeof junk ? (size_t)(offset - i) : sizeof junk;
        ok = write(fd, junk, n) == (ssize_t)n;
    }
    for (size_t at = 0; at < bytes && ok;) {
        ssize_t n = write(fd, (const char *)data + at, bytes - at);
        ok = n > 0;
        at += ok ? (size_t)n : 0;
    }
    for (size_t i = 0; i < tail && ok; i += sizeof junk) {
        size_t n = tail - i < sizeof junk ? tail - i : sizeof junk;
        ok = write(fd, junk, n) == (ssize_t)n;
    }
    ok &= close(fd) == 0;
    if (!ok) unlink(path);
    return ok;
}

/* The lowest free file descriptor: unchanged across calls unless a call leaks one. */
static int lowest_free_fd(void) {
    int fd = open("/dev/null", O_RDONLY);
    if (fd >= 0) close(fd);
    return fd;
}

/* T of autoxla.h, as documented there: the threads axl_read_shards uses, and the rows of
 * scratch it needs. */
static int64_t read_threads(int nthreads, int64_t rows, int64_t row_bytes) {
    int64_t t = nthreads ? nthreads : axl_num_cpus();
    if (t > AXL_MAX_THREADS) t = AXL_MAX_THREADS;
    int64_t by_size = rows / ((((int64_t)1 << 20) + row_bytes - 1) / row_bytes);
    return t < by_size ? t : by_size < 1 ? 1 : by_size;
}

/* ---- one case: scatter and read against the reference ----------------------------------- */

typedef struct case_opts {
    int all_isas;    /* every ISA (else AUTO only) */
    int all_threads; /* thread counts 1, 2, 3, 0 (else 1) */
    int read;        /* also axl_read_shards from a file */
    int ints;        /* the I8 and U8 copies instead of the float pairs */
} case_opts;

static void check_case(const int64_t *shape, const int64_t *grid, int ndim, case_opts opts) {
    char what[160], s[64], g[64];
    format_dims(s, sizeof s, shape, ndim);
    format_dims(g, sizeof g, grid, ndim);
    int64_t numel = prod(shape, ndim);
    for (int a = 0; a < (opts.ints ? 2 : 3); a++) {
        int sd = opts.ints ? int_dtypes[a] : float_dtypes[a];
        size_t ss = axl_dtype_size(sd);
        void *src = random_source(sd, numel);
        char path[PATH_SIZE];
        int64_t offset = 37; /* odd: the file offset has no alignment to keep */
        int have_file = opts.read && write_temp_file(path, offset, src, (size_t)numel * ss, 5);
        if (opts.read) CHECK_MSG(have_file, "cannot write a temp file for %s", s);
        for (int b = 0; b < (opts.ints ? 1 : 3); b++) {
            int dd = opts.ints ? sd : float_dtypes[b];
            blocks want, got;
            blocks_init(&want, shape, grid, ndim, dd);
            blocks_init(&got, shape, grid, ndim, dd);
            reference(src, sd, shape, grid, ndim, dd, &want);
            for (int isa = opts.all_isas ? AXL_ISA_SCALAR : AXL_ISA_AUTO; isa < AXL_ISA_COUNT;
                 isa++) {
                if (!isa_available(isa)) continue;
                for (size_t t = 0; t < (opts.all_threads ? 4u : 1u); t++) {
                    int nthreads = thread_counts[t];
                    snprintf(what, sizeof what, "shape %s grid %s %s->%s isa %s nthreads %d", s,
                             g, dtype_names[sd], dtype_names[dd], axl_isa_name(isa), nthreads);
                    memset(got.mem, GUARD_BYTE, ((size_t)got.elems * got.ds + GUARD) *
                                                    (size_t)got.count);
                    int status = axl_scatter_shards(src, sd, ndim, shape, grid, got.ptrs, dd,
                                                    nthreads, isa);
                    int64_t k = status == AXL_OK ? blocks_diff(&got, &want) : -1;
                    CHECK_MSG(status == AXL_OK && k < 0, "scatter %s: status %d, block %lld",
                              what, status, (long long)k);
                    if (!have_file) continue;

                    /* The least scratch the call takes, the default, and a lot more. */
                    int64_t best = axl_read_shards_scratch_bytes(sd, ndim, shape, nthreads);
                    int64_t row = numel / shape[0] * (int64_t)ss;
                    CHECK_MSG(best >= row && best % row == 0, "%s: scratch %lld, row %lld", what,
                              (long long)best, (long long)row);
                    int64_t fewest = read_threads(nthreads, shape[0], row) * row;
                    CHECK_MSG(fewest <= best, "%s: least scratch %lld > %lld", what,
                              (long long)fewest, (long long)best);
                    /* Past 4096 rows, one pread per row (per element for ndim 1) takes
                     * long: the smallest scratch then holds 61 rows per thread. */
                    int64_t small = shape[0] > 4096 ? fewest * 61 : fewest;
                    const int64_t sizes[] = {small, best, best * 3 + (int64_t)ss};
                    char *scratch = xmalloc((size_t)sizes[2]);
                    for (size_t z = 0; z < 3; z++) {
                        memset(got.mem, GUARD_BYTE, ((size_t)got.elems * got.ds + GUARD) *
                                                        (size_t)got.count);
                        status = axl_read_shards(path, offset, sd, ndim, shape, grid, got.ptrs,
                                                 dd, scratch, sizes[z], nthreads, isa);
                        k = status == AXL_OK ? blocks_diff(&got, &want) : -1;
                        CHECK_MSG(status == AXL_OK && k < 0,
                                  "read %s scratch %lld: status %d, block %lld", what,
                                  (long long)sizes[z], status, (long long)k);
                        if (z == 0 && fewest > (int64_t)ss) /* one element too small */
                            CHECK_EQ(axl_read_shards(path, offset, sd, ndim, shape, grid,
                                                     got.ptrs, dd, scratch, fewest - (int64_t)ss,
                                                     nthreads, isa),
                                     AXL_ERR_BAD_SIZE);
                    }
                    free(scratch);
                }
            }
            free(want.mem);
            free(got.mem);
        }
        if (have_file) unlink(path);
        free(src);
    }
}

/* Every grid of divisors of shape (grid[d] | shape[d], from all-ones to full splits). */
static void check_all_grids(const int64_t *shape, int ndim, case_opts opts) {
    int64_t grid[AXL_MAX_NDIM];
    for (int d = 0; d < ndim; d++) grid[d] = 1;
    for (;;) {
        if (prod(grid, ndim) <= MAX_BLOCKS) check_case(shape, grid, ndim, opts);
        int d = ndim - 1; /* the next grid: an odometer over the divisors */
        for (; d >= 0; d--) {
            do grid[d]++;
            while (grid[d] <= shape[d] && shape[d] % grid[d]);
            if (grid[d] <= shape[d]) break;
            grid[d] = 1;
        }
        if (d < 0) return;
    }
}

static void test_small_shapes(void) {
    /* Every grid, every ISA, every thread count, and read_shards too. */
    const case_opts all = {1, 1, 1, 0};
    const int64_t s1[] = {12}, s2[] = {6, 4}, s3[] = {4, 3, 2}, s4[] = {2, 3, 1, 4};
    check_all_grids(s1, 1, all);
    check_all_grids(s2, 2, all);
    check_all_grids(s3, 3, all);
    check_all_grids(s4, 4, all);
    /* Odd and prime sizes, size-1 dims; every grid with AUTO and one thread. */
    const case_opts quick = {0, 0, 1, 0};
    const int64_t o1[] = {1}, o2[] = {7}, o3[] = {7, 5}, o4[] = {1, 9}, o5[] = {5, 1, 6},
                  o6[] = {3, 5, 7, 2}, o7[] = {1, 1, 1, 1}, o8[] = {9, 1, 1, 10},
                  o9[] = {2, 15, 6, 1};
    check_all_grids(o1, 1, quick);
    check_all_grids(o2, 1, quick);
    check_all_grids(o3, 2, quick);
    check_all_grids(o4, 2, quick);
    check_all_grids(o5, 3, quick);
    check_all_grids(o6, 4, quick);
    check_all_grids(o7, 4, quick);
    check_all_grids(o8, 4, quick);
    check_all_grids(o9, 4, quick);
}

/* Tensors large enough to use several threads (scatter: 2^16 elements; read: 2 MiB), with
 * grids that split rows, columns, both, and nothing. */
static void test_large_shapes(void) {
    const case_opts all = {1, 1, 1, 0};
    typedef struct {
        int ndim;
        int64_t shape[4], grid[4];
    } big;
    const big cases[] = {
        {2, {1024, 520}, {1, 8}},  {2, {1024, 520}, {8, 1}},   {2, {1024, 520}, {4, 2}},
        {2, {1024, 520}, {1, 1}},  {2, {1024, 520}, {1, 520}}, {2, {3, 200000}, {1, 8}},
        {1, {600000}, {8}},        {1, {600001}, {1}},         {3, {8, 256, 130}, {8, 1, 2}},
        {4, {2, 4, 96, 200}, {1, 2, 1, 8}}, {2, {131, 4099}, {131, 1}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        check_case(cases[i].shape, cases[i].grid, cases[i].ndim, all);
}

/* I8 and U8 blocks (quantized weights and their packed nibbles) are plain copies: small
 * shapes with every grid, and large ones split over threads, scattered and read. */
static void test_integer_copies(void) {
    const case_opts all = {1, 1, 1, 1};
    const int64_t s2[] = {6, 4}, s3[] = {4, 3, 2}, o3[] = {7, 5};
    check_all_grids(s2, 2, all);
    check_all_grids(s3, 3, all);
    check_all_grids(o3, 2, all);
    const int64_t big[] = {1024, 520}, grid_cols[] = {1, 8}, grid_rows[] = {8, 1};
    check_case(big, grid_cols, 2, all);
    check_case(big, grid_rows, 2, all);
}

/* ---- files that are missing or too short -------------------------------------------------- */

static void test_bad_files(void) {
    const int64_t shape[] = {300, 1000}, grid[] = {2, 4};
    int64_t numel = shape[0] * shape[1];
    size_t bytes = (size_t)numel * 2;
    void *src = random_source(AXL_BF16, numel);
    blocks got;
    blocks_init(&got, shape, grid, 2, AXL_F32);
    int64_t scratch_bytes = axl_read_shards_scratch_bytes(AXL_BF16, 2, shape, 0);
    char *scratch = xmalloc((size_t)scratch_bytes);
    char path[PATH_SIZE];
    int fds = lowest_free_fd();

    if (write_temp_file(path, 8, src, bytes, 0)) {
        for (size_t t = 0; t < 4; t++) {
            int nt = thread_counts[t];
            CHECK_EQ(axl_read_shards(path, 8, AXL_BF16, 2, shape, grid, got.ptrs, AXL_F32,
                                     scratch, scratch_bytes, nt, 0),
                     AXL_OK);
            /* The data starts one byte later: the file ends one byte early. */
            CHECK_EQ(axl_read_shards(path, 9, AXL_BF16, 2, shape, grid, got.ptrs, AXL_F32,
                                     scratch, scratch_bytes, nt, 0),
                     AXL_ERR_IO);
            /* An offset past the end of the file. */
            CHECK_EQ(axl_read_shards(path, (int64_t)bytes * 4, AXL_BF16, 2, shape, grid,
                                     got.ptrs, AXL_F32, scratch, scratch_bytes, nt, 0),
                     AXL_ERR_IO);
        }
        /* Truncated to half, and to nothing. */
        const off_t lengths[] = {(off_t)bytes / 2 + 1, 8, 0};
        for (size_t i = 0; i < 3; i++) {
            CHECK(truncate(path, lengths[i]) == 0);
            for (size_t t = 0; t < 4; t++)
                CHECK_EQ(axl_read_shards(path, 8, AXL_BF16, 2, shape, grid, got.ptrs, AXL_F32,
                                         scratch, scratch_bytes, thread_counts[t], 0),
                         AXL_ERR_IO);
        }
        unlink(path);
        /* Now missing. */
        CHECK_EQ(axl_read_shards(path, 8, AXL_BF16, 2, shape, grid, got.ptrs, AXL_F32, scratch,
                                 scratch_bytes, 0, 0),
                 AXL_ERR_IO);
    } else {
        CHECK_MSG(0, "cannot write a temp file");
    }
    CHECK_EQ(axl_read_shards("/nonexistent/axl/shards.safetensors", 0, AXL_BF16, 2, shape,
                             grid, got.ptrs, AXL_F32, scratch, scratch_bytes, 1, 0),
             AXL_ERR_IO);
    CHECK_EQ(axl_read_shards("", 0, AXL_BF16, 2, shape, grid, got.ptrs, AXL_F32, scratch,
                             scratch_bytes, 1, 0),
             AXL_ERR_IO);
    /* A directory opens read-only, but reading it fails. */
    CHECK_EQ(axl_read_shards("/", 0, AXL_BF16, 2, shape, grid, got.ptrs, AXL_F32, scratch,
                             scratch_bytes, 1, 0),
             AXL_ERR_IO);
    /* A FIFO with no writer: a blocking open would wait forever; refused at once. */
    char fifo[PATH_SIZE];
    snprintf(fifo, sizeof fifo, "/tmp/axl-test-fifo-%ld", (long)getpid());
    unlink(fifo);
    if (mkfifo(fifo, 0600) == 0) {
        CHECK_EQ(axl_read_shards(fifo, 0, AXL_BF16, 2, shape, grid, got.ptrs, AXL_F32, scratch,
                                 scratch_bytes, 1, 0),
                 AXL_ERR_IO);
        unlink(fifo);
    } else {
        CHECK_MSG(0, "cannot make a FIFO in /tmp");
    }
    CHECK_MSG(lowest_free_fd() == fds, "file descriptors leaked: lowest free %d, was %d",
              lowest_free_fd(), fds);
    free(scratch);
    free(got.mem);
    free(src);
}

/* More than 1 MiB per thread, so read_shards starts workers; with thread creation failing
 * it returns AXL_ERR_RESOURCE, and closes its file. So does scatter_shards. */
static void test_thread_failure(void) {
    const int64_t shape[] = {2048, 1024}, grid[] = {2, 2};
    int64_t numel = shape[0] * shape[1];
    void *src = random_source(AXL_F32, numel);
    blocks got;
    blocks_init(&got, shape, grid, 2, AXL_BF16);
    int64_t scratch_bytes = axl_read_shards_scratch_bytes(AXL_F32, 2, shape, 4);
    char *scratch = xmalloc((size_t)scratch_bytes);
    char path[PATH_SIZE];
    int fds = lowest_free_fd();
    axl_test_fail_thread_creates(0);
    CHECK_EQ(axl_scatter_shards(src, AXL_F32, 2, shape, grid, got.ptrs, AXL_BF16, 4, 0),
             AXL_ERR_RESOURCE);
    if (write_temp_file(path, 0, src, (size_t)numel * 4, 0)) {
        CHECK_EQ(axl_read_shards(path, 0, AXL_F32, 2, shape, grid, got.ptrs, AXL_BF16, scratch,
                                 scratch_bytes, 4, 0),
                 AXL_ERR_RESOURCE);
        axl_test_fail_thread_creates(-1);
        CHECK_EQ(axl_read_shards(path, 0, AXL_F32, 2, shape, grid, got.ptrs, AXL_BF16, scratch,
                                 scratch_bytes, 4, 0),
                 AXL_OK);
        unlink(path);
    }
    axl_test_fail_thread_creates(-1);
    CHECK_MSG(lowest_free_fd() == fds, "file descriptors leaked: lowest free %d, was %d",
              lowest_free_fd(), fds);
    free(scratch);
    free(got.mem);
    free(src);
}

/* ---- scratch sizes ---------------------------------------------------------------------- */

static void test_scratch_bytes(void) {
    const int64_t big[] = {8192, 14336}; /* 224 MiB of bf16: a 28 KiB row */
    int64_t row = 14336 * 2;
    for (int t = 1; t <= 8; t++) /* T threads of 8 MiB of whole rows each */
        CHECK_EQ(axl_read_shards_scratch_bytes(AXL_BF16, 2, big, t),
                 (int64_t)t * ((8 << 20) / row) * row);
    /* 256 threads: T = 8192 / ceil(1 MiB / row) = 221, each with 8192 / 221 rows. */
    CHECK_EQ(axl_read_shards_scratch_bytes(AXL_BF16, 2, big, 1000), 221 * (8192 / 221) * row);
    const int64_t small[] = {10, 10}; /* 400 bytes: one thread, all rows */
    CHECK_EQ(axl_read_shards_scratch_bytes(AXL_F32, 2, small, 0), 400);
    const int64_t fat[] = {3, 1 << 22}; /* rows of 16 MiB: one row per thread, T = rows */
    CHECK_EQ(axl_read_shards_scratch_bytes(AXL_F32, 2, fat, 8), 3 * ((int64_t)16 << 20));
    const int64_t vec[] = {1 << 20}; /* ndim 1: a row is one element; 2 MiB -> 2 threads */
    CHECK_EQ(axl_read_shards_scratch_bytes(AXL_F16, 1, vec, 8), 2 * ((int64_t)1 << 20));
    const int64_t empty[] = {0, 5};
    CHECK_EQ(axl_read_shards_scratch_bytes(AXL_F16, 2, empty, 8), 0);
    CHECK_EQ(axl_read_shards_scratch_bytes(AXL_I8, 2, big, 1), ((8 << 20) / (row / 2)) * (row / 2));
    CHECK_EQ(axl_read_shards_scratch_bytes(-1, 2, big, 1), -AXL_ERR_BAD_DTYPE);
    CHECK_EQ(axl_read_shards_scratch_bytes(AXL_DTYPE_COUNT, 2, big, 1), -AXL_ERR_BAD_DTYPE);
    CHECK_EQ(axl_read_shards_scratch_bytes(AXL_BF16, 0, big, 1), -AXL_ERR_BAD_SIZE);
    CHECK_EQ(axl_read_shards_scratch_bytes(AXL_BF16, 9, big, 1), -AXL_ERR_BAD_SIZE);
    CHECK_EQ(axl_read_shards_scratch_bytes(AXL_BF16, 2, NULL, 1), -AXL_ERR_NULL_POINTER);
    CHECK_EQ(axl_read_shards_scratch_bytes(AXL_BF16, 2, big, -1), -AXL_ERR_BAD_THREADS);
    const int64_t negative[] = {4, -1};
    CHECK_EQ(axl_read_shards_scratch_bytes(AXL_BF16, 2, negative, 1), -AXL_ERR_BAD_SIZE);
    const int64_t huge[] = {INT64_MAX / 2, 4};
    CHECK_EQ(axl_read_shards_scratch_bytes(AXL_BF16, 2, huge, 1), -AXL_ERR_BAD_SIZE);
}

/* ---- bad arguments ---------------------------------------------------------------------- */

static void test_bad_arguments(void) {
    _Alignas(64) char src[512] = {0}, a[256], b[256], scratch[512];
    void *dsts[2] = {a, b};
    const int64_t shape[] = {4, 8}, grid[] = {1, 2};
    const char *path = "/dev/zero"; /* readable and never short */

#define SCATTER(s, sd, nd, sh, gr, ds, dd, nt, isa) axl_scatter_shards(s, sd, nd, sh, gr, ds, dd, nt, isa)
#define READ(p, off, sd, nd, sh, gr, ds, dd, sc, scb, nt, isa) \
    axl_read_shards(p, off, sd, nd, sh, gr, ds, dd, sc, scb, nt, isa)
    CHECK_EQ(SCATTER(src, AXL_F32, 2, shape, grid, dsts, AXL_BF16, 1, 0), AXL_OK);
    CHECK_EQ(READ(path, 0, AXL_F32, 2, shape, grid, dsts, AXL_BF16, scratch, 512, 1, 0), AXL_OK);

    const int bad_dtypes[] = {-1, AXL_I8, AXL_U8, AXL_DTYPE_COUNT, 99};
    for (size_t i = 0; i < sizeof bad_dtypes / sizeof *bad_dtypes; i++) {
        int bd = bad_dtypes[i];
        CHECK_EQ(SCATTER(src, bd, 2, shape, grid, dsts, AXL_F32, 1, 0), AXL_ERR_BAD_DTYPE);
        CHECK_EQ(SCATTER(src, AXL_F32, 2, shape, grid, dsts, bd, 1, 0), AXL_ERR_BAD_DTYPE);
        CHECK_EQ(READ(path, 0, bd, 2, shape, grid, dsts, AXL_F32, scratch, 512, 1, 0),
                 AXL_ERR_BAD_DTYPE);
        CHECK_EQ(READ(path, 0, AXL_F32, 2, shape, grid, dsts, bd, scratch, 512, 1, 0),
                 AXL_ERR_BAD_DTYPE);
    }

    /* I8 and U8 only to themselves. */
    const int int_pairs[][2] = {{AXL_I8, AXL_U8}, {AXL_U8, AXL_I8}, {AXL_I8, AXL_BF16},
                                {AXL_F16, AXL_U8}, {AXL_U8, AXL_F32}};
    for (size_t i = 0; i < sizeof int_pairs / sizeof *int_pairs; i++) {
        int sd = int_pairs[i][0], dd = int_pairs[i][1];
        CHECK_EQ(SCATTER(src, sd, 2, shape, grid, dsts, dd, 1, 0), AXL_ERR_BAD_DTYPE);
        CHECK_EQ(READ(path, 0, sd, 2, shape, grid, dsts, dd, scratch, 512, 1, 0),
                 AXL_ERR_BAD_DTYPE);
    }
    CHECK_EQ(SCATTER(src, AXL_I8, 2, shape, grid, dsts, AXL_I8, 1, 0), AXL_OK);
    CHECK_EQ(READ(path, 0, AXL_U8, 2, shape, grid, dsts, AXL_U8, scratch, 512, 1, 0), AXL_OK);
    CHECK_EQ(SCATTER(src + 1, AXL_U8, 2, shape, grid, dsts, AXL_U8, 1, 0), AXL_OK); /* bytes */

    /* ndim, shape and grid. */
    const int bad_ndims[] = {0, -1, AXL_MAX_NDIM + 1, 1000};
    for (size_t i = 0; i < sizeof bad_ndims / sizeof *bad_ndims; i++) {
        CHECK_EQ(SCATTER(src, AXL_F32, bad_ndims[i], shape, grid, dsts, AXL_BF16, 1, 0),
                 AXL_ERR_BAD_SIZE);
        CHECK_EQ(READ(path, 0, AXL_F32, bad_ndims[i], shape, grid, dsts, AXL_BF16, scratch, 512,
                      1, 0),
                 AXL_ERR_BAD_SIZE);
    }
    typedef struct {
        int64_t shape[2], grid[2];
    } bad_geometry;
    const bad_geometry bad[] = {
        {{-1, 8}, {1, 1}}, {{4, -8}, {1, 2}},  {{4, 8}, {0, 2}},        {{4, 8}, {1, -2}},
        {{4, 8}, {3, 1}},  {{4, 8}, {1, 16}},  {{4, 8}, {1, 3}},        {{0, 8}, {1, 3}},
        {{INT64_MAX, 8}, {1, 1}},             {{(int64_t)1 << 31, (int64_t)1 << 31}, {1, 1}},
        {{0, 8}, {INT64_MAX, 1}},             {{0, 0}, {(int64_t)1 << 40, (int64_t)1 << 40}},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        CHECK_MSG(SCATTER(src, AXL_F32, 2, bad[i].shape, bad[i].grid, dsts, AXL_BF16, 1, 0) ==
                      AXL_ERR_BAD_SIZE,
                  "case %zu", i);
        CHECK_MSG(READ(path, 0, AXL_F32, 2, bad[i].shape, bad[i].grid, dsts, AXL_BF16, scratch,
                       512, 1, 0) == AXL_ERR_BAD_SIZE,
                  "case %zu", i);
    }
    CHECK_EQ(SCATTER(src, AXL_F32, 2, NULL, grid, dsts, AXL_BF16, 1, 0), AXL_ERR_NULL_POINTER);
    CHECK_EQ(SCATTER(src, AXL_F32, 2, shape, NULL, dsts, AXL_BF16, 1, 0), AXL_ERR_NULL_POINTER);
    CHECK_EQ(READ(path, 0, AXL_F32, 2, NULL, grid, dsts, AXL_BF16, scratch, 512, 1, 0),
             AXL_ERR_NULL_POINTER);
    CHECK_EQ(READ(path, 0, AXL_F32, 2, shape, NULL, dsts, AXL_BF16, scratch, 512, 1, 0),
             AXL_ERR_NULL_POINTER);

    /* Threads and ISAs. */
    CHECK_EQ(SCATTER(src, AXL_F32, 2, shape, grid, dsts, AXL_BF16, -1, 0), AXL_ERR_BAD_THREADS);
    CHECK_EQ(READ(path, 0, AXL_F32, 2, shape, grid, dsts, AXL_BF16, scratch, 512, INT32_MIN, 0),
             AXL_ERR_BAD_THREADS);
    const int bad_isas[] = {-1, AXL_ISA_COUNT, 99};
    for (size_t i = 0; i < sizeof bad_isas / sizeof *bad_isas; i++) {
        CHECK_EQ(SCATTER(src, AXL_F32, 2, shape, grid, dsts, AXL_BF16, 1, bad_isas[i]),
                 AXL_ERR_UNSUPPORTED_ISA);
        CHECK_EQ(READ(path, 0, AXL_F32, 2, shape, grid, dsts, AXL_BF16, scratch, 512, 1,
                      bad_isas[i]),
                 AXL_ERR_UNSUPPORTED_ISA);
    }
    for (int isa = AXL_ISA_AVX2; isa < AXL_ISA_COUNT; isa++)
        if (!isa_available(isa))
            CHECK_EQ(SCATTER(src, AXL_F32, 2, shape, grid, dsts, AXL_BF16, 1, isa),
                     AXL_ERR_UNSUPPORTED_ISA);

    /* Offsets and scratch sizes. */
    CHECK_EQ(READ(path, -1, AXL_F32, 2, shape, grid, dsts, AXL_BF16, scratch, 512, 1, 0),
             AXL_ERR_BAD_SIZE);
    CHECK_EQ(READ(path, INT64_MIN, AXL_F32, 2, shape, grid, dsts, AXL_BF16, scratch, 512, 1, 0),
             AXL_ERR_BAD_SIZE);
    CHECK_EQ(READ(path, INT64_MAX - 64, AXL_F32, 2, shape, grid, dsts, AXL_BF16, scratch, 512, 1,
                  0),
             AXL_ERR_BAD_SIZE); /* offset + 128 bytes overflows */
    CHECK_EQ(READ(path, 0, AXL_F32, 2, shape, grid, dsts, AXL_BF16, scratch, -1, 1, 0),
             AXL_ERR_BAD_SIZE);
    CHECK_EQ(READ(path, 0, AXL_F32, 2, shape, grid, dsts, AXL_BF16, scratch, 31, 1, 0),
             AXL_ERR_BAD_SIZE); /* a row is 32 bytes */
    CHECK_EQ(READ(path, 0, AXL_F32, 2, shape, grid, dsts, AXL_BF16, scratch, 32, 1, 0), AXL_OK);

    /* NULL pointers, allowed only for tensors with no elements. */
    void *null_dsts[2] = {a, NULL};
    CHECK_EQ(SCATTER(NULL, AXL_F32, 2, shape, grid, dsts, AXL_BF16, 1, 0), AXL_ERR_NULL_POINTER);
    CHECK_EQ(SCATTER(src, AXL_F32, 2, shape, grid, NULL, AXL_BF16, 1, 0), AXL_ERR_NULL_POINTER);
    CHECK_EQ(SCATTER(src, AXL_F32, 2, shape, grid, null_dsts, AXL_BF16, 1, 0),
             AXL_ERR_NULL_POINTER);
    CHECK_EQ(READ(NULL, 0, AXL_F32, 2, shape, grid, dsts, AXL_BF16, scratch, 512, 1, 0),
             AXL_ERR_NULL_POINTER);
    CHECK_EQ(READ(path, 0, AXL_F32, 2, shape, grid, NULL, AXL_BF16, scratch, 512, 1, 0),
             AXL_ERR_NULL_POINTER);
    CHECK_EQ(READ(path, 0, AXL_F32, 2, shape, grid, null_dsts, AXL_BF16, scratch, 512, 1, 0),
             AXL_ERR_NULL_POINTER);
    CHECK_EQ(READ(path, 0, AXL_F32, 2, shape, grid, dsts, AXL_BF16, NULL, 512, 1, 0),
             AXL_ERR_NULL_POINTER);
    const int64_t empty[] = {4, 0}, empty_grid[] = {2, 4};
    CHECK_EQ(SCATTER(NULL, AXL_F32, 2, empty, empty_grid, NULL, AXL_BF16, 0, 0), AXL_OK);
    CHECK_EQ(READ(NULL, 0, AXL_F32, 2, empty, empty_grid, NULL, AXL_BF16, NULL, 0, 0, 0), AXL_OK);
    CHECK_EQ(READ("/nonexistent", 0, AXL_F32, 2, empty, empty_grid, NULL, AXL_BF16, NULL, 0, 0,
                  0),
             AXL_OK); /* nothing to read: the file is not opened */

    /* Misaligned buffers. */
    void *odd_dsts[2] = {a, b + 1};
    CHECK_EQ(SCATTER(src + 2, AXL_F32, 2, shape, grid, dsts, AXL_BF16, 1, 0), AXL_ERR_MISALIGNED);
    CHECK_EQ(SCATTER(src, AXL_F32, 2, shape, grid, odd_dsts, AXL_BF16, 1, 0), AXL_ERR_MISALIGNED);
    CHECK_EQ(SCATTER(src + 2, AXL_BF16, 2, shape, grid, dsts, AXL_F32, 1, 0), AXL_OK);
    CHECK_EQ(READ(path, 0, AXL_F32, 2, shape, grid, odd_dsts, AXL_BF16, scratch, 512, 1, 0),
             AXL_ERR_MISALIGNED);
    CHECK_EQ(READ(path, 0, AXL_F32, 2, shape, grid, dsts, AXL_BF16, scratch + 2, 500, 1, 0),
             AXL_ERR_MISALIGNED);
    CHECK_EQ(READ(path, 0, AXL_BF16, 2, shape, grid, dsts, AXL_F32, scratch + 2, 500, 1, 0),
             AXL_OK);

    /* Overlaps: with the source, with the scratch, between blocks; adjacency is fine. */
    void *into_src[2] = {a, src + 64};
    CHECK_EQ(SCATTER(src, AXL_F32, 2, shape, grid, into_src, AXL_BF16, 1, 0), AXL_ERR_OVERLAP);
    void *next_to_src[2] = {src + 128, a}; /* src is 32 f32 = 128 bytes */
    CHECK_EQ(SCATTER(src, AXL_F32, 2, shape, grid, next_to_src, AXL_BF16, 1, 0), AXL_OK);
    void *same[2] = {a, a};
    CHECK_EQ(SCATTER(src, AXL_F32, 2, shape, grid, same, AXL_BF16, 1, 0), AXL_ERR_OVERLAP);
    void *crossing[2] = {a, a + 30}; /* blocks of 16 bf16 = 32 bytes */
    CHECK_EQ(SCATTER(src, AXL_F32, 2, shape, grid, crossing, AXL_BF16, 1, 0), AXL_ERR_OVERLAP);
    void *touching[2] = {a + 32, a};
    CHECK_EQ(SCATTER(src, AXL_F32, 2, shape, grid, touching, AXL_BF16, 1, 0), AXL_OK);
    CHECK_EQ(READ(path, 0, AXL_F32, 2, shape, grid, crossing, AXL_BF16, scratch, 512, 1, 0),
             AXL_ERR_OVERLAP);
    void *into_scratch[2] = {a, scratch + 480};
    CHECK_EQ(READ(path, 0, AXL_F32, 2, shape, grid, into_scratch, AXL_BF16, scratch, 512, 1, 0),
             AXL_ERR_OVERLAP);
    CHECK_EQ(READ(path, 0, AXL_F32, 2, shape, grid, into_scratch, AXL_BF16, scratch, 480, 1, 0),
             AXL_OK);
    /* Many blocks: the overlap check leaves the stack for the heap. */
    const int64_t wide[] = {1, 128}, wide_grid[] = {1, 128}; /* blocks of one bf16 */
    void *many[128];
    for (int k = 0; k < 128; k++) many[k] = b + (k == 77 ? 2 * 76 : 2 * k);
    CHECK_EQ(SCATTER(src, AXL_BF16, 2, wide, wide_grid, many, AXL_BF16, 1, 0), AXL_ERR_OVERLAP);
    many[77] = b + 2 * 77;
    CHECK_EQ(SCATTER(src, AXL_BF16, 2, wide, wide_grid, many, AXL_BF16, 1, 0), AXL_OK);
#undef SCATTER
#undef READ
}

/* ---- axl_read_blocks and axl_block_ranges ------------------------------------------------ */

/* The block of element e (row-major), as autoxla.h defines it. */
static int64_t block_of(int64_t e, const int64_t *shape, const int64_t *grid, int ndim) {
    int64_t k = 0, kmul = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        int64_t i = e % shape[d];
        e /= shape[d];
        k += i / (shape[d] / grid[d]) * kmul;
        kmul *= grid[d];
    }
    return k;
}

/* The ranges axl_block_ranges must give, found element by element: the bytes of the
 * elements of wanted blocks, a range merged into the one before when at most gap bytes
 * after it. out holds 2 * numel entries; returns the count. The index of each element is
 * counted up (an odometer) rather than divided out: the large cases have millions. */
static int64_t naive_ranges(const int64_t *shape, const int64_t *grid, int ndim,
                            const unsigned char *wanted, size_t ss, int64_t gap, int64_t *out) {
    int64_t numel = prod(shape, ndim), n = 0;
    int64_t blk[AXL_MAX_NDIM] = {0}, in[AXL_MAX_NDIM] = {0};
    for (int64_t e = 0; e < numel; e++) {
        int64_t k = 0;
        for (int d = 0; d < ndim; d++) k = k * grid[d] + blk[d];
        if (e < 64) CHECK(k == block_of(e, shape, grid, ndim)); /* the odometer's start */
        for (int d = ndim - 1; d >= 0; d--) {
            if (++in[d] < shape[d] / grid[d]) break;
            in[d] = 0;
            if (++blk[d] < grid[d]) break;
            blk[d] = 0;
        }
        if (!wanted[k]) continue;
        int64_t b = e * (int64_t)ss;
        if (n > 0 && b - out[2 * n - 1] <= gap) {
            out[2 * n - 1] = b + (int64_t)ss;
        } else {
            out[2 * n] = b;
            out[2 * n + 1] = b + (int64_t)ss;
            n++;
        }
    }
    return n;
}

/* axl_block_ranges against naive_ranges, and its contract (sorted, disjoint, more than gap
 * apart; capacity honoured). Returns the ranges' total bytes. */
static int64_t check_ranges(const char *what, const int64_t *shape, const int64_t *grid,
                            int ndim, int sd, const unsigned char *wanted, int64_t gap) {
    int64_t numel = prod(shape, ndim);
    size_t ss = axl_dtype_size(sd);
    int64_t *want = xmalloc(sizeof *want * 2 * (size_t)numel);
    int64_t nwant = naive_ranges(shape, grid, ndim, wanted, ss, gap, want);
    int64_t n = axl_block_ranges(sd, ndim, shape, grid, wanted, gap, NULL, 0);
    CHECK_MSG(n == nwant, "%s gap %lld: %lld ranges, want %lld", what, (long long)gap,
              (long long)n, (long long)nwant);
    int64_t cap = n > 0 ? n : 0, total = 0;
    int64_t *got = xmalloc(sizeof *got * (2 * (size_t)cap + 2));
    for (int64_t i = 0; i < 2 * cap + 2; i++) got[i] = -7;
    CHECK_EQ(axl_block_ranges(sd, ndim, shape, grid, wanted, gap, got, cap), n);
    CHECK_MSG(got[2 * cap] == -7 && got[2 * cap + 1] == -7, "%s: wrote past capacity", what);
    for (int64_t i = 0; i < cap; i++) {
        int64_t b = got[2 * i], e = got[2 * i + 1];
        CHECK_MSG(i >= nwant || (b == want[2 * i] && e == want[2 * i + 1]),
                  "%s gap %lld: range %lld is [%lld, %lld), want [%lld, %lld)", what,
                  (long long)gap, (long long)i, (long long)b, (long long)e,
                  (long long)(i < nwant ? want[2 * i] : -1),
                  (long long)(i < nwant ? want[2 * i + 1] : -1));
        CHECK_MSG(b < e && (i == 0 || b - got[2 * i - 1] > gap) && b % (int64_t)ss == 0 &&
                      e % (int64_t)ss == 0 && e <= numel * (int64_t)ss,
                  "%s gap %lld: range %lld [%lld, %lld)", what, (long long)gap, (long long)i,
                  (long long)b, (long long)e);
        total += e - b;
    }
    if (cap > 1) { /* too small an array: the count all the same, the first ranges only */
        for (int64_t i = 0; i < 2 * cap + 2; i++) got[i] = -7;
        CHECK_EQ(axl_block_ranges(sd, ndim, shape, grid, wanted, gap, got, cap / 2), n);
        CHECK(got[2 * (cap / 2) - 1] == want[2 * (cap / 2) - 1] && got[2 * (cap / 2)] == -7);
    }
    free(got);
    free(want);
    return total;
}

/* T of axl_read_blocks (autoxla.h) for R bytes to read. */
static int64_t blocks_threads(int nthreads, int64_t rows, int64_t row_bytes, int64_t r) {
    int64_t t = read_threads(nthreads, rows, row_bytes), by_size = r >> 20;
    return t < by_size ? t : by_size < 1 ? 1 : by_size;
}

/* Subset i of nblocks blocks, as flags; 0 past the last. Every subset of up to 4 blocks;
 * of more: none, all, single blocks, and random ones. */
static int pick_subset(int64_t nblocks, int i, unsigned char *flags) {
    int64_t singles = nblocks < 6 ? nblocks : 6;
    if (nblocks <= 4 ? i >= 1 << nblocks : i >= 2 + singles + 10) return 0;
    for (int64_t k = 0; k < nblocks; k++) {
        if (nblocks <= 4)
            flags[k] = (unsigned char)(i >> k & 1);
        else if (i < 2)
            flags[k] = (unsigned char)i;
        else if (i < 2 + singles)
            flags[k] = k == (i - 2) * (nblocks - 1) / (singles > 1 ? singles - 1 : 1);
        else
            flags[k] = rng_u32() % 3 == 0;
    }
    return 1;
}

/* Wanted blocks equal the reference (guards intact), unwanted ones untouched. Returns the
 * first block that is wrong, or -1. */
static int64_t wanted_diff(const blocks *got, const blocks *want, const unsigned char *flags) {
    size_t n = (size_t)got->elems * got->ds;
    for (int64_t k = 0; k < got->count; k++) {
        const unsigned char *p = got->ptrs[k];
        if (flags[k] && memcmp(p, want->ptrs[k], n) != 0) return k;
        for (size_t i = flags[k] ? n : 0; i < n + GUARD; i++)
            if (p[i] != GUARD_BYTE) return k;
    }
    return -1;
}

typedef struct rb_config {
    int sd, dd, isa;
} rb_config;

/* Every dtype pair with AUTO, and some pairs with each ISA. */
static const rb_config rb_configs[] = {
    {AXL_F32, AXL_F32, 0},   {AXL_F32, AXL_BF16, 0},  {AXL_F32, AXL_F16, 0},
    {AXL_BF16, AXL_F32, 0},  {AXL_BF16, AXL_BF16, 0}, {AXL_BF16, AXL_F16, 0},
    {AXL_F16, AXL_F32, 0},   {AXL_F16, AXL_BF16, 0},  {AXL_F16, AXL_F16, 0},
    {AXL_I8, AXL_I8, 0},     {AXL_U8, AXL_U8, 0},
    {AXL_F32, AXL_BF16, AXL_ISA_SCALAR}, {AXL_BF16, AXL_F16, AXL_ISA_SCALAR},
    {AXL_F16, AXL_F32, AXL_ISA_SCALAR},  {AXL_F32, AXL_BF16, AXL_ISA_AVX2},
    {AXL_BF16, AXL_F16, AXL_ISA_AVX2},   {AXL_F16, AXL_F32, AXL_ISA_AVX2},
    {AXL_F32, AXL_F16, AXL_ISA_AVX512},  {AXL_BF16, AXL_F32, AXL_ISA_AVX512},
};

/* One shape and grid: every subset (or a sample), gaps from exact to everything merged,
 * every config, scratch from one element per thread (chunks end mid-run) to the default. */
static void check_read_blocks_case(const int64_t *shape, const int64_t *grid, int ndim) {
    char what[200], s[64], g[64];
    format_dims(s, sizeof s, shape, ndim);
    format_dims(g, sizeof g, grid, ndim);
    int64_t numel = prod(shape, ndim), nblocks = prod(grid, ndim);
    unsigned char flags[MAX_BLOCKS];
    void *dsts[MAX_BLOCKS];
    const int sds[] = {AXL_F32, AXL_BF16, AXL_F16, AXL_I8, AXL_U8};
    for (size_t a = 0; a < 5; a++) {
        int sd = sds[a];
        size_t ss = axl_dtype_size(sd);
        int64_t row = numel / shape[0] * (int64_t)ss;
        void *src = random_source(sd, numel);
        char path[PATH_SIZE];
        int64_t offset = 37;
        if (!write_temp_file(path, offset, src, (size_t)numel * ss, 5)) {
            CHECK_MSG(0, "cannot write a temp file for %s", s);
            free(src);
            continue;
        }
        blocks want[AXL_DTYPE_COUNT], got;
        for (int dd = 0; dd < AXL_DTYPE_COUNT; dd++) {
            want[dd].mem = NULL;
            if (dd != sd && (sd >= AXL_I8 || dd >= AXL_I8)) continue;
            blocks_init(&want[dd], shape, grid, ndim, dd);
            reference(src, sd, shape, grid, ndim, dd, &want[dd]);
        }
        blocks_init(&got, shape, grid, ndim, AXL_F32); /* room for any dtype */
        int64_t best = axl_read_shards_scratch_bytes(sd, ndim, shape, 0);
        char *scratch = xmalloc((size_t)best * 3 + 64);
        const int64_t gaps[] = {0, (int64_t)ss, 5 * (int64_t)ss + 1, INT64_MAX};
        int turn = 0;
        for (int i = 0; pick_subset(nblocks, i, flags); i++) {
            int64_t nwanted = 0;
            for (int64_t k = 0; k < nblocks; k++) nwanted += flags[k] != 0;
            for (size_t gi = 0; gi < 4; gi++) {
                int64_t gap = gaps[gi];
                snprintf(what, sizeof what, "shape %s grid %s %s subset %d", s, g,
                         dtype_names[sd], i);
                int64_t total = check_ranges(what, shape, grid, ndim, sd, flags, gap);
                if (gap == 0)
                    CHECK_MSG(total == nwanted * (numel / nblocks) * (int64_t)ss,
                              "%s: %lld bytes for %lld blocks", what, (long long)total,
                              (long long)nwanted);
                for (size_t c = 0; c < sizeof rb_configs / sizeof *rb_configs; c++) {
                    const rb_config *cf = &rb_configs[c];
                    if (cf->sd != sd || !isa_available(cf->isa)) continue;
                    int nthreads = thread_counts[turn % 4];
                    int64_t t = blocks_threads(nthreads, shape[0], row, total);
                    /* One element per thread, an odd size, the default. */
                    const int64_t sizes[] = {t * (int64_t)ss, 3 * t * (int64_t)ss + 1, best};
                    int64_t sb = sizes[turn++ % 3];
                    snprintf(what, sizeof what,
                             "shape %s grid %s %s->%s isa %s subset %d gap %lld scratch %lld "
                             "nthreads %d", s, g, dtype_names[sd], dtype_names[cf->dd],
                             axl_isa_name(cf->isa), i, (long long)gap, (long long)sb, nthreads);
                    size_t ds = axl_dtype_size(cf->dd);
                    got.ds = ds;
                    size_t stride = (size_t)got.elems * 4 + GUARD;
                    memset(got.mem, GUARD_BYTE, stride * (size_t)got.count);
                    for (int64_t k = 0; k < nblocks; k++) {
                        got.ptrs[k] = got.mem + (size_t)k * stride;
                        dsts[k] = flags[k] ? got.ptrs[k] : NULL;
                    }
                    int64_t bytes_read = -1;
                    int status = axl_read_blocks(path, offset, sd, ndim, shape, grid, dsts,
                                                 cf->dd, gap, scratch, sb, nthreads, cf->isa,
                                                 &bytes_read);
                    int64_t k = status == AXL_OK ? wanted_diff(&got, &want[cf->dd], flags) : -1;
                    CHECK_MSG(status == AXL_OK && k < 0 && bytes_read == total,
                              "read_blocks %s: status %d, block %lld, read %lld of %lld", what,
                              status, (long long)k, (long long)bytes_read, (long long)total);
                    if (total > 0 && sb == sizes[0]) /* one byte short of an element each */
                        CHECK_EQ(axl_read_blocks(path, offset, sd, ndim, shape, grid, dsts,
                                                 cf->dd, gap, scratch, sb - 1, nthreads,
                                                 cf->isa, NULL),
                                 AXL_ERR_BAD_SIZE);
                }
            }
        }
        got.ds = 4;
        free(scratch);
        for (int dd = 0; dd < AXL_DTYPE_COUNT; dd++) free(want[dd].mem);
        free(got.mem);
        unlink(path);
        free(src);
    }
}

/* Every grid of divisors of shape with at most 64 blocks. */
static void read_blocks_all_grids(const int64_t *shape, int ndim) {
    int64_t grid[AXL_MAX_NDIM];
    for (int d = 0; d < ndim; d++) grid[d] = 1;
    for (;;) {
        if (prod(grid, ndim) <= 64) check_read_blocks_case(shape, grid, ndim);
        int d = ndim - 1;
        for (; d >= 0; d--) {
            do grid[d]++;
            while (grid[d] <= shape[d] && shape[d] % grid[d]);
            if (grid[d] <= shape[d]) break;
            grid[d] = 1;
        }
        if (d < 0) return;
    }
}

static void test_read_blocks_small(void) {
    const int64_t s1[] = {12}, s2[] = {6, 4}, s3[] = {4, 3, 2}, s4[] = {2, 3, 1, 4},
                  o2[] = {5, 7}, o4[] = {3, 1, 2, 5}, one[] = {1, 1};
    read_blocks_all_grids(s1, 1);
    read_blocks_all_grids(s2, 2);
    read_blocks_all_grids(s3, 3);
    read_blocks_all_grids(s4, 4);
    read_blocks_all_grids(o2, 2);
    read_blocks_all_grids(o4, 4);
    read_blocks_all_grids(one, 2);
}

/* Tensors of several MiB, so that several threads read (T > 1 when R >= 2 MiB), with
 * grids splitting rows, columns and a middle dim, and scratch small enough for many
 * chunks per thread. */
static void test_read_blocks_large(void) {
    typedef struct {
        int ndim, sd, dd;
        int64_t shape[3], grid[3];
    } big;
    const big cases[] = {
        {2, AXL_BF16, AXL_F32, {1024, 2080}, {2, 4}},
        {3, AXL_F32, AXL_F16, {8, 256, 520}, {2, 4, 2}},
        {2, AXL_I8, AXL_I8, {2400, 1000}, {1, 5}},
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const big *b = &cases[c];
        int64_t numel = prod(b->shape, b->ndim), nblocks = prod(b->grid, b->ndim);
        size_t ss = axl_dtype_size(b->sd);
        int64_t row = numel / b->shape[0] * (int64_t)ss;
        void *src = random_source(b->sd, numel);
        char path[PATH_SIZE];
        if (!write_temp_file(path, 4096 + 2, src, (size_t)numel * ss, 0)) {
            CHECK_MSG(0, "cannot write a temp file");
            free(src);
            continue;
        }
        blocks want, got;
        blocks_init(&want, b->shape, b->grid, b->ndim, b->dd);
        blocks_init(&got, b->shape, b->grid, b->ndim, b->dd);
        reference(src, b->sd, b->shape, b->grid, b->ndim, b->dd, &want);
        int64_t best = axl_read_shards_scratch_bytes(b->sd, b->ndim, b->shape, 0);
        char *scratch = xmalloc((size_t)best);
        unsigned char flags[64];
        void *dsts[64];
        for (int i = 0; i < 6; i++) {
            for (int64_t k = 0; k < nblocks; k++) /* all, first half, every other, ... */
                flags[k] = i == 0 ? 1 : i == 1 ? k < nblocks / 2 : i == 2 ? k % 2 == 0
                           : i == 3 ? k == 1 || k == nblocks - 2 : rng_u32() % 2;
            for (int64_t gi = 0; gi < 2; gi++) {
                int64_t gap = gi ? 3 * row + 2 : 0;
                char what[160];
                snprintf(what, sizeof what, "large case %zu subset %d gap %lld", c, i,
                         (long long)gap);
                int64_t total = check_ranges(what, b->shape, b->grid, b->ndim, b->sd, flags, gap);
                for (size_t t = 0; t < 4; t++) {
                    int nthreads = thread_counts[t];
                    int64_t threads = blocks_threads(nthreads, b->shape[0], row, total);
                    /* The default, and about 64 KiB a thread: many chunks, ending mid-run. */
                    int64_t small = threads * (((int64_t)64 << 10) + (int64_t)ss) + 1;
                    const int64_t sizes[] = {best, small < best ? small : best};
                    for (size_t z = 0; z < 2; z++) {
                        memset(got.mem, GUARD_BYTE,
                               ((size_t)got.elems * got.ds + GUARD) * (size_t)got.count);
                        for (int64_t k = 0; k < nblocks; k++)
                            dsts[k] = flags[k] ? got.ptrs[k] : NULL;
                        int64_t bytes_read = -1;
                        int status = axl_read_blocks(path, 4096 + 2, b->sd, b->ndim, b->shape,
                                                     b->grid, dsts, b->dd, gap, scratch,
                                                     sizes[z], nthreads, 0, &bytes_read);
                        int64_t k = status == AXL_OK ? wanted_diff(&got, &want, flags) : -1;
                        CHECK_MSG(status == AXL_OK && k < 0 && bytes_read == total,
                                  "%s nthreads %d scratch %lld: status %d, block %lld, read "
                                  "%lld of %lld", what, nthreads, (long long)sizes[z], status,
                                  (long long)k, (long long)bytes_read, (long long)total);
                    }
                    if (total > 0) { /* T elements of scratch, as documented, and no less */
                        CHECK_EQ(axl_read_blocks(path, 4096 + 2, b->sd, b->ndim, b->shape,
                                                 b->grid, dsts, b->dd, gap, scratch,
                                                 threads * (int64_t)ss - 1, nthreads, 0, NULL),
                                 AXL_ERR_BAD_SIZE);
                    }
                }
            }
        }
        free(scratch);
        free(want.mem);
        free(got.mem);
        unlink(path);
        free(src);
    }
}

/* Files that end early: only the wanted bytes must be there. Missing files, directories
 * and FIFOs fail, unless nothing is wanted (the file is then not opened). */
static void test_read_blocks_files(void) {
    const int64_t shape[] = {300, 1000}, grid[] = {2, 4};
    int64_t numel = shape[0] * shape[1];
    size_t bytes = (size_t)numel * 2;
    void *src = random_source(AXL_BF16, numel);
    blocks want, got;
    blocks_init(&want, shape, grid, 2, AXL_F32);
    blocks_init(&got, shape, grid, 2, AXL_F32);
    reference(src, AXL_BF16, shape, grid, 2, AXL_F32, &want);
    int64_t scratch_bytes = axl_read_shards_scratch_bytes(AXL_BF16, 2, shape, 0);
    char *scratch = xmalloc((size_t)scratch_bytes);
    unsigned char flags[8] = {1, 0, 1, 0, 0, 0, 0, 0}, none[8] = {0};
    void *dsts[8] = {got.ptrs[0], NULL, got.ptrs[2], NULL, NULL, NULL, NULL, NULL};
    void *no_dsts[8] = {NULL};
    int64_t r[4], bytes_read;
    /* Blocks 0 and 2 (rows 0-149, columns 0-249 and 500-749): every 2000-byte row holds a
     * range of 500 bytes from 0 and one from 1000; the last ends at 149 * 2000 + 1500. */
    CHECK_EQ(axl_block_ranges(AXL_BF16, 2, shape, grid, flags, 0, r, 2), 300);
    CHECK(r[0] == 0 && r[1] == 500 && r[2] == 1000 && r[3] == 1500);
    CHECK_EQ(axl_block_ranges(AXL_BF16, 2, shape, grid, flags, 500, r, 2), 1);
    CHECK(r[0] == 0 && r[1] == 149 * 2000 + 1500);
    CHECK_EQ(axl_block_ranges(AXL_BF16, 2, shape, grid, flags, 499, NULL, 0), 300);
    CHECK_EQ(axl_block_ranges(AXL_BF16, 2, shape, grid, none, INT64_MAX, NULL, 0), 0);
    int64_t last = 149 * 2000 + 1500;
    char path[PATH_SIZE];
    int fds = lowest_free_fd();
    for (size_t t = 0; t < 4; t++) {
        int nt = thread_counts[t];
        for (int64_t gap = 0; gap <= 500; gap += 500) {
            if (!write_temp_file(path, 8, src, bytes, 0)) {
                CHECK_MSG(0, "cannot write a temp file");
                continue;
            }
            CHECK(truncate(path, 8 + last) == 0); /* the unwanted rest is gone */
            memset(got.mem, GUARD_BYTE, ((size_t)got.elems * got.ds + GUARD) * (size_t)got.count);
            CHECK_EQ(axl_read_blocks(path, 8, AXL_BF16, 2, shape, grid, dsts, AXL_F32, gap,
                                     scratch, scratch_bytes, nt, 0, &bytes_read),
                     AXL_OK);
            CHECK(wanted_diff(&got, &want, flags) < 0);
            CHECK_EQ(bytes_read, gap ? last : 150 * 1000);
            CHECK(truncate(path, 8 + last - 1) == 0); /* one byte of block 2 missing */
            bytes_read = -1;
            CHECK_EQ(axl_read_blocks(path, 8, AXL_BF16, 2, shape, grid, dsts, AXL_F32, gap,
                                     scratch, scratch_bytes, nt, 0, &bytes_read),
                     AXL_ERR_IO);
            CHECK_MSG(bytes_read >= 0 && bytes_read < last, "read %lld",
                      (long long)bytes_read);
            CHECK_EQ(axl_read_blocks(path, 9, AXL_BF16, 2, shape, grid, dsts, AXL_F32, gap,
                                     scratch, scratch_bytes, nt, 0, NULL),
                     AXL_ERR_IO);
            CHECK_EQ(axl_read_blocks(path, (int64_t)bytes * 4, AXL_BF16, 2, shape, grid,
                                     dsts, AXL_F32, gap, scratch, scratch_bytes, nt, 0,
                                     NULL),
                     AXL_ERR_IO);
            CHECK(truncate(path, 0) == 0);
            CHECK_EQ(axl_read_blocks(path, 8, AXL_BF16, 2, shape, grid, dsts, AXL_F32, gap,
                                     scratch, scratch_bytes, nt, 0, NULL),
                     AXL_ERR_IO);
            unlink(path); /* now missing */
            CHECK_EQ(axl_read_blocks(path, 8, AXL_BF16, 2, shape, grid, dsts, AXL_F32, gap,
                                     scratch, scratch_bytes, nt, 0, NULL),
                     AXL_ERR_IO);
        }
    }
    CHECK_EQ(axl_read_blocks("/", 0, AXL_BF16, 2, shape, grid, dsts, AXL_F32, 0, scratch,
                             scratch_bytes, 1, 0, NULL),
             AXL_ERR_IO);
    char fifo[PATH_SIZE];
    snprintf(fifo, sizeof fifo, "/tmp/axl-test-fifo-blocks-%ld", (long)getpid());
    unlink(fifo);
    if (mkfifo(fifo, 0600) == 0) {
        CHECK_EQ(axl_read_blocks(fifo, 0, AXL_BF16, 2, shape, grid, dsts, AXL_F32, 0, scratch,
                                 scratch_bytes, 1, 0, NULL),
                 AXL_ERR_IO);
        unlink(fifo);
    } else {
        CHECK_MSG(0, "cannot make a FIFO in /tmp");
    }
    /* Nothing wanted: nothing opened, even a missing file; path and scratch may be NULL. */
    bytes_read = -1;
    CHECK_EQ(axl_read_blocks("/nonexistent/axl/blocks", 0, AXL_BF16, 2, shape, grid, no_dsts,
                             AXL_F32, 0, scratch, scratch_bytes, 0, 0, &bytes_read),
             AXL_OK);
    CHECK_EQ(bytes_read, 0);
    CHECK_EQ(axl_read_blocks(NULL, 0, AXL_BF16, 2, shape, grid, no_dsts, AXL_F32, 7, NULL, 0, 0,
                             0, NULL),
             AXL_OK);
    CHECK_MSG(lowest_free_fd() == fds, "file descriptors leaked: lowest free %d, was %d",
              lowest_free_fd(), fds);
    free(scratch);
    free(want.mem);
    free(got.mem);
    free(src);
}

/* More than 2 MiB to read, so that workers start; with thread creation failing the call
 * returns AXL_ERR_RESOURCE and closes its file. */
static void test_read_blocks_thread_failure(void) {
    const int64_t shape[] = {2048, 1024}, grid[] = {2, 2};
    int64_t numel = shape[0] * shape[1];
    void *src = random_source(AXL_F32, numel);
    blocks got;
    blocks_init(&got, shape, grid, 2, AXL_BF16);
    void *dsts[4] = {got.ptrs[0], got.ptrs[1], NULL, got.ptrs[3]};
    int64_t scratch_bytes = axl_read_shards_scratch_bytes(AXL_F32, 2, shape, 4);
    char *scratch = xmalloc((size_t)scratch_bytes);
    char path[PATH_SIZE];
    int fds = lowest_free_fd();
    if (write_temp_file(path, 0, src, (size_t)numel * 4, 0)) {
        axl_test_fail_thread_creates(0);
        CHECK_EQ(axl_read_blocks(path, 0, AXL_F32, 2, shape, grid, dsts, AXL_BF16, 0, scratch,
                                 scratch_bytes, 4, 0, NULL),
                 AXL_ERR_RESOURCE);
        axl_test_fail_thread_creates(-1);
        int64_t bytes_read = 0;
        CHECK_EQ(axl_read_blocks(path, 0, AXL_F32, 2, shape, grid, dsts, AXL_BF16, 0, scratch,
                                 scratch_bytes, 4, 0, &bytes_read),
                 AXL_OK);
        CHECK_EQ(bytes_read, numel * 4 / 4 * 3);
        unlink(path);
    } else {
        CHECK_MSG(0, "cannot write a temp file");
    }
    axl_test_fail_thread_creates(-1);
    CHECK_MSG(lowest_free_fd() == fds, "file descriptors leaked: lowest free %d, was %d",
              lowest_free_fd(), fds);
    free(scratch);
    free(got.mem);
    free(src);
}

static void test_read_blocks_bad_arguments(void) {
    _Alignas(64) char a[256], b[256], scratch[512];
    void *dsts[2] = {a, b}, *first[2] = {a, NULL};
    const int64_t shape[] = {4, 8}, grid[] = {1, 2};
    const unsigned char both[2] = {1, 1};
    const char *path = "/dev/zero"; /* readable and never short */
    int64_t r[4], bytes_read;
#define RB(p, off, sd, nd, sh, gr, ds, dd, gap, sc, scb, nt, isa) \
    axl_read_blocks(p, off, sd, nd, sh, gr, ds, dd, gap, sc, scb, nt, isa, &bytes_read)
#define BR(sd, nd, sh, gr, w, gap, out, cap) axl_block_ranges(sd, nd, sh, gr, w, gap, out, cap)
    CHECK_EQ(RB(path, 0, AXL_F32, 2, shape, grid, dsts, AXL_BF16, 0, scratch, 512, 1, 0), AXL_OK);
    CHECK_EQ(bytes_read, 128);
    CHECK_EQ(RB(path, 0, AXL_F32, 2, shape, grid, first, AXL_BF16, 0, scratch, 512, 1, 0), AXL_OK);
    CHECK_EQ(bytes_read, 64);
    CHECK_EQ(BR(AXL_F32, 2, shape, grid, both, 0, r, 2), 1);
    CHECK(r[0] == 0 && r[1] == 128);

    /* Refused: bytes_read is 0 whatever it held. */
    const int bad_dtypes[] = {-1, AXL_DTYPE_COUNT, 99};
    for (size_t i = 0; i < sizeof bad_dtypes / sizeof *bad_dtypes; i++) {
        int bd = bad_dtypes[i];
        bytes_read = -1;
        CHECK_EQ(RB(path, 0, bd, 2, shape, grid, dsts, AXL_F32, 0, scratch, 512, 1, 0),
                 AXL_ERR_BAD_DTYPE);
        CHECK_EQ(bytes_read, 0);
        CHECK_EQ(RB(path, 0, AXL_F32, 2, shape, grid, dsts, bd, 0, scratch, 512, 1, 0),
                 AXL_ERR_BAD_DTYPE);
        CHECK_EQ(BR(bd, 2, shape, grid, both, 0, r, 2), -AXL_ERR_BAD_DTYPE);
    }
    CHECK_EQ(RB(path, 0, AXL_I8, 2, shape, grid, dsts, AXL_U8, 0, scratch, 512, 1, 0),
             AXL_ERR_BAD_DTYPE);
    CHECK_EQ(RB(path, 0, AXL_F16, 2, shape, grid, dsts, AXL_I8, 0, scratch, 512, 1, 0),
             AXL_ERR_BAD_DTYPE);
    CHECK_EQ(RB(path, 0, AXL_U8, 2, shape, grid, dsts, AXL_U8, 0, scratch, 512, 1, 0), AXL_OK);
    CHECK_EQ(BR(AXL_U8, 2, shape, grid, both, 0, r, 2), 1); /* any dtype: only its size */
    CHECK_EQ(r[1], 32);

    const int bad_ndims[] = {0, -1, AXL_MAX_NDIM + 1};
    for (size_t i = 0; i < sizeof bad_ndims / sizeof *bad_ndims; i++) {
        CHECK_EQ(RB(path, 0, AXL_F32, bad_ndims[i], shape, grid, dsts, AXL_BF16, 0, scratch, 512,
                    1, 0),
                 AXL_ERR_BAD_SIZE);
        CHECK_EQ(BR(AXL_F32, bad_ndims[i], shape, grid, both, 0, r, 2), -AXL_ERR_BAD_SIZE);
    }
    typedef struct {
        int64_t shape[2], grid[2];
    } bad_geometry;
    const bad_geometry bad[] = {
        {{-1, 8}, {1, 1}}, {{4, 8}, {0, 2}}, {{4, 8}, {3, 1}}, {{4, 8}, {1, 16}},
        {{0, 8}, {1, 3}},  {{INT64_MAX, 8}, {1, 1}},           {{0, 8}, {INT64_MAX, 1}},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        CHECK_MSG(RB(path, 0, AXL_F32, 2, bad[i].shape, bad[i].grid, dsts, AXL_BF16, 0, scratch,
                     512, 1, 0) == AXL_ERR_BAD_SIZE,
                  "case %zu", i);
        CHECK_MSG(BR(AXL_F32, 2, bad[i].shape, bad[i].grid, both, 0, r, 2) == -AXL_ERR_BAD_SIZE,
                  "case %zu", i);
    }
    CHECK_EQ(RB(path, 0, AXL_F32, 2, NULL, grid, dsts, AXL_BF16, 0, scratch, 512, 1, 0),
             AXL_ERR_NULL_POINTER);
    CHECK_EQ(RB(path, 0, AXL_F32, 2, shape, NULL, dsts, AXL_BF16, 0, scratch, 512, 1, 0),
             AXL_ERR_NULL_POINTER);
    CHECK_EQ(BR(AXL_F32, 2, NULL, grid, both, 0, r, 2), -AXL_ERR_NULL_POINTER);
    CHECK_EQ(BR(AXL_F32, 2, shape, NULL, both, 0, r, 2), -AXL_ERR_NULL_POINTER);
    CHECK_EQ(BR(AXL_F32, 2, shape, grid, NULL, 0, r, 2), -AXL_ERR_NULL_POINTER);
    CHECK_EQ(BR(AXL_F32, 2, shape, grid, both, 0, NULL, 1), -AXL_ERR_NULL_POINTER);
    CHECK_EQ(BR(AXL_F32, 2, shape, grid, both, 0, NULL, 0), 1);
    CHECK_EQ(BR(AXL_F32, 2, shape, grid, both, -1, r, 2), -AXL_ERR_BAD_SIZE);
    CHECK_EQ(BR(AXL_F32, 2, shape, grid, both, INT64_MIN, r, 2), -AXL_ERR_BAD_SIZE);
    CHECK_EQ(BR(AXL_F32, 2, shape, grid, both, 0, r, -1), -AXL_ERR_BAD_SIZE);
    const int64_t empty[] = {4, 0}, empty_grid[] = {2, 4};
    CHECK_EQ(BR(AXL_F32, 2, empty, empty_grid, NULL, 0, NULL, 0), 0);

    /* Threads, ISAs, offsets, gaps, scratch sizes. */
    CHECK_EQ(RB(path, 0, AXL_F32, 2, shape, grid, dsts, AXL_BF16, 0, scratch, 512, -1, 0),
             AXL_ERR_BAD_THREADS);
    CHECK_EQ(RB(path, 0, AXL_F32, 2, shape, grid, dsts, AXL_BF16, 0, scratch, 512, 1, -1),
             AXL_ERR_UNSUPPORTED_ISA);
    CHECK_EQ(RB(path, 0, AXL_F32, 2, shape, grid, dsts, AXL_BF16, 0, scratch, 512, 1,
                AXL_ISA_COUNT),
             AXL_ERR_UNSUPPORTED_ISA);
    CHECK_EQ(RB(path, -1, AXL_F32, 2, shape, grid, dsts, AXL_BF16, 0, scratch, 512, 1, 0),
             AXL_ERR_BAD_SIZE);
    CHECK_EQ(RB(path, INT64_MAX - 64, AXL_F32, 2, shape, grid, dsts, AXL_BF16, 0, scratch, 512,
                1, 0),
             AXL_ERR_BAD_SIZE);
    CHECK_EQ(RB(path, 0, AXL_F32, 2, shape, grid, dsts, AXL_BF16, -1, scratch, 512, 1, 0),
             AXL_ERR_BAD_SIZE);
    CHECK_EQ(RB(path, 0, AXL_F32, 2, shape, grid, dsts, AXL_BF16, 0, scratch, -1, 1, 0),
             AXL_ERR_BAD_SIZE);
    CHECK_EQ(RB(path, 0, AXL_F32, 2, shape, grid, dsts, AXL_BF16, 0, scratch, 3, 1, 0),
             AXL_ERR_BAD_SIZE); /* less than one f32 */
    CHECK_EQ(RB(path, 0, AXL_F32, 2, shape, grid, dsts, AXL_BF16, 0, scratch, 4, 1, 0), AXL_OK);
    CHECK_EQ(bytes_read, 128); /* 32 reads of one element */

    /* NULL pointers. */
    void *none[2] = {NULL, NULL};
    CHECK_EQ(RB(path, 0, AXL_F32, 2, shape, grid, NULL, AXL_BF16, 0, scratch, 512, 1, 0),
             AXL_ERR_NULL_POINTER);
    CHECK_EQ(RB(NULL, 0, AXL_F32, 2, shape, grid, dsts, AXL_BF16, 0, scratch, 512, 1, 0),
             AXL_ERR_NULL_POINTER);
    CHECK_EQ(RB(path, 0, AXL_F32, 2, shape, grid, first, AXL_BF16, 0, NULL, 512, 1, 0),
             AXL_ERR_NULL_POINTER);
    CHECK_EQ(RB(NULL, 0, AXL_F32, 2, shape, grid, none, AXL_BF16, 0, NULL, 0, 1, 0), AXL_OK);
    CHECK_EQ(RB(NULL, 0, AXL_F32, 2, empty, empty_grid, NULL, AXL_BF16, 0, NULL, 0, 0, 0),
             AXL_OK);
    CHECK_EQ(axl_read_blocks(path, 0, AXL_F32, 2, shape, grid, dsts, AXL_BF16, 0, scratch, 512,
                             1, 0, NULL),
             AXL_OK); /* bytes_read may be NULL */

    /* Alignment and overlaps: only wanted blocks count. */
    void *odd[2] = {a, b + 1}, *odd_unwanted[2] = {a, NULL};
    CHECK_EQ(RB(path, 0, AXL_F32, 2, shape, grid, odd, AXL_BF16, 0, scratch, 512, 1, 0),
             AXL_ERR_MISALIGNED);
    CHECK_EQ(RB(path, 0, AXL_F32, 2, shape, grid, odd_unwanted, AXL_BF16, 0, scratch, 512, 1, 0),
             AXL_OK);
    CHECK_EQ(RB(path, 0, AXL_F32, 2, shape, grid, dsts, AXL_BF16, 0, scratch + 2, 500, 1, 0),
             AXL_ERR_MISALIGNED);
    void *crossing[2] = {a, a + 30}; /* blocks of 16 bf16 = 32 bytes */
    CHECK_EQ(RB(path, 0, AXL_F32, 2, shape, grid, crossing, AXL_BF16, 0, scratch, 512, 1, 0),
             AXL_ERR_OVERLAP);
    void *into_scratch[2] = {NULL, scratch + 480};
    CHECK_EQ(RB(path, 0, AXL_F32, 2, shape, grid, into_scratch, AXL_BF16, 0, scratch, 512, 1, 0),
             AXL_ERR_OVERLAP);
    CHECK_EQ(RB(path, 0, AXL_F32, 2, shape, grid, into_scratch, AXL_BF16, 0, scratch, 480, 1, 0),
             AXL_OK);
    /* Many blocks, a few wanted: two of them on the same memory. */
    const int64_t wide[] = {1, 128}, wide_grid[] = {1, 128};
    void *many[128] = {NULL};
    many[3] = b;
    many[90] = b + 2;
    CHECK_EQ(RB(path, 0, AXL_BF16, 2, wide, wide_grid, many, AXL_BF16, 0, scratch, 512, 1, 0),
             AXL_OK);
    CHECK_EQ(bytes_read, 4);
    many[90] = b + 1;
    CHECK_EQ(RB(path, 0, AXL_BF16, 2, wide, wide_grid, many, AXL_BF16, 0, scratch, 512, 1, 0),
             AXL_ERR_MISALIGNED);
    many[90] = b;
    CHECK_EQ(RB(path, 0, AXL_BF16, 2, wide, wide_grid, many, AXL_BF16, 0, scratch, 512, 1, 0),
             AXL_ERR_OVERLAP);
    for (int k = 0; k < 128; k++) many[k] = b + 2 * k; /* all wanted: the heap check */
    many[77] = b + 2 * 76;
    CHECK_EQ(RB(path, 0, AXL_BF16, 2, wide, wide_grid, many, AXL_BF16, 0, scratch, 512, 1, 0),
             AXL_ERR_OVERLAP);
    many[77] = NULL; /* the overlap gone with the block */
    CHECK_EQ(RB(path, 0, AXL_BF16, 2, wide, wide_grid, many, AXL_BF16, 0, scratch, 512, 1, 0),
             AXL_OK);
    CHECK_EQ(bytes_read, 254);
#undef RB
#undef BR
}

void test_shards(void) {
    test_small_shapes();
    test_large_shapes();
    test_integer_copies();
    test_bad_files();
    test_thread_failure();
    test_scratch_bytes();
    test_bad_arguments();
    test_read_blocks_small();
    test_read_blocks_large();
    test_read_blocks_files();
    test_read_blocks_thread_failure();
    test_read_blocks_bad_arguments();
}
