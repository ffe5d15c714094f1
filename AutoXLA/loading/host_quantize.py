"""Quantizing only what this host holds: the pieces of a float checkpoint weight whose quantized
shards the host's devices keep, read and quantized without the rest (docs/multihost.md).

Quantization is local: every scale, zero point and scale search covers one block of
``block_size`` consecutive elements of one row. So a piece of the weight quantizes to exactly the
corresponding piece of the whole weight's result when it is made of whole rows, or of whole
blocks of whole rows. Two ways to cut, the first that applies:

* **tiles**: the weight's own shard grid, when every quantized tensor (weight, scale, zero point)
  is split the same way and a tile's width is a whole number of quantization blocks (blockwise
  formats, e.g. int4 blocks of 32 on a 4096-wide weight split 4 ways). The host reads and
  quantizes exactly its tiles.
* **rows**: whole rows, in blocks of G rows, G the least common multiple of the tensors' row
  splits. Per-channel formats need the whole row for one scale, so a weight split by columns
  across hosts is read whole on each of them.
"""
from __future__ import annotations

import math
import types

import torch

from ..quantization.linear import stored_tensors
from ..sharding import hosts
from . import streaming


def host_quantized_shards(record, leaves: dict, fmt, mesh, host, quantize,
                          importance: torch.Tensor | None = None):
    """({leaf name: {device: shard}} for ``host``'s devices, bytes read, the statistics of what
    was quantized). ``leaves`` maps the quantized tensors' leaf names (weight, weight_scale, ...)
    to their plan entries; ``quantize(w, importance)`` runs the C engine on a piece."""
    tiles = _tile_grid(leaves, fmt, mesh)
    if tiles is not None:
        return _by_tiles(record, leaves, tiles, mesh, host, quantize, importance)
    return _by_rows(record, leaves, mesh, host, quantize, importance)


def _tile_grid(leaves: dict, fmt, mesh) -> tuple[int, int] | None:
    """The weight's (rows, columns) shard grid if every quantized tensor shares it and a tile's
    width holds whole quantization blocks (and whole int4 byte pairs), else None."""
    grids = {leaf: hosts.shard_grid(e.spec, mesh) for leaf, e in leaves.items()}
    grid = grids["weight"]
    width = fmt.in_features // grid[1]
    if any(g != grid for g in grids.values()) or grid[1] == 1:
        return None
    if fmt.per_channel or width % fmt.block_size or (fmt.bits == 4 and width % 2):
        return None
    return grid


def _by_tiles(record, leaves, grid, mesh, host, quantize, importance):
    of_device = hosts.device_blocks(leaves["weight"].spec, mesh)
    mine = hosts.host_blocks(leaves["weight"].spec, mesh, host)
    pieces, read = streaming.read_blocks(record, grid, mine, record.dtype)
    width = record.shape[1] // grid[1]
    out = {leaf: {} for leaf in leaves}
    results = []
    for k in mine:
        column = k % grid[1]
        part = None if importance is None else importance[column * width:(column + 1) * width]
        q = quantize(pieces.pop(k), part)
        results.append(q)
        for leaf, value in _stored(q).items():
            for d in host.devices:
                if of_device[d] == k:
                    out[leaf][d] = value
    return out, read, merged_stats(results)


def _by_rows(record, leaves, mesh, host, quantize, importance):
    rows = record.shape[0]
    splits = {leaf: hosts.shard_grid(e.spec, mesh)[0] for leaf, e in leaves.items()}
    g = math.lcm(*splits.values())        # divides ``rows``, as each split does
    wanted = set()
    for leaf, e in leaves.items():
        per = g // splits[leaf]
        of_device = hosts.device_blocks(e.spec, mesh)
        inner = math.prod(hosts.shard_grid(e.spec, mesh)[1:])
        for d in host.devices:
            r = of_device[d] // inner                   # the device's block along dim 0
            wanted.update(range(r * per, (r + 1) * per))
    order = sorted(wanted)
    grid = (g,) + (1,) * (len(record.shape) - 1)
    blocks, read = streaming.read_blocks(record, grid, order, record.dtype)
    w = torch.cat([blocks.pop(b) for b in order]) if len(order) > 1 else blocks.pop(order[0])
    step = rows // g
    local_row = {b * step: i * step for i, b in enumerate(order)}   # first row: where it is in w
    q = quantize(w, importance)
    del w
    out = {}
    for leaf, value in _stored(q).items():
        e = leaves[leaf]
        grid = hosts.shard_grid(e.spec, mesh)
        of_device = hosts.device_blocks(e.spec, mesh)
        height = e.shape[0] // grid[0]
        out[leaf] = {}
        for d in host.devices:
            b0, inner = divmod(of_device[d], math.prod(grid[1:]))
            start = local_row[b0 * height]     # a row block starts where a read block does
            block = value[start:start + height]
            out[leaf][d] = streaming.split_grid(block, (1,) + tuple(grid[1:]))[inner]
    return out, read, q


def _stored(q) -> dict[str, torch.Tensor]:
    return stored_tensors(q)


def merged_stats(results: list):
    """What the quantization report reads (per-row error and SQNR) of several tiles, as one."""
    if not results or results[0].max_err is None:
        return types.SimpleNamespace(max_err=None, sqnr_db=None)
    return types.SimpleNamespace(max_err=torch.cat([q.max_err.reshape(-1) for q in results]),
                                 sqnr_db=torch.cat([q.sqnr_db.reshape(-1) for q in results]))
