"""A Plan from a config alone: the model built on the meta device (no weights, no XLA devices),
quantized on meta as asked, planned for a mesh. What `autoxla plan` and the forecasts run on."""
from __future__ import annotations

import os

import torch
from transformers import PretrainedConfig
from transformers.initialization import no_init_weights

from ..loading.checkpoint import require_path_or_hub_id
from ..planning.model_configs import shipped_config_dir
from ..sharding.mesh import mesh_shape_for, normalize_strategy
from .causal import causal_or_image_text_class
from .choices import quantization_for
from .empty import load_config
from .pipeline import empty_model, pick_auto_class, plan_for_mesh, quantize_layers
from .segmentation import auto_classes

# The dtype names the command line accepts, to torch's names.
DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
               "float16": "float16", "half": "float16", "fp32": "float32", "float32": "float32",
               "float": "float32"}


def plan_from_config(path_or_config, strategy: str = "fsdp", devices: int = 8, dtype=None,
                     quantization_config=None, on_tpu: bool = True, scan_layers: bool = True,
                     attn_implementation: str = "eager", attention_config=None):
    """The Plan of a causal LM or segmentation checkpoint, from its config on the meta device.

    The model class is the one from_pretrained would build: a causal LM or image-text-to-text
    model (modeling/causal.py) if transformers has one for the config, else the first
    segmentation auto class (in the seed's order) that knows it.
    """
    strategy = normalize_strategy(strategy)
    r, config = meta_model(path_or_config, dtype, quantization_config, on_tpu)
    return plan_for_mesh(r, config, strategy, mesh_shape_for(strategy, devices), scan_layers,
                         attn_implementation, attention_config)


def meta_model(path_or_config, dtype=None, quantization_config=None, on_tpu: bool = True):
    """(the model built on the meta device, quantized as asked; its config). A hub id that
    AutoXLA ships the config of (planning/model_configs.py) is read offline."""
    if isinstance(path_or_config, PretrainedConfig):
        config = path_or_config
    else:
        path = os.fspath(path_or_config)
        if os.path.isfile(path):            # a config.json given directly
            path = os.path.dirname(os.path.abspath(path))
        elif not os.path.exists(path):
            shipped = shipped_config_dir(path)
            if shipped is None:
                require_path_or_hub_id(path)
            path = shipped or path
        config = load_config(path)
    if isinstance(dtype, str):
        if dtype.lower() not in DTYPE_NAMES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of "
                             f"{', '.join(sorted(DTYPE_NAMES))}")
        dtype = getattr(torch, DTYPE_NAMES[dtype.lower()])
    auto_class = causal_or_image_text_class(config) or pick_auto_class(auto_classes(), config)
    with no_init_weights():     # a plan reads shapes only: random init on meta is wasted time
        r = empty_model(config, auto_class, dtype if dtype is not None else "auto")
    # the same choice of format as from_pretrained's (the checkpoint's own, if it is quantized)
    quantize_layers(r, quantization_for(config, quantization_config), on_tpu)
    return r, config
