/* test_safetensors.c - axl_st_parse_header: valid headers (escapes, metadata, zero-size and
 * scalar tensors, padding, keys and tensors in any order, ignored fields, every dtype) give
 * exactly the expected records, and every rule of autoxla.h rejects several headers with the
 * expected error kind, position and tensor. Every header is parsed from a malloc'd buffer of
 * exactly its length (so the sanitizer build catches a read past it), with output buffers of
 * exactly the documented bounds, and again in the sizing mode, which must agree. Then every
 * prefix and many random mutations of valid headers must parse without a crash. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "test.h"

void test_safetensors(void);

typedef struct parsed {
    int rc;           /* status of the full call */
    int sizing_rc;    /* status of the sizing call */
    axl_st_header h;  /* of the full call */
    axl_st_header sz; /* of the sizing call */
    uint8_t *header;
    int64_t n;
} parsed;

static void parsed_free(parsed *p) {
    free(p->h.records);
    free(p->h.names);
    free(p->h.dims);
    free(p->header);
    memset(p, 0, sizeof *p);
}

/* Parses n bytes of text as the header of a file of file_size bytes. */
static void parse_n(parsed *p, const char *text, int64_t n, int64_t file_size) {
    memset(p, 0, sizeof *p);
    p->n = n;
    p->header = xmalloc((size_t)n);
    memcpy(p->header, text, (size_t)n);
    axl_st_header *h = &p->h;
    h->records_cap = n / AXL_ST_MIN_ENTRY_BYTES + 1;
    h->names_cap = n;
    h->dims_cap = n / 2 + 1;
    h->records = xmalloc((size_t)h->records_cap * sizeof *h->records);
    h->names = xmalloc((size_t)h->names_cap);
    h->dims = xmalloc((size_t)h->dims_cap * sizeof *h->dims);
    p->rc = axl_st_parse_header(n ? p->header : NULL, n, file_size, h);
    p->sizing_rc = axl_st_parse_header(n ? p->header : NULL, n, file_size, &p->sz);
    /* the sizing call sees every error but the cross-tensor ones, and counts the same */
    const int kind = (int)h->error.kind;
    const int cross = kind == AXL_ST_ERR_DUPLICATE_NAME || kind == AXL_ST_ERR_GAP ||
                      kind == AXL_ST_ERR_OVERLAP || kind == AXL_ST_ERR_SAME_BYTES ||
                      kind == AXL_ST_ERR_TRUNCATED || kind == AXL_ST_ERR_TRAILING_BYTES;
    if (p->rc == AXL_OK || cross) {
        CHECK_MSG(p->sizing_rc == AXL_OK, "sizing call of %.*s: %d", (int)n, text, p->sizing_rc);
        CHECK_EQ(p->sz.count, h->count);
        CHECK_EQ(p->sz.names_used, h->names_used);
        CHECK_EQ(p->sz.dims_used, h->dims_used);
    } else {
        CHECK_EQ(p->sizing_rc, p->rc);
        CHECK_EQ(p->sz.error.kind, h->error.kind);
        CHECK_EQ(p->sz.error.position, h->error.position);
        CHECK_EQ(p->sz.error.tensor_pos, h->error.tensor_pos);
    }
    if (p->rc == AXL_OK) CHECK_EQ(h->error.kind, AXL_ST_OK);
}

/* text as a header followed by data bytes of tensor data. */
static void parse(parsed *p, const char *text, int64_t data) {
    int64_t n = (int64_t)strlen(text);
    parse_n(p, text, n, 8 + n + data);
}

/* The header is valid with data bytes of data: checks and returns the parse. */
#define VALID(p, text, data)                                                            \
    do {                                                                                \
        parse(p, text, data);                                                           \
        CHECK_MSG((p)->rc == AXL_OK, "%s: status %d kind %d (%s) at %lld", text,        \
                  (p)->rc, (int)(p)->h.error.kind, axl_st_error_text((int)(p)->h.error.kind), \
                  (long long)(p)->h.error.position);                                   \
    } while (0)

/* The header (with data bytes of data) is rejected with kind; returns nothing. */
static void rejected_n(const char *text, int64_t n, int64_t file_size, int kind, int line) {
    parsed p;
    parse_n(&p, text, n, file_size);
    int want_rc = kind == AXL_ST_ERR_CAPACITY ? AXL_ERR_BAD_SIZE : AXL_ERR_BAD_HEADER;
    CHECK_MSG(p.rc == want_rc && p.h.error.kind == kind,
              "line %d: %.*s: status %d kind %d (%s), expected kind %d (%s)", line, (int)n, text,
              p.rc, (int)p.h.error.kind, axl_st_error_text((int)p.h.error.kind), kind,
              axl_st_error_text(kind));
    CHECK(p.h.error.position >= -1 && p.h.error.position <= n);
    parsed_free(&p);
}
#define REJECT(text, data, kind) \
    rejected_n(text, (int64_t)strlen(text), 8 + (int64_t)strlen(text) + (data), kind, __LINE__)

static const char *name_of(const parsed *p, int64_t i) {
    static char buf[256];
    const axl_st_tensor *r = &p->h.records[i];
    int64_t len = r->name_len < 255 ? r->name_len : 255;
    memcpy(buf, p->h.names + r->name_off, (size_t)len);
    buf[len] = 0;
    return buf;
}

static int name_is(const parsed *p, int64_t i, const char *want, int64_t want_len) {
    const axl_st_tensor *r = &p->h.records[i];
    return r->name_len == want_len && memcmp(p->h.names + r->name_off, want, (size_t)want_len) == 0;
}

static int shape_is(const parsed *p, int64_t i, const int64_t *want, int64_t ndim) {
    const axl_st_tensor *r = &p->h.records[i];
    if (r->ndim != ndim) return 0;
    for (int64_t d = 0; d < ndim; d++)
        if (p->h.dims[r->dims_off + d] != want[d]) return 0;
    return 1;
}

/* The key span of record i in the header is exactly the quoted text want. */
static int key_is_text(const parsed *p, int64_t pos, int64_t len, const char *want) {
    return pos >= 0 && len == (int64_t)strlen(want) &&
           memcmp(p->header + pos, want, (size_t)len) == 0;
}

/* ---- valid headers ---------------------------------------------------------------------- */

static void test_basic(void) {
    parsed p;
    VALID(&p,
          "{\"__metadata__\":{\"format\":\"pt\"},"
          "\"b\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[8,32]},"
          "\"a\":{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[0,8]}}",
          32);
    CHECK_EQ(p.h.count, 2);
    CHECK_EQ(p.h.data_bytes, 32);
    CHECK_EQ(p.h.dims_used, 3);
    CHECK_EQ(p.h.names_used, 2);
    /* sorted by offsets: a first */
    CHECK_MSG(name_is(&p, 0, "a", 1), "%s", name_of(&p, 0));
    CHECK(name_is(&p, 1, "b", 1));
    CHECK_EQ(p.h.records[0].dtype, AXL_ST_BF16);
    CHECK_EQ(p.h.records[1].dtype, AXL_ST_F32);
    CHECK(shape_is(&p, 0, (const int64_t[]){4}, 1));
    CHECK(shape_is(&p, 1, (const int64_t[]){2, 3}, 2));
    CHECK_EQ(p.h.records[0].begin, 0);
    CHECK_EQ(p.h.records[0].end, 8);
    CHECK_EQ(p.h.records[1].begin, 8);
    CHECK_EQ(p.h.records[1].end, 32);
    CHECK(key_is_text(&p, p.h.records[0].key_pos, p.h.records[0].key_len, "\"a\""));
    CHECK(key_is_text(&p, p.h.records[1].key_pos, p.h.records[1].key_len, "\"b\""));
    parsed_free(&p);

    /* the empty header, with and without whitespace */
    VALID(&p, "{}", 0);
    CHECK_EQ(p.h.count, 0);
    CHECK_EQ(p.h.data_bytes, 0);
    parsed_free(&p);
    VALID(&p, "{ \t\r\n}   ", 0);
    CHECK_EQ(p.h.count, 0);
    parsed_free(&p);
    VALID(&p, "{\"__metadata__\":{}}", 0);
    CHECK_EQ(p.h.count, 0);
    parsed_free(&p);
}

