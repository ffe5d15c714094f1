"""evaluate(path, formats): every format of a checkpoint, loaded and measured by one code path.

Each format is loaded with AutoXLA*.from_pretrained(path, sharding_strategy=..., do_quant=...,
quantization_config=...) on the chosen runtime's devices (llama.cpp formats: a float checkpoint holding gguf's
dequantized weights, evaluation/llama_cpp.py), then measured against the float model: perplexity
on a text for causal LMs, output SQNR on a fixed input for segmentation models.
"""
from __future__ import annotations

import gc
import math
import time
import warnings
from dataclasses import dataclass, field

from ..modeling import AutoXLAModelForCausalLM, AutoXLAModelForImageSegmentation
from ..modeling.causal import causal_or_image_text_class
from ..modeling.empty import load_config
from ..modeling.segmentation import auto_classes
from ..state import state_of
from . import vision
from .formats import AUTOXLA, FLOAT, FORMATS, LLAMA_CPP, Format, parse_formats
from .llama_cpp import gguf_type, reference_checkpoint
from .perplexity import DEFAULT_WINDOW, perplexity, read_text, token_windows

CAUSAL, VISION = "causal", "vision"


@dataclass
class Result:
    format: Format
    bytes_per_weight: float
    value: float                 # perplexity (causal) or worst output SQNR in dB (vision)
    ratio: float | None = None   # perplexity / the float model's (causal)
    seconds: float = 0.0         # building (llama.cpp: quantizing, writing) and loading
    eval_seconds: float = 0.0    # the forwards
    details: dict = field(default_factory=dict)   # vision: SQNR of each output
    notes: list[str] = field(default_factory=list)
    base: object = field(default=None, repr=False)   # what the float row gives the others


@dataclass
class Evaluation:
    path: str
    model_class: str
    kind: str
    strategy: str
    results: list[Result]
    tokens: int = 0             # causal: tokens of the text scored
    window: int = 0

    def __getitem__(self, name: str) -> Result:
        return next(r for r in self.results if r.format.name == name)

    def rows(self) -> list[tuple[str, ...]]:
        if self.kind == CAUSAL:
            head = ("format", "bytes/weight", "perplexity", "ratio to float")
            body = [(r.format.name, "failed", "failed", "-") if math.isnan(r.value) else
                    (r.format.name, f"{r.bytes_per_weight:.4f}", f"{r.value:.4f}",
                     "-" if r.ratio is None else f"{r.ratio:.4f}") for r in self.results]
        else:
            head = ("format", "bytes/weight", "worst output SQNR (dB)", "per output")
            body = [(r.format.name, "failed", "failed", "") if math.isnan(r.value) else
                    (r.format.name, f"{r.bytes_per_weight:.4f}",
                     "float" if r.format.kind == FLOAT else f"{r.value:.1f}",
                     "" if r.format.kind == FLOAT else
                     ", ".join(f"{k} {v:.1f}" for k, v in r.details.items()))
                    for r in self.results]
        return [head] + body

    def title(self) -> str:
        what = (f"perplexity on {self.tokens} tokens (windows of {self.window})"
                if self.kind == CAUSAL else "output SQNR against the float model, fixed input")
        return f"{self.model_class} at {self.path}, strategy {self.strategy}: {what}"

    def table(self) -> str:
        rows = self.rows()
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                           for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join([self.title(), *lines, *self._notes()])

    def markdown(self) -> str:
        rows = self.rows()
        out = ["| " + " | ".join(rows[0]) + " |",
               "|" + "|".join("---" if i == 0 else "---:" for i in range(len(rows[0]))) + "|"]
        out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
        return "\n".join(out)

    def _notes(self) -> list[str]:
        return [f"note: {r.format.name}: {n}" for r in self.results for n in r.notes]


def model_kind(config) -> tuple[str, object]:
    """(CAUSAL or VISION, the auto class from_pretrained builds it with), or an error naming
    the model. VISION: the segmentation families with a fixed input (evaluation/vision.py)."""
    auto = causal_or_image_text_class(config)
    if auto is not None:
        return CAUSAL, auto
    if vision.knows(config):
        for auto in auto_classes():
            if type(config) in getattr(auto, "_model_mapping", {}):
                return VISION, auto
    raise ValueError(f"{type(config).__name__} (model_type {getattr(config, 'model_type', '?')!r})"
                     " is neither a causal LM nor a segmentation model with a fixed input: "
                     "eval-quant measures perplexity of causal LMs and output SQNR of "
                     f"{vision.known_configs()} models; pass a checkpoint of one of those")


def _load(path, kind: str, fmt: Format, strategy: str, runtime: str | None):
    cls = AutoXLAModelForCausalLM if kind == CAUSAL else AutoXLAModelForImageSegmentation
    quant = fmt.kind == AUTOXLA
    return cls.from_pretrained(str(path), sharding_strategy=strategy, do_quant=quant,
                               quantization_config=fmt.quantization_config() if quant else None,
                               runtime=runtime, **(fmt.load if quant else {}))


def _bytes_per_weight(model, fmt: Format) -> float:
    """From the stored tensors as the plan put them on the devices: quantized weight, scale and
    zero point bytes over the float elements they stand for (AUTOXLA); the float dtype's size for
    the float model and the llama.cpp formats' float copy (the caller replaces the latter)."""
    import torch

    plan = state_of(model).plan
    if fmt.kind != AUTOXLA:
        return torch.empty((), dtype=getattr(torch, plan.dtype)).element_size()
    # A quantized weight's entry carries the float shape it stands for; its scale and zero point
    # name it in derived_from (they carry the format label too, but no float shape).
    weights = {t.name: t for t in plan if t.quant and not t.derived_from}
    stored = sum(t.nbytes for t in plan if t.name in weights or t.derived_from in weights)
    elements = sum(math.prod(t.source_shape) for t in weights.values())
    return stored / max(elements, 1)


