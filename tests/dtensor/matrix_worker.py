"""One rank of the dtensor runtime's matrix (tests/dtensor/test_matrix.py starts 8 of them).

For each architecture: transformers' model on the CPU in fp32 is the reference (every rank
computes it, so no reference crosses a process boundary); for each strategy the checkpoint is
loaded with ``runtime="dtensor"`` and this rank writes what it saw to OUT/<arch>-<strategy>-<rank>.json:
its placements and blocks against the plan (rank 0: the plan's JSON), the bytes it read, the logits' and the loss's
differences, every gradient's, and whether 16 greedy tokens equal transformers'.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

TRAIN_BATCH = 8          # divides data x fsdp under every strategy: the split-rows path
GENERATE_BATCH = 3       # divides none: the path where every rank computes every row
NEW_TOKENS = 16


def reference(checkpoint):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                 attn_implementation="eager")
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab - 3, (TRAIN_BATCH, 12))
    labels = ids.clone()
    labels[0, :5] = -100                  # masked prompt tokens, as fine-tuning has
    prompts = torch.randint(3, vocab - 3, (GENERATE_BATCH, 12))
    out = model(ids, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        tokens = model.generate(prompts, attention_mask=torch.ones_like(prompts),
                                max_new_tokens=NEW_TOKENS, do_sample=False,
                                min_new_tokens=NEW_TOKENS)
    return dict(ids=ids, labels=labels, prompts=prompts, logits=out.logits.detach(),
                loss=out.loss.detach(), grads=grads, tokens=tokens)


def check(checkpoint, strategy, ref) -> dict:
    from torch.distributed.tensor import DTensor

    from AutoXLA.modeling import AutoXLAModelForCausalLM
    from AutoXLA.runtimes.dtensor.placements import local_block, placements_for, planned_block
    from AutoXLA.state import state_of

    model = AutoXLAModelForCausalLM.from_pretrained(checkpoint, sharding_strategy=strategy,
                                                    runtime="dtensor", dtype=torch.float32)
    plan, mesh, rank = state_of(model).plan, state_of(model).mesh, dist.get_rank()
    wrong_layout, expected_bytes = [], 0
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    for t in plan:
        if t.tied_to:
            continue
        value = tensors[t.name]
        if not isinstance(value, DTensor):
            wrong_layout.append(f"{t.name}: not a DTensor")
            continue
        got = (tuple(value.placements), local_block(t.shape, value.device_mesh, value.placements))
        want = (placements_for(t.spec), planned_block(t.spec, mesh, t.shape, rank))
        if got != want or tuple(value.to_local().shape) != want[1][0]:
            wrong_layout.append(f"{t.name}: {got} != plan's {want}")
        if t.persistent:
            expected_bytes += t.bytes_per_device
    out = model(ref["ids"], labels=ref["labels"])
    out.loss.backward()
    grad_diff, grad_scale, wrong_grads = 0.0, 0.0, []
    for name, p in model.named_parameters():
        if p.grad is None:
            wrong_grads.append(f"{name}: no gradient")
            continue
        if tuple(p.grad.placements) != tuple(p.placements):
            wrong_grads.append(f"{name}: gradient {p.grad.placements} != {p.placements}")
        want = ref["grads"][name]
        grad_diff = max(grad_diff, float((p.grad.full_tensor() - want).abs().max()))
        grad_scale = max(grad_scale, float(want.abs().max()))
    with torch.no_grad():
        tokens = model.generate(ref["prompts"], attention_mask=torch.ones_like(ref["prompts"]),
                                max_new_tokens=NEW_TOKENS, do_sample=False,
                                min_new_tokens=NEW_TOKENS)
    return dict(
        mesh=str(plan.mesh), wrong_layout=wrong_layout, wrong_grads=wrong_grads,
        bytes_read=state_of(model).load.bytes_read, expected_bytes=expected_bytes,
        logits_diff=float((out.logits.detach() - ref["logits"]).abs().max()),
        logits_scale=float(ref["logits"].abs().max()),
        loss=float(out.loss.detach()), reference_loss=float(ref["loss"]),
        grad_diff=grad_diff, grad_scale=grad_scale,
        tokens_equal=bool(torch.equal(tokens, ref["tokens"])),
        tokens=tokens.tolist(), reference_tokens=ref["tokens"].tolist(),
        plan=plan.to_json() if rank == 0 else None)


def main(out_dir: str, cases: str) -> None:
    from AutoXLA.runtimes.dtensor.process import ensure_process_group

    ensure_process_group("cpu")
    rank = dist.get_rank()
    for case in json.loads(cases):
        ref = reference(case["checkpoint"])
        for strategy in case["strategies"]:
            try:
                result = check(case["checkpoint"], strategy, ref)
            except Exception as e:   # reported per case; the other ranks fail the same way
                result = dict(error=f"{type(e).__name__}: {e}")
                import traceback
                traceback.print_exc()
            path = os.path.join(out_dir, f"{case['name']}-{strategy}-{rank}.json")
            with open(path, "w") as f:
                json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