static void test_escapes(void) {
    parsed p;
    /* names: quote, backslash, slash, \n, e-acute as escape and raw, an emoji as a surrogate
     * pair and raw, U+0000, U+FFFF, U+10FFFF (raw F4 8F BF BF), and an escaped field name */
    VALID(&p,
          "{\"q\\\"b\\\\s\\/\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
          "\"nl\\n\\t\\b\\f\\r\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]},"
          "\"\\u00e9\\u00E9\xc3\xa9\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[2,3]},"
          "\"\\ud83d\\ude00\xf0\x9f\x98\x80\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[3,4]},"
          "\"z\\u0000\\uffff\xf4\x8f\xbf\xbf\":{\"\\u0064type\":\"U8\",\"shape\":[1],\"data_offsets\":[4,5]}}",
          5);
    CHECK_EQ(p.h.count, 5);
    if (p.rc == AXL_OK) {
        CHECK_MSG(name_is(&p, 0, "q\"b\\s/", 6), "%s", name_of(&p, 0));
        CHECK(name_is(&p, 1, "nl\n\t\b\f\r", 7));
        CHECK(name_is(&p, 2, "\xc3\xa9\xc3\xa9\xc3\xa9", 6));
        CHECK(name_is(&p, 3, "\xf0\x9f\x98\x80\xf0\x9f\x98\x80", 8));
        CHECK(name_is(&p, 4, "z\0\xef\xbf\xbf\xf4\x8f\xbf\xbf", 9));
        CHECK_EQ(p.h.names_used, 6 + 7 + 6 + 8 + 9);
    }
    parsed_free(&p);
    /* escaped metadata values, metadata in the middle (and last, below) */
    VALID(&p,
          "{\"a\":{\"dtype\":\"I8\",\"shape\":[2],\"data_offsets\":[0,2]},"
          "\"__metadata__\":{\"k\\u0041\":\"v\\n\\ud800\\udc00\",\"empty\":\"\"},"
          "\"b\":{\"dtype\":\"I8\",\"shape\":[2],\"data_offsets\":[2,4]}}",
          4);
    CHECK_EQ(p.h.count, 2);
    CHECK_EQ(p.h.names_used, 2); /* metadata names are not kept */
    parsed_free(&p);
    /* "__metadata__": null is no metadata (safetensors reads it as None) */
    VALID(&p, "{\"a\":{\"dtype\":\"I8\",\"shape\":[2],\"data_offsets\":[0,2]},\"__metadata__\":null}", 2);
    CHECK_EQ(p.h.count, 1);
    parsed_free(&p);
}

static void test_zero_size_and_scalars(void) {
    parsed p;
    /* zero-size tensors at the start, between, at the end, several at one offset; a scalar */
    VALID(&p,
          "{\"e0\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]},"
          "\"s\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]},"
          "\"e1\":{\"dtype\":\"F16\",\"shape\":[2,0,3],\"data_offsets\":[4,4]},"
          "\"e2\":{\"dtype\":\"I64\",\"shape\":[0,5],\"data_offsets\":[4,4]},"
          "\"t\":{\"dtype\":\"I16\",\"shape\":[1,1,1],\"data_offsets\":[4,6]},"
          "\"e3\":{\"dtype\":\"BOOL\",\"shape\":[0],\"data_offsets\":[6,6]}}",
          6);
    CHECK_EQ(p.h.count, 6);
    if (p.rc == AXL_OK) {
        CHECK(name_is(&p, 0, "e0", 2));
        CHECK(name_is(&p, 1, "s", 1));
        CHECK(shape_is(&p, 1, NULL, 0));
        /* e1, e2 at 4..4 in key order, then t, then e3 */
        CHECK(name_is(&p, 2, "e1", 2));
        CHECK(name_is(&p, 3, "e2", 2));
        CHECK(name_is(&p, 4, "t", 1));
        CHECK(name_is(&p, 5, "e3", 2));
        CHECK(shape_is(&p, 2, (const int64_t[]){2, 0, 3}, 3));
        CHECK_EQ(p.h.data_bytes, 6);
    }
    parsed_free(&p);
    /* only zero-size tensors: the data section is empty */
    VALID(&p, "{\"e\":{\"dtype\":\"U64\",\"shape\":[0,0],\"data_offsets\":[0,0]}}", 0);
    CHECK_EQ(p.h.data_bytes, 0);
    parsed_free(&p);
    /* a huge dimension times 0 */
    VALID(&p, "{\"e\":{\"dtype\":\"F64\",\"shape\":[0,9223372036854775807],\"data_offsets\":[0,0]}}", 0);
    parsed_free(&p);
}

static void test_order_padding_and_ignored_fields(void) {
    parsed p;
    /* fields in every order, whitespace between all tokens, trailing padding */
    VALID(&p,
          "{ \"c\" : { \"data_offsets\" : [ 6 , 12 ] , \"shape\" : [ 3 ] , \"dtype\" : \"F16\" } ,\n"
          "\t\"a\":{\"shape\":[2],\"dtype\":\"U8\",\"data_offsets\":[0,2]},\r\n"
          "\"b\":{\"data_offsets\":[2,6],\"dtype\":\"U16\",\"shape\":[2]}}        \n\t\r ",
          12);
    CHECK_EQ(p.h.count, 3);
    if (p.rc == AXL_OK) {
        CHECK(name_is(&p, 0, "a", 1) && name_is(&p, 1, "b", 1) && name_is(&p, 2, "c", 1));
        CHECK_EQ(p.h.records[1].dtype, AXL_ST_U16);
        CHECK_EQ(p.h.records[2].dtype, AXL_ST_F16);
    }
    parsed_free(&p);
    /* unknown fields of every JSON type are skipped */
    VALID(&p,
          "{\"a\":{\"x\":[1,-2.5e+3,0.0,-0,1E9,{\"k\":[true,false,null]},\"s\\u1234\",[]],"
          "\"dtype\":\"F32\",\"y\":{},\"shape\":[1],\"z\":null,\"data_offsets\":[0,4],"
          "\"dtypes\":7,\"shap\":\"e\",\"DTYPE\":0}}",
          4);
    CHECK_EQ(p.h.count, 1);
    parsed_free(&p);
    /* nesting up to the limit in an ignored field: the entry is depth 2, so 62 more */
    {
        char buf[512];
        int at = snprintf(buf, sizeof buf, "{\"a\":{\"x\":");
        for (int k = 0; k < AXL_ST_MAX_DEPTH - 2; k++) buf[at++] = '[';
        for (int k = 0; k < AXL_ST_MAX_DEPTH - 2; k++) buf[at++] = ']';
        snprintf(buf + at, sizeof buf - (size_t)at,
                 ",\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[0,1]}}");
        VALID(&p, buf, 1);
        parsed_free(&p);
        at = snprintf(buf, sizeof buf, "{\"a\":{\"x\":");
        for (int k = 0; k < AXL_ST_MAX_DEPTH - 1; k++) buf[at++] = '[';
        for (int k = 0; k < AXL_ST_MAX_DEPTH - 1; k++) buf[at++] = ']';
        snprintf(buf + at, sizeof buf - (size_t)at,
                 ",\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[0,1]}}");
        REJECT(buf, 1, AXL_ST_ERR_TOO_DEEP);
        /* an object in an object ... : the same limit */
        at = snprintf(buf, sizeof buf, "{\"a\":{\"x\":");
        for (int k = 0; k < AXL_ST_MAX_DEPTH; k++) at += snprintf(buf + at, sizeof buf - (size_t)at, "{\"k\":");
        buf[at++] = '1';
        for (int k = 0; k < AXL_ST_MAX_DEPTH; k++) buf[at++] = '}';
        buf[at] = 0;
        REJECT(buf, 1, AXL_ST_ERR_TOO_DEEP);
    }
}

