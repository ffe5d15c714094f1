"""The original AutoXLA's attention patchers (``AutoXLA.kernels.attention.impl_utils``), over ours.

The original replaced each attention module with a wrapper class of its own per model family.
Here nothing is replaced and nothing is reimplemented: ``patch_model`` points the model's own
attention modules at AutoXLA's kernels exactly as ``from_pretrained(..., attn_implementation=...)``
does, through ``AutoXLA.attention.patch_attention`` (AutoXLA/attention/patch.py; the kernels are
AutoXLA/attention/hf.py and tpu.py, the config AutoXLA/attention/config.py ``AttentionConfig``).
A model loaded with ``attn_implementation="eager"`` and patched here computes what the same
checkpoint loaded with the kernel computes.

Where the original's keywords differ from ours:

- ``layer_indices`` is ``AttentionConfig.layers`` (the other layers keep eager attention).
- ``logits_soft_cap``: the kernels apply the soft-cap the model's config sets
  (``attn_logit_softcapping``, Gemma 2), always; a value that disagrees with it is an error.
- ``model_type`` is not needed (every decoder attention module transformers' attention interface
  runs is found); one that is not the model's is reported with a warning.
- ``inplace=False`` copies a model that is on the CPU; a model AutoXLA sharded is refused (its
  deep copy would duplicate every shard on every device): patch it in place, or load a second
  copy with ``from_pretrained(..., attn_implementation=...)``.
- ``apply_splash_attention(block_size=...)`` sets every ``sa_block_*`` size; ``mask_k`` means
  nothing to the kernel (its mask is causal, the model's window and padding) and is ignored with
  a warning. The original passed both to a config that has no such fields (a TypeError).
- ``XLAFlashAttentionPatcher``'s ``partition_spec`` is the kernel's q/k/v spec
  (``AttentionConfig.qkv_partition_spec``): 4 entries, or 2 for (batch, heads), as
  from_pretrained's ``attention_partition_spec``; None derives it from the mesh. The original
  stored it and never used it.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import warnings
from typing import Any, Optional, Sequence

from torch import nn

from ...attention.config import AttentionConfig
from ...attention.patch import apply_attention, plan_attention
from ...saving import unwrap
from ...sharding.configs import decoder_config
# from_pretrained's own reading of the original's attention_layer_indices / attention_partition_spec
from ...modeling.options import fold_original_attention_keywords
from ...modeling.scan import stack_of
from ...state import record_state, state_of

logger = logging.getLogger("AutoXLA")

SplashAttentionConfig = AttentionConfig
_BLOCK_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionConfig)
                      if f.name.startswith("sa_block_"))


class BaseAttentionPatcher:
    """Points a model's decoder attention at one of AutoXLA's kernels (subclasses name which)."""

    kernel: str = ""    # "splash_attention" or "xla_flash_attention"
    name: str = ""

    def __init__(self, model_type: Optional[str] = None,
                 layer_indices: Optional[Sequence[int]] = None,
                 logits_soft_cap: Optional[float] = None):
        self.model_type = model_type
        self.layer_indices = None if layer_indices is None else list(layer_indices)
        self.logits_soft_cap = logits_soft_cap
        self.patched_layers: list[int] = []

    def attention_config(self, model: nn.Module) -> AttentionConfig:
        """The kernel's config for ``model`` (before ``layer_indices`` is applied)."""
        raise NotImplementedError

    def kernel_mesh(self, model: nn.Module):
        """The mesh the kernel runs over: the one AutoXLA sharded the model over."""
        return state_of(model).mesh

    def patch_model(self, model: nn.Module, inplace: bool = True) -> nn.Module:
        """Routes ``model``'s decoder attention to the kernel; returns the model (a copy of a
        CPU model with ``inplace=False``)."""
        if not self.kernel:
            raise TypeError("BaseAttentionPatcher names no kernel: use SplashAttentionPatcher "
                            "or XLAFlashAttentionPatcher")
        if not inplace:
            model = _copy(model)
        inner = unwrap(model)   # inside an FSDPv2 wrapper
        if getattr(inner, "config", None) is None:
            raise TypeError(f"{self.name} patches a transformers model (one with a config), got "
                            f"{type(inner).__name__}")
        self._check_model_type(inner)
        _check_soft_cap(inner, self.logits_soft_cap)
        cfg = fold_original_attention_keywords(self.attention_config(inner), self.layer_indices, None)
        mesh = self.kernel_mesh(inner)
        if mesh is None:
            warnings.warn(f"{type(inner).__name__} was not loaded by AutoXLA (no autoxla_mesh): "
                          f"{self.name} runs its portable path, never the TPU kernel; load it with "
                          "AutoXLAModelForCausalLM.from_pretrained to shard it and use the kernel",
                          stacklevel=3)
        planned = plan_attention(inner, self.kernel, cfg, mesh)
        apply_attention(inner, planned, cfg, mesh)
        _rescan(model, inner, planned)
        self.patched_layers = sorted({m.layer_idx for m in inner.modules()
                                      if getattr(m, "autoxla_attention", None) is not None
                                      and m.layer_idx is not None})
        logger.info("%s: patched the attention of layers %s", self.name, self.patched_layers)
        return model

    def _check_model_type(self, model: nn.Module) -> None:
        config = model.config
        types = {config.model_type, decoder_config(config).model_type}
        if self.model_type is not None and self.model_type not in types:
            warnings.warn(f"model_type={self.model_type!r} is not used: the model is "
                          f"{config.model_type!r}, and AutoXLA patches every decoder attention "
                          "module of any model type", stacklevel=4)


