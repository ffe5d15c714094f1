"""Validating a .safetensors header with the C core's strict parser
(parse_safetensors_header), and the error that names the rule broken."""

from __future__ import annotations

import ctypes
import operator
from typing import NamedTuple

from .checks import _INT64_MAX
from .library import _check_status, _get_lib, _lib_lock

# axl_st_parse_header (autoxla.h): the one strict validator of .safetensors headers. The
# structures mirror axl_st_error / axl_st_tensor / axl_st_header field for field.


class SafetensorsHeaderError(ValueError):
    """A .safetensors header that breaks a rule of the format (see autoxla.h).

    `kind` names the rule ("overlap", "truncated", ... as in _ST_ERROR_KINDS), `code` is its
    axl_st_error_kind value, `position` the byte of the header where it was found (None for
    file-level problems), `tensor` / `other` the names of the tensors concerned (or None).
    """

    def __init__(self, message: str, *, kind: str, code: int, position: int | None,
                 tensor: str | None, other: str | None = None):
        super().__init__(message)
        self.kind = kind
        self.code = code
        self.position = position
        self.tensor = tensor
        self.other = other


class SafetensorsTensor(NamedTuple):
    """One tensor of a validated header; its bytes are [8 + n + begin, 8 + n + end)."""

    name: str
    dtype: str          # the header's dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int          # data_offsets, relative to the data section
    end: int


# axl_st_error_kind values, in order.
_ST_ERROR_KINDS = (
    "ok", "eof", "syntax", "utf8", "control_char", "escape", "surrogate", "too_deep",
    "trailing_data", "not_object", "entry_not_object", "metadata_not_object",
    "metadata_value", "duplicate_metadata", "missing_dtype", "missing_shape",
    "missing_offsets", "duplicate_field", "dtype_not_string", "unknown_dtype",
    "shape_not_array", "too_many_dims", "offsets_not_array", "offsets_length",
    "expected_integer", "not_integer", "negative", "leading_zero", "int_overflow",
    "offsets_reversed", "size_overflow", "partial_byte", "size_mismatch", "duplicate_name",
    "gap", "overlap", "same_bytes", "header_beyond_file", "truncated", "trailing_bytes",
    "capacity",
)
_AXL_ERR_BAD_HEADER = 12


class _StError(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in (
        "kind", "position", "tensor", "tensor_pos", "tensor_len", "other", "other_pos",
        "other_len", "value")]


class _StTensor(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in (
        "name_off", "name_len", "key_pos", "key_len", "dtype", "ndim", "dims_off", "begin",
        "end")]


class _StHeader(ctypes.Structure):
    _fields_ = [
        ("records", ctypes.POINTER(_StTensor)), ("records_cap", ctypes.c_int64),
        ("names", ctypes.c_void_p), ("names_cap", ctypes.c_int64),
        ("dims", ctypes.POINTER(ctypes.c_int64)), ("dims_cap", ctypes.c_int64),
        ("count", ctypes.c_int64), ("names_used", ctypes.c_int64),
        ("dims_used", ctypes.c_int64), ("data_bytes", ctypes.c_int64),
        ("error", _StError),
    ]


_st_ready = False


def _st_lib() -> ctypes.CDLL:
    """The library with the safetensors functions' signatures set (once)."""
    global _st_ready
    lib = _get_lib()
    if not _st_ready:
        with _lib_lock:
            lib.axl_st_parse_header.argtypes = [
                ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(_StHeader)]
            lib.axl_st_parse_header.restype = ctypes.c_int
            lib.axl_st_error_text.argtypes = [ctypes.c_int]
            lib.axl_st_error_text.restype = ctypes.c_char_p
            lib.axl_st_dtype_name.argtypes = [ctypes.c_int]
            lib.axl_st_dtype_name.restype = ctypes.c_char_p
            _st_ready = True
    return lib


def _st_key_name(header: bytes, pos: int, length: int) -> str | None:
    """The decoded tensor name whose quoted key is header[pos:pos+length]."""
    if pos < 0 or length < 2:
        return None
    import json

    raw = header[pos:pos + length]
    try:
        name = json.loads(raw)
    except ValueError:  # cannot happen for a span the C core validated; keep the bytes
        return raw.decode("utf-8", "backslashreplace")
    return name if isinstance(name, str) else None


