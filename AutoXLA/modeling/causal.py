"""AutoXLAModelForCausalLM: the seed's entry point for decoder language models."""
from __future__ import annotations

import os

from torch import nn

from .options import LoadOptions
from .pipeline import build


class AutoXLAModelForCausalLM:
    """Loads a Hugging Face causal LM sharded over an XLA device mesh.

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
        from transformers import AutoModelForCausalLM

        opts = LoadOptions.from_kwargs(kwargs)
        return build(pretrained_model_name_or_path, AutoModelForCausalLM, opts)
