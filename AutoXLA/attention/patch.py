"""Step 4 of the pipeline: point a loaded model's attention at a kernel, layer by layer."""
from __future__ import annotations

from torch import nn

from ..sharding.configs import decoder_config
from .config import KERNELS, TRANSFORMERS_NAMES, AttentionConfig
from .hf import LayerAttention, register, warn_once


def patch_attention(model: nn.Module, implementation: str, cfg: AttentionConfig, mesh) -> int:
    """Routes the model's attention modules to ``implementation`` (a kernel name).

    Layers outside ``cfg.layers`` keep the model's eager attention. Returns the number of
    attention modules patched; a model with none that go through transformers' attention
    interface is an error rather than a silent no-op.
    """
    if implementation not in KERNELS:
        raise ValueError(f"unknown attention kernel {implementation!r}; use one of {KERNELS}")
    register()
    cfg = cfg.with_mesh(mesh) if mesh is not None else cfg
    config = getattr(model, "config", None)
    decoder = decoder_config(config)
    # A vision-language model: only its text decoder's attention (the vision tower's is
    # bidirectional and stays eager).
    modules = [m for m in model.modules() if _uses_attention_interface(m)
               and (decoder is config or m.config is decoder)]
    if not modules:
        raise ValueError(f"{type(model).__name__} has no attention module that goes through "
                         "transformers' AttentionInterface; use attn_implementation='eager'")
    if any(isinstance(getattr(m, "sinks", None), nn.Parameter) for m in modules):
        # gpt-oss's attention sinks (a learned logit per head in every softmax): neither Pallas
        # kernel nor the portable path has them, and leaving them out would be silently wrong.
        warn_once(f"sinks-{implementation}", "attn_implementation=%r: attention sinks (gpt-oss) "
                  "are in neither Pallas kernel nor AutoXLA's portable path; the model runs its "
                  "eager attention", implementation)
        for m in modules:
            m.autoxla_attention = None
        if config is not None:
            set_decoder_attention(config, "eager")
        return 0
    layers = {m.layer_idx for m in modules if getattr(m, "layer_idx", None) is not None}
    cfg.check_layers(max(layers) + 1 if layers else 0)
    patched = 0
    for m in modules:
        chosen = cfg.patches(getattr(m, "layer_idx", None))
        m.autoxla_attention = LayerAttention(implementation, cfg, mesh) if chosen else None
        patched += chosen
    if config is not None:
        set_decoder_attention(config, TRANSFORMERS_NAMES[implementation])
    return patched


def set_decoder_attention(config, name: str) -> None:
    """``name`` as the attention implementation of the text decoder only. transformers' setter
    applies a value to every sub-config, so a vision-language config is set to eager first (its
    vision tower attends bidirectionally, which the kernels do not implement), then its decoder."""
    decoder = decoder_config(config)
    if decoder is not config:
        config._attn_implementation = "eager"
    decoder._attn_implementation = name


def _uses_attention_interface(module: nn.Module) -> bool:
    # transformers' attention modules hold their config and layer index, and read
    # config._attn_implementation on every call to pick the attention function.
    return (type(module).__name__.endswith("Attention") and hasattr(module, "config")
            and hasattr(module, "layer_idx"))


def vision_attention(requested: str | None) -> str:
    """The attention a segmentation model gets: always eager, saying so once if asked for more.

    The kernels implement causal decoder attention; vision encoders attend bidirectionally.
    """
    if requested not in (None, "eager"):
        warn_once(f"vision-{requested}", "attn_implementation=%r is ignored for segmentation "
                  "models: the kernels implement causal decoder attention, and vision attention "
                  "is bidirectional; using eager attention", requested)
    return "eager"