static void test_every_dtype(void) {
    /* each dtype with 8 elements: bytes = bits (the 6-bit ones fill 6 whole bytes) */
    for (int d = 0; d < AXL_ST_DTYPE_COUNT; d++) {
        const char *name = axl_st_dtype_name(d);
        int bits = axl_st_dtype_bits(d);
        CHECK(name != NULL && bits > 0);
        char buf[256];
        snprintf(buf, sizeof buf, "{\"t\":{\"dtype\":\"%s\",\"shape\":[2,4],\"data_offsets\":[0,%d]}}",
                 name, bits);
        parsed p;
        VALID(&p, buf, bits);
        CHECK_EQ(p.h.count, 1);
        if (p.rc == AXL_OK) CHECK_EQ(p.h.records[0].dtype, d);
        parsed_free(&p);
        for (int e = 0; e < d; e++) CHECK(strcmp(name, axl_st_dtype_name(e)) != 0);
    }
    CHECK_EQ(axl_st_dtype_bits(AXL_ST_F4), 4);
    CHECK_EQ(axl_st_dtype_bits(AXL_ST_F6_E2M3), 6);
    CHECK_EQ(axl_st_dtype_bits(AXL_ST_BOOL), 8);
    CHECK_EQ(axl_st_dtype_bits(AXL_ST_BF16), 16);
    CHECK_EQ(axl_st_dtype_bits(AXL_ST_C64), 64);
    CHECK(strcmp(axl_st_dtype_name(AXL_ST_F8_E4M3), "F8_E4M3") == 0);
    CHECK(axl_st_dtype_name(-1) == NULL && axl_st_dtype_name(AXL_ST_DTYPE_COUNT) == NULL);
    CHECK_EQ(axl_st_dtype_bits(AXL_ST_DTYPE_COUNT), 0);
    /* sub-byte: whole bytes only */
    REJECT("{\"t\":{\"dtype\":\"F4\",\"shape\":[3],\"data_offsets\":[0,2]}}", 2,
           AXL_ST_ERR_PARTIAL_BYTE);
    REJECT("{\"t\":{\"dtype\":\"F4\",\"shape\":[3],\"data_offsets\":[0,1]}}", 1,
           AXL_ST_ERR_PARTIAL_BYTE);
    REJECT("{\"t\":{\"dtype\":\"F6_E3M2\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1,
           AXL_ST_ERR_PARTIAL_BYTE);
    REJECT("{\"t\":{\"dtype\":\"F6_E2M3\",\"shape\":[2,3],\"data_offsets\":[0,5]}}", 5,
           AXL_ST_ERR_PARTIAL_BYTE);
    parsed p;
    VALID(&p, "{\"t\":{\"dtype\":\"F6_E2M3\",\"shape\":[2,2],\"data_offsets\":[0,3]}}", 3);
    parsed_free(&p);
    VALID(&p, "{\"t\":{\"dtype\":\"F4\",\"shape\":[1,2],\"data_offsets\":[0,1]}}", 1);
    parsed_free(&p);
}

/* ---- rejections ------------------------------------------------------------------------- */

#define T1 "{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}"

static void test_json_syntax(void) {
    /* not an object, or not starting with '{' */
    REJECT("[]", 0, AXL_ST_ERR_NOT_OBJECT);
    REJECT(" {}", 0, AXL_ST_ERR_NOT_OBJECT);
    REJECT("\"a\"", 0, AXL_ST_ERR_NOT_OBJECT);
    REJECT("1", 0, AXL_ST_ERR_NOT_OBJECT);
    REJECT("null", 0, AXL_ST_ERR_NOT_OBJECT);
    rejected_n("", 0, 8, AXL_ST_ERR_EOF, __LINE__);
    /* ends too early */
    REJECT("{", 0, AXL_ST_ERR_EOF);
    REJECT("{\"a", 0, AXL_ST_ERR_EOF);
    REJECT("{\"a\":", 0, AXL_ST_ERR_EOF);
    REJECT("{\"a\":{\"dtype\":\"F32\"", 0, AXL_ST_ERR_EOF);
    REJECT("{\"a\":{\"dtype\":\"F32\",\"shape\":[1", 0, AXL_ST_ERR_EOF);
    REJECT("{\"a\":" T1, 4, AXL_ST_ERR_EOF);
    REJECT("{\"a\":{\"x\":1.", 0, AXL_ST_ERR_EOF);
    REJECT("{\"a\":{\"x\":tr", 0, AXL_ST_ERR_EOF);
    REJECT("{\"a\\", 0, AXL_ST_ERR_EOF);
    REJECT("{\"a\\u12", 0, AXL_ST_ERR_EOF);
    /* bad bytes */
    REJECT("{,}", 0, AXL_ST_ERR_SYNTAX);
    REJECT("{\"a\":" T1 ",}", 4, AXL_ST_ERR_SYNTAX);
    REJECT("{'a':" T1 "}", 4, AXL_ST_ERR_SYNTAX);
    REJECT("{\"a\" " T1 "}", 4, AXL_ST_ERR_SYNTAX);
    REJECT("{\"a\":" T1 " \"b\":" T1 "}", 4, AXL_ST_ERR_SYNTAX);
    REJECT("{\"a\":{\"x\":tru,\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[0,1]}}", 1,
           AXL_ST_ERR_SYNTAX);
    REJECT("{\"a\":{\"x\":nul}}", 0, AXL_ST_ERR_SYNTAX);
    REJECT("{\"a\":{\"x\":+1}}", 0, AXL_ST_ERR_SYNTAX);
    REJECT("{\"a\":{\"x\":.5}}", 0, AXL_ST_ERR_SYNTAX);
    REJECT("{\"a\":{\"x\":1.e5}}", 0, AXL_ST_ERR_SYNTAX);
    REJECT("{\"a\":{\"x\":1e}}", 0, AXL_ST_ERR_SYNTAX);
    REJECT("{\"a\":{\"x\":-}}", 0, AXL_ST_ERR_SYNTAX);
    REJECT("{\"a\":{\"x\":[1,]}}", 0, AXL_ST_ERR_SYNTAX);
    REJECT("{\"a\":{\"x\":[1 2]}}", 0, AXL_ST_ERR_SYNTAX);
    REJECT("{\"a\":{\"x\":{1:2}}}", 0, AXL_ST_ERR_SYNTAX);
    REJECT("{\"a\":{\"x\":NaN}}", 0, AXL_ST_ERR_SYNTAX);
    REJECT("{\"a\":{\"x\":01}}", 0, AXL_ST_ERR_LEADING_ZERO);
    REJECT("{\"a\":{\"dtype\":\"F32\",,\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
           AXL_ST_ERR_SYNTAX);
    /* after the object: only whitespace */
    REJECT("{}x", 0, AXL_ST_ERR_TRAILING_DATA);
    REJECT("{}{}", 0, AXL_ST_ERR_TRAILING_DATA);
    REJECT("{} ,", 0, AXL_ST_ERR_TRAILING_DATA);
    REJECT("{}   \f", 0, AXL_ST_ERR_TRAILING_DATA);
    rejected_n("{}\0", 3, 11, AXL_ST_ERR_TRAILING_DATA, __LINE__);
    rejected_n("{}  \0  ", 7, 15, AXL_ST_ERR_TRAILING_DATA, __LINE__);
}

