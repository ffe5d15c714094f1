/* safetensors.c - a strict validator of safetensors headers (axl_st_parse_header; the rules
 * are documented in autoxla.h).
 *
 * A small recursive-descent JSON parser that knows the header's schema. Scalar code on
 * purpose: a header is parsed once per file and is a few KiB to a few MiB, so this is not a
 * hot loop and clarity wins. Every read goes through the cursor checks below (p->i < p->n),
 * recursion is bounded by AXL_ST_MAX_DEPTH, every write is checked against its cap, and
 * nothing is allocated. */
#include "internal.h"

static const struct {
    const char *name;
    int bits;
} dtypes[AXL_ST_DTYPE_COUNT] = {
    [AXL_ST_BOOL] = {"BOOL", 8},
    [AXL_ST_U8] = {"U8", 8},
    [AXL_ST_I8] = {"I8", 8},
    [AXL_ST_I16] = {"I16", 16},
    [AXL_ST_U16] = {"U16", 16},
    [AXL_ST_F16] = {"F16", 16},
    [AXL_ST_BF16] = {"BF16", 16},
    [AXL_ST_I32] = {"I32", 32},
    [AXL_ST_U32] = {"U32", 32},
    [AXL_ST_F32] = {"F32", 32},
    [AXL_ST_F64] = {"F64", 64},
    [AXL_ST_I64] = {"I64", 64},
    [AXL_ST_U64] = {"U64", 64},
    [AXL_ST_F8_E4M3] = {"F8_E4M3", 8},
    [AXL_ST_F8_E5M2] = {"F8_E5M2", 8},
    [AXL_ST_F8_E4M3FNUZ] = {"F8_E4M3FNUZ", 8},
    [AXL_ST_F8_E5M2FNUZ] = {"F8_E5M2FNUZ", 8},
    [AXL_ST_F8_E8M0] = {"F8_E8M0", 8},
    [AXL_ST_F4] = {"F4", 4},
    [AXL_ST_F6_E2M3] = {"F6_E2M3", 6},
    [AXL_ST_F6_E3M2] = {"F6_E3M2", 6},
    [AXL_ST_C64] = {"C64", 64},
};

const char *axl_st_dtype_name(int dtype) {
    return dtype >= 0 && dtype < AXL_ST_DTYPE_COUNT ? dtypes[dtype].name : NULL;
}

int axl_st_dtype_bits(int dtype) {
    return dtype >= 0 && dtype < AXL_ST_DTYPE_COUNT ? dtypes[dtype].bits : 0;
}

