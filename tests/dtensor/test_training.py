"""Training and saving on the dtensor runtime, and checkpoints crossing between the runtimes.

On a Llama from transformers' config class (sizes shrunk), in real processes:

- 8 ranks, fsdp, gradient checkpointing: four AdamW steps give transformers' losses on the CPU;
  each decoder layer runs twice a step (its activations recomputed); step 2 is committed.
- 4 ranks, 2d (another mesh and world size, given as the user's own DeviceMesh over ("fsdp",
  "model"), the original AutoXLA's mesh): step 2 restored, steps 3-4 continue the run.
- save_pretrained writes the xla runtime's bytes (float and int4); the xla runtime (its own
  interpreter: torch 2.9 + torch_xla) loads the dtensor runtime's checkpoint, and training
  checkpoints go both ways (step 2 of either resumed by the other).
- generation is one logic on both runtimes (generation/loop.py): on the 8 ranks, a left-padded
  batch of 3 sampled with a seed, top-k, top-p and a temperature gives the xla runtime's tokens,
  and greedy with an EOS gives transformers' (rows padded after their EOS); the first with the
  weights gathered once for the call, the second gathering them at every step.

The xla runtime's half runs in its own venv (tests/dtensor/xla_side.py), found through
$AUTOXLA_XLA_PY, which ./run sets.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from AutoXLA.runtimes.dtensor.launch import launch
from AutoXLA.testing.architectures import save_checkpoint

HERE = Path(__file__).resolve().parent
LR = 1e-3
BATCHES, BATCH, LENGTH = 4, 8, 16
# fp32 on both sides: the losses differ by summation order (gradients reduce-scattered over 8
# ranks, sums over "model" under 2d), ~1e-7 of a loss near 5.6 per step, and AdamW's normalised
# updates carry that into the next steps without amplifying it much over 4 steps (measured below
# 2e-6 relative). A lost or misplaced optimizer state moves the loss by > 1e-3 relative.
LOSS_RTOL = 1e-5
# Sampling on both runtimes: prompts of 9, 6 and 12 tokens, left-padded
PROMPT_LENGTHS = (9, 6, 12)
SAMPLE = dict(max_new_tokens=12, do_sample=True, seed=11, top_k=40, top_p=0.9, temperature=0.7)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("training")
    checkpoint = save_checkpoint("Llama", root / "llama", seed=3)
    # two fixed batches, twice: the third step's loss, on the first batch again, is lower
    ids = torch.randint(3, 250, (2, BATCH, LENGTH), generator=torch.Generator().manual_seed(0))
    prompts = torch.randint(3, 250, (len(PROMPT_LENGTHS), max(PROMPT_LENGTHS)),
                            generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompts)
    for row, n in enumerate(PROMPT_LENGTHS):
        prompts[row, :-n], mask[row, :-n] = 0, 0
    job = dict(checkpoint=str(checkpoint), lr=LR, batches=ids.repeat(BATCHES // 2, 1, 1).tolist(),
               dtensor_steps=str(root / "dtensor-steps"), xla_steps=str(root / "xla-steps"),
               out=str(root / "out"), prompts=prompts.tolist(), mask=mask.tolist(),
               sample=SAMPLE, greedy=_greedy_with_an_eos(checkpoint, prompts, mask))
    os.makedirs(job["out"])
    path = root / "job.json"
    path.write_text(json.dumps(job))
    job["file"] = str(path)
    return job


def _greedy_with_an_eos(checkpoint, prompts, mask) -> dict:
    """A greedy request whose EOS is the third token transformers picks for the first row, and
    transformers' answer to it (that row stops there; the others run on, or stop where they
    pick it too, and are padded after)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    args = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        eos = int(model.generate(prompts, **args, eos_token_id=None)[0, prompts.shape[1] + 2])
        want = model.generate(prompts, **args, eos_token_id=eos)
    return dict(kwargs=dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=eos),
                want=want.tolist())