def evaluate(path, formats, *, text_file=None, text: str | None = None, strategy: str = "2d",
             max_tokens: int | None = None, window: int | None = None, reference: bool = True,
             keep_going: bool = False, log=None, runtime: str | None = None) -> Evaluation:
    """Every format in ``formats`` (names or Format entries) loaded from ``path`` and measured;
    ``log(str)`` is told about each step. Causal LMs are scored on ``text``, else the file
    ``text_file``, else the text AutoXLA ships. The float model is evaluated first, as the
    reference of every ratio and SQNR; ``reference=False`` skips it (causal LMs only: the
    perplexities alone, no ratios), which a test comparing formats with each other can afford.
    ``keep_going=True``: a format that cannot be built or run for this model is a row marked
    failed (its error in the notes) instead of an exception, for long runs such as the bench.
    ``runtime``: "xla" or "dtensor" (every process of a dtensor job calls this alike); None:
    the installed one."""
    log = log or (lambda _msg: None)
    if isinstance(formats, (str, Format)):
        formats = [formats]
    fmts = [f for item in formats
            for f in ([item] if isinstance(item, Format) else parse_formats([item]))]
    fmts = [FORMATS["float"]] * reference + [f for f in fmts if f.kind != FLOAT]
    for f in fmts:                      # fail before any model is loaded
        if f.kind == LLAMA_CPP:
            gguf_type(f.gguf_type)
    config = load_config(str(path))
    kind, auto_class = model_kind(config)
    windows = None
    if kind == CAUSAL:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as e:
            raise ValueError(f"{path} has no tokenizer transformers can load; perplexity needs "
                             "the tokenizer files beside the weights (tokenizer.save_pretrained)"
                             ) from e
        windows = token_windows(tokenizer, text if text is not None else read_text(text_file),
                                max_tokens, DEFAULT_WINDOW if window is None else window)
    else:
        if text is not None or text_file is not None or max_tokens is not None:
            raise ValueError(f"{path} is a segmentation model ({type(config).__name__}), "
                             "measured by output SQNR on a fixed input: a text and a token count "
                             "apply to causal LMs only; drop --text / --max-tokens")
        family, inputs = vision.fixed_inputs(config)
    if kind != CAUSAL and runtime == "dtensor":
        raise ValueError(f"{path} is a segmentation model ({type(config).__name__}): those run "
                         "on the xla runtime only so far (docs/runtimes.md); drop --runtime dtensor")
    if not reference and kind != CAUSAL:
        raise ValueError("reference=False: output SQNR needs the float model's outputs")
    results: list[Result] = []
    base = None
    for fmt in fmts:
        try:
            result = _one(path, kind, fmt, strategy, auto_class, windows,
                          (family, inputs) if kind == VISION else None, base, runtime)
        except Exception as e:  # noqa: BLE001 - reported in the table when asked to go on
            if not keep_going or fmt.kind == FLOAT:
                raise
            result = Result(fmt, math.nan, math.nan, notes=[f"failed: {type(e).__name__}: {e}"])
        if fmt.kind == FLOAT:
            base = result.base
        results.append(result)
        log(f"{fmt.name}: {'perplexity' if kind == CAUSAL else 'SQNR'} {result.value:.4f} "
            f"(built and loaded in {result.seconds:.1f} s, evaluated in "
            f"{result.eval_seconds:.1f} s)")
        gc.collect()
    return Evaluation(str(path), model_kind_name(config, auto_class), kind, strategy, results,
                      windows.tokens if windows is not None else 0,
                      windows.ids.shape[1] if windows is not None else 0)


def _one(path, kind, fmt, strategy, auto_class, windows, vision_input, base,
         runtime=None) -> Result:
    """Build, load and measure one format. ``base``: the float model's perplexity or outputs
    (None for the float model itself, or without a reference)."""
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if fmt.kind == LLAMA_CPP:
            with reference_checkpoint(path, fmt, auto_class) as ref:
                model = _load(ref.directory, kind, fmt, strategy, runtime)
                bpw = ref.bytes_per_weight
        else:
            model = _load(path, kind, fmt, strategy, runtime)
            bpw = _bytes_per_weight(model, fmt)
        t1 = time.perf_counter()
        if kind == CAUSAL:
            value = perplexity(model, windows)
            result = Result(fmt, bpw, value, value / base if base else
                            (1.0 if fmt.kind == FLOAT else None), base=value)
        else:
            family, inputs = vision_input
            out = vision.outputs(model, family, inputs)
            ref_out = out if base is None else base
            details = {k: vision.sqnr_db(v, ref_out[k]) for k, v in out.items()}
            result = Result(fmt, bpw, min(details.values()), details=details, base=out)
        del model
    result.seconds, result.eval_seconds = t1 - t0, time.perf_counter() - t1
    result.notes = list(dict.fromkeys(str(w.message) for w in caught if _worth_noting(w, fmt)))
    return result


def model_kind_name(config, auto_class) -> str:
    mapping = getattr(auto_class, "_model_mapping", {})
    try:
        return mapping[type(config)].__name__
    except (KeyError, TypeError, AttributeError):
        return type(config).__name__


def _worth_noting(w, fmt: Format) -> bool:
    """Warnings that change what a format means (e.g. W8A8 falling back to float activations),
    not the loader's routine ones."""
    text = str(w.message)
    return fmt.kind == AUTOXLA and "quantize_activation" in text
