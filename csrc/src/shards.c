/* shards.c - axl_scatter_shards, axl_read_shards and axl_read_blocks: cut a tensor into its
 * grid of blocks and convert its dtype in one pass, from memory or straight from a file
 * (all of it, or only the bytes of some blocks). */
#define _POSIX_C_SOURCE 200809L /* pread, O_CLOEXEC */
#define _FILE_OFFSET_BITS 64    /* a 64-bit off_t on 32-bit builds too */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"
#include "parallel.h"

/* As in convert.c: below two of these per thread a scatter stays on the calling thread. */
#define MIN_PER_THREAD ((int64_t)1 << 15)

/* axl_read_shards gives a thread no less than this much of the file (see autoxla.h). */
#define MIN_READ_BYTES_PER_THREAD ((int64_t)1 << 20)

/* What axl_read_shards_scratch_bytes gives each thread to read at a time, at most. */
#define DEFAULT_CHUNK_BYTES ((int64_t)8 << 20)

/* Largest single pread request (Linux returns at most 0x7FFFF000 bytes per call anyway). */
#define MAX_PREAD_BYTES ((size_t)1 << 30)

/* axl_parallel_for starts ranges at multiples of this many indices (parallel.h); asking it
 * for n = T * WORKER_SPAN indices in ranges of at least WORKER_SPAN gives exactly T ranges,
 * i.e. T workers for axl_read_shards, which hand out the work among themselves. */
#define WORKER_SPAN 64

/* Blocks overlap-checked without a heap allocation; more use one malloc per call. */
#define STACK_SPANS 64

/* ---- the plan: how elements of src map to blocks --------------------------------------
 * The tensor seen through the fewest dims that give the same blocks: dims of size 1 are
 * dropped, and a dim with grid 1 is merged into the dim before it (the pair then behaves
 * as one dim of size shape[d] * shape[d+1] cut into grid[d] blocks). Every dim but the
 * first is then split, and the last dim of a block, `run` elements, is contiguous in both
 * src and the block: the unit handed to a conversion kernel. Runs are numbered row-major
 * over (size[0], ..., size[m-2], grid[m-1]), which is also src order. */
typedef struct shard_plan {
    int m;                           /* dims after merging, 1 .. ndim */
    int64_t size[AXL_MAX_NDIM];      /* of the tensor, per merged dim */
    int64_t grid[AXL_MAX_NDIM];      /* blocks per merged dim */
    int64_t step[AXL_MAX_NDIM];      /* block size counted in runs: size/grid, 1 for the last */
    int64_t stride[AXL_MAX_NDIM];    /* element stride of each merged dim inside a block */
    int64_t run;                     /* elements per run: the last dim's block size */
    axl_convert_fn fn;               /* NULL: copy */
    size_t ss, ds;                   /* element sizes of src and blocks */
    void *const *dsts;               /* prod(grid) blocks, row-major grid order */
} shard_plan;

static void make_plan(shard_plan *p, int ndim, const int64_t *shape, const int64_t *grid,
                      int isa, int src_dtype, int dst_dtype, void *const *dsts) {
    /* Equal dtypes copy; that is the only case for I8 and U8 (check_common). */
    p->fn = src_dtype == dst_dtype ? NULL : axl_convert_kernel(isa, src_dtype, dst_dtype);
    p->ss = axl_dtype_size(src_dtype);
    p->ds = axl_dtype_size(dst_dtype);
    p->dsts = dsts;
    int64_t block[AXL_MAX_NDIM];
    int m = 0;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] == 1) continue; /* its grid is 1: it changes nothing */
        if (m > 0 && grid[d] == 1) {
            p->size[m - 1] *= shape[d];
            block[m - 1] *= shape[d];
            continue;
        }
        p->size[m] = shape[d];
        p->grid[m] = grid[d];
        block[m] = shape[d] / grid[d];
        m++;
    }
    if (m == 0) { /* a single element */
        p->size[0] = p->grid[0] = block[0] = 1;
        m = 1;
    }
    p->m = m;
    p->run = block[m - 1];
    p->stride[m - 1] = 1;
    p->step[m - 1] = 1;
    for (int d = m - 2; d >= 0; d--) {
        p->stride[d] = p->stride[d + 1] * block[d + 1];
        p->step[d] = block[d];
    }
}