@pytest.fixture(scope="module")
def reference(job):
    """transformers + AdamW on the CPU, the same batches: the losses of the 4 steps."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(job["checkpoint"], dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for ids in torch.tensor(job["batches"]):
        optimizer.zero_grad()
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def _run(mode: str, nproc: int, job: dict) -> list[dict]:
    worker = str(HERE / "training_worker.py")
    codes = launch(nproc, [worker, mode, job["file"], job["out"]], timeout=900)
    assert codes == [0] * nproc, f"the ranks exited with {codes} (their output is above)"
    return [json.loads((Path(job["out"]) / f"{mode}-{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def first(job):
    return _run("first", 8, job)


@pytest.fixture(scope="module")
def xla_side(job, first):
    python = os.environ.get("AUTOXLA_XLA_PY")
    if not python:
        pytest.fail("the xla runtime's interpreter is unknown: run through ./run (it sets "
                    "AUTOXLA_XLA_PY), or set AUTOXLA_XLA_PY to that venv's python")
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[1]))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    out = subprocess.run([python, str(HERE / "xla_side.py"), job["file"], job["out"]], env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads((Path(job["out"]) / "xla.json").read_text())


@pytest.fixture(scope="module")
def resumed(job, xla_side):
    return _run("resume", 4, job)


def _close(got, want):
    return all(abs(g - w) <= LOSS_RTOL * abs(w) for g, w in zip(got, want)) and len(got) == len(want)


def test_sampling_gives_the_xla_runtimes_tokens(first, xla_side, job):
    # The same seeded draws from the same logits (fp32, differing by summation order only): a
    # draw flips only where two tokens' cumulative probabilities straddle it within ~1e-6
    for rank, r in enumerate(first):
        assert r["sampled"]["tokens"] == xla_side["sampled"]["tokens"], rank
        assert r["sampled"]["traced"].startswith("never"), r["sampled"]
        assert r["sampled"]["kept_gathered"], r["sampled"]   # a tiny model: it fits
    # the xla runtime pads to its buckets; the dtensor one (nothing compiled) keeps the request's
    # shapes and grows its cache slot by slot
    longest = max(PROMPT_LENGTHS)
    assert first[0]["sampled"]["buckets"] == [len(PROMPT_LENGTHS), longest,
                                              longest + SAMPLE["max_new_tokens"]]
    assert xla_side["sampled"]["buckets"] == [4, 16, 64]
    new = torch.tensor(first[0]["sampled"]["tokens"])[:, len(job["prompts"][0]):]
    assert len(set(map(tuple, new.tolist()))) == len(PROMPT_LENGTHS)   # the rows differ


def test_greedy_with_an_eos_gives_transformers_tokens(first, job):
    for rank, r in enumerate(first):
        assert r["greedy"] == job["greedy"]["want"], rank
        # one rank without the memory to keep the weights: all gather at every step, same tokens
        assert r["outvoted"] == job["greedy"]["want"] and not r["kept_when_outvoted"], rank


def test_training_steps_give_transformers_losses(first, reference):
    for rank, r in enumerate(first):
        assert _close(r["losses"], reference), (rank, r["losses"], reference)
    assert reference[2] < reference[0] - 0.01   # the steps do train


def test_gradient_checkpointing_recomputes_each_layer(first):
    # transformers' checkpointing runs a layer's forward again in the backward pass: its MLP is
    # called twice per step (once without checkpointing)
    assert all(r["layer_calls_per_step"] == 2 for r in first), [r["layer_calls_per_step"] for r in first]


def test_resume_on_another_mesh_continues_the_run(resumed, reference):
    for rank, r in enumerate(resumed):
        got = r["dtensor_steps"]
        assert "error" not in got, got["error"]
        assert got["step"] == 2 and "model=2" in got["mesh"], got
        assert got["strategy"] == "custom mesh", got    # mesh=: the user's DeviceMesh
        assert "row-major order" in r["permuted_mesh"], r["permuted_mesh"]
        assert _close(got["losses"], reference[2:]), (rank, got["losses"], reference[2:])


def test_lora_without_shard_adapters_on_several_processes_is_refused_by_name(resumed):
    # peft's adapters are plain tensors each rank would train alone until shard_adapters places
    # them (tests/dtensor/test_lora.py)
    for rank, r in enumerate(resumed):
        assert "shard_adapters(model)" in r["lora"] and "lora_" in r["lora"], (rank, r["lora"])
        # placed, an adapter the plan does not place (the embeddings') is named with the fix
        unplaced = r["lora_unplaced"]
        assert "embed_tokens" in unplaced and "target_modules" in unplaced, (rank, unplaced)


@pytest.mark.parametrize("name", ["float", "int4"])
def test_save_pretrained_writes_the_xla_runtimes_bytes(job, first, xla_side, name):
    ours, theirs = Path(job["out"]) / f"saved-{name}", Path(job["out"]) / f"xla-saved-{name}"
    files = sorted(p.name for p in ours.iterdir())
    assert files == sorted(p.name for p in theirs.iterdir())
    for file in files:
        if file.endswith(".safetensors") or file.endswith(".index.json"):
            assert (ours / file).read_bytes() == (theirs / file).read_bytes(), file
    # config.json: equal but for the version of transformers that wrote it (5.25 here, 5.24 in
    # the xla runtime's venv)
    mine, other = (json.loads((d / "config.json").read_text()) for d in (ours, theirs))
    mine.pop("transformers_version"), other.pop("transformers_version")
    assert mine == other


def test_the_xla_runtime_loads_the_dtensor_runtimes_checkpoint(xla_side):
    # the same fp32 weights, eager attention against SDPA: summation order only
    assert xla_side["logits_diff"] <= 1e-4 * xla_side["logits_scale"], xla_side


def test_training_checkpoints_cross_between_the_runtimes(xla_side, resumed, reference):
    # torch 2.14.1's DCP files read by torch 2.9's and back (a gap they could not bridge would be
    # a TrainingCheckpointError naming both versions: tests/multihost/test_train_checkpoint_damage.py)
    for direction, got in (("dtensor -> xla", xla_side["resumed"]),
                           ("xla -> dtensor", resumed[0]["xla_steps"])):
        assert "error" not in got, (direction, got["error"])
        assert got["step"] == 2 and _close(got["losses"], reference[2:]), (direction, got)
    assert _close(xla_side["first_losses"], reference[:2]), xla_side["first_losses"]
