"""The only module that talks to AutoXLA's C core (csrc/, built as `_axl_core*.so` here).

Python owns memory, C only computes: every function below checks its tensors (device,
layout, dtype, contiguity, shape, alignment, overlap) and allocates outputs before it passes
a pointer, and keeps the tensors referenced for the whole call, so no argument can crash
the process. The library is loaded with ctypes at first use, not at import; a missing or
stale build raises NativeLibraryError, and a non-zero C status raises NativeError.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import math
import operator
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = [
    "NativeError",
    "NativeLibraryError",
    "available_isas",
    "best_isa",
    "convert",
    "cpu_features",
    "num_cpus",
    "read_shards",
    "scatter_shards",
]

# Must equal AXL_ABI_VERSION in csrc/include/autoxla.h.
ABI_VERSION = 2

# axl_dtype values (autoxla.h) of the dtypes axl_convert takes.
_CONVERT_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

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

_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1
_REBUILD = "rebuild it with `pip install -e .` from the AutoXLA source tree"


class NativeLibraryError(ImportError):
    """The C core library is missing, cannot be loaded, or is from another version."""


class NativeError(RuntimeError):
    """A C core function returned a non-zero status; `code` is the axl_status value."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


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


def _dtype_names() -> str:
    return ", ".join(str(d) for d in _CONVERT_DTYPES)


def _check_cpu_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(
            f"{name} is on device {t.device}; the C core reads host memory: pass a CPU "
            f"tensor (e.g. {name}.cpu())"
        )
    if t.layout != torch.strided:
        raise ValueError(f"{name} has layout {t.layout}; call .to_dense() first")
    if t.dtype not in _CONVERT_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; expected one of {_dtype_names()}")
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
    return t


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


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
    _check_cpu_tensor("src", src)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    if dtype not in _CONVERT_DTYPES:
        raise ValueError(f"cannot convert to {dtype}; expected one of {_dtype_names()}")
    threads = _check_nthreads(nthreads)
    isa_code = _check_isa(isa)
    lib = _get_lib()  # before allocating: a missing library should fail first

    if out is None:
        out = torch.empty(src.shape, dtype=dtype)
    else:
        _check_cpu_tensor("out", out)
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

    # src and out stay referenced by this frame until the call returns.
    status = lib.axl_convert(
        src.data_ptr(), _CONVERT_DTYPES[src.dtype], out.data_ptr(), _CONVERT_DTYPES[dtype],
        src.numel(), threads, isa_code,
    )
    _check_status(status, f"convert {src.dtype} -> {dtype} (isa={isa!r}, nthreads={threads})")
    return out


# ---- shard slicing -----------------------------------------------------------------------


def _check_dtype(name: str, dtype: object) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {type(dtype).__name__}")
    if dtype not in _CONVERT_DTYPES:
        raise ValueError(f"{name} is {dtype}; expected one of {_dtype_names()}")
    return dtype


def _check_ints(name: str, values: object, minimum: int) -> tuple[int, ...]:
    """A tuple of ints >= minimum (and < 2**63), from any sequence of ints."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, torch.Size)):
        raise TypeError(f"{name} must be a tuple of ints, got {type(values).__name__}")
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
    # Every dim divides: for a non-empty tensor prod(grid) <= numel; an empty one may have
    # a large grid of empty blocks, but not one whose count overflows the C core.
    if math.prod(grid) > _INT64_MAX // 4:
        raise ValueError(f"grid {grid} makes {math.prod(grid)} blocks; that is too many")
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
    dims. grid: one positive int per dim of src, dividing that dim (1 = not split).
    dtype: float32, bfloat16 or float16. nthreads, isa: as for convert(). Not
    differentiable: the blocks never require grad.
    """
    _check_cpu_tensor("src", src)
    shape = tuple(src.shape)
    grid = _check_grid(shape, grid)
    _check_dtype("dtype", dtype)
    threads = _check_nthreads(nthreads)
    isa_code = _check_isa(isa)
    lib = _get_lib()  # before allocating: a missing library should fail first

    blocks, ptrs = _alloc_blocks(shape, grid, dtype)
    # src, blocks and the arrays stay referenced by this frame until the call returns.
    status = lib.axl_scatter_shards(
        src.data_ptr(), _CONVERT_DTYPES[src.dtype], len(shape), _int64_array(shape),
        _int64_array(grid), ptrs, _CONVERT_DTYPES[dtype], threads, isa_code,
    )
    _check_status(
        status,
        f"scatter_shards {src.dtype} {shape} grid {grid} -> {dtype} (isa={isa!r}, "
        f"nthreads={threads})",
    )
    return blocks


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
    safetensors file; the whole tensor is never in memory.

    The C core reads the file in chunks of whole dim-0 rows (about 8 MiB per thread),
    staged in one scratch buffer allocated here, and converts each chunk straight into
    the blocks. Host memory peaks at the blocks plus that scratch. Raises
    FileNotFoundError for a missing file and ValueError for one too short to hold the
    tensor (a truncated download?); NativeError if reading fails anyway.
    """
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
    _check_dtype("src_dtype", src_dtype)
    shape = _check_ints("shape", shape, 0)
    grid = _check_grid(shape, grid)
    _check_dtype("dtype", dtype)
    threads = _check_nthreads(nthreads)
    isa_code = _check_isa(isa)

    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=src_dtype).element_size()
    end = offset + nbytes
    if numel > _INT64_MAX // 4 or end > _INT64_MAX:
        raise ValueError(
            f"the tensor of shape {shape} ({src_dtype}) at offset {offset} is too large: it "
            f"would end at byte {end}; check the shape and offset"
        )
    try:
        file_size = os.stat(path_str).st_size
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path_str}: no such file; it should hold a tensor of shape {shape} "
            f"({src_dtype}) at bytes [{offset}, {end})"
        ) from None
    if not os.path.isfile(path_str):
        raise ValueError(f"{path_str} is not a regular file; pass the checkpoint file's path")
    if file_size < end:
        raise ValueError(
            f"{path_str} is {file_size} bytes, but the tensor of shape {shape} ({src_dtype}) "
            f"occupies bytes [{offset}, {end}): the file looks truncated; download or save "
            f"it again"
        )
    lib = _get_lib()  # before allocating: a missing library should fail first

    ndim = len(shape)
    c_shape, c_grid = _int64_array(shape), _int64_array(grid)
    # One thread count for both calls: the scratch size depends on it.
    threads = threads or lib.axl_num_cpus()
    scratch_bytes = lib.axl_read_shards_scratch_bytes(
        _CONVERT_DTYPES[src_dtype], ndim, c_shape, threads
    )
    if scratch_bytes < 0:
        _check_status(-scratch_bytes, f"read_shards scratch size for {shape} ({src_dtype})")
    scratch = torch.empty(scratch_bytes, dtype=torch.uint8)
    blocks, ptrs = _alloc_blocks(shape, grid, dtype)
    # The scratch, blocks and arrays stay referenced by this frame until the call returns.
    status = lib.axl_read_shards(
        os.fsencode(path_str), offset, _CONVERT_DTYPES[src_dtype], ndim, c_shape, c_grid, ptrs,
        _CONVERT_DTYPES[dtype], scratch.data_ptr(), scratch_bytes, threads, isa_code,
    )
    _check_status(
        status,
        f"read_shards {path_str} bytes [{offset}, {end}) {src_dtype} {shape} grid {grid} -> "
        f"{dtype} (isa={isa!r}, nthreads={threads})",
    )
    return blocks