const char *axl_st_error_text(int kind) {
    switch (kind) {
    case AXL_ST_OK: return "valid header";
    case AXL_ST_ERR_EOF: return "the header ends in the middle of a JSON value";
    case AXL_ST_ERR_SYNTAX: return "invalid JSON";
    case AXL_ST_ERR_UTF8: return "invalid UTF-8 in a string";
    case AXL_ST_ERR_CONTROL_CHAR: return "unescaped control character in a string";
    case AXL_ST_ERR_ESCAPE: return "invalid escape sequence in a string";
    case AXL_ST_ERR_SURROGATE: return "\\u escape of a lone surrogate";
    case AXL_ST_ERR_TOO_DEEP: return "JSON nested too deeply";
    case AXL_ST_ERR_TRAILING_DATA: return "data after the header's JSON object";
    case AXL_ST_ERR_NOT_OBJECT: return "the header is not a JSON object";
    case AXL_ST_ERR_ENTRY_NOT_OBJECT: return "a tensor's entry is not a JSON object";
    case AXL_ST_ERR_METADATA_NOT_OBJECT: return "__metadata__ is neither a JSON object nor null";
    case AXL_ST_ERR_METADATA_VALUE: return "a __metadata__ value is not a string";
    case AXL_ST_ERR_DUPLICATE_METADATA: return "__metadata__ appears twice";
    case AXL_ST_ERR_MISSING_DTYPE: return "a tensor has no \"dtype\"";
    case AXL_ST_ERR_MISSING_SHAPE: return "a tensor has no \"shape\"";
    case AXL_ST_ERR_MISSING_OFFSETS: return "a tensor has no \"data_offsets\"";
    case AXL_ST_ERR_DUPLICATE_FIELD: return "a tensor's field appears twice";
    case AXL_ST_ERR_DTYPE_NOT_STRING: return "\"dtype\" is not a string";
    case AXL_ST_ERR_UNKNOWN_DTYPE: return "unknown dtype";
    case AXL_ST_ERR_SHAPE_NOT_ARRAY: return "\"shape\" is not an array";
    case AXL_ST_ERR_TOO_MANY_DIMS: return "\"shape\" has too many dimensions";
    case AXL_ST_ERR_OFFSETS_NOT_ARRAY: return "\"data_offsets\" is not an array";
    case AXL_ST_ERR_OFFSETS_LENGTH: return "\"data_offsets\" does not hold exactly 2 numbers";
    case AXL_ST_ERR_EXPECTED_INTEGER: return "expected an integer";
    case AXL_ST_ERR_NOT_INTEGER: return "a number with a fraction or exponent where an integer is required";
    case AXL_ST_ERR_NEGATIVE: return "a negative number where a size or offset is required";
    case AXL_ST_ERR_LEADING_ZERO: return "a number with a leading zero";
    case AXL_ST_ERR_INT_OVERFLOW: return "an integer larger than 2^63-1";
    case AXL_ST_ERR_OFFSETS_REVERSED: return "\"data_offsets\" end before they begin";
    case AXL_ST_ERR_SIZE_OVERFLOW: return "the tensor's size overflows 64 bits";
    case AXL_ST_ERR_PARTIAL_BYTE: return "a sub-byte tensor that does not fill whole bytes";
    case AXL_ST_ERR_SIZE_MISMATCH: return "\"data_offsets\" do not span dtype size * shape bytes";
    case AXL_ST_ERR_DUPLICATE_NAME: return "two tensors have the same name";
    case AXL_ST_ERR_GAP: return "unused bytes before a tensor's data";
    case AXL_ST_ERR_OVERLAP: return "a tensor's data overlaps another's";
    case AXL_ST_ERR_SAME_BYTES: return "two tensors claim the same bytes";
    case AXL_ST_ERR_HEADER_BEYOND_FILE: return "the header is longer than the file";
    case AXL_ST_ERR_TRUNCATED: return "the file ends inside a tensor's data (truncated)";
    case AXL_ST_ERR_TRAILING_BYTES: return "bytes after the last tensor's data";
    case AXL_ST_ERR_CAPACITY: return "an output buffer is too small";
    default: return "unknown error kind";
    }
}

/* ---- parser state ---------------------------------------------------------------------- */

typedef struct parser {
    const uint8_t *s;
    int64_t n, i; /* input length, cursor: s[i] is read only when i < n */
    axl_st_header *out;
    int full;     /* buffers given: store records, names, dims */
    /* the tensor being parsed, for error reports */
    int64_t cur, cur_pos, cur_len;
} parser;

static int fail(parser *p, int kind, int64_t pos) {
    axl_st_error *e = &p->out->error;
    e->kind = kind;
    e->position = pos;
    e->tensor = p->cur;
    e->tensor_pos = p->cur_pos;
    e->tensor_len = p->cur_len;
    return kind == AXL_ST_ERR_CAPACITY ? AXL_ERR_BAD_SIZE : AXL_ERR_BAD_HEADER;
}

static int at_end(const parser *p) { return p->i >= p->n; }
static uint8_t peek(const parser *p) { return p->s[p->i]; } /* only after !at_end */

static void skip_ws(parser *p) {
    while (p->i < p->n) {
        uint8_t c = p->s[p->i];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
        p->i++;
    }
}

/* EOF or SYNTAX unless s[i] == c, which is consumed. */
static int expect(parser *p, uint8_t c) {
    if (at_end(p)) return fail(p, AXL_ST_ERR_EOF, p->i);
    if (peek(p) != c) return fail(p, AXL_ST_ERR_SYNTAX, p->i);
    p->i++;
    return AXL_OK;
}

/* ---- strings ---------------------------------------------------------------------------
 * A decoded string is written to dst[0 .. cap) (dst may be NULL); *len gets its full
 * decoded length, which may exceed cap (the rest is validated, not written). A decoded
 * string is never longer than its encoded form. */

static void put(uint8_t *dst, int64_t cap, int64_t *len, uint8_t b) {
    if (dst && *len < cap) dst[*len] = b;
    (*len)++;
}

