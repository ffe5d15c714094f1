"""Bad input gets one clear error that names the problem and the fix."""
import json
import shutil

import pytest
import torch

from AutoXLA import backend
from AutoXLA.loading.checkpoint import CheckpointError
from AutoXLA.modeling import AutoXLAModelForCausalLM


def test_unknown_strategy(checkpoints):
    with pytest.raises(ValueError, match=r"unknown sharding_strategy 'zigzag'.*fsdp"):
        AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], sharding_strategy="zigzag")


def test_strategy_is_case_insensitive_and_aliases_work(checkpoints, xla_devices):
    for name, expected in [("FSDP", "fsdp"), ("Data_Parallel", "dp"), ("model_parallel", "mp")]:
        model = AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], sharding_strategy=name)
        assert model.autoxla_plan.strategy == expected


def test_auto_shard_false_needs_a_mesh(checkpoints):
    with pytest.raises(ValueError, match="auto_shard=False needs mesh="):
        AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], auto_shard=False)


def test_mesh_with_an_axis_named_otherwise(checkpoints, xla_devices):
    # A mesh missing an axis is fine (size 1, tests/compat/test_options.py); a foreign name is not.
    import numpy as np
    from torch_xla.distributed.spmd import Mesh

    mesh = Mesh(np.arange(8), (4, 2), ("fsdp", "tensor"))
    with pytest.raises(ValueError, match=r"unknown axes \['tensor'\].*a missing axis has size 1"):
        AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], mesh=mesh)


def test_mesh_of_the_wrong_size(checkpoints, xla_devices):
    # torch_xla's Mesh itself refuses a mesh that does not cover all devices, so a mesh-like
    # object stands in for one built before the device count changed.
    class StaleMesh:
        axis_names = ("data", "fsdp", "model")
        mesh_shape = (1, 2, 2)

        def get_op_sharding(self, spec):
            raise AssertionError("must be refused before use")

    with pytest.raises(ValueError, match=r"covers 4 devices but the runtime has 8"):
        AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], mesh=StaleMesh())


def test_user_mesh_is_used(checkpoints, xla_devices):
    import numpy as np
    from torch_xla.distributed.spmd import Mesh

    # Axis order differs from AutoXLA's own, and device ids are permuted: specs go by name.
    mesh = Mesh(np.array([7, 6, 5, 4, 3, 2, 1, 0]), (2, 4, 1), ("model", "fsdp", "data"))
    model = AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], mesh=mesh, auto_shard=False)
    assert model.autoxla_plan.mesh.sizes == (1, 4, 2)
    assert model.autoxla_mesh is mesh
    from ..helpers import check_sharding_matches_plan

    check_sharding_matches_plan(model, model.autoxla_plan, mesh)


def test_pickle_only_checkpoint_is_refused_unless_opted_in(checkpoints, tmp_path, xla_devices):
    from transformers import AutoModelForCausalLM

    # transformers 5 writes only safetensors, so the legacy layout is written by hand.
    ref = AutoModelForCausalLM.from_pretrained(checkpoints["llama"])
    shutil.copy(checkpoints["llama"] / "config.json", tmp_path / "config.json")
    torch.save(ref.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"only pickle weights.*use_safetensors=False"):
        AutoXLAModelForCausalLM.from_pretrained(tmp_path)
    model = AutoXLAModelForCausalLM.from_pretrained(tmp_path, use_safetensors=False)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        got = model(input_ids=ids.to(backend.device())).logits.cpu()
        want = ref(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_tensor(checkpoints, tmp_path, xla_devices):
    d = _copy(checkpoints["llama"], tmp_path / "ck")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    # Drop one tensor by rewriting the shard that holds it without it.
    from safetensors.torch import load_file, save_file

    name = "model.layers.1.mlp.down_proj.weight"
    shard = d / index["weight_map"][name]
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    # The index still names it: the index and the shard disagree, found before any byte is read.
    with pytest.raises(CheckpointError, match=r"puts tensor '.*down_proj.weight' in .* holds no "
                                              r"such tensor"):
        AutoXLAModelForCausalLM.from_pretrained(d)
    # Gone from the index too: the model lacks a weight.
    del index["weight_map"][name]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"1 weight\(s\).*down_proj.*re-save"):
        AutoXLAModelForCausalLM.from_pretrained(d)


def test_mismatched_tensor(checkpoints, tmp_path, xla_devices):
    d = _copy(checkpoints["llama"], tmp_path / "ck")
    config = json.loads((d / "config.json").read_text())
    config["intermediate_size"] = 64   # the weights say 128
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"has shape \(128, 64\) but .* needs \(64, 64\)"):
        AutoXLAModelForCausalLM.from_pretrained(d)


def test_truncated_shard(checkpoints, tmp_path, xla_devices):
    d = _copy(checkpoints["llama"], tmp_path / "ck")
    shard = sorted(d.glob("*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"truncated.*download or save it again"):
        AutoXLAModelForCausalLM.from_pretrained(d)


def test_no_weights_at_all(checkpoints, tmp_path):
    shutil.copy(checkpoints["llama"] / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=r"no weights in .*save_pretrained"):
        AutoXLAModelForCausalLM.from_pretrained(tmp_path)


def test_typo_in_a_keyword(checkpoints):
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['shardng_strategy'\]"):
        AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], shardng_strategy="fsdp")


def test_unknown_attention_implementation(checkpoints):
    with pytest.raises(ValueError, match=r"unknown attn_implementation 'sdpa2'.*eager"):
        AutoXLAModelForCausalLM.from_pretrained(checkpoints["llama"], attn_implementation="sdpa2")


def test_remote_code_stays_off(checkpoints, tmp_path):
    d = _copy(checkpoints["llama"], tmp_path / "ck")
    config = json.loads((d / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.Evil"}
    config["model_type"] = "evil-custom"
    (d / "config.json").write_text(json.dumps(config))
    (d / "evil.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoXLAModelForCausalLM.from_pretrained(d)
