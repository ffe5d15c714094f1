"""One rank of the dtensor runtime's matrix (tests/dtensor/test_matrix.py starts 8 of them).

For each architecture: transformers' model on the CPU in fp32 is the reference (``reference``,
computed once by the test's own process and read here from CASE["reference"]); for each strategy the checkpoint is
loaded with ``runtime="dtensor"`` and this rank writes what it saw to OUT/<arch>-<strategy>-<rank>.json:
its placements and blocks against the plan (rank 0: the plan's JSON), the bytes it read, the logits' and the loss's
differences, every gradient's, and whether 16 greedy tokens equal transformers'; and for the
quantized cases, the logits against transformers on the round-tripped weights and the float SQNR.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.helpers import sqnr_db  # noqa: E402  (the checkout's tests package, by path)

TRAIN_BATCH = 8          # divides data x fsdp under every strategy: the split-rows path
GENERATE_BATCH = 3       # divides none: the path where every rank computes every row
NEW_TOKENS = 16


def reference_model(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                attn_implementation="eager")


def reference(checkpoint):
    torch.manual_seed(0)
    model = reference_model(checkpoint)
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


def layout(model) -> tuple[list[str], int]:
    """(every tensor whose placements or local block differ from the plan's, the bytes this
    rank's blocks of the checkpoint's tensors hold)."""
    from torch.distributed.tensor import DTensor

    from AutoXLA.runtimes.dtensor.placements import local_block, placements_for, planned_block
    from AutoXLA.state import state_of

    plan, mesh, rank = state_of(model).plan, state_of(model).mesh, dist.get_rank()
    wrong, expected_bytes = [], 0
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    for t in plan:
        if t.tied_to:
            continue
        value = tensors[t.name]
        if not isinstance(value, DTensor):
            wrong.append(f"{t.name}: not a DTensor")
            continue
        got = (tuple(value.placements), local_block(t.shape, value.device_mesh, value.placements))
        want = (placements_for(t.spec), planned_block(t.spec, mesh, t.shape, rank))
        if got != want or tuple(value.to_local().shape) != want[1][0]:
            wrong.append(f"{t.name}: {got} != plan's {want}")
        if t.persistent:
            expected_bytes += t.bytes_per_device
    return wrong, expected_bytes


def check_quantized(checkpoint, strategy, bits, ref, saved=None, activations=False) -> dict:
    """int8 per channel or int4 in blocks of 32 (no scale search: the reference has none): the
    logits against transformers with every quantized weight replaced by its round trip through
    tests/reference_quant.py, and against the float model (SQNR). With ``saved``, the model is
    that quantized checkpoint (written by `autoxla quantize`, the bytes the xla runtime's
    save_pretrained writes) loaded as it is. With ``activations``, W8A8 (int8 per channel):
    the reference quantizes each linear's activation rows too, as torch_xla's op does."""
    from AutoXLA.modeling import AutoXLAModelForCausalLM
    from AutoXLA.quantization import QuantizationConfig
    from AutoXLA.quantization.linear import QuantizedLinear
    from tests.reference_quant import quantized_reference, w8a8_reference

    if saved:
        model = AutoXLAModelForCausalLM.from_pretrained(saved, sharding_strategy=strategy,
                                                        runtime="dtensor", dtype=torch.float32)
    else:
        cfg = QuantizationConfig(bits=bits, block_size=32 if bits == 4 else -1, scale_search=False,
                                 quantize_activation=activations)
        model = AutoXLAModelForCausalLM.from_pretrained(checkpoint, sharding_strategy=strategy,
                                                        runtime="dtensor", dtype=torch.float32,
                                                        do_quant=True, quantization_config=cfg)
    wrong_layout, _ = layout(model)
    rounded = (w8a8_reference if activations else quantized_reference)(
        reference_model(checkpoint), model)
    with torch.no_grad():
        got = model(ref["ids"]).logits
        want = rounded(ref["ids"]).logits
    return dict(wrong_layout=wrong_layout,
                logits_diff=float((got - want).abs().max()), logits_scale=float(want.abs().max()),
                sqnr_db=sqnr_db(ref["logits"], got), reference_sqnr_db=sqnr_db(want, got),
                backends=sorted({m.backend for m in model.modules()
                                 if isinstance(m, QuantizedLinear)}))


def check(checkpoint, strategy, ref) -> dict:
    from AutoXLA.modeling import AutoXLAModelForCausalLM
    from AutoXLA.state import state_of

    model = AutoXLAModelForCausalLM.from_pretrained(checkpoint, sharding_strategy=strategy,
                                                    runtime="dtensor", dtype=torch.float32)
    plan, rank = state_of(model).plan, dist.get_rank()
    wrong_layout, expected_bytes = layout(model)
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
        ref = torch.load(case["reference"], weights_only=True)
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
        for strategy, bits, saved, activations in case.get("quantized", []):
            try:
                result = check_quantized(case["checkpoint"], strategy, bits, ref, saved,
                                         activations)
            except Exception as e:
                result = dict(error=f"{type(e).__name__}: {e}")
                import traceback
                traceback.print_exc()
            label = "w8a8" if activations else f"int{bits}-saved" if saved else f"int{bits}"
            path = os.path.join(out_dir, f"{case['name']}-{strategy}-{label}-{rank}.json")
            with open(path, "w") as f:
                json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
