"""The fine-tuning loop: batches by length bucket, gradient accumulation, AdamW on the parameters
that train, warm-up then cosine decay, an evaluation split's loss, a line of JSON per step, and a
training-checkpoint commit every few steps from which a killed run resumes exactly.

Exact resumption holds because everything a step depends on is restored or recomputed from the
step number: the adapters and the optimizer's state come from the last commit; the learning rate
is the schedule's value at that step; the batches are a function of (seed, step) (data.py).
"""
from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..generation.engine import engine_of
from ..saving import TrainingCheckpoints
from .data import DEFAULT_BUCKETS, IGNORE, Batches, split, tokenize
from .lora import save_adapter, shard_adapters

METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"


@dataclass(frozen=True)
class FinetuneConfig:
    """How to fine-tune; checked once, here.

    steps: optimizer steps. batch_size: sequences per forward; grad_accum: forwards per step.
    lr, warmup_steps, weight_decay: AdamW's rate, reached linearly over the warm-up, then decayed
        to 0 along a cosine (transformers' get_cosine_schedule_with_warmup), and its decay.
    buckets: sequence lengths (a batch is padded to the smallest that holds its sequences).
    eval_fraction: share of the records held out; their loss is measured every eval_every
        steps (0: at the end only) and at the end.
    save_every: steps between checkpoint commits (0: at the end only); keep: commits kept.
    seed: the data's order and the held-out split.
    """

    steps: int
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 2e-4
    warmup_steps: int = 0
    weight_decay: float = 0.0
    buckets: tuple = DEFAULT_BUCKETS
    eval_fraction: float = 0.0
    eval_every: int = 0
    save_every: int = 0
    keep: int = 2
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "batch_size", "grad_accum", "keep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: give an int >= 1")
        for name in ("warmup_steps", "eval_every", "save_every", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r}: give an int >= 0")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr={self.lr!r}: give a positive learning rate")
        if self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} exceeds steps={self.steps}")
        object.__setattr__(self, "buckets", tuple(self.buckets))


@dataclass
class Result:
    """What a run did: one record per step run in this call, the held-out losses, where it
    started (0, or the step it resumed from), where the adapter was written."""

    steps: list[dict] = field(default_factory=list)
    eval_losses: list[dict] = field(default_factory=list)
    resumed_from: int = 0
    adapter: Path | None = None


def finetune(model, tokenizer, records: list[dict], config: FinetuneConfig, out_dir,
             progress: bool = True) -> Result:
    """Train ``model``'s trainable parameters (a peft model's adapters) on ``records``; resume
    from ``out_dir``'s last commit if there is one. Writes ``out_dir``/metrics.jsonl,
    checkpoints/ and, for a peft model, adapter/ (peft's format)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    engine = engine_of(base)
    device = engine.device()
    if hasattr(model, "peft_config"):      # the adapters placed as planned, before AdamW's states
        shard_adapters(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameters: wrap it with peft "
                         "(get_peft_model) or leave some parameters requiring grad")
    train, held = split(records, config.eval_fraction, config.seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def batched(records):
        return Batches([tokenize(r, tokenizer) for r in records], config.batch_size,
                       config.buckets, config.seed, pad or 0)

    batches, evals = batched(train), (batched(held) if held else None)

    optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay)
    schedule = _schedule(optimizer, config)
    commits = TrainingCheckpoints(out / CHECKPOINTS, keep=config.keep, trainable_only=True)
    result = Result()
    if commits.latest() is not None:
        result.resumed_from = commits.restore(model, optimizer)
        with warnings.catch_warnings():      # the schedule replayed to the step, not trained
            warnings.simplefilter("ignore")
            for _ in range(result.resumed_from):
                schedule.step()
    # one process of a job writes the log and draws the bar (every process computes the same)
    writes = engine.writes_files()
    metrics = _Metrics(out / METRICS, result.resumed_from) if writes else None
    bar = _bar(progress and writes, config.steps, result.resumed_from)
    model.train()
    try:
        for step in range(result.resumed_from, config.steps):
            record = _step(model, optimizer, schedule, batches, step, config, device, engine)
            done = step + 1
            if evals is not None and ((config.eval_every and done % config.eval_every == 0)
                                      or done == config.steps):
                record["eval_loss"] = _evaluate(model, evals, device)
                result.eval_losses.append({"step": done, "loss": record["eval_loss"]})
            if metrics is not None:
                metrics.write(record)
            result.steps.append(record)
            if bar is not None:
                bar.set_postfix(loss=f"{record['loss']:.4f}",
                                tok_s=f"{record['tokens_per_s']:.0f}")
                bar.update(1)
            if (config.save_every and done % config.save_every == 0) or done == config.steps:
                commits.save(done, model, optimizer)
    finally:
        if bar is not None:
            bar.close()
        if metrics is not None:
            metrics.close()
        commits.close()
    if hasattr(model, "peft_config"):
        result.adapter = out / "adapter"
        save_adapter(model, result.adapter)
    return result


def _schedule(optimizer, config: FinetuneConfig):
    from transformers import get_cosine_schedule_with_warmup

    return get_cosine_schedule_with_warmup(optimizer, config.warmup_steps, config.steps)


def _step(model, optimizer, schedule, batches: Batches, step: int, config: FinetuneConfig,
          device, engine) -> dict:
    """One optimizer step over ``grad_accum`` batches: the mean of their losses is minimised."""
    t0, compiles = time.perf_counter(), engine.compile_count()
    lr = schedule.get_last_lr()[0]
    losses, tokens = [], 0
    for micro in range(config.grad_accum):
        batch = batches.batch(step * config.grad_accum + micro)
        tokens += int(batch["attention_mask"].sum())
        loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
        (loss / config.grad_accum).backward()
        losses.append(loss.detach())
        # The graph ends with each micro-batch: one program per (bucket, first or accumulating
        # micro-batch), not one per sequence of buckets in a step (measured before: a new
        # program at step 15 of 200 for the first step of a 128 then a 64 bucket)
        engine.sync()
        engine.finish_step()
    optimizer.step()
    schedule.step()
    optimizer.zero_grad()
    engine.sync()
    engine.finish_step()
    loss = float(torch.stack(losses).mean().cpu())       # the step's one look at the device
    engine.sync()
    seconds = time.perf_counter() - t0
    return {"step": step + 1, "loss": loss, "lr": lr, "tokens": tokens,
            "tokens_per_s": tokens / seconds, "seconds": seconds,
            "compiles": engine.compile_count() - compiles}


@torch.no_grad()
def _evaluate(model, evals: Batches, device) -> float:
    """The held-out records' loss, per token that carries one."""
    model.eval()
    total, count = torch.zeros((), device=device), 0
    for i in range(evals.per_epoch):
        batch = evals.batch(i)
        n = int((batch["labels"][:, 1:] != IGNORE).sum())     # transformers shifts the labels
        total = total + model(**{k: v.to(device) for k, v in batch.items()}).loss * n
        count += n
    model.train()
    return float(total.cpu()) / max(count, 1)


class _Metrics:
    """metrics.jsonl: one line per step. A resumed run first drops the lines of steps after the
    commit it resumes from (the killed run logged them; they are run again)."""

    def __init__(self, path: Path, resumed_from: int):
        self.path = path
        if path.exists():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and _step_of(line) <= resumed_from]
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(path)
        self._file = path.open("a")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 0


def _bar(progress: bool, total: int, initial: int):
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
