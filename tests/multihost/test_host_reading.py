"""Per-host reading, simulated in one process: for every strategy and P = 2 and 4 hosts of an
8-device mesh, each host reads only the byte ranges of its devices' shards, the hosts together
read the checkpoint, no range is read by two hosts unless both hold its shard, and every shard
equals the single-process load's. No XLA program runs: the plan and the device layout are all a
host needs to know what to read (sharding/hosts.py)."""
import math
import types

import numpy as np
import pytest
import torch

from AutoXLA import _native
from AutoXLA.loading import checkpoint as ckpt
from AutoXLA.loading import streaming
from AutoXLA.modeling.from_config import plan_from_config
from AutoXLA.sharding import hosts
from AutoXLA.sharding.hosts import Host
from AutoXLA.sharding.mesh import AXES, mesh_shape_for

DEVICES = 8
STRATEGIES = ("fsdp", "dp", "mp", "2d", "3d")


def _mesh(strategy):
    shape = mesh_shape_for(strategy, DEVICES)
    return types.SimpleNamespace(axis_names=AXES, mesh_shape=shape.sizes,
                                 device_ids=np.arange(DEVICES))


def _planned_records(path, strategy):
    """(plan entry, checkpoint record) of every tensor the loader reads from the files."""
    plan = plan_from_config(path, strategy, DEVICES, scan_layers=False)
    records = ckpt.locate(path).records
    return [(t, records[t.name]) for t in plan if not t.tied_to and t.name in records]


def _overlap(a, b) -> int:
    """Bytes two sorted lists of disjoint [begin, end) ranges share."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        total += max(0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


@pytest.fixture(scope="module")
def llama(checkpoints):
    return checkpoints["llama"]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("count", [2, 4])
def test_each_host_reads_its_own_shards(llama, strategy, count):
    mesh = _mesh(strategy)
    everyone = [Host.simulated_host(i, count, DEVICES) for i in range(count)]
    read = [0] * count
    total = split_over_hosts = 0
    for t, record in _planned_records(llama, strategy):
        dtype = getattr(torch, t.dtype)
        whole, _ = streaming.host_shards(record, t.spec, mesh, Host.single(DEVICES), dtype)
        grid = hosts.shard_grid(t.spec, mesh)
        block_bytes = record.nbytes // math.prod(grid)
        held = [hosts.host_blocks(t.spec, mesh, h) for h in everyone]
        ranges = [_native.block_ranges(record.dtype, record.shape, grid, b) for b in held]
        for i, host in enumerate(everyone):
            shards, n = streaming.host_shards(record, t.spec, mesh, host, dtype, gap_bytes=0)
            assert sorted(shards) == list(host.devices)
            for d, shard in shards.items():
                assert torch.equal(shard, whole[d]), (t.name, strategy, count, i, d)
            # Gap 0: exactly the bytes of the blocks the host's devices hold, each block once.
            assert n == len(held[i]) * block_bytes == sum(e - b for b, e in ranges[i]), t.name
            read[i] += n
            for j in range(i):    # two hosts share bytes only of blocks both hold
                common = len(set(held[i]) & set(held[j])) * block_bytes
                assert _overlap(ranges[i], ranges[j]) == common, (t.name, i, j)
        assert set().union(*held) == set(range(math.prod(grid)))   # together: the whole tensor
        total += record.nbytes
        if all(len(h) * count == math.prod(grid) for h in held):
            split_over_hosts += record.nbytes
    # Tensors split evenly over the hosts cost each host 1/P of their bytes; the rest (norms,
    # tensors split only within a host, or not at all) at most their whole size.
    for n in read:
        assert n <= split_over_hosts / count + (total - split_over_hosts), (n, total)
    # Under fsdp every weight is split over all devices, so over the hosts: 1/P each, plus a few
    # bytes of tensors too small to split. (Elsewhere the bound above is the claim: under mp the
    # tiny model's 2 key/value heads cannot split 8 ways and are read by every host; under dp and
    # 3d the hosts hold data-parallel replicas, each of which needs the weights.)
    if strategy == "fsdp":
        assert max(read) <= total / count * 1.02, (read, total)
    print(f"{strategy} P={count}: each host read {max(read) / total:.1%} of the checkpoint")


def test_what_a_host_reads_is_what_the_kernel_counts(llama):
    """/proc/self/io's rchar (bytes returned by this process's read and pread calls, all threads)
    around one host's reads agrees with the bytes the C core says it read."""
    mesh = _mesh("fsdp")
    host = Host.simulated_host(1, 4, DEVICES)
    planned = _planned_records(llama, "fsdp")
    streaming.host_shards(planned[0][1], planned[0][0].spec, mesh, host, torch.float32)   # warm
    before = _rchar()
    counted = sum(streaming.host_shards(r, t.spec, mesh, host, getattr(torch, t.dtype),
                                        gap_bytes=0)[1] for t, r in planned)
    measured = _rchar() - before
    # Slack: pytest and torch may read a few small files meanwhile (never 64 KiB in this window);
    # the checkpoint is ~4x that per host, so reading whole tensors would fail.
    assert counted <= measured <= counted + 64 * 1024, (counted, measured)
    assert counted < sum(r.nbytes for _, r in planned) / 3


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_the_simulated_host_setting_is_checked():
    assert Host.from_env(8, "1/4") == Host(1, 4, (2, 3), simulated=True)
    assert Host.from_env(8, "") is None
    for bad in ("4/4", "1/3", "x/2", "2"):
        with pytest.raises(ValueError, match="AUTOXLA_SIMULATE_HOST"):
            Host.from_env(8, bad)