/* Converts elements [begin, end) of the tensor (row-major order) into their blocks; src
 * points at element `begin`. Only the runs' ends cost index arithmetic, no divisions. */
static void scatter_elements(const shard_plan *p, const char *src, int64_t begin,
                             int64_t end) {
    const int m = p->m;
    int64_t blk[AXL_MAX_NDIM], in[AXL_MAX_NDIM]; /* per merged dim: block, index inside */
    int64_t q = begin / p->run, o = begin % p->run;
    for (int d = m - 1; d >= 0; d--) {
        int64_t extent = p->step[d] * p->grid[d], i = q % extent;
        q /= extent;
        blk[d] = i / p->step[d];
        in[d] = i % p->step[d];
    }
    while (begin < end) {
        int64_t k = 0, at = o; /* the block, and the element offset inside it */
        for (int d = 0; d < m; d++) {
            k = k * p->grid[d] + blk[d];
            at += in[d] * p->stride[d];
        }
        int64_t n = p->run - o < end - begin ? p->run - o : end - begin;
        char *block = p->dsts[k];
        if (block) { /* NULL: a block axl_read_blocks does not want, read only as a gap */
            char *dst = block + (size_t)at * p->ds;
            if (p->fn)
                p->fn(src, dst, n);
            else
                memcpy(dst, src, (size_t)n * p->ss);
        }
        src += (size_t)n * p->ss;
        begin += n;
        o = 0;
        for (int d = m - 1; d >= 0; d--) { /* the next run */
            if (++in[d] < p->step[d]) break;
            in[d] = 0;
            if (++blk[d] < p->grid[d]) break;
            blk[d] = 0;
        }
    }
}

/* ---- argument checks ------------------------------------------------------------------- */

static int is_float_dtype(int dtype) {
    return dtype == AXL_F32 || dtype == AXL_BF16 || dtype == AXL_F16;
}

/* Float dtypes in any pair (converted); I8 and U8 only to themselves (copied). */
static int dtypes_ok(int src_dtype, int dst_dtype) {
    if (is_float_dtype(src_dtype) && is_float_dtype(dst_dtype)) return 1;
    return src_dtype == dst_dtype && (src_dtype == AXL_I8 || src_dtype == AXL_U8);
}

/* The byte count of any buffer must fit in a ptrdiff_t, as for axl_convert. */
#define MAX_ELEMENTS ((int64_t)(PTRDIFF_MAX / 4))

/* ndim and shape: AXL_OK and the element count, or a status. */
static int check_shape(int ndim, const int64_t *shape, int64_t *numel) {
    if (ndim < 1 || ndim > AXL_MAX_NDIM) return AXL_ERR_BAD_SIZE;
    if (!shape) return AXL_ERR_NULL_POINTER;
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0) return AXL_ERR_BAD_SIZE;
        if (shape[d] == 0) n = 0;
    }
    for (int d = 0; d < ndim && n; d++) {
        if (shape[d] > MAX_ELEMENTS / n) return AXL_ERR_BAD_SIZE;
        n *= shape[d];
    }
    *numel = n;
    return AXL_OK;
}

/* grid against a checked shape: AXL_OK and the block count, or a status. */
static int check_grid(int ndim, const int64_t *shape, const int64_t *grid, int64_t *nblocks) {
    if (!grid) return AXL_ERR_NULL_POINTER;
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) {
        if (grid[d] < 1 || shape[d] % grid[d]) return AXL_ERR_BAD_SIZE;
        /* A zero-sized dim takes any grid; the count of (empty) blocks must still fit. */
        if (grid[d] > MAX_ELEMENTS / n) return AXL_ERR_BAD_SIZE;
        n *= grid[d];
    }
    *nblocks = n;
    return AXL_OK;
}

/* Checks shared by both entry points, in axl_convert's order: sizes, dtypes, threads, isa.
 * Fills the counts and resolves *isa. */
static int check_common(int ndim, const int64_t *shape, const int64_t *grid, int src_dtype,
                        int dst_dtype, int nthreads, int *isa, int64_t *numel,
                        int64_t *nblocks) {
    if (!dtypes_ok(src_dtype, dst_dtype)) return AXL_ERR_BAD_DTYPE;
    int status = check_shape(ndim, shape, numel);
    if (status == AXL_OK) status = check_grid(ndim, shape, grid, nblocks);
    if (status != AXL_OK) return status;
    if (nthreads < 0) return AXL_ERR_BAD_THREADS;
    return axl_resolve_isa(*isa, isa);
}

