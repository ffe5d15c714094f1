"""The only module that talks to AutoXLA's C core (csrc/, built as `_axl_core*.so` here).

Python owns memory, C only computes: every function below checks its tensors (device,
layout, dtype, contiguity, shape, alignment, overlap, that the storage holds every element,
that output memory is writable: see _check_storage and _check_host_memory), bounds what it
allocates per call (_MAX_BLOCKS), reads regular files only, and allocates outputs before
it passes a pointer, and keeps the tensors referenced for the whole call, so no argument
can crash or hang the process. The library is loaded with ctypes at first use, not at import; a missing or
stale build raises NativeLibraryError, and a non-zero C status raises NativeError.
"""

from __future__ import annotations

import bisect
import ctypes
import importlib.machinery
import itertools
import math
import operator
import os
import stat
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

__all__ = [
    "NativeError",
    "NativeLibraryError",
    "Quantized",
    "SafetensorsHeaderError",
    "SafetensorsTensor",
    "available_isas",
    "best_isa",
    "block_ranges",
    "convert",
    "cpu_features",
    "dequantize",
    "num_cpus",
    "parse_safetensors_header",
    "quantize",
    "quantized_shape",
    "read_blocks",
    "read_shards",
    "scatter_shards",
]

# Must equal AXL_ABI_VERSION in csrc/include/autoxla.h.
ABI_VERSION = 8

# axl_dtype values (autoxla.h) of the dtypes axl_convert takes.
_CONVERT_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

# Dtypes quantization scales can be stored in (axl_quantize's scale_dtype).
_SCALE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

# Quantized data (axl_dtype values): the shard functions copy these, same dtype in and out.
_INT_DTYPES = {torch.int8: 3, torch.uint8: 4}
_SHARD_DTYPES = {**_CONVERT_DTYPES, **_INT_DTYPES}

# axl_status values this module reacts to.
_AXL_ERR_NON_FINITE = 7

# axl_isa values; the vectorised ISAs are listed in increasing order of preference.
_ISAS = {"auto": 0, "scalar": 1, "avx2": 2, "avx512": 3}

# AXL_CPU_* bits.
_CPU_FEATURE_BITS = {
    "avx2": 1 << 0,
    "f16c": 1 << 1,
    "fma": 1 << 2,
    "avx512f": 1 << 3,
    "avx512bw": 1 << 4,
    "avx512vl": 1 << 5,
    "avx512dq": 1 << 6,
    "avx512vnni": 1 << 7,
    "avx512bf16": 1 << 8,
}

# AXL_MAX_NDIM: most dims axl_scatter_shards / axl_read_shards take.
_MAX_NDIM = 8

# Most blocks one scatter_shards / read_shards call cuts: a block per device of a mesh, and
# the largest meshes (a TPU v5p pod: 8960 chips) stay well below 2**16. Each block is a
# Python tensor (about 0.5 KB and a microsecond or two) plus 8 bytes in C, so 2**16 of them
# return in well under a second; without a bound, an empty tensor of shape (0, 10**12)
# "divides" into 10**12 empty blocks and the call never returns.
_MAX_BLOCKS = 2**16

_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1
_REBUILD = "rebuild it with `pip install -e .` from the AutoXLA source tree"


class _QSpec(ctypes.Structure):
    """axl_qspec (autoxla.h), field for field."""

    _fields_ = [
        ("bits", ctypes.c_int32), ("scheme", ctypes.c_int32), ("block_size", ctypes.c_int64),
        ("scale_dtype", ctypes.c_int32), ("search", ctypes.c_int32),
        ("importance", ctypes.c_void_p),
    ]


# axl_qscheme values.
_Q_SYMMETRIC, _Q_ZERO_POINT, _Q_OFFSET = 0, 1, 2
_AXL_ERR_BAD_VALUE = 13


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
    here = Path(__file__).resolve().parent
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


# ---- CPU queries -------------------------------------------------------------------------


def cpu_features() -> dict[str, bool]:
    """Which instruction set extensions the C core sees (and the OS enables) on this CPU."""
    bits = _get_lib().axl_cpu_features()
    return {name: bool(bits & bit) for name, bit in _CPU_FEATURE_BITS.items()}


def best_isa() -> str:
    """The ISA that isa="auto" uses here: "avx512", "avx2" or "scalar"."""
    lib = _get_lib()
    return lib.axl_isa_name(lib.axl_best_isa()).decode()


def available_isas() -> list[str]:
    """Every ISA name this CPU can run, "scalar" first (each vector ISA implies the ones
    before it)."""
    names = [name for name in _ISAS if name != "auto"]
    return names[: names.index(best_isa()) + 1]


def num_cpus() -> int:
    """CPUs this process may run on (its affinity mask); what nthreads=0 uses."""
    return _get_lib().axl_num_cpus()


# ---- argument checks ---------------------------------------------------------------------


def _dtype_names(dtypes=_CONVERT_DTYPES) -> str:
    return ", ".join(str(d) for d in dtypes)


def _plain_tensor(name: str, t: object) -> torch.Tensor:
    """t as a plain torch.Tensor over the same memory, so that no Python override of a
    subclass (a data_ptr() or shape that lies, a __torch_function__) decides what pointer
    and size reach C. Tensors whose data lives behind __torch_dispatch__ (FakeTensor,
    DTensor, other wrapper subclasses) have no host memory of their own: refused."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_nested:
        raise ValueError(
            f"{name} is a nested tensor (rows of different lengths, no single dense buffer); "
            f"pass a dense tensor, e.g. each of {name}.unbind() in turn"
        )
    try:  # torch.vmap / torch.func wrappers are plain Tensors without storage
        if t.layout == torch.strided:  # other layouts: refused by name below
            t.untyped_storage()
    except (RuntimeError, NotImplementedError) as e:
        raise ValueError(
            f"{name} has no storage of its own ({e}); it is a wrapper such as torch.vmap's or "
            f"torch.func.grad's, which the C core cannot read: call this function outside the "
            f"transform, on a plain CPU tensor"
        ) from None
    if type(t) is torch.Tensor:
        return t
    if torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python):
        raise ValueError(
            f"{name} is a {type(t).__name__}, a tensor subclass that handles its own data "
            f"(__torch_dispatch__) and has no host memory the C core could read or write; "
            f"pass a plain CPU torch.Tensor holding the values"
        )
    with torch._C.DisableTorchFunctionSubclass():  # the C++ view, no subclass Python code
        return torch.Tensor.as_subclass(t, torch.Tensor)


def _check_storage(name: str, t: torch.Tensor) -> None:
    """The bytes the C core touches, [data_ptr, data_ptr + numel * itemsize) of a contiguous
    t, lie inside t's storage. A view can outlive its storage's size (storage resize_()
    after the view was made, set_/as_strided over a non-resizable storage): C would then
    read or write past the allocation and crash the process."""
    numel = t.numel()
    if numel == 0:
        return
    item = t.element_size()
    storage = t.untyped_storage()
    have = storage.nbytes()
    need = (t.storage_offset() + numel) * item
    base = storage.data_ptr()
    if t.data_ptr() == 0 or base == 0 or need > have:
        raise ValueError(
            f"{name} (shape {tuple(t.shape)}, {t.dtype}, storage offset {t.storage_offset()}) "
            f"needs {need} bytes of storage but its storage has {have} bytes (it was shrunk "
            f"with resize_() after this view was made, or the view was built past its end "
            f"with set_ / as_strided); pass a tensor whose storage holds all its elements, "
            f"e.g. {name}.clone() taken while the storage was whole, or a fresh torch.empty("
            f"{tuple(t.shape)}, dtype={t.dtype})"
        )
    if t.data_ptr() != base + t.storage_offset() * item:
        raise ValueError(  # cannot happen for a real CPU tensor; refuse rather than guess
            f"{name}'s data pointer {t.data_ptr():#x} is not at its storage offset "
            f"{t.storage_offset()} in its storage at {base:#x}; pass {name}.clone()"
        )


def _check_cpu_tensor(name: str, t: object, dtypes=_CONVERT_DTYPES, fix: str = "") -> torch.Tensor:
    """A dense, contiguous, aligned CPU tensor of one of `dtypes`, whose storage holds every
    element; `fix` ends the dtype error. Returns it as a plain torch.Tensor (_plain_tensor):
    callers pass that one's pointers to C."""
    t = _plain_tensor(name, t)
    if t.device.type != "cpu":
        raise ValueError(
            f"{name} is on device {t.device}; the C core reads host memory: pass a CPU "
            f"tensor (e.g. {name}.cpu())"
        )
    if t.layout != torch.strided:
        raise ValueError(f"{name} has layout {t.layout}; call .to_dense() first")
    if t.dtype not in dtypes:
        raise ValueError(
            f"{name} has dtype {t.dtype}; expected one of {_dtype_names(dtypes)}{fix}"
        )
    if t.is_neg():
        raise ValueError(f"{name} is a lazily negated view; call .resolve_neg() first")
    if not t.is_contiguous():
        raise ValueError(
            f"{name} is not contiguous (shape {tuple(t.shape)}, strides {t.stride()}); "
            f"call .contiguous() first"
        )
    if t.data_ptr() % t.element_size():
        raise ValueError(
            f"{name}'s data at {t.data_ptr():#x} is not aligned to its {t.element_size()}-byte "
            f"elements (a view at an odd byte offset?); call .clone() first"
        )
    _check_storage(name, t)
    return t


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _byte_range(a), _byte_range(b)
    return a0 < a1 and b0 < b1 and a0 < b1 and b0 < a1


