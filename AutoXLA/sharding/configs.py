"""Which config describes each part of a model. A vision-language model (Mistral 3, LLaVA) nests
its text decoder's config (``text_config``) and its vision tower's (``vision_config``) inside its
own, which holds no head or layer counts of its own; sharding, the KV cache, the scanned stack and
the attention kernels read the part's own config."""
from __future__ import annotations

from torch import nn


def decoder_config(config):
    """The text decoder's config: ``config`` itself, or its nested text config."""
    if config is None or not hasattr(config, "get_text_config"):
        return config
    return config.get_text_config(decoder=True)


def module_configs(model: nn.Module, config) -> dict:
    """Module path -> the config that describes it: the nearest enclosing module's own config
    (transformers' sub-models hold theirs as ``.config``), else ``config``."""
    from transformers import PretrainedConfig

    out = {}
    for path, m in model.named_modules():   # parents come before their children
        own = getattr(m, "config", None)
        inherited = out.get(path.rpartition(".")[0], config) if path else config
        out[path] = own if path and isinstance(own, PretrainedConfig) else inherited
    return out
