"""Calibration: one short forward pass of the float model that measures what each linear reads.

``calibrate(model, data)`` runs the model (sharded on the XLA devices, or on the CPU) over a few
hundred tokens with a pre-hook on every nn.Linear and returns a ``Calibration``: per layer, the
absolute maximum and the mean square of each input channel, and which norm (or up projection)
produced that input. SmoothQuant (smoothing.py) and the sensitivity report (sensitivity.py) are
built from it; ``Calibration.importance(name)`` is the mean square, the weighting an
error-minimising scale search wants.

Statistics stay on the device: each hook folds its batch into running tensors, and they are read
to the host once, at the end. On XLA the pass runs one decoder layer per execution (a sync
before each layer): every layer is then the same graph, compiled once, where the whole unrolled
model would be one graph that takes minutes to compile (3.5 min for SmolLM2-135M on 2 cores).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import torch
from torch import nn

from .. import backend
from ..sharding.decoder_stack import find_stack

DEFAULT_MAX_TOKENS, DEFAULT_SEQ_LEN = 512, 128


def default_text() -> str:
    """The calibration set shipped with the package (AutoXLA/data/calibration.txt): a few
    varied English paragraphs (prose, a recipe, code, a letter, figures, a Q&A), no network."""
    return resources.files("AutoXLA").joinpath("data/calibration.txt").read_text(encoding="utf-8")


@dataclass
class LayerStats:
    """What one linear read during calibration, per input channel (float32, on the CPU)."""

    absmax: torch.Tensor        # (in_features,) max |x_j|
    mean_square: torch.Tensor   # (in_features,) mean x_j^2 over the tokens seen
    weight_absmax: torch.Tensor  # (in_features,) max |W_ij| over output rows i


@dataclass
class Calibration:
    """The result of ``calibrate``: statistics per linear layer name, the tokens seen, and the
    producer of each linear's input where it is a norm's output (the very tensor object) or, in a
    gated MLP, the up projection's rows that multiply into down_proj's input."""

    layers: dict[str, LayerStats]
    input_ids: torch.Tensor                       # (sequences, length) on the CPU
    producers: dict[str, str] = field(default_factory=dict)   # linear -> norm / up_proj name

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()

    def importance(self, name: str) -> torch.Tensor:
        """Per-input-channel weights for an error-minimising weight quantizer: E[x_j^2]."""
        return self.layers[name].mean_square

    def __repr__(self) -> str:
        return (f"Calibration({len(self.layers)} linear layers, {self.tokens} tokens in "
                f"{self.input_ids.shape[0]} sequence(s), {len(self.producers)} inputs traced "
                "to a norm or up projection)")


@dataclass
class CalibrationConfig:
    """How to calibrate before quantizing (from_pretrained's ``calibration=`` keyword).

    data: None = the shipped English text (default_text); a str or list of str (tokenized with
        the checkpoint's tokenizer, concatenated and cut into sequences); token ids, a 1-D
        (cut into sequences) or 2-D (sequences, length) integer tensor; or a Calibration.
    max_tokens, seq_len: at most max_tokens tokens, in sequences of seq_len.
    smooth: SmoothQuant (only with quantize_activation=True: it moves activation range into the
        weights, which only pays when activations are quantized).
    alpha: SmoothQuant's migration strength, in [0, 1]: s_j = max|X_j|^a / max|W_j|^(1-a).
    target: None, or the largest allowed relative perplexity increase on the calibration tokens
        (0.02 = 2 %): the most sensitive layers keep float activations (W8A16), then full
        precision, until the quantized model's emulated perplexity is within it.
    """

    data: Any = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    seq_len: int = DEFAULT_SEQ_LEN
    smooth: bool = True
    alpha: float = 0.5
    target: float | None = None

    def __post_init__(self):
        for name in ("max_tokens", "seq_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 2:
                raise ValueError(f"CalibrationConfig {name}={v!r} must be an integer >= 2")
        if not isinstance(self.smooth, bool):
            raise ValueError(f"CalibrationConfig smooth must be True or False, got {self.smooth!r}")
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0:
            raise ValueError(f"CalibrationConfig alpha={a!r} must be a number in [0, 1] "
                             "(SmoothQuant's usual value is 0.5)")
        t = self.target
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0):
            raise ValueError(f"CalibrationConfig target={t!r} must be None or a relative "
                             "perplexity increase >= 0, e.g. 0.02 for 2 %")
        d = self.data
        if isinstance(d, list) and (not d or not all(isinstance(s, str) and s for s in d)):
            raise ValueError("CalibrationConfig data as a list must hold non-empty strings")
        if isinstance(d, torch.Tensor) and (d.is_floating_point() or d.is_complex()
                                            or d.dim() not in (1, 2) or d.numel() < 2):
            raise ValueError(f"calibration token ids must be an integer tensor of 1 or 2 dims "
                             f"with at least 2 tokens, got {d.dtype} of shape {tuple(d.shape)}")
        if not (d is None or isinstance(d, (str, list, torch.Tensor, Calibration))):
            raise TypeError(f"calibration data must be text, a list of texts, token ids or a "
                            f"Calibration, got {type(d).__name__}")
        if isinstance(d, str) and not d.strip():
            raise ValueError("calibration text is empty")

    @property
    def needs_tokenizer(self) -> bool:
        return self.data is None or isinstance(self.data, (str, list))

    @classmethod
    def from_any(cls, value) -> "CalibrationConfig | None":
        """from_pretrained's keyword: None/False = none; True = the default set; a config; its
        dict; or the data itself (text, texts, token ids, a Calibration)."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls(**value)
        return cls(data=value)


# -- tokens ---------------------------------------------------------------------------------
def token_batch(data, tokenizer=None, max_tokens: int = DEFAULT_MAX_TOKENS,
                seq_len: int = DEFAULT_SEQ_LEN) -> torch.Tensor:
    """The calibration tokens as a (sequences, length) int64 tensor on the CPU."""
    if isinstance(data, Calibration):
        return data.input_ids
    if data is None or isinstance(data, (str, list)):
        if tokenizer is None:
            raise ValueError("calibration text needs a tokenizer: pass tokenizer=, or token ids "
                             "(an integer tensor) instead of text")
        texts = [default_text()] if data is None else ([data] if isinstance(data, str) else data)
        sep = [tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None) is not None else []
        ids: list[int] = []
        for text in texts:
            ids += tokenizer(text, add_special_tokens=False)["input_ids"] + sep
        data = torch.tensor(ids[:-len(sep)] if sep else ids, dtype=torch.long)
    ids = data.to(torch.long)
    if ids.dim() == 2:
        return ids[:max(1, max_tokens // ids.shape[1])].contiguous()
    if ids.numel() < seq_len:
        return ids[None, :max_tokens]
    rows = min(max(1, max_tokens // seq_len), ids.numel() // seq_len)
    return ids[:rows * seq_len].reshape(rows, seq_len)


# -- the pass -------------------------------------------------------------------------------
def model_device(model: nn.Module) -> torch.device:
    return next(p.device for p in model.parameters())


def read_back(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors on the host after one execution of everything pending (one sync; on XLA
    each is first replicated, so each read is a plain copy, not a gathering program)."""
    if tensors and tensors[0].device.type == "xla":
        tensors = [backend.replicated(t) for t in tensors]
        backend.sync()
    return [t.cpu() for t in tensors]


@contextlib.contextmanager
def layer_by_layer(model: nn.Module):
    """On XLA, a sync before each decoder layer runs, so that each layer (the same ops on the
    same shapes) is one graph compiled once; elsewhere nothing."""
    found = find_stack(model)
    if found is None or model_device(model).type != "xla":
        yield
        return

    handles = [layer.register_forward_pre_hook(lambda *_: backend.sync()) for layer in found[1]]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def forward_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    kwargs = {"use_cache": False} if getattr(getattr(model, "config", None), "use_cache", None) is not None else {}
    out = model(input_ids=ids, **kwargs)
    return out.logits if hasattr(out, "logits") else out[0]


def token_nll(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """(sequences, length - 1) float32 negative log-likelihood of each next token, on the device."""
    logits = forward_logits(model, ids)[:, :-1].float()
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                       reduction="none").reshape(ids.shape[0], -1)


def _is_norm(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return "Norm" in type(module).__name__ and isinstance(w, torch.Tensor) and w.dim() == 1


def _gated_mlp_pairs(model: nn.Module) -> dict[str, str]:
    """down_proj -> up_proj in gated MLPs (Llama, Mistral, Qwen, Gemma: down(act(gate(x)) * up(x))):
    down's input is linear in up's output, so dividing up's rows divides down's input. Found by
    structure; smoothing.py checks on the calibration tokens that the model's output is unchanged."""
    pairs = {}
    for name, m in model.named_modules():
        parts = [getattr(m, k, None) for k in ("gate_proj", "up_proj", "down_proj")]
        if all(isinstance(p, nn.Linear) for p in parts) and parts[1].out_features == parts[2].in_features:
            prefix = f"{name}." if name else ""
            pairs[f"{prefix}down_proj"] = f"{prefix}up_proj"
    return pairs


def refuse_scanned(model: nn.Module) -> None:
    """Hooks on a scanned stack's layers would run inside its traced loop body."""
    stacked = [n for n, m in model.named_modules() if hasattr(m, "per_layer_items")]
    if stacked:
        raise ValueError(f"{type(model).__name__}'s decoder stack ({stacked[0]}) is scanned (one "
                         "loop), so its layers cannot be measured one by one: load it with "
                         "scan_layers=False to calibrate, or pass calibration= to from_pretrained")


def collect(model: nn.Module, ids: torch.Tensor) -> tuple[Calibration, torch.Tensor]:
    """One forward pass over ``ids`` with statistics hooks on every nn.Linear.

    Returns the Calibration and each token's float NLL (on the CPU, for smoothing's check)."""
    refuse_scanned(model)
    device = model_device(model)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    # Made on the host and sent, so each layer's accumulators are device data like its weights.
    running = {n: [torch.zeros(m.in_features).to(device), torch.zeros(m.in_features).to(device),
                   None] for n, m in linears.items()}
    norm_out: dict[int, tuple[str, torch.Tensor]] = {}
    producers: dict[str, str] = {}

    def pre_hook(name):
        def hook(module, args):
            x = args[0]
            hit = norm_out.get(id(x))
            if hit is not None and hit[1] is x:      # the norm's very output tensor
                producers[name] = hit[0]
            x = x.detach().reshape(-1, x.shape[-1]).float()
            r = running[name]
            r[0] = torch.maximum(r[0], x.abs().amax(0))
            r[1] = r[1] + x.pow(2).sum(0)
            if r[2] is None:          # in the layer's own graph, not one graph of all weights
                r[2] = module.weight.detach().abs().amax(0).float()
        return hook

    def norm_hook(name):
        def hook(module, args, out):
            if isinstance(out, torch.Tensor):
                norm_out[id(out)] = (name, out)
        return hook

    handles = [m.register_forward_pre_hook(pre_hook(n)) for n, m in linears.items()]
    handles += [m.register_forward_hook(norm_hook(n)) for n, m in model.named_modules() if _is_norm(m)]
    try:
        with torch.no_grad(), layer_by_layer(model):
            nll = token_nll(model, ids.to(device))
        flat = torch.cat([torch.cat(r) for r in running.values() if r[2] is not None])
    finally:
        for h in handles:
            h.remove()
        norm_out.clear()
    # One graph (the forward and every statistic), one read: all statistics in one flat vector.
    flat, nll = read_back(flat, nll)
    ran = {n: m for n, m in linears.items() if running[n][2] is not None}   # called at least once
    flat = flat.split([3 * m.in_features for m in ran.values()])
    layers = {}
    for (n, m), v in zip(ran.items(), flat):
        absmax, square_sum, w_absmax = v.split(m.in_features)
        layers[n] = LayerStats(absmax, square_sum / ids.numel(), w_absmax)
    for down, up in _gated_mlp_pairs(model).items():
        producers.setdefault(down, up)
    return Calibration(layers, ids.cpu(), producers), nll


def calibrate(model: nn.Module, data=None, *, tokenizer=None, max_tokens: int = DEFAULT_MAX_TOKENS,
              seq_len: int = DEFAULT_SEQ_LEN) -> Calibration:
    """Statistics of every linear's input on ``data`` (None = the shipped text, which needs
    ``tokenizer``; or text, texts, token ids), from one forward pass of the float ``model``."""
    cfg = CalibrationConfig(data=data, max_tokens=max_tokens, seq_len=seq_len)
    ids = token_batch(cfg.data, tokenizer, cfg.max_tokens, cfg.seq_len)
    check_ids(model, ids)
    return collect(model, ids)[0]


def check_ids(model: nn.Module, ids: torch.Tensor) -> None:
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if ids.numel() and (int(ids.min()) < 0 or (vocab is not None and int(ids.max()) >= vocab)):
        raise ValueError(f"calibration token ids must be in [0, {vocab}) (the model's vocab_size), "
                         f"got values from {int(ids.min())} to {int(ids.max())}")
    if ids.shape[-1] < 2:
        raise ValueError("calibration sequences need at least 2 tokens (each is scored on the next)")