static void test_strings(void) {
    /* invalid UTF-8: overlong, surrogate, above U+10FFFF, stray bytes, truncated sequences */
    REJECT("{\"\xc0\x80\":" T1 "}", 4, AXL_ST_ERR_UTF8);
    REJECT("{\"\xc1\xbf\":" T1 "}", 4, AXL_ST_ERR_UTF8);
    REJECT("{\"\xe0\x80\xaf\":" T1 "}", 4, AXL_ST_ERR_UTF8);
    REJECT("{\"\xf0\x80\x80\xaf\":" T1 "}", 4, AXL_ST_ERR_UTF8);
    REJECT("{\"\xed\xa0\x80\":" T1 "}", 4, AXL_ST_ERR_UTF8);
    REJECT("{\"\xed\xbf\xbf\":" T1 "}", 4, AXL_ST_ERR_UTF8);
    REJECT("{\"\xf4\x90\x80\x80\":" T1 "}", 4, AXL_ST_ERR_UTF8);
    REJECT("{\"\xf5\x80\x80\x80\":" T1 "}", 4, AXL_ST_ERR_UTF8);
    REJECT("{\"\xff\":" T1 "}", 4, AXL_ST_ERR_UTF8);
    REJECT("{\"\x80\":" T1 "}", 4, AXL_ST_ERR_UTF8);
    REJECT("{\"\xe2\x82\":" T1 "}", 4, AXL_ST_ERR_UTF8);
    REJECT("{\"\xc3\":" T1 "}", 4, AXL_ST_ERR_UTF8);
    REJECT("{\"a\":{\"x\":\"\xc3\x28\"}}", 0, AXL_ST_ERR_UTF8);
    REJECT("{\"__metadata__\":{\"k\":\"\xe2\x28\xa1\"}}", 0, AXL_ST_ERR_UTF8);
    REJECT("{\"\xe2\x82", 0, AXL_ST_ERR_EOF);
    /* bytes >= 0x80 outside strings */
    REJECT("{\xc3\xa9}", 0, AXL_ST_ERR_SYNTAX);
    /* raw control characters */
    REJECT("{\"a\nb\":" T1 "}", 4, AXL_ST_ERR_CONTROL_CHAR);
    REJECT("{\"a\tb\":" T1 "}", 4, AXL_ST_ERR_CONTROL_CHAR);
    REJECT("{\"a\x01\":" T1 "}", 4, AXL_ST_ERR_CONTROL_CHAR);
    rejected_n("{\"a\0\":{}}", 9, 17, AXL_ST_ERR_CONTROL_CHAR, __LINE__);
    REJECT("{\"__metadata__\":{\"k\":\"\x1f\"}}", 0, AXL_ST_ERR_CONTROL_CHAR);
    /* escapes */
    REJECT("{\"a\\x\":" T1 "}", 4, AXL_ST_ERR_ESCAPE);
    REJECT("{\"a\\U0041\":" T1 "}", 4, AXL_ST_ERR_ESCAPE);
    REJECT("{\"a\\u12G4\":" T1 "}", 4, AXL_ST_ERR_ESCAPE);
    REJECT("{\"a\\u 123\":" T1 "}", 4, AXL_ST_ERR_ESCAPE);
    REJECT("{\"a\\'\":" T1 "}", 4, AXL_ST_ERR_ESCAPE);
    /* surrogates: lone high, lone low, reversed, high + non-surrogate, high + text */
    REJECT("{\"\\ud800\":" T1 "}", 4, AXL_ST_ERR_SURROGATE);
    REJECT("{\"\\udc00\":" T1 "}", 4, AXL_ST_ERR_SURROGATE);
    REJECT("{\"\\udc00\\ud800\":" T1 "}", 4, AXL_ST_ERR_SURROGATE);
    REJECT("{\"\\ud800\\u0041\":" T1 "}", 4, AXL_ST_ERR_SURROGATE);
    REJECT("{\"\\ud800\\ud800\":" T1 "}", 4, AXL_ST_ERR_SURROGATE);
    REJECT("{\"\\udbffx\":" T1 "}", 4, AXL_ST_ERR_SURROGATE);
    REJECT("{\"\\ud800\\n\":" T1 "}", 4, AXL_ST_ERR_SURROGATE);
    REJECT("{\"a\":{\"x\":\"\\udfff\"}}", 0, AXL_ST_ERR_SURROGATE);
}

