"""TRL's SFTTrainer driving a model AutoXLA loaded (issue 45), on the tiny Llama with SmolLM2's
real tokenizer and chat template, 8 XLA:CPU devices, fsdp, with TRL's defaults (gradient
checkpointing on) except ``bf16=False`` (TRL autocasts to bf16 by default: fp32 on both sides is
what lets the losses be compared to 1e-5), and the two settings docs/finetuning.md says a
sharded model needs:

- ``optim="adamw_torch"``: transformers' default, fused AdamW, has no XLA kernel;
- ``pad_to_multiple_of`` (with ``max_length``): TRL pads each batch to its longest sequence, and
  every new length is a new XLA program.

The reference is the same SFTTrainer run on plain transformers + peft on the CPU, in a child
process (accelerate's state is one per process, and it must not see torch_xla there).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ..helpers import arithmetic_chat, seed_lora_adapters

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEPS = 6
# fp32 both sides, the same batches and adapters: summation order (sharded matmuls, a
# recomputed forward) only, ~1e-7 of a loss near 11, carried through AdamW over 6 steps. The
# adapters start seeded (B non-zero) because with peft's zero B, AdamW's first update divides
# gradients of ~1e-9 by themselves and turns last-bit differences into 1e-4 (observed).
LOSS_RTOL = 1e-5
SETTINGS = dict(optim="adamw_torch", pad_to_multiple_of=64, max_length=64, bf16=False)


def sft(model, tokenizer, out_dir, **settings):
    """SFTTrainer on ``model`` (wrapped with seeded LoRA adapters here): (losses per step,
    programs compiled per step or None off XLA, the trainer)."""
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS,
                                             lora_dropout=0.0))
    seed_lora_adapters(model)
    args = SFTConfig(output_dir=str(out_dir), max_steps=STEPS, per_device_train_batch_size=4,
                     learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
                     seed=0, **settings)
    trainer = SFTTrainer(model=model, args=args,
                         train_dataset=Dataset.from_list(arithmetic_chat(32)),
                         processing_class=tokenizer)
    if model.device.type == "xla":       # the recipe's optional step: adapters placed by the plan
        from AutoXLA.training import shard_adapters
        shard_adapters(trainer.model)
    counts = []

    class Programs(TrainerCallback):
        def on_step_end(self, *_, **__):
            if model.device.type == "xla":
                counts.append(_compile_count(model))

    trainer.add_callback(Programs())
    before = _compile_count(model)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    per_step = [b - a for a, b in zip([before, *counts], counts)] if counts else None
    return losses, per_step, trainer


def _compile_count(model) -> int:
    if model.device.type != "xla":
        return 0
    from AutoXLA import backend      # not in the child, which must not import torch_xla
    return backend.compile_count()


def reference(path: str, out_dir: str) -> list[float]:
    """The child's run: plain transformers + peft, SFTTrainer on the CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    losses, _, _ = sft(model, AutoTokenizer.from_pretrained(path), out_dir, use_cpu=True,
                       **SETTINGS)
    return losses


@pytest.fixture(scope="module")
def trl_reference(chat_checkpoint, tmp_path_factory):
    """The losses of SFTTrainer on plain transformers + peft on the CPU (a child without
    torch_xla), started at once and read when first needed."""
    path, _ = chat_checkpoint
    env = {**os.environ, "USE_TORCH_XLA": "0", "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", "import json, sys; from tests.finetuning.test_trl import reference; "
         "print('LOSSES', json.dumps(reference(sys.argv[1], sys.argv[2])))", str(path),
         str(tmp_path_factory.mktemp("trl") / "reference")], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    losses = []

    def read():
        if not losses:
            out, _ = child.communicate(timeout=600)
            assert child.returncode == 0, out[-3000:]
            losses.extend(json.loads(next(line for line in out.splitlines()
                                          if line.startswith("LOSSES"))[7:]))
        return losses
    yield read
    child.kill()


@pytest.mark.parametrize("scanned", [False, True])
def test_sft_trainer_trains_an_autoxla_model_like_transformers(scanned, chat_checkpoint,
                                                               trl_reference, tmp_path,
                                                               xla_devices):
    from AutoXLA.modeling import AutoXLAModelForCausalLM

    path, tokenizer = chat_checkpoint
    model = AutoXLAModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                    sharding_strategy="fsdp", scan_layers=scanned)
    losses, per_step, trainer = sft(model, tokenizer, tmp_path / "autoxla", **SETTINGS)
    want = trl_reference()

    # TRL's default: unrolled, through torch_xla's checkpoint; scanned, the loop's own recompute
    assert trainer.args.gradient_checkpointing
    if scanned:
        assert model.model.layers.last_mode == "scanned"
    assert len(losses) == len(want) == STEPS
    assert all(abs(g - w) <= LOSS_RTOL * abs(w) for g, w in zip(losses, want)), (losses, want)
    assert losses[-1] < losses[0]
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # One batch shape (padded to 64): the first steps compile (forward and backward with the
    # checkpointed layers, the optimizer's first and later updates, TRL's logged metrics); the
    # rest reuse those programs.
    assert sum(per_step[3:]) == 0, per_step