/* Every block non-NULL (unless null_ok: axl_read_blocks) and aligned to the destination
 * element size. */
static int check_blocks(void *const *dsts, int64_t nblocks, size_t ds, int null_ok) {
    if (!dsts) return AXL_ERR_NULL_POINTER;
    for (int64_t k = 0; k < nblocks && !null_ok; k++)
        if (!dsts[k]) return AXL_ERR_NULL_POINTER;
    for (int64_t k = 0; k < nblocks; k++)
        if ((uintptr_t)dsts[k] % ds) return AXL_ERR_MISALIGNED;
    return AXL_OK;
}

typedef struct span {
    uintptr_t begin, end;
} span;

static int span_order(const void *a, const void *b) {
    uintptr_t x = ((const span *)a)->begin, y = ((const span *)b)->begin;
    return (x > y) - (x < y);
}

/* AXL_ERR_OVERLAP if any two of [other, other + other_bytes) and the non-NULL ones of the
 * nblocks blocks of block_bytes each share a byte: sorted by start, each must end before
 * the next starts. */
static int check_overlap(const void *other, size_t other_bytes, void *const *dsts,
                         int64_t nblocks, size_t block_bytes) {
    span local[STACK_SPANS], *spans = local;
    size_t n = 1; /* nblocks <= MAX_ELEMENTS: no overflow */
    for (int64_t k = 0; k < nblocks; k++) n += dsts[k] != NULL;
    if (n > STACK_SPANS) {
        if (n > SIZE_MAX / sizeof *spans) return AXL_ERR_RESOURCE;
        spans = malloc(n * sizeof *spans);
        if (!spans) return AXL_ERR_RESOURCE;
    }
    spans[0] = (span){(uintptr_t)other, (uintptr_t)other + other_bytes};
    for (int64_t k = 0, i = 1; k < nblocks; k++)
        if (dsts[k]) spans[i++] = (span){(uintptr_t)dsts[k], (uintptr_t)dsts[k] + block_bytes};
    qsort(spans, n, sizeof *spans, span_order);
    int status = AXL_OK;
    for (size_t i = 1; i < n && status == AXL_OK; i++)
        if (spans[i].begin < spans[i - 1].end) status = AXL_ERR_OVERLAP;
    if (spans != local) free(spans);
    return status;
}

/* ---- axl_scatter_shards ----------------------------------------------------------------- */

typedef struct scatter_job {
    const shard_plan *plan;
    const char *src;
} scatter_job;

static void scatter_range(void *arg, int64_t begin, int64_t end) {
    const scatter_job *job = arg;
    scatter_elements(job->plan, job->src + (size_t)begin * job->plan->ss, begin, end);
}

int axl_scatter_shards(const void *src, int src_dtype, int ndim, const int64_t *shape,
                       const int64_t *grid, void *const *dsts, int dst_dtype, int nthreads,
                       int isa) {
    int64_t numel = 0, nblocks = 0;
    int status = check_common(ndim, shape, grid, src_dtype, dst_dtype, nthreads, &isa, &numel,
                              &nblocks);
    if (status != AXL_OK) return status;
    if (numel == 0) return AXL_OK; /* empty tensors may carry NULL data pointers */
    size_t ss = axl_dtype_size(src_dtype), ds = axl_dtype_size(dst_dtype);
    if (!src) return AXL_ERR_NULL_POINTER;
    status = check_blocks(dsts, nblocks, ds, 0);
    if (status != AXL_OK) return status;
    if ((uintptr_t)src % ss) return AXL_ERR_MISALIGNED;
    status = check_overlap(src, (size_t)numel * ss, dsts, nblocks,
                           (size_t)(numel / nblocks) * ds);
    if (status != AXL_OK) return status;

    shard_plan plan;
    make_plan(&plan, ndim, shape, grid, isa, src_dtype, dst_dtype, dsts);
    scatter_job job = {&plan, src};
    if (nthreads == 0) nthreads = axl_num_cpus();
    return axl_parallel_for(numel, nthreads, MIN_PER_THREAD, scatter_range, &job);
}