def _st_error(lib, header: bytes, file_size: int, out: _StHeader) -> SafetensorsHeaderError:
    e = out.error
    code = int(e.kind)
    kind = _ST_ERROR_KINDS[code] if 0 <= code < len(_ST_ERROR_KINDS) else f"kind {code}"
    text = lib.axl_st_error_text(code).decode()
    n = len(header)
    tensor = _st_key_name(header, e.tensor_pos, e.tensor_len)
    other = _st_key_name(header, e.other_pos, e.other_len)
    position = int(e.position) if e.position >= 0 else None
    value = int(e.value)
    if kind == "size_mismatch":
        detail = f"{text}: the dtype and shape need {value} bytes"
    elif kind == "too_many_dims":
        detail = f"{text} (at most {value})"
    elif kind == "duplicate_name":
        detail = f"the tensor name appears twice in the header (at bytes {e.other_pos} and {e.tensor_pos})"
    elif kind == "gap":
        where = f"tensor {other!r} ends" if other is not None else "the data section begins"
        detail = (f"{text}: its data_offsets begin after byte {value} of the data section, "
                  f"where {where}")
    elif kind == "overlap":
        detail = (f"{text}: its data_offsets begin inside tensor {other!r}, which ends at "
                  f"byte {value} of the data section")
    elif kind == "same_bytes":
        detail = f"its data_offsets are those of tensor {other!r}: {text}"
    elif kind == "header_beyond_file":
        detail = f"{text}: a {n}-byte header after the 8-byte length needs more than the file's {file_size} bytes"
    elif kind == "truncated":
        detail = (f"{text}: the file has {file_size} bytes but its header and tensors need "
                  f"{8 + n + value} (8 + {n} header bytes + {value} data bytes)")
    elif kind == "trailing_bytes":
        detail = (f"{text}: the file has {file_size} bytes but its header and tensors account "
                  f"for {8 + n + value}, leaving {file_size - 8 - n - value} unexplained bytes")
    else:
        detail = text
    if kind in ("gap", "overlap", "same_bytes", "truncated"):
        detail += f" (its entry is at byte {position} of the header)"
    elif position is not None and kind != "duplicate_name":
        detail += f" (at byte {position} of the header)"
    if tensor is not None and kind != "trailing_bytes":
        detail = f"tensor {tensor!r}: {detail}"
    elif tensor is not None:
        detail += f", after the last tensor {tensor!r}"
    return SafetensorsHeaderError(detail, kind=kind, code=code, position=position,
                                  tensor=tensor, other=other)


def parse_safetensors_header(header: bytes, file_size: int) -> list[SafetensorsTensor]:
    """Validates a .safetensors header (the n bytes after the 8-byte length) of a file of
    file_size bytes with the C core's strict parser, and returns its tensors in file order.

    Raises SafetensorsHeaderError naming the rule broken, the byte of the header and the
    tensor. Nothing of the file but the header is needed: the tensors' offsets are checked
    against file_size (they must tile the data section exactly up to the end of the file).
    """
    if not isinstance(header, (bytes, bytearray, memoryview)):
        raise TypeError(f"header must be bytes, got {type(header).__name__}")
    header = bytes(header)
    file_size = operator.index(file_size)
    if not 0 <= file_size <= _INT64_MAX:
        raise ValueError(f"file_size must be in 0 .. 2**63-1, got {file_size}")
    lib = _st_lib()
    n = len(header)
    data = header if n else None
    # First call: no buffers, only the sizes; then buffers of exactly those sizes.
    sizing = _StHeader()
    status = lib.axl_st_parse_header(data, n, file_size, ctypes.byref(sizing))
    if status == _AXL_ERR_BAD_HEADER:
        raise _st_error(lib, header, file_size, sizing)
    _check_status(status, "axl_st_parse_header")
    records = (_StTensor * max(1, sizing.count))()
    names = ctypes.create_string_buffer(max(1, sizing.names_used))
    dims = (ctypes.c_int64 * max(1, sizing.dims_used))()
    out = _StHeader(records, sizing.count, ctypes.cast(names, ctypes.c_void_p),
                    sizing.names_used, dims, sizing.dims_used)
    status = lib.axl_st_parse_header(data, n, file_size, ctypes.byref(out))
    if status == _AXL_ERR_BAD_HEADER:
        raise _st_error(lib, header, file_size, out)
    _check_status(status, "axl_st_parse_header")
    raw_names = names.raw
    result = []
    for r in records[: out.count]:
        name = raw_names[r.name_off:r.name_off + r.name_len].decode("utf-8")
        dtype = lib.axl_st_dtype_name(r.dtype).decode()
        shape = tuple(dims[r.dims_off:r.dims_off + r.ndim])
        result.append(SafetensorsTensor(name, dtype, shape, int(r.begin), int(r.end)))
    return result
