"""QuantizationConfig: the seed's keywords, validation at the edge, and its saved form."""
import pytest

from AutoXLA.quantization import QuantizationConfig
from AutoXLA.quantization.config import FORMAT_VERSION


def test_seed_spellings():
    a = QuantizationConfig(bits=8, use_pallas=True, quantize_activation=True)
    b = QuantizationConfig(n_bits=8, use_pallas=True)
    assert a.n_bits == a.bits == 8 and a.quantize_activation and a.use_pallas
    assert b.n_bits == b.bits == 8 and not b.quantize_activation
    assert QuantizationConfig().n_bits == 8 and QuantizationConfig().block_size == -1
    assert QuantizationConfig(bits=4, n_bits=4).n_bits == 4
    c = QuantizationConfig(n_bits=8, exclude_layers=["iou_prediction_head", "output_upscaling"])
    assert c.exclude_layers == ["iou_prediction_head", "output_upscaling"]


@pytest.mark.parametrize("kwargs,match", [
    (dict(n_bits=3), r"n_bits=3 is not supported; use 8 \(int8\) or 4 \(int4\)"),
    (dict(bits=16), r"n_bits=16"),
    (dict(n_bits=True), r"n_bits=True"),
    (dict(bits=8, n_bits=4), r"bits=8 and n_bits=4 disagree"),
    (dict(block_size=0), r"block_size=0 is not supported; use -1 \(per-channel\) or a positive"),
    (dict(block_size=-2), r"block_size=-2"),
    (dict(block_size=True), r"block_size=True"),
    (dict(block_size="64"), r"block_size='64'"),
    (dict(symmetric="yes"), r"symmetric must be True or False"),
    (dict(quantize_activation=1), r"quantize_activation must be True or False"),
    (dict(use_pallas="auto"), r"use_pallas must be"),
    (dict(backend="cuda"), r"backend='cuda' is unknown; use one of auto, pallas, xla_op, torch_int8, fallback"),
    (dict(backend="pallas", use_pallas=False), r"contradicts"),
    (dict(exclude_layers=[""]), r"non-empty strings"),
])
def test_invalid_values_name_value_and_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantizationConfig(**kwargs)


def test_any_block_size_fits_any_layer():
    cfg = QuantizationConfig(n_bits=4, block_size=64, scale_search=False)
    even = cfg.layer_format("a", 128, 8)
    assert (even.groups, even.ragged, even.label) == (2, False, "int4 block 64 sym")
    ragged = cfg.layer_format("model.layers.0.mlp.down_proj", 96, 8)   # 64 + a last block of 32
    assert (ragged.groups, ragged.ragged, ragged.scale_shape) == (2, True, (8, 2))
    assert ragged.label == "int4 block 64 (last 32) sym"
    narrow = cfg.layer_format("b", 48, 8)      # a block wider than the layer: one per row
    assert narrow.per_channel and narrow.groups == 1 and narrow.block_size == 48
    odd = QuantizationConfig(n_bits=8, block_size=48).layer_format("c", 200, 3)
    assert (odd.groups, odd.label) == (5, "int8 block 48 (last 8) sym")


def test_layer_format_shapes():
    # An odd input: the last nibble is padded.
    f = QuantizationConfig(n_bits=4, block_size=-1).layer_format("x", 77, 5)
    assert f.per_channel and f.q_shape == (5, 39) and f.scale_shape == (5, 1)
    f = QuantizationConfig(n_bits=8, block_size=32, symmetric=False).layer_format("x", 96, 5)
    assert f.q_shape == (5, 96) and f.scale_shape == (5, 3) and f.label == "int8 block 32 asym"


def test_exclude_patterns():
    cfg = QuantizationConfig(exclude_layers=["lm_head", "mlp.down_proj", "*.o_proj", "layers.1"])
    assert cfg.excludes("lm_head") == "lm_head"
    assert cfg.excludes("model.layers.0.mlp.down_proj") == "mlp.down_proj"
    assert cfg.excludes("model.layers.0.self_attn.o_proj") == "*.o_proj"
    assert cfg.excludes("model.layers.1.mlp.up_proj") == "layers.1"
    assert cfg.excludes("model.layers.10.mlp.up_proj") is None     # dotted parts, not substrings
    assert cfg.excludes("model.layers.0.mlp.up_proj") is None