/* ---- axl_read_shards -------------------------------------------------------------------- */

/* T of autoxla.h: threads a read of rows * row_bytes uses (row_bytes > 0, rows > 0). */
static int read_threads(int nthreads, int64_t rows, int64_t row_bytes) {
    int64_t t = nthreads == 0 ? axl_num_cpus() : nthreads;
    if (t > AXL_MAX_THREADS) t = AXL_MAX_THREADS;
    int64_t min_rows = (MIN_READ_BYTES_PER_THREAD + row_bytes - 1) / row_bytes;
    int64_t by_size = rows / min_rows;
    if (by_size < t) t = by_size;
    return t < 1 ? 1 : (int)t;
}

/* Rows of dim 0 and bytes per row of a tensor with numel > 0 elements of ss bytes. */
static void row_geometry(int64_t numel, const int64_t *shape, size_t ss, int64_t *rows,
                         int64_t *row_bytes) {
    *rows = shape[0];
    *row_bytes = numel / shape[0] * (int64_t)ss;
}

/* Reads n bytes at file offset `at` into buf: retries on EINTR, continues after short
 * reads; an error or the end of the file first is AXL_ERR_IO. */
static int pread_full(int fd, char *buf, size_t n, int64_t at) {
    while (n > 0) {
        ssize_t got = pread(fd, buf, n < MAX_PREAD_BYTES ? n : MAX_PREAD_BYTES, (off_t)at);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return AXL_ERR_IO;
        buf += got;
        n -= (size_t)got;
        at += got;
    }
    return AXL_OK;
}

typedef struct read_job {
    const shard_plan *plan;
    int fd;
    int64_t offset;        /* of row 0 in the file */
    int64_t rows, row_elems, row_bytes;
    int64_t chunk_rows;    /* rows per read; a worker's scratch holds this many */
    int64_t nchunks;       /* ceil(rows / chunk_rows), handed out in file order */
    char *scratch;         /* one slot of chunk_rows * row_bytes per worker */
    atomic_int_fast64_t next_chunk;
    atomic_int next_slot;
    atomic_int status; /* the first failure; the others stop at their next chunk */
} read_job;

/* One worker (see WORKER_SPAN): takes the next chunk of rows until none is left, reads it
 * into its own slot of scratch and converts it into the blocks. */
static void read_worker(void *arg, int64_t begin, int64_t end) {
    read_job *job = arg;
    (void)begin;
    (void)end;
    int slot = atomic_fetch_add(&job->next_slot, 1); /* < T: at most T workers run */
    char *buf = job->scratch + (size_t)slot * (size_t)(job->chunk_rows * job->row_bytes);
    for (;;) {
        if (atomic_load(&job->status) != AXL_OK) return;
        int64_t c = atomic_fetch_add(&job->next_chunk, 1);
        if (c >= job->nchunks) return;
        int64_t r0 = c * job->chunk_rows;
        int64_t r1 = job->rows - r0 < job->chunk_rows ? job->rows : r0 + job->chunk_rows;
        int status = pread_full(job->fd, buf, (size_t)((r1 - r0) * job->row_bytes),
                                job->offset + r0 * job->row_bytes);
        if (status != AXL_OK) {
            int ok = AXL_OK;
            atomic_compare_exchange_strong(&job->status, &ok, status);
            return;
        }
        scatter_elements(job->plan, buf, r0 * job->row_elems, r1 * job->row_elems);
    }
}

