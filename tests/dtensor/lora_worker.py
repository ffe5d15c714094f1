"""One process (a world of one) of tests/dtensor/test_lora.py: peft's LoRA on a model the dtensor
runtime loaded and on plain transformers, the same adapters, 8 AdamW steps each; writes both
runs' losses to OUT/lora.json."""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def train(model, batches) -> list[float]:
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for step in range(8):
        ids = batches[step % 2]
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def main(checkpoint: str, out: str) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from AutoXLA.modeling import AutoXLAModelForCausalLM
    from tests.helpers import seed_lora_adapters

    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(3, 250, (8, 16), generator=g) for _ in range(2)]
    runs = {}
    for side in ("transformers", "dtensor"):
        model = (AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
                 if side == "transformers" else
                 AutoXLAModelForCausalLM.from_pretrained(checkpoint, runtime="dtensor",
                                                         sharding_strategy="fsdp",
                                                         dtype=torch.float32))
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj", "down_proj"]))
        seed_lora_adapters(model)
        runs[side] = train(model, batches)
    with open(os.path.join(out, "lora.json"), "w") as f:
        json.dump(runs, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
