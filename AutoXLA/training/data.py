"""Fine-tuning data: JSON lines to token ids with a loss mask, batched by length bucket.

Each line of the file is one record, in one of three forms (the names TRL users know):
  {"messages": [{"role": ..., "content": ...}, ...]}   chat: the checkpoint's chat template;
                                                       loss on the assistant's turns only
  {"prompt": "...", "completion": "..."}               loss on the completion (and EOS) only
  {"text": "..."}                                      loss on every token (and EOS)

Sequences are padded to the smallest of a few length buckets that holds them (longer ones are cut
to the largest), and a batch holds sequences of one bucket: on the xla runtime each bucket is one
compiled step. Which batch a step takes is a function of (seed, step) only, so a run resumed at
step N takes exactly the batches an uninterrupted run takes from N on.
"""
from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

IGNORE = -100          # the label transformers' loss skips

DEFAULT_BUCKETS = (64, 128, 256, 512)


@dataclass(frozen=True)
class Example:
    ids: tuple[int, ...]
    labels: tuple[int, ...]      # IGNORE where no loss is taken


def read_records(path: str | Path) -> list[dict]:
    """The records of a JSON-lines file; a bad line is named with its number and the fix."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such data file; pass a JSON-lines file (--data)")
    records = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not JSON ({e.msg}); each line must be one "
                                 "JSON object") from None
            _check_record(record, f"{path}:{number}")
            records.append(record)
    if not records:
        raise ValueError(f"{path} holds no records; each line must be one JSON object with "
                         "'messages', 'prompt' and 'completion', or 'text'")
    return records


def _check_record(record, where: str) -> None:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if (not isinstance(messages, list) or not messages
                or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                           and isinstance(m.get("content"), str) for m in messages)):
            raise ValueError(f"{where}: 'messages' must be a list of {{'role': str, 'content': "
                             "str}} objects")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where}: no 'assistant' message: nothing to learn from")
    elif "prompt" in record or "completion" in record:
        if not all(isinstance(record.get(k), str) for k in ("prompt", "completion")):
            raise ValueError(f"{where}: 'prompt' and 'completion' must both be strings")
    elif not isinstance(record.get("text"), str):
        raise ValueError(f"{where}: a record needs 'messages', 'prompt' and 'completion', or "
                         f"'text'; it has {sorted(record)}")


def tokenize(record: dict, tokenizer) -> Example:
    """One record as token ids and labels (the ids where the loss is taken, else IGNORE)."""
    if "messages" in record:
        return _chat(record["messages"], tokenizer)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if "prompt" in record:
        prompt = tokenizer(record["prompt"])["input_ids"]
        answer = tokenizer(record["completion"], add_special_tokens=False)["input_ids"] + eos
        return Example(tuple(prompt + answer), tuple([IGNORE] * len(prompt) + answer))
    ids = tokenizer(record["text"])["input_ids"] + eos
    return Example(tuple(ids), tuple(ids))


def _chat(messages: list[dict], tokenizer) -> Example:
    """The chat template over the whole conversation; the loss on each assistant turn's tokens:
    those the template adds between the conversation before the turn (with the generation
    prompt, what the model sees when it answers) and the conversation through it."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat records ('messages') need the checkpoint's chat template, and its "
                         "tokenizer has none: use 'prompt' / 'completion' or 'text' records")

    def render(upto, prompt):
        return list(tokenizer.apply_chat_template(messages[:upto], tokenize=True,
                                                  add_generation_prompt=prompt,
                                                  return_dict=True)["input_ids"])

    ids = render(len(messages), False)
    labels = [IGNORE] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(i, True), render(i + 1, False)
        if through[:len(before)] != before or ids[:len(through)] != through:
            raise ValueError("the chat template does not render a conversation's beginning as "
                             "a prefix of the whole (it rewrites earlier turns), so the "
                             "assistant's tokens cannot be found: use 'prompt' / 'completion' "
                             "records")
        labels[len(before):len(through)] = through[len(before):]
    return Example(tuple(ids), tuple(labels))


def split(records: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """(train, eval): a seeded share of the records held out (at least one when asked)."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval fraction {eval_fraction}: give a share in [0, 1)")
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(eval_fraction * len(records))) if eval_fraction > 0 else 0
    if n_eval >= len(records):
        raise ValueError(f"{len(records)} records leave none to train on after holding out "
                         f"{n_eval} for evaluation: lower the eval fraction or add records")
    held = set(order[:n_eval])
    return ([r for i, r in enumerate(records) if i not in held],
            [r for i, r in enumerate(records) if i in held])


class Batches:
    """Fixed-shape batches of examples: ``batch(i)`` is the i-th batch of the run, a function of
    (seed, i). Each epoch shuffles the examples (seeded by the epoch), groups them by bucket and
    shuffles the batches; a bucket's last partial batch is filled with rows that carry no loss."""

    def __init__(self, examples: list[Example], batch_size: int, buckets=DEFAULT_BUCKETS,
                 seed: int = 0, pad_id: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch size {batch_size}: give at least 1")
        buckets = tuple(sorted(buckets))
        if not buckets or buckets[0] < 2:
            raise ValueError(f"length buckets {buckets}: give lengths >= 2")
        self.examples, self.batch_size, self.buckets = examples, batch_size, buckets
        self.seed, self.pad_id = seed, pad_id
        self.cut = sum(len(e.ids) > buckets[-1] for e in examples)   # sequences cut to fit
        sizes = Counter(self.bucket_of(e) for e in examples)       # examples per bucket
        self.per_epoch = sum(-(-n // batch_size) for n in sizes.values())
        self._epochs: dict[int, list[tuple[int, list[int]]]] = {}

    def bucket_of(self, example: Example) -> int:
        return next((b for b in self.buckets if b >= len(example.ids)), self.buckets[-1])

    def _epoch(self, epoch: int) -> list[tuple[int, list[int]]]:
        """[(bucket, example indices)] of one epoch, in the order the steps take them."""
        if epoch not in self._epochs:
            rng = random.Random(self.seed * 1_000_003 + epoch)
            order = list(range(len(self.examples)))
            rng.shuffle(order)
            groups: dict[int, list[int]] = {}
            for i in order:
                groups.setdefault(self.bucket_of(self.examples[i]), []).append(i)
            batches = [(b, g[k:k + self.batch_size]) for b, g in sorted(groups.items())
                       for k in range(0, len(g), self.batch_size)]
            rng.shuffle(batches)
            self._epochs = {epoch: batches}       # one epoch held at a time
        return self._epochs[epoch]

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        """input_ids, attention_mask and labels, [batch_size, bucket] on the host."""
        bucket, rows = self._epoch(index // self.per_epoch)[index % self.per_epoch]
        ids = torch.full((self.batch_size, bucket), self.pad_id, dtype=torch.int64)
        labels = torch.full((self.batch_size, bucket), IGNORE, dtype=torch.int64)
        mask = torch.zeros((self.batch_size, bucket), dtype=torch.int64)
        for r, i in enumerate(rows):          # right-padded, as training batches are
            e = self.examples[i]
            n = min(len(e.ids), bucket)
            ids[r, :n] = torch.tensor(e.ids[:n])
            labels[r, :n] = torch.tensor(e.labels[:n])
            mask[r, :n] = 1
        for r in range(len(rows), self.batch_size):   # filler: a real row, no loss
            ids[r], mask[r] = ids[0], mask[0]
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
