"""Cutting a tensor into the blocks of a device grid with the C core: from memory
(scatter_shards), from a file (read_shards), only some blocks from a file (read_blocks) and
the byte ranges those read (block_ranges); file_kind names what a path is when it is not a
regular file."""

from __future__ import annotations

import ctypes
import itertools
import math
import operator
import os
import stat

import torch

from .checks import (
    _CONVERT_DTYPES,
    _INT64_MAX,
    _MAX_NDIM,
    _check_cpu_tensor,
    _check_dtype,
    _check_host_memory,
    _check_int,
    _check_ints,
    _check_isa,
    _check_nthreads,
    _dtype_names,
)
from .library import NativeError, _check_status, _get_lib

# Quantized data (axl_dtype values): the shard functions copy these, same dtype in and out.
_INT_DTYPES = {torch.int8: 3, torch.uint8: 4}
_SHARD_DTYPES = {**_CONVERT_DTYPES, **_INT_DTYPES}

# Most blocks one scatter_shards / read_shards call cuts: a block per device of a mesh, and
# the largest meshes (a TPU v5p pod: 8960 chips) stay well below 2**16. Each block is a
# Python tensor (about 0.5 KB and a microsecond or two) plus 8 bytes in C, so 2**16 of them
# return in well under a second; without a bound, an empty tensor of shape (0, 10**12)
# "divides" into 10**12 empty blocks and the call never returns.
_MAX_BLOCKS = 2**16


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
