"""Finds and loads the C core (`AutoXLA/_axl_core*.so`, built beside the package) with ctypes.

The library is loaded at first use (_get_lib), not at import, and every C function's signature
is set once, there; a missing or stale build (ABI version) raises NativeLibraryError, and a
non-zero C status raises NativeError (_check_status).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import threading
from pathlib import Path

# Must equal AXL_ABI_VERSION in csrc/include/autoxla.h.
ABI_VERSION = 8

_REBUILD = "rebuild it with `pip install -e .` from the AutoXLA source tree"


# Here, not in quant.py, because _load() declares axl_quantize_spec / axl_dequantize_spec with it.
class _QSpec(ctypes.Structure):
    """axl_qspec (autoxla.h), field for field."""

    _fields_ = [
        ("bits", ctypes.c_int32), ("scheme", ctypes.c_int32), ("block_size", ctypes.c_int64),
        ("scale_dtype", ctypes.c_int32), ("search", ctypes.c_int32),
        ("importance", ctypes.c_void_p),
    ]


class NativeLibraryError(ImportError):
    """The C core library is missing, cannot be loaded, or is from another version."""


class NativeError(RuntimeError):
    """A C core function returned a non-zero status; `code` is the axl_status value.

    `row` is the offending row of the weight when quantize() refused one (code 7), else
    None; `reason` then says why: "non_finite" (the row holds NaN or Inf), "range_overflow"
    (finite values, but an asymmetric block's max - min overflows float32),
    "scale_overflow" (float16 scales: a block's scale is above 65504, float16's largest) or
    "grid_overflow" (a block within about 2^-8 of FLT_MAX, where scale x levels overflows),
    else None. The message says the same, with the values and the fix.
    """

    def __init__(
        self, code: int, message: str, row: int | None = None, reason: str | None = None,
        detail: str | None = None,
    ):
        super().__init__(message)
        self.code = code
        self.row = row
        self.reason = reason
        self.detail = detail or message  # the message without the call's description


_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()
def _library_path() -> Path:
    here = Path(__file__).resolve().parent.parent  # AutoXLA/, above this package
    candidates = sorted(here.glob("_axl_core*.so"))
    if not candidates:
        raise NativeLibraryError(
            f"AutoXLA's C core (_axl_core*.so) is not built in {here}; {_REBUILD}."
        )
    # Prefer the build for this interpreter when builds for several sit side by side.
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    own = [p for p in candidates if p.name.endswith(suffixes)]
    return (own or candidates)[0]


def _load() -> ctypes.CDLL:
    path = _library_path()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise NativeLibraryError(f"cannot load AutoXLA's C core {path}: {e}; {_REBUILD}.") from e

    # Signatures are set once, here; see csrc/include/autoxla.h.
    lib.axl_abi_version.argtypes = []
    lib.axl_abi_version.restype = ctypes.c_int
    # First: a stale build may lack the functions below.
    version = lib.axl_abi_version()
    if version != ABI_VERSION:
        raise NativeLibraryError(
            f"AutoXLA's C core {path} has ABI version {version}, this AutoXLA needs "
            f"{ABI_VERSION}; {_REBUILD}."
        )
    lib.axl_strerror.argtypes = [ctypes.c_int]
    lib.axl_strerror.restype = ctypes.c_char_p
    lib.axl_cpu_features.argtypes = []
    lib.axl_cpu_features.restype = ctypes.c_uint32
    lib.axl_best_isa.argtypes = []
    lib.axl_best_isa.restype = ctypes.c_int
    lib.axl_isa_name.argtypes = [ctypes.c_int]
    lib.axl_isa_name.restype = ctypes.c_char_p
    lib.axl_num_cpus.argtypes = []
    lib.axl_num_cpus.restype = ctypes.c_int
    lib.axl_convert.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
        ctypes.c_int64, ctypes.c_int, ctypes.c_int,
    ]
    lib.axl_convert.restype = ctypes.c_int
    lib.axl_scatter_shards.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int64),
        ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
        ctypes.c_int, ctypes.c_int,
    ]
    lib.axl_scatter_shards.restype = ctypes.c_int
    lib.axl_read_shards.argtypes = [
        ctypes.c_char_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
        ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64),
        ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
        ctypes.c_int, ctypes.c_int,
    ]
    lib.axl_read_shards.restype = ctypes.c_int
    lib.axl_read_shards_scratch_bytes.argtypes = [
        ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.c_int,
    ]
    lib.axl_read_shards_scratch_bytes.restype = ctypes.c_int64
    lib.axl_read_blocks.argtypes = [
        ctypes.c_char_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
        ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64),
        ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int64, ctypes.c_void_p,
        ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int64),
    ]
    lib.axl_read_blocks.restype = ctypes.c_int
    lib.axl_block_ranges.argtypes = [
        ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int64),
        ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_ubyte), ctypes.c_int64,
        ctypes.POINTER(ctypes.c_int64), ctypes.c_int64,
    ]
    lib.axl_block_ranges.restype = ctypes.c_int64
    lib.axl_quantize.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
        ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_int,
        ctypes.c_int,
    ]
    lib.axl_quantize.restype = ctypes.c_int
    lib.axl_dequantize.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
        ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
        ctypes.c_int,
    ]
    lib.axl_dequantize.restype = ctypes.c_int
    lib.axl_quantize_spec.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(_QSpec),
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_int, ctypes.c_int,
    ]
    lib.axl_quantize_spec.restype = ctypes.c_int
    lib.axl_dequantize_spec.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
        ctypes.c_int64, ctypes.POINTER(_QSpec), ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
        ctypes.c_int,
    ]
    lib.axl_dequantize_spec.restype = ctypes.c_int

    return lib


def _get_lib() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        with _lib_lock:
            if _lib is None:
                _lib = _load()
    return _lib


def _check_status(status: int, what: str) -> None:
    if status != 0:
        message = _get_lib().axl_strerror(status).decode()
        raise NativeError(status, f"{what}: {message} (status {status})")
