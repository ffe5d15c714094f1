"""attention_config: one validated object for the attention kernels (seed: "Splash Attention").

The keys are torch_xla's ``SplashAttentionConfig`` fields, so the seed's dict (the ``sa_block_*``
sizes and ``"mesh": str(mesh)``) and a ``SplashAttentionConfig`` itself are both accepted, plus
two of ours: ``layers`` (which decoder layers use the kernel; the rest stay eager) and a
``qkv_partition_spec`` that defaults to one derived from the mesh. ``sa_block_q`` and
``sa_block_kv`` are also the block shape of the portable path that runs off TPU.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import InitVar, dataclass
from typing import Any

from ..sharding.mesh import canonical_device_ids, validate_mesh_axes

IMPLEMENTATIONS = ("eager", "xla_flash_attention", "splash_attention")
KERNELS = IMPLEMENTATIONS[1:]
# The names the kernels are registered under in transformers. transformers treats any name that
# contains "flash" as its own flash-attention family (hub kernels, 2D masks), so neither may.
TRANSFORMERS_NAMES = {"xla_flash_attention": "autoxla_fa", "splash_attention": "autoxla_splash"}
_BLOCK_KEYS = ("sa_block_q", "sa_block_kv", "sa_block_kv_compute", "sa_block_q_dkv",
               "sa_block_kv_dkv", "sa_block_kv_dkv_compute", "sa_block_q_dq", "sa_block_kv_dq")
_LAYOUTS = ("HEAD_DIM_MINOR", "SEQ_MINOR")
_BATCH = ("data", "fsdp")
# The original AutoXLA's key -> ours (torch_xla's field name).
_ALIASES = {"AttentionType_LOCAL_SLIDING": "attentiontype_local_sliding",
            "SLIDE_WINDOW_SIZE": "slide_window_size"}
# Axis names other libraries use for ours: the original AutoXLA's splash specs say "mp".
_AXIS_ALIASES = {"mp": "model"}


@dataclass(frozen=True)
class AttentionConfig:
    # Block sizes (torch_xla's defaults are 2048; 512 is the seed's choice and suits the
    # sequence lengths the portable path is used for).
    sa_block_q: int = 512
    sa_block_kv: int = 512
    sa_block_kv_compute: int = 512
    sa_block_q_dkv: int = 512
    sa_block_kv_dkv: int = 512
    sa_block_kv_dkv_compute: int = 512
    sa_block_q_dq: int = 512
    sa_block_kv_dq: int = 512
    sa_use_fused_bwd_kernel: bool = True
    sa_q_layout: str = "HEAD_DIM_MINOR"
    sa_k_layout: str = "HEAD_DIM_MINOR"
    sa_v_layout: str = "HEAD_DIM_MINOR"
    mesh: str | None = None                   # str(Mesh); filled in from the model's mesh
    qkv_partition_spec: tuple | None = None   # None: batch on (data, fsdp), heads on model
    segment_ids_partition_spec: tuple = (_BATCH, None)
    layers: tuple[int, ...] | None = None     # decoder layer indices to patch; None: all
    # torch_xla's window fields. Set by the user, every patched layer attends within
    # slide_window_size keys before the query (torch_xla's LocalMask(w, w): q - w <= k), on top of
    # any window the model's own config gives the layer; AutoXLA fills in the effective window of
    # each layer when it calls the kernel.
    attentiontype_local_sliding: bool = False
    slide_window_size: int | None = None
    # The original AutoXLA's spellings of the two window fields (constructor only).
    AttentionType_LOCAL_SLIDING: InitVar[bool | None] = None
    SLIDE_WINDOW_SIZE: InitVar[int | None] = None

    def __post_init__(self, AttentionType_LOCAL_SLIDING=None, SLIDE_WINDOW_SIZE=None):
        for alias, name in ((AttentionType_LOCAL_SLIDING, "attentiontype_local_sliding"),
                            (SLIDE_WINDOW_SIZE, "slide_window_size")):
            if alias is not None:
                object.__setattr__(self, name, alias)
        self._check_window()
        for key in _BLOCK_KEYS:
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"attention_config[{key!r}] must be a positive int, got {value!r}")
        for key in ("sa_q_layout", "sa_k_layout", "sa_v_layout"):
            if getattr(self, key) not in _LAYOUTS:
                raise ValueError(f"attention_config[{key!r}] must be one of {_LAYOUTS}, got "
                                 f"{getattr(self, key)!r}")
        if self.mesh is not None:
            if not isinstance(self.mesh, str):
                object.__setattr__(self, "mesh", str(self.mesh))   # a Mesh object: its string
            _mesh_key(self.mesh)
        for key in ("qkv_partition_spec", "segment_ids_partition_spec"):
            spec = getattr(self, key)
            if spec is not None:
                object.__setattr__(self, key, _as_spec(spec, key, 4 if key.startswith("qkv") else 2))
        if self.layers is not None:
            layers = tuple(self.layers) if not isinstance(self.layers, int) else (self.layers,)
            if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers):
                raise ValueError(f"attention_config['layers'] must be decoder layer indices "
                                 f"(ints >= 0), got {self.layers!r}")
            object.__setattr__(self, "layers", tuple(sorted(set(layers))))

    def _check_window(self) -> None:
        sliding, size = self.attentiontype_local_sliding, self.slide_window_size
        if not isinstance(sliding, bool):
            raise ValueError(f"attention_config['AttentionType_LOCAL_SLIDING'] must be True or "
                             f"False, got {sliding!r}")
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
            raise ValueError(f"attention_config['SLIDE_WINDOW_SIZE'] must be an int >= 0 (keys "
                             f"before the query each query sees), got {size!r}")
        if sliding and size is None:
            raise ValueError("attention_config['AttentionType_LOCAL_SLIDING'] = True needs "
                             "'SLIDE_WINDOW_SIZE': how many keys before the query each query sees")
        if size is not None and not sliding:
            raise ValueError(f"attention_config['SLIDE_WINDOW_SIZE'] = {size} takes effect only "
                             "with 'AttentionType_LOCAL_SLIDING': True; set it, or drop the size")

    def window(self, layer_window: int | None) -> int | None:
        """The window a patched layer attends within, in transformers' convention (a query sees
        ``W`` keys, itself included): the model's own window for the layer, narrowed by the
        user's sliding setting (``slide_window_size`` keys before the query: ``W = size + 1``)."""
        if not self.attentiontype_local_sliding:
            return layer_window
        user = self.slide_window_size + 1
        return user if layer_window is None else min(user, layer_window)

    def to_json(self) -> str:
        """Every field as JSON (the original AutoXLA's SplashAttentionConfig.to_json)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "AttentionConfig":
        """The inverse of ``to_json``; also reads torch_xla's and the original's JSON."""
        try:
            value = json.loads(text)
        except (TypeError, ValueError) as e:
            raise ValueError(f"attention config JSON does not parse: {e}") from None
        return cls.from_any(value)

    @classmethod
    def from_any(cls, value: Any) -> "AttentionConfig":
        """None, a dict with the seed's keys, a SplashAttentionConfig, or an AttentionConfig."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if dataclasses.is_dataclass(value) and type(value).__name__ == "SplashAttentionConfig":
            value = dataclasses.asdict(value)
        if not isinstance(value, dict):
            raise TypeError(f"attention_config must be a dict of SplashAttentionConfig fields, a "
                            f"SplashAttentionConfig or an AttentionConfig, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} | set(_ALIASES)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown attention_config key(s) {unknown}; valid keys: "
                             f"{', '.join(sorted(known))}")
        value = dict(value)
        for alias, name in _ALIASES.items():
            if alias in value and name in value and value[alias] != value.pop(name):
                raise ValueError(f"attention_config has both {alias!r} and {name!r} with "
                                 "different values; they are the same setting: pass one")
        return cls(**value)

    def with_mesh(self, mesh) -> "AttentionConfig":
        """This config bound to the model's mesh: the user's mesh string must describe it."""
        actual = str(mesh)
        if self.mesh is None:
            return dataclasses.replace(self, mesh=actual)
        if _mesh_key(self.mesh) != _mesh_key(actual):
            raise ValueError(
                f"attention_config['mesh'] is {self.mesh}, but the model is sharded over {actual}; "
                "build the string from the same mesh (pass that Mesh as mesh= too), or leave the "
                "key out and AutoXLA fills it in")
        return self

    def check_layers(self, num_layers: int) -> None:
        if self.layers is not None and self.layers and self.layers[-1] >= num_layers:
            raise ValueError(f"attention_config['layers'] = {list(self.layers)} names layer "
                             f"{self.layers[-1]}, but the model has {num_layers} layers "
                             f"(0..{num_layers - 1})")

    def patches(self, layer_idx: int | None) -> bool:
        return self.layers is None or layer_idx is None or layer_idx in self.layers


