"""What AutoXLA hands torch_xla's Pallas kernels: the translation from transformers' conventions
to the kernels' arguments, pinned on its own (tests/tpu_emulation runs the kernels themselves)."""
import json

import numpy as np
import pytest
import torch

from AutoXLA.attention import AttentionConfig, tpu
from AutoXLA.attention.hf import kernel_mask


class FakeMesh:
    """The two attributes of a torch_xla Mesh the translation reads, and its string."""

    def __init__(self, shape, names=("data", "fsdp", "model")):
        self.mesh_shape, self.axis_names = shape, names
        self.device_ids = np.arange(int(np.prod(shape)))

    def __str__(self):
        return (f"{{'device_ids': {self.device_ids.tolist()}, 'mesh_shape': {self.mesh_shape}, "
                f"'axis_names': {self.axis_names}}}")


def _qkv(b=2, hq=8, hkv=2, s=16, d=4):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, hq, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g),
            torch.randn(b, hkv, s, d, generator=g))


def test_flash_repeats_kv_heads_in_transformers_order():
    from transformers.models.llama.modeling_llama import repeat_kv

    q, k, v = _qkv()
    mesh = FakeMesh((1, 4, 2))
    seg = torch.ones(2, 16, dtype=torch.int32)
    a = tpu.flash_arguments(q, k, v, scale=0.5, causal=True, segment_ids=seg, mesh=mesh,
                            cfg=AttentionConfig())
    # Batch 2 on data*fsdp = 4 and 16 positions: zero rows fill the shards and zero positions
    # one 128-lane key block; the call's output keeps 2 rows of 16.
    assert a["rows"] == 2 and a["positions"] == 16 and a["q"].shape[:3] == (4, 8, 128)
    assert not a["q"][2:].any() and not a["k"][:, :, 16:].any()
    k4, v4 = a["k"][:2, :, :16], a["v"][:2, :, :16]
    assert torch.equal(k4, repeat_kv(k, 4)) and torch.equal(v4, repeat_kv(v, 4))
    assert torch.equal(a["q"][:2, :, :16], q) and a["sm_scale"] == 0.5 and a["causal"] is True
    assert torch.equal(a["q_segment_ids"][:2, :16], seg)
    assert a["kv_segment_ids"] is a["q_segment_ids"]
    assert a["mesh"] is mesh
    # 8 heads divide model=2: batch over (data, fsdp), heads over model.
    assert a["partition_spec"] == (("data", "fsdp"), "model", None, None)


# (kernel, query heads, kv heads, mesh) -> (heads axes, kv repeat, words of the reason).
# Issue 43's cases: Qwen2.5-7B (28 / 4) on model=8, Llama-3-70B (64 / 8) on model=16, the
# 6 / 3-head Llama and Gemma 2 fixtures on model=2.
HEAD_CASES = [
    ("splash_attention", 8, 8, (1, 8, 1), (), 1, ""),             # no model axis to split on
    ("splash_attention", 32, 8, (1, 4, 2), ("model",), 1, ""),    # both divide
    ("splash_attention", 6, 3, (1, 4, 2), ("model",), 2, "3 kv heads do not divide model=2"),
    ("splash_attention", 12, 3, (1, 4, 2), ("model",), 2, "6 do"),   # 2x, not the group's 4x
    ("splash_attention", 64, 8, (1, 1, 16), ("model",), 2, "its 4 query heads"),
    ("splash_attention", 28, 4, (1, 1, 8), (), 1, "28 query heads do not divide model=8"),
    ("xla_flash_attention", 28, 4, (1, 1, 8), (), 7, "no grouped-query attention"),
    ("xla_flash_attention", 64, 8, (1, 1, 16), ("model",), 8, "no grouped-query attention"),
    ("xla_flash_attention", 8, 8, (1, 4, 2), ("model",), 1, ""),
]