static void test_schema_types(void) {
    /* entries that are not objects */
    REJECT("{\"a\":\"F32\"}", 0, AXL_ST_ERR_ENTRY_NOT_OBJECT);
    REJECT("{\"a\":[1]}", 0, AXL_ST_ERR_ENTRY_NOT_OBJECT);
    REJECT("{\"a\":4}", 0, AXL_ST_ERR_ENTRY_NOT_OBJECT);
    REJECT("{\"a\":null}", 0, AXL_ST_ERR_ENTRY_NOT_OBJECT);
    REJECT("{\"a\":" T1 ",\"b\":true}", 4, AXL_ST_ERR_ENTRY_NOT_OBJECT);
    /* metadata */
    REJECT("{\"__metadata__\":[]}", 0, AXL_ST_ERR_METADATA_NOT_OBJECT);
    REJECT("{\"__metadata__\":\"x\"}", 0, AXL_ST_ERR_METADATA_NOT_OBJECT);
    REJECT("{\"__metadata__\":nul}", 0, AXL_ST_ERR_SYNTAX);
    REJECT("{\"__metadata__\":true}", 0, AXL_ST_ERR_METADATA_NOT_OBJECT);
    REJECT("{\"__metadata__\":{\"k\":null}}", 0, AXL_ST_ERR_METADATA_VALUE);
    REJECT("{\"__metadata__\":{\"a\":\"b\",\"k\":null}}", 0, AXL_ST_ERR_METADATA_VALUE);
    REJECT("{\"__metadata__\":null,\"__metadata__\":{}}", 0, AXL_ST_ERR_DUPLICATE_METADATA);
    REJECT("{\"__metadata__\":{\"k\":1}}", 0, AXL_ST_ERR_METADATA_VALUE);
    REJECT("{\"__metadata__\":{\"k\":{}}}", 0, AXL_ST_ERR_METADATA_VALUE);
    REJECT("{\"__metadata__\":{\"k\":true}}", 0, AXL_ST_ERR_METADATA_VALUE);
    REJECT("{\"__metadata__\":{\"a\":\"b\",\"k\":[\"v\"]}}", 0, AXL_ST_ERR_METADATA_VALUE);
    REJECT("{\"__metadata__\":{},\"__metadata__\":{}}", 0, AXL_ST_ERR_DUPLICATE_METADATA);
    REJECT("{\"__metadata__\":{},\"a\":" T1 ",\"\\u005f_metadata__\":{}}", 4,
           AXL_ST_ERR_DUPLICATE_METADATA);
    /* missing fields */
    REJECT("{\"a\":{}}", 0, AXL_ST_ERR_MISSING_DTYPE);
    REJECT("{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, AXL_ST_ERR_MISSING_DTYPE);
    REJECT("{\"a\":{\"Dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
           AXL_ST_ERR_MISSING_DTYPE);
    REJECT("{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, AXL_ST_ERR_MISSING_SHAPE);
    REJECT("{\"a\":{\"dtype\":\"F32\",\"shapes\":[1],\"data_offsets\":[0,4]}}", 4,
           AXL_ST_ERR_MISSING_SHAPE);
    REJECT("{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, AXL_ST_ERR_MISSING_OFFSETS);
    REJECT("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"offsets\":[0,4]}}", 4,
           AXL_ST_ERR_MISSING_OFFSETS);
    /* fields twice */
    REJECT("{\"a\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
           AXL_ST_ERR_DUPLICATE_FIELD);
    REJECT("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
           AXL_ST_ERR_DUPLICATE_FIELD);
    REJECT("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"data_offsets\":[0,4]}}",
           4, AXL_ST_ERR_DUPLICATE_FIELD);
    REJECT("{\"a\":{\"dtype\":\"F32\",\"\\u0064type\":\"F16\",\"shape\":[1],\"data_offsets\":[0,4]}}",
           4, AXL_ST_ERR_DUPLICATE_FIELD);
    /* dtype */
    REJECT("{\"a\":{\"dtype\":32,\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
           AXL_ST_ERR_DTYPE_NOT_STRING);
    REJECT("{\"a\":{\"dtype\":null,\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
           AXL_ST_ERR_DTYPE_NOT_STRING);
    REJECT("{\"a\":{\"dtype\":[\"F32\"],\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
           AXL_ST_ERR_DTYPE_NOT_STRING);
    REJECT("{\"a\":{\"dtype\":\"F128\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
           AXL_ST_ERR_UNKNOWN_DTYPE);
    REJECT("{\"a\":{\"dtype\":\"f32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
           AXL_ST_ERR_UNKNOWN_DTYPE);
    REJECT("{\"a\":{\"dtype\":\"F32 \",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
           AXL_ST_ERR_UNKNOWN_DTYPE);
    REJECT("{\"a\":{\"dtype\":\"\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
           AXL_ST_ERR_UNKNOWN_DTYPE);
    REJECT("{\"a\":{\"dtype\":\"F8_E4M3FNUZF8_E4M3FNUZ\",\"shape\":[1],\"data_offsets\":[0,1]}}",
           1, AXL_ST_ERR_UNKNOWN_DTYPE);
    REJECT("{\"a\":{\"dtype\":\"F32\\u0000\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
           AXL_ST_ERR_UNKNOWN_DTYPE);
    /* shape */
    REJECT("{\"a\":{\"dtype\":\"F32\",\"shape\":1,\"data_offsets\":[0,4]}}", 4,
           AXL_ST_ERR_SHAPE_NOT_ARRAY);
    REJECT("{\"a\":{\"dtype\":\"F32\",\"shape\":\"[1]\",\"data_offsets\":[0,4]}}", 4,
           AXL_ST_ERR_SHAPE_NOT_ARRAY);
    REJECT("{\"a\":{\"dtype\":\"F32\",\"shape\":{},\"data_offsets\":[0,4]}}", 4,
           AXL_ST_ERR_SHAPE_NOT_ARRAY);
    REJECT("{\"a\":{\"dtype\":\"F32\",\"shape\":null,\"data_offsets\":[0,4]}}", 4,
           AXL_ST_ERR_SHAPE_NOT_ARRAY);
    {
        char buf[1024];
        int at = snprintf(buf, sizeof buf, "{\"a\":{\"dtype\":\"U8\",\"shape\":[1");
        for (int k = 1; k < AXL_ST_MAX_NDIM; k++) at += snprintf(buf + at, sizeof buf - (size_t)at, ",1");
        snprintf(buf + at, sizeof buf - (size_t)at, "],\"data_offsets\":[0,1]}}");
        parsed p;
        VALID(&p, buf, 1);
        CHECK_EQ(p.h.dims_used, AXL_ST_MAX_NDIM);
        parsed_free(&p);
        at = snprintf(buf, sizeof buf, "{\"a\":{\"dtype\":\"U8\",\"shape\":[1");
        for (int k = 0; k < AXL_ST_MAX_NDIM; k++) at += snprintf(buf + at, sizeof buf - (size_t)at, ",1");
        snprintf(buf + at, sizeof buf - (size_t)at, "],\"data_offsets\":[0,1]}}");
        REJECT(buf, 1, AXL_ST_ERR_TOO_MANY_DIMS);
    }
    /* data_offsets */
    REJECT("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":4}}", 4,
           AXL_ST_ERR_OFFSETS_NOT_ARRAY);
    REJECT("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":{\"0\":4}}}", 4,
           AXL_ST_ERR_OFFSETS_NOT_ARRAY);
    REJECT("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":\"0,4\"}}", 4,
           AXL_ST_ERR_OFFSETS_NOT_ARRAY);
    REJECT("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[]}}", 4,
           AXL_ST_ERR_OFFSETS_LENGTH);
    REJECT("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4]}}", 4,
           AXL_ST_ERR_OFFSETS_LENGTH);
    REJECT("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,4]}}", 4,
           AXL_ST_ERR_OFFSETS_LENGTH);
    REJECT("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,]}}", 4,
           AXL_ST_ERR_OFFSETS_LENGTH);
    REJECT("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,0]}}", 4,
           AXL_ST_ERR_OFFSETS_REVERSED);
    REJECT("{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[9,8]}}", 9,
           AXL_ST_ERR_OFFSETS_REVERSED);
}

static void test_integers(void) {
#define WITH_SHAPE(s) "{\"a\":{\"dtype\":\"U8\",\"shape\":" s ",\"data_offsets\":[0,1]}}"
#define WITH_OFFSETS(o) "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":" o "}}"
    REJECT(WITH_SHAPE("[\"1\"]"), 1, AXL_ST_ERR_EXPECTED_INTEGER);
    REJECT(WITH_SHAPE("[null]"), 1, AXL_ST_ERR_EXPECTED_INTEGER);
    REJECT(WITH_SHAPE("[[1]]"), 1, AXL_ST_ERR_EXPECTED_INTEGER);
    REJECT(WITH_SHAPE("[true]"), 1, AXL_ST_ERR_EXPECTED_INTEGER);
    REJECT(WITH_SHAPE("[1,]"), 1, AXL_ST_ERR_EXPECTED_INTEGER);
    REJECT(WITH_OFFSETS("[\"0\",1]"), 1, AXL_ST_ERR_EXPECTED_INTEGER);
    REJECT(WITH_OFFSETS("[0,{}]"), 1, AXL_ST_ERR_EXPECTED_INTEGER);
    REJECT(WITH_SHAPE("[1.0]"), 1, AXL_ST_ERR_NOT_INTEGER);
    REJECT(WITH_SHAPE("[1e0]"), 1, AXL_ST_ERR_NOT_INTEGER);
    REJECT(WITH_SHAPE("[1E+0]"), 1, AXL_ST_ERR_NOT_INTEGER);
    REJECT(WITH_SHAPE("[0.5]"), 1, AXL_ST_ERR_NOT_INTEGER);
    REJECT(WITH_OFFSETS("[0,1.0]"), 1, AXL_ST_ERR_NOT_INTEGER);
    REJECT(WITH_OFFSETS("[0e3,1]"), 1, AXL_ST_ERR_NOT_INTEGER);
    REJECT(WITH_SHAPE("[-1]"), 1, AXL_ST_ERR_NEGATIVE);
    REJECT(WITH_SHAPE("[-0]"), 1, AXL_ST_ERR_NEGATIVE);
    REJECT(WITH_OFFSETS("[-0,1]"), 1, AXL_ST_ERR_NEGATIVE);
    REJECT(WITH_OFFSETS("[-4,1]"), 1, AXL_ST_ERR_NEGATIVE);
    REJECT(WITH_SHAPE("[01]"), 1, AXL_ST_ERR_LEADING_ZERO);
    REJECT(WITH_SHAPE("[00]"), 1, AXL_ST_ERR_LEADING_ZERO);
    REJECT(WITH_OFFSETS("[00,1]"), 1, AXL_ST_ERR_LEADING_ZERO);
    REJECT(WITH_SHAPE("[9223372036854775808]"), 1, AXL_ST_ERR_INT_OVERFLOW);
    REJECT(WITH_SHAPE("[99999999999999999999999]"), 1, AXL_ST_ERR_INT_OVERFLOW);
    REJECT(WITH_OFFSETS("[0,18446744073709551617]"), 1, AXL_ST_ERR_INT_OVERFLOW);
    /* INT64_MAX itself is an integer; the file is too short for it */
    REJECT("{\"a\":{\"dtype\":\"U8\",\"shape\":[9223372036854775807],"
           "\"data_offsets\":[0,9223372036854775807]}}",
           1, AXL_ST_ERR_TRUNCATED);
    /* element count and byte size overflow */
    REJECT("{\"a\":{\"dtype\":\"U8\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,0]}}",
           0, AXL_ST_ERR_SIZE_OVERFLOW);
    REJECT("{\"a\":{\"dtype\":\"U8\",\"shape\":[4294967296,4294967296,0],\"data_offsets\":[0,0]}}",
           0, AXL_ST_ERR_SIZE_OVERFLOW); /* left to right, like safetensors */
    REJECT("{\"a\":{\"dtype\":\"F32\",\"shape\":[2305843009213693952],\"data_offsets\":[0,0]}}",
           0, AXL_ST_ERR_SIZE_OVERFLOW);
    REJECT("{\"a\":{\"dtype\":\"data_offsets\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1,
           AXL_ST_ERR_UNKNOWN_DTYPE);
    REJECT("{\"a\":{\"shape\":[3074457345618258603],\"dtype\":\"I64\",\"data_offsets\":[0,0]}}",
           0, AXL_ST_ERR_SIZE_OVERFLOW);
    REJECT("{\"a\":{\"dtype\":\"F4\",\"shape\":[2305843009213693952],\"data_offsets\":[0,0]}}",
           0, AXL_ST_ERR_SIZE_OVERFLOW);
    parsed p;
    /* the largest F32 that fits: 2^61 - 1 elements = 2^63 - 4 bytes (the file is short) */
    parse(&p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2305843009213693951],"
              "\"data_offsets\":[0,9223372036854775804]}}", 0);
    CHECK_EQ(p.h.error.kind, AXL_ST_ERR_TRUNCATED);
    parsed_free(&p);
    /* sizes that disagree with the offsets */
    parse(&p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", 4);
    CHECK_EQ(p.h.error.kind, AXL_ST_ERR_SIZE_MISMATCH);
    CHECK_EQ(p.h.error.value, 8);
    CHECK(key_is_text(&p, p.h.error.tensor_pos, p.h.error.tensor_len, "\"a\""));
    CHECK_EQ(p.h.error.tensor, 0);
    parsed_free(&p);
    REJECT("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,12]}}", 12,
           AXL_ST_ERR_SIZE_MISMATCH);
    REJECT("{\"a\":{\"dtype\":\"BOOL\",\"shape\":[],\"data_offsets\":[0,0]}}", 0,
           AXL_ST_ERR_SIZE_MISMATCH);
    REJECT("{\"a\":{\"dtype\":\"BF16\",\"shape\":[0],\"data_offsets\":[0,2]}}", 2,
           AXL_ST_ERR_SIZE_MISMATCH);
#undef WITH_SHAPE
#undef WITH_OFFSETS
}

static void test_cross_tensor(void) {
    parsed p;
    /* duplicate names, also through escapes; the later one is reported */
    parse(&p, "{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
              "\"x\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]},"
              "\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[2,3]}}", 3);
    CHECK_EQ(p.rc, AXL_ERR_BAD_HEADER);
    CHECK_EQ(p.h.error.kind, AXL_ST_ERR_DUPLICATE_NAME);
    CHECK(key_is_text(&p, p.h.error.tensor_pos, p.h.error.tensor_len, "\"w\""));
    CHECK(key_is_text(&p, p.h.error.other_pos, p.h.error.other_len, "\"w\""));
    CHECK(p.h.error.tensor_pos > p.h.error.other_pos);
    CHECK_EQ(p.h.error.position, p.h.error.tensor_pos);
    CHECK(p.h.error.tensor >= 0 && p.h.error.tensor < p.h.count);
    CHECK(p.h.error.tensor >= 0 && p.h.records[p.h.error.tensor].key_pos == p.h.error.tensor_pos);
    parsed_free(&p);
    parse(&p, "{\"ab\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
              "\"\\u0061\\u0062\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}", 2);
    CHECK_EQ(p.h.error.kind, AXL_ST_ERR_DUPLICATE_NAME);
    CHECK(key_is_text(&p, p.h.error.tensor_pos, p.h.error.tensor_len, "\"\\u0061\\u0062\""));
    parsed_free(&p);
    REJECT("{\"\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]},"
           "\"\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]}}", 0,
           AXL_ST_ERR_DUPLICATE_NAME);
    /* names that only share a prefix, or differ after a NUL, are distinct */
    VALID(&p, "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
              "\"a\\u0000\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]},"
              "\"a\\u0000b\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[2,3]},"
              "\"ab\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[3,4]}}", 4);
    CHECK_EQ(p.h.count, 4);
    parsed_free(&p);

    /* a gap at the start */
    parse(&p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8);
    CHECK_EQ(p.h.error.kind, AXL_ST_ERR_GAP);
    CHECK_EQ(p.h.error.value, 0);
    CHECK_EQ(p.h.error.other, -1);
    CHECK(key_is_text(&p, p.h.error.tensor_pos, p.h.error.tensor_len, "\"a\""));
    parsed_free(&p);
    /* a gap between two tensors */
    parse(&p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
              "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[6,10]}}", 10);
    CHECK_EQ(p.h.error.kind, AXL_ST_ERR_GAP);
    CHECK_EQ(p.h.error.value, 4);
    CHECK(key_is_text(&p, p.h.error.tensor_pos, p.h.error.tensor_len, "\"b\""));
    CHECK(key_is_text(&p, p.h.error.other_pos, p.h.error.other_len, "\"a\""));
    parsed_free(&p);
    /* a zero-size tensor past the end is a gap too */
    REJECT("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
           "\"e\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[9,9]}}", 4, AXL_ST_ERR_GAP);
    /* overlap */
    parse(&p, "{\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]},"
              "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 12);
    CHECK_EQ(p.h.error.kind, AXL_ST_ERR_OVERLAP);
    CHECK_EQ(p.h.error.value, 8);
    CHECK(key_is_text(&p, p.h.error.tensor_pos, p.h.error.tensor_len, "\"b\""));
    CHECK(key_is_text(&p, p.h.error.other_pos, p.h.error.other_len, "\"a\""));
    parsed_free(&p);
    REJECT("{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
           "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 16, AXL_ST_ERR_OVERLAP);
    REJECT("{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
           "\"e\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,8]}}", 16, AXL_ST_ERR_OVERLAP);
    /* the same bytes twice */
    parse(&p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
              "\"b\":{\"dtype\":\"I32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4);
    CHECK_EQ(p.h.error.kind, AXL_ST_ERR_SAME_BYTES);
    CHECK(key_is_text(&p, p.h.error.tensor_pos, p.h.error.tensor_len, "\"b\""));
    CHECK(key_is_text(&p, p.h.error.other_pos, p.h.error.other_len, "\"a\""));
    parsed_free(&p);
    REJECT("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
           "\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[1,5]},"
           "\"c\":{\"dtype\":\"U8\",\"shape\":[2,2],\"data_offsets\":[1,5]}}", 5,
           AXL_ST_ERR_SAME_BYTES);

    /* file size: header beyond the file, truncated data, trailing bytes */
    const char *ok = "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                     "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}";
    const int64_t n = (int64_t)strlen(ok);
    rejected_n(ok, n, 8 + n - 1, AXL_ST_ERR_HEADER_BEYOND_FILE, __LINE__);
    rejected_n(ok, n, 7, AXL_ST_ERR_HEADER_BEYOND_FILE, __LINE__);
    rejected_n(ok, n, 0, AXL_ST_ERR_HEADER_BEYOND_FILE, __LINE__);
    rejected_n("{}", 2, 9, AXL_ST_ERR_HEADER_BEYOND_FILE, __LINE__);
    parse_n(&p, ok, n, 8 + n + 11);
    CHECK_EQ(p.h.error.kind, AXL_ST_ERR_TRUNCATED);
    CHECK_EQ(p.h.error.value, 12);
    CHECK(key_is_text(&p, p.h.error.tensor_pos, p.h.error.tensor_len, "\"b\""));
    parsed_free(&p);
    parse_n(&p, ok, n, 8 + n + 2);
    CHECK_EQ(p.h.error.kind, AXL_ST_ERR_TRUNCATED);
    CHECK(key_is_text(&p, p.h.error.tensor_pos, p.h.error.tensor_len, "\"a\""));
    parsed_free(&p);
    rejected_n(ok, n, 8 + n, AXL_ST_ERR_TRUNCATED, __LINE__);
    parse_n(&p, ok, n, 8 + n + 13);
    CHECK_EQ(p.h.error.kind, AXL_ST_ERR_TRAILING_BYTES);
    CHECK_EQ(p.h.error.value, 12);
    CHECK_EQ(p.h.error.position, -1);
    CHECK(key_is_text(&p, p.h.error.tensor_pos, p.h.error.tensor_len, "\"b\""));
    parsed_free(&p);
    rejected_n(ok, n, INT64_MAX, AXL_ST_ERR_TRAILING_BYTES, __LINE__);
    rejected_n("{}", 2, 11, AXL_ST_ERR_TRAILING_BYTES, __LINE__);
    parse_n(&p, ok, n, 8 + n + 12);
    CHECK_EQ(p.rc, AXL_OK);
    parsed_free(&p);
}

/* ---- error details, arguments, capacities ---------------------------------------------- */

static void test_error_details(void) {
    parsed p;
    /* the position of a bad value, and the tensor being parsed */
    const char *text = "{\"a\":" T1 ",\"bad name\":{\"dtype\":\"F32\",\"shape\":[1.5],"
                       "\"data_offsets\":[4,8]}}";
    parse(&p, text, 8);
    CHECK_EQ(p.h.error.kind, AXL_ST_ERR_NOT_INTEGER);
    CHECK_EQ(p.h.error.position, (int64_t)(strstr(text, "1.5") - text));
    CHECK_EQ(p.h.error.tensor, 1);
    CHECK(key_is_text(&p, p.h.error.tensor_pos, p.h.error.tensor_len, "\"bad name\""));
    CHECK_EQ(p.h.error.other, -1);
    parsed_free(&p);
    /* an error outside any tensor names none */
    parse(&p, "{\"__metadata__\":{\"k\":5}}", 0);
    CHECK_EQ(p.h.error.kind, AXL_ST_ERR_METADATA_VALUE);
    CHECK_EQ(p.h.error.tensor, -1);
    CHECK_EQ(p.h.error.tensor_pos, -1);
    CHECK_EQ(p.h.error.position, 21);
    parsed_free(&p);
    /* a bad key names no tensor either */
    parse(&p, "{\"a\\q\":{}}", 0);
    CHECK_EQ(p.h.error.kind, AXL_ST_ERR_ESCAPE);
    CHECK_EQ(p.h.error.position, 3);
    CHECK_EQ(p.h.error.tensor, -1);
    parsed_free(&p);
    /* texts */
    for (int k = 0; k < AXL_ST_ERROR_KIND_COUNT; k++) {
        const char *t = axl_st_error_text(k);
        CHECK(t != NULL && strlen(t) > 0 && strcmp(t, "unknown error kind") != 0);
        for (int j = 0; j < k; j++) CHECK_MSG(strcmp(t, axl_st_error_text(j)) != 0, "%d %d", j, k);
    }
    CHECK(strcmp(axl_st_error_text(-1), "unknown error kind") == 0);
    CHECK(strcmp(axl_st_error_text(AXL_ST_ERROR_KIND_COUNT), "unknown error kind") == 0);
}

static void test_arguments_and_capacity(void) {
    const char *text = "{\"ab\":{\"dtype\":\"U8\",\"shape\":[1,1],\"data_offsets\":[0,1]},"
                       "\"cd\":{\"dtype\":\"U8\",\"shape\":[1,1],\"data_offsets\":[1,2]}}";
    const int64_t n = (int64_t)strlen(text);
    const uint8_t *h = (const uint8_t *)text;
    axl_st_tensor rec[2];
    char names[4];
    int64_t dims[4];
    axl_st_header out = {rec, 2, names, 4, dims, 4, 0, 0, 0, 0, {0}};
    CHECK_EQ(axl_st_parse_header(h, n, 8 + n + 2, &out), AXL_OK);
    CHECK_EQ(out.count, 2);
    CHECK(out.names_used == 4 && memcmp(names, "abcd", 4) == 0);
    CHECK_EQ(axl_st_parse_header(h, n, 8 + n + 2, NULL), AXL_ERR_NULL_POINTER);
    CHECK_EQ(axl_st_parse_header(NULL, n, 8 + n + 2, &out), AXL_ERR_NULL_POINTER);
    CHECK_EQ(axl_st_parse_header(h, -1, 8 + n + 2, &out), AXL_ERR_BAD_SIZE);
    CHECK_EQ(axl_st_parse_header(h, n, -1, &out), AXL_ERR_BAD_SIZE);
    out.names = NULL; /* only some buffers */
    CHECK_EQ(axl_st_parse_header(h, n, 8 + n + 2, &out), AXL_ERR_NULL_POINTER);
    out.names = names;
    out.dims_cap = -1;
    CHECK_EQ(axl_st_parse_header(h, n, 8 + n + 2, &out), AXL_ERR_BAD_SIZE);
    /* each buffer one short: AXL_ERR_BAD_SIZE with kind CAPACITY, nothing written past it */
    const struct { int64_t rc, nc, dc; } caps[] = {{1, 4, 4}, {2, 3, 4}, {2, 4, 3}, {0, 0, 0}};
    for (size_t k = 0; k < sizeof caps / sizeof *caps; k++) {
        memset(rec, 0x5A, sizeof rec);
        memset(names, 0x5A, sizeof names);
        memset(dims, 0x5A, sizeof dims);
        axl_st_header o = {rec, caps[k].rc, names, caps[k].nc, dims, caps[k].dc, 0, 0, 0, 0, {0}};
        CHECK_EQ(axl_st_parse_header(h, n, 8 + n + 2, &o), AXL_ERR_BAD_SIZE);
        CHECK_EQ(o.error.kind, AXL_ST_ERR_CAPACITY);
        const uint8_t *rb = (const uint8_t *)&rec[caps[k].rc];
        for (size_t b = 0; b < (2 - (size_t)caps[k].rc) * sizeof *rec; b++) CHECK(rb[b] == 0x5A);
        for (int64_t b = caps[k].nc; b < 4; b++) CHECK(names[b] == 0x5A);
        const uint8_t *db = (const uint8_t *)&dims[caps[k].dc];
        for (size_t b = 0; b < (4 - (size_t)caps[k].dc) * sizeof *dims; b++) CHECK(db[b] == 0x5A);
    }
    /* the sizing call then exact buffers */
    axl_st_header sz = {0};
    CHECK_EQ(axl_st_parse_header(h, n, 8 + n + 2, &sz), AXL_OK);
    CHECK(sz.count == 2 && sz.names_used == 4 && sz.dims_used == 4);
    /* exact buffers from the sizing call leave no room in names for a "__metadata__"
     * key after the last tensor: it must still be told from a tensor (fuzzer finding) */
    {
        const char *m = "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                        "\"__metadata__\":{\"k\":\"v\"},\"\\u005f_metadata__\":{}}";
        const int64_t mn = (int64_t)strlen(m);
        axl_st_header s1 = {0};
        CHECK_EQ(axl_st_parse_header((const uint8_t *)m, mn, 8 + mn + 1, &s1), AXL_ERR_BAD_HEADER);
        CHECK_EQ(s1.error.kind, AXL_ST_ERR_DUPLICATE_METADATA);
        const char *m2 = "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                         "\"__metadata__\":{\"k\":\"v\"}}";
        const int64_t mn2 = (int64_t)strlen(m2);
        axl_st_header s2 = {0};
        CHECK_EQ(axl_st_parse_header((const uint8_t *)m2, mn2, 8 + mn2 + 1, &s2), AXL_OK);
        CHECK(s2.count == 1 && s2.names_used == 1 && s2.dims_used == 1);
        axl_st_tensor *r1 = xmalloc(sizeof *r1);
        char *nm = xmalloc(1);
        int64_t *dm = xmalloc(sizeof *dm);
        axl_st_header full = {r1, 1, nm, 1, dm, 1, 0, 0, 0, 0, {0}};
        CHECK_EQ(axl_st_parse_header((const uint8_t *)m2, mn2, 8 + mn2 + 1, &full), AXL_OK);
        CHECK(full.count == 1 && nm[0] == 'a' && dm[0] == 1);
        CHECK_EQ(axl_st_parse_header((const uint8_t *)m, mn, 8 + mn + 1, &full), AXL_ERR_BAD_HEADER);
        CHECK_EQ(full.error.kind, AXL_ST_ERR_DUPLICATE_METADATA);
        free(r1);
        free(nm);
        free(dm);
    }
    /* n == 0 with a NULL header is an empty header, not a NULL pointer */
    CHECK_EQ(axl_st_parse_header(NULL, 0, 8, &sz), AXL_ERR_BAD_HEADER);
    CHECK_EQ(sz.error.kind, AXL_ST_ERR_EOF);
}

/* ---- robustness: prefixes and mutations ----------------------------------------------- */

static uint64_t rng = 0x9E3779B97F4A7C15u;

static void robust(const char *text, int64_t n, int64_t file_size) {
    parsed p;
    parse_n(&p, text, n, file_size);
    CHECK_MSG(p.rc == AXL_OK || p.rc == AXL_ERR_BAD_HEADER, "status %d", p.rc);
    CHECK(p.h.error.kind >= 0 && p.h.error.kind < AXL_ST_ERROR_KIND_COUNT);
    CHECK(p.h.error.position >= -1 && p.h.error.position <= n);
    CHECK(p.h.count <= p.h.records_cap && p.h.names_used <= p.h.names_cap &&
          p.h.dims_used <= p.h.dims_cap);
    if (p.h.error.tensor_pos >= 0)
        CHECK(p.h.error.tensor_len >= 2 && p.h.error.tensor_pos + p.h.error.tensor_len <= n &&
              p.header[p.h.error.tensor_pos] == '"');
    if (p.rc == AXL_OK) {
        int64_t at = 0;
        for (int64_t i = 0; i < p.h.count; i++) {
            CHECK_EQ(p.h.records[i].begin, at);
            at = p.h.records[i].end;
        }
        CHECK_EQ(8 + n + at, file_size);
    }
    parsed_free(&p);
}

static void test_robustness(void) {
    const char *valid[] = {
        "{\"__metadata__\":{\"format\":\"pt\",\"n\":\"\"},"
        "\"w\\u00e9\\ud83d\\ude00\":{\"dtype\":\"BF16\",\"shape\":[2,3],\"data_offsets\":[0,12]},"
        "\"b\":{\"extra\":[1,{\"x\":-1.5e3}],\"shape\":[],\"dtype\":\"F32\",\"data_offsets\":[12,16]}}  ",
        "{\"e\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]},"
        "\"f\":{\"dtype\":\"F4\",\"shape\":[2,2],\"data_offsets\":[0,2]}}",
    };
    const int64_t data[] = {16, 2};
    for (size_t v = 0; v < sizeof valid / sizeof *valid; v++) {
        const int64_t n = (int64_t)strlen(valid[v]);
        parsed p;
        VALID(&p, valid[v], data[v]);
        parsed_free(&p);
        for (int64_t len = 0; len < n; len++) robust(valid[v], len, 8 + len + data[v]);
        char *buf = xmalloc((size_t)n);
        static const char tokens[] = "{}[]:,\"\\-0123456789.eE+ \x00\x7f\x80\xbf\xc3\xed\xf4\xffu";
        for (int round = 0; round < 3000; round++) {
            memcpy(buf, valid[v], (size_t)n);
            int edits = 1 + (int)(axl_test_rng(&rng) % 4);
            for (int e = 0; e < edits; e++) {
                uint32_t r = axl_test_rng(&rng);
                int64_t at = (int64_t)(r % (uint32_t)n);
                buf[at] = (r >> 16) & 1 ? (char)tokens[(r >> 17) % (sizeof tokens - 1)]
                                        : (char)(r >> 24);
            }
            int64_t fs = 8 + n + data[v] + (int64_t)(axl_test_rng(&rng) % 3) - 1;
            robust(buf, n, fs);
        }
        free(buf);
    }
}

/* Many tensors: the sorts and the linear parse at a scale real checkpoints reach. */
static void test_many_tensors(void) {
    const int count = 20000;
    size_t cap = (size_t)count * 80 + 16, at = 0;
    char *buf = xmalloc(cap);
    at += (size_t)snprintf(buf + at, cap - at, "{");
    for (int k = count - 1; k >= 0; k--) /* reversed order in the header */
        at += (size_t)snprintf(buf + at, cap - at,
                               "%s\"layer.%d\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[%d,%d]}",
                               k == count - 1 ? "" : ",", k, 4 * k, 4 * k + 4);
    at += (size_t)snprintf(buf + at, cap - at, "}");
    parsed p;
    parse_n(&p, buf, (int64_t)at, 8 + (int64_t)at + 4 * count);
    CHECK_EQ(p.rc, AXL_OK);
    CHECK_EQ(p.h.count, count);
    int sorted = 1;
    for (int k = 0; k < count && p.rc == AXL_OK; k++) sorted &= p.h.records[k].begin == 4 * k;
    CHECK(sorted);
    parsed_free(&p);
    /* the same with one name repeated far apart */
    memcpy(strstr(buf, "\"layer.7\""), "\"layer.9\"", 9);
    parse_n(&p, buf, (int64_t)at, 8 + (int64_t)at + 4 * count);
    CHECK_EQ(p.h.error.kind, AXL_ST_ERR_DUPLICATE_NAME);
    parsed_free(&p);
    free(buf);
}

void test_safetensors(void) {
    test_basic();
    test_escapes();
    test_zero_size_and_scalars();
    test_order_padding_and_ignored_fields();
    test_every_dtype();
    test_json_syntax();
    test_strings();
    test_schema_types();
    test_integers();
    test_cross_tensor();
    test_error_details();
    test_arguments_and_capacity();
    test_robustness();
    test_many_tensors();
}
