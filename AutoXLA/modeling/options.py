"""The keywords of from_pretrained, validated once at the edge."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..attention import AttentionConfig
from ..attention.config import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from ..attention.hf import warn_once
from ..generation import GenerationOptions
from .. import runtimes
from ..quantization import CalibrationConfig, QuantizationConfig
from ..sharding.mesh import normalize_strategy
from ..sharding.multislice import MultiSlice


@dataclass
class LoadOptions:
    sharding_strategy: str = "fsdp"
    auto_shard: bool = True
    mesh: Any = None
    use_fsdp_wrap: bool = False
    auto_wrap_policy: Callable | None = None
    shard_output_callable: Callable | None = None
    gradient_checkpointing: bool = False
    verbose: bool | None = None         # None: a progress bar on a terminal; True: also the plan
    dtype: Any = "auto"
    attn_implementation: str = "eager"
    attention_config: Any = None        # AttentionConfig once validated (kernels only)
    attention_layer_indices: Any = None   # the original AutoXLA's attention_config["layers"]
    attention_partition_spec: Any = None  # the original's q/k/v spec: qkv_partition_spec
    trust_remote_code: bool = False
    use_safetensors: bool | None = None
    xla_patch_linear: bool = False      # torch_xla's einsum nn.Linear, applied before sharding
    do_quant: bool | None = None
    quantization_config: Any = None     # QuantizationConfig (or its dict) once validated
    calibration: Any = None             # CalibrationConfig once validated (True, text, ids, ...)
    generation_options: Any = None      # GenerationOptions (or its dict) once validated
    compile_cache: Any = None           # directory of torch_xla's persistent compilation cache
    scan_layers: bool | None = None     # the decoder stack as one loop where it repeats (None:
                                        # on the xla runtime; the dtensor one runs layer by layer)
    multislice: Any = None              # MultiSlice once validated: slices joined by DCN
    runtime: str | None = None          # "xla" | "dtensor"; None: the installed one (runtimes/)
    hub_kwargs: dict = field(default_factory=dict)      # revision, cache_dir, token, ...
    config_kwargs: dict = field(default_factory=dict)   # anything else: config overrides

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> "LoadOptions":
        kwargs = dict(kwargs)
        if "torch_dtype" in kwargs and "dtype" not in kwargs:
            kwargs["dtype"] = kwargs.pop("torch_dtype")
        hub = {k: kwargs.pop(k) for k in ("revision", "cache_dir", "local_files_only", "token",
                                          "subfolder", "force_download") if k in kwargs}
        own = {k: kwargs.pop(k) for k in list(kwargs) if k in cls.__dataclass_fields__
               and k not in ("hub_kwargs", "config_kwargs")}
        opts = cls(**own, hub_kwargs=hub, config_kwargs=kwargs)
        opts._validate()
        return opts

    def _validate(self) -> None:
        self.sharding_strategy = normalize_strategy(self.sharding_strategy)
        if not self.auto_shard and self.mesh is None:
            raise ValueError("auto_shard=False needs mesh=: pass the Mesh to shard over, or keep "
                             "auto_shard=True to build one from sharding_strategy")
        impl = self.attn_implementation or "eager"
        if not isinstance(impl, str) or impl.strip().lower() not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"unknown attn_implementation {impl!r}; use one of "
                             f"{', '.join(ATTENTION_IMPLEMENTATIONS)} (case-insensitive)")
        self.attn_implementation = impl.strip().lower()
        self._validate_attention()
        if self.verbose not in (None, True, False):
            raise TypeError(f"verbose must be True, False or None (a progress bar on a "
                            f"terminal), got {self.verbose!r}")
        if self.dtype not in ("auto", None) and not isinstance(self.dtype, torch.dtype):
            if isinstance(self.dtype, str) and isinstance(getattr(torch, self.dtype, None), torch.dtype):
                self.dtype = getattr(torch, self.dtype)
            else:
                raise ValueError(f"dtype={self.dtype!r} is not a torch dtype; use e.g. "
                                 "torch.bfloat16, 'bfloat16' or 'auto' (the checkpoint's dtype)")
        self._validate_quantization()

        self.generation_options = GenerationOptions.from_any(self.generation_options)
        if self.compile_cache is not None and not isinstance(self.compile_cache, (str, os.PathLike)):
            raise TypeError(f"compile_cache must be a directory path, got "
                            f"{type(self.compile_cache).__name__}")
        self._validate_multislice()
        self._validate_runtime()
        if self.scan_layers is None:
            self.scan_layers = self.runtime == "xla"
        if not isinstance(self.scan_layers, bool):
            raise TypeError(f"scan_layers must be True or False, got {self.scan_layers!r}")
        if not isinstance(self.xla_patch_linear, bool):
            raise TypeError(f"xla_patch_linear must be True or False, got {self.xla_patch_linear!r}")
        for name in ("auto_wrap_policy", "shard_output_callable"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"{name} must be callable, got {type(value).__name__}")
        if (self.auto_wrap_policy or self.shard_output_callable) and not self.use_fsdp_wrap:
            raise ValueError("auto_wrap_policy and shard_output_callable configure the FSDPv2 "
                             "wrapper: pass use_fsdp_wrap=True as well")

    def _validate_runtime(self) -> None:
        self.runtime = runtimes.check_name(self.runtime) or runtimes.default()
        if self.runtime != "dtensor":
            return
        # What the dtensor runtime runs so far (docs/runtimes.md): refused by name, not ignored.
        asked = {"attn_implementation": self.attn_implementation != "eager",
                 "multislice": self.multislice is not None,
                 "use_fsdp_wrap": self.use_fsdp_wrap, "xla_patch_linear": self.xla_patch_linear,
                 "calibration": self.calibration is not None,
                 "compile_cache": self.compile_cache is not None}
        asked["scan_layers=True"] = self.scan_layers is True
        refused = [k for k, on in asked.items() if on]
        if refused:
            raise ValueError(f"runtime='dtensor' does not take {', '.join(refused)} yet: they are "
                             "options of the xla runtime (runtime='xla'); docs/runtimes.md lists "
                             "what each runtime runs")

    def _validate_multislice(self) -> None:
        ms = self.multislice
        if isinstance(ms, int) and not isinstance(ms, bool):
            ms = MultiSlice(ms)
        if ms is not None and not isinstance(ms, MultiSlice):
            raise TypeError(f"multislice must be an AutoXLA.sharding.MultiSlice (or a slice "
                            f"count), got {type(ms).__name__}; e.g. multislice=MultiSlice(2)")
        if ms is not None and ms.slices > 1 and self.mesh is not None:
            raise ValueError("multislice=... builds the mesh across slices, but mesh= passes one "
                             "already: build yours with torch_xla's HybridMesh and drop "
                             "multislice, or drop mesh=")
        self.multislice = ms if ms is not None and ms.slices > 1 else None

    def _validate_attention(self) -> None:
        cfg = AttentionConfig.from_any(self.attention_config)   # checked even when unused
        cfg = fold_original_attention_keywords(cfg, self.attention_layer_indices,
                                      self.attention_partition_spec)
        self.attention_layer_indices = self.attention_partition_spec = None
        if self.attn_implementation == "eager":
            if cfg != AttentionConfig():
                warn_once("eager-attention-config", "attention_config (or attention_layer_indices"
                          " / attention_partition_spec) configures the attention kernels, but "
                          "attn_implementation is 'eager': it is ignored. Pass "
                          "attn_implementation='splash_attention' or 'xla_flash_attention' to use it")
            self.attention_config = None
            return
        self.attention_config = cfg

    def _validate_quantization(self) -> None:
        cfg = self.quantization_config
        if isinstance(cfg, dict):
            cfg = QuantizationConfig.from_dict(cfg)
        if cfg is not None and not isinstance(cfg, QuantizationConfig):
            raise TypeError(f"quantization_config must be an AutoXLA QuantizationConfig (or its "
                            f"dict), got {type(cfg).__name__}; build one with "
                            "AutoXLA.quantization.QuantizationConfig(bits=8)")
        if self.do_quant not in (None, True, False):
            raise TypeError(f"do_quant must be True or False, got {self.do_quant!r}")
        if self.do_quant is False and cfg is not None:
            raise ValueError("do_quant=False contradicts quantization_config=...: drop one of them")
        if self.do_quant and cfg is None:
            cfg = QuantizationConfig()   # int8 per-channel symmetric
        self.quantization_config = cfg
        self.do_quant = cfg is not None

        self.calibration = CalibrationConfig.from_any(self.calibration)
        if self.calibration is not None and not self.do_quant:
            raise ValueError("calibration=... calibrates quantization, but nothing is quantized: "
                             "pass do_quant=True (with quantization_config=QuantizationConfig("
                             "quantize_activation=True) for W8A8 with SmoothQuant)")


def fold_original_attention_keywords(cfg, layer_indices, partition_spec):
    """The original AutoXLA's two attention keywords folded into the AttentionConfig:
    ``attention_layer_indices`` is ``layers``; ``attention_partition_spec`` is the q/k/v spec,
    given whole (4 entries) or as (batch, heads) for [batch, heads, seq, head_dim]."""
    import dataclasses

    changes = {}
    if layer_indices is not None:
        layers = AttentionConfig(layers=layer_indices).layers
        if cfg.layers is not None and cfg.layers != layers:
            raise ValueError(f"attention_layer_indices={list(layers)} and attention_config"
                             f"['layers']={list(cfg.layers)} disagree; they are the same "
                             "setting: pass one of them")
        changes["layers"] = layers
    if partition_spec is not None:
        spec = tuple(partition_spec) if isinstance(partition_spec, (list, tuple)) else partition_spec
        if isinstance(spec, tuple) and len(spec) == 2:
            spec = spec + (None, None)
        spec = AttentionConfig(qkv_partition_spec=spec).qkv_partition_spec
        if cfg.qkv_partition_spec is not None and cfg.qkv_partition_spec != spec:
            raise ValueError(f"attention_partition_spec={partition_spec!r} and attention_config"
                             f"['qkv_partition_spec']={cfg.qkv_partition_spec!r} disagree; pass one")
        changes["qkv_partition_spec"] = spec
    return dataclasses.replace(cfg, **changes) if changes else cfg