# Memory the C core may touch. A tensor can sit over memory the process may not write (a
# read-only mmap, np.memmap(mode="r") through torch.from_numpy, frombuffer of a PROT_READ
# mmap) or not even read (PROT_NONE); C would fault and kill the interpreter. The kernel's
# own list of this process's mappings, /proc/self/maps, says which: reading it costs about
# a millisecond whatever the tensor's size, changes nothing, and needs no signal handler;
# a syscall probe (making the kernel write into the range to see EFAULT) would instead cost
# a pass over every page and overwrite the output first. Mappings change (mmap / munmap at
# any time), so it is read once per call, and only when there is something to check:
# every user-supplied output, and inputs over memory torch did not allocate itself (a
# non-resizable storage: from_numpy, frombuffer, from_file, mmap loads). Tensors torch
# allocated (resizable storages) are ordinary heap memory, readable and writable. Without
# /proc (not Linux) nothing can be checked and the call proceeds as before. Not caught: a
# Python bytes object under torch.frombuffer is writable heap memory (writing it breaks
# the bytes object's immutability but cannot crash), and a shared file mapping whose file
# was truncated since (SIGBUS: the pages are mapped, the file is not there).
_PROC_MAPS = "/proc/self/maps"


def _read_mappings() -> list[tuple[int, int, bytes]] | None:
    """(start, end, perms) of every mapping of this process, by address; None without /proc."""
    try:
        with open(_PROC_MAPS, "rb") as f:
            text = f.read()
    except OSError:
        return None
    maps = []
    for line in text.splitlines():
        addr, perms = line.split(b" ", 2)[:2]
        lo, _, hi = addr.partition(b"-")
        maps.append((int(lo, 16), int(hi, 16), perms))
    return maps


def _range_problem(maps, start: int, end: int, write: bool) -> str | None:
    """Why [start, end) cannot be read (or written), per maps; None if it can."""
    i = bisect.bisect_right(maps, (start, _INT64_MAX * 4)) - 1
    pos = start
    while pos < end:
        if i < 0 or i >= len(maps) or not maps[i][0] <= pos < maps[i][1]:
            return f"byte {pos:#x} is not mapped memory"
        perms = maps[i][2].decode(errors="replace")
        if perms[:1] != "r" or (write and perms[1:2] != "w"):
            return (
                f"the mapping [{maps[i][0]:#x}, {maps[i][1]:#x}) holding it is "
                f"{'read-only' if perms[:1] == 'r' else 'not readable'} (permissions {perms})"
            )
        pos = maps[i][1]
        i += 1
    return None


def _check_host_memory(
    outputs: dict[str, torch.Tensor | None], inputs: dict[str, torch.Tensor | None]
) -> None:
    """Every output's bytes are writable and every foreign input's bytes readable (see above);
    raises ValueError naming the first tensor that is not."""
    todo = [(n, t, True) for n, t in outputs.items() if t is not None and t.numel()]
    todo += [
        (n, t, False) for n, t in inputs.items()
        if t is not None and t.numel() and not t.untyped_storage().resizable()
    ]
    if not todo:
        return
    maps = _read_mappings()
    if maps is None:
        return
    for name, t, write in todo:
        start, end = _byte_range(t)
        problem = _range_problem(maps, start, end, write)
        if problem is None:
            continue
        if write:
            raise ValueError(
                f"{name} (shape {tuple(t.shape)}, {t.dtype}, bytes [{start:#x}, {end:#x})) is "
                f"over memory this process cannot write: {problem} (a read-only mmap, "
                f"np.memmap(mode='r'), torch.frombuffer of a read-only buffer?); writing it "
                f"would crash the process: pass a writable tensor, e.g. torch.empty("
                f"{tuple(t.shape)}, dtype={t.dtype}), or leave it out to get a new one"
            )
        raise ValueError(
            f"{name} (shape {tuple(t.shape)}, {t.dtype}, bytes [{start:#x}, {end:#x})) is over "
            f"memory this process cannot read: {problem}; reading it would crash the process: "
            f"pass a tensor over readable memory (e.g. a copy made while it was readable)"
        )


def _check_nthreads(nthreads: object) -> int:
    if isinstance(nthreads, bool) or not isinstance(nthreads, int):
        raise TypeError(f"nthreads must be an int, got {type(nthreads).__name__}")
    if not 0 <= nthreads <= _INT32_MAX:
        raise ValueError(
            f"nthreads={nthreads} is out of range; pass 0 for all CPUs or a positive count"
        )
    return nthreads


def _check_isa(isa: object) -> int:
    if not isinstance(isa, str):
        raise TypeError(f"isa must be a str, got {type(isa).__name__}")
    if isa not in _ISAS:
        raise ValueError(f"unknown isa {isa!r}; expected one of {', '.join(map(repr, _ISAS))}")
    return _ISAS[isa]


# ---- kernels -----------------------------------------------------------------------------


