"""Checkpoint tensor -> sharded XLA tensor, one tensor at a time.

The C core reads a tensor's bytes from its file, converts the dtype and cuts it into the shard
grid in one pass (``_native.read_shards``); the shards then go to their devices directly
(``backend.tensor_from_shards``). Host memory holds at most one tensor's shards at a time.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .. import _native, backend
from .checkpoint import TensorRecord

NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Quantized weights and zero points: the C core cuts them into shards as they are (no conversion).
NATIVE_COPY_DTYPES = (torch.int8, torch.uint8)


def _native_path(src: torch.dtype, dst: torch.dtype) -> bool:
    return (src in NATIVE_DTYPES and dst in NATIVE_DTYPES) or (src == dst and src in NATIVE_COPY_DTYPES)


def shard_grid_tensors(record: TensorRecord, grid: tuple[int, ...], dtype: torch.dtype,
                       nthreads: int = 0) -> list[torch.Tensor]:
    """The tensor's shards in row-major grid order, each contiguous and of ``dtype``."""
    if _native_path(record.dtype, dtype) and record.shape:
        return _native.read_shards(record.path, record.offset, record.dtype, record.shape, grid,
                                   dtype, nthreads=nthreads)
    # Other integer, bool and float64 tensors (rare, small: buffers, masks) take the torch path.
    return split_grid(read_whole(record).to(dtype), grid)


def read_whole(record: TensorRecord) -> torch.Tensor:
    """The whole tensor, copied out of its file (for the few tensors the C path does not take)."""
    raw = np.fromfile(record.path, dtype=np.uint8, count=record.nbytes, offset=record.offset)
    return torch.from_numpy(raw).view(record.dtype).reshape(record.shape)


def split_grid(t: torch.Tensor, grid: tuple[int, ...]) -> list[torch.Tensor]:
    """Row-major grid of contiguous blocks of ``t`` (the reference for the C core's layout)."""
    blocks = [t]
    for dim, parts in enumerate(grid):
        if parts > 1:
            blocks = [piece for b in blocks for piece in b.chunk(parts, dim)]
    return [b.contiguous() for b in blocks]


def to_device(grid_shards: list[torch.Tensor], spec: tuple, mesh, shape) -> torch.Tensor:
    """A sharded XLA tensor from grid-ordered host shards."""
    grid = backend.shard_grid(spec, mesh)
    coords = backend.device_shard_coords(spec, mesh)
    strides = [math.prod(grid[d + 1:]) for d in range(len(grid))]
    per_device = [grid_shards[sum(c * s for c, s in zip(coord, strides))] for coord in coords]
    return backend.tensor_from_shards(per_device, spec, mesh, shape)


def tensor_to_device(t: torch.Tensor, spec: tuple, mesh, dtype: torch.dtype | None = None,
                     nthreads: int = 0) -> torch.Tensor:
    """An in-memory host tensor (buffers, pickle weights, from_model) to a sharded XLA tensor."""
    grid = backend.shard_grid(spec, mesh)
    dtype = dtype or t.dtype
    if _native_path(t.dtype, dtype) and t.dim() > 0:
        shards = _native.scatter_shards(t.contiguous(), grid, dtype, nthreads=nthreads)
    else:
        shards = split_grid(t.to(dtype), grid)
    return to_device(shards, spec, mesh, tuple(t.shape))
