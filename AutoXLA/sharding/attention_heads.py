"""How the Pallas attention kernels split a decoder's heads over the mesh (issue 43).

Both kernels attend per device on whole heads: torch_xla's wrappers give q, k and v one partition
spec, ``(batch, heads, -, -)``, and cut each tensor's heads over the spec's heads axes (splash in
a JAX ``shard_map``, flash in torch_xla's manual-sharding region), so the query heads and the kv
heads must each divide those axes. The plan decides, from the config and the mesh, and records
why (``KernelHeads``, ``plan.layer_attention.heads``); attention/tpu.py applies the decision:

- split: the query and the kv heads both divide the axes. Each device attends with its block of
  query heads and the kv heads they read: query head ``h`` reads kv head ``h // G`` (``G`` query
  heads per kv head), so the i-th of ``m`` contiguous blocks of query heads reads exactly the
  i-th block of kv heads.
- kv heads repeated: the query heads divide but the kv heads do not (Llama-3-70B's 64 / 8 on a
  model axis of 16). Each kv head is repeated ``r`` times in transformers' ``repeat_kv`` order,
  ``r`` the smallest divisor of ``G`` that makes the kv heads divide (2 there: 16 kv heads, one
  per device beside its 4 query heads). Since ``r`` divides ``G`` the result is still a grouping
  (``G / r`` query heads per repeated head, each reading a copy of its own kv head), and the
  split above applies. The k/v projections are replicated on the axis already (the rules split
  attention projections by whole heads or not at all: sharding/rules.py), so every device holds
  all kv heads: the repeat and the cut are local, no communication, and each device's kernel
  reads ``r`` times the kv heads it would read if they divided.
- whole: the query heads do not divide (Qwen2.5-7B's 28 heads on a model axis of 8). No repeat
  or split of whole heads can give 8 equal blocks of 28, and AutoXLA never pads, so the heads
  stay whole in the kernel's spec: every device along the axes attends with all heads of its
  batch rows, as its replicated q_proj computed them (the attention's work is repeated ``m``
  times; the layer's other matmuls keep their splits).

Flash attention has no GQA at all: its kv heads are always repeated to the query heads (r = G).
"""
from __future__ import annotations

from dataclasses import dataclass

from .mesh import MeshShape

FLASH = "xla_flash_attention"


@dataclass(frozen=True)
class KernelHeads:
    """The heads of one decoder's attention as the kernels get them."""

    heads: int                  # query heads (the config's num_attention_heads)
    kv_heads: int               # the config's num_key_value_heads
    axes: tuple[str, ...] = ()  # the mesh axes the heads are split over; () keeps them whole
    kv_repeat: int = 1          # each kv head repeated this many times for the call
    reason: str = ""            # why the heads are kept whole or the kv heads repeated

    @property
    def spec_entry(self):
        """The heads entry of the kernels' q/k/v partition spec."""
        if not self.axes:
            return None
        return self.axes[0] if len(self.axes) == 1 else self.axes

    def check(self, heads: int, kv_heads: int) -> None:
        """A call's head counts against the decision's, which came from the config."""
        if (heads, kv_heads) != (self.heads, self.kv_heads):
            raise ValueError(
                f"the attention kernels were planned for {self.heads} query / {self.kv_heads} kv "
                f"heads (the model config's num_attention_heads / num_key_value_heads), but a "
                f"layer called them with {heads} / {kv_heads}: a model whose layers differ in "
                "head counts is not supported by the kernels; use attn_implementation='eager'")

    def describe(self, mesh: MeshShape) -> str:
        counts = f"{self.heads} query / {self.kv_heads} kv heads"
        if self.axes:
            line = f"{counts} split over {'x'.join(self.axes)}={mesh.size(self.axes)}"
        elif mesh.model > 1:
            line = f"{counts} kept whole"
        else:
            line = f"{counts} (no model axis to split them over)"
        if self.kv_repeat > 1:
            line += (f", each kv head repeated {self.kv_repeat}x "
                     f"(to {self.kv_heads * self.kv_repeat})")
        return f"attention heads in the kernels: {line}" + (
            f" ({self.reason})" if self.reason else "")


def kernel_heads(kernel: str, heads: int, kv_heads: int, mesh: MeshShape,
                 user_spec: tuple | None = None) -> KernelHeads:
    """How ``kernel`` gets ``heads`` query and ``kv_heads`` kv heads on ``mesh``: split over the
    heads axes of ``user_spec`` (the user's qkv_partition_spec; by default the model axis),
    with the kv heads repeated where they alone do not divide, or whole when the query heads do
    not divide the default axis. A user's spec that the query heads do not divide is an error:
    it asked for a split that cannot be made."""
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{heads} query heads and {kv_heads} kv heads: grouped-query attention "
                         "needs the query heads to be a multiple of the kv heads")
    groups = heads // kv_heads
    explicit = user_spec is not None
    entry = user_spec[1] if explicit else "model"
    named = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    axes = tuple(a for a in named if mesh.size(a) > 1)
    size = mesh.size(axes)
    reasons, repeat = [], 1
    if axes and heads % size:
        if explicit:
            raise ValueError(
                f"attention_config['qkv_partition_spec'] = {tuple(user_spec)} splits the "
                f"attention heads over {'x'.join(axes)}={size}, but the model's {heads} query "
                "heads do not divide it: the kernels split q, k and v by whole heads. Leave "
                "qkv_partition_spec out (AutoXLA then keeps the heads whole on that axis and "
                "the plan says so), or make its heads entry None")
        reasons.append(f"{heads} query heads do not divide {'x'.join(axes)}={size}: every "
                       "device along it attends with all heads of its rows")
        axes = ()
    elif axes and kv_heads % size and kernel != FLASH:
        repeat = next(r for r in range(1, groups + 1)
                      if groups % r == 0 and (kv_heads * r) % size == 0)
        reasons.append(f"{kv_heads} kv heads do not divide {'x'.join(axes)}={size}; "
                       f"{kv_heads * repeat} do, and each device gets the kv heads its "
                       f"{heads // size} query heads read")
    if kernel == FLASH and groups > 1:
        repeat = groups
        reasons.append("xla_flash_attention has no grouped-query attention")
    return KernelHeads(heads, kv_heads, axes, repeat, "; ".join(reasons))