static void put_code_point(uint8_t *dst, int64_t cap, int64_t *len, uint32_t c) {
    if (c < 0x80) {
        put(dst, cap, len, (uint8_t)c);
    } else if (c < 0x800) {
        put(dst, cap, len, (uint8_t)(0xC0 | (c >> 6)));
        put(dst, cap, len, (uint8_t)(0x80 | (c & 0x3F)));
    } else if (c < 0x10000) {
        put(dst, cap, len, (uint8_t)(0xE0 | (c >> 12)));
        put(dst, cap, len, (uint8_t)(0x80 | ((c >> 6) & 0x3F)));
        put(dst, cap, len, (uint8_t)(0x80 | (c & 0x3F)));
    } else {
        put(dst, cap, len, (uint8_t)(0xF0 | (c >> 18)));
        put(dst, cap, len, (uint8_t)(0x80 | ((c >> 12) & 0x3F)));
        put(dst, cap, len, (uint8_t)(0x80 | ((c >> 6) & 0x3F)));
        put(dst, cap, len, (uint8_t)(0x80 | (c & 0x3F)));
    }
}

static int hex_value(uint8_t c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* The 4 hex digits after "\u" at s[i] (i at the 'u'); advances past them. */
static int read_u_escape(parser *p, int64_t esc_pos, uint32_t *out) {
    p->i++; /* the 'u' */
    uint32_t v = 0;
    for (int k = 0; k < 4; k++) {
        if (at_end(p)) return fail(p, AXL_ST_ERR_EOF, p->i);
        int h = hex_value(peek(p));
        if (h < 0) return fail(p, AXL_ST_ERR_ESCAPE, esc_pos);
        v = v << 4 | (uint32_t)h;
        p->i++;
    }
    *out = v;
    return AXL_OK;
}

/* Length of the UTF-8 sequence at s[i] (first byte >= 0x80), validated strictly. */
static int utf8_sequence(parser *p, int64_t *bytes) {
    const uint8_t c = peek(p);
    int extra;
    uint8_t lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
    if (c >= 0xC2 && c <= 0xDF) {
        extra = 1;
    } else if (c >= 0xE0 && c <= 0xEF) {
        extra = 2;
        if (c == 0xE0) lo = 0xA0;      /* no overlong forms */
        if (c == 0xED) hi = 0x9F;      /* no surrogates */
    } else if (c >= 0xF0 && c <= 0xF4) {
        extra = 3;
        if (c == 0xF0) lo = 0x90;      /* no overlong forms */
        if (c == 0xF4) hi = 0x8F;      /* nothing above U+10FFFF */
    } else {
        return fail(p, AXL_ST_ERR_UTF8, p->i);
    }
    for (int k = 1; k <= extra; k++) {
        if (p->i + k >= p->n) return fail(p, AXL_ST_ERR_EOF, p->n);
        uint8_t b = p->s[p->i + k];
        if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF))
            return fail(p, AXL_ST_ERR_UTF8, p->i);
    }
    *bytes = 1 + extra;
    return AXL_OK;
}

/* A string at s[i] == '"'. */
static int parse_string(parser *p, uint8_t *dst, int64_t cap, int64_t *len) {
    int rc;
    *len = 0;
    p->i++; /* opening quote */
    for (;;) {
        if (at_end(p)) return fail(p, AXL_ST_ERR_EOF, p->i);
        uint8_t c = peek(p);
        if (c == '"') {
            p->i++;
            return AXL_OK;
        }
        if (c < 0x20) return fail(p, AXL_ST_ERR_CONTROL_CHAR, p->i);
        if (c >= 0x80) {
            int64_t bytes = 0;
            if ((rc = utf8_sequence(p, &bytes))) return rc;
            for (int64_t k = 0; k < bytes; k++) put(dst, cap, len, p->s[p->i + k]);
            p->i += bytes;
            continue;
        }
        if (c != '\\') {
            put(dst, cap, len, c);
            p->i++;
            continue;
        }
        const int64_t esc = p->i;
        p->i++;
        if (at_end(p)) return fail(p, AXL_ST_ERR_EOF, p->i);
        c = peek(p);
        uint8_t simple = 0;
        switch (c) {
        case '"': simple = '"'; break;
        case '\\': simple = '\\'; break;
        case '/': simple = '/'; break;
        case 'b': simple = '\b'; break;
        case 'f': simple = '\f'; break;
        case 'n': simple = '\n'; break;
        case 'r': simple = '\r'; break;
        case 't': simple = '\t'; break;
        case 'u': break;
        default: return fail(p, AXL_ST_ERR_ESCAPE, esc);
        }
        if (c != 'u') {
            put(dst, cap, len, simple);
            p->i++;
            continue;
        }
        uint32_t cp;
        if ((rc = read_u_escape(p, esc, &cp))) return rc;
        if (cp >= 0xDC00 && cp <= 0xDFFF) return fail(p, AXL_ST_ERR_SURROGATE, esc);
        if (cp >= 0xD800 && cp <= 0xDBFF) {
            /* must be followed by \u of a low surrogate */
            if (p->i + 1 >= p->n) return fail(p, AXL_ST_ERR_EOF, p->n);
            if (p->s[p->i] != '\\' || p->s[p->i + 1] != 'u')
                return fail(p, AXL_ST_ERR_SURROGATE, esc);
            const int64_t esc2 = p->i;
            p->i++;
            uint32_t low;
            if ((rc = read_u_escape(p, esc2, &low))) return rc;
            if (low < 0xDC00 || low > 0xDFFF) return fail(p, AXL_ST_ERR_SURROGATE, esc);
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
        }
        put_code_point(dst, cap, len, cp);
    }
}

