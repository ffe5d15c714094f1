"""The plan's mesh as a DeviceMesh: one process per device, ranks laid out row-major over the
("data", "fsdp", "model") axes, as sharding/hosts.py numbers the devices."""
from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ...sharding.mesh import AXES, MeshShape
from . import process


@dataclass(frozen=True)
class PlanMesh:
    """What the loader needs of a mesh (axis names, sizes, device ids: sharding/hosts.py) and the
    DeviceMesh DTensors live on."""

    shape: MeshShape
    device_mesh: DeviceMesh
    device_type: str

    axis_names = AXES

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        return self.shape.sizes

    @property
    def device_ids(self) -> list[int]:
        return list(range(self.shape.num_devices))

    def group(self, axis: str):
        return self.device_mesh.get_group(axis)

    def size(self, axis: str) -> int:
        return self.shape.size(axis)


# One DeviceMesh per shape and device type for the life of the process group: building one
# creates a process group per axis (a rendezvous of every process and, on gloo, a connection per
# pair), which a job loading several models, or one model twice, need not pay again.
_MESHES: dict[tuple, PlanMesh] = {}


def make_mesh(shape: MeshShape, device_type: str) -> PlanMesh:
    # keyed by the job's group too: a process group started again needs meshes of its own (the
    # cache keeps the old group alive, so its id is not reused)
    key = (shape.sizes, device_type, id(process.default_group()))
    if key not in _MESHES:
        _MESHES[key] = _new_mesh(shape, device_type)
    return _MESHES[key]


def _new_mesh(shape: MeshShape, device_type: str) -> PlanMesh:
    world = process.world_size()
    if shape.num_devices != world:
        raise ValueError(f"the plan's mesh {shape} has {shape.num_devices} devices but this job "
                         f"has {world} processes: start one process per device (torchrun "
                         f"--nproc-per-node {shape.num_devices}, or --nproc {shape.num_devices} on "
                         "the autoxla command line)")
    return PlanMesh(shape, init_device_mesh(device_type, shape.sizes, mesh_dim_names=AXES),
                    device_type)
