"""Which devices this process owns, and so which shards of each tensor it must build.

On a multi-host slice every host runs the same program but addresses only its own chips; it must
build host shards for those devices only, from the bytes of the checkpoint those shards hold
(docs/multihost.md). This module is pure Python: it needs the mesh's layout (device ids and axis
sizes), never the devices, so the reading plan can be checked without torch_xla.

A ``Host`` is the process's view: its index among ``count`` processes and the global ids of the
devices it addresses. ``backend.current_host()`` builds it from torch_xla's runtime, or, for tests
on one machine, from ``AUTOXLA_SIMULATE_HOST=i/P`` (the devices split into P equal, contiguous
groups, as TPU hosts own consecutive device ids).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

SIMULATE_ENV = "AUTOXLA_SIMULATE_HOST"


def available_memory() -> int | None:
    """Bytes of this machine's memory available now (the kernel's MemAvailable), or None where
    /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


@dataclass(frozen=True)
class Host:
    """This process among all the processes of a job, and the devices it addresses."""

    index: int
    count: int
    devices: tuple[int, ...]      # global device ids, in the order the runtime lists them
    simulated: bool = False       # one process standing in for host ``index`` (tests, docs)

    @property
    def is_everything(self) -> bool:
        """One process addressing every device: the single-host case, nothing to skip."""
        return self.count == 1 and not self.simulated

    @classmethod
    def single(cls, num_devices: int) -> "Host":
        return cls(0, 1, tuple(range(num_devices)))

    @classmethod
    def simulated_host(cls, index: int, count: int, num_devices: int) -> "Host":
        """Host ``index`` of ``count`` equal hosts owning consecutive device ids."""
        if count < 1 or num_devices % count:
            raise ValueError(f"{count} simulated hosts cannot split {num_devices} devices evenly; "
                             f"use a count that divides {num_devices}")
        if not 0 <= index < count:
            raise ValueError(f"simulated host {index} is not one of 0..{count - 1}")
        per = num_devices // count
        return cls(index, count, tuple(range(index * per, (index + 1) * per)), simulated=True)

    @classmethod
    def from_env(cls, num_devices: int, value: str | None = None) -> "Host | None":
        """The simulated host ``AUTOXLA_SIMULATE_HOST=i/P`` asks for, or None when unset."""
        value = os.environ.get(SIMULATE_ENV) if value is None else value
        if not value:
            return None
        index, _, count = value.partition("/")
        try:
            return cls.simulated_host(int(index), int(count), num_devices)
        except ValueError as e:
            raise ValueError(f"{SIMULATE_ENV}={value!r}: {e}; write it as INDEX/COUNT, e.g. 1/4 "
                             f"for the second of 4 hosts") from None


def shard_grid(spec: tuple, mesh) -> tuple[int, ...]:
    """Shards per tensor dimension under ``spec`` on ``mesh`` (any object with ``axis_names`` and
    ``mesh_shape``, such as torch_xla's Mesh)."""
    sizes = dict(zip(mesh.axis_names, mesh.mesh_shape))
    return tuple(math.prod(sizes[a] for a in _names(axes)) for axes in spec)


def device_blocks(spec: tuple, mesh) -> list[int]:
    """For device 0..N-1, the index (row-major over ``shard_grid``) of the block it holds.

    A dimension split over several axes (a tuple) is indexed row-major in the order listed, the
    way XLA's tile assignment lays it out; tests check this against mark_sharding.
    """
    import numpy as np

    sizes = dict(zip(mesh.axis_names, mesh.mesh_shape))
    grid = shard_grid(spec, mesh)
    layout = np.asarray(mesh.device_ids).reshape(tuple(mesh.mesh_shape))
    blocks = [0] * layout.size
    for position in np.ndindex(*layout.shape):
        at = dict(zip(mesh.axis_names, position))
        block = 0
        for parts, axes in zip(grid, spec):
            i = 0
            for a in _names(axes):
                i = i * sizes[a] + at[a]
            block = block * parts + i
        blocks[int(layout[position])] = block
    return blocks


def block_box(shape, grid, block: int) -> list[tuple[int, int]]:
    """[start, stop) per dim of grid block ``block`` (row-major, as ``device_blocks`` numbers
    them) of a tensor of ``shape``."""
    coords = []
    for parts in reversed(grid):
        coords.append(block % parts)
        block //= parts
    coords.reverse()
    return [(c * (n // parts), (c + 1) * (n // parts)) for c, n, parts in zip(coords, shape, grid)]


def host_blocks(spec: tuple, mesh, host: Host) -> list[int]:
    """The blocks ``host``'s devices hold, each once, ascending: what the host reads. Blocks its
    devices share (a replicated dimension) are read once per host."""
    blocks = device_blocks(spec, mesh)
    return sorted({blocks[d] for d in host.devices})


def _names(axes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)
