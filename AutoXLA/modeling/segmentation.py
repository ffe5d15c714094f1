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


# Tried after those, as the original AutoXLA does: DETR's AutoModelForImageSegmentation, then the
# bare AutoModel, which builds models no task class maps, such as SAM 3's text-prompted detector
# (Sam3Config -> Sam3Model).
FALLBACK_CLASS_NAMES = ("AutoModelForImageSegmentation", "AutoModel")
# AutoModel also builds every text model (LlamaConfig -> LlamaModel), which is no segmentation
# model: a config that one of these maps is refused by the fallback, so it keeps the clear error.
TEXT_AUTO_CLASS_NAMES = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM",
                         "AutoModelForImageTextToText")


def auto_classes() -> tuple:
    import transformers

    names = AUTO_CLASS_NAMES + FALLBACK_CLASS_NAMES[:-1]
    found = tuple(getattr(transformers, n) for n in names if hasattr(transformers, n))
    return found + (_non_text_auto_model(),)


def _non_text_auto_model():
    """transformers.AutoModel whose mapping leaves out the configs of text models."""
    import transformers

    text = [getattr(transformers, n)._model_mapping for n in TEXT_AUTO_CLASS_NAMES
            if hasattr(transformers, n)]
    return type("AutoModel", (transformers.AutoModel,), {
        "__doc__": _non_text_auto_model.__doc__,
        "_model_mapping": _WithoutText(transformers.AutoModel._model_mapping, text)})


class _WithoutText:
    """A read-only view of an auto mapping without the config types any of ``text`` maps."""

    def __init__(self, mapping, text):
        self._mapping, self._text = mapping, text

    def __contains__(self, config_type) -> bool:
        return config_type in self._mapping and not any(config_type in t for t in self._text)

    def __getitem__(self, config_type):
        if config_type not in self:
            raise KeyError(config_type)
        return self._mapping[config_type]

    def keys(self):
        return [k for k in self._mapping.keys() if k in self]

    def get(self, config_type, default=None):
        return self[config_type] if config_type in self else default


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
