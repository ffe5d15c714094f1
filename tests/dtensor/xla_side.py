"""The xla runtime's half of the cross-runtime checks (tests/dtensor/test_training.py), run by the
xla runtime's interpreter (torch 2.9 + torch_xla, 8 virtual CPU devices) on what the dtensor
runtime wrote, and writing what the dtensor runtime then reads:

1. ``from_pretrained`` of the dtensor runtime's save_pretrained output: logits against plain
   transformers on the same directory; and this runtime's own save_pretrained of the job's
   checkpoint as loaded (float over fsdp, int4 over 2d, the scanned stack by default), which the
   test compares with the dtensor runtime's byte for byte; the job's sampled request through
   the float model's ``generate`` (tokens and buckets);
2. TrainingCheckpoints.restore of the dtensor runtime's step 2 into a model on this runtime, then
   steps 3-4 (or the error it gives);
3. steps 1-2 on this runtime from the start, committed as step 2 for the dtensor runtime to resume.

Writes OUT/xla.json.
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def load(path: str):
    from AutoXLA.modeling import AutoXLAModelForCausalLM

    # Unscanned: a training checkpoint carries the model's own names, and the dtensor runtime's
    # decoder layers are transformers' (TrainingCheckpoints names the scan_layers mismatch)
    model = AutoXLAModelForCausalLM.from_pretrained(path, sharding_strategy="fsdp", runtime="xla",
                                                    dtype=torch.float32, scan_layers=False)
    model.train()
    return model


def steps(model, optimizer, batches) -> list[float]:
    from AutoXLA import backend

    losses = []
    for ids in batches:
        ids = torch.tensor(ids).to(backend.device())
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        backend.sync()
        losses.append(loss.item())
    return losses


def sampled(model, job: dict) -> dict:
    from AutoXLA.state import state_of

    with torch.no_grad():
        tokens = model.generate(input_ids=torch.tensor(job["prompts"]),
                                attention_mask=torch.tensor(job["mask"]), **job["sample"])
    stats = state_of(model).last_generate
    return dict(tokens=tokens.cpu().tolist(),
                buckets=[stats.batch_bucket, stats.prompt_bucket, stats.cache_length])


def main(job_file: str, out: str) -> None:
    from transformers import AutoModelForCausalLM

    from AutoXLA import backend
    from AutoXLA.modeling import AutoXLAModelForCausalLM
    from AutoXLA.quantization import QuantizationConfig
    from AutoXLA.saving import TrainingCheckpointError, TrainingCheckpoints

    job = json.loads(open(job_file).read())
    result = {"torch": torch.__version__}

    saved = os.path.join(out, "saved-float")
    ids = torch.tensor(job["batches"][0])
    reference = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    model = load(saved).eval()
    with torch.no_grad():
        want = reference(ids).logits
        got = model(ids.to(backend.device())).logits.cpu()
    result["logits_diff"] = float((got - want).abs().max())
    result["logits_scale"] = float(want.abs().max())
    del model
    quantized = dict(do_quant=True, quantization_config=QuantizationConfig(
        bits=4, block_size=32, scale_search=False))
    for name, strategy, kwargs in (("float", "fsdp", {}), ("int4", "2d", quantized)):
        model = AutoXLAModelForCausalLM.from_pretrained(job["checkpoint"], runtime="xla",
                                                        sharding_strategy=strategy,
                                                        dtype=torch.float32, **kwargs)
        model.save_pretrained(os.path.join(out, f"xla-saved-{name}"))
        if name == "float":
            result["sampled"] = sampled(model, job)
        del model

    model = load(job["checkpoint"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=job["lr"])
    try:
        step = TrainingCheckpoints(job["dtensor_steps"]).restore(model, optimizer)
        result["resumed"] = dict(step=step, losses=steps(model, optimizer, job["batches"][step:]))
    except TrainingCheckpointError as e:
        result["resumed"] = dict(error=str(e))
    del model, optimizer

    model = load(job["checkpoint"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=job["lr"])
    result["first_losses"] = steps(model, optimizer, job["batches"][:2])
    TrainingCheckpoints(job["xla_steps"]).save(2, model, optimizer)

    with open(os.path.join(out, "xla.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