@pytest.mark.parametrize("kernel,heads,kv_heads,shape,axes,repeat,why", HEAD_CASES)
def test_the_head_split_of_the_kernels(kernel, heads, kv_heads, shape, axes, repeat, why):
    from AutoXLA.sharding.attention_heads import kernel_heads
    from AutoXLA.sharding.mesh import MeshShape

    decided = kernel_heads(kernel, heads, kv_heads, MeshShape(*shape))
    assert (decided.axes, decided.kv_repeat) == (axes, repeat)
    assert why in decided.reason and bool(decided.reason) == bool(why)
    # Whatever was decided, every tensor the kernel gets divides its heads axes.
    size = MeshShape(*shape).size(axes)
    assert heads % size == 0 and (kv_heads * repeat) % size == 0
    assert (heads // kv_heads) % repeat == 0     # a repeat that keeps the grouping


def test_a_users_head_split_that_cannot_be_made_is_an_error():
    from AutoXLA.sharding.attention_heads import kernel_heads
    from AutoXLA.sharding.mesh import MeshShape

    with pytest.raises(ValueError, match=r"splits the attention heads over model=8, but the "
                                         r"model's 28 query heads do not divide it.*Leave "
                                         r"qkv_partition_spec out"):
        kernel_heads("splash_attention", 28, 4, MeshShape(1, 1, 8),
                     (("data", "fsdp"), "model", None, None))
    # Heads None in the user's spec: whole, which needs no reason; kv heads of a split the user
    # asked for are repeated as for the default.
    whole = kernel_heads("splash_attention", 6, 3, MeshShape(1, 4, 2),
                         (("data", "fsdp"), None, None, None))
    assert (whole.axes, whole.kv_repeat, whole.reason) == ((), 1, "")
    assert kernel_heads("splash_attention", 6, 3, MeshShape(1, 4, 2),
                        ("fsdp", "model", None, None)).kv_repeat == 2


def test_splash_repeats_kv_heads_so_that_each_shard_reads_its_own_groups():
    # 12 query / 3 kv heads on model=2: each kv head 2x (transformers' repeat_kv order), so each
    # model shard's 6 query heads read its 3 repeated heads in groups of 2, and query head h
    # reads a copy of kv head h // 4 as in transformers.
    from AutoXLA.sharding.attention_heads import kernel_heads
    from AutoXLA.sharding.mesh import MeshShape

    q, k, v = _qkv(hq=12, hkv=3)
    mesh = FakeMesh((1, 4, 2))
    heads = kernel_heads("splash_attention", 12, 3, MeshShape(1, 4, 2))
    a = tpu.splash_arguments(q, k, v, scale=1.0, window=None, softcap=None, segment_ids=None,
                             mesh=mesh, cfg=AttentionConfig(), heads=heads)
    assert json.loads(a["config"])["qkv_partition_spec"] == [["data", "fsdp"], "model", None, None]
    kr, vr = a["k"][:2, :, :16], a["v"][:2, :, :16]
    assert kr.shape[1] == 6
    for shard in range(2):
        local_k, local_v = kr[:, 3 * shard:3 * shard + 3], vr[:, 3 * shard:3 * shard + 3]
        for j in range(6):                       # local query head j, global 6 * shard + j
            h = 6 * shard + j
            assert torch.equal(local_k[:, j // 2], k[:, h // 4]), (shard, j)
            assert torch.equal(local_v[:, j // 2], v[:, h // 4]), (shard, j)


def test_a_call_that_does_not_match_the_planned_heads_is_an_error():
    from AutoXLA.sharding.attention_heads import kernel_heads
    from AutoXLA.sharding.mesh import MeshShape

    q, k, v = _qkv()
    heads = kernel_heads("splash_attention", 6, 3, MeshShape(1, 4, 2))
    with pytest.raises(ValueError, match=r"planned for 6 query / 3 kv heads.*called them with "
                                         r"8 / 2"):
        tpu.splash_arguments(q, k, v, scale=1.0, window=None, softcap=None, segment_ids=None,
                             mesh=FakeMesh((1, 4, 2)), cfg=AttentionConfig(), heads=heads)


def test_user_partition_spec_wins():
    q, k, v = _qkv()
    cfg = AttentionConfig(qkv_partition_spec=[["data", "fsdp"], None, None, None])
    a = tpu.flash_arguments(q, k, v, scale=1.0, causal=True, segment_ids=None,
                            mesh=FakeMesh((1, 4, 2)), cfg=cfg)
    assert a["partition_spec"] == (("data", "fsdp"), None, None, None)


def test_flash_has_no_window_or_softcap():
    assert tpu.flash_supports(None, None)
    assert not tpu.flash_supports(6, None) and not tpu.flash_supports(None, 50.0)


def test_splash_arguments():
    from torch_xla.experimental.splash_attention import SplashAttentionConfig

    q, k, v = _qkv()
    mesh = FakeMesh((1, 8, 1))
    seg = torch.ones(2, 16, dtype=torch.int32)
    a = tpu.splash_arguments(q, k, v, scale=0.25, window=6, softcap=50.0, segment_ids=seg,
                             mesh=mesh, cfg=AttentionConfig(sa_block_q=256))
    # No sm_scale in splash: q arrives pre-scaled; k and v keep their kv heads (GQA is native).
    # 2 rows on data*fsdp = 8 and 16 positions: zeros up to 8 rows and one 128-lane block.
    assert a["rows"] == 2 and a["positions"] == 16 and a["q"].shape[:3] == (8, 8, 128)
    assert not a["k"][2:].any() and not a["k"][:, :, 16:].any()
    assert torch.equal(a["q"][:2, :, :16], q * 0.25) and torch.equal(a["k"][:2, :, :16], k)
    assert torch.equal(a["v"][:2, :, :16], v)
    assert a["causal"] is True and a["attn_logits_soft_cap"] == 50.0
    assert torch.equal(a["decoder_segment_ids"][:2, :16], seg)
    # torch_xla parses the JSON back into its own config, mesh string included.
    cfg = SplashAttentionConfig.from_json(a["config"])
    assert cfg.mesh == str(mesh) and cfg.sa_block_q == 256 and cfg.sa_block_kv == 512
    assert cfg.attentiontype_local_sliding and cfg.slide_window_size == 5
    assert cfg.qkv_partition_spec == (("data", "fsdp"), None, None, None)
    assert "layers" not in json.loads(a["config"])
    full = SplashAttentionConfig.from_json(tpu.splash_arguments(
        q, k, v, scale=1.0, window=None, softcap=None, segment_ids=None, mesh=mesh,
        cfg=AttentionConfig())["config"])
    assert not full.attentiontype_local_sliding and full.slide_window_size is None


def test_splash_pads_the_sequence_to_blocks_it_can_take():
    # Splash neither pads nor takes key blocks that are not whole lanes (128): AutoXLA appends
    # positions up to a length every block divides, and slices them off after the call.
    cfg = AttentionConfig(sa_block_q=512, sa_block_kv=256)
    assert tpu.splash_length(1024, cfg) == 1024
    assert tpu.splash_length(12, cfg) == 128 and tpu.splash_length(100, cfg) == 128
    assert tpu.splash_length(600, cfg) == 1024          # 512-blocks: 600 -> 640 -> 1024
    assert tpu.splash_length(768, AttentionConfig(sa_block_q=256, sa_block_kv=512)) == 1024
    # Flash with torch_xla's blocks (512, and 1024 for dq): 12 -> 128, 600 -> 1024.
    assert tpu.flash_length(12) == 128 and tpu.flash_length(600) == 1024
    with pytest.raises(ValueError, match="not a multiple of 128"):
        tpu.splash_length(1000, AttentionConfig(sa_block_q=100))
    q, k, v = _qkv(s=20)
    a = tpu.splash_arguments(q, k, v, scale=1.0, window=None, softcap=None, segment_ids=None,
                             mesh=FakeMesh((1, 8, 1)), cfg=cfg)
    assert a["q"].shape == (8, 8, 128, 4) and a["positions"] == 20 and a["rows"] == 2
    assert torch.equal(a["k"][:2, :, :20], k) and not a["k"][:, :, 20:].any()


@pytest.mark.parametrize("window", [1, 3, 6, 40])
def test_splash_mask_equals_transformers_sliding_window(window):
    # Splash applies CausalMask & LocalMask(window_size=(w, w)) & equal segment ids, where
    # LocalMask admits q - w <= k <= q + w (jax splash_attention_mask.make_local_attention_mask).
    # With w = W - 1 and padding as segment ids, that is transformers' sliding-window mask on
    # every real query row.
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    s = 20
    padding = torch.ones(2, s, dtype=torch.bool)
    padding[1, :5] = False                   # left padding
    expected = sdpa_mask(batch_size=2, q_length=s, kv_length=s,
                         mask_function=sliding_window_causal_mask_function(window),
                         attention_mask=padding, allow_is_causal_skip=False)[:, 0]
    q_, k_, v_ = _qkv(s=s)
    a = tpu.splash_arguments(q_, k_, v_, scale=1.0, window=window, softcap=None,
                             segment_ids=padding.to(torch.int32), mesh=FakeMesh((1, 8, 1)),
                             cfg=AttentionConfig())
    w = json.loads(a["config"])["slide_window_size"]
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    splash = (j <= i) & (i - w <= j) & (j <= i + w)
    seg = a["decoder_segment_ids"][:2, :s].numpy()
    splash = splash[None] & (seg[:, :, None] == seg[:, None, :])
    real = padding.numpy()
    assert np.array_equal(splash[real], expected.numpy()[real])


def test_kernel_mask_describes_plain_masks():
    from transformers.masking_utils import (and_masks, causal_mask_function, or_masks,
                                            sliding_window_causal_mask_function)

    pad = torch.ones(2, 10, dtype=torch.bool)
    pad[0, :3] = False
    m = kernel_mask(2, 10, 10, mask_function=causal_mask_function, attention_mask=pad)
    assert m.structured and m.window is None
    assert torch.equal(m.segment_ids, pad.to(torch.int32))
    m = kernel_mask(2, 10, 10, mask_function=sliding_window_causal_mask_function(4),
                    attention_mask=pad)
    assert m.structured and m.window == 4
    # Decoding (queries after a cache) and widened masks keep transformers' dense mask.
    m = kernel_mask(2, 1, 10, q_offset=9, mask_function=causal_mask_function, attention_mask=pad)
    assert not m.structured and m.dense().shape == (2, 1, 1, 10)
    image = or_masks(causal_mask_function, lambda b, h, q, k: k < 2)
    assert not kernel_mask(2, 10, 10, mask_function=image, attention_mask=pad).structured
    packed = and_masks(causal_mask_function, lambda b, h, q, k: q // 5 == k // 5)
    assert not kernel_mask(2, 10, 10, mask_function=packed, attention_mask=pad).structured


def test_vision_models_keep_eager_and_warn_once(caplog):
    from AutoXLA.attention import vision_attention
    from AutoXLA.attention.hf import _WARNED

    _WARNED.discard("vision-splash_attention")
    with caplog.at_level("WARNING", logger="AutoXLA"):
        assert vision_attention("splash_attention") == "eager"
        assert vision_attention("splash_attention") == "eager"
        assert vision_attention("eager") == "eager" and vision_attention(None) == "eager"
    warnings = [r for r in caplog.records if "bidirectional" in r.getMessage()]
    assert len(warnings) == 1 and "splash_attention" in warnings[0].getMessage()


def test_attention_config_accepts_the_seed_dict_and_rejects_typos():
    seed = {k: 512 for k in ("sa_block_q", "sa_block_kv", "sa_block_kv_compute",
                             "sa_block_q_dkv", "sa_block_kv_dkv", "sa_block_kv_dkv_compute",
                             "sa_block_q_dq", "sa_block_kv_dq")}
    mesh = FakeMesh((1, 8, 1))
    cfg = AttentionConfig.from_any({**seed, "mesh": str(mesh), "layers": [1, 0, 1]})
    assert cfg.layers == (0, 1) and cfg.mesh == str(mesh)
    assert cfg.with_mesh(mesh) is cfg
    with pytest.raises(ValueError, match="same mesh"):
        cfg.with_mesh(FakeMesh((1, 4, 2)))
    with pytest.raises(ValueError, match=r"sa_layout.*valid keys"):
        AttentionConfig.from_any({"sa_layout": "x"})
    with pytest.raises(ValueError, match="layer indices"):
        AttentionConfig(layers=[-1])
    with pytest.raises(ValueError, match="sa_q_layout"):
        AttentionConfig(sa_q_layout="ROW")


def test_dropout_is_refused_by_the_kernels_but_kept_by_eager_layers():
    from torch import nn

    from AutoXLA.attention.hf import _attention_function

    q, k, v = _qkv(b=1, hq=2, hkv=2, s=4)
    attention = _attention_function("splash_attention")
    kernel_layer = nn.Module()
    with pytest.raises(ValueError, match=r"attention dropout \(p=0.1\).*attention_dropout to 0"):
        attention(kernel_layer, q, k, v, None, dropout=0.1)
    # A layer left out by attention_config['layers'] runs the model's eager attention, dropout
    # included (Llama's eager attention, found through the module's class).
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaConfig

    eager_layer = LlamaAttention(LlamaConfig(hidden_size=8, num_attention_heads=2,
                                             num_key_value_heads=2, head_dim=4), layer_idx=0)
    eager_layer.autoxla_attention = None
    eager_layer.train()
    out, weights = attention(eager_layer, q, k, v, None, dropout=0.5, scaling=1.0)
    assert out.shape == (1, 4, 2, 4) and weights is not None
