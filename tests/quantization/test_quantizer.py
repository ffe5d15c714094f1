"""ModelQuantizer on CPU models: what it replaces, what it keeps, and what it reports."""
import warnings

import pytest
import torch
from torch import nn

from AutoXLA import LanguageModelQuantizer as TopLevelAlias
from AutoXLA.quantization import (LanguageModelQuantizer, ModelQuantizer, QuantizationConfig,
                                  QuantizedLinear)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q_proj = nn.Linear(d, d, bias=True)
        self.mlp = nn.Sequential()
        self.mlp.down_proj = nn.Linear(2 * d, d, bias=True)
        self.up = nn.Linear(d, 2 * d, bias=False)

    def forward(self, x):
        return x + self.mlp.down_proj(torch.relu(self.up(self.q_proj(x))))


class Toy(nn.Module):
    def __init__(self, d=64, vocab=50, tie=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Block(d) for _ in range(2)])
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def _quiet(fn, *a, **k):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*a, **k)


def test_aliases_are_one_class():
    assert LanguageModelQuantizer is ModelQuantizer is TopLevelAlias


def test_replaces_linears_keeps_biases_head_and_embeddings():
    torch.manual_seed(0)
    model = Toy()
    bias_before = model.layers[0].q_proj.bias.detach().clone()
    ids = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        ref = model(ids).double()
    _quiet(ModelQuantizer(QuantizationConfig(n_bits=8)).quantize_model, model)
    q = model.layers[0].q_proj
    assert isinstance(q, QuantizedLinear) and q.weight.dtype == torch.int8
    assert q.bias.dtype == torch.float32 and torch.equal(q.bias.detach(), bias_before)
    assert isinstance(model.lm_head, nn.Linear) and isinstance(model.embed, nn.Embedding)
    report = model.autoxla_quantization
    assert set(report.layers) == {f"layers.{i}.{n}" for i in range(2)
                                  for n in ("q_proj", "mlp.down_proj", "up")}
    assert "lm_head" in report.skipped and "quantize_lm_head=False" in report.skipped["lm_head"]
    assert report.bytes_after < report.bytes_before
    d = report.layers["layers.0.up"]
    assert d.min_sqnr_db > 35 and d.max_err > 0      # int8 on Gaussian rows: ~40 dB per row
    assert "6 linear(s) quantized" in str(report)
    with torch.no_grad():
        out = model(ids).double()
    sqnr = 10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum())
    assert sqnr > 25, sqnr


def test_exclude_layers_and_unmatched_pattern_warns():
    model = Toy()
    cfg = QuantizationConfig(n_bits=4, exclude_layers=["mlp.down_proj", "no_such_layer"])
    with pytest.warns(UserWarning, match=r"pattern 'no_such_layer' matches no linear layer of Toy"):
        ModelQuantizer(cfg).quantize_model(model)
    for i in range(2):
        assert type(model.layers[i].mlp.down_proj) is nn.Linear
        assert isinstance(model.layers[i].q_proj, QuantizedLinear)
    assert model.autoxla_quantization.skipped["layers.0.mlp.down_proj"].startswith("excluded")


def test_quantizing_nothing_says_so():
    # Every candidate excluded: the model stays float, and a warning says it (GPT-2's Conv1D
    # layers were once skipped without a word)
    model = Toy()
    cfg = QuantizationConfig(n_bits=8, exclude_layers=["layers"])
    with pytest.warns(UserWarning, match=r"no layer of Toy is quantized: the model stays in full "
                                         r"precision .* each of its 7 candidate\(s\) was kept"):
        ModelQuantizer(cfg).quantize_model(model)
    assert not model.autoxla_quantization.layers


