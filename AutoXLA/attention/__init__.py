"""Attention kernels: transformers attention functions for TPU kernels and a portable path."""
from .blockwise import Schedule, blockwise_attention, schedule
from .config import IMPLEMENTATIONS, KERNELS, AttentionConfig
from .patch import patch_attention, vision_attention

__all__ = ["IMPLEMENTATIONS", "KERNELS", "AttentionConfig", "Schedule", "blockwise_attention",
           "patch_attention", "schedule", "vision_attention"]
