"""The main job on the embedded default model: checkpoint -> plan -> sharded load -> generate ->
check against plain transformers. Run with `autoxla demo` (see README)."""
from __future__ import annotations

import time
from pathlib import Path

import torch

DEFAULT_FAMILY = "llama"
NEW_TOKENS = 8


def run_demo(directory, strategy: str = "2d") -> bool:
    from transformers import AutoModelForCausalLM

    from . import backend
    from .modeling import AutoXLAModelForCausalLM
    from .tiny import save_tiny_checkpoint

    path = save_tiny_checkpoint(DEFAULT_FAMILY, Path(directory) / f"tiny-{DEFAULT_FAMILY}")
    print(f"checkpoint: {path} ({len(list(path.glob('*.safetensors')))} safetensors shards)")
    t0 = time.perf_counter()
    model = AutoXLAModelForCausalLM.from_pretrained(path, sharding_strategy=strategy)
    print(model.autoxla_plan)
    print(f"loaded on {backend.device_count()} XLA devices in {time.perf_counter() - t0:.2f} s")

    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [0, 0, 3, 4, 5, 6, 7, 8]])
    mask = (ids != 0).long()
    args = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
    dev = backend.device()
    got = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), **args).cpu()
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = reference.generate(input_ids=ids, attention_mask=mask, **args)
    print("generated (sharded):     ", got[:, ids.shape[1]:].tolist())
    print("generated (transformers):", expected[:, ids.shape[1]:].tolist())
    ok = torch.equal(got, expected)
    print("OK: sharded generation equals plain transformers" if ok else
          "MISMATCH: sharded generation differs from plain transformers")
    return ok
