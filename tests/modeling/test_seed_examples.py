"""The seed's Quick Start and 3D examples, as written, with a local path. Its other examples run as
written too: Splash Attention in tests/attention/test_models.py, Quantized Loading in
tests/quantization/test_quantized_loading.py, the segmentation ones in tests/segmentation/."""
import torch

from AutoXLA import backend


def test_quick_start(checkpoints, xla_devices):
    path = str(checkpoints["llama"])
    # --- from the seed (hub id -> local path) ---
    from AutoXLA.modeling import AutoXLAModelForCausalLM

    # Load a pretrained model with FSDP sharding and XLA Flash Attention
    model = AutoXLAModelForCausalLM.from_pretrained(
        path,
        attn_implementation="splash_attention",
        sharding_strategy="fsdp"
    )
    # --- end of the seed's code ---
    assert model.autoxla_plan.strategy == "fsdp" and model.autoxla_plan.mesh.fsdp == 8
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 2, 3]]).to(backend.device())).logits
    assert logits.shape == (1, 3, 256) and torch.isfinite(logits.cpu()).all()


def test_3d_sharding(checkpoints, xla_devices):
    path = str(checkpoints["llama"])
    from AutoXLA.modeling import AutoXLAModelForCausalLM

    model = AutoXLAModelForCausalLM.from_pretrained(
        path,
        sharding_strategy="3d"
    )
    assert model.autoxla_plan.mesh.sizes == (2, 2, 2)
    # 3d replicates weights over "data": no parameter spec mentions it.
    assert not any("data" in str(t.spec) for t in model.autoxla_plan.parameters)


def test_top_level_import(checkpoints, xla_devices):
    import AutoXLA

    assert AutoXLA.AutoXLAModelForCausalLM.from_pretrained

