"""Hub-layout mixture-of-experts checkpoints (one tensor per expert) streamed into transformers 5's
fused expert parameters (loading/converted.py): every device's shard equals the fused tensor
transformers itself builds, a host of several reads only its own experts, and a checkpoint that
misses an expert is refused by name. No XLA program runs: the plan and the device layout say
what each device holds."""
import functools
import json
import types

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from AutoXLA.testing.architectures import save_checkpoint
from AutoXLA.loading import checkpoint as ckpt
from AutoXLA.loading import streaming
from AutoXLA.loading.converted import compose
from AutoXLA.modeling.from_config import plan_from_config
from AutoXLA.sharding import hosts
from AutoXLA.sharding.hosts import Host
from AutoXLA.sharding.mesh import AXES, mesh_shape_for

DEVICES = 8


def _mesh(strategy):
    shape = mesh_shape_for(strategy, DEVICES)
    return types.SimpleNamespace(axis_names=AXES, mesh_shape=shape.sizes,
                                 device_ids=np.arange(DEVICES))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {name: save_checkpoint(name, root / name, seed=3) for name in ("Mixtral", "Qwen2-MoE")}


def _composites(path, strategy):
    from transformers import AutoModelForCausalLM

    from transformers import AutoConfig

    from AutoXLA.modeling.pipeline import empty_model

    plan = plan_from_config(path, strategy, DEVICES, scan_layers=False)
    checkpoint = ckpt.locate(path)
    resolved = empty_model(AutoConfig.from_pretrained(path), AutoModelForCausalLM)
    names, converted = ckpt.renamed_keys(resolved.model, checkpoint.records)
    renamings, converters = ckpt.weight_conversions(resolved.model)
    composites, unsupported = compose(resolved.model, converted, converters, renamings,
                                      {t.name: t.shape for t in plan})
    assert not unsupported
    return plan, checkpoint, composites


