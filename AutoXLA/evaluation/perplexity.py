"""Perplexity of a causal LM on a text: token-level negative log-likelihood, one code path for
every format.

The text is tokenized once and cut into windows of ``window`` tokens; each window is scored
independently (its first token has no context and is not scored), so a window is one forward of
one fixed shape: the last window is right-padded and its padding is not scored (a causal model's
real positions never see later ones, so no attention mask is needed).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path


DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "data" / "eval_text.txt"
DEFAULT_WINDOW = 512


def read_text(path=None) -> str:
    """The evaluation text: ``path``, or the English text shipped with AutoXLA."""
    p = Path(path) if path is not None else DEFAULT_TEXT
    if not p.is_file():
        raise FileNotFoundError(f"evaluation text {p} does not exist or is not a file; pass "
                                "--text FILE with a UTF-8 text file, or leave --text out for the "
                                "text AutoXLA ships" if path is not None else
                                f"AutoXLA's evaluation text {p} is missing: reinstall AutoXLA")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"evaluation text {p} is not UTF-8 text ({e.reason} at byte "
                         f"{e.start}); pass a plain text file") from e
    if not text.strip():
        raise ValueError(f"evaluation text {p} is empty; pass a file with a few paragraphs")
    return text


@dataclass
class Windows:
    ids: "torch.Tensor"      # (n, window) int64
    scored: "torch.Tensor"   # (n, window - 1) bool: which next-token predictions count
    tokens: int              # tokens of the text used

    @property
    def predictions(self) -> int:
        return int(self.scored.sum())


def token_windows(tokenizer, text: str, max_tokens: int | None = None,
                  window: int = DEFAULT_WINDOW) -> Windows:
    import torch

    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"--max-tokens {max_tokens}: perplexity needs at least 2 tokens")
    if window < 2:
        raise ValueError(f"--window {window}: a window needs at least 2 tokens")
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise ValueError(f"the evaluation text is {len(ids)} token(s); perplexity needs at least 2")
    window = min(window, len(ids))
    n = math.ceil(len(ids) / window)
    pad = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    flat = torch.full((n * window,), pad, dtype=torch.int64)
    flat[:len(ids)] = torch.tensor(ids, dtype=torch.int64)
    real = torch.zeros(n * window, dtype=torch.bool)
    real[:len(ids)] = True
    return Windows(flat.view(n, window), real.view(n, window)[:, 1:].clone(), len(ids))


def negative_log_likelihood(model, windows: Windows) -> float:
    """Summed NLL (nats) of the scored next-token predictions; the log-softmax runs on the
    model's device in float32, only the per-token NLL comes back."""
    import torch
    import torch.nn.functional as F

    dev = next(model.parameters()).device   # an XLA device, or a dtensor rank's (DTensors)
    total = 0.0
    with torch.no_grad():
        for ids, scored in zip(windows.ids, windows.scored):
            x = ids[None].to(dev)
            logits = model(input_ids=x).logits[0, :-1].float()
            nll = F.cross_entropy(logits, x[0, 1:], reduction="none").cpu().double()
            total += float(nll[scored].sum())
    return total


def perplexity(model, windows: Windows) -> float:
    return math.exp(negative_log_likelihood(model, windows) / windows.predictions)