/* ---- numbers and other values ---------------------------------------------------------- */

static int is_digit(uint8_t c) { return c >= '0' && c <= '9'; }

/* Any JSON number (validated, not converted). */
static int skip_number(parser *p) {
    if (peek(p) == '-') p->i++;
    if (at_end(p)) return fail(p, AXL_ST_ERR_EOF, p->i);
    if (peek(p) == '0') {
        p->i++;
        if (!at_end(p) && is_digit(peek(p))) return fail(p, AXL_ST_ERR_LEADING_ZERO, p->i - 1);
    } else if (is_digit(peek(p))) {
        while (!at_end(p) && is_digit(peek(p))) p->i++;
    } else {
        return fail(p, AXL_ST_ERR_SYNTAX, p->i);
    }
    if (!at_end(p) && peek(p) == '.') {
        p->i++;
        if (at_end(p)) return fail(p, AXL_ST_ERR_EOF, p->i);
        if (!is_digit(peek(p))) return fail(p, AXL_ST_ERR_SYNTAX, p->i);
        while (!at_end(p) && is_digit(peek(p))) p->i++;
    }
    if (!at_end(p) && (peek(p) == 'e' || peek(p) == 'E')) {
        p->i++;
        if (!at_end(p) && (peek(p) == '+' || peek(p) == '-')) p->i++;
        if (at_end(p)) return fail(p, AXL_ST_ERR_EOF, p->i);
        if (!is_digit(peek(p))) return fail(p, AXL_ST_ERR_SYNTAX, p->i);
        while (!at_end(p) && is_digit(peek(p))) p->i++;
    }
    return AXL_OK;
}

/* An integer 0 .. INT64_MAX where the schema requires one (a dim or an offset). */
static int parse_count(parser *p, int64_t *out) {
    if (at_end(p)) return fail(p, AXL_ST_ERR_EOF, p->i);
    const int64_t start = p->i;
    uint8_t c = peek(p);
    if (c == '-') return fail(p, AXL_ST_ERR_NEGATIVE, start);
    if (!is_digit(c)) return fail(p, AXL_ST_ERR_EXPECTED_INTEGER, start);
    if (c == '0' && p->i + 1 < p->n && is_digit(p->s[p->i + 1]))
        return fail(p, AXL_ST_ERR_LEADING_ZERO, start);
    int64_t v = 0;
    while (!at_end(p) && is_digit(peek(p))) {
        int d = peek(p) - '0';
        if (v > (INT64_MAX - d) / 10) return fail(p, AXL_ST_ERR_INT_OVERFLOW, start);
        v = v * 10 + d;
        p->i++;
    }
    if (!at_end(p) && (peek(p) == '.' || peek(p) == 'e' || peek(p) == 'E'))
        return fail(p, AXL_ST_ERR_NOT_INTEGER, start);
    *out = v;
    return AXL_OK;
}

static int skip_literal(parser *p, const char *word) {
    for (const char *w = word; *w; w++) {
        if (at_end(p)) return fail(p, AXL_ST_ERR_EOF, p->i);
        if (peek(p) != (uint8_t)*w) return fail(p, AXL_ST_ERR_SYNTAX, p->i);
        p->i++;
    }
    return AXL_OK;
}

static int next_member(parser *p, uint8_t close, int *done);
static int parse_key(parser *p, uint8_t *dst, int64_t cap, int64_t *len);

/* The opening `open` at the cursor (else error `kind` there), then whitespace; an empty
 * container is consumed whole, closing `close` included, and *empty set. */
static int open_container(parser *p, uint8_t open, uint8_t close, int kind, int *empty) {
    if (at_end(p)) return fail(p, AXL_ST_ERR_EOF, p->i);
    if (peek(p) != open) return fail(p, kind, p->i);
    p->i++;
    skip_ws(p);
    *empty = !at_end(p) && peek(p) == close;
    if (*empty) p->i++;
    return AXL_OK;
}

