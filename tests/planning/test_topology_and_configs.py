"""TPU presets, shipped model configs, and `autoxla plan` over them offline and fast."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from AutoXLA.planning.model_configs import shipped_config_dir, shipped_ids
from AutoXLA.planning.topology import PRESETS, topology


@pytest.mark.parametrize("name, chips, hosts, hbm_gib", [
    ("v4-8", 4, 1, 32),         # v4 and v5p names count TensorCores, two per chip
    ("v5p-128", 64, 16, 95),    # 4x4x4: 64 chips on 16 hosts (Cloud TPU v5p table)
    ("v5p-64", 32, 8, 95),
    ("v5e-8", 8, 1, 16),        # v5e and v6e names count chips; 8 on one host
    ("v5e-16", 16, 4, 16),
    ("v5e-256", 256, 64, 16),
    ("v6e-8", 8, 1, 32),
    ("v6e-256", 256, 64, 32),
    ("V5LITEPOD-16", 16, 4, 16),   # the gcloud spelling of v5e
])
def test_presets(name, chips, hosts, hbm_gib):
    t = topology(name)
    assert (t.chips, t.hosts, t.hbm_bytes) == (chips, hosts, hbm_gib * 2**30)
    assert t.chips_per_host * t.hosts == t.chips


def test_unknown_topology_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown topology 'v5p-7'; use one of v4-8, .*v6e-256"):
        topology("v5p-7")


EXPECTED = {   # (hidden, layers, heads, kv heads) of the decoder models, from their hub configs
    "meta-llama/Llama-2-7b-hf": (4096, 32, 32, 32), "meta-llama/Llama-2-13b-hf": (5120, 40, 40, 40),
    "meta-llama/Llama-2-70b-hf": (8192, 80, 64, 8), "meta-llama/Llama-3.1-8B": (4096, 32, 32, 8),
    "meta-llama/Llama-3.1-70B": (8192, 80, 64, 8), "meta-llama/Llama-3.1-405B": (16384, 126, 128, 8),
    "mistralai/Mistral-7B-v0.1": (4096, 32, 32, 8), "mistralai/Mixtral-8x7B-v0.1": (4096, 32, 32, 8),
    "google/gemma-2-9b": (3584, 42, 16, 8), "google/gemma-2-27b": (4608, 46, 32, 16),
    "Qwen/Qwen3-8B": (4096, 36, 32, 8), "Qwen/Qwen3-32B": (5120, 64, 64, 8),
    "Qwen/Qwen3-30B-A3B": (2048, 48, 32, 4), "Qwen/Qwen3-235B-A22B": (4096, 94, 64, 4),
    "deepseek-ai/DeepSeek-V3": (7168, 61, 128, 128), "openai/gpt-oss-120b": (2880, 36, 64, 8),
}


def test_shipped_configs_read_offline():
    from AutoXLA.modeling.empty import load_config

    assert set(EXPECTED) <= set(shipped_ids())
    assert {"facebook/sam-vit-huge", "facebook/sam2.1-hiera-large",
            "nvidia/segformer-b5-finetuned-ade-640-640",
            "facebook/mask2former-swin-large-coco-panoptic"} <= set(shipped_ids())
    assert shipped_config_dir("META-LLAMA/llama-3.1-70b") == shipped_config_dir(
        "meta-llama/Llama-3.1-70B") and shipped_config_dir("someone/else") is None
    for hub_id, dims in EXPECTED.items():
        c = load_config(shipped_config_dir(hub_id))
        assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
                c.num_key_value_heads) == dims, hub_id


# bench/plan_speed.py, in a fresh interpreter that refuses torch_xla: every shipped config
# planned once. The bench measures the 2 s goal; here each call need only answer (a hang guard
# of 30 s, 15x the goal, so a loaded CI machine does not fail it).
def test_plan_every_shipped_config_offline_without_torch_xla():
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "bench" / "plan_speed.py")],
                         capture_output=True, text=True, timeout=600, cwd=root,
                         env={**os.environ, "HF_HUB_OFFLINE": "1",
                              "PYTHONPATH": os.pathsep.join([str(root), *sys.path])})
    assert out.returncode == 0, out.stderr[-3000:]
    times = [line.split(" ", 1) for line in out.stdout.splitlines()]
    assert sorted(what.split()[0] for _, what in times) == sorted(shipped_ids())
    assert not [(float(t), what) for t, what in times if float(t) >= 30.0]


# (hub id, experts, experts each device holds on fsdp=64): split by expert where they divide 64.
_MOE = [("Qwen/Qwen3-30B-A3B", 128, 2), ("deepseek-ai/DeepSeek-V3", 256, 4),
        ("openai/gpt-oss-120b", 128, 2), ("mistralai/Mixtral-8x7B-v0.1", 8, 8)]


@pytest.mark.parametrize("hub_id,experts,per_device", _MOE)
def test_mixture_of_experts_forecast_offline(hub_id, experts, per_device):
    from AutoXLA.planning.communication import communication
    from AutoXLA.modeling.from_config import plan_from_config
    import dataclasses

    from AutoXLA.modeling.empty import load_config
    from AutoXLA.planning.memory import InferenceSetup, gathered_weights, inference_forecast

    path = shipped_config_dir(hub_id)
    plan = plan_from_config(path, "fsdp", 64)
    tensors = [t for t in plan if t.role == "experts" and len(t.shape) == 3]
    assert tensors and all(t.shape[0] == experts for t in tensors)
    assert all(t.shard_shape[0] == per_device for t in tensors)
    if per_device == experts:      # Mixtral's 8 on 64: each expert split like FSDP instead
        assert all(t.spec[0] is None and "fsdp" in t.spec for t in tensors)
    # Each device's expert bytes are its share: the whole / 64.
    assert sum(t.bytes_per_device for t in tensors) * 64 == sum(t.nbytes for t in tensors)
    forecast = inference_forecast(plan, load_config(path), InferenceSetup(batch=64, max_len=2048))
    gathered = next(x for x in forecast.lines if x.name == "gathered weights")
    if per_device < experts:       # experts split by expert are not gathered: the same without them
        without = dataclasses.replace(plan, tensors=[t for t in plan if t.role != "experts"])
        assert gathered_weights(without, train=False).bytes_per_device == gathered.bytes_per_device
        report = communication(plan, batch=64, train=False)
        moving = [op for op in report.ops if "to the experts" in op.what]
        assert moving and all(op.axes == ("fsdp",) for op in moving)
        assert not any(op.what.startswith("weight") and ".experts." in op.what for op in report.ops)
    assert any("every token runs through all" in n for n in forecast.notes)


def test_quantized_experts_forecast_offline():
    # int8 experts (quantization/experts.py): half the bytes of bf16 plus their scales, still
    # split by expert, and the forecast still moves tokens to them rather than their weights.
    from AutoXLA.modeling.empty import load_config
    from AutoXLA.planning.communication import communication
    from AutoXLA.modeling.from_config import plan_from_config
    from AutoXLA.quantization import QuantizationConfig

    path = shipped_config_dir("Qwen/Qwen3-30B-A3B")
    bf16 = plan_from_config(path, "fsdp", 64)
    int8 = plan_from_config(path, "fsdp", 64, quantization_config=QuantizationConfig(bits=8))
    experts = [t for t in int8 if t.role == "experts"]
    assert experts and all(t.dtype == "int8" and t.spec[0] == "fsdp" for t in experts)
    float_bytes = sum(t.nbytes for t in bf16 if t.role == "experts" and len(t.shape) == 3)
    assert sum(t.nbytes for t in experts) * 2 == float_bytes
    report = communication(int8, batch=64, train=False)
    moving = [op for op in report.ops if "to the experts" in op.what]
    assert len(moving) == load_config(path).num_hidden_layers     # one per MoE layer
    assert not any(".experts." in op.what and op.what.startswith("weight") for op in report.ops)
    # The quantized linears (attention) are gathered as weights.
    assert any(op.what.startswith("weight") and "self_attn" in op.what for op in report.ops)