class SplashAttentionPatcher(BaseAttentionPatcher):
    """Splash attention on every (or the chosen) decoder layer: ``patch_model(model)``."""

    kernel, name = "splash_attention", "Splash Attention"

    def __init__(self, splash_config: Any, model_type: Optional[str] = None,
                 layer_indices: Optional[Sequence[int]] = None,
                 logits_soft_cap: Optional[float] = None):
        super().__init__(model_type, layer_indices, logits_soft_cap)
        # An AttentionConfig (= SplashAttentionConfig), its dict, or torch_xla's config.
        self.splash_config = AttentionConfig.from_any(splash_config)

    def attention_config(self, model: nn.Module) -> AttentionConfig:
        return self.splash_config

    @staticmethod
    def from_model_config(model: nn.Module, layer_indices: Optional[Sequence[int]] = None,
                          **splash_kwargs) -> "SplashAttentionPatcher":
        """A patcher whose config has ``splash_kwargs`` and the model's own soft-cap."""
        inner = unwrap(model)
        return SplashAttentionPatcher(AttentionConfig.from_any(splash_kwargs),
                                      layer_indices=layer_indices,
                                      logits_soft_cap=_model_soft_cap(inner))


class XLAFlashAttentionPatcher(BaseAttentionPatcher):
    """torch_xla's flash attention on every (or the chosen) decoder layer."""

    kernel, name = "xla_flash_attention", "XLA Flash Attention"

    def __init__(self, mesh: Any, partition_spec: Any = None, model_type: Optional[str] = None,
                 layer_indices: Optional[Sequence[int]] = None,
                 logits_soft_cap: Optional[float] = None):
        super().__init__(model_type, layer_indices, logits_soft_cap)
        self.mesh = mesh
        self.partition_spec = partition_spec
        # Validated now: a wrong spec is an error at construction, as a config's would be.
        self._config = fold_original_attention_keywords(AttentionConfig(), None, partition_spec)

    def attention_config(self, model: nn.Module) -> AttentionConfig:
        if self.mesh is None:
            return self._config
        model_mesh = state_of(model).mesh
        cfg = dataclasses.replace(self._config, mesh=str(self.mesh))
        if model_mesh is not None:
            try:
                cfg.with_mesh(model_mesh)
            except ValueError as e:
                raise ValueError(f"XLAFlashAttentionPatcher(mesh=...) must be the mesh the "
                                 f"model is sharded over (model.autoxla_mesh, or None for it): "
                                 f"{e}") from None
        return cfg

    def kernel_mesh(self, model: nn.Module):
        return state_of(model).mesh or self.mesh

    @staticmethod
    def from_model_config(model: nn.Module, mesh: Any, partition_spec: Any = None,
                          layer_indices: Optional[Sequence[int]] = None
                          ) -> "XLAFlashAttentionPatcher":
        """A patcher with the model's own soft-cap."""
        inner = unwrap(model)
        return XLAFlashAttentionPatcher(mesh, partition_spec, layer_indices=layer_indices,
                                        logits_soft_cap=_model_soft_cap(inner))


