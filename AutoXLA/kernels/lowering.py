"""The TPU lowering check: the Mosaic TPU program of each kernel call AutoXLA would make,
produced on a machine without a TPU.

``jax.jit(f).trace(...).lower(lowering_platforms=("tpu",))`` runs JAX's Mosaic lowering, which
enforces the TPU's tiling rules that interpret mode ignores (a block's last two dimensions must
divide by 8 and 128 or span the array; key blocks whole lanes): a call that fails here would fail
on a TPU at compile time. It cannot check what only a TPU knows: VMEM limits at compile time on
the chip, and speed.

Each call is the one AutoXLA makes on one device under fsdp (a row of the batch, every head):
- flash: JAX's flash attention with torch_xla's block sizes (``FlashAttention.DEFAULT_BLOCK_SIZES``
  clipped to the length, as torch_xla's wrapper clips them), forward and backward;
- splash: torch_xla's own JAX wrapper (``splash_attention_jax_wrapper``, a ``shard_map`` over
  the mesh) with AutoXLA's config, forward and backward;
- the int8 matmul: torch_xla's kernel with the tiles AutoXLA passes (pallas_tiles).
at the sequence length AutoXLA pads the call to (attention/tpu.py's kernel_length).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

from .. import backend
from ..attention import AttentionConfig, tpu
from ..attention.tpu import splash_json
from ..modeling.empty import load_config
from . import interpret


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    kernel: str            # "xla_flash_attention" | "splash_attention"
    heads: int
    kv_heads: int
    head_dim: int
    seq_len: int           # as the model sees it; the kernel runs at the padded length
    window: int | None = None
    softcap: float | None = None
    batch: int = 1         # rows per device


class LoweringError(RuntimeError):
    pass


@contextlib.contextmanager
def _real_kernels():
    """Pallas calls lower for the TPU here even in a process whose kernels are interpreted."""
    from jax._src import config as jax_config

    flag = jax_config.pallas_tpu_interpret_mode_context_manager
    previous = flag.swap_local(False)
    try:
        yield
    finally:
        flag.set_local(previous)


def _lower(fn, *shapes) -> None:
    import jax

    with _real_kernels():
        jax.jit(fn).trace(*shapes).lower(lowering_platforms=("tpu",))


def flash_blocks(length: int, batch: int) -> dict:
    """torch_xla's flash block sizes as its wrapper clips them for this call."""
    from torch_xla.experimental.custom_kernel import FlashAttention

    b = FlashAttention.DEFAULT_BLOCK_SIZES
    return dict(block_b=min(b["block_b"], batch), block_q=min(b["block_q"], length),
                block_k_major=min(b["block_k_major"], length), block_k=min(b["block_k"], length),
                block_q_major_dkv=min(b["block_q_major_dkv"], length),
                block_k_major_dkv=min(b["block_k_major_dkv"], length),
                block_k_dkv=min(b["block_k_dkv"], length),
                block_q_dkv=min(b["block_q_dkv"], length),
                block_k_major_dq=min(b["block_k_major_dq"], length),
                block_k_dq=min(b["block_k_dq"], length),
                block_q_dq=min(b["block_q_dq"], length))


def lower_attention(call: AttentionCall, cfg=None, blocks: dict | None = None) -> int:
    """Lowers ``call`` (forward and backward) for the TPU; returns the padded length it ran at.
    ``blocks`` overrides flash's block sizes (to show a bad one failing). Raises LoweringError."""
    import jax
    import jax.numpy as jnp

    cfg = cfg or AttentionConfig()
    try:
        if call.kernel == "xla_flash_attention":
            length = tpu.flash_length(call.seq_len)
            from jax.experimental.pallas.ops.tpu import flash_attention as fa

            sizes = fa.BlockSizes(**(blocks or flash_blocks(length, call.batch)))
            shape = jax.ShapeDtypeStruct((call.batch, call.heads, length, call.head_dim),
                                         jnp.bfloat16)   # kv heads repeated, as AutoXLA does

            def loss(q, k, v):
                out = fa.flash_attention(q, k, v, causal=True, sm_scale=call.head_dim ** -0.5,
                                         block_sizes=sizes)
                return out.astype(jnp.float32).sum()
            _lower(jax.grad(loss, argnums=(0, 1, 2)), shape, shape, shape)
            return length
        length = tpu.splash_length(call.seq_len, cfg)
        _lower_splash(call, cfg, length)
        return length
    except LoweringError:
        raise
    except Exception as e:   # JAX raises ValueError, NotImplementedError, MosaicError, ...
        raise LoweringError(f"{call.kernel} at {call.seq_len} tokens ({call.heads} heads, "
                            f"{call.kv_heads} kv heads, head_dim {call.head_dim}): "
                            f"{type(e).__name__}: {str(e).splitlines()[0]}") from e


