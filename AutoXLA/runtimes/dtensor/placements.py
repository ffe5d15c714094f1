"""A plan's partition spec as DTensor placements, and the check that a rank holds its planned block.

The plan names the axes each tensor dimension is split over ("data", "fsdp", "model"); a
DeviceMesh with those ``mesh_dim_names`` takes, per mesh dimension, ``Shard(d)`` where the spec
splits tensor dimension ``d`` over it and ``Replicate()`` where it splits none. A dimension split
over two axes is sharded over both, the first listed outermost, which is DTensor's nesting when
the axes are listed in the mesh's order (the only order our rules write; another order would need
``_StridedShard`` and is refused by name).
"""
from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ...sharding import hosts
from ...sharding.mesh import AXES


def axes_of(entry) -> tuple[str, ...]:
    return hosts._names(entry)


def placements_for(spec: tuple, axis_names: tuple[str, ...] = AXES) -> tuple:
    """One placement per mesh dimension for a tensor partitioned by ``spec``."""
    placements = [Replicate()] * len(axis_names)
    for dim, entry in enumerate(spec):
        names = axes_of(entry)
        order = [axis_names.index(a) for a in names]
        if order != sorted(order):
            raise NotImplementedError(
                f"partition spec {spec}: dimension {dim} is split over {names}, not in the mesh's "
                f"order {axis_names}; the dtensor runtime takes the axes in mesh order only")
        for a in names:
            placements[axis_names.index(a)] = Shard(dim)
    return tuple(placements)


def compute_placements(placements: tuple, axis_names: tuple[str, ...], keep: frozenset) -> tuple:
    """``placements`` with every mesh dimension not in ``keep`` gathered (Replicate): what a
    module computes with (its parameters whole over the batch axes, split over ``keep``)."""
    return tuple(p if name in keep else Replicate() for p, name in zip(placements, axis_names))


def local_block(shape: tuple, device_mesh, placements: tuple) -> tuple[tuple, tuple]:
    """(local shape, global offset) of this rank's piece, as DTensor lays it out."""
    local, offset = compute_local_shape_and_global_offset(tuple(shape), device_mesh, list(placements))
    return tuple(local), tuple(offset)


def planned_block(spec: tuple, mesh, shape: tuple, rank: int) -> tuple[tuple, tuple]:
    """(local shape, global offset) of ``rank``'s block under the plan's own layout
    (sharding/hosts.py, the layout the xla runtime's loader uses)."""
    box = hosts.block_box(shape, hosts.shard_grid(spec, mesh), hosts.device_blocks(spec, mesh)[rank])
    return tuple(hi - lo for lo, hi in box), tuple(lo for lo, _ in box)
