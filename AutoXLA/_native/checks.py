"""The argument checks every kernel shares, run before any pointer reaches C: plain tensors
(no subclass decides the pointer), CPU, layout, dtype, contiguity, alignment, storage that holds
every element, memory the process can read or write (/proc/self/maps), ints, thread counts and
ISA names. Each raises TypeError or ValueError with the fix."""

from __future__ import annotations

import bisect
import operator
from collections.abc import Sequence

import torch

from .cpu import _ISAS

# axl_dtype values (autoxla.h) of the dtypes axl_convert takes.
_CONVERT_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

# AXL_MAX_NDIM: most dims axl_scatter_shards / axl_read_shards take.
_MAX_NDIM = 8

_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1


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


def _check_dtype(name: str, dtype: object, dtypes=_CONVERT_DTYPES) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {type(dtype).__name__}")
    if dtype not in dtypes:
        raise ValueError(f"{name} is {dtype}; expected one of {_dtype_names(dtypes)}")
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


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    value = operator.index(value)
    if not minimum <= value <= _INT64_MAX:
        raise ValueError(f"{name}={value} is out of range; expected an int >= {minimum}")
    return value
