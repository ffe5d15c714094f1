"""Strategies -> mesh shapes, and user mesh validation (pure Python, no devices)."""
import pytest

from AutoXLA.sharding.mesh import MeshShape, mesh_shape_for, normalize_strategy, validate_mesh_axes


@pytest.mark.parametrize("n,strategy,expected", [
    (8, "fsdp", (1, 8, 1)), (8, "dp", (8, 1, 1)), (8, "mp", (1, 1, 8)),
    (8, "2d", (1, 4, 2)), (8, "3d", (2, 2, 2)),
    (16, "2d", (1, 4, 4)), (16, "3d", (2, 4, 2)), (32, "3d", (4, 4, 2)),
    (6, "2d", (1, 3, 2)), (7, "2d", (1, 7, 1)), (7, "3d", (1, 7, 1)), (1, "3d", (1, 1, 1)),
    (256, "2d", (1, 16, 16)), (256, "3d", (8, 8, 4)),
])
def test_factorisation_rule(n, strategy, expected):
    shape = mesh_shape_for(strategy, n)
    assert shape.sizes == expected and shape.num_devices == n


@pytest.mark.parametrize("n", range(1, 65))
@pytest.mark.parametrize("strategy", ["fsdp", "dp", "mp", "2d", "3d"])
def test_every_device_count_works(n, strategy):
    shape = mesh_shape_for(strategy, n)
    assert shape.num_devices == n
    if strategy == "3d":
        assert shape.data <= shape.fsdp and shape.model ** 3 <= n
    if strategy == "2d":
        assert shape.model <= shape.fsdp


@pytest.mark.parametrize("alias,name", [("FSDP", "fsdp"), ("data_parallel", "dp"), ("DP", "dp"),
                                        ("Model_Parallel", "mp"), ("2D", "2d"), (" 3d ", "3d")])
def test_aliases(alias, name):
    assert normalize_strategy(alias) == name


@pytest.mark.parametrize("bad", ["tp", "", None, 3, "fsdp2"])
def test_unknown_strategy_lists_valid_ones(bad):
    with pytest.raises(ValueError, match=r"use one of .*2d.*3d.*data_parallel.*dp.*fsdp"):
        normalize_strategy(bad)


def test_user_mesh_validation():
    assert validate_mesh_axes(("model", "fsdp", "data"), (2, 4, 1), 8) == MeshShape(1, 4, 2)
    # A subset of the axes (the original AutoXLA's meshes): the missing ones have size 1.
    assert validate_mesh_axes(("data", "fsdp"), (2, 4), 8) == MeshShape(2, 4, 1)
    assert validate_mesh_axes(("data",), (8,), 8) == MeshShape(8, 1, 1)
    with pytest.raises(ValueError, match=r"2 dimensions \(2, 4\) but 1 axis names"):
        validate_mesh_axes(("data",), (2, 4), 8)
    with pytest.raises(ValueError, match=r"covers 4 devices but the runtime has 8"):
        validate_mesh_axes(("data", "fsdp", "model"), (1, 2, 2), 8)
    with pytest.raises(ValueError, match=r"unknown axes \['pipe'\]"):
        validate_mesh_axes(("data", "fsdp", "model", "pipe"), (1, 2, 2, 2), 8)


def test_canonical_device_ids_keep_every_devices_coordinates():
    import numpy as np

    from AutoXLA.sharding.mesh import canonical_device_ids

    ids = np.random.default_rng(0).permutation(8)
    user = ids.reshape(2, 4)                      # axes ("model", "fsdp")
    canonical = np.asarray(canonical_device_ids(ids, (2, 4), ("model", "fsdp"))).reshape(1, 4, 2)
    for m in range(2):
        for f in range(4):
            assert canonical[0, f, m] == user[m, f]
