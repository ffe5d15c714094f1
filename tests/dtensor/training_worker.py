"""One rank of the dtensor runtime's training and saving checks (tests/dtensor/test_training.py).

``first`` (8 ranks, fsdp, gradient checkpointing): the job's sampled and greedy requests through
``generate``; save_pretrained of the model as loaded, of an int4 model; then AdamW steps 1-2 on the job's fixed batches, a TrainingCheckpoints commit of
step 2, steps 3-4. ``resume`` (4 ranks, 2d: another mesh and world size; the dtensor runtime's step 2 into a model
loaded on the user's own DeviceMesh over ("fsdp", "model")): for each step-2 directory given (the
dtensor runtime's, the xla runtime's), the model and AdamW restored, steps 3-4.
Each rank writes OUT/<mode>-<rank>.json: the losses, and how often a decoder layer ran per step.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def load(checkpoint: str, strategy: str | None, **kwargs):
    from AutoXLA.modeling import AutoXLAModelForCausalLM

    if strategy is not None:
        kwargs["sharding_strategy"] = strategy
    return AutoXLAModelForCausalLM.from_pretrained(checkpoint, runtime="dtensor",
                                                   dtype=torch.float32, **kwargs)


def steps(model, optimizer, batches) -> list[float]:
    """One AdamW step per batch (the batch as input and labels); the losses before each step."""
    losses = []
    for ids in batches:
        ids = torch.tensor(ids)
        optimizer.zero_grad()
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def first(job: dict, out: str) -> dict:
    from AutoXLA.quantization import QuantizationConfig
    from AutoXLA.saving import TrainingCheckpoints
    from AutoXLA.sharding.decoder_stack import find_stack as layers_of

    model = load(job["checkpoint"], "fsdp", gradient_checkpointing=True)
    answers = generated(model, job)
    # What users save right after loading: float, and int4 quantized as it loads
    model.save_pretrained(os.path.join(out, "saved-float"))
    quantized = load(job["checkpoint"], "2d", do_quant=True, quantization_config=QuantizationConfig(
        bits=4, block_size=32, scale_search=False))
    quantized.save_pretrained(os.path.join(out, "saved-int4"))
    del quantized

    # Training, with gradient checkpointing: a decoder layer's MLP runs twice a step (its forward, and
    # again in the backward pass), each time gathering its parameters
    model.train()
    calls = []
    _, layers = layers_of(model)
    # (transformers checkpoints the layer's forward, so its submodules are called again)
    layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=job["lr"])
    losses = steps(model, optimizer, job["batches"][:2])
    TrainingCheckpoints(job["dtensor_steps"]).save(2, model, optimizer)
    losses += steps(model, optimizer, job["batches"][2:])
    return dict(losses=losses, layer_calls_per_step=len(calls) / len(job["batches"]), **answers)


def generated(model, job: dict) -> dict:
    """The job's sampled request (tokens, buckets, how the steps ran) and its greedy one, this one
    with the weights gathered again at every step (as for a model too big to keep them)."""
    from AutoXLA.runtimes.dtensor import generation
    from AutoXLA.state import state_of

    ids, mask = torch.tensor(job["prompts"]), torch.tensor(job["mask"])
    with torch.no_grad():
        sampled = model.generate(input_ids=ids, attention_mask=mask, **job["sample"])
        stats = state_of(model).last_generate
        share, generation.KEEP_GATHERED_SHARE = generation.KEEP_GATHERED_SHARE, 0.0
        try:
            greedy = model.generate(input_ids=ids, attention_mask=mask, **job["greedy"]["kwargs"])
        finally:
            generation.KEEP_GATHERED_SHARE = share
        assert not state_of(model).last_generate.kept_gathered
        # rank 0 alone short of memory: every rank must then gather at every step (a rank that
        # kept its weights would skip gathers the others wait on, for ever)
        if dist.get_rank() == 0:
            generation.KEEP_GATHERED_SHARE = 0.0
        try:
            outvoted = model.generate(input_ids=ids, attention_mask=mask,
                                      **job["greedy"]["kwargs"])
        finally:
            generation.KEEP_GATHERED_SHARE = share
        kept_when_outvoted = state_of(model).last_generate.kept_gathered
    return dict(sampled=dict(tokens=sampled.tolist(), traced=stats.traced,
                             kept_gathered=stats.kept_gathered,
                             buckets=[stats.batch_bucket, stats.prompt_bucket, stats.cache_length]),
                greedy=greedy.tolist(), outvoted=outvoted.tolist(),
                kept_when_outvoted=kept_when_outvoted)


def resume(job: dict, out: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from AutoXLA.saving import TrainingCheckpoints, TrainingCheckpointError

    # a mesh whose ranks sit elsewhere than the plan numbers them is refused, not misread
    try:
        load(job["checkpoint"], None, mesh=init_device_mesh("cpu", (2, 2),
                                                            mesh_dim_names=("model", "fsdp")))
        result = dict(permuted_mesh="loaded")
    except ValueError as e:
        result = dict(permuted_mesh=str(e))
    for source in ("dtensor_steps", "xla_steps"):
        if source == "dtensor_steps":   # the user's own mesh, as the original AutoXLA's users pass it
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "model"))
            model = load(job["checkpoint"], None, mesh=mesh)
        else:
            model = load(job["checkpoint"], "2d")
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=job["lr"])
        try:
            step = TrainingCheckpoints(job[source]).restore(model, optimizer)
        except TrainingCheckpointError as e:
            result[source] = dict(error=str(e))
            continue
        result[source] = dict(step=step, losses=steps(model, optimizer, job["batches"][step:]),
                              mesh=str(model.autoxla_plan.mesh),
                              strategy=model.autoxla_plan.strategy)
    result["lora"], result["lora_unplaced"] = lora_refused(model, job)
    return result


def lora_refused(model, job: dict) -> tuple[str, str]:
    """peft's LoRA on 4 processes without shard_adapters: its adapters are plain tensors,
    refused at the first forward; and after it, an adapter the plan does not place (on the
    embeddings), refused naming the module to leave out."""
    from peft import LoraConfig, get_peft_model

    from AutoXLA.training import shard_adapters

    peft_model = get_peft_model(model, LoraConfig(
        r=4, target_modules=["q_proj", "v_proj", "embed_tokens"]))
    said = []
    for place in (False, True):
        if place:
            shard_adapters(peft_model)
        try:
            peft_model(input_ids=torch.tensor(job["batches"][0]))
            said.append("ran")
        except ValueError as e:
            said.append(str(e))
    return said[0], said[1]


def main(mode: str, job_file: str, out: str) -> None:
    from AutoXLA.runtimes.dtensor.process import ensure_process_group

    ensure_process_group("cpu")
    job = json.loads(open(job_file).read())
    result = (first if mode == "first" else resume)(job, out)
    with open(os.path.join(out, f"{mode}-{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
