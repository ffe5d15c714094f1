"""One SPMD program really runs across 8 XLA:CPU devices in this process (docs/testing.md)."""
import os

import numpy as np
import pytest
import torch

from AutoXLA import backend
from AutoXLA.loading import streaming
from AutoXLA.sharding.mesh import MeshShape


def test_sharded_matmul_equals_unsharded(xla_devices):
    from torch_xla.distributed.spmd import XLAShardedTensor

    mesh = backend.make_mesh(MeshShape(1, 4, 2))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 32, generator=g), torch.randn(32, 24, generator=g)
    xa = backend.mark_sharding(a.to(backend.device()), mesh, ("fsdp", "model"))
    xb = backend.mark_sharding(b.to(backend.device()), mesh, ("model", None))
    c = xa @ xb
    backend.sync()
    # The input is really split: 8 tiles of 4 x 16, one per device.
    assert backend.sharding_spec(xa) == "{devices=[4,2]0,1,2,3,4,5,6,7}"
    shards = XLAShardedTensor(xa).local_shards
    assert len(shards) == 8 and {tuple(s.data.shape) for s in shards} == {(4, 16)}
    assert len({s.shard_device for s in shards}) == 8
    # fp32 matmul of 32 terms: sums reordered across the model-axis all-reduce, ~1e-6 apart.
    torch.testing.assert_close(c.cpu(), a @ b, atol=1e-5, rtol=1e-5)


def test_mark_sharding_does_not_retry_a_failed_jax_import_per_call(xla_devices):
    """torch_xla's mark_sharding imports torchax and jax on every call; without JAX each failed
    import ran torchax's package code again (backend._answer_missing_jax_at_once)."""
    import importlib.util
    import sys

    if sys.modules.get("jax") is not None:
        pytest.skip("JAX is installed in this process: the imports succeed and nothing changes")
    from torch_xla._internal import jax_workarounds

    executed = []
    finder = type("Spy", (), {"find_spec": staticmethod(
        lambda name, path=None, target=None: executed.append(name))})
    sys.meta_path.insert(0, finder)
    try:
        mesh = backend.make_mesh(MeshShape(1, 8, 1))
        backend.mark_sharding(torch.zeros(8, 4, device=backend.device()), mesh, ("fsdp", None))
        assert jax_workarounds.maybe_get_torchax() is None
        assert jax_workarounds.maybe_get_jax(log=False) is None
    finally:
        sys.meta_path.remove(finder)
    # Answered from sys.modules: no finder was asked for either package again.
    assert not [n for n in executed if n.split(".")[0] in ("jax", "torchax")], executed
    assert importlib.util.find_spec("jax") is None and importlib.util.find_spec("torchax") is None


# Specs with single axes, tuples of axes (row-major order matters) and replicated dims.
SPECS = [(("fsdp", "model"), (16, 8)), (("model", "fsdp"), (16, 8)), ((None, "fsdp"), (3, 8)),
         ((("data", "fsdp"), None), (8, 5)), ((("fsdp", "data"), "model"), (8, 6)),
         ((None, None), (5, 3)), (("model", None, "fsdp"), (2, 3, 4))]
MESHES = {"ordered": (np.arange(8), (2, 2, 2), ("data", "fsdp", "model")),
          "permuted": (np.array([3, 1, 7, 5, 0, 2, 6, 4]), (2, 2, 2), ("model", "data", "fsdp"))}


@pytest.mark.parametrize("spec,shape", SPECS, ids=str)
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_host_shards_land_where_mark_sharding_puts_them(spec, shape, mesh_name, xla_devices):
    """Our device -> shard mapping agrees with torch_xla's own mark_sharding, data included."""
    from torch_xla.distributed.spmd import Mesh, XLAShardedTensor

    ids, mesh_shape, names = MESHES[mesh_name]
    mesh = Mesh(ids, mesh_shape, names)
    t = torch.arange(float(np.prod(shape))).reshape(shape)
    ours = streaming.tensor_to_device(t, spec, mesh)
    theirs = backend.mark_sharding(t.to(backend.device()), mesh, spec)
    backend.sync()
    assert backend.sharding_spec(ours) == backend.sharding_spec(theirs)
    for a, b in zip(XLAShardedTensor(ours).local_shards, XLAShardedTensor(theirs).local_shards):
        assert a.shard_device == b.shard_device
        assert torch.equal(a.data, b.data), (spec, a.shard_device)
    assert torch.equal(ours.cpu(), t)


def _run(code):
    import subprocess
    import sys

    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8", "PYTHONPATH": os.getcwd()}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)


_CPU_BACKWARD = "a = torch.ones(3, requires_grad=True); (a * 2).sum().backward()\n"
_XLA_BACKWARD = ("x = torch.ones(3, device=backend.device(), requires_grad=True)\n"
                 "(x * 2).sum().backward(); print('xla backward ok')\n")


def test_a_cpu_backward_after_loading_does_not_break_xla_training():
    # autograd sizes its device queues at its first backward: AutoXLA runs that first backward on
    # XLA when it starts the runtime, so a later CPU backward cannot leave XLA without a queue.
    r = _run("import torch\nfrom AutoXLA import backend\nbackend.device()\n" + _CPU_BACKWARD
             + _XLA_BACKWARD)
    assert r.returncode == 0 and "xla backward ok" in r.stdout, r.stderr[-2000:]


def test_a_cpu_backward_before_loading_is_reported_in_words():
    r = _run("import torch\nfrom AutoXLA import backend\n" + _CPU_BACKWARD
             + "backend.device()\n")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "backward passes on XLA devices will fail in this process" in r.stderr
