"""AutoXLA.utils.prepare_model_for_checkpoint: a sharded (scanned, quantized) model becomes a
plain transformers model on the CPU that transformers' save_pretrained / from_pretrained
round-trip."""
import json

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from AutoXLA.modeling import AutoXLAModelForCausalLM
from AutoXLA.modeling.scan import StackedDecoderLayers
from AutoXLA.quantization.linear import QuantizedLinear
from AutoXLA.testing.tiny import available_families
from AutoXLA.utils import prepare_model_for_checkpoint
from tests.helpers import assert_close

# llama: a scanned stack to unstack; gemma2: tied embeddings (saved once, tied again) and soft-caps.
FAMILIES = [f for f in ("llama", "gemma2") if f in available_families()]


def _logits(model, ids, mask):
    dev = next(model.parameters()).device
    with torch.no_grad():
        return model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits.cpu()


def _is_plain_cpu_model(model):
    tensors = [*model.parameters(), *model.buffers()]
    assert {t.device.type for t in tensors} == {"cpu"}
    assert not any(isinstance(m, (StackedDecoderLayers, QuantizedLinear)) for m in model.modules())
    assert model.config._attn_implementation == "eager"
    assert not any(hasattr(m, "autoxla_attention") for m in model.modules())
    # transformers' own generate (and, unquantized, its own save_pretrained), not AutoXLA's.
    assert "generate" not in vars(model) and not hasattr(model, "autoxla_plan")


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_model_becomes_the_checkpoints_transformers_model(
        family, checkpoints, reference_models, batch, xla_devices, tmp_path):
    model = AutoXLAModelForCausalLM.from_pretrained(
        checkpoints[family], sharding_strategy="2d", attn_implementation="splash_attention")
    plain = prepare_model_for_checkpoint(model)
    _is_plain_cpu_model(plain)
    reference = reference_models(family)
    assert type(plain) is type(reference)
    # The weights are gathered bit for bit: every tensor of the checkpoint, under its name.
    expected_state = reference.state_dict()
    state = plain.state_dict()
    assert state.keys() == expected_state.keys()
    for name, t in expected_state.items():
        assert torch.equal(state[name], t), name
    if reference.config.tie_word_embeddings:
        assert plain.lm_head.weight is plain.get_input_embeddings().weight
    # Same weights, same eager code on the CPU: the logits are the reference's exactly.
    ids, mask = batch
    expected = reference(input_ids=ids, attention_mask=mask).logits.detach()
    assert torch.equal(_logits(plain, ids, mask), expected)
    assert "save_pretrained" not in vars(plain)
    plain.save_pretrained(tmp_path)       # transformers' own save
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert torch.equal(_logits(reloaded, ids, mask), expected)
    # The sharded model is left as it was.
    assert model.config._attn_implementation == "autoxla_splash"
    assert next(model.parameters()).device.type == "xla"


@pytest.fixture(scope="module")
def int8_llama(checkpoints, xla_devices, tmp_path_factory):
    """llama int8 from an AutoXLA-saved quantized checkpoint (its config.json carries
    quantization_config, which transformers could not load)."""
    saved = tmp_path_factory.mktemp("int8")
    AutoXLAModelForCausalLM.from_pretrained(
        checkpoints["llama"], sharding_strategy="2d", do_quant=True).save_pretrained(saved)
    return AutoXLAModelForCausalLM.from_pretrained(saved, sharding_strategy="2d")


def test_int8_model_dequantized(int8_llama, batch, tmp_path):
    ids, mask = batch
    quantized = _logits(int8_llama, ids, mask)
    plain = prepare_model_for_checkpoint(int8_llama, dequantize=True)
    _is_plain_cpu_model(plain)
    layers = int8_llama.autoxla_quantization.layers
    assert layers and all(type(plain.get_submodule(n)) is nn.Linear for n in layers)
    # The dequantized weights are the values the quantized layers compute with, so the only
    # difference is fp32 summation order (sharded matmuls vs CPU ones): the logits tolerance.
    got = _logits(plain, ids, mask)
    assert_close(got, quantized, what="dequantized vs int8 logits")
    plain.save_pretrained(tmp_path)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert torch.equal(_logits(reloaded, ids, mask), got)


def test_int8_model_kept_quantized(int8_llama, batch, tmp_path):
    ids, mask = batch
    kept = prepare_model_for_checkpoint(int8_llama, dequantize=False)
    layers = int8_llama.autoxla_quantization.layers
    assert all(isinstance(kept.get_submodule(n), QuantizedLinear) for n in layers)
    for n in layers:    # the quantized values themselves, gathered
        assert torch.equal(kept.get_submodule(n).weight, int8_llama.get_submodule(n).weight.cpu())
    assert {t.device.type for t in kept.state_dict().values()} == {"cpu"}
    assert_close(_logits(kept, ids, mask), _logits(int8_llama, ids, mask),
                 what="CPU int8 copy vs int8 logits")
    kept.save_pretrained(tmp_path)        # AutoXLA's: it records the quantization
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["quantization_config"]["n_bits"] == 8
    reloaded = AutoXLAModelForCausalLM.from_pretrained(tmp_path, sharding_strategy="2d")
    assert torch.equal(_logits(reloaded, ids, mask), _logits(int8_llama, ids, mask))


def test_quantized_experts_dequantized(tmp_path, xla_devices):
    # gpt-oss keeps its experts [experts, in, out] (quantized as [experts, out, in]): the copy
    # holds them in transformers' layout again, and transformers itself loads what it saves.
    from AutoXLA.testing.architectures import save_checkpoint
    from AutoXLA.quantization import QuantizationConfig
    from AutoXLA.quantization.experts import QuantizedExperts

    src = save_checkpoint("gpt-oss", tmp_path / "src")
    model = AutoXLAModelForCausalLM.from_pretrained(
        src, sharding_strategy="2d", do_quant=True, quantization_config=QuantizationConfig(bits=4))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    mask = torch.ones_like(ids)
    plain = prepare_model_for_checkpoint(model)
    _is_plain_cpu_model(plain)
    assert not any(isinstance(m, QuantizedExperts) for m in plain.modules())
    experts = plain.model.layers[0].mlp.experts
    assert isinstance(experts.gate_up_proj, nn.Parameter) and experts.is_transposed
    got = _logits(plain, ids, mask)
    assert_close(got, _logits(model, ids, mask), what="dequantized vs int4 experts logits")
    plain.save_pretrained(tmp_path / "plain")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", attn_implementation="eager")
    # transformers' own experts forward: the same sums in another order.
    assert_close(_logits(reloaded, ids, mask), got, what="transformers reload logits")
