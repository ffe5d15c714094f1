"""``AutoXLA.kernels.attention.splash_attention``: the original's path to ``SplashAttentionConfig``,
which is ``AutoXLA.attention.AttentionConfig`` (AutoXLA/attention/config.py)."""
from ....attention.config import AttentionConfig as SplashAttentionConfig

__all__ = ["SplashAttentionConfig"]
