"""Reading safetensors headers and streaming tensors into shards, against safetensors itself."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from AutoXLA import backend
from AutoXLA.loading import checkpoint as ckpt
from AutoXLA.loading import streaming
from AutoXLA.modeling import AutoXLAModelForCausalLM


@pytest.fixture
def mixed_file(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w_bf16": torch.randn(24, 40, generator=g).to(torch.bfloat16),
        "w_f16": torch.randn(16, 8, 3, generator=g).to(torch.float16),
        "w_f32": torch.randn(7, generator=g),
        "ids_i64": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "mask_bool": torch.tensor([True, False, True]),
        "x_f64": torch.randn(4, 4, generator=g, dtype=torch.float64),
    }
    path = tmp_path / "mixed.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    return path, tensors


def test_header_records_match_safetensors(mixed_file):
    path, tensors = mixed_file
    records = ckpt.read_safetensors_header(path)
    assert set(records) == set(tensors)
    for name, t in tensors.items():
        r = records[name]
        assert r.dtype == t.dtype and r.shape == tuple(t.shape)
        assert torch.equal(streaming.read_whole(r), t)


@pytest.mark.parametrize("name", ["w_bf16", "w_f16", "w_f32", "ids_i64", "x_f64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shard_grid_equals_torch(mixed_file, name, dtype):
    path, tensors = mixed_file
    record = ckpt.read_safetensors_header(path)[name]
    t = tensors[name]
    grid = tuple(2 if s % 2 == 0 else 1 for s in t.shape)
    got = streaming.shard_grid_tensors(record, grid, dtype)
    want = streaming.split_grid(t.to(dtype), grid)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == dtype and torch.equal(a, b)


def test_garbage_header_is_refused(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ckpt.CheckpointError, match="unreadable safetensors header"):
        ckpt.read_safetensors_header(bad)
    bad.write_bytes(b"\xff" * 8)
    with pytest.raises(ckpt.CheckpointError, match="not plausible"):
        ckpt.read_safetensors_header(bad)


def test_index_naming_a_missing_shard(checkpoints, tmp_path):
    import shutil

    d = tmp_path / "ck"
    shutil.copytree(checkpoints["llama"], d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    (d / sorted(set(index["weight_map"].values()))[0]).unlink()
    with pytest.raises(ckpt.CheckpointError, match="download is incomplete"):
        ckpt.locate(d)


def test_load_converts_dtype_exactly(checkpoints, xla_devices):
    """An fp32 checkpoint loaded as bf16 holds exactly torch's fp32 -> bf16 rounding."""
    model = AutoXLAModelForCausalLM.from_pretrained(checkpoints["mistral"], dtype=torch.bfloat16,
                                                    sharding_strategy="2d")
    state = {}
    for f in checkpoints["mistral"].glob("*.safetensors"):
        state.update(load_file(f))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # state_dict() has the checkpoint's names, also for the scanned (stacked) decoder layers.
    loaded = model.state_dict()
    assert set(state) <= set(loaded)
    for name, t in state.items():
        assert torch.equal(loaded[name].cpu(), t.to(torch.bfloat16)), name
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_bf16_checkpoint_loads_as_bf16_by_default(checkpoints, tmp_path, xla_devices):
    from AutoXLA.testing.tiny import save_tiny_checkpoint

    d = save_tiny_checkpoint("llama", tmp_path / "bf16", dtype=torch.bfloat16)
    model = AutoXLAModelForCausalLM.from_pretrained(d)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.autoxla_plan.dtype == "bfloat16"
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 2, 3]]).to(backend.device())).logits.cpu()
    assert torch.isfinite(logits.float()).all()