def apply_splash_attention(model: nn.Module, splash_config: Any = None,
                           block_size: Optional[int] = None, mask_k: Optional[int] = None,
                           layer_indices: Optional[Sequence[int]] = None, inplace: bool = True,
                           **splash_kwargs) -> nn.Module:
    """Splash attention on ``model``'s decoder layers (all, or ``layer_indices``).

    ``splash_config``: an AttentionConfig (= SplashAttentionConfig), its dict or torch_xla's
    config; or None, then one is built from ``splash_kwargs`` (its fields), with ``block_size``
    as every ``sa_block_*`` size not given. ``mask_k`` is accepted and ignored, with a warning.
    """
    if mask_k is not None:
        warnings.warn(f"mask_k={mask_k} has no meaning for AutoXLA's splash attention (its mask is "
                      "causal, the model's sliding window and the padding) and is ignored",
                      stacklevel=2)
    if splash_config is None:
        fields = dict(splash_kwargs)
        if block_size is not None:
            for key in _BLOCK_FIELDS:
                fields.setdefault(key, block_size)
        splash_config = AttentionConfig.from_any(fields)
    else:
        if splash_kwargs:
            raise ValueError(f"pass either splash_config or its fields as keywords, not both "
                             f"(got splash_config and {sorted(splash_kwargs)}): put them in the "
                             "config, e.g. dataclasses.replace(splash_config, ...)")
        if block_size is not None:
            warnings.warn(f"block_size={block_size} is ignored: splash_config gives the block "
                          "sizes (its sa_block_* fields)", stacklevel=2)
    patcher = SplashAttentionPatcher(splash_config, layer_indices=layer_indices)
    return patcher.patch_model(model, inplace=inplace)


def apply_xla_flash_attention(model: nn.Module, mesh: Any = None, partition_spec: Any = None,
                              layer_indices: Optional[Sequence[int]] = None,
                              inplace: bool = True) -> nn.Module:
    """torch_xla's flash attention on ``model``'s decoder layers (all, or ``layer_indices``).

    ``mesh`` must be the mesh AutoXLA sharded the model over (None: that one);
    ``partition_spec`` is the q/k/v spec (4 entries, or 2 for batch and heads; None: derived
    from the mesh)."""
    patcher = XLAFlashAttentionPatcher(mesh, partition_spec, layer_indices=layer_indices)
    return patcher.patch_model(model, inplace=inplace)


# -- helpers ---------------------------------------------------------------------------------

def _model_soft_cap(model: nn.Module):
    return getattr(decoder_config(model.config), "attn_logit_softcapping", None)


def _check_soft_cap(model: nn.Module, requested) -> None:
    if requested is None:
        return
    actual = _model_soft_cap(model)
    if actual is None or float(requested) != float(actual):
        raise ValueError(
            f"logits_soft_cap={requested}, but the model's config sets attn_logit_softcapping="
            f"{actual}: AutoXLA's kernels apply the soft-cap the model's config sets, so that "
            "they compute what the model computes. Drop logits_soft_cap, or change "
            "attn_logit_softcapping in the config before loading")


def _copy(model: nn.Module) -> nn.Module:
    if state_of(model).plan is not None:
        raise ValueError(
            "inplace=False would deep-copy a model AutoXLA sharded over the XLA devices, "
            "duplicating every shard on every device; patch it in place (inplace=True), or load a "
            "second copy with AutoXLAModelForCausalLM.from_pretrained(path, attn_implementation="
            "'splash_attention') (or 'xla_flash_attention')")
    return copy.deepcopy(model)


def _rescan(model: nn.Module, inner: nn.Module, planned) -> None:
    """A scanned decoder stack runs one layer's (or one group's) modules for every step: if the
    patch made the layers differ (layer_indices), it runs unrolled, as from_pretrained decides
    when its attention_config['layers'] does the same (planning/plan.py). The model's plan is
    then replaced by one that records the new attention and stack (on the wrapper too: both
    read it), since a Plan is never changed in place."""
    stack = stack_of(inner)
    if stack is not None:
        stack.stack_plan = stack.stack_plan.rechecked(stack.shells)
    plan = state_of(inner).plan
    if plan is None:
        return
    unrolled = stack is not None and not stack.stack_plan.scanned
    new = dataclasses.replace(plan, layer_attention=planned,
                              stack=stack.stack_plan if unrolled else plan.stack)
    for holder in ([model] if model is inner else [model, inner]):
        record_state(holder, plan=new)    # generation reads the stack to pick its cache
