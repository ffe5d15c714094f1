"""What the user asked for, decided once against the checkpoint's config before the model is
built: the attention kernel, the quantization format (the user's, or the one an AutoXLA-quantized
checkpoint was saved in), the mesh, whether the decoder stack may scan. The pipeline's steps read
these values, never the keywords (``LoadOptions`` validates the keywords; this decides with them).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..attention import AttentionConfig
from ..quantization import CalibrationConfig, QuantizationConfig
from ..sharding.multislice import MultiSlice
from .options import LoadOptions


@dataclass(frozen=True)
class Choices:
    attention: str                              # "eager", or the kernel every patched layer runs
    attention_config: AttentionConfig | None    # the kernel's config (None for eager)
    quantization: QuantizationConfig | None     # the format the weights are quantized to
    calibration: CalibrationConfig | None       # calibrate the float model first (from_pretrained)
    strategy: str                               # the mesh's strategy, or "custom mesh"
    mesh: Any                                   # the user's Mesh, or None: built for strategy
    multislice: MultiSlice | None
    scan_layers: bool

    def for_float_model(self) -> "Choices":
        """The float model calibration measures: eager attention, nothing quantized."""
        return dataclasses.replace(self, attention="eager", attention_config=None,
                                   quantization=None, calibration=None)


def choose(config, opts: LoadOptions, checkpoint: bool = True) -> Choices:
    """The Choices for a model of ``config`` loaded with ``opts``: from a checkpoint, whose saved
    quantization format counts, or (``checkpoint=False``) a model already built (from_model),
    quantized only as ``opts`` asks."""
    requested = opts.quantization_config
    quantization = quantization_for(config, requested) if checkpoint else requested
    strategy = "custom mesh" if opts.mesh is not None else opts.sharding_strategy
    return Choices(opts.attn_implementation, opts.attention_config, quantization, opts.calibration,
                   strategy, opts.mesh, opts.multislice, opts.scan_layers)


def quantization_for(config, requested: QuantizationConfig | None) -> QuantizationConfig | None:
    """The format to quantize to: ``requested``, or the format a checkpoint AutoXLA saved
    quantized holds in its config.json (loaded as such); an error when the two differ, or when
    another library quantized the checkpoint."""
    saved = getattr(config, "quantization_config", None)
    if saved is None:
        return requested
    saved = saved if isinstance(saved, dict) else saved.to_dict()
    method = saved.get("quant_method")
    if method != "autoxla":
        raise ValueError(f"the checkpoint is quantized with {method!r}, which AutoXLA cannot "
                         "load; use its float checkpoint with do_quant=True instead")
    saved = QuantizationConfig.from_dict(saved)
    if requested is not None and not requested.same_weights_as(saved):
        raise ValueError(
            f"the checkpoint is already quantized (n_bits={saved.n_bits}, block_size="
            f"{saved.block_size}, symmetric={saved.symmetric}) and cannot be quantized again "
            "with a different format; load it without quantization_config, or quantize its "
            "float checkpoint")
    return requested or saved
