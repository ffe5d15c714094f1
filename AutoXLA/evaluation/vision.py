"""Output SQNR of a segmentation model against its float self, on one fixed deterministic input.

The input and the outputs compared are those of the segmentation tests (tiny_vision.tiny_inputs
and comparable_outputs: N(0, 1) pixels, seeded point prompts for the SAM families), with the
image size taken from the checkpoint's config.
"""
from __future__ import annotations

import math

from .. import backend
from ..testing import tiny_vision


def known_configs() -> str:
    return ", ".join(c for c, _ in tiny_vision.FAMILIES.values())


def knows(config) -> bool:
    return any(c == type(config).__name__ for c, _ in tiny_vision.FAMILIES.values())


def family_of(config) -> str:
    """The tiny_vision family whose config class ``config`` is, or an error naming them."""
    for family, (config_class, _) in tiny_vision.FAMILIES.items():
        if config_class == type(config).__name__:
            return family
    raise ValueError(f"eval-quant has no fixed input for {type(config).__name__} models; it "
                     f"measures the output SQNR of {known_configs()} checkpoints")


def _image_size(config, family: str) -> int:
    """The square input side the checkpoint's config asks for, else the tiny model's."""
    for c in (config, getattr(config, "vision_config", None),
              getattr(getattr(config, "vision_config", None), "backbone_config", None),
              getattr(config, "backbone_config", None)):
        size = getattr(c, "image_size", None) if c is not None else None
        if isinstance(size, (list, tuple)) and size:
            size = size[0]
        if isinstance(size, int) and size > 0:
            return size
    return tiny_vision.image_size(family)


def fixed_inputs(config) -> tuple[str, dict]:
    family = family_of(config)
    return family, tiny_vision.tiny_inputs(family, batch=1, seed=0,
                                           size=_image_size(config, family))


def outputs(model, family: str, inputs: dict) -> dict:
    import torch

    dev = backend.device()
    with torch.no_grad():
        out = model(**{k: v.to(dev) for k, v in inputs.items()})
        return {k: v.cpu().double() for k, v in tiny_vision.comparable_outputs(family, out).items()}


def sqnr_db(got, ref) -> float:
    """10 log10(|ref|^2 / |ref - got|^2) in float64; inf when equal."""
    noise = float((ref - got).pow(2).sum())
    return math.inf if noise == 0 else 10 * math.log10(float(ref.pow(2).sum()) / noise)
