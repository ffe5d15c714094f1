"""``AutoXLA.kernels.attention``: the original AutoXLA's module of attention kernels and patchers.

Names only: ``SplashAttentionConfig`` is ``AutoXLA.attention.AttentionConfig``
(AutoXLA/attention/config.py); the patchers live in ``impl_utils`` (the original's module name) and
call ``AutoXLA.attention.patch_attention`` (AutoXLA/attention/patch.py).
"""
from .impl_utils import (BaseAttentionPatcher, SplashAttentionConfig, SplashAttentionPatcher,
                         XLAFlashAttentionPatcher, apply_splash_attention,
                         apply_xla_flash_attention)

__all__ = ["BaseAttentionPatcher", "SplashAttentionConfig", "SplashAttentionPatcher",
           "XLAFlashAttentionPatcher", "apply_splash_attention", "apply_xla_flash_attention"]
