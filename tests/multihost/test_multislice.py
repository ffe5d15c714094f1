"""Meshes over several slices: the DCN/ICI split, the device order against torch_xla's own
HybridMesh, and the mesh the loader builds with multislice=."""
import numpy as np
import pytest

from AutoXLA.sharding.mesh import AXES, MeshShape, mesh_shape_for
from AutoXLA.sharding.multislice import MultiSlice, device_order


def _torch_xla_hybrid_order(ici: MeshShape, dcn: MeshShape) -> list[int]:
    """torch_xla's HybridMesh._create_hybrid_device_mesh on devices numbered slice by slice.

    Its per-slice step reorders devices by their physical TPU coordinates, which XLA:CPU devices
    do not have; it is replaced by the row-major order such coordinates give a slice whose devices
    are numbered along the torus. The grouping of slices into the DCN mesh is torch_xla's own."""
    from torch_xla.distributed.spmd import HybridMesh

    per = ici.num_devices
    mesh = object.__new__(HybridMesh)
    mesh.device_attributes = [{"name": f"TPU:{i}", "slice_index": i // per}
                              for i in range(per * dcn.num_devices)]
    mesh._create_device_mesh = lambda shape, devices: np.asarray(devices).reshape(shape)
    return [int(x) for x in mesh._create_hybrid_device_mesh(ici.sizes, dcn.sizes).reshape(-1)]


@pytest.mark.parametrize("slices,strategy,axes,devices", [
    (2, "3d", ("data",), 8), (2, "dp", ("data",), 8), (4, "dp", ("data",), 8),
    (2, "fsdp", ("data", "fsdp"), 8), (4, "2d", ("data", "fsdp"), 16),
    (2, "3d", ("data", "fsdp"), 32), (8, "3d", ("data", "fsdp"), 64), (2, "3d", ("fsdp",), 8),
    (4, "3d", ("data", "fsdp"), 16)])
def test_device_order_is_torch_xlas_hybrid_mesh(slices, strategy, axes, devices):
    shape = mesh_shape_for(strategy, devices)
    ici, dcn = MultiSlice(slices, axes).split(shape)
    assert [i * d for i, d in zip(ici.sizes, dcn.sizes)] == list(shape.sizes)
    assert dcn.num_devices == slices and dcn.model == 1
    order = device_order(ici, dcn)
    assert order == _torch_xla_hybrid_order(ici, dcn)
    # What the split is for: moving along a DCN-only axis changes slice, along ICI it never does.
    layout = np.asarray(order).reshape(shape.sizes)
    per = ici.num_devices
    for axis, i in enumerate(ici.sizes):
        moved = np.roll(layout, 1, axis=axis) // per != layout // per
        if dcn.sizes[axis] == 1:
            assert not moved.any(), f"{AXES[axis]} crosses slices but is ICI only"
        elif i == 1:
            assert moved.all(), f"{AXES[axis]} should cross slices at every step"


def test_slices_go_to_data_first_then_fsdp():
    shape = MeshShape(2, 4, 2)
    assert MultiSlice(2).split(shape) == (MeshShape(1, 4, 2), MeshShape(2, 1, 1))
    assert MultiSlice(4, ("data", "fsdp")).split(shape) == (MeshShape(1, 2, 2), MeshShape(2, 2, 1))
    assert "data=2 over DCN (across slices); fsdp=4 over ICI (within a slice); model=2 over ICI" \
        in MultiSlice(2).links(shape)


@pytest.mark.parametrize("kwargs,match", [
    ({"slices": 0}, "positive int"), ({"slices": True}, "positive int"),
    ({"slices": 2, "dcn_axes": ("model",)}, "model axis"),
    ({"slices": 2, "dcn_axes": ("data", "data")}, "each once"),
    ({"slices": 2, "dcn_axes": ()}, "only")])
def test_bad_multislice_is_one_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiSlice(**kwargs)


def test_slices_that_do_not_divide_the_mesh_say_how_to_fix_it():
    with pytest.raises(ValueError, match=r"dcn_axes=\('data', 'fsdp'\)"):
        MultiSlice(2).split(mesh_shape_for("fsdp", 8))      # data=1: nowhere to put 2 slices
    with pytest.raises(ValueError, match="do not divide"):
        MultiSlice(3, ("data", "fsdp")).split(mesh_shape_for("3d", 8))


def test_from_pretrained_builds_the_hybrid_mesh(checkpoints, xla_devices):
    """2 slices across fsdp on 3d: the loaded model's mesh is the hybrid order, the plan says
    which axis crosses DCN, and the model computes what the single-slice load computes. (Slices
    across data only, the usual choice, give the plain order: data is the mesh's slowest axis.)"""
    import torch

    from AutoXLA import backend
    from AutoXLA.modeling import AutoXLAModelForCausalLM
    from AutoXLA.sharding import MultiSlice as Public

    ids = torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(1))
    plain = AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], sharding_strategy="3d")
    with torch.no_grad():
        want = plain(input_ids=ids.to(backend.device())).logits.cpu()
    model = AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], sharding_strategy="3d",
                                                    multislice=Public(2, ("fsdp",)))
    ici, dcn = Public(2, ("fsdp",)).split(mesh_shape_for("3d", 8))
    assert [int(i) for i in model.autoxla_mesh.device_ids] == device_order(ici, dcn)
    assert device_order(ici, dcn) != list(range(8))     # the order really differs
    assert any(n.startswith("links: 2 slices: data=2 over ICI (within a slice); fsdp=2 over DCN") for n in model.autoxla_plan.notes)
    with torch.no_grad():
        got = model(input_ids=ids.to(backend.device())).logits.cpu()
    # The same program on a permuted device order: same arithmetic, so the same numbers up to
    # the order of the cross-device sums (~1e-6 on logits of magnitude ~1).
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_autoxla_plan_says_which_axis_crosses_which_link(checkpoints, capsys):
    from AutoXLA import cli

    path = str(checkpoints["llama"])
    assert cli.main(["plan", path, "--strategy", "3d", "--devices", "16", "--slices", "2"]) == 0
    assert ("note: links: 2 slices: data=2 over DCN (across slices); fsdp=4 over ICI (within a "
            "slice); model=2 over ICI (within a slice)") in capsys.readouterr().out
    assert cli.main(["plan", path, "--slices", "2"]) == 2          # fsdp: data=1, nowhere to go
    assert "dcn_axes=('data', 'fsdp')" in capsys.readouterr().err
    assert cli.main(["plan", path, "--slices", "2", "--dcn-axes", "data,fsdp"]) == 0
    assert "fsdp=8 over DCN x2 across slices, ICI x4 within each" in capsys.readouterr().out