int axl_read_shards(const char *path, int64_t offset, int src_dtype, int ndim,
                    const int64_t *shape, const int64_t *grid, void *const *dsts, int dst_dtype,
                    void *scratch, int64_t scratch_bytes, int nthreads, int isa) {
    int64_t numel = 0, nblocks = 0;
    int status = check_common(ndim, shape, grid, src_dtype, dst_dtype, nthreads, &isa, &numel,
                              &nblocks);
    if (status != AXL_OK) return status;
    size_t ss = axl_dtype_size(src_dtype), ds = axl_dtype_size(dst_dtype);
    int64_t bytes = numel * (int64_t)ss; /* numel <= MAX_ELEMENTS: no overflow */
    if (offset < 0 || offset > INT64_MAX - bytes || scratch_bytes < 0) return AXL_ERR_BAD_SIZE;
    if (numel == 0) return AXL_OK; /* nothing to read: the file is not opened */

    int64_t rows, row_bytes;
    row_geometry(numel, shape, ss, &rows, &row_bytes);
    int threads = read_threads(nthreads, rows, row_bytes);
    if (scratch_bytes / threads < row_bytes) return AXL_ERR_BAD_SIZE;
    if (!path || !scratch) return AXL_ERR_NULL_POINTER;
    status = check_blocks(dsts, nblocks, ds, 0);
    if (status != AXL_OK) return status;
    if ((uintptr_t)scratch % ss) return AXL_ERR_MISALIGNED;
    status = check_overlap(scratch, (size_t)scratch_bytes, dsts, nblocks,
                           (size_t)(numel / nblocks) * ds);
    if (status != AXL_OK) return status;

    shard_plan plan;
    make_plan(&plan, ndim, shape, grid, isa, src_dtype, dst_dtype, dsts);

    /* A worker's slot: its share of scratch in whole rows, but no more than its share of
     * the rows, so that every worker gets a chunk. */
    int64_t chunk_rows = scratch_bytes / threads / row_bytes;
    int64_t share = (rows + threads - 1) / threads;
    if (chunk_rows > share) chunk_rows = share;

    /* O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, forever;
     * on a regular file (or a device such as /dev/zero) it changes nothing. A FIFO, socket
     * or directory never holds a tensor: refused on the descriptor itself, so a path
     * swapped after the caller's own checks (_native/ takes regular files only) cannot
     * hang the call. */
    int fd;
    do {
        fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) return AXL_ERR_IO;
    struct stat st;
    if (fstat(fd, &st) != 0 || S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode) ||
        S_ISDIR(st.st_mode)) {
        close(fd);
        return AXL_ERR_IO;
    }

    read_job job = {
        .plan = &plan,
        .fd = fd,
        .offset = offset,
        .rows = rows,
        .row_elems = numel / rows,
        .row_bytes = row_bytes,
        .chunk_rows = chunk_rows,
        .nchunks = (rows + chunk_rows - 1) / chunk_rows,
        .scratch = scratch,
    };
    atomic_init(&job.next_chunk, 0);
    atomic_init(&job.next_slot, 0);
    atomic_init(&job.status, AXL_OK);
    status = axl_parallel_for((int64_t)threads * WORKER_SPAN, threads, WORKER_SPAN, read_worker,
                              &job);
    if (status == AXL_OK) status = atomic_load(&job.status);
    close(fd); /* read-only: nothing to lose if it fails; never retried (Linux frees fd) */
    return status;
}

int64_t axl_read_shards_scratch_bytes(int src_dtype, int ndim, const int64_t *shape,
                                      int nthreads) {
    if (axl_dtype_size(src_dtype) == 0) return -AXL_ERR_BAD_DTYPE;
    int64_t numel = 0;
    int status = check_shape(ndim, shape, &numel);
    if (status != AXL_OK) return -status;
    if (nthreads < 0) return -AXL_ERR_BAD_THREADS;
    if (numel == 0) return 0;
    int64_t rows, row_bytes;
    row_geometry(numel, shape, axl_dtype_size(src_dtype), &rows, &row_bytes);
    int threads = read_threads(nthreads, rows, row_bytes);
    /* threads <= rows, so the product stays <= the tensor's bytes. */
    int64_t chunk_rows = DEFAULT_CHUNK_BYTES / row_bytes;
    if (chunk_rows > rows / threads) chunk_rows = rows / threads;
    if (chunk_rows < 1) chunk_rows = 1;
    return threads * chunk_rows * row_bytes;
}

/* ---- the bytes of some blocks: axl_block_ranges and axl_read_blocks ----------------------
 * A walk over the plan's merged dims in file order. At dim d, grid cell kd (blocks with
 * that index on d) covers block[d] consecutive slabs of dim d, `slab[d]` elements each;
 * if no block under the cell is wanted the cell is skipped whole, if all are it is one
 * range, and otherwise each of its slabs is walked on the next dim. A cell of the last
 * dim holds one block, so the walk never goes deeper. Cells with no or all blocks wanted
 * cost their flags only, never their runs. */

enum { NONE_WANTED, ALL_WANTED, SOME_WANTED };