def convert(
    src: torch.Tensor,
    dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
    nthreads: int = 0,
    isa: str = "auto",
) -> torch.Tensor:
    """Return src converted to dtype, like src.to(dtype), computed by the C core.

    float32, bfloat16 and float16, in any pair. Bit for bit equal to src.to(dtype) for
    every non-NaN value; NaNs stay NaN with a fixed bit pattern per pair (see axl_convert
    in csrc/include/autoxla.h: PyTorch's own NaN patterns vary with CPU and position).

    src: a contiguous CPU tensor of any shape. out: optional contiguous CPU tensor of
    src's shape and of `dtype`, not overlapping src; written and returned. nthreads: 0 =
    all CPUs, n > 0 = at most n threads (small tensors use one). isa: "auto" or one of
    available_isas(). Not differentiable: the result never requires grad.
    """
    src = _check_cpu_tensor("src", src)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    if dtype not in _CONVERT_DTYPES:
        raise ValueError(f"cannot convert to {dtype}; expected one of {_dtype_names()}")
    threads = _check_nthreads(nthreads)
    isa_code = _check_isa(isa)
    lib = _get_lib()  # before allocating: a missing library should fail first

    result = out  # the caller's object is returned; `out` below is its plain tensor
    if out is None:
        out = torch.empty(src.shape, dtype=dtype)
        result = None
    else:
        out = _check_cpu_tensor("out", out)
        if out.dtype != dtype:
            raise ValueError(f"out has dtype {out.dtype}, expected {dtype}; pass out of that dtype")
        if out.shape != src.shape:
            raise ValueError(
                f"out has shape {tuple(out.shape)}, src has shape {tuple(src.shape)}; "
                f"pass out=torch.empty(src.shape, dtype={dtype})"
            )
        if out.requires_grad:
            raise ValueError(
                "out requires grad, but convert writes it outside autograd; pass a tensor "
                "with requires_grad=False"
            )
        (s0, s1), (o0, o1) = _byte_range(src), _byte_range(out)
        if s0 < o1 and o0 < s1:
            raise ValueError("out shares memory with src; pass a separate output tensor")
    _check_host_memory({"out": None if result is None else out}, {"src": src})

    # src and out stay referenced by this frame until the call returns.
    status = lib.axl_convert(
        src.data_ptr(), _CONVERT_DTYPES[src.dtype], out.data_ptr(), _CONVERT_DTYPES[dtype],
        src.numel(), threads, isa_code,
    )
    _check_status(status, f"convert {src.dtype} -> {dtype} (isa={isa!r}, nthreads={threads})")
    return out if result is None else result


# ---- shard slicing -----------------------------------------------------------------------


def _check_dtype(name: str, dtype: object, dtypes=_CONVERT_DTYPES) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {type(dtype).__name__}")
    if dtype not in dtypes:
        raise ValueError(f"{name} is {dtype}; expected one of {_dtype_names(dtypes)}")
    return dtype


def _check_shard_dtypes(src_name: str, src_dtype: torch.dtype, dtype: object) -> torch.dtype:
    """Float dtypes convert in any pair; int8/uint8 (quantized data) only copy to themselves."""
    _check_dtype("dtype", dtype, _SHARD_DTYPES)
    if (src_dtype in _INT_DTYPES or dtype in _INT_DTYPES) and dtype != src_dtype:
        expected = src_dtype if src_dtype in _INT_DTYPES else _dtype_names()
        raise ValueError(
            f"dtype is {dtype} but {src_name} is {src_dtype}: int8/uint8 blocks are copied, "
            f"never converted to or from floats; expected one of {expected}"
        )
    return dtype


def _check_ints(name: str, values: object, minimum: int) -> tuple[int, ...]:
    """A tuple of ints >= minimum (and < 2**63), from any sequence of ints."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, torch.Size)):
        raise TypeError(f"{name} must be a tuple of ints, got {type(values).__name__}")
    try:  # before iterating: a range(10**18) is a Sequence too, and would never end
        n = len(values)
    except OverflowError:
        n = _INT64_MAX
    if n > _MAX_NDIM:
        raise ValueError(
            f"{name} has {n if n < _INT64_MAX else 'too many'} entries; tensors here have at "
            f"most {_MAX_NDIM} dims: pass one int per dim"
        )
    out = []
    for d, v in enumerate(values):
        if isinstance(v, bool) or not hasattr(type(v), "__index__"):
            raise TypeError(f"{name}[{d}] must be an int, got {type(v).__name__} ({v!r})")
        v = operator.index(v)  # numpy integers too
        if not minimum <= v <= _INT64_MAX:
            raise ValueError(f"{name}[{d}] = {v} is out of range; expected an int >= {minimum}")
        out.append(v)
    return tuple(out)


def _check_grid(shape: tuple[int, ...], grid: object) -> tuple[int, ...]:
    """grid: one positive int per dim of shape (1 <= ndim <= 8), each dividing its dim."""
    if not shape:
        raise ValueError(
            "the tensor is a scalar (0 dims); it has no dims to split: copy it whole instead"
        )
    if len(shape) > _MAX_NDIM:
        raise ValueError(f"the tensor has {len(shape)} dims; at most {_MAX_NDIM} are supported")
    grid = _check_ints("grid", grid, 1)
    if len(grid) != len(shape):
        raise ValueError(
            f"grid {grid} has {len(grid)} entries but the tensor of shape {shape} has "
            f"{len(shape)} dims; pass one block count per dim (1 = not split)"
        )
    for d, (size, parts) in enumerate(zip(shape, grid)):
        if size % parts:
            raise ValueError(
                f"grid[{d}] = {parts} does not divide dim {d} of size {size} (shape {shape}); "
                f"every dim must split into equal blocks: use a divisor of {size}"
            )
    # Every block is a Python tensor made here (and a C pointer): the count bounds this
    # call's time and memory, whatever the tensor's size (an empty one divides by any grid).
    blocks = math.prod(grid)
    if blocks > _MAX_BLOCKS:
        raise ValueError(
            f"grid {grid} makes {blocks} blocks, more than the {_MAX_BLOCKS} allowed (no "
            f"device mesh has that many devices); pass one block count per dim that matches "
            f"your mesh's axes, e.g. (1, 8) for 8 devices on the last dim"
        )
    return grid


def _block_shape(shape: tuple[int, ...], grid: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(size // parts for size, parts in zip(shape, grid))


def _alloc_blocks(shape, grid, dtype) -> tuple[list[torch.Tensor], ctypes.Array]:
    """The blocks, and a C array of their data pointers (kept alive by the caller)."""
    block = _block_shape(shape, grid)
    blocks = [torch.empty(block, dtype=dtype) for _ in range(math.prod(grid))]
    ptrs = (ctypes.c_void_p * len(blocks))(*(b.data_ptr() for b in blocks))
    return blocks, ptrs


def _int64_array(values: tuple[int, ...]) -> ctypes.Array:
    return (ctypes.c_int64 * len(values))(*values)


def scatter_shards(
    src: torch.Tensor,
    grid: tuple[int, ...],
    dtype: torch.dtype,
    *,
    nthreads: int = 0,
    isa: str = "auto",
) -> list[torch.Tensor]:
    """src cut into grid[d] equal blocks along each dim d and converted to dtype, computed
    by the C core; the blocks in row-major grid order (the last grid dim varies fastest).

    Equals ``[b.to(dtype).contiguous() for b in split_grid(src, grid)]``, where split_grid
    chunks dim by dim, bit for bit (conversion as in convert(): NaNs follow one fixed rule
    per pair). src: a contiguous CPU tensor of float32, bfloat16 or float16 with 1 to 8
    dims, or of int8 / uint8 (quantized data, e.g. quantize()'s q), which is copied: then
    dtype must be src's dtype. grid: one positive int per dim of src, dividing that dim (1
    = not split). dtype: float32, bfloat16 or float16 for a float src. nthreads, isa: as
    for convert(). Not differentiable: the blocks never require grad.
    """
    src = _check_cpu_tensor("src", src, _SHARD_DTYPES)
    shape = tuple(src.shape)
    grid = _check_grid(shape, grid)
    _check_shard_dtypes("src", src.dtype, dtype)
    threads = _check_nthreads(nthreads)
    isa_code = _check_isa(isa)
    _check_host_memory({}, {"src": src})
    lib = _get_lib()  # before allocating: a missing library should fail first

    blocks, ptrs = _alloc_blocks(shape, grid, dtype)
    # src, blocks and the arrays stay referenced by this frame until the call returns.
    status = lib.axl_scatter_shards(
        src.data_ptr(), _SHARD_DTYPES[src.dtype], len(shape), _int64_array(shape),
        _int64_array(grid), ptrs, _SHARD_DTYPES[dtype], threads, isa_code,
    )
    _check_status(
        status,
        f"scatter_shards {src.dtype} {shape} grid {grid} -> {dtype} (isa={isa!r}, "
        f"nthreads={threads})",
    )
    return blocks


def file_kind(mode: int) -> str:
    """What a stat mode is, in words: "a regular file", "a FIFO (named pipe)", "a directory",
    "a device", "a socket" (for the messages that refuse all but regular files)."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return (
        "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else
        "a directory" if stat.S_ISDIR(mode) else
        "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
        "a socket" if stat.S_ISSOCK(mode) else "not a regular file"
    )