/* Any JSON value; depth is that of a container opened here. */
static int skip_value(parser *p, int depth) {
    int rc, done;
    int64_t len;
    if (at_end(p)) return fail(p, AXL_ST_ERR_EOF, p->i);
    const uint8_t c = peek(p);
    if (c == '{' || c == '[') {
        const uint8_t close = c == '{' ? '}' : ']';
        if (depth > AXL_ST_MAX_DEPTH) return fail(p, AXL_ST_ERR_TOO_DEEP, p->i);
        if ((rc = open_container(p, c, close, AXL_ST_ERR_SYNTAX, &done))) return rc;
        while (!done) {
            if (c == '{' && (rc = parse_key(p, NULL, 0, &len))) return rc;
            if ((rc = skip_value(p, depth + 1))) return rc;
            if ((rc = next_member(p, close, &done))) return rc;
        }
        return AXL_OK;
    }
    if (c == '"') return parse_string(p, NULL, 0, &len);
    if (c == 't') return skip_literal(p, "true");
    if (c == 'f') return skip_literal(p, "false");
    if (c == 'n') return skip_literal(p, "null");
    if (c == '-' || is_digit(c)) return skip_number(p);
    return fail(p, AXL_ST_ERR_SYNTAX, p->i);
}

/* After a member: ',' (then whitespace; *done = 0) or the closing brace/bracket (*done = 1). */
static int next_member(parser *p, uint8_t close, int *done) {
    skip_ws(p);
    if (at_end(p)) return fail(p, AXL_ST_ERR_EOF, p->i);
    if (peek(p) == close) {
        p->i++;
        *done = 1;
        return AXL_OK;
    }
    int rc = expect(p, ',');
    skip_ws(p);
    *done = 0;
    return rc;
}

/* An object key at the cursor (after whitespace), then ':' and whitespace. */
static int parse_key(parser *p, uint8_t *dst, int64_t cap, int64_t *len) {
    int rc;
    if (at_end(p)) return fail(p, AXL_ST_ERR_EOF, p->i);
    if (peek(p) != '"') return fail(p, AXL_ST_ERR_SYNTAX, p->i);
    if ((rc = parse_string(p, dst, cap, len))) return rc;
    skip_ws(p);
    if ((rc = expect(p, ':'))) return rc;
    skip_ws(p);
    return AXL_OK;
}

static int key_is(const uint8_t *buf, int64_t len, const char *word) {
    size_t w = strlen(word);
    return len == (int64_t)w && memcmp(buf, word, w) == 0;
}

/* ---- the schema ------------------------------------------------------------------------ */

static int parse_metadata(parser *p) {
    int rc, done;
    int64_t len;
    if (at_end(p)) return fail(p, AXL_ST_ERR_EOF, p->i);
    if (peek(p) == 'n') return skip_literal(p, "null"); /* no metadata, as safetensors allows */
    if ((rc = open_container(p, '{', '}', AXL_ST_ERR_METADATA_NOT_OBJECT, &done))) return rc;
    while (!done) {
        if ((rc = parse_key(p, NULL, 0, &len))) return rc;
        if (at_end(p)) return fail(p, AXL_ST_ERR_EOF, p->i);
        /* strings only: safetensors refuses a null value too */
        if (peek(p) != '"') return fail(p, AXL_ST_ERR_METADATA_VALUE, p->i);
        if ((rc = parse_string(p, NULL, 0, &len))) return rc;
        if ((rc = next_member(p, '}', &done))) return rc;
    }
    return AXL_OK;
}

/* "shape": an array of counts, stored at dims[dims_used ..]; *elements = their product. */
static int parse_shape(parser *p, int64_t *ndim, int64_t *elements) {
    int rc, done;
    axl_st_header *h = p->out;
    *ndim = 0;
    *elements = 1;
    if ((rc = open_container(p, '[', ']', AXL_ST_ERR_SHAPE_NOT_ARRAY, &done))) return rc;
    while (!done) {
        const int64_t pos = p->i;
        int64_t d;
        if ((rc = parse_count(p, &d))) return rc;
        if (*ndim == AXL_ST_MAX_NDIM) {
            h->error.value = AXL_ST_MAX_NDIM;
            return fail(p, AXL_ST_ERR_TOO_MANY_DIMS, pos);
        }
        if (d != 0 && *elements > INT64_MAX / d) return fail(p, AXL_ST_ERR_SIZE_OVERFLOW, pos);
        *elements *= d;
        if (p->full) {
            if (h->dims_used >= h->dims_cap) return fail(p, AXL_ST_ERR_CAPACITY, pos);
            h->dims[h->dims_used] = d;
        }
        h->dims_used++;
        (*ndim)++;
        if ((rc = next_member(p, ']', &done))) return rc;
    }
    return AXL_OK;
}

