"""peft's LoRA on the dtensor runtime, on 4 processes (tests/dtensor/lora_worker.py): after
``shard_adapters`` the adapters are DTensors placed as the plan says, and 8 AdamW steps give the
losses of transformers + peft on the CPU with the same adapters, under 2d (a split batch,
tensor-parallel blocks whose column and row linears carry adapters, and the lm_head's adapters
placed like its weight), fsdp, and on an int4 2d
base (QLoRA, against LoRA on the dequantized base). Only the adapters train; the base is
bit-identical afterwards; the adapter process 0 writes loads in plain transformers + peft, and
onto a fresh model on the 4 processes (``load_adapter``), and gives the trained model's logits.
Without ``shard_adapters`` several processes refuse by name (tests/dtensor/test_training.py)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from AutoXLA.runtimes.dtensor.launch import launch
from AutoXLA.testing.architectures import save_checkpoint

# fp32 on both sides: the sides differ by summation order only (row linears and row adapters
# summed over "model", gradients summed over the batch ranks), ~1e-7 of a loss near 5.6, which
# AdamW's normalised updates carry over 8 steps without amplifying much (as in
# test_training.py). A rank training its adapter alone or a missed sum moves a loss by > 1e-3
# relative; a gradient off by a constant factor does not (AdamW normalises it): GRAD_RTOL.
LOSS_RTOL = 1e-5
# The adapters' first gradients, each against its largest entry: fp32 sums in another order,
# ~1e-6 measured; one summed twice over "model" is off by 100 %, one of a rank's rows only by
# about half of it
GRAD_RTOL = 1e-4
# The adapter on the CPU against the same adapter on the 4 processes: fp32 logits near 1 in
# size; summation order only
LOGIT_ATOL = 1e-4
LAYERS = 2          # AutoXLA.testing.architectures' Llama
TARGETS = 7         # q, k, v, o, gate, up, down


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    checkpoint = str(save_checkpoint("Llama", root / "llama", seed=0))
    worker = os.path.join(os.path.dirname(__file__), "lora_worker.py")
    assert launch(4, [worker, checkpoint, str(root)], timeout=900) == [0] * 4
    return json.loads((root / "lora.json").read_text()), root, checkpoint


@pytest.mark.parametrize("case", ["2d", "fsdp", "2d-int4"])
def test_lora_on_four_processes_gives_transformers_and_peft_losses(runs, case):
    run = runs[0][case]
    if case.startswith("2d"):
        assert run["mesh"]["model"] > 1 and run["mesh"]["fsdp"] > 1, run["mesh"]
    else:
        assert run["mesh"] == dict(fsdp=4, model=1, data=1), run["mesh"]
    got, want = run["dtensor"], run["transformers"]
    assert all(abs(g - w) <= LOSS_RTOL * abs(w) for g, w in zip(got, want)), (got, want)
    assert got[-2] < got[0] - 0.01                        # it trains
    assert run["gradient"] <= GRAD_RTOL, run["gradient"]
    adapters = 2 * LAYERS * TARGETS + (2 if case == "2d" else 0)     # 2d: the head's A and B
    assert run["planned"] == run["trainable"] == run["optimizer_states"] == adapters
    assert run["trainable_all_lora"] and run["trainable_all_dtensors"]
    assert run["frozen_without_grads"] and run["base_unchanged"]
    assert run["quantized_layers"] == (LAYERS * TARGETS if case.endswith("int4") else 0)


def test_the_adapter_process_0_wrote_loads_in_transformers_and_peft(runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    results, root, checkpoint = runs
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32), str(root / "adapter"))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(results["batch"])).logits
    want = torch.tensor(results["2d"]["logits"])
    assert logits.shape == want.shape
    torch.testing.assert_close(logits, want, atol=LOGIT_ATOL, rtol=0)
    # and loaded back onto a fresh model on the 4 processes (load_adapter; peft's
    # PeftModel.from_pretrained would size the adapters by the local piece): the same logits
    assert results["2d"]["reloaded_all_dtensors"]
    torch.testing.assert_close(torch.tensor(results["2d"]["reloaded_logits"]), want,
                               atol=LOGIT_ATOL, rtol=0)