def _read_scratch(lib, src_dtype, shape, c_shape, threads: int, what: str, needed: bool = True):
    """(the staging buffer axl_read_shards / axl_read_blocks read through, its size)."""
    scratch_bytes = lib.axl_read_shards_scratch_bytes(
        _SHARD_DTYPES[src_dtype], len(shape), c_shape, threads
    )
    if scratch_bytes < 0:
        _check_status(-scratch_bytes, f"{what} scratch size for {shape} ({src_dtype})")
    return torch.empty(scratch_bytes if needed else 0, dtype=torch.uint8), scratch_bytes


def read_shards(
    path: str | os.PathLike,
    offset: int,
    src_dtype: torch.dtype,
    shape: tuple[int, ...],
    grid: tuple[int, ...],
    dtype: torch.dtype,
    *,
    nthreads: int = 0,
    isa: str = "auto",
) -> list[torch.Tensor]:
    """Like scatter_shards, for the tensor of src_dtype and shape whose bytes (dense,
    row-major, native little-endian) start at byte `offset` of the file `path`, as in a
    safetensors file; the whole tensor is never in memory. int8 / uint8 tensors are copied
    (dtype must equal src_dtype), as in scatter_shards.

    The C core reads the file in chunks of whole dim-0 rows (about 8 MiB per thread),
    staged in one scratch buffer allocated here, and converts each chunk straight into
    the blocks. Host memory peaks at the blocks plus that scratch. Raises
    FileNotFoundError for a missing file and ValueError for one too short to hold the
    tensor (a truncated download?); NativeError if reading fails anyway.
    """
    _check_dtype("src_dtype", src_dtype, _SHARD_DTYPES)
    shape = _check_ints("shape", shape, 0)
    grid = _check_grid(shape, grid)
    _check_shard_dtypes("src_dtype", src_dtype, dtype)
    threads = _check_nthreads(nthreads)
    isa_code = _check_isa(isa)
    path_str, end = _check_tensor_file(path, offset, src_dtype, shape, "read_shards")
    lib = _get_lib()  # before allocating: a missing library should fail first

    ndim = len(shape)
    c_shape, c_grid = _int64_array(shape), _int64_array(grid)
    # One thread count for both calls: the scratch size depends on it.
    threads = threads or lib.axl_num_cpus()
    scratch, scratch_bytes = _read_scratch(lib, src_dtype, shape, c_shape, threads, "read_shards")
    blocks, ptrs = _alloc_blocks(shape, grid, dtype)
    # The scratch, blocks and arrays stay referenced by this frame until the call returns.
    status = lib.axl_read_shards(
        os.fsencode(path_str), offset, _SHARD_DTYPES[src_dtype], ndim, c_shape, c_grid, ptrs,
        _SHARD_DTYPES[dtype], scratch.data_ptr(), scratch_bytes, threads, isa_code,
    )
    _check_status(
        status,
        f"read_shards {path_str} bytes [{offset}, {end}) {src_dtype} {shape} grid {grid} -> "
        f"{dtype} (isa={isa!r}, nthreads={threads})",
    )
    return blocks


# Most entries `wanted` may list, duplicates included: a block is listed once in practice,
# and a list this long takes a fraction of a second; the bound stops an endless iterator
# (itertools.cycle) from hanging the call.
_MAX_WANTED_ENTRIES = 4 * _MAX_BLOCKS


def _check_wanted(wanted: object, nblocks: int) -> list[int]:
    """The block indices listed in `wanted` (an iterable of ints in [0, nblocks)), sorted,
    duplicates merged."""
    if isinstance(wanted, (str, bytes)) or not hasattr(wanted, "__iter__"):
        raise TypeError(
            f"wanted must be an iterable of block indices (ints), got {type(wanted).__name__}"
        )
    out = set()
    for i, k in enumerate(itertools.islice(iter(wanted), _MAX_WANTED_ENTRIES + 1)):
        if i == _MAX_WANTED_ENTRIES:
            raise ValueError(
                f"wanted lists more than {_MAX_WANTED_ENTRIES} block indices; list each wanted "
                f"block once (there are {nblocks} blocks)"
            )
        if isinstance(k, bool) or not hasattr(type(k), "__index__"):
            raise TypeError(f"wanted[{i}] must be an int block index, got {type(k).__name__}")
        try:
            k = operator.index(k)  # numpy integers and integer 0-d tensors too
        except TypeError:
            raise TypeError(
                f"wanted[{i}] must be an int block index, got {type(k).__name__} ({k!r})"
            ) from None
        if not 0 <= k < nblocks:
            raise ValueError(
                f"wanted[{i}] = {k} is not a block index: the grid has {nblocks} blocks, "
                f"numbered 0 .. {nblocks - 1} in row-major grid order"
            )
        out.add(k)
    return sorted(out)


def _check_tensor_file(path: object, offset: object, src_dtype: torch.dtype,
                       shape: tuple[int, ...], fn: str) -> tuple[str, int]:
    """The file checks of read_shards and read_blocks: the path as str and the tensor's end.

    Only a regular file: opening a FIFO blocks until a writer comes (forever), a device may
    never end. The C core checks again on the descriptor it opens (O_NONBLOCK, fstat), so a
    file swapped for a FIFO after this stat cannot hang the call either."""
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    path_str = os.fspath(path)
    if not isinstance(path_str, str):
        raise TypeError(f"path must name a file as str, got {type(path_str).__name__}")
    if "\0" in path_str:
        raise ValueError(f"path {path_str!r} contains a NUL character")
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"offset must be an int, got {type(offset).__name__}")
    if offset < 0:
        raise ValueError(f"offset={offset} is negative; pass the tensor's byte offset in the file")
    numel = math.prod(shape)
    end = offset + numel * torch.empty((), dtype=src_dtype).element_size()
    if numel > _INT64_MAX // 4 or end > _INT64_MAX:
        raise ValueError(
            f"the tensor of shape {shape} ({src_dtype}) at offset {offset} is too large: it "
            f"would end at byte {end}; check the shape and offset"
        )
    try:
        st = os.stat(path_str)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path_str}: no such file; it should hold a tensor of shape {shape} "
            f"({src_dtype}) at bytes [{offset}, {end})"
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(
            f"{path_str} is {file_kind(st.st_mode)}, not a regular file; {fn} reads "
            f"tensors from files only: pass the checkpoint file's path"
        )
    # The whole tensor, though only some blocks are read: a shorter file is truncated.
    if st.st_size < end:
        raise ValueError(
            f"{path_str} is {st.st_size} bytes, but the tensor of shape {shape} ({src_dtype}) "
            f"occupies bytes [{offset}, {end}): the file looks truncated; download or save "
            f"it again"
        )
    return path_str, end


