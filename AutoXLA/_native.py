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
import threading
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
]

# Must equal AXL_ABI_VERSION in csrc/include/autoxla.h.
ABI_VERSION = 1

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

_INT32_MAX = 2**31 - 1
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

    version = lib.axl_abi_version()
    if version != ABI_VERSION:
        raise NativeLibraryError(
            f"AutoXLA's C core {path} has ABI version {version}, this AutoXLA needs "
            f"{ABI_VERSION}; {_REBUILD}."
        )
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
