"""The plan's mesh as a DeviceMesh: one process per device, ranks laid out row-major over the
("data", "fsdp", "model") axes, as sharding/hosts.py numbers the devices."""
from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ...sharding.mesh import AXES, MeshShape, canonical_device_ids, validate_mesh_axes
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


def adopt_device_mesh(mesh, device_type: str) -> tuple[MeshShape, PlanMesh]:
    """A user's ``mesh=`` on this runtime: a DeviceMesh over the job's processes whose
    ``mesh_dim_names`` are some of ("data", "fsdp", "model") (the original AutoXLA's
    ``("fsdp", "model")`` works; a missing axis has size 1). Used as it is when it names all
    three in that order; otherwise replaced by the three-axis mesh that keeps every rank at its
    coordinates. Its ranks must be laid out as the plan numbers devices (row-major over the
    axes), which ``init_device_mesh`` does."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh= on runtime='dtensor' takes a torch.distributed DeviceMesh, got "
                        f"{type(mesh).__name__}: e.g. init_device_mesh('{device_type}', (2, 4), "
                        "mesh_dim_names=('fsdp', 'model')), or pass sharding_strategy=")
    if mesh.device_type != device_type:
        raise ValueError(f"mesh= is a {mesh.device_type!r} DeviceMesh but this job computes on "
                         f"{device_type!r} ($AUTOXLA_DEVICE_TYPE): build the mesh on {device_type!r}")
    names = tuple(mesh.mesh_dim_names or ())
    sizes = tuple(mesh.mesh.shape)
    world = process.world_size()
    shape = validate_mesh_axes(names, sizes, world, example=f"init_device_mesh('{device_type}', "
                               f"(1, {world}, 1), mesh_dim_names={AXES})")
    ids = canonical_device_ids(mesh.mesh.flatten().tolist(), sizes, names)
    if list(ids) != list(range(shape.num_devices)):
        raise ValueError(f"mesh= lays its ranks out as {mesh.mesh.tolist()} over {names}; the "
                         "dtensor runtime needs them in row-major order over (data, fsdp, model), "
                         "as init_device_mesh lays them: build it with init_device_mesh")
    if names == AXES:
        return shape, PlanMesh(shape, mesh, device_type)
    return shape, make_mesh(shape, device_type)
