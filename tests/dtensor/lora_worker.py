"""One rank of tests/dtensor/test_lora.py: peft's LoRA on a model the dtensor runtime loaded, on
4 processes, against plain transformers + peft on the CPU (run by every rank, the same on each),
the same adapters and batches, 8 AdamW steps each. Cases: float 2d (fsdp x model: a split batch
and tensor-parallel blocks whose column and row linears carry adapters), float fsdp, and QLoRA
on an int4 2d base (the reference: transformers with each projection's weight replaced by what
AutoXLA's quantized linear dequantizes to). The float 2d case wraps the lm_head too (its
adapters placed like the head's weight). Process 0 writes OUT/lora.json and, for the float 2d
case, the adapter in peft's format (OUT/adapter) with the trained model's logits. With a third
argument (``real``), bench/real_lora.py's run instead: the real SmolLM2, 20 steps under 2d and
fsdp, the reference on process 0 only, OUT/real.json. The loop and the reference are
tests/lora_reference.py's, shared with the xla runtime's run of the bench."""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.lora_reference import (TARGETS, config, reference, train, whole,  # noqa: E402
                                  worst_gradient)

STEPS = 8


def case(checkpoint: str, strategy: str, bits, batches, out: str | None,
         steps: int = STEPS, every_rank: bool = True, targets=TARGETS) -> dict:
    """One case's result (process 0's is written). ``every_rank=False``: only process 0 runs
    the CPU reference (no collectives in it), the others report their own numbers unchecked.
    ``targets``: the modules LoRA wraps (the lm_head too in the float 2d case)."""
    from peft import get_peft_model

    from AutoXLA.modeling import AutoXLAModelForCausalLM
    from AutoXLA.quantization import QuantizationConfig
    from AutoXLA.quantization.linear import QuantizedLinear
    from AutoXLA.quantization.packing import dequantize
    from AutoXLA.state import state_of
    from AutoXLA.training import load_adapter, qlora, save_adapter, shard_adapters
    from tests.helpers import seed_lora_adapters

    quant = {} if bits is None else dict(do_quant=True, quantization_config=QuantizationConfig(
        bits=bits, block_size=32, scale_search=False))
    model = AutoXLAModelForCausalLM.from_pretrained(checkpoint, runtime="dtensor",
                                                    sharding_strategy=strategy,
                                                    dtype=torch.float32, **quant)
    mesh = state_of(model).plan.mesh
    dequantized = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear):      # gathered whole (a collective on every rank)
            parts = [None if t is None else whole(t) for t in (
                m.weight, m.weight_scale, m.weight_zero_point, m.weight_offset)]
            dequantized[name] = dequantize(parts[0], parts[1], parts[2], m.quant_format,
                                           torch.float32, parts[3])
    base = {n: whole(t) for n, t in model.state_dict().items()}

    model = get_peft_model(model, qlora(config(targets)) if bits else config(targets))
    placed = shard_adapters(model)
    seed_lora_adapters(model)
    losses, grads, opt = train(model, batches, steps)
    want_losses, want_grads = (reference(checkpoint, batches, steps, dequantized, targets)
                               if every_rank or dist.get_rank() == 0 else (losses, grads))

    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    after = {n.replace("base_model.model.", "").replace(".base_layer", ""): whole(t)
             for n, t in model.state_dict().items() if "lora_" not in n}
    result = dict(
        mesh=dict(fsdp=mesh.fsdp, model=mesh.model, data=mesh.data),
        dtensor=losses, transformers=want_losses, gradient=worst_gradient(grads, want_grads),
        planned=len(placed.tensors), trainable=len(trainable),
        trainable_all_lora=all("lora_" in n for n in trainable),
        trainable_all_dtensors=all(isinstance(p, DTensor) for p in trainable.values()),
        frozen_without_grads=all(p.grad is None for p in model.parameters() if not p.requires_grad),
        optimizer_states=len(opt.state),
        quantized_layers=len(dequantized),
        base_unchanged=set(after) == set(base) and all(torch.equal(after[n], t)
                                                       for n, t in base.items()))
    if out is not None:
        save_adapter(model, os.path.join(out, "adapter"))
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=batches[0], use_cache=False).logits
        result["logits"] = logits.tolist()
        # the adapter written, loaded onto a fresh model on the 4 processes (load_adapter)
        fresh = AutoXLAModelForCausalLM.from_pretrained(checkpoint, runtime="dtensor",
                                                        sharding_strategy=strategy,
                                                        dtype=torch.float32)
        dist.barrier()                   # process 0 has written the adapter's files
        loaded = load_adapter(fresh, os.path.join(out, "adapter")).eval()
        with torch.no_grad():
            again = loaded(input_ids=batches[0], use_cache=False).logits
        result["reloaded_logits"] = again.tolist()
        result["reloaded_all_dtensors"] = all(isinstance(p, DTensor) for n, p in
                                              loaded.named_parameters() if "lora_" in n)
    return result


def main(checkpoint: str, out: str, real: str = "") -> None:
    g = torch.Generator().manual_seed(1)
    if real:       # the real SmolLM2 (bench/real_lora.py): 20 steps under 2d and fsdp
        batches = [torch.randint(3, 49000, (4, 32), generator=g) for _ in range(2)]
        runs = {s: case(checkpoint, s, None, batches, None, 20, every_rank=False)
                for s in ("2d", "fsdp")}
        if dist.get_rank() == 0:
            with open(os.path.join(out, "real.json"), "w") as f:
                json.dump(runs, f)
        return
    batches = [torch.randint(3, 250, (8, 16), generator=g) for _ in range(2)]
    runs = {"2d": case(checkpoint, "2d", None, batches, out, targets=TARGETS + ["lm_head"]),
            "fsdp": case(checkpoint, "fsdp", None, batches, None),
            "2d-int4": case(checkpoint, "2d", 4, batches, None)}
    if dist.get_rank() == 0:
        runs["batch"] = batches[0].tolist()
        with open(os.path.join(out, "lora.json"), "w") as f:
            json.dump(runs, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