def _lower_splash(call: AttentionCall, cfg, length: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from torch_xla.distributed.spmd import Mesh
    from torch_xla.experimental.splash_attention import (SplashAttentionConfig,
                                                         splash_attention_jax_wrapper)

    # torch_xla's Mesh spans every device: fsdp over all of them, one row each.
    n = jax.device_count()
    mesh = Mesh(np.arange(n), (1, n, 1), ("data", "fsdp", "model"))
    layer_cfg = dataclasses.replace(
        cfg.with_mesh(mesh), qkv_partition_spec=(("data", "fsdp"), None, None, None),
        attentiontype_local_sliding=call.window is not None,
        slide_window_size=None if call.window is None else call.window - 1)

    config = SplashAttentionConfig.from_json(splash_json(layer_cfg))
    q = jax.ShapeDtypeStruct((call.batch * n, call.heads, length, call.head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((call.batch * n, call.kv_heads, length, call.head_dim),
                              jnp.bfloat16)

    def loss(q, k, v):
        out = splash_attention_jax_wrapper(q, k, v, None, True, config, call.softcap)
        return out.astype(jnp.float32).sum()
    _lower(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)


def lower_quantized_matmul(tokens: int, out_features: int, in_features: int, tiles: tuple,
                           int8_activations: bool, dtype: str = "bfloat16") -> None:
    """torch_xla's Pallas int8 matmul kernel with ``tiles`` (batch, out, in) on ``dtype``
    activations, for the TPU."""
    import jax
    import jax.numpy as jnp
    from torch_xla.experimental.pallas_kernels.quantized_matmul_kernel import (
        quantized_matmul_int8)

    fn = functools.partial(quantized_matmul_int8, quantize_activation=int8_activations,
                           batch_block_size=tiles[0], out_block_size=tiles[1],
                           in_block_size=tiles[2])
    try:
        _lower(fn, jax.ShapeDtypeStruct((tokens, in_features), jnp.dtype(dtype)),
               jax.ShapeDtypeStruct((out_features, in_features), jnp.int8),
               jax.ShapeDtypeStruct((out_features,), jnp.float32))
    except Exception as e:
        raise LoweringError(f"int8 matmul ({tokens} x {in_features} -> {out_features}) with tiles "
                            f"{tiles}: {type(e).__name__}: {str(e).splitlines()[0]}") from e


def attention_calls(config, seq_lens) -> list[AttentionCall]:
    """The distinct attention calls a transformers ``config`` makes at these lengths, for both
    kernels (flash only where it takes the layer: no window, no soft-cap)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    softcap = getattr(text, "attn_logit_softcapping", None)
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    window = getattr(text, "sliding_window", None)
    if getattr(text, "use_sliding_window", True) is False:
        window = None
    windows = {window if t == "sliding_attention" or (window and not getattr(
        text, "layer_types", None)) else None for t in types}
    calls = []
    for seq in seq_lens:
        for w in sorted(windows, key=lambda w: w or 0):
            if tpu.flash_supports(w, softcap):
                calls.append(AttentionCall("xla_flash_attention", heads, kv_heads, head_dim, seq))
            calls.append(AttentionCall("splash_attention", heads, kv_heads, head_dim, seq, w,
                                       softcap))
    return calls


SEQ_LENS = (2048, 8192, 32768)
# ./run test lowers 2k and 8k; 32k costs ~20 s of host time per windowed splash call (splash
# builds its block mask on the host), so its rows in docs/attention.md come from main().
TEST_SEQ_LENS = (2048, 8192)
# Models whose attention no kernel takes: gpt-oss's sinks run eager attention (attention/hf.py).
NO_KERNEL = {"gpt_oss"}


def shipped_decoders() -> dict[str, object]:
    """name -> config of the shipped planning configs whose attention both kernels could take
    (one head size for queries, keys and values: not DeepSeek-V3's multi-head latent attention)."""
    import os

    root = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "model_configs")
    out = {}
    for name in sorted(os.listdir(root)):
        config = load_config(os.path.join(root, name))
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if not getattr(text, "num_attention_heads", None) or getattr(text, "is_encoder_decoder",
                                                                        False):
            continue
        if getattr(text, "qk_rope_head_dim", None) or getattr(text, "kv_lora_rank", None):
            continue      # MLA: q/k heads of 192, v heads of 128
        if "ForCausalLM" not in "".join(getattr(config, "architectures", None) or []):
            continue
        if getattr(text, "model_type", "") in NO_KERNEL:
            continue
        out[name.replace("--", "/")] = config
    return out


def _tiling(call: AttentionCall) -> tuple:
    """What decides a call's block shapes: not the head counts, which only set the grid's
    extent (and a kv-head count below the heads only for splash, whose GQA has its own blocks)."""
    gqa = call.kernel == "splash_attention" and call.kv_heads < call.heads
    return (call.kernel, call.head_dim, gqa, call.seq_len, call.window, call.softcap, call.batch)


def check_shipped(seq_lens=SEQ_LENS) -> list[tuple[str, AttentionCall, int | str]]:
    """(model, call, padded length or the lowering error) for every call of every shipped
    decoder; calls that tile alike (_tiling) are lowered once."""
    results, done = [], {}
    for name, config in shipped_decoders().items():
        for call in attention_calls(config, seq_lens):
            key = _tiling(call)
            if key not in done:
                try:
                    done[key] = lower_attention(call)
                except LoweringError as e:
                    done[key] = str(e)
            results.append((name, call, done[key]))
    return results


def main() -> None:
    """Prints the lowering table of docs/attention.md (./run emulated -m AutoXLA.kernels.lowering)."""
    backend.ensure_spmd()
    interpret.enable()
    rows: dict[tuple, dict[str, list[str]]] = {}
    for name, c, r in check_shipped():
        row = rows.setdefault((name, f"{c.heads} / {c.kv_heads} x {c.head_dim}", c.window,
                               c.softcap), {"xla_flash_attention": [], "splash_attention": []})
        tokens = f"{c.seq_len // 1024}k"
        row[c.kernel].append(f"{tokens} ok" if isinstance(r, int) else f"{tokens} FAILS: {r}")
    print("| model | heads / kv heads x head_dim | window | soft-cap | flash | splash |")
    print("|---|---|---|---|---|---|")
    for (name, heads, window, softcap), kernels in rows.items():
        flash = ", ".join(kernels["xla_flash_attention"]) or (
            "not called: " + ("logit soft-cap" if softcap else "sliding window"))
        print(f"| {name} | {heads} | {window or '-'} | {softcap or '-'} | {flash} | "
              f"{', '.join(kernels['splash_attention'])} |")

if __name__ == "__main__":
    main()