typedef struct walk_level {
    int64_t base;   /* element of the slab walked on this dim */
    int64_t prefix; /* its block coordinates on the dims before, row-major over their grid */
    int64_t kd;     /* the cell of this dim being walked */
    int64_t j;      /* the cell's slab being walked on the next dim; -1: cell not looked at */
} walk_level;

typedef struct range_walk {
    int m;
    int64_t grid[AXL_MAX_NDIM];
    int64_t block[AXL_MAX_NDIM]; /* block size per merged dim */
    int64_t slab[AXL_MAX_NDIM];  /* elements per index of each merged dim */
    int64_t under[AXL_MAX_NDIM]; /* blocks under one cell of each merged dim */
    const unsigned char *flags;  /* block k is wanted if flags[k] != 0 ... */
    void *const *dsts;           /* ... or, without flags, if dsts[k] != NULL */
    int64_t gap;                 /* coalescing: largest gap bridged, in elements */
    int depth;                   /* dim being walked, -1 when done */
    walk_level at[AXL_MAX_NDIM];
    int pending;                 /* a range found past the last coalesced one */
    int64_t pending_begin, pending_end;
} range_walk;

/* flags or dsts (one of them NULL) say which blocks of the plan's tensor are wanted;
 * ranges of them closer than gap_bytes >= 0 merge. The walk holds no pointer into itself:
 * a copy walks again from the same place. */
static void walk_init(range_walk *w, const shard_plan *p, const unsigned char *flags,
                      void *const *dsts, int64_t gap_bytes) {
    int m = p->m;
    w->m = m;
    for (int d = 0; d < m; d++) {
        w->grid[d] = p->grid[d];
        w->block[d] = p->size[d] / p->grid[d];
    }
    w->slab[m - 1] = 1;
    w->under[m - 1] = 1;
    for (int d = m - 2; d >= 0; d--) {
        w->slab[d] = w->slab[d + 1] * p->size[d + 1];
        w->under[d] = w->under[d + 1] * p->grid[d + 1];
    }
    w->flags = flags;
    w->dsts = dsts;
    w->gap = gap_bytes / (int64_t)p->ss; /* gaps are whole elements: the same test */
    w->depth = 0;
    w->at[0] = (walk_level){0, 0, 0, -1};
    w->pending = 0;
}

static int is_wanted(const range_walk *w, int64_t k) {
    return w->flags ? w->flags[k] != 0 : w->dsts[k] != NULL;
}

/* Whether none, all or some of the n blocks from k0 on are wanted. */
static int classify(const range_walk *w, int64_t k0, int64_t n) {
    int first = is_wanted(w, k0);
    for (int64_t k = k0 + 1; k < k0 + n; k++)
        if (is_wanted(w, k) != first) return SOME_WANTED;
    return first ? ALL_WANTED : NONE_WANTED;
}

/* The next range [*begin, *end) of elements of wanted blocks in file order, uncoalesced
 * (ranges may touch): 1, or 0 when none is left. */
static int walk_next(range_walk *w, int64_t *begin, int64_t *end) {
    while (w->depth >= 0) {
        int d = w->depth;
        walk_level *l = &w->at[d];
        if (l->kd == w->grid[d]) { /* slab done: on to the parent cell's next slab */
            if (--w->depth >= 0) {
                walk_level *up = &w->at[w->depth];
                if (++up->j == w->block[w->depth]) {
                    up->kd++;
                    up->j = -1;
                }
            }
            continue;
        }
        int64_t cell = l->prefix * w->grid[d] + l->kd;
        int64_t first = l->base + l->kd * w->block[d] * w->slab[d];
        if (l->j < 0) {
            int c = classify(w, cell * w->under[d], w->under[d]);
            if (c != SOME_WANTED) {
                l->kd++;
                if (c == NONE_WANTED) continue;
                *begin = first;
                *end = first + w->block[d] * w->slab[d];
                return 1;
            }
            l->j = 0;
        }
        /* Some wanted, so d < m - 1 (under[m-1] == 1): the cell's slab j, one dim down. */
        w->at[d + 1] = (walk_level){first + l->j * w->slab[d], cell, 0, -1};
        w->depth = d + 1;
    }
    return 0;
}

/* The next coalesced range in elements: 1, or 0 when none is left. Ranges come sorted,
 * disjoint, and more than the gap apart. */
