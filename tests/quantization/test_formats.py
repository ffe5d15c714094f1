"""The quantization formats of issue 14 through the Python layers: scale dtypes (and, as they
come, the error-minimising search and the float offset) in the config, the loaded layers, the
plan and saving."""

import pytest
import torch

from AutoXLA import backend
from AutoXLA.loading import checkpoint as ckpt
from AutoXLA.loading.streaming import read_whole
from AutoXLA.modeling import AutoXLAModelForCausalLM
from AutoXLA.quantization import QuantizationConfig, QuantizedLinear
from AutoXLA.quantization.weights import quantize_tensor

from ..helpers import assert_close, quiet



def test_scale_dtype_is_validated_and_saved_only_when_not_the_default():
    with pytest.raises(ValueError, match=r"scale_dtype='half' is not supported; use one of "
                                         r"'bfloat16', 'float16', 'float32'"):
        QuantizationConfig(scale_dtype="half")
    assert "scale_dtype" not in QuantizationConfig(bits=4).to_dict()       # still version 1
    d = QuantizationConfig(bits=4, block_size=32, scale_dtype="float16").to_dict()
    assert d["scale_dtype"] == "float16" and d["format_version"] == 3
    assert QuantizationConfig.from_dict(d).scale_dtype == "float16"
    fmt = QuantizationConfig(bits=4, block_size=32, scale_dtype="float16").layer_format("x", 64, 2)
    assert fmt.label == "int4 block 32 sym, float16 scales, searched"
    assert fmt.torch_scale_dtype is torch.float16


def test_float16_scales_are_finer_than_bfloat16():
    # Both round the float32 scale UP to their grid; float16 has 10 mantissa bits to bfloat16's 7,
    # so its scales sit closer above the ideal one and the squared error over many blocks is
    # lower (a statistical claim, hence 4096 blocks of Gaussian weights: the measured gap is
    # ~1 %, far outside the sampling noise of the mean over that many blocks).
    w = torch.randn(512, 256, generator=torch.Generator().manual_seed(0))
    err = {}
    for dtype in ("bfloat16", "float16"):
        fmt = QuantizationConfig(bits=4, block_size=32, scale_dtype=dtype).layer_format("w", 256, 512)
        q = quantize_tensor(w, fmt)
        layer = QuantizedLinear(fmt, bias=False, backend="fallback")
        layer.load_quantized(q.q, q.scale, q.zero_point)
        err[dtype] = (layer.dequantized_weight(torch.float64) - w.double()).pow(2).mean().item()
    assert err["float16"] < err["bfloat16"], err


def test_float16_scales_load_sharded_and_reload(checkpoints, batch, tmp_path, xla_devices):
    path = checkpoints["llama"]
    cfg = QuantizationConfig(bits=4, block_size=32, symmetric=False, scale_dtype="float16")
    model = quiet(AutoXLAModelForCausalLM.from_pretrained, path, sharding_strategy="2d",
                   do_quant=True, quantization_config=cfg)
    c = ckpt.locate(path)
    name = "model.layers.0.self_attn.q_proj"
    m = model.get_submodule(name)
    assert m.weight_scale.dtype == torch.float16
    q = quantize_tensor(read_whole(c.records[f"{name}.weight"]), m.quant_format)
    assert torch.equal(m.weight_scale.cpu(), q.scale) and torch.equal(m.weight.cpu(), q.q)
    assert "float16 scales" in str(model.autoxla_plan)
    model.save_pretrained(tmp_path / "fp16")
    again = quiet(AutoXLAModelForCausalLM.from_pretrained, tmp_path / "fp16",
                   sharding_strategy="fsdp")
    assert again.get_submodule(name).weight_scale.dtype == torch.float16
    ids, mask = (t.to(backend.device()) for t in batch)
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask).logits.cpu()
        b = again(input_ids=ids, attention_mask=mask).logits.cpu()
    assert_close(b, a, what="float16 scales saved and reloaded")


def test_zero_point_and_search_are_validated_and_saved():
    with pytest.raises(ValueError, match=r"zero_point='float' needs symmetric=False"):
        QuantizationConfig(bits=4, zero_point="float")
    with pytest.raises(ValueError, match=r"zero_point='fp16' is not supported; use 'int8'"):
        QuantizationConfig(bits=4, symmetric=False, zero_point="fp16")
    with pytest.raises(ValueError, match=r"scale_search must be True or False"):
        QuantizationConfig(scale_search="yes")
    cfg = QuantizationConfig(bits=4, block_size=32, symmetric=False, zero_point="float",
                             scale_search=True)
    d = cfg.to_dict()
    assert (d["zero_point"], d["scale_search"], d["format_version"]) == ("float", True, 3)
    assert QuantizationConfig.from_dict(d).same_weights_as(cfg)
    assert not QuantizationConfig(bits=4, block_size=32, symmetric=False).same_weights_as(cfg)
    fmt = cfg.layer_format("x", 64, 2)
    assert fmt.label == "int4 block 32 asym float offset, searched"
    assert "zero_point" not in QuantizationConfig(bits=4).to_dict()


def _loaded(path, cfg, strategy="2d"):
    return quiet(AutoXLAModelForCausalLM.from_pretrained, path, sharding_strategy=strategy,
                  do_quant=True, quantization_config=cfg)


def _weight_error(model, path) -> float:
    """Sum over the quantized linears of ||W - dequantized W||^2, in float64."""
    c = ckpt.locate(path)
    total = 0.0
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            w = read_whole(c.records[f"{name}.weight"]).double()
            total += (m.dequantized_weight(torch.float64).cpu() - w).pow(2).sum().item()
    return total


def test_float_offset_and_search_load_sharded(checkpoints, batch, tmp_path, xla_devices):
    path, c = checkpoints["llama"], ckpt.locate(checkpoints["llama"])
    plain = QuantizationConfig(bits=4, block_size=32, symmetric=False, zero_point="float",
                               scale_search=False)
    searched = QuantizationConfig(bits=4, block_size=32, symmetric=False, zero_point="float",
                                  scale_search=True)
    models = {"plain": _loaded(path, plain), "searched": _loaded(path, searched)}
    for key, model in models.items():
        name = "model.layers.1.mlp.down_proj"
        m = model.get_submodule(name)
        assert m.weight_zero_point is None and m.weight_offset.dtype == torch.bfloat16
        q = quantize_tensor(read_whole(c.records[f"{name}.weight"]), m.quant_format)
        for got, want in ((m.weight, q.q), (m.weight_scale, q.scale), (m.weight_offset, q.offset)):
            assert torch.equal(got.cpu(), want), key
        plan = model.autoxla_plan
        assert plan[f"{name}.weight_offset"].role == plan[f"{name}.weight_scale"].role
    # The search never gives a block a larger squared error than min-max (autoxla.h), so the
    # whole model's weight error cannot be larger either; measured ~0.75x on this fixture.
    assert _weight_error(models["searched"], path) < _weight_error(models["plain"], path)
    models["searched"].save_pretrained(tmp_path / "searched")
    again = quiet(AutoXLAModelForCausalLM.from_pretrained, tmp_path / "searched",
                   sharding_strategy="fsdp")
    ids, mask = (t.to(backend.device()) for t in batch)
    with torch.no_grad():
        a = models["searched"](input_ids=ids, attention_mask=mask).logits.cpu()
        b = again(input_ids=ids, attention_mask=mask).logits.cpu()
    assert_close(b, a, what="float-offset searched int4 saved and reloaded")