def _as_spec(spec, key: str, rank: int) -> tuple:
    def entry(e):
        if e is None or isinstance(e, str):
            return _AXIS_ALIASES.get(e, e)
        if isinstance(e, (list, tuple)) and all(isinstance(a, str) for a in e):
            return tuple(_AXIS_ALIASES.get(a, a) for a in e)
        raise ValueError(f"attention_config[{key!r}]: {e!r} is not an axis name, a tuple of "
                         "them, or None")
    if not isinstance(spec, (list, tuple)) or len(spec) != rank:
        raise ValueError(f"attention_config[{key!r}] must have {rank} entries (one per "
                         f"dimension), got {spec!r}")
    return tuple(entry(e) for e in spec)


def _mesh_key(text: str):
    """(device ids, sizes) of a ``str(Mesh)`` as the ``(data, fsdp, model)`` mesh that puts every
    device at the same coordinates, so a mesh with a subset of the axes (the original AutoXLA's
    ``("fsdp", "model")``) describes the same mesh as its three-axis form; or a ValueError
    saying how to make one."""
    import ast

    try:
        d = ast.literal_eval(text.replace("Mesh", "", 1))
        ids, sizes, names = tuple(d["device_ids"]), tuple(d["mesh_shape"]), tuple(d["axis_names"] or ())
    except (ValueError, SyntaxError, KeyError, TypeError):
        raise ValueError(f"attention_config['mesh'] = {text!r} is not a mesh string: use "
                         "str(mesh) of a torch_xla.distributed.spmd.Mesh") from None
    try:
        shape = validate_mesh_axes(names, sizes, len(ids))
    except ValueError as e:
        raise ValueError(f"attention_config['mesh'] does not describe an AutoXLA mesh: {e}") from None
    return canonical_device_ids(ids, sizes, names), shape.sizes