@functools.cache
def _fused_reference(path) -> dict[str, torch.Tensor]:
    """transformers' own parameters of the checkpoint (its converters fuse the experts)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("strategy", ["fsdp", "2d", "3d", "mp", "dp"])
@pytest.mark.parametrize("name", ["Mixtral", "Qwen2-MoE"])
def test_every_shard_is_transformers_fused_tensor(name, strategy, moe):
    plan, checkpoint, composites = _composites(moe[name], strategy)
    reference = _fused_reference(moe[name])
    assert {n.rsplit(".", 1)[-1] for n in composites} == {"gate_up_proj", "down_proj"}
    mesh, host = _mesh(strategy), Host.single(DEVICES)
    for target, composite in composites.items():
        spec = plan[target].spec
        shards, read = composite.host_shards(checkpoint.records, spec, mesh, host, torch.float32)
        assert read == sum(checkpoint.records[p.key].nbytes for p in composite.pieces)
        want = streaming.split_grid(reference[target], hosts.shard_grid(spec, mesh))
        for device, block in enumerate(hosts.device_blocks(spec, mesh)):
            assert torch.equal(shards[device], want[block]), f"{target} on device {device}"


def test_a_host_reads_only_its_experts(moe):
    plan, checkpoint, composites = _composites(moe["Mixtral"], "fsdp")
    mesh = _mesh("fsdp")
    for target, composite in composites.items():
        whole = sum(checkpoint.records[p.key].nbytes for p in composite.pieces)
        for i in range(2):
            host = Host.simulated_host(i, 2, DEVICES)
            shards, read = composite.host_shards(checkpoint.records, plan[target].spec, mesh, host,
                                                 torch.float32)
            assert set(shards) == set(host.devices)
            assert read == whole // 2     # 8 experts over fsdp=8: 4 devices, 4 experts per host


@pytest.mark.parametrize("strategy", ["2d", "3d", "mp"])
def test_one_device_reads_only_its_block_of_each_expert(strategy, moe):
    # One process per device (the dtensor runtime; a host of one device): a piece split over
    # "model" is read only where this device's shard overlaps it, so the bytes read are the
    # shard's own, not whole experts'
    plan, checkpoint, composites = _composites(moe["Mixtral"], strategy)
    reference = _fused_reference(moe["Mixtral"])
    mesh = _mesh(strategy)
    for target, composite in composites.items():
        spec = plan[target].spec
        itemsize = checkpoint.records[composite.pieces[0].key].dtype.itemsize
        want = streaming.split_grid(reference[target], hosts.shard_grid(spec, mesh))
        for device, block in enumerate(hosts.device_blocks(spec, mesh)):
            host = Host(device, DEVICES, (device,))
            shards, read = composite.host_shards(checkpoint.records, spec, mesh, host, torch.float32)
            assert torch.equal(shards[device], want[block]), f"{target} on device {device}"
            assert read == want[block].numel() * itemsize, f"{target} on device {device}"


def test_a_missing_expert_is_refused_by_name(moe, tmp_path, xla_devices):
    import shutil

    from AutoXLA.modeling import AutoXLAModelForCausalLM

    path = tmp_path / "broken"
    shutil.copytree(moe["Mixtral"], path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    key = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
    file = path / index["weight_map"].pop(key)
    tensors = load_file(file)
    del tensors[key]
    save_file(tensors, file, metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ckpt.CheckpointError, match="experts are missing"):
        AutoXLAModelForCausalLM.from_pretrained(path, sharding_strategy="2d")


@pytest.mark.parametrize("host_index", [0, 1])
def test_quantized_pieces_are_the_fused_tensor_quantized(host_index, moe):
    # do_quant on a hub-layout checkpoint: each expert's tensor is quantized alone by the C engine
    # and placed in the int4 weight's and the scales' shards (modeling/pipeline.py
    # _quantized_pieces). Every row is quantized on its own, so each shard must equal the shard
    # of transformers' fused tensor quantized whole, on either host of two (half the experts).
    from transformers import AutoConfig, AutoModelForCausalLM

    from AutoXLA.modeling.pipeline import empty_model
    from AutoXLA.quantization import QuantizationConfig
    from AutoXLA.quantization.linear import stored_tensors
    from AutoXLA.quantization.weights import quantize_tensor

    path, cfg = moe["Mixtral"], QuantizationConfig(bits=4, block_size=32)
    plan = plan_from_config(path, "2d", DEVICES, quantization_config=cfg, scan_layers=False)
    checkpoint = ckpt.locate(path)
    resolved = empty_model(AutoConfig.from_pretrained(path), AutoModelForCausalLM)
    _, converted = ckpt.renamed_keys(resolved.model, checkpoint.records)
    renamings, converters = ckpt.weight_conversions(resolved.model)
    composites, _ = compose(resolved.model, converted, converters, renamings,
                            {t.source_name: t.source_shape for t in plan if t.source_name})
    assert len(composites) == 4       # gate_up_proj and down_proj of 2 layers
    reference = dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
                     .named_parameters())
    mesh, host = _mesh("2d"), Host.simulated_host(host_index, 2, DEVICES)
    for target, composite in composites.items():
        leaves = {leaf: plan[f"{target}.{leaf}"] for leaf in ("weight", "weight_scale")}
        fmt = cfg.layer_format(target, *reversed(reference[target].shape[1:]))
        targets = {leaf: (e.spec, e.shape, getattr(torch, e.dtype)) for leaf, e in leaves.items()}
        shards, read = composite.assemble(
            checkpoint.records, targets, mesh, host,
            lambda r, wanted: (stored_tensors(quantize_tensor(streaming.read_whole(r), fmt)),
                               [(0, 1)] + [(0, n) for n in r.shape], r.nbytes))
        assert read == sum(checkpoint.records[p.key].nbytes for p in composite.pieces) // 2
        fused = reference[target].detach()
        whole = stored_tensors(quantize_tensor(fused.reshape(-1, fused.shape[-1]), fmt))
        for leaf, e in leaves.items():
            want = streaming.split_grid(whole[leaf].reshape(e.shape), hosts.shard_grid(e.spec, mesh))
            blocks = hosts.device_blocks(e.spec, mesh)
            for device in host.devices:
                assert torch.equal(shards[leaf][device], want[blocks[device]]), (target, leaf)
