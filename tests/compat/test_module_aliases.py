"""The original AutoXLA's module names (AutoXLA.models, AutoXLA.kernels, AutoXLA.utils) are our own
objects under those names: no second implementation to drift from the first."""
import importlib
import json

import pytest

import AutoXLA
from AutoXLA import attention, modeling

# Every alias module, and the file of ours its docstring must point to.
ALIAS_MODULES = {
    "AutoXLA.models": "AutoXLA/modeling/causal.py",
    "AutoXLA.models.auto_model": "AutoXLA/modeling/causal.py",
    "AutoXLA.models.segmentation": "AutoXLA/modeling/segmentation.py",
    "AutoXLA.kernels": "AutoXLA/attention/patch.py",
    "AutoXLA.kernels.attention": "AutoXLA/attention/patch.py",
    "AutoXLA.kernels.attention.impl_utils": "AutoXLA/attention/patch.py",
    "AutoXLA.kernels.attention.splash_attention": "AutoXLA/attention/config.py",
    "AutoXLA.kernels.attention.splash_attention.sa_kernel": "AutoXLA/attention/config.py",
    "AutoXLA.utils": "AutoXLA/saving/pretrained.py",
}
MODEL_CLASSES = ("AutoXLAModelForCausalLM", "AutoXLAModelForImageSegmentation",
                 "AutoXLAModelForMaskGeneration")
PATCHERS = ("BaseAttentionPatcher", "SplashAttentionPatcher", "XLAFlashAttentionPatcher",
            "apply_splash_attention", "apply_xla_flash_attention")


@pytest.mark.parametrize("name", sorted(ALIAS_MODULES))
def test_each_alias_module_says_what_it_is_and_where_ours_lives(name):
    doc = importlib.import_module(name).__doc__ or ""
    assert "original" in doc, f"{name}'s docstring does not say it is the original's name"
    assert ALIAS_MODULES[name] in doc, f"{name}'s docstring does not name {ALIAS_MODULES[name]}"


def test_model_classes_are_the_modeling_classes():
    from AutoXLA.models import auto_model, segmentation

    for cls in MODEL_CLASSES:
        assert getattr(AutoXLA.models, cls) is getattr(modeling, cls) is getattr(AutoXLA, cls)
    assert auto_model.AutoXLAModelForCausalLM is modeling.AutoXLAModelForCausalLM
    for cls in MODEL_CLASSES[1:]:
        assert getattr(segmentation, cls) is getattr(modeling, cls)


def test_splash_config_is_our_attention_config_at_every_path():
    from AutoXLA.kernels.attention import impl_utils, splash_attention
    from AutoXLA.kernels.attention.splash_attention import sa_kernel

    for module in (AutoXLA.kernels, AutoXLA.kernels.attention, impl_utils, splash_attention,
                   sa_kernel):
        assert module.SplashAttentionConfig is attention.AttentionConfig, module.__name__


def test_patchers_are_one_implementation_at_both_paths():
    from AutoXLA.kernels.attention import impl_utils

    for name in PATCHERS:
        assert getattr(AutoXLA.kernels, name) is getattr(impl_utils, name)
        assert getattr(AutoXLA.kernels.attention, name) is getattr(impl_utils, name)
    assert issubclass(impl_utils.SplashAttentionPatcher, impl_utils.BaseAttentionPatcher)
    assert issubclass(impl_utils.XLAFlashAttentionPatcher, impl_utils.BaseAttentionPatcher)


def test_splash_config_json_round_trip_and_the_originals_json():
    from AutoXLA.kernels import SplashAttentionConfig

    cfg = SplashAttentionConfig(sa_block_q=128, sa_block_kv=256, layers=[1, 0],
                                AttentionType_LOCAL_SLIDING=True, SLIDE_WINDOW_SIZE=64)
    assert SplashAttentionConfig.from_json(cfg.to_json()) == cfg
    # What the original's to_json writes (its dataclass's fields, lists for tuples, its
    # defaults): read as the same settings, its "mp" axis named "model" as ours.
    original = {"sa_block_q": 256, "sa_block_kv": 256, "sa_block_kv_compute": 256,
                "sa_block_q_dkv": 256, "sa_block_kv_dkv": 256, "sa_block_kv_dkv_compute": 256,
                "sa_block_q_dq": 256, "sa_block_kv_dq": 256, "sa_use_fused_bwd_kernel": True,
                "sa_q_layout": "HEAD_DIM_MINOR", "sa_k_layout": "HEAD_DIM_MINOR",
                "sa_v_layout": "HEAD_DIM_MINOR", "mesh": None,
                "qkv_partition_spec": [["mp", "fsdp"], None, None, None],
                "segment_ids_partition_spec": [["mp", "fsdp"], None],
                "AttentionType_LOCAL_SLIDING": True, "SLIDE_WINDOW_SIZE": 32}
    read = SplashAttentionConfig.from_json(json.dumps(original))
    assert read.sa_block_q == read.sa_block_kv_dq == 256
    assert read.qkv_partition_spec == (("model", "fsdp"), None, None, None)
    assert (read.attentiontype_local_sliding, read.slide_window_size) == (True, 32)
