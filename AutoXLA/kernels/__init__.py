"""``AutoXLA.kernels``: the original AutoXLA's names for the attention kernels, over ours.

Only names, no second implementation: ``SplashAttentionConfig`` is
``AutoXLA.attention.AttentionConfig`` (AutoXLA/attention/config.py), and the patchers and the
``apply_*`` functions (``AutoXLA.kernels.attention.impl_utils``) call
``AutoXLA.attention.patch_attention`` (AutoXLA/attention/patch.py), which
``from_pretrained(..., attn_implementation=...)`` uses too. The original's Pallas quantized
matmul (``AutoXLA.kernels.quantization``) is not here: AutoXLA.quantization chooses its backends.

Two modules of this package reach into torch_xla's and JAX's kernel internals, imported only by
what needs them: ``interpret`` (the Pallas kernels in interpret mode off a TPU, for the tests and
``autoxla doctor --selftest``) and ``lowering`` (the TPU lowering check of the kernel calls).
"""
from .attention import (BaseAttentionPatcher, SplashAttentionConfig, SplashAttentionPatcher,
                        XLAFlashAttentionPatcher, apply_splash_attention, apply_xla_flash_attention)

__all__ = ["BaseAttentionPatcher", "SplashAttentionConfig", "SplashAttentionPatcher",
           "XLAFlashAttentionPatcher", "apply_splash_attention", "apply_xla_flash_attention"]
