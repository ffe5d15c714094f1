"""Checkpoint tensor -> sharded XLA tensor, one tensor at a time.

The C core reads a tensor's bytes from its file, converts the dtype and cuts it into the shard
grid in one pass (``_native.read_shards``); the shards then go to their devices directly
(``backend.tensor_from_shards``). Host memory holds at most one tensor's shards at a time. On
several hosts each process reads only the blocks its devices hold (``host_shards``,
docs/multihost.md).
"""
from __future__ import annotations

import numpy as np
import torch

from .. import _native, backend
from ..sharding import hosts
from ..sharding.hosts import Host
from .checkpoint import TensorRecord

NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Quantized weights and zero points: the C core cuts them into shards as they are (no conversion).
NATIVE_COPY_DTYPES = (torch.int8, torch.uint8)
# A host reading part of a tensor reads across a gap between two of its byte ranges only when the
# gap is at most this. 0: exactly the bytes of its shards. A weight split by columns across hosts
# leaves one range per row (4 KiB of an 8 KiB bf16 row for a 4096-wide weight on 2 hosts), so a
# page-sized gap would read it whole; bench/host_read.py measures what the extra preads cost.
READ_GAP_BYTES = 0


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


def read_blocks(record: TensorRecord, grid: tuple[int, ...], blocks: list[int],
                dtype: torch.dtype, gap_bytes: int = READ_GAP_BYTES,
                nthreads: int = 0) -> tuple[dict[int, torch.Tensor], int]:
    """Only the grid ``blocks`` of the tensor, read from the byte ranges that hold them (the C
    core coalesces ranges less than ``gap_bytes`` apart into one pread); and the bytes read."""
    if _native_path(record.dtype, dtype) and record.shape:
        return _native.read_blocks(record.path, record.offset, record.dtype, record.shape, grid,
                                   dtype, blocks, gap_bytes=gap_bytes, nthreads=nthreads)
    # The torch path reads the whole tensor (small buffers and masks, in rare dtypes).
    every = split_grid(read_whole(record).to(dtype), grid)
    return {b: every[b] for b in blocks}, record.nbytes


def host_shards(record: TensorRecord, spec: tuple, mesh, host: Host, dtype: torch.dtype,
                gap_bytes: int = READ_GAP_BYTES) -> tuple[dict[int, torch.Tensor], int]:
    """device -> its shard, for the devices ``host`` addresses, read from the checkpoint; and the
    bytes read. A single host reads every block; one of several reads only its own, each once
    (devices that hold the same block share its tensor)."""
    grid = hosts.shard_grid(spec, mesh)
    of_device = hosts.device_blocks(spec, mesh)
    if host.is_everything:
        every = shard_grid_tensors(record, grid, dtype)
        return {d: every[b] for d, b in enumerate(of_device)}, record.nbytes
    blocks, read = read_blocks(record, grid, hosts.host_blocks(spec, mesh, host), dtype, gap_bytes)
    return {d: blocks[of_device[d]] for d in host.devices}, read


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


def to_device(shards: dict[int, torch.Tensor], spec: tuple, mesh, shape,
              host: Host | None = None, runtime=None) -> torch.Tensor:
    """A sharded tensor from ``host``'s shards (device -> shard), built by ``runtime``
    (runtimes/: an XLA tensor by default, a DTensor on the dtensor runtime)."""
    return (runtime or backend).tensor_from_shards(shards, spec, mesh, shape, host)


def split_for_host(t: torch.Tensor, spec: tuple, mesh, host: Host | None = None,
                   dtype: torch.dtype | None = None, nthreads: int = 0) -> dict[int, torch.Tensor]:
    """device -> shard of an in-memory tensor, for the devices ``host`` addresses (all: None)."""
    grid = hosts.shard_grid(spec, mesh)
    dtype = dtype or t.dtype
    if _native_path(t.dtype, dtype) and t.dim() > 0:
        every = _native.scatter_shards(t.contiguous(), grid, dtype, nthreads=nthreads)
    else:
        every = split_grid(t.to(dtype), grid)
    of_device = hosts.device_blocks(spec, mesh)
    devices = range(len(of_device)) if host is None else host.devices
    return {d: every[of_device[d]] for d in devices}


def tensor_to_device(t: torch.Tensor, spec: tuple, mesh, dtype: torch.dtype | None = None,
                     host: Host | None = None, nthreads: int = 0, runtime=None) -> torch.Tensor:
    """An in-memory host tensor (buffers, pickle weights, from_model) to a sharded tensor."""
    return to_device(split_for_host(t, spec, mesh, host, dtype, nthreads), spec, mesh,
                     tuple(t.shape), host, runtime)