def read_blocks(
    path: str | os.PathLike,
    offset: int,
    src_dtype: torch.dtype,
    shape: tuple[int, ...],
    grid: tuple[int, ...],
    dtype: torch.dtype,
    wanted,
    *,
    gap_bytes: int = 0,
    nthreads: int = 0,
    isa: str = "auto",
) -> tuple[dict[int, torch.Tensor], int]:
    """Like read_shards, for only the blocks listed in `wanted`, reading only the bytes of
    the file that hold them (a host of a multi-host slice needs a few blocks per tensor).

    wanted: an iterable of block indices, ints in [0, prod(grid)) in read_shards' order
    (row-major over the grid); duplicates are merged, none is fine. Returns ({k: block k}
    for each wanted k in increasing order, the bytes read). Each block equals read_shards'
    block k bit for bit. The bytes read are exactly block_ranges(src_dtype, shape, grid,
    wanted, gap_bytes=gap_bytes), relative to offset: with gap_bytes=0 only the wanted
    blocks' bytes; a larger gap_bytes merges ranges at most that far apart into one read
    (fewer, longer preads; the gap is read and dropped): a block that splits the last dim
    is a short range per row, which a gap_bytes as large as the rest of the row joins.
    The file must still hold the whole tensor (else ValueError, as in read_shards).
    Scratch, threads and errors as in read_shards; with nothing wanted the C core opens
    no file and reads 0 bytes.
    """
    _check_dtype("src_dtype", src_dtype, _SHARD_DTYPES)
    shape = _check_ints("shape", shape, 0)
    grid = _check_grid(shape, grid)
    _check_shard_dtypes("src_dtype", src_dtype, dtype)
    ks = _check_wanted(wanted, math.prod(grid))
    gap_bytes = _check_int("gap_bytes", gap_bytes, 0)
    threads = _check_nthreads(nthreads)
    isa_code = _check_isa(isa)
    path_str, end = _check_tensor_file(path, offset, src_dtype, shape, "read_blocks")
    lib = _get_lib()  # before allocating: a missing library should fail first

    ndim = len(shape)
    c_shape, c_grid = _int64_array(shape), _int64_array(grid)
    threads = threads or lib.axl_num_cpus()
    # read_shards' scratch: autoxla.h promises it is enough for any subset of the blocks.
    scratch, scratch_bytes = _read_scratch(lib, src_dtype, shape, c_shape, threads,
                                           "read_blocks", needed=bool(ks))
    block = _block_shape(shape, grid)
    blocks = {k: torch.empty(block, dtype=dtype) for k in ks}
    ptrs = (ctypes.c_void_p * math.prod(grid))()  # NULL: not wanted
    for k, b in blocks.items():
        ptrs[k] = b.data_ptr()
    bytes_read = ctypes.c_int64(0)
    # The scratch, blocks and arrays stay referenced by this frame until the call returns.
    status = lib.axl_read_blocks(
        os.fsencode(path_str), offset, _SHARD_DTYPES[src_dtype], ndim, c_shape, c_grid, ptrs,
        _SHARD_DTYPES[dtype], gap_bytes, scratch.data_ptr() if ks else None, scratch_bytes,
        threads, isa_code, ctypes.byref(bytes_read),
    )
    _check_status(
        status,
        f"read_blocks {path_str} bytes [{offset}, {end}) {src_dtype} {shape} grid {grid} "
        f"blocks {_short_list(ks)} -> {dtype} (gap_bytes={gap_bytes}, isa={isa!r}, "
        f"nthreads={threads})",
    )
    return blocks, bytes_read.value


def _short_list(values: list[int], most: int = 8) -> str:
    """values for a message: at most `most` of them."""
    if len(values) <= most:
        return str(values)
    return f"[{', '.join(map(str, values[:most]))}, ... ({len(values)} in all)]"


def block_ranges(
    src_dtype: torch.dtype,
    shape: tuple[int, ...],
    grid: tuple[int, ...],
    wanted,
    *,
    gap_bytes: int = 0,
) -> list[tuple[int, int]]:
    """The byte ranges read_blocks reads for these arguments, computed by the same C code:
    [(begin, end), ...] relative to the tensor's first byte (add the file offset), sorted,
    disjoint and more than gap_bytes apart. With gap_bytes=0 they cover exactly the wanted
    blocks' bytes: len(wanted) x the block's elements x src_dtype's size in all.
    """
    _check_dtype("src_dtype", src_dtype, _SHARD_DTYPES)
    shape = _check_ints("shape", shape, 0)
    grid = _check_grid(shape, grid)
    nblocks = math.prod(grid)
    ks = _check_wanted(wanted, nblocks)
    gap_bytes = _check_int("gap_bytes", gap_bytes, 0)
    if math.prod(shape) > _INT64_MAX // 4:
        raise ValueError(f"the tensor of shape {shape} is too large; check the shape")
    lib = _get_lib()

    c_shape, c_grid = _int64_array(shape), _int64_array(grid)
    flags = (ctypes.c_ubyte * nblocks)()
    for k in ks:
        flags[k] = 1
    what = f"block_ranges {src_dtype} {shape} grid {grid} blocks {_short_list(ks)}"
    code = _SHARD_DTYPES[src_dtype]
    count = lib.axl_block_ranges(code, len(shape), c_shape, c_grid, flags, gap_bytes, None, 0)
    if count < 0:
        _check_status(-count, what)
    ranges = (ctypes.c_int64 * (2 * count))()
    got = lib.axl_block_ranges(code, len(shape), c_shape, c_grid, flags, gap_bytes, ranges,
                               count)
    if got != count:  # same arguments, same walk: cannot happen
        raise NativeError(0, f"{what}: {got} ranges on the second call, {count} on the first")
    return [(ranges[2 * i], ranges[2 * i + 1]) for i in range(count)]


# ---- quantization ------------------------------------------------------------------------

# Formats: bits -> (dtype of q, qmax). See axl_quantize in csrc/include/autoxla.h.
_Q_DTYPES = {8: torch.int8, 4: torch.uint8}