/* "data_offsets": exactly [begin, end] with begin <= end. */
static int parse_offsets(parser *p, int64_t *begin, int64_t *end) {
    int rc, done;
    const int64_t pos = p->i;
    if (at_end(p)) return fail(p, AXL_ST_ERR_EOF, p->i);
    if (peek(p) != '[') return fail(p, AXL_ST_ERR_OFFSETS_NOT_ARRAY, p->i);
    p->i++;
    skip_ws(p);
    int64_t v[2];
    for (int k = 0;; k++) {
        if (!at_end(p) && peek(p) == ']') return fail(p, AXL_ST_ERR_OFFSETS_LENGTH, pos);
        if (k == 2) return fail(p, AXL_ST_ERR_OFFSETS_LENGTH, pos);
        if ((rc = parse_count(p, &v[k]))) return rc;
        if ((rc = next_member(p, ']', &done))) return rc;
        if (done) {
            if (k != 1) return fail(p, AXL_ST_ERR_OFFSETS_LENGTH, pos);
            break;
        }
    }
    if (v[0] > v[1]) return fail(p, AXL_ST_ERR_OFFSETS_REVERSED, pos);
    *begin = v[0];
    *end = v[1];
    return AXL_OK;
}

/* A tensor's entry; on success *t is filled but for the name and key fields. */
static int parse_entry(parser *p, axl_st_tensor *t) {
    int rc, done;
    int have_dtype = 0, have_shape = 0, have_offsets = 0;
    int64_t elements = 0;
    const int64_t entry_pos = p->i;
    if ((rc = open_container(p, '{', '}', AXL_ST_ERR_ENTRY_NOT_OBJECT, &done))) return rc;
    while (!done) {
        uint8_t key[16];
        int64_t len;
        const int64_t key_pos = p->i;
        if ((rc = parse_key(p, key, sizeof key, &len))) return rc;
        const int64_t value_pos = p->i;
        if (key_is(key, len, "dtype")) {
            if (have_dtype) return fail(p, AXL_ST_ERR_DUPLICATE_FIELD, key_pos);
            have_dtype = 1;
            if (at_end(p)) return fail(p, AXL_ST_ERR_EOF, p->i);
            if (peek(p) != '"') return fail(p, AXL_ST_ERR_DTYPE_NOT_STRING, value_pos);
            uint8_t name[16];
            int64_t name_len;
            if ((rc = parse_string(p, name, sizeof name, &name_len))) return rc;
            t->dtype = -1;
            for (int d = 0; d < AXL_ST_DTYPE_COUNT; d++)
                if (key_is(name, name_len, dtypes[d].name)) t->dtype = d;
            if (t->dtype < 0) return fail(p, AXL_ST_ERR_UNKNOWN_DTYPE, value_pos);
        } else if (key_is(key, len, "shape")) {
            if (have_shape) return fail(p, AXL_ST_ERR_DUPLICATE_FIELD, key_pos);
            have_shape = 1;
            t->dims_off = p->out->dims_used;
            if ((rc = parse_shape(p, &t->ndim, &elements))) return rc;
        } else if (key_is(key, len, "data_offsets")) {
            if (have_offsets) return fail(p, AXL_ST_ERR_DUPLICATE_FIELD, key_pos);
            have_offsets = 1;
            if ((rc = parse_offsets(p, &t->begin, &t->end))) return rc;
        } else {
            if ((rc = skip_value(p, 3))) return rc;
        }
        if ((rc = next_member(p, '}', &done))) return rc;
    }
    if (!have_dtype) return fail(p, AXL_ST_ERR_MISSING_DTYPE, entry_pos);
    if (!have_shape) return fail(p, AXL_ST_ERR_MISSING_SHAPE, entry_pos);
    if (!have_offsets) return fail(p, AXL_ST_ERR_MISSING_OFFSETS, entry_pos);
    const int64_t bits = dtypes[t->dtype].bits;
    int64_t bytes;
    if (bits % 8 == 0) {
        if (elements > INT64_MAX / (bits / 8)) return fail(p, AXL_ST_ERR_SIZE_OVERFLOW, entry_pos);
        bytes = elements * (bits / 8);
    } else {
        if (elements > INT64_MAX / bits) return fail(p, AXL_ST_ERR_SIZE_OVERFLOW, entry_pos);
        if (elements * bits % 8) return fail(p, AXL_ST_ERR_PARTIAL_BYTE, entry_pos);
        bytes = elements * bits / 8;
    }
    if (t->end - t->begin != bytes) {
        p->out->error.value = bytes;
        return fail(p, AXL_ST_ERR_SIZE_MISMATCH, entry_pos);
    }
    return AXL_OK;
}

