"""convert: a tensor converted between float32, bfloat16 and float16 by the C core."""

from __future__ import annotations

import torch

from .checks import (
    _CONVERT_DTYPES,
    _byte_range,
    _check_cpu_tensor,
    _check_host_memory,
    _check_isa,
    _check_nthreads,
    _dtype_names,
)
from .library import _check_status, _get_lib


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