class Quantized(NamedTuple):
    """A weight quantized by quantize(): CPU tensors, for rows x cols and G = ceil(cols /
    block) blocks per row (the last one shorter when block does not divide cols).

    q: int8 (rows, cols) for 8 bits; uint8 (rows, ceil(cols / 2)) for 4 bits, two 4-bit
    two's complement values per byte, element 2j of a row in the low nibble (bits 0-3) of
    byte j and element 2j+1 in the high nibble (with odd cols the last high nibble is 0).
    scale: (rows, G) of the scale_dtype given to quantize(), float32, bfloat16 or float16.
    zero_point: int8 (rows, G), None when symmetric.
    max_err: float32 (rows,), the largest |w - dequantized| per row; sqnr_db: float32
    (rows,), 10 log10(sum w^2 / sum (w - dequantized)^2) per row (+inf for an exact row);
    both None unless quantize(..., stats=True).
    offset: (rows, G) of the scale dtype for quantize(..., offset=True), where the dequantized
    value is q * scale + offset (no zero point); None otherwise.
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    max_err: torch.Tensor | None
    sqnr_db: torch.Tensor | None
    offset: torch.Tensor | None = None


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    value = operator.index(value)
    if not minimum <= value <= _INT64_MAX:
        raise ValueError(f"{name}={value} is out of range; expected an int >= {minimum}")
    return value


def _check_bits(bits: object) -> int:
    if isinstance(bits, bool) or not hasattr(type(bits), "__index__"):
        raise TypeError(f"bits must be an int (4 or 8), got {type(bits).__name__} ({bits!r})")
    bits = operator.index(bits)
    if bits not in _Q_DTYPES:
        raise ValueError(f"bits={bits} is not supported; pass bits=8 (int8) or bits=4 (int4)")
    return bits


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} ({value!r})")
    return value


def _check_block(block_size: object, cols: int) -> int:
    """The C core's block size: -1 (per-channel) -> cols; any size >= 1 otherwise, at most
    cols (a block of cols or more is one per row). The last block of a row is shorter when
    the size does not divide cols (G = ceil(cols / block) blocks per row)."""
    if isinstance(block_size, bool) or not hasattr(type(block_size), "__index__"):
        raise TypeError(
            f"block_size must be an int, got {type(block_size).__name__} ({block_size!r})"
        )
    block = operator.index(block_size)
    if block == -1 or block == cols:
        return cols
    if block >= 1:
        return min(block, cols)
    raise ValueError(
        f"block_size={block} is not a block size: pass -1 (one scale per row) or a positive "
        f"number of elements per block (e.g. 32; the last block of a row may be shorter)"
    )


def _check_importance(importance: object, cols: int, search: bool) -> torch.Tensor | None:
    """The search's per-column weights: None, or a float32 (cols,) CPU tensor, finite, >= 0."""
    if importance is None:
        return None
    if not search:
        raise ValueError(
            "importance weights only the search's error: pass search=True with it (or drop it)"
        )
    t = _check_cpu_tensor(
        "importance", importance, {torch.float32: None},
        ": pass one float32 weight per input column, e.g. x.pow(2).mean(0).float()",
    )
    if tuple(t.shape) != (cols,):
        raise ValueError(
            f"importance has shape {tuple(t.shape)}, expected ({cols},): one weight per input "
            f"column of w"
        )
    bad = ~(torch.isfinite(t) & (t >= 0))
    if bool(bad.any()):
        col = int(bad.nonzero()[0])
        raise ValueError(
            f"importance[{col}] is {float(t[col])}; every weight must be finite and >= 0 "
            f"(clean it, e.g. torch.nan_to_num(importance).clamp(min=0))"
        )
    return t


def _groups(cols: int, block: int) -> int:
    """Blocks per row, G = ceil(cols / block) (0 for an empty row)."""
    return -(-cols // block) if cols else 0


def quantized_shape(rows: int, cols: int, bits: int) -> tuple[int, int]:
    """Shape of quantize()'s q for a (rows, cols) weight: (rows, cols) for 8 bits, (rows,
    ceil(cols / 2)) for 4 bits (two values per byte)."""
    rows, cols = _check_int("rows", rows, 0), _check_int("cols", cols, 0)
    return (rows, cols) if _check_bits(bits) == 8 else (rows, (cols + 1) // 2)


def _check_scale_dtype(scale_dtype: object) -> torch.dtype:
    if not isinstance(scale_dtype, torch.dtype) or scale_dtype not in _SCALE_DTYPES:
        raise ValueError(
            f"scale_dtype={scale_dtype!r} is not supported; scales are stored as "
            f"{' or '.join(map(str, _SCALE_DTYPES))}"
        )
    return scale_dtype


def _check_out_tensor(name: str, t: object, dtype: torch.dtype, shape: tuple[int, ...]):
    """t checked as an output of dtype and shape; returned as its plain tensor."""
    t = _check_cpu_tensor(name, t, {dtype: None}, f": pass torch.empty({shape}, dtype={dtype})")
    if tuple(t.shape) != shape:
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}, expected {shape}; pass "
            f"torch.empty({shape}, dtype={dtype})"
        )
    if t.requires_grad:
        raise ValueError(
            f"{name} requires grad, but the C core writes it outside autograd; pass a tensor "
            f"with requires_grad=False"
        )
    return t


def _check_disjoint(named: dict[str, torch.Tensor | None]) -> None:
    """No two of the (non-None) tensors share a byte."""
    items = [(n, t) for n, t in named.items() if t is not None]
    for i, (a_name, a) in enumerate(items):
        for b_name, b in items[i + 1:]:
            if _shares_memory(a, b):
                raise ValueError(
                    f"{a_name} and {b_name} share memory; pass separate tensors (e.g. "
                    f"{b_name}.clone())"
                )


_SKIP_FIX = (
    "or keep this layer unquantized (add its name to QuantizationConfig(exclude_layers=[...]))"
)


def _non_finite_message(
    w: torch.Tensor, row: int, block: int, bits: int = 8, symmetric: bool = True,
    scale_dtype: torch.dtype = torch.float32, offset: bool = False,
) -> tuple[str, str | None]:
    """What axl_quantize's AXL_ERR_NON_FINITE for `row` means, and the reason (NativeError).

    The C core returns it for a row holding NaN or Inf, (asymmetric only) for a finite row
    with a block whose hi - lo (hi = max(max, 0), lo = min(min, 0)) overflows float32 (e.g.
    3e38 and -3e38 in one block), and for a block whose grid, the rounded-up scale times its
    levels, overflows float32 (values within about 2^-8 of FLT_MAX, symmetric or not).
    """
    rows, cols = w.shape
    if not 0 <= row < rows or cols == 0:  # not a row the C core can name; say what we know
        return (
            f"the C core refused row {row} (NaN or Inf, or an asymmetric block whose range "
            f"overflows float32); check the weight with torch.isfinite", None,
        )
    values = w[row].float()  # exact for every dtype quantize takes
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        col = int((~finite).nonzero()[0])
        return (
            f"row {row} of the weight contains NaN or Inf (first at column {col}: "
            f"{float(values[col])}); find where it comes from, or drop or clean that row "
            f"(e.g. torch.nan_to_num) before quantizing, {_SKIP_FIX}", "non_finite",
        )
    groups = _groups(cols, block)
    # Ragged rows: the short last block padded with 0, which min(., 0) / max(., 0) ignore.
    blocks = torch.nn.functional.pad(values, (0, groups * block - cols)).view(groups, block)
    lo = blocks.min(dim=1).values.clamp(max=0)
    hi = blocks.max(dim=1).values.clamp(min=0)
    over = ~torch.isfinite(hi - lo)  # float32 arithmetic, as in the C core
    if not symmetric and bool(over.any()):
        pass  # the range overflow, below
    elif scale_dtype == torch.float16:
        # float32 scales as the C core computes them; above 65504 none rounds up to float16.
        qmax = 127 if bits == 8 else 7
        s = hi.clamp(min=-lo) / qmax if symmetric else (hi - lo) / (2 * qmax + 1)
        big = s > torch.finfo(torch.float16).max
        if offset:  # the scale of [min, max], and the offset near min, both stored as float16
            mn, mx = blocks.min(dim=1).values, blocks.max(dim=1).values
            if cols % block:  # the padding zeros of the short last block are not its values
                last = values[(groups - 1) * block:]
                mn[-1], mx[-1] = last.min(), last.max()
            s = (mx - mn) / (2 * qmax + 1)
            big = (s > torch.finfo(torch.float16).max) | ((mn + (qmax + 1) * s).abs() > 65519)
        if bool(big.any()):
            g = int(big.nonzero()[0])
            return (
                f"row {row} of the weight is finite, but its block {g} (columns {g * block} to "
                f"{min((g + 1) * block, cols) - 1}) needs a scale of {float(s[g]):.6g} (or an "
                f"offset) above "
                f"float16's largest value {torch.finfo(torch.float16).max:.0f}: store the scales "
                f"as torch.bfloat16 or torch.float32 (scale_dtype=...), or scale the weights "
                f"down, {_SKIP_FIX}", "scale_overflow",
            )
    if not bool(over.any()):
        # The grid: scale * qmax (or * (qmax - qmin)), with the scale rounded up, overflows
        # for a block within about 2^-8 of the largest float32, symmetric or not.
        amax = values.abs()
        col = int(amax.argmax())
        if float(amax[col]) < torch.finfo(torch.float32).max / 2:
            return (
                f"the C core refused row {row}, but it is finite and no block comes near the "
                f"float32 limit here; please report this with the weight", None,
            )
        return (
            f"row {row} of the weight is finite, but its block {col // block} (columns "
            f"{col // block * block} to {min((col // block + 1) * block, cols) - 1}) reaches "
            f"{float(values[col]):.6g} (column {col}), within about 2^-8 of the largest float32 "
            f"({torch.finfo(torch.float32).max:.6g}): its quantization grid (the scale times "
            f"the number of levels) overflows float32, so its extreme values would dequantize "
            f"to Inf; scale the weights down, {_SKIP_FIX}", "grid_overflow",
        )
    g = int(over.nonzero()[0])
    part = values[g * block:(g + 1) * block]
    c_lo, c_hi = g * block + int(part.argmin()), g * block + int(part.argmax())
    return (
        f"row {row} of the weight is finite, but its asymmetric block {g} (columns "
        f"{g * block} to {min((g + 1) * block, cols) - 1}) spans {float(values[c_lo]):.6g} (column "
        f"{c_lo}) to {float(values[c_hi]):.6g} (column {c_hi}): the range max - min = "
        f"{float(values[c_hi]) - float(values[c_lo]):.6g} overflows float32 arithmetic (largest "
        f"float32 {torch.finfo(torch.float32).max:.6g}), so no scale exists; scale the "
        f"weights down so that max - min stays below that, quantize with symmetric=True "
        f"(max |x| / qmax does not overflow), {_SKIP_FIX}", "range_overflow",
    )