/* ---- cross-tensor checks: in-place heapsort ------------------------------------------- */

typedef int (*record_cmp)(const axl_st_tensor *a, const axl_st_tensor *b, const char *names);

static int by_name(const axl_st_tensor *a, const axl_st_tensor *b, const char *names) {
    int64_t m = a->name_len < b->name_len ? a->name_len : b->name_len;
    int c = m ? memcmp(names + a->name_off, names + b->name_off, (size_t)m) : 0;
    if (c) return c;
    if (a->name_len != b->name_len) return a->name_len < b->name_len ? -1 : 1;
    return (a->key_pos > b->key_pos) - (a->key_pos < b->key_pos);
}

static int by_offsets(const axl_st_tensor *a, const axl_st_tensor *b, const char *names) {
    (void)names;
    if (a->begin != b->begin) return a->begin < b->begin ? -1 : 1;
    if (a->end != b->end) return a->end < b->end ? -1 : 1;
    return (a->key_pos > b->key_pos) - (a->key_pos < b->key_pos);
}

static void sift_down(axl_st_tensor *r, int64_t root, int64_t count, record_cmp cmp,
                      const char *names) {
    for (;;) {
        int64_t child = 2 * root + 1;
        if (child >= count) return;
        if (child + 1 < count && cmp(&r[child], &r[child + 1], names) < 0) child++;
        if (cmp(&r[root], &r[child], names) >= 0) return;
        axl_st_tensor tmp = r[root];
        r[root] = r[child];
        r[child] = tmp;
        root = child;
    }
}

static void heapsort_records(axl_st_tensor *r, int64_t count, record_cmp cmp, const char *names) {
    for (int64_t i = count / 2; i-- > 0;) sift_down(r, i, count, cmp, names);
    for (int64_t end = count - 1; end > 0; end--) {
        axl_st_tensor tmp = r[0];
        r[0] = r[end];
        r[end] = tmp;
        sift_down(r, 0, end, cmp, names);
    }
}

/* Tensor i of records as "tensor" (and j as "other", if j >= 0) of the error. */
static int fail_records(parser *p, int kind, int64_t i, int64_t j) {
    const axl_st_tensor *r = p->out->records;
    p->cur = i;
    p->cur_pos = i >= 0 ? r[i].key_pos : -1;
    p->cur_len = i >= 0 ? r[i].key_len : -1;
    axl_st_error *e = &p->out->error;
    e->other = j;
    e->other_pos = j >= 0 ? r[j].key_pos : -1;
    e->other_len = j >= 0 ? r[j].key_len : -1;
    const int64_t pos = kind == AXL_ST_ERR_TRAILING_BYTES || i < 0 ? -1 : r[i].key_pos;
    return fail(p, kind, pos);
}

static int check_records(parser *p, int64_t file_size) {
    axl_st_header *h = p->out;
    axl_st_tensor *r = h->records;
    const int64_t count = h->count;
    heapsort_records(r, count, by_name, h->names);
    for (int64_t i = 1; i < count; i++) {
        const axl_st_tensor *a = &r[i - 1], *b = &r[i];
        if (a->name_len == b->name_len &&
            (a->name_len == 0 ||
             memcmp(h->names + a->name_off, h->names + b->name_off, (size_t)a->name_len) == 0))
            /* equal names are sorted by key position: i is the later one */
            return fail_records(p, AXL_ST_ERR_DUPLICATE_NAME, i, i - 1);
    }
    heapsort_records(r, count, by_offsets, h->names);
    int64_t start = 0;
    for (int64_t i = 0; i < count; i++) {
        if (r[i].begin > start) {
            h->error.value = start;
            return fail_records(p, AXL_ST_ERR_GAP, i, i - 1);
        }
        if (r[i].begin < start) {
            h->error.value = start;
            const int same = r[i].begin == r[i - 1].begin && r[i].end == r[i - 1].end;
            return fail_records(p, same ? AXL_ST_ERR_SAME_BYTES : AXL_ST_ERR_OVERLAP, i, i - 1);
        }
        start = r[i].end;
    }
    h->data_bytes = start;
    const int64_t avail = file_size - 8 - p->n; /* >= 0, checked first */
    if (start > avail) {
        int64_t i = 0;
        while (r[i].end <= avail) i++; /* the first tensor the file cuts; exists */
        h->error.value = start;
        return fail_records(p, AXL_ST_ERR_TRUNCATED, i, -1);
    }
    if (start < avail) {
        h->error.value = start;
        return fail_records(p, AXL_ST_ERR_TRAILING_BYTES, count - 1, -1);
    }
    return AXL_OK;
}