def test_lm_head_quantized_when_asked_but_never_when_tied():
    model = Toy()
    _quiet(ModelQuantizer(QuantizationConfig(quantize_lm_head=True)).quantize_model, model)
    assert isinstance(model.lm_head, QuantizedLinear)
    tied = Toy(tie=True)
    _quiet(ModelQuantizer(QuantizationConfig(quantize_lm_head=True)).quantize_model, tied)
    assert type(tied.lm_head) is nn.Linear and tied.lm_head.weight is tied.embed.weight
    assert "tied" in tied.autoxla_quantization.skipped["lm_head"]


def test_ragged_blocks_stay_within_half_a_step():
    # Widths 64 and 128 in blocks of 24: the last block has 16 or 8, with its own scale. The C
    # engine's bound (autoxla.h): every element within scale/2 of its dequantized value, plus
    # fp32 rounding (< 2^-13 of the scale), so 0.5001 * scale is the reference here.
    model = Toy()
    weights = {n: m.weight.detach().clone() for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and n != "lm_head"}
    cfg = QuantizationConfig(n_bits=4, block_size=24, scale_search=False)   # the bound is absmax's
    _quiet(ModelQuantizer(cfg).quantize_model, model)
    for name, w in weights.items():
        layer = model.get_submodule(name)
        cols = w.shape[1]
        assert layer.quant_format.label == f"int4 block 24 (last {cols % 24}) sym", name
        assert tuple(layer.weight_scale.shape) == (w.shape[0], -(-cols // 24))
        scale = layer.weight_scale.float().repeat_interleave(24, dim=1)[:, :cols]
        err = (layer.dequantized_weight(torch.float32) - w).abs()
        assert (err <= 0.5001 * scale).all(), name


def test_a_block_wider_than_the_layer_is_one_per_row():
    model = Toy()
    _quiet(ModelQuantizer(QuantizationConfig(n_bits=4, block_size=256)).quantize_model, model)
    fmt = model.layers[0].q_proj.quant_format
    assert fmt.per_channel and fmt.groups == 1


def test_use_pallas_off_tpu_warns_once_and_falls_back():
    model = Toy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ModelQuantizer(QuantizationConfig(bits=8, use_pallas=True)).quantize_model(model)
    pallas = [w for w in caught if "Pallas" in str(w.message)]
    assert len(pallas) == 1, [str(w.message) for w in caught]
    assert "runs only on a TPU" in str(pallas[0].message)
    assert {d.backend for d in model.autoxla_quantization.layers.values()} == {"xla_op"}


def test_activation_quantization_unsupported_by_fallback_says_so():
    with pytest.warns(UserWarning, match=r"fallback backend does not quantize activations: 6 layer"):
        ModelQuantizer(QuantizationConfig(n_bits=4, block_size=32,
                                          quantize_activation=True)).quantize_model(Toy())


def test_config_or_keywords():
    assert ModelQuantizer(n_bits=4).config.n_bits == 4
    with pytest.raises(TypeError, match="QuantizationConfig"):
        ModelQuantizer({"n_bits": 4})
    with pytest.raises(TypeError, match="not both"):
        ModelQuantizer(QuantizationConfig(), n_bits=4)


def test_nan_weight_names_the_layer_row():
    model = Toy()
    with torch.no_grad():
        model.layers[1].up.weight[17, 3] = float("nan")
    with pytest.raises(ValueError, match=r"cannot quantize layers.1.up: row 17 of the weight "
                                         r"contains NaN or Inf.*exclude_layers"):
        _quiet(ModelQuantizer(QuantizationConfig()).quantize_model, model)


def test_huge_finite_weight_is_not_called_nan():
    """Asymmetric scales need max - min, which overflows float32 for +-3e38 in one block."""
    model = Toy()
    with torch.no_grad():
        model.layers[0].up.weight[5, 0] = 3e38
        model.layers[0].up.weight[5, 1] = -3e38
    with pytest.raises(ValueError, match=r"cannot quantize layers.0.up: row 5 of the weight is "
                                         r"finite.*overflows float32.*symmetric=True") as e:
        _quiet(ModelQuantizer(QuantizationConfig(symmetric=False)).quantize_model, model)
    assert "NaN or Inf" not in str(e.value)