def quantize(
    w: torch.Tensor,
    *,
    bits: int,
    symmetric: bool,
    block_size: int,
    stats: bool = False,
    scale_dtype: torch.dtype = torch.float32,
    nthreads: int = 0,
    isa: str = "auto",
    out: Quantized | None = None,
    search: bool = False,
    importance: torch.Tensor | None = None,
    offset: bool = False,
) -> Quantized:
    """Quantize the (rows, cols) weight w to int8 or int4 with the C core; see Quantized.

    search: True runs the error-minimising search per block (autoxla.h, "formats and the
    error-minimising search"): candidate scales around the absmax / min-max one (for
    symmetric ones also mapping the signed extreme to -8 / -128, so a scale may be negative),
    each refit by least squares, the lowest (weighted) squared error kept only if below the
    plain result's, so no block is ever worse than without the search; the plain half-step
    bound below then no longer holds for searched blocks. importance: with search=True, None
    (uniform) or a float32 (cols,) CPU tensor of finite weights >= 0 per input column (e.g. the
    mean squared activation from calibration) that weight the squared error. offset: True
    (with symmetric=False) for the float-offset scheme y = q * scale + offset (like
    llama.cpp's Q4_1; q over the full range, scale = (max - min) / (qmax - qmin) rounded up,
    offset = min - qmin * scale rounded to nearest, stored in the scale dtype as
    Quantized.offset, no zero point). All of these give the same bits on every ISA.

    w: a 2-D contiguous CPU tensor of float32, bfloat16 or float16, read in place.
    bits: 8 or 4. symmetric: True for q in [-qmax, qmax] with no zero point; False for the
    full range [qmin, qmax] with an int8 zero point per block. block_size: elements of a
    row that share one scale: -1 (or cols, or more) for one per row, else any size >= 1; the
    last block of a row is shorter when it does not divide cols. stats: also return max_err and sqnr_db per row (computed in the same
    pass). scale_dtype: torch.float32, torch.bfloat16 or torch.float16, the dtype the scales
    are stored in (bfloat16 and float16 round the float32 scale UP, see below).
    nthreads, isa: as for convert(). out: optional Quantized of tensors to fill (q, scale of
    scale_dtype; zero_point exactly when asymmetric; max_err and sqnr_db exactly when
    stats), each of the documented dtype and shape; returned.

    The arithmetic is fixed and identical on every ISA and thread count (autoxla.h):
    symmetric scale = max|x| / qmax, asymmetric scale = (max(x, 0) - min(x, 0)) / (qmax -
    qmin), in float32; with scale_dtype=torch.bfloat16 (torch.float16) that scale is rounded
    UP to bfloat16 (float16): the smallest value of that dtype >= it, not to nearest as
    .to(dtype) rounds, and the rounded value is used from then on (float16: a scale above
    65504 refuses the row, NativeError reason "scale_overflow"; any tiny nonzero scale
    becomes 2^-24): q = clamp(round_half_even(x * (1 / scale)) +
    zero_point), all in float32; a block whose scale is 0 (or whose 1 / scale overflows) is
    all zeros with scale 0. Since the stored scale is never below the float32 one, every
    element of a kept block is within half a step (plus float32 rounding) of its
    dequantized value, with either scale dtype.
    Raises NativeError (with .row and .reason) if a row holds NaN or Inf, (asymmetric) a
    block whose range max - min overflows float32 arithmetic (finite values near +-3.4e38),
    or (float16 scales) a block whose scale exceeds float16's range.
    """
    w = _check_cpu_tensor(
        "w", w, _CONVERT_DTYPES,
        ": convert it first, e.g. w.to(torch.bfloat16) (or float32 / float16)",
    )
    if w.dim() != 2:
        raise ValueError(
            f"w has shape {tuple(w.shape)}; quantize takes a 2-D (rows, cols) weight: reshape "
            f"it first, e.g. w.reshape(-1, w.shape[-1])"
        )
    bits = _check_bits(bits)
    symmetric = _check_bool("symmetric", symmetric)
    stats = _check_bool("stats", stats)
    search = _check_bool("search", search)
    offset = _check_bool("offset", offset)
    if offset and symmetric:
        raise ValueError(
            "offset=True is an asymmetric scheme (y = q * scale + offset); pass "
            "symmetric=False with it"
        )
    scale_dtype = _check_scale_dtype(scale_dtype)
    rows, cols = w.shape
    block = _check_block(block_size, cols)
    groups = _groups(cols, block)
    importance = _check_importance(importance, cols, search)
    threads = _check_nthreads(nthreads)
    isa_code = _check_isa(isa)
    scheme = _Q_SYMMETRIC if symmetric else _Q_OFFSET if offset else _Q_ZERO_POINT
    has_zp = scheme == _Q_ZERO_POINT
    lib = _get_lib()  # before allocating: a missing library should fail first

    q_shape = quantized_shape(rows, cols, bits)
    if out is None:
        q = torch.empty(q_shape, dtype=_Q_DTYPES[bits])
        scale = torch.empty((rows, groups), dtype=scale_dtype)
        zero_point = torch.empty((rows, groups), dtype=torch.int8) if has_zp else None
        offsets = torch.empty((rows, groups), dtype=scale_dtype) if offset else None
        max_err = torch.empty(rows, dtype=torch.float32) if stats else None
        sqnr_db = torch.empty(rows, dtype=torch.float32) if stats else None
    else:
        if not isinstance(out, Quantized):
            raise TypeError(
                f"out must be a Quantized, got {type(out).__name__}; build one with "
                f"Quantized(q, scale, zero_point, max_err, sqnr_db)"
            )
        q = _check_out_tensor("out.q", out.q, _Q_DTYPES[bits], q_shape)
        scale = _check_out_tensor("out.scale", out.scale, scale_dtype, (rows, groups))
        if has_zp == (out.zero_point is None):
            raise ValueError(
                "out.zero_point must be None for symmetric=True or offset=True and an int8 "
                f"tensor of shape {(rows, groups)} for symmetric=False"
            )
        zero_point = _check_out_tensor(
            "out.zero_point", out.zero_point, torch.int8, (rows, groups)
        ) if has_zp else None
        if offset == (out.offset is None):
            raise ValueError(
                f"out.offset must be a {scale_dtype} tensor of shape {(rows, groups)} for "
                f"offset=True and None otherwise"
            )
        offsets = _check_out_tensor(
            "out.offset", out.offset, scale_dtype, (rows, groups)
        ) if offset else None
        for name in ("max_err", "sqnr_db"):
            if stats != (getattr(out, name) is not None):
                raise ValueError(
                    f"out.{name} must be a float32 tensor of shape ({rows},) when stats=True "
                    f"and None when stats=False"
                )
        max_err = _check_out_tensor("out.max_err", out.max_err, torch.float32, (rows,)) if stats else None
        sqnr_db = _check_out_tensor("out.sqnr_db", out.sqnr_db, torch.float32, (rows,)) if stats else None
        _check_disjoint({
            "w": w, "importance": importance, "out.q": q, "out.scale": scale,
            "out.zero_point": zero_point, "out.offset": offsets, "out.max_err": max_err,
            "out.sqnr_db": sqnr_db,
        })
    outputs = {} if out is None else {
        "out.q": q, "out.scale": scale, "out.zero_point": zero_point, "out.offset": offsets,
        "out.max_err": max_err, "out.sqnr_db": sqnr_db,
    }
    _check_host_memory(outputs, {"w": w, "importance": importance})

    def ptr(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    bad_row = ctypes.c_int64(-1)
    spec = _QSpec(bits, scheme, block, _SCALE_DTYPES[scale_dtype], int(search), ptr(importance))
    # Every tensor stays referenced by this frame until the call returns.
    status = lib.axl_quantize_spec(
        w.data_ptr(), _CONVERT_DTYPES[w.dtype], rows, cols, ctypes.byref(spec), q.data_ptr(),
        scale.data_ptr(), ptr(zero_point), ptr(offsets), ptr(max_err), ptr(sqnr_db),
        ctypes.byref(bad_row), threads, isa_code,
    )
    kind = "symmetric" if symmetric else "offset" if offset else "asymmetric"
    what = (
        f"quantize {w.dtype} {tuple(w.shape)} to int{bits} {kind} block {block}, "
        f"{scale_dtype} scales{', search' if search else ''} (isa={isa!r}, nthreads={threads})"
    )
    if status == _AXL_ERR_NON_FINITE:
        row = bad_row.value
        message, reason = _non_finite_message(w, row, block, bits, symmetric, scale_dtype, offset)
        raise NativeError(status, f"{what}: {message}", row=row, reason=reason, detail=message)
    _check_status(status, what)
    if stats and cols == 0:  # the C core writes nothing for an empty matrix
        max_err.zero_()
        sqnr_db.fill_(math.inf)
    return Quantized(q, scale, zero_point, max_err, sqnr_db, offsets) if out is None else out


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    *,
    bits: int,
    cols: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    nthreads: int = 0,
    isa: str = "auto",
    out: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """The (rows, cols) weight of dtype back from quantize()'s q, scale and zero_point.

    offset: quantize(..., offset=True)'s Quantized.offset (then zero_point must be None):
    y = float32(q) * scale + offset instead.

    y = float32(q - zero_point) * scale, then rounded to dtype exactly as convert() rounds.
    q, scale, zero_point: as in Quantized (zero_point None = symmetric); scale is float32,
    bfloat16 or float16 (widened to float32 exactly), as quantize() returned it. bits, block_size:
    those given to quantize(); cols: the weight's column count (q of 4 bits holds
    ceil(cols / 2) bytes per row). dtype: float32, bfloat16 or float16. out: optional
    (rows, cols) tensor of dtype to fill; returned. nthreads, isa: as for convert().
    """
    bits = _check_bits(bits)
    q = _check_cpu_tensor(
        "q", q, {_Q_DTYPES[bits]: None},
        f" for bits={bits}: pass quantize()'s q unchanged",
    )
    if q.dim() != 2:
        raise ValueError(f"q has shape {tuple(q.shape)}; expected 2-D (rows, bytes per row)")
    cols = _check_int("cols", cols, 0)
    rows = q.shape[0]
    q_shape = quantized_shape(rows, cols, bits)
    if tuple(q.shape) != q_shape:
        raise ValueError(
            f"q has shape {tuple(q.shape)}, but a ({rows}, {cols}) weight of {bits} bits "
            f"quantizes to {q_shape}; check cols and bits"
        )
    block = _check_block(block_size, cols)
    groups = _groups(cols, block)
    scale = _check_cpu_tensor("scale", scale, _SCALE_DTYPES, ": pass quantize()'s scale")
    if tuple(scale.shape) != (rows, groups):
        raise ValueError(
            f"scale has shape {tuple(scale.shape)}, expected {(rows, groups)} (one per block "
            f"of {block}); check block_size"
        )
    if offset is not None:
        if zero_point is not None:
            raise ValueError(
                "zero_point and offset were both given; the offset scheme has no zero point: "
                "pass zero_point=None with quantize(..., offset=True)'s offset"
            )
        offset = _check_cpu_tensor(
            "offset", offset, {scale.dtype: None},
            f": pass quantize()'s offset (of the scale's dtype {scale.dtype})",
        )
        if tuple(offset.shape) != (rows, groups):
            raise ValueError(f"offset has shape {tuple(offset.shape)}, expected {(rows, groups)}")
    if zero_point is not None:
        zero_point = _check_cpu_tensor(
            "zero_point", zero_point, {torch.int8: None},
            ": pass quantize()'s zero_point (None when symmetric)",
        )
        if tuple(zero_point.shape) != (rows, groups):
            raise ValueError(
                f"zero_point has shape {tuple(zero_point.shape)}, expected {(rows, groups)}"
            )
    _check_dtype("dtype", dtype)
    threads = _check_nthreads(nthreads)
    isa_code = _check_isa(isa)
    lib = _get_lib()  # before allocating: a missing library should fail first

    result = out  # the caller's object is returned; `out` below is its plain tensor
    if out is None:
        out = torch.empty((rows, cols), dtype=dtype)
    else:
        out = _check_out_tensor("out", out, dtype, (rows, cols))
        for name, t in (("q", q), ("scale", scale), ("zero_point", zero_point),
                        ("offset", offset)):
            if t is not None and _shares_memory(out, t):
                raise ValueError(f"out shares memory with {name}; pass a separate output tensor")
    _check_host_memory(
        {"out": None if result is None else out},
        {"q": q, "scale": scale, "zero_point": zero_point, "offset": offset},
    )

    scheme = (_Q_OFFSET if offset is not None else _Q_ZERO_POINT if zero_point is not None
              else _Q_SYMMETRIC)
    spec = _QSpec(bits, scheme, block, _SCALE_DTYPES[scale.dtype], 0, None)
    # q, scale, zero_point, offset and out stay referenced by this frame until the call returns.
    status = lib.axl_dequantize_spec(
        q.data_ptr(), scale.data_ptr(), None if zero_point is None else zero_point.data_ptr(),
        None if offset is None else offset.data_ptr(), rows, cols, ctypes.byref(spec),
        out.data_ptr(), _CONVERT_DTYPES[dtype], threads, isa_code,
    )
    _check_status(
        status,
        f"dequantize int{bits} ({rows}, {cols}) block {block}, {scale.dtype} scales -> {dtype} "
        f"(isa={isa!r}, nthreads={threads})",
    )
    return out if result is None else result


# ---- safetensors headers -----------------------------------------------------------------
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
