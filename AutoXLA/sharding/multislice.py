"""Meshes over several TPU slices: the slow data-center network (DCN) between slices, the fast
inter-chip interconnect (ICI) within each.

A strategy picks the mesh's axis sizes (mesh.py); with ``MultiSlice(slices=S)`` those sizes are
factored into a DCN part (S in all, on the axes ``dcn_axes`` allows, ``data`` first) and an ICI
part (the rest, within a slice), as MaxText and torchprime do: data parallelism talks once per
step, so it is the one axis that can afford DCN; the model axis talks in every layer and never
crosses it. On TPU the device order comes from torch_xla's ``HybridMesh`` (physical torus within
each slice); elsewhere, and in tests, ``device_order`` lays out slices of consecutive device ids,
the order torch_xla's ``HybridMesh`` gives slices whose devices are numbered slice by slice.
Pure Python, like mesh.py: ``autoxla plan`` uses it without devices.
"""
from __future__ import annotations

from dataclasses import dataclass

from .mesh import AXES, MeshShape

# Axes that may cross DCN, in the order slices are given to them. "model" never does.
DCN_AXES = ("data", "fsdp")


@dataclass(frozen=True)
class MultiSlice:
    """``slices`` TPU slices joined by DCN, and which mesh axes may span them (``data`` first)."""

    slices: int = 1
    dcn_axes: tuple[str, ...] = ("data",)

    def __post_init__(self):
        if isinstance(self.slices, bool) or not isinstance(self.slices, int) or self.slices < 1:
            raise ValueError(f"MultiSlice(slices={self.slices!r}): the number of TPU slices must "
                             "be a positive int (1 = one slice, no DCN)")
        axes = (self.dcn_axes,) if isinstance(self.dcn_axes, str) else tuple(self.dcn_axes)
        bad = [a for a in axes if a not in DCN_AXES]
        if bad or not axes or len(set(axes)) != len(axes):
            raise ValueError(
                f"MultiSlice(dcn_axes={self.dcn_axes!r}): only {DCN_AXES} may cross the "
                "data-center network, each once; the model axis communicates in every layer and "
                "must stay within a slice (ICI). Use dcn_axes=('data',) or ('data', 'fsdp')")
        object.__setattr__(self, "dcn_axes", axes)

    def split(self, mesh: MeshShape) -> tuple[MeshShape, MeshShape]:
        """(ICI shape, DCN shape) whose products per axis are ``mesh``: the slices go to the
        ``dcn_axes`` in order, each taking the largest part of the remaining slice count that
        divides its size. An error says how to fix a mesh the slices cannot divide."""
        sizes = dict(zip(AXES, mesh.sizes))
        dcn = dict.fromkeys(AXES, 1)
        left = self.slices
        for axis in self.dcn_axes:
            take = max(d for d in range(1, left + 1) if left % d == 0 and sizes[axis] % d == 0)
            dcn[axis], left = take, left // take
        if left != 1:
            allowed = " x ".join(f"{a}={sizes[a]}" for a in self.dcn_axes)
            raise ValueError(
                f"{self.slices} slices cannot split the mesh {mesh}: the axes allowed to cross "
                f"DCN ({allowed}) do not divide into {self.slices}. Use a strategy with a data "
                "axis of a multiple of the slice count (sharding_strategy='3d' or 'dp', or a "
                "mesh=), or allow fsdp across slices: MultiSlice(slices, dcn_axes=('data', "
                "'fsdp'))")
        dcn_shape = MeshShape(*(dcn[a] for a in AXES))
        ici_shape = MeshShape(*(sizes[a] // dcn[a] for a in AXES))
        return ici_shape, dcn_shape

    def links(self, mesh: MeshShape) -> str:
        """Which axis crosses which link, as the plan prints it."""
        if self.slices == 1:
            return ""
        ici, dcn = self.split(mesh)
        parts = []
        for axis, i, d in zip(AXES, ici.sizes, dcn.sizes):
            if i * d == 1:
                continue
            if d == 1:
                where = "ICI (within a slice)"
            elif i == 1:
                where = "DCN (across slices)"
            else:
                where = f"DCN x{d} across slices, ICI x{i} within each"
            parts.append(f"{axis}={i * d} over {where}")
        return f"{self.slices} slices: " + "; ".join(parts)


def device_order(ici: MeshShape, dcn: MeshShape) -> list[int]:
    """Device ids laid out on the (ici * dcn) mesh, row-major, when slice s holds the ids
    ``s * n .. (s + 1) * n - 1`` (n devices per slice) and devices within a slice are ordered
    row-major over the ICI shape: each slice is one contiguous ICI block of the mesh, and the
    slices tile it in the DCN shape's row-major order (torch_xla's ``HybridMesh`` without its
    physical-torus reordering, which needs TPU coordinates)."""
    import numpy as np

    per_slice = ici.num_devices
    blocks = np.arange(dcn.num_devices * per_slice).reshape(dcn.sizes + ici.sizes)
    # (d0, d1, d2, i0, i1, i2) -> (d0, i0, d1, i1, d2, i2): DCN index is the slow one per axis.
    mesh = blocks.transpose(0, 3, 1, 4, 2, 5).reshape(
        tuple(d * i for d, i in zip(dcn.sizes, ici.sizes)))
    return [int(x) for x in mesh.reshape(-1)]
