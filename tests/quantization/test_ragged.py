"""Ragged blocks (issue 14): a block size that does not divide a layer's width leaves a shorter
last block, in the C engine, the plan, the sharded load, the forward and saving."""
import copy

import pytest
import torch

from AutoXLA import backend
from AutoXLA.loading import checkpoint as ckpt
from AutoXLA.loading.streaming import read_whole
from AutoXLA.modeling import AutoXLAModelForCausalLM
from AutoXLA.quantization import ModelQuantizer, QuantizationConfig, QuantizedLinear
from AutoXLA.quantization.weights import quantize_tensor

from ..helpers import assert_close, check_sharding_matches_plan, quiet

WIDTH = 200            # the example: blocks of 32 leave a last block of 8



@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """A tiny Llama whose every linear reads 200 inputs (hidden and intermediate sizes 200)."""
    from transformers import AutoModelForCausalLM

    from AutoXLA.testing.tiny import save_tiny_checkpoint

    path = save_tiny_checkpoint("llama", tmp_path_factory.mktemp("wide") / "llama", seed=3,
                                hidden_size=WIDTH, intermediate_size=WIDTH,
                                num_attention_heads=4, num_key_value_heads=2)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    return path, reference


@pytest.mark.parametrize("bits,sym,strategy", [(4, True, "2d"), (8, False, "fsdp")])
def test_width_200_in_blocks_of_32_loads_sharded(bits, sym, strategy, wide_llama, batch,
                                                 xla_devices):
    path, reference = wide_llama
    cfg = QuantizationConfig(n_bits=bits, block_size=32, symmetric=sym)
    model = quiet(AutoXLAModelForCausalLM.from_pretrained, path, sharding_strategy=strategy,
                   do_quant=True, quantization_config=cfg)
    unsharded = quiet(ModelQuantizer(cfg).quantize_model, copy.deepcopy(reference))
    ids, mask = batch
    with torch.no_grad():
        out = model(input_ids=ids.to(backend.device()), attention_mask=mask.to(backend.device()))
        ref = unsharded(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    # The same quantized tensors sharded and unsharded: only fp32 reordering differs (helpers.py).
    assert_close(out.logits.cpu()[valid], ref[valid], what=f"int{bits} ragged, {strategy}")

    # Every linear holds exactly what the C engine makes of the checkpoint's weight: 7 blocks a
    # row (6 of 32 and one of 8), placed as the plan says.
    plan, c = model.autoxla_plan, ckpt.locate(path)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert len(linears) == 14
    for name, m in linears.items():
        searched = ", searched" if bits == 4 else ""          # int4's default (test_config.py)
        kind = "sym" if sym else "asym"
        assert m.quant_format.label == f"int{bits} block 32 (last 8) {kind}{searched}"
        assert tuple(m.weight_scale.shape) == (m.out_features, 7)
        q = quantize_tensor(read_whole(c.records[f"{name}.weight"]), m.quant_format)
        assert torch.equal(m.weight.cpu(), q.q) and torch.equal(m.weight_scale.cpu(), q.scale)
        if not sym:
            assert torch.equal(m.weight_zero_point.cpu(), q.zero_point)
    assert check_sharding_matches_plan(model, plan, model.autoxla_mesh) == (
        len(plan.parameters) + sum(1 for t in plan if t.quant))
    # 7 blocks split over no mesh axis: the plan keeps the scales' block dim whole and says why.
    scale = plan["model.layers.0.self_attn.o_proj.weight_scale"]
    assert "(last 8)" in str(plan) and scale.spec[1] is None


def test_ragged_checkpoint_saves_and_reloads(wide_llama, batch, tmp_path, xla_devices):
    path, _ = wide_llama
    cfg = QuantizationConfig(n_bits=4, block_size=48, symmetric=False)   # 4 x 48 + 8
    model = quiet(AutoXLAModelForCausalLM.from_pretrained, path, sharding_strategy="2d",
                   do_quant=True, quantization_config=cfg)
    model.save_pretrained(tmp_path / "saved")
    again = quiet(AutoXLAModelForCausalLM.from_pretrained, tmp_path / "saved",
                   sharding_strategy="fsdp")
    ids, mask = (t.to(backend.device()) for t in batch)
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask).logits.cpu()
        b = again(input_ids=ids, attention_mask=mask).logits.cpu()
    assert_close(b, a, what="ragged int4 saved and reloaded")
    m = again.get_submodule("model.layers.1.mlp.down_proj")
    assert m.quant_format.label == "int4 block 48 (last 8) asym, searched"
    assert torch.equal(m.weight_scale.cpu(),
                       model.get_submodule("model.layers.1.mlp.down_proj").weight_scale.cpu())