def test_dict_round_trip_and_version():
    cfg = QuantizationConfig(n_bits=4, block_size=64, symmetric=False, exclude_layers=["x"],
                             quantize_activation=True, backend="fallback", scale_search=False)
    d = cfg.to_dict()
    assert d["quant_method"] == "autoxla" and d["format_version"] == FORMAT_VERSION
    assert "bits" not in d and d["n_bits"] == 4
    assert QuantizationConfig.from_dict(d) == cfg
    with pytest.raises(ValueError, match="format_version 99"):
        QuantizationConfig.from_dict({**d, "format_version": 99})
    with pytest.raises(ValueError, match="quant_method='gptq'"):
        QuantizationConfig.from_dict({**d, "quant_method": "gptq"})
    with pytest.raises(ValueError, match=r"unknown quantization_config keys \['group'\]"):
        QuantizationConfig.from_dict({**d, "group": 1})


def test_same_weights_ignores_runtime_settings():
    a = QuantizationConfig(n_bits=8)
    assert a.same_weights_as(QuantizationConfig(n_bits=8, quantize_activation=True, backend="fallback"))
    assert not a.same_weights_as(QuantizationConfig(n_bits=4))


def test_cli_plans_quantized_tensors_without_torch_xla(checkpoints, tmp_path):
    import subprocess
    import sys

    (tmp_path / "config.json").write_text((checkpoints["llama"] / "config.json").read_text())
    code = ("import sys; from AutoXLA.cli import main; rc = main(sys.argv[1:]); "
            "assert 'torch_xla' not in sys.modules, 'plan must not import torch_xla'; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, "plan", str(tmp_path), "--strategy", "2d",
                          "--bits", "4", "--block-size", "64", "--asym"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    q = next(line for line in lines if line.startswith("model.layers.0.mlp.down_proj.weight "))
    # int4 packed: (64, 128) float becomes (64, 64) bytes; on a TPU int4 runs on Pallas only when
    # symmetric, so this asymmetric layer takes the fallback.
    assert "64x64" in q and "uint8" in q and "int4 block 64 asym, searched via fallback" in q
    assert any(line.startswith("model.layers.0.mlp.down_proj.weight_zero_point ") for line in lines)
    assert "14 linear(s) quantized" in out.stdout


def test_cli_quantization_flags_need_bits(capsys, checkpoints):
    from AutoXLA.cli import main

    assert main(["plan", str(checkpoints["llama"]), "--asym"]) == 2
    assert "add --bits 8 or --bits 4" in capsys.readouterr().err
    assert main(["plan", str(checkpoints["llama"]), "--bits", "3"]) == 2
    assert "n_bits=3" in capsys.readouterr().err


def test_bits_decide_the_default_format():
    # Issue 14: int4 defaults to the format that won at Q4_0's bytes (blocks of 32, searched);
    # int8 stays per-channel absmax. Stated keywords always win, and a saved dict without
    # scale_search (written before the default) reads back unsearched.
    int4, int8 = QuantizationConfig(bits=4), QuantizationConfig(bits=8)
    assert (int4.block_size, int4.scale_search) == (32, True)
    assert (int8.block_size, int8.scale_search) == (-1, False)
    assert int4.layer_format("x", 64, 2).label == "int4 block 32 sym, searched"
    pc = QuantizationConfig(bits=4, block_size=-1, scale_search=False)
    assert pc.layer_format("x", 64, 2).label == "int4 per-channel sym"
    assert QuantizationConfig(bits=4, per_channel=True).block_size == -1
    old = QuantizationConfig.from_dict({"n_bits": 4, "block_size": 64, "symmetric": True})
    assert old.scale_search is False and old.to_dict()["format_version"] == FORMAT_VERSION
    assert QuantizationConfig.from_dict(int4.to_dict()) == int4
