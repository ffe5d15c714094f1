"""AutoXLAModelForImageSegmentation: the seed's entry point for segmentation models."""
from __future__ import annotations

import os

from torch import nn

from ..attention import vision_attention
from ..attention.hf import warn_once
from .options import LoadOptions
from .pipeline import build, build_from_model

# The transformers auto classes a segmentation checkpoint is resolved against, in the seed's order:
# the first whose mapping knows the config's type builds the model.
AUTO_CLASS_NAMES = (
    # Promptable mask generation: SAM, SAM-HQ, SAM2, the SAM 3 tracker, EdgeTAM.
    "AutoModelForMaskGeneration",
    # One head for panoptic/instance/semantic: Mask2Former, MaskFormer, OneFormer.
    "AutoModelForUniversalSegmentation",
    # Instance segmentation (MaskFormer is also universal, which wins).
    "AutoModelForInstanceSegmentation",
    # Per-pixel class logits: SegFormer, UperNet, BEiT, DPT, MobileViT, ...
    "AutoModelForSemanticSegmentation",
)


def auto_classes() -> tuple:
    import transformers

    return tuple(getattr(transformers, n) for n in AUTO_CLASS_NAMES if hasattr(transformers, n))


class AutoXLAModelForImageSegmentation:
    """Loads a segmentation model sharded over an XLA device mesh (optionally quantized).

    Not instantiable: use ``from_pretrained`` (a checkpoint) or ``from_model`` (a model already
    built in code). Both return the model (or its FSDPv2 wrapper) with ``autoxla_plan`` and
    ``autoxla_mesh`` attached, as ``AutoXLAModelForCausalLM`` does. Attention stays eager: the
    kernels are causal decoder attention, vision attention is bidirectional.
    """

    def __init__(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} is a factory: call "
                        "AutoXLAModelForImageSegmentation.from_pretrained(path, ...) or "
                        ".from_model(model, ...)")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *model_args,
                        **kwargs) -> nn.Module:
        """Keywords as for AutoXLAModelForCausalLM.from_pretrained (sharding_strategy, mesh,
        do_quant, quantization_config, use_fsdp_wrap, xla_patch_linear, dtype, ...)."""
        if model_args:
            raise TypeError("from_pretrained takes the path positionally and everything else "
                            f"as keywords; got extra positional arguments {model_args!r}")
        opts = _options(kwargs)
        return build(pretrained_model_name_or_path, auto_classes(), opts)

    @classmethod
    def from_model(cls, model: nn.Module, **kwargs) -> nn.Module:
        """The quantize -> shard -> FSDPv2 pipeline on a model built in code (weights on the CPU),
        e.g. MedSAM3's SAM3 from the native sam3 package."""
        opts = _options(kwargs)
        extra = sorted(opts.hub_kwargs) + sorted(opts.config_kwargs)
        if extra:
            raise TypeError(f"from_model() got unexpected keyword argument(s) {extra}: a built "
                            "model has no checkpoint or config to apply them to")
        return build_from_model(model, opts)


def _options(kwargs: dict) -> LoadOptions:
    kwargs = dict(kwargs)
    requested = kwargs.pop("attn_implementation", None)
    if kwargs.pop("attention_config", None) is not None:
        warn_once("vision-attention_config", "attention_config is ignored for segmentation "
                  "models: they keep eager attention (vision attention is bidirectional)")
    vision_attention(requested)             # warns once when asked for a kernel
    return LoadOptions.from_kwargs(kwargs)


AutoXLAModelForMaskGeneration = AutoXLAModelForImageSegmentation