static int walk_next_coalesced(range_walk *w, int64_t *begin, int64_t *end) {
    int64_t b, e, nb, ne;
    if (w->pending) {
        b = w->pending_begin;
        e = w->pending_end;
        w->pending = 0;
    } else if (!walk_next(w, &b, &e)) {
        return 0;
    }
    while (walk_next(w, &nb, &ne)) {
        if (nb - e <= w->gap) {
            e = ne;
            continue;
        }
        w->pending = 1;
        w->pending_begin = nb;
        w->pending_end = ne;
        break;
    }
    *begin = b;
    *end = e;
    return 1;
}

int64_t axl_block_ranges(int src_dtype, int ndim, const int64_t *shape, const int64_t *grid,
                         const unsigned char *wanted, int64_t gap_bytes, int64_t *ranges,
                         int64_t capacity) {
    size_t ss = axl_dtype_size(src_dtype);
    if (ss == 0) return -AXL_ERR_BAD_DTYPE;
    int64_t numel = 0, nblocks = 0;
    int status = check_shape(ndim, shape, &numel);
    if (status == AXL_OK) status = check_grid(ndim, shape, grid, &nblocks);
    if (status != AXL_OK) return -status;
    if (gap_bytes < 0 || capacity < 0) return -AXL_ERR_BAD_SIZE;
    if (numel == 0) return 0;
    if (!wanted || (!ranges && capacity > 0)) return -AXL_ERR_NULL_POINTER;

    shard_plan plan; /* the geometry only: equal dtypes pick no kernel */
    make_plan(&plan, ndim, shape, grid, AXL_ISA_SCALAR, src_dtype, src_dtype, NULL);
    range_walk walk;
    walk_init(&walk, &plan, wanted, NULL, gap_bytes);
    int64_t count = 0, b, e;
    for (; walk_next_coalesced(&walk, &b, &e); count++) {
        if (count >= capacity) continue;
        ranges[2 * count] = b * (int64_t)ss;
        ranges[2 * count + 1] = e * (int64_t)ss;
    }
    return count;
}

typedef struct blocks_job {
    const shard_plan *plan;
    int fd;
    int64_t offset;      /* of the tensor in the file */
    int64_t chunk_elems; /* most elements per read; a worker's scratch slot holds this many */
    char *scratch;
    pthread_mutex_t lock; /* guards walk, at and end */
    range_walk walk;
    int64_t at, end;      /* the current range's elements not handed out yet */
    atomic_int next_slot;
    atomic_int status;    /* the first failure; the others stop at their next chunk */
    atomic_int_fast64_t bytes_read;
} blocks_job;

/* The next chunk [*begin, *end) in file order: at most chunk_elems of the current range,
 * the next range once it is used up. 1, or 0 when none is left. */
static int next_chunk(blocks_job *job, int64_t *begin, int64_t *end) {
    pthread_mutex_lock(&job->lock);
    int got = job->at < job->end || walk_next_coalesced(&job->walk, &job->at, &job->end);
    if (got) {
        *begin = job->at;
        *end = job->end - job->at < job->chunk_elems ? job->end : job->at + job->chunk_elems;
        job->at = *end;
    }
    pthread_mutex_unlock(&job->lock);
    return got;
}

/* One worker (see WORKER_SPAN): reads chunks into its own slot of scratch and converts
 * their wanted runs into the blocks (scatter_elements skips the others'). */
static void blocks_worker(void *arg, int64_t begin, int64_t end) {
    blocks_job *job = arg;
    size_t ss = job->plan->ss;
    (void)begin;
    (void)end;
    int slot = atomic_fetch_add(&job->next_slot, 1); /* < T: at most T workers run */
    char *buf = job->scratch + (size_t)slot * (size_t)job->chunk_elems * ss;
    int64_t b, e;
    while (atomic_load(&job->status) == AXL_OK && next_chunk(job, &b, &e)) {
        int status = pread_full(job->fd, buf, (size_t)(e - b) * ss, job->offset + b * (int64_t)ss);
        if (status != AXL_OK) {
            int ok = AXL_OK;
            atomic_compare_exchange_strong(&job->status, &ok, status);
            return;
        }
        atomic_fetch_add(&job->bytes_read, (e - b) * (int64_t)ss);
        scatter_elements(job->plan, buf, b, e);
    }
}

