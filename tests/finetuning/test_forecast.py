"""The fine-tuning forecast (`autoxla plan --train --lora-rank R [--bits 4]`) and the adapters'
placements, against what peft and torch allocate and save on the CPU, and against peft's own
count of LoRA parameters on Llama 2 7B."""
import json

import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model

from AutoXLA.cli import main
from AutoXLA.modeling.from_config import plan_from_config
from AutoXLA.planning.adapters import plan_adapters
from AutoXLA.planning.memory import (LayerShape, TrainingSetup, layer_saved_bytes_per_token,
                                     lora_saved_bytes_per_token, training_forecast)
from AutoXLA.testing.tiny import tiny_config

from ..helpers import saved_by_first_layer

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _with_adapters(plan, rank):
    import dataclasses

    return dataclasses.replace(plan, adapters=plan_adapters(plan, rank))


def test_frozen_base_adapters_gradients_and_states_are_what_peft_and_torch_allocate():
    # The reference: peft's LoRA on the tiny Llama on the CPU after one backward and one AdamW
    # step, every tensor's bytes summed. On one device the forecast must equal it exactly.
    config = tiny_config("llama")
    torch.manual_seed(0)
    model = get_peft_model(transformers.AutoModelForCausalLM.from_config(config),
                           LoraConfig(r=4, target_modules=TARGETS, lora_dropout=0.0))
    ids = torch.randint(0, config.vocab_size, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    opt.step()
    plan = _with_adapters(plan_from_config(config, "fsdp", 1, scan_layers=False), 4)
    lines = {x.name: x.bytes_per_device
             for x in training_forecast(plan, config, TrainingSetup(2, 8)).lines}
    base = [p for n, p in model.named_parameters() if "lora_" not in n]
    assert lines["adapters"] == _bytes(trainable) == plan.adapters.total_bytes()
    assert lines["gradients"] == _bytes(p.grad for p in model.parameters())   # adapters' only
    assert lines["optimizer (adamw)"] == _bytes(v for s in opt.state.values() for v in s.values())
    assert lines["frozen base"] == _bytes(base) + _bytes(model.buffers())
    assert "parameters" not in lines
    assert sorted(plan.adapters.targets) == sorted(TARGETS)


@pytest.mark.parametrize("tied", [False, True])
def test_the_head_s_adapters_when_named_are_peft_s_and_placed_like_the_head(tied):
    # peft wraps the lm_head only when target_modules names it (its "all-linear" leaves it
    # out); its count, from peft on the CPU, is the plan's; A is split like the head weight's
    # input dim, B like its output (vocab) dim, whether the head is tied to the embeddings or not
    config = tiny_config("llama")
    config.tie_word_embeddings = tied
    targets = TARGETS + ["lm_head"]
    model = get_peft_model(transformers.AutoModelForCausalLM.from_config(config),
                           LoraConfig(r=4, target_modules=targets, lora_dropout=0.0))
    plan = plan_from_config(config, "2d", 8)
    adapters = plan_adapters(plan, 4, targets=tuple(targets))
    assert adapters.parameters() == sum(p.numel() for p in model.parameters() if p.requires_grad)
    out_axis, in_axis = plan["lm_head.weight"].spec
    assert adapters.spec_of("lm_head", "lora_A") == (None, in_axis)
    assert adapters.spec_of("lm_head", "lora_B") == (out_axis, None)
    assert "lm_head" in adapters.targets and "lm_head" not in plan_adapters(plan, 4).targets


def test_llama2_7b_counts_peft_s_parameters_and_places_adapters_like_their_base(capsys):
    # Independent count: peft's print_trainable_parameters on Llama-2-7b with r=8 on the seven
    # projections says 19,988,480 (32 layers x 8 x (4 x (4096 + 4096) + 3 x (4096 + 11008))).
    assert main(["plan", "meta-llama/Llama-2-7b-hf", "--strategy", "2d", "--train", "--batch",
                 "8", "--seq", "256", "--lora-rank", "8", "--bits", "4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    adapters = d["adapters"]
    assert sum(t["shape"][0] * t["shape"][1] for t in adapters["tensors"]) == 19_988_480
    assert adapters["rank"] == 8 and adapters["dtype"] == "float32"
    assert d["stack"]["scanned"] is True           # the adapters stacked with their layers
    base = {t["name"]: t for t in d["tensors"]}
    for t in adapters["tensors"]:
        w = base[t["module"] + ".weight"]
        assert w["quant"].startswith("int4")
        if t["name"].endswith("lora_A.weight"):     # A [r, in]: in split like the base's in
            assert t["spec"] == [None, w["spec"][1]]
        else:                                       # B [out, r]: out split like the base's out
            assert t["spec"] == [w["spec"][0], None]
    lines = {x["name"]: x["bytes_per_device"] for x in d["forecast"]["lines"]}
    assert lines["frozen base"] == sum(t["bytes_per_device"] for t in d["tensors"]
                                       if not t["tied_to"])
    # 2d on 8 devices: every adapter split 2 or 4 ways, none whole
    assert lines["adapters"] == adapters["bytes_per_device"] < 19_988_480 * 4 / 2
    assert lines["gradients"] == lines["adapters"]
    n = len(adapters["tensors"])
    assert lines["optimizer (adamw)"] == 2 * lines["adapters"] + 4 * n
    assert "gathered weights" in lines and "activations" in lines


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_activations_with_lora_match_what_autograd_saves(dtype):
    # The reference: every storage autograd saves while one decoder layer with peft's adapters
    # (float32, as peft makes them) runs forward, weights and rotary tables excluded. The base
    # is frozen: its matmuls and norms save nothing for weight gradients; A saves its input
    # (cast to float32 when the model is bf16, one copy per projection in eager) and B saves A's
    # output. fp32 is exact (measured 1.000); bf16 measured 1.034: autograd keeps one more
    # head_dim-wide bf16 tensor in the attention than full training does, 3 % of the layer.
    # 1 % / 5 % catch any missing projection input (>= 6 % of the layer each).
    config = tiny_config("llama", num_hidden_layers=1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=TARGETS, lora_dropout=0.0))
    b, s = 2, 16
    saved = saved_by_first_layer(model.base_model.model.model, config.hidden_size, dtype, b, s)
    e = torch.empty((), dtype=dtype).element_size()
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    plan = _with_adapters(plan_from_config(config, "fsdp", 1, name, scan_layers=False), 4)
    shape = LayerShape.from_config(config)
    per_token = (layer_saved_bytes_per_token(shape, e)
                 + lora_saved_bytes_per_token(shape, plan.adapters, plan.dtype, 1))
    tolerance = 0.01 if dtype == torch.float32 else 0.05
    assert saved / (b * s * per_token) == pytest.approx(1.0, abs=tolerance), (saved, per_token)


@pytest.mark.parametrize("argv, message", [
    (["--lora-rank", "0"], "--lora-rank 0: give a rank >= 1"),
    (["--lora-rank", "8", "--infer", "--batch", "1", "--max-len", "64"], "merge the adapter"),
])
def test_bad_lora_forecast_arguments_are_named(capsys, argv, message):
    assert main(["plan", "meta-llama/Llama-2-7b-hf", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_scanned_plan_stacks_adapters_and_checkpoints_every_layer():
    # The adapters of a scanned stack are placed per layer as unrolled (stacked with the layer
    # axis unsplit, modeling/scan.py); its activations are the loop's: every layer's input kept,
    # one layer recomputed at a time, so they stay below the unrolled stack's.
    config = tiny_config("llama")
    scanned = _with_adapters(plan_from_config(config, "fsdp", 8), 8)
    unrolled = _with_adapters(plan_from_config(config, "fsdp", 8, scan_layers=False), 8)
    assert scanned.adapters == unrolled.adapters
    setup = TrainingSetup(4, 256)
    lines = {l.name: l for l in training_forecast(scanned, config, setup).lines}
    plain = {l.name: l for l in training_forecast(unrolled, config, setup).lines}
    assert "checkpointed per layer" in lines["activations"].formula
    assert lines["activations"].bytes_per_device < plain["activations"].bytes_per_device


def test_an_unrolled_quantized_step_counts_every_dequantized_weight_a_scanned_one_layers():
    # Measured on XLA:CPU (docs/finetuning.md, "Not yet"): an unrolled int4 LoRA step keeps
    # every quantized projection's weight dequantized in fp32 from its forward to its backward
    # (109 such buffers live at the peak of a 16-layer Llama's step); a scanned step one layer's
    # (its seven projections in fp32 at the peak of the same model's step). The reference: the
    # float model's own projections, on one device (nothing split), 4 bytes per weight.
    from AutoXLA.quantization import QuantizationConfig

    config = tiny_config("llama")
    quant = QuantizationConfig(bits=4)
    setup = TrainingSetup(2, 16)
    unrolled = _with_adapters(plan_from_config(config, "fsdp", 1, quantization_config=quant,
                                               scan_layers=False), 8)
    quantized = {t.name for t in unrolled.tensors if t.backend}
    float_model = transformers.AutoModelForCausalLM.from_config(config)
    want = sum(4 * m.weight.numel() for n, m in float_model.named_modules()
               if isinstance(m, torch.nn.Linear) and f"{n}.weight" in quantized)
    assert want and len(quantized) == 2 * len(TARGETS)          # 2 layers x 7 projections
    lines = {l.name: l.bytes_per_device for l in training_forecast(unrolled, config, setup).lines}
    assert lines["dequantized weights"] == want
    scanned = _with_adapters(plan_from_config(config, "fsdp", 1, quantization_config=quant), 8)
    assert scanned.stack is not None and scanned.stack.scanned and scanned.stack.start == 0
    lines = {l.name: l.bytes_per_device for l in training_forecast(scanned, config, setup).lines}
    assert lines["dequantized weights"] == want // config.num_hidden_layers    # one layer's
    checkpointed = training_forecast(unrolled, config, TrainingSetup(2, 16, grad_ckpt=True))
    assert {l.name: l.bytes_per_device for l in checkpointed.lines}[
        "dequantized weights"] == want // config.num_hidden_layers
    eight = _with_adapters(plan_from_config(config, "fsdp", 8, quantization_config=quant,
                                            scan_layers=False), 8)
    split = {l.name: l.bytes_per_device for l in training_forecast(eight, config, setup).lines}
    assert want // 8 <= split["dequantized weights"] < want     # split like the codes
