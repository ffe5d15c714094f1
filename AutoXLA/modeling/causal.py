"""AutoXLAModelForCausalLM: the seed's entry point for decoder language models (and for
vision-language models that generate text: image-text-to-text checkpoints such as Mistral 3)."""
from __future__ import annotations

import os

from torch import nn

from ..saving import unwrap
from .image_text import merge_images_statically
from .options import LoadOptions
from .pipeline import build


class AutoXLAModelForCausalLM:
    """Loads a Hugging Face causal LM (or image-text-to-text model) sharded over an XLA device mesh.

    Not instantiable: use ``from_pretrained``. The returned object is the transformers model
    (or its FSDPv2 wrapper with ``use_fsdp_wrap=True``), with ``autoxla_plan`` (the Plan it was
    loaded by) and ``autoxla_mesh`` attached.
    """

    def __init__(self, *args, **kwargs):
        raise TypeError("AutoXLAModelForCausalLM is a factory: call "
                        "AutoXLAModelForCausalLM.from_pretrained(path, ...)")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *model_args,
                        **kwargs) -> nn.Module:
        """Load, plan, stream and shard a checkpoint (see docs/usage.md for every keyword).

        Keywords: auto_shard (True), sharding_strategy ("fsdp"; "dp"/"data_parallel",
        "mp"/"model_parallel", "2d", "3d"), mesh (a torch_xla Mesh with axes data, fsdp, model),
        use_fsdp_wrap, auto_wrap_policy, shard_output_callable, gradient_checkpointing, verbose,
        dtype ("auto"), attn_implementation ("eager", "xla_flash_attention",
        "splash_attention"), attention_config, do_quant, quantization_config, and transformers'
        own loading keywords.
        """
        if model_args:
            raise TypeError("from_pretrained takes the path positionally and everything else "
                            f"as keywords; got extra positional arguments {model_args!r}")
        opts = LoadOptions.from_kwargs(kwargs)
        model = build(pretrained_model_name_or_path, auto_class_for, opts)
        hf = unwrap(model)
        if getattr(hf.config, "vision_config", None) is not None:   # an image-text-to-text model
            merge_images_statically(hf)
        return model


def auto_class_for(config):
    """The transformers auto class that builds ``config``'s generating model.

    A config with a vision tower (``vision_config``: Mistral 3, LLaVA, ...) is an
    image-text-to-text model, as in the original AutoXLA; so is a config AutoModelForCausalLM does
    not know but AutoModelForImageTextToText does. Everything else is a causal LM.
    """
    auto_class = causal_or_image_text_class(config)
    if auto_class is None:
        raise ValueError(
            f"{type(config).__name__} (model_type {getattr(config, 'model_type', '?')!r}) is "
            "neither a causal LM (AutoModelForCausalLM) nor an image-text-to-text model "
            "(AutoModelForImageTextToText) transformers can build; AutoXLAModelForCausalLM loads "
            "decoder language models and vision-language models. For segmentation use "
            "AutoXLAModelForImageSegmentation")
    return auto_class


def causal_or_image_text_class(config):
    """auto_class_for's choice, or None when neither auto class knows ``config`` (for callers
    that try other loaders next, as ``autoxla plan`` does)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    order = (AutoModelForCausalLM, AutoModelForImageTextToText)
    if getattr(config, "vision_config", None) is not None:
        order = order[::-1]
    remote = getattr(config, "auto_map", None) or {}     # trust_remote_code models name theirs
    return next((c for c in order if type(config) in c._model_mapping or c.__name__ in remote),
                None)