/* ---- entry point ----------------------------------------------------------------------- */

int axl_st_parse_header(const uint8_t *header, int64_t n, int64_t file_size,
                        axl_st_header *out) {
    if (!out) return AXL_ERR_NULL_POINTER;
    out->count = out->names_used = out->dims_used = out->data_bytes = 0;
    axl_st_error *e = &out->error;
    e->kind = AXL_ST_OK;
    e->position = e->tensor = e->tensor_pos = e->tensor_len = -1;
    e->other = e->other_pos = e->other_len = -1;
    e->value = 0;
    if (!header && n > 0) return AXL_ERR_NULL_POINTER;
    const int given = (out->records != NULL) + (out->names != NULL) + (out->dims != NULL);
    if (given != 0 && given != 3) return AXL_ERR_NULL_POINTER;
    if (n < 0 || file_size < 0 || out->records_cap < 0 || out->names_cap < 0 ||
        out->dims_cap < 0)
        return AXL_ERR_BAD_SIZE;

    parser p = {header, n, 0, out, given == 3, -1, -1, -1};
    int rc;
    if (file_size < 8 || n > file_size - 8) {
        e->value = n;
        return fail(&p, AXL_ST_ERR_HEADER_BEYOND_FILE, -1);
    }
    int done, seen_metadata = 0;
    if ((rc = open_container(&p, '{', '}', AXL_ST_ERR_NOT_OBJECT, &done))) return rc;
    while (!done) {
        const int64_t key_pos = p.i;
        /* the name goes straight into names; a short local copy tells __metadata__ */
        uint8_t local[16];
        uint8_t *dst = p.full ? (uint8_t *)out->names + out->names_used : local;
        const int64_t cap = p.full ? out->names_cap - out->names_used : (int64_t)sizeof local;
        int64_t len;
        p.cur = -1;
        p.cur_pos = p.cur_len = -1;
        if (at_end(&p)) return fail(&p, AXL_ST_ERR_EOF, p.i);
        if (peek(&p) != '"') return fail(&p, AXL_ST_ERR_SYNTAX, p.i);
        if ((rc = parse_string(&p, dst, cap, &len))) return rc;
        const int64_t key_len = p.i - key_pos;
        skip_ws(&p);
        if ((rc = expect(&p, ':'))) return rc;
        skip_ws(&p);
        int is_metadata = len <= cap && key_is(dst, len, "__metadata__");
        if (len > cap && len <= (int64_t)sizeof local) {
            /* no room left in names (the caller sized it for the tensors' names only):
             * decode this short key again into the local copy to tell __metadata__ */
            const int64_t resume = p.i;
            p.i = key_pos;
            if ((rc = parse_string(&p, local, sizeof local, &len))) return rc;
            p.i = resume;
            is_metadata = key_is(local, len, "__metadata__");
        }
        if (is_metadata) {
            if (seen_metadata) return fail(&p, AXL_ST_ERR_DUPLICATE_METADATA, key_pos);
            seen_metadata = 1;
            if ((rc = parse_metadata(&p))) return rc;
        } else {
            p.cur = out->count;
            p.cur_pos = key_pos;
            p.cur_len = key_len;
            if (p.full && len > cap) return fail(&p, AXL_ST_ERR_CAPACITY, key_pos);
            axl_st_tensor t = {out->names_used, len, key_pos, key_len, -1, 0, 0, 0, 0};
            if ((rc = parse_entry(&p, &t))) return rc;
            if (p.full) {
                if (out->count >= out->records_cap)
                    return fail(&p, AXL_ST_ERR_CAPACITY, key_pos);
                out->records[out->count] = t;
            }
            out->count++;
            out->names_used += len;
        }
        if ((rc = next_member(&p, '}', &done))) return rc;
    }
    p.cur = p.cur_pos = p.cur_len = -1;
    skip_ws(&p);
    if (!at_end(&p)) return fail(&p, AXL_ST_ERR_TRAILING_DATA, p.i);
    if (!p.full) return AXL_OK;
    return check_records(&p, file_size);
}
