"""llama.cpp's reference quantizers (the gguf package's gguf.quants) applied to a checkpoint.

The same linears AutoXLA would quantize (ModelQuantizer's plan of the empty model, with the
format's exclude_layers / quantize_lm_head) are quantized and dequantized by gguf and written, as
float32, into a temporary copy of the checkpoint; the caller loads that copy as a float model, so
the llama.cpp formats are evaluated by exactly the loader and evaluator the AutoXLA formats are.
"""
from __future__ import annotations

import contextlib
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..loading import checkpoint as ckpt
from ..modeling.empty import load_config
from ..modeling.pipeline import empty_model
from ..quantization import ModelQuantizer

_PIN = "gguf==0.19.0"


@dataclass
class Reference:
    directory: Path          # the float checkpoint holding the dequantized weights
    quantized_bytes: int     # bytes the gguf blocks take (what llama.cpp would store)
    weights: int             # elements quantized

    @property
    def bytes_per_weight(self) -> float:
        return self.quantized_bytes / max(self.weights, 1)


def gguf_type(name: str):
    """The gguf.GGMLQuantizationType called ``name`` (e.g. "Q4_1"), checked to have a quantizer."""
    try:
        from gguf import GGMLQuantizationType
        from gguf import quants
    except ImportError as e:
        raise ImportError(f"the llama.cpp reference formats need the gguf package: pip install "
                          f"{_PIN}") from e
    qtype = getattr(GGMLQuantizationType, name, None)
    if qtype is None or not hasattr(quants, name) or "quantize_blocks" not in vars(
            getattr(quants, name)):
        raise ValueError(f"gguf.quants has no quantizer for {name!r} (it has Q8_0, Q5_0, Q5_1, "
                         "Q4_0, Q4_1, ...; the K- and IQ-types only dequantize)")
    return qtype


def quantized_layers(path, fmt, auto_class):
    """(module names of the linears AutoXLA would quantize in the checkpoint at ``path``, the
    empty model they were chosen from)."""
    r = empty_model(load_config(str(path)), auto_class)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")    # e.g. W8A8 notes, irrelevant to choosing layers
        report = ModelQuantizer(fmt.quantization_config()).plan(r.model, r.tied, on_tpu=False)
    return list(report.layers), r.model


@contextlib.contextmanager
def reference_checkpoint(path, fmt, auto_class):
    """Yields a Reference: a temporary float checkpoint whose quantized linears went through
    gguf's quantize + dequantize for ``fmt.gguf_type``; the directory is removed afterwards."""
    import numpy as np
    import torch
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize, quantize
    from safetensors import safe_open
    from safetensors.torch import save_file

    qtype = gguf_type(fmt.gguf_type)
    block, _ = GGML_QUANT_SIZES[qtype]
    source = ckpt.locate(str(path))
    if source.is_pickle or not source.records:
        raise ckpt.CheckpointError(f"{path}: the llama.cpp formats need safetensors weights")
    layers, model = quantized_layers(path, fmt, auto_class)
    names, _ = ckpt.renamed_keys(model, source.records)
    prefix = getattr(model, "base_model_prefix", "") + "."
    keys = {}
    for layer in layers:
        name = f"{layer}.weight"
        key = names.get(name) or (names.get(name[len(prefix):]) if name.startswith(prefix)
                                  else None)
        if key is None:
            raise ckpt.CheckpointError(f"{path} has no tensor for {name} (AutoXLA would quantize "
                                       "it); the checkpoint does not match its config")
        rec = source.records[key]
        if len(rec.shape) != 2 or rec.shape[1] % block:
            raise ValueError(f"{fmt.name} quantizes rows in blocks of {block}, but {key} has shape "
                             f"{tuple(rec.shape)}: llama.cpp cannot store it in {fmt.gguf_type}; "
                             "compare this model with the AutoXLA formats only")
        keys[key] = rec
    tmp = Path(tempfile.mkdtemp(prefix=f"autoxla-{fmt.name}-"))
    try:
        for f in source.directory.iterdir():   # config, index, tokenizer: as they are
            if f.is_file() and f.suffix != ".safetensors":
                shutil.copy2(f, tmp / f.name)
        total = weights = 0
        for shard in sorted({rec.path for rec in source.records.values()}):
            tensors = {}
            with safe_open(shard, framework="pt") as fh:
                for key in fh.keys():
                    t = fh.get_tensor(key)
                    if key in keys:
                        w = t.to(torch.float32).numpy()
                        q = quantize(w, qtype)
                        total, weights = total + q.nbytes, weights + w.size
                        t = torch.from_numpy(np.ascontiguousarray(dequantize(q, qtype)))
                    tensors[key] = t
            save_file(tensors, str(tmp / Path(shard).name), metadata={"format": "pt"})
        yield Reference(tmp, total, weights)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
