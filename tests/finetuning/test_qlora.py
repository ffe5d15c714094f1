"""QLoRA: peft's LoRA on AutoXLA's int4 / int8 quantized linears, through peft's extension point
(``AutoXLA.training.qlora(config)``), on the xla runtime (issue 45).

The reference is plain transformers + peft on the CPU with each quantized projection's weight
replaced by what AutoXLA's quantized linear dequantizes to (the same base, in float): 20 AdamW
steps on fixed batches give the same losses, the decoder stack unrolled or scanned (the adapters
stacked beside the stacked codes); only the adapters train; the quantized base (codes, scales) is
bit-identical afterwards; no step after the first two compiles; merging is refused.
"""
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from AutoXLA import backend
from AutoXLA.modeling import AutoXLAModelForCausalLM
from AutoXLA.quantization import QuantizationConfig
from AutoXLA.quantization.linear import QuantizedLinear
from AutoXLA.training import merge_and_save, qlora, quantized_lora_linear, shard_adapters

from ..helpers import seed_lora_adapters
from ..lora_reference import TARGETS, base_weights, config
from .test_lora import STEPS, _train

# fp32 on both sides and the same float base: our quantized linear computes x @ dequant(W) on
# the device where the reference multiplies by the dequantized copy, so the losses differ by
# summation order only (~1e-7 of a loss near 7.4), as in test_lora.py. A lost adapter gradient,
# a base that moved or an adapter skipped on a quantized layer moves a loss by > 1e-3 relative.
LOSS_RTOL = 1e-5


def _reference_losses(path: str, dequantized: dict) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for name, weight in dequantized.items():
            model.get_submodule(name).weight.copy_(weight)
    model = get_peft_model(model, config())
    seed_lora_adapters(model)
    model.train()
    return _train(model, torch.device("cpu"))[0]


@pytest.mark.parametrize("bits,strategy,scanned", [(4, "fsdp", False), (4, "2d", False),
                                                   (8, "fsdp", False), (4, "2d", True)])
def test_qlora_steps_give_the_losses_of_lora_on_the_dequantized_base(bits, strategy, scanned,
                                                                       checkpoints, xla_devices):
    path = checkpoints["llama"]
    model = AutoXLAModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, sharding_strategy=strategy, scan_layers=scanned, do_quant=True,
        quantization_config=QuantizationConfig(bits=bits))
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert {n.rsplit(".", 1)[1] for n in quantized} == set(TARGETS)
    dequantized = {n: m.dequantized_weight(torch.float32).cpu() for n, m in quantized.items()}
    base = base_weights(model)         # the quantized codes and scales among them

    model = get_peft_model(model, qlora(config()))
    wrapped = [m for m in model.modules() if isinstance(m, quantized_lora_linear())]
    assert len(wrapped) == len(quantized)
    seed_lora_adapters(model)
    if scanned:                         # the adapters stacked beside the stacked int codes
        shard_adapters(model)
    model.train()
    compiles = []
    losses, opt = _train(model, backend.device(), compiles)

    want = _reference_losses(path, dequantized)
    assert all(abs(g - w) <= LOSS_RTOL * abs(w) for g, w in zip(losses, want)), (losses, want)
    assert losses[-1] < losses[0] - 0.1                 # the adapters do learn
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)
    assert len(opt.state) == len(trainable)             # optimizer state for the adapters only
    after = base_weights(model)
    assert set(after) == set(base) and any(t.dtype in (torch.int8, torch.uint8)
                                           for t in base.values())
    assert all(torch.equal(after[n], t) for n, t in base.items())
    assert sum(compiles[2:]) == 0, compiles
    if scanned:
        assert model.get_base_model().model.layers.last_mode == "scanned"


def test_unsupported_variants_and_merging_are_refused_by_name(checkpoints, xla_devices):
    model = AutoXLAModelForCausalLM.from_pretrained(
        checkpoints["llama"], dtype=torch.float32, sharding_strategy="fsdp", scan_layers=False,
        do_quant=True, quantization_config=QuantizationConfig(bits=4))
    with pytest.raises(ValueError, match="does not support use_dora"):
        get_peft_model(model, qlora(LoraConfig(r=4, target_modules=["q_proj"], use_dora=True)))
    model = get_peft_model(model, qlora(config()))
    with pytest.raises(ValueError, match="cannot merge a LoRA adapter into AutoXLA's quantized"):
        model.merge_and_unload()
    with pytest.raises(ValueError, match="wraps a quantized base.*autoxla merge FLOAT_DIR"):
        merge_and_save(model, "/nonexistent/never-written")
