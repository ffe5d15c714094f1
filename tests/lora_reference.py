"""The LoRA comparison both runtimes share: peft's adapters (r=8 on the seven projections), a
fixed AdamW run over two batches in turn, the adapters' first gradients, and the same run by plain
transformers + peft on the CPU. Used by tests/dtensor/lora_worker.py (the dtensor runtime's
processes) and bench/real_lora.py (the real SmolLM2 on either runtime)."""
from __future__ import annotations

from typing import Callable

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LR = 1e-3


def whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor on the host, whole: a DTensor gathered (a collective on every rank), an XLA
    tensor copied back."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def config(targets: list[str] = TARGETS):
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(targets))


def base_weights(model) -> dict[str, torch.Tensor]:
    """The base model's tensors on the host by transformers' per-layer names, peft's wrapping
    taken off (a scanned stack's state dict names them per layer too)."""
    return {n.replace("base_model.model.", "", 1).replace(".base_layer", ""): t.detach().cpu()
            for n, t in model.state_dict().items() if "lora_" not in n}


def trainable_gradients(model) -> dict[str, torch.Tensor]:
    """Each trainable parameter's gradient, whole, by its name."""
    return {n: whole(p.grad) for n, p in model.named_parameters() if p.requires_grad}


def train(model, batches, steps: int, device=None,
          after_step: Callable[[int], None] | None = None,
          gradients: Callable[[object], dict] = trainable_gradients,
          ) -> tuple[list[float], dict, torch.optim.Optimizer]:
    """The losses of ``steps`` AdamW steps on ``batches`` in turn, and the adapters' first
    gradients whole (``gradients(model)`` after the first backward): AdamW's normalised update
    hides a gradient off by a constant factor (one summed twice over "model"), so the gradients
    are compared too. ``after_step(step)`` runs after each update (the xla runtime ends its
    graph there)."""
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses, first = [], {}
    for step in range(steps):
        ids = batches[step % 2] if device is None else batches[step % 2].to(device)
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        if step == 0:
            first = gradients(model)
        opt.step()
        if after_step is not None:
            after_step(step)
        losses.append(float(loss.detach().cpu()))
    return losses, first, opt


def worst_gradient(got: dict, want: dict) -> float:
    """The largest |got - want| of any adapter's gradient, relative to that gradient's largest
    entry (inf when the two models' adapters differ)."""
    if set(got) != set(want):
        return float("inf")
    return max(float((got[n] - want[n]).abs().max() / want[n].abs().max()) for n in want)


def reference(checkpoint: str, batches, steps: int, dequantized: dict | None = None,
              targets: list[str] = TARGETS) -> tuple[list[float], dict]:
    """transformers + peft's eager run on the CPU, fp32, the same adapters (seeded by name);
    ``dequantized``: module name -> the weight AutoXLA's quantized linear dequantizes to, put in
    place of the checkpoint's (QLoRA's reference)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.helpers import seed_lora_adapters

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        for name, weight in (dequantized or {}).items():
            model.get_submodule(name).weight.copy_(weight)
    model = get_peft_model(model, config(targets))
    seed_lora_adapters(model)
    return train(model, batches, steps)[:2]
