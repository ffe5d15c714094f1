"""The quantization formats of issue 14 through the Python layers: scale dtypes (and, as they
come, the error-minimising search and the float offset) in the config, the loaded layers, the
plan and saving."""
import warnings

import pytest
import torch

from AutoXLA import backend
from AutoXLA.loading import checkpoint as ckpt
from AutoXLA.loading.streaming import read_whole
from AutoXLA.modeling import AutoXLAModelForCausalLM
from AutoXLA.quantization import QuantizationConfig, QuantizedLinear
from AutoXLA.quantization.quantizer import quantize_tensor

from ..helpers import assert_close


def _quiet(fn, *a, **k):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*a, **k)


def test_scale_dtype_is_validated_and_saved_only_when_not_the_default():
    with pytest.raises(ValueError, match=r"scale_dtype='half' is not supported; use one of "
                                         r"'bfloat16', 'float16', 'float32'"):
        QuantizationConfig(scale_dtype="half")
    assert "scale_dtype" not in QuantizationConfig(bits=4).to_dict()       # still version 1
    d = QuantizationConfig(bits=4, block_size=32, scale_dtype="float16").to_dict()
    assert d["scale_dtype"] == "float16" and d["format_version"] == 3
    assert QuantizationConfig.from_dict(d).scale_dtype == "float16"
    fmt = QuantizationConfig(bits=4, block_size=32, scale_dtype="float16").layer_format("x", 64, 2)
    assert fmt.label == "int4 block 32 sym, float16 scales"
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
    model = _quiet(AutoXLAModelForCausalLM.from_pretrained, path, sharding_strategy="2d",
                   do_quant=True, quantization_config=cfg)
    c = ckpt.locate(path)
    name = "model.layers.0.self_attn.q_proj"
    m = model.get_submodule(name)
    assert m.weight_scale.dtype == torch.float16
    q = quantize_tensor(read_whole(c.records[f"{name}.weight"]), m.quant_format)
    assert torch.equal(m.weight_scale.cpu(), q.scale) and torch.equal(m.weight.cpu(), q.q)
    assert "float16 scales" in str(model.autoxla_plan)
    model.save_pretrained(tmp_path / "fp16")
    again = _quiet(AutoXLAModelForCausalLM.from_pretrained, tmp_path / "fp16",
                   sharding_strategy="fsdp")
    assert again.get_submodule(name).weight_scale.dtype == torch.float16
    ids, mask = (t.to(backend.device()) for t in batch)
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask).logits.cpu()
        b = again(input_ids=ids, attention_mask=mask).logits.cpu()
    assert_close(b, a, what="float16 scales saved and reloaded")