int axl_read_blocks(const char *path, int64_t offset, int src_dtype, int ndim,
                    const int64_t *shape, const int64_t *grid, void *const *dsts, int dst_dtype,
                    int64_t gap_bytes, void *scratch, int64_t scratch_bytes, int nthreads,
                    int isa, int64_t *bytes_read) {
    if (bytes_read) *bytes_read = 0;
    int64_t numel = 0, nblocks = 0;
    int status = check_common(ndim, shape, grid, src_dtype, dst_dtype, nthreads, &isa, &numel,
                              &nblocks);
    if (status != AXL_OK) return status;
    size_t ss = axl_dtype_size(src_dtype), ds = axl_dtype_size(dst_dtype);
    int64_t bytes = numel * (int64_t)ss; /* numel <= MAX_ELEMENTS: no overflow */
    if (offset < 0 || offset > INT64_MAX - bytes || scratch_bytes < 0 || gap_bytes < 0)
        return AXL_ERR_BAD_SIZE;
    if (numel == 0) return AXL_OK; /* nothing to read: the file is not opened */
    status = check_blocks(dsts, nblocks, ds, 1);
    if (status != AXL_OK) return status;

    shard_plan plan;
    make_plan(&plan, ndim, shape, grid, isa, src_dtype, dst_dtype, dsts);
    range_walk walk;
    walk_init(&walk, &plan, NULL, dsts, gap_bytes);
    int64_t total = 0, b, e; /* R of autoxla.h, in elements; a first walk on a copy */
    for (range_walk count = walk; walk_next_coalesced(&count, &b, &e);) total += e - b;
    if (total == 0) return AXL_OK; /* no block wanted: the file is not opened */

    /* T: read_shards' threads, but no more than one per 1 MiB to read. */
    int64_t rows, row_bytes;
    row_geometry(numel, shape, ss, &rows, &row_bytes);
    int threads = read_threads(nthreads, rows, row_bytes);
    int64_t by_size = total * (int64_t)ss / MIN_READ_BYTES_PER_THREAD;
    if (by_size < threads) threads = by_size < 1 ? 1 : (int)by_size;
    if (scratch_bytes / threads < (int64_t)ss) return AXL_ERR_BAD_SIZE;
    if (!path || !scratch) return AXL_ERR_NULL_POINTER;
    if ((uintptr_t)scratch % ss) return AXL_ERR_MISALIGNED;
    status = check_overlap(scratch, (size_t)scratch_bytes, dsts, nblocks,
                           (size_t)(numel / nblocks) * ds);
    if (status != AXL_OK) return status;

    /* A worker's slot: its share of scratch, but no more than its share of the bytes to
     * read, so that every worker gets a chunk. Chunks may end mid-run. */
    int64_t chunk_elems = scratch_bytes / threads / (int64_t)ss;
    int64_t share = (total + threads - 1) / threads;
    if (chunk_elems > share) chunk_elems = share;

    blocks_job job = {
        .plan = &plan,
        .offset = offset,
        .chunk_elems = chunk_elems,
        .scratch = scratch,
        .walk = walk,
    };
    atomic_init(&job.next_slot, 0);
    atomic_init(&job.status, AXL_OK);
    atomic_init(&job.bytes_read, 0);
    if (pthread_mutex_init(&job.lock, NULL) != 0) return AXL_ERR_RESOURCE;

    /* Opened as in axl_read_shards (O_NONBLOCK; FIFOs, sockets, directories refused). */
    int fd;
    do {
        fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    } while (fd < 0 && errno == EINTR);
    struct stat st;
    if (fd >= 0 && (fstat(fd, &st) != 0 || S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode) ||
                    S_ISDIR(st.st_mode))) {
        close(fd);
        fd = -1;
    }
    if (fd < 0) {
        pthread_mutex_destroy(&job.lock);
        return AXL_ERR_IO;
    }
    job.fd = fd;
    status = axl_parallel_for((int64_t)threads * WORKER_SPAN, threads, WORKER_SPAN,
                              blocks_worker, &job);
    if (status == AXL_OK) status = atomic_load(&job.status);
    close(fd);
    pthread_mutex_destroy(&job.lock);
    if (bytes_read) *bytes_read = atomic_load(&job.bytes_read);
    return status;
}
