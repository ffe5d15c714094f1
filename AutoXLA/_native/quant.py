"""Quantizing a 2-D weight to int8 / int4 with the C core (quantize, into a Quantized) and
back (dequantize), with their argument checks and the message that explains a refused row."""

from __future__ import annotations

import ctypes
import math
import operator
from typing import NamedTuple

import torch

from .checks import (
    _CONVERT_DTYPES,
    _check_cpu_tensor,
    _check_dtype,
    _check_host_memory,
    _check_int,
    _check_isa,
    _check_nthreads,
    _shares_memory,
)
from .library import NativeError, _QSpec, _check_status, _get_lib

# Dtypes quantization scales can be stored in (axl_quantize's scale_dtype).
_SCALE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

# axl_status values this module reacts to.
_AXL_ERR_NON_FINITE = 7

# axl_qscheme values.
_Q_SYMMETRIC, _Q_ZERO_POINT, _Q_OFFSET = 0, 1, 2
_AXL_ERR_BAD_VALUE = 13

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
