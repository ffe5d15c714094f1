"""Which kernel each attention module runs: decided on the empty model (``plan_attention``, a
value the Plan records), applied to the loaded one (``apply_attention``, step 4 of the pipeline)."""
from __future__ import annotations

from torch import nn

from ..planning.plan import LayerAttentionPlan
from ..sharding.attention_heads import kernel_heads
from ..sharding.configs import decoder_config
from ..sharding.mesh import MeshShape, validate_mesh_axes
from .config import KERNELS, TRANSFORMERS_NAMES, AttentionConfig
from .hf import LayerAttention, register, warn_once


def patch_attention(model: nn.Module, implementation: str, cfg: AttentionConfig, mesh) -> int:
    """Routes the model's attention modules to ``implementation`` (a kernel name): the plan of
    ``plan_attention``, applied at once (for a model patched after loading: kernels/attention).
    Returns the number of attention modules patched."""
    if implementation not in KERNELS:
        raise ValueError(f"unknown attention kernel {implementation!r}; use one of {KERNELS}")
    return apply_attention(model, plan_attention(model, implementation, cfg, mesh), cfg, mesh)


def plan_attention(model: nn.Module, implementation: str, cfg: AttentionConfig | None,
                   mesh=None) -> LayerAttentionPlan | None:
    """Which kernel each attention module of ``model`` will run (it may be empty: nothing is read
    but its structure): ``implementation`` in the layers ``cfg.layers`` names (all by default),
    the model's eager attention in the others, and in all of them when the model has attention
    sinks, which no kernel implements; None for "eager" (nothing is patched). A model with no
    attention module that goes through transformers' attention interface is an error rather
    than a silent no-op. With the ``mesh`` (a MeshShape, or a torch_xla Mesh), also how the
    kernel splits the heads over it (sharding/attention_heads.py)."""
    if implementation == "eager":
        return None
    cfg = cfg if cfg is not None else AttentionConfig()
    if implementation not in KERNELS:
        raise ValueError(f"unknown attention kernel {implementation!r}; use one of {KERNELS}")
    config = getattr(model, "config", None)
    decoder = decoder_config(config)
    # A vision-language model: only its text decoder's attention (the vision tower's is
    # bidirectional and stays eager).
    modules = [(path, m) for path, m in model.named_modules() if _uses_attention_interface(m)
               and (decoder is config or m.config is decoder)]
    if not modules:
        raise ValueError(f"{type(model).__name__} has no attention module that goes through "
                         "transformers' AttentionInterface; use attn_implementation='eager'")
    if any(isinstance(getattr(m, "sinks", None), nn.Parameter) for _, m in modules):
        # gpt-oss's attention sinks (a learned logit per head in every softmax): neither Pallas
        # kernel nor the portable path has them, and leaving them out would be silently wrong.
        warn_once(f"sinks-{implementation}", "attn_implementation=%r: attention sinks (gpt-oss) "
                  "are in neither Pallas kernel nor AutoXLA's portable path; the model runs its "
                  "eager attention", implementation)
        return LayerAttentionPlan("eager", {path: "eager" for path, _ in modules},
                                  "attention sinks: no kernel has them")
    layers = {m.layer_idx for _, m in modules if getattr(m, "layer_idx", None) is not None}
    cfg.check_layers(max(layers) + 1 if layers else 0)
    chosen = {path: implementation if cfg.patches(getattr(m, "layer_idx", None)) else "eager"
              for path, m in modules}
    why = "" if cfg.layers is None else f"attention_config['layers'] = {list(cfg.layers)}"
    return LayerAttentionPlan(implementation, chosen, why,
                              _heads(implementation, decoder, cfg, mesh))


def _heads(kernel: str, decoder, cfg: AttentionConfig, mesh):
    """The plan's head split for ``kernel`` on ``mesh``, from the text decoder's head counts;
    None without a mesh or head counts (each call then decides from its shapes)."""
    heads = getattr(decoder, "num_attention_heads", None)
    kv_heads = getattr(decoder, "num_key_value_heads", None) or heads
    if mesh is None or not isinstance(heads, int) or not isinstance(kv_heads, int):
        return None
    if not isinstance(mesh, MeshShape):     # a torch_xla Mesh
        mesh = validate_mesh_axes(mesh.axis_names, mesh.mesh_shape, len(mesh.device_ids))
    return kernel_heads(kernel, heads, kv_heads, mesh, cfg.qkv_partition_spec)


def apply_attention(model: nn.Module, planned: LayerAttentionPlan, cfg: AttentionConfig,
                    mesh) -> int:
    """Points each attention module at the kernel ``planned`` gives it (None: the model's eager
    attention) and the text decoder's config at the kernel's name. Returns how many run a
    kernel."""
    register()
    if mesh is not None and planned.kernel != "eager":
        cfg = cfg.with_mesh(mesh)
    patched = 0
    for path, kernel in planned.modules.items():
        chosen = kernel != "eager"
        model.get_submodule(path).autoxla_attention = (
            LayerAttention(kernel, cfg, mesh, planned.heads) if chosen else None)
        patched += chosen
    config = getattr(model, "config", None)
    if config is not None:
        set_decoder_attention(config, TRANSFORMERS_NAMES.get(planned.kernel, "eager"))
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
