"""``AutoXLA.kernels.attention.splash_attention.sa_kernel``: the original's module of the splash
config; ``SplashAttentionConfig`` is ``AutoXLA.attention.AttentionConfig``
(AutoXLA/attention/config.py)."""
from ....attention.config import AttentionConfig as SplashAttentionConfig

__all__ = ["SplashAttentionConfig"]
