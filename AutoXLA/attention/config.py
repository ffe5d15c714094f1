"""attention_config: one validated object for the attention kernels (seed: "Splash Attention").

The keys are torch_xla's ``SplashAttentionConfig`` fields, so the seed's dict (the ``sa_block_*``
sizes and ``"mesh": str(mesh)``) and a ``SplashAttentionConfig`` itself are both accepted, plus
two of ours: ``layers`` (which decoder layers use the kernel; the rest stay eager) and a
``qkv_partition_spec`` that defaults to one derived from the mesh. ``sa_block_q`` and
``sa_block_kv`` are also the block shape of the portable path that runs off TPU.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

IMPLEMENTATIONS = ("eager", "xla_flash_attention", "splash_attention")
KERNELS = IMPLEMENTATIONS[1:]
# The names the kernels are registered under in transformers. transformers treats any name that
# contains "flash" as its own flash-attention family (hub kernels, 2D masks), so neither may.
TRANSFORMERS_NAMES = {"xla_flash_attention": "autoxla_fa", "splash_attention": "autoxla_splash"}
_BLOCK_KEYS = ("sa_block_q", "sa_block_kv", "sa_block_kv_compute", "sa_block_q_dkv",
               "sa_block_kv_dkv", "sa_block_kv_dkv_compute", "sa_block_q_dq", "sa_block_kv_dq")
_LAYOUTS = ("HEAD_DIM_MINOR", "SEQ_MINOR")
_BATCH = ("data", "fsdp")


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
    # torch_xla's own window fields: set per layer by AutoXLA, not by the user.
    attentiontype_local_sliding: bool = False
    slide_window_size: int | None = None

    def __post_init__(self):
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
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown attention_config key(s) {unknown}; valid keys: "
                             f"{', '.join(sorted(known))}")
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
            return e
        if isinstance(e, (list, tuple)) and all(isinstance(a, str) for a in e):
            return tuple(e)
        raise ValueError(f"attention_config[{key!r}]: {e!r} is not an axis name, a tuple of "
                         "them, or None")
    if not isinstance(spec, (list, tuple)) or len(spec) != rank:
        raise ValueError(f"attention_config[{key!r}] must have {rank} entries (one per "
                         f"dimension), got {spec!r}")
    return tuple(entry(e) for e in spec)


def _mesh_key(text: str):
    """(device ids, shape, axis names) of a ``str(Mesh)``, or a ValueError saying how to make one."""
    import ast

    try:
        d = ast.literal_eval(text.replace("Mesh", "", 1))
        key = (tuple(d["device_ids"]), tuple(d["mesh_shape"]), tuple(d["axis_names"] or ()))
    except (ValueError, SyntaxError, KeyError, TypeError):
        raise ValueError(f"attention_config['mesh'] = {text!r} is not a mesh string: use "
                         "str(mesh) of a torch_xla.distributed.spmd.Mesh") from None
    missing = [a for a in _BATCH if a not in key[2]]
    if missing:
        raise ValueError(f"attention_config['mesh'] has axes {key[2]}; splash attention needs "
                         f"axes named {_BATCH} (missing {missing})")
    return key
