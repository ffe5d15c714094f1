/* fuzz_safetensors_header.c - libFuzzer target for axl_st_parse_header (autoxla.h), the C
 * core's safetensors header reader.
 *
 * Input: 1 mode byte, then the header's bytes (the n bytes after the 8-byte length). The
 * mode picks the file size: exactly right for the header's tensors (8 + n + D, D learnt
 * from a first call with the largest size), one byte short, one byte long, or (mode 3) the
 * next 8 input bytes as a signed little-endian size. The header lives in a buffer of exactly
 * n bytes and every output buffer has exactly the size documented as sufficient, so
 * AddressSanitizer sees any access outside them.
 *
 * Checked on every input: the status is AXL_OK, AXL_ERR_BAD_HEADER, or AXL_ERR_BAD_SIZE for
 * a negative size only (never AXL_ERR_BAD_SIZE / AXL_ST_ERR_CAPACITY: the documented
 * bounds must hold); the error is in range and its spans lie in the header and are quoted;
 * the sizing call (NULL buffers) agrees; exact buffers from the sizing call give the same
 * records; the result is deterministic. On success: records tile [0, D) in order, each
 * span = dims product * dtype bits / 8, names are valid UTF-8 no longer than their keys, and
 * 8 + n + D == file size. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"

static void alloc_buffers(axl_st_header *h, int64_t records, int64_t names, int64_t dims) {
    memset(h, 0, sizeof *h);
    h->records_cap = records;
    h->names_cap = names;
    h->dims_cap = dims;
    h->records = xmalloc((size_t)records * sizeof *h->records);
    h->names = xmalloc((size_t)names);
    h->dims = xmalloc((size_t)dims * sizeof *h->dims);
}

static void free_buffers(axl_st_header *h) {
    free(h->records);
    free(h->names);
    free(h->dims);
}

/* Independent strict UTF-8 check (Unicode table 3-7). */
static int valid_utf8(const uint8_t *s, int64_t n) {
    for (int64_t i = 0; i < n;) {
        uint32_t c = s[i], cp, min;
        int extra;
        if (c < 0x80) { i++; continue; }
        else if ((c & 0xE0) == 0xC0) { extra = 1; cp = c & 0x1F; min = 0x80; }
        else if ((c & 0xF0) == 0xE0) { extra = 2; cp = c & 0x0F; min = 0x800; }
        else if ((c & 0xF8) == 0xF0) { extra = 3; cp = c & 0x07; min = 0x10000; }
        else return 0;
        if (i + extra >= n) return 0;
        for (int k = 1; k <= extra; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return 0;
            cp = cp << 6 | (s[i + k] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
        i += 1 + extra;
    }
    return 1;
}

static void check_span(const uint8_t *hdr, int64_t n, int64_t pos, int64_t len, const char *what) {
    if (pos == -1 && len == -1) return;
    if (pos < 0 || len < 2 || pos > n - len) fail("%s span %lld+%lld outside the %lld-byte header", what, (long long)pos, (long long)len, (long long)n);
    if (hdr[pos] != '"' || hdr[pos + len - 1] != '"') fail("%s span %lld+%lld is not a quoted key", what, (long long)pos, (long long)len);
}

static int cross_kind(int64_t kind) {
    return kind == AXL_ST_ERR_DUPLICATE_NAME || kind == AXL_ST_ERR_GAP ||
           kind == AXL_ST_ERR_OVERLAP || kind == AXL_ST_ERR_SAME_BYTES ||
           kind == AXL_ST_ERR_TRUNCATED || kind == AXL_ST_ERR_TRAILING_BYTES;
}

static void check_success(const uint8_t *hdr, int64_t n, int64_t file_size, const axl_st_header *h) {
    int64_t at = 0;
    for (int64_t i = 0; i < h->count; i++) {
        const axl_st_tensor *r = &h->records[i];
        int bits = axl_st_dtype_bits((int)r->dtype);
        if (bits == 0) fail("record %lld has dtype %lld", (long long)i, (long long)r->dtype);
        if (r->begin != at || r->end < r->begin)
            fail("record %lld spans %lld..%lld, expected to begin at %lld", (long long)i, (long long)r->begin, (long long)r->end, (long long)at);
        if (r->ndim < 0 || r->ndim > AXL_ST_MAX_NDIM || r->dims_off < 0 || r->dims_off > h->dims_used - r->ndim)
            fail("record %lld has dims %lld+%lld of %lld", (long long)i, (long long)r->dims_off, (long long)r->ndim, (long long)h->dims_used);
        __int128 elements = 1;
        for (int64_t d = 0; d < r->ndim; d++) {
            if (h->dims[r->dims_off + d] < 0) fail("negative dim");
            elements *= h->dims[r->dims_off + d];
            if (elements > INT64_MAX) fail("record %lld: element count overflows", (long long)i);
        }
        __int128 total_bits = elements * bits;
        if (total_bits % 8 || total_bits / 8 != (__int128)(r->end - r->begin))
            fail("record %lld: %lld bytes for %lld elements of %d bits", (long long)i, (long long)(r->end - r->begin), (long long)elements, bits);
        if (r->name_off < 0 || r->name_len < 0 || r->name_off > h->names_used - r->name_len)
            fail("record %lld: name %lld+%lld of %lld", (long long)i, (long long)r->name_off, (long long)r->name_len, (long long)h->names_used);
        if (!valid_utf8((const uint8_t *)h->names + r->name_off, r->name_len)) fail("record %lld: name is not UTF-8", (long long)i);
        check_span(hdr, n, r->key_pos, r->key_len, "key");
        if (r->name_len > r->key_len - 2) fail("record %lld: name longer than its key", (long long)i);
        /* distinct names (quadratic, but inputs are small) */
        for (int64_t j = 0; j < i; j++) {
            const axl_st_tensor *q = &h->records[j];
            if (q->name_len == r->name_len && memcmp(h->names + q->name_off, h->names + r->name_off, (size_t)r->name_len) == 0)
                fail("records %lld and %lld have the same name", (long long)j, (long long)i);
        }
        at = r->end;
    }
    if (at != h->data_bytes) fail("data_bytes %lld, records end at %lld", (long long)h->data_bytes, (long long)at);
    if ((__int128)8 + n + at != file_size) fail("accepted a file of %lld bytes for 8 + %lld + %lld", (long long)file_size, (long long)n, (long long)at);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_input in = {data, size};
    const uint8_t mode = take(&in) % 4;
    int64_t raw_size = 0;
    if (mode == 3)
        for (int k = 0; k < 8; k++) raw_size |= (int64_t)((uint64_t)take(&in) << (8 * k));
    const int64_t n = (int64_t)in.n;
    uint8_t *hdr = xmalloc(in.n);
    if (in.n) memcpy(hdr, in.p, in.n);
    const uint8_t *hp = n ? hdr : NULL;

    int64_t file_size;
    if (mode == 3) {
        file_size = raw_size;
    } else {
        /* D from a call with the largest file: TRAILING_BYTES reports it */
        axl_st_header probe;
        alloc_buffers(&probe, n / AXL_ST_MIN_ENTRY_BYTES + 1, n, n / 2 + 1);
        int rc = axl_st_parse_header(hp, n, INT64_MAX, &probe);
        int64_t d = rc == AXL_ERR_BAD_HEADER && probe.error.kind == AXL_ST_ERR_TRAILING_BYTES
                        ? probe.error.value : 0;
        free_buffers(&probe);
        file_size = 8 + n + d;
        if (mode == 1 && file_size > 0) file_size--;
        if (mode == 2 && file_size < INT64_MAX) file_size++;
    }

    axl_st_header h, again, sizing = {0};
    alloc_buffers(&h, n / AXL_ST_MIN_ENTRY_BYTES + 1, n, n / 2 + 1);
    const int rc = axl_st_parse_header(hp, n, file_size, &h);
    if (file_size < 0) {
        if (rc != AXL_ERR_BAD_SIZE) fail("file size %lld: status %d", (long long)file_size, rc);
        free_buffers(&h);
        free(hdr);
        return 0;
    }
    if (rc != AXL_OK && rc != AXL_ERR_BAD_HEADER)
        fail("status %d (%s), kind %lld (%s) with the documented buffer sizes", rc, axl_strerror(rc), (long long)h.error.kind, axl_st_error_text((int)h.error.kind));
    const axl_st_error *e = &h.error;
    if ((rc == AXL_OK) != (e->kind == AXL_ST_OK)) fail("status %d with kind %lld", rc, (long long)e->kind);
    if (e->kind < 0 || e->kind >= AXL_ST_ERROR_KIND_COUNT) fail("kind %lld", (long long)e->kind);
    if (e->position < -1 || e->position > n) fail("position %lld in a %lld-byte header", (long long)e->position, (long long)n);
    check_span(hdr, n, e->tensor_pos, e->tensor_len, "error tensor");
    check_span(hdr, n, e->other_pos, e->other_len, "error other");
    if (e->tensor < -1 || e->tensor > h.count) fail("error tensor index %lld of %lld", (long long)e->tensor, (long long)h.count);
    if (h.count > h.records_cap || h.names_used > h.names_cap || h.dims_used > h.dims_cap) fail("outputs exceed caps");

    /* the sizing call agrees */
    const int src = axl_st_parse_header(hp, n, file_size, &sizing);
    if (rc == AXL_OK || cross_kind(e->kind)) {
        if (src != AXL_OK) fail("sizing call: status %d, kind %lld, full call: kind %lld", src, (long long)sizing.error.kind, (long long)e->kind);
        if (sizing.count != h.count || sizing.names_used != h.names_used || sizing.dims_used != h.dims_used)
            fail("sizing call counts %lld/%lld/%lld, full call %lld/%lld/%lld", (long long)sizing.count, (long long)sizing.names_used, (long long)sizing.dims_used, (long long)h.count, (long long)h.names_used, (long long)h.dims_used);
    } else if (src != rc || sizing.error.kind != e->kind || sizing.error.position != e->position) {
        fail("sizing call: status %d kind %lld at %lld, full call: %d kind %lld at %lld", src, (long long)sizing.error.kind, (long long)sizing.error.position, rc, (long long)e->kind, (long long)e->position);
    }

    if (rc == AXL_OK) {
        check_success(hdr, n, file_size, &h);
        /* exact buffers from the sizing call: the same records; deterministic */
        alloc_buffers(&again, sizing.count, sizing.names_used, sizing.dims_used);
        int rc2 = axl_st_parse_header(hp, n, file_size, &again);
        if (rc2 != AXL_OK || again.count != h.count) fail("exact buffers: status %d", rc2);
        if (h.count && memcmp(again.records, h.records, (size_t)h.count * sizeof *h.records))
            fail("exact buffers: other records");
        if (h.names_used && memcmp(again.names, h.names, (size_t)h.names_used)) fail("exact buffers: other names");
        if (h.dims_used && memcmp(again.dims, h.dims, (size_t)h.dims_used * sizeof *h.dims)) fail("exact buffers: other dims");
        free_buffers(&again);
    }
    free_buffers(&h);
    free(hdr);
    return 0;
}
