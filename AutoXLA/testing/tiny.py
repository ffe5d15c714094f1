"""Tiny causal LM checkpoints built locally, for the demo, the tests and the benchmarks.

Random weights, real ``save_pretrained`` output (several safetensors shards and an index), so they
load through exactly the path a hub checkpoint takes. Head counts are chosen so that some divide
the model axis of an 8-device mesh and some do not, and one model has an odd intermediate size.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

_COMMON = dict(num_hidden_layers=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
               eos_token_id=2)

# family -> (config class name, its keywords). Every family keeps its architecture's quirks.
FAMILIES = {
    # 4 query heads, 2 kv heads: kv divides model=2 (2d) but not model=8 (mp).
    "llama": ("LlamaConfig", dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_attention_heads=4, num_key_value_heads=2)),
    # Sliding window shorter than the test sequences, 8 heads / 4 kv heads.
    "mistral": ("MistralConfig", dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                                       num_attention_heads=8, num_key_value_heads=4,
                                       sliding_window=6)),
    # q/k norms, head_dim independent of hidden, odd intermediate size, vocab not divisible by 8.
    "qwen3": ("Qwen3Config", dict(vocab_size=250, hidden_size=64, intermediate_size=77,
                                   num_attention_heads=8, num_key_value_heads=8, head_dim=16)),
    # Logit soft-caps, alternating local/global layers, tied embeddings, 3 kv heads.
    "gemma2": ("Gemma2Config", dict(vocab_size=256, hidden_size=48, intermediate_size=96,
                                     num_attention_heads=6, num_key_value_heads=3, head_dim=16,
                                     sliding_window=6, query_pre_attn_scalar=16)),
    # Mistral 3's text model (yarn rope), 8 heads / 2 kv heads.
    "ministral3": ("Ministral3Config", dict(vocab_size=256, hidden_size=64, intermediate_size=96,
                                             num_attention_heads=8, num_key_value_heads=2,
                                             head_dim=8, rope_parameters={
                                                 "type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                 "original_max_position_embeddings": 128,
                                                 "max_position_embeddings": 512,
                                                 "beta_fast": 32.0, "beta_slow": 1.0,
                                                 "mscale_all_dim": 1.0, "mscale": 1.0,
                                                 "llama_4_scaling_beta": 0.1})),
}


def available_families() -> list[str]:
    import transformers

    return [f for f, (cls, _) in FAMILIES.items() if hasattr(transformers, cls)]


def tiny_config(family: str, **overrides):
    return config_from_table(FAMILIES, family, overrides, defaults=_COMMON)


def config_from_table(families: dict, family: str, overrides: dict, defaults: dict | None = None):
    """The transformers config ``families[family]`` names: defaults, then the family's keywords,
    then ``overrides``."""
    import copy

    import transformers

    if family not in families:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(families)}")
    cls_name, kwargs = families[family]
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        raise ValueError(f"transformers {transformers.__version__} has no {cls_name}")
    return cls(**{**(defaults or {}), **copy.deepcopy(kwargs), **overrides})


def save_tiny_checkpoint(family: str, directory: str | os.PathLike, *, seed: int = 0,
                         dtype: torch.dtype = torch.float32, max_shard_size: str | int = "64KB",
                         **overrides) -> Path:
    """Builds the family's tiny model with random weights and saves it (sharded) to ``directory``."""
    from transformers import AutoModelForCausalLM

    return save_random(AutoModelForCausalLM, tiny_config(family, **overrides), directory,
                       seed=seed, dtype=dtype, max_shard_size=max_shard_size)


def save_random(auto_class, config, directory: str | os.PathLike, *, seed: int = 0,
                dtype: torch.dtype = torch.float32, max_shard_size: str | int = "64KB") -> Path:
    """``auto_class``'s model of ``config`` with random weights, saved by ``save_pretrained``
    (several shards and an index) to ``directory``. transformers' init is small (std 0.02): the
    matrices are widened to std 0.2 so that logits differ across tokens and a wrong shard shows."""
    torch.manual_seed(seed)
    model = auto_class.from_config(config, dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    directory = Path(directory)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    return directory


# Image-text-to-text checkpoints: a text decoder (text_config) and a vision tower (vision_config),
# built by AutoModelForImageTextToText. Kept out of FAMILIES, whose test matrices would run every
# strategy on them. 32x32 images in 8x8 patches: 16 patches per image.
_TEXT = dict(_COMMON, vocab_size=256, hidden_size=64, intermediate_size=96)
IMAGE_SIZE, PATCH_SIZE = 32, 8
IMAGE_TEXT_FAMILIES = {
    # Mistral 3: the Ministral 3 text model (yarn rope) and a Pixtral vision tower (4 heads, 2D
    # rotary), whose 16 patches the projector merges 2x2 into 4 image tokens.
    "mistral3": ("Mistral3Config", dict(
        text_config=dict(FAMILIES["ministral3"][1], **_TEXT, model_type="ministral3"),
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, head_dim=8,
                           image_size=IMAGE_SIZE, patch_size=PATCH_SIZE),
        image_token_index=10, spatial_merge_size=2)),
    # Mistral 3 with a Mistral text model: MistralConfig's own 4096-token sliding window (left at
    # its default on purpose: a window shorter than the test sequences hid a bug, issue 43), 8
    # heads / 2 kv heads, and the same Pixtral tower.
    "mistral3_mistral": ("Mistral3Config", dict(
        text_config=dict(**_TEXT, model_type="mistral", num_attention_heads=8,
                         num_key_value_heads=2),
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, head_dim=8,
                           image_size=IMAGE_SIZE, patch_size=PATCH_SIZE),
        image_token_index=10, spatial_merge_size=2)),
    # LLaVA: a Llama text model (8 heads, 2 kv heads) and a CLIP vision tower; every patch is an
    # image token (the class token is dropped), 16 per image.
    "llava": ("LlavaConfig", dict(
        text_config=dict(**_TEXT, model_type="llama", num_attention_heads=8, num_key_value_heads=2),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, projection_dim=32,
                           image_size=IMAGE_SIZE, patch_size=PATCH_SIZE),
        image_token_index=10, tie_word_embeddings=False)),
    # Gemma 3: Gemma3TextConfig's own 4096-token sliding window on both layers (2 layers: the
    # global layer of its 5 + 1 pattern is the architecture matrix's), a SigLIP tower whose 16
    # patches are pooled into 4 image tokens, and the image/begin/end tokens moved into the
    # shrunk vocabulary.
    "gemma3": ("Gemma3Config", dict(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=512),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE),
        mm_tokens_per_image=4, image_token_index=10, boi_token_index=11, eoi_token_index=12)),
}


def tiny_image_text_config(family: str, **overrides):
    return config_from_table(IMAGE_TEXT_FAMILIES, family, overrides)


def image_tokens_per_image(config) -> int:
    """How many image tokens one IMAGE_SIZE image becomes in ``config``'s model (Mistral 3 merges
    patches spatial_merge_size x spatial_merge_size; LLaVA keeps one per patch; Gemma 3 pools
    them into mm_tokens_per_image)."""
    if getattr(config, "mm_tokens_per_image", None):
        return config.mm_tokens_per_image
    vision = config.vision_config
    side = vision.image_size // vision.patch_size // getattr(config, "spatial_merge_size", 1)
    return side * side


def save_tiny_image_text_checkpoint(family: str, directory: str | os.PathLike, *, seed: int = 0,
                                    dtype: torch.dtype = torch.float32,
                                    max_shard_size: str | int = "64KB", **overrides) -> Path:
    """Builds the image-text-to-text family's tiny model with random weights (widened as in
    save_tiny_checkpoint) and saves it (sharded) to ``directory``."""
    from transformers import AutoModelForImageTextToText

    return save_random(AutoModelForImageTextToText, tiny_image_text_config(family, **overrides),
                       directory, seed=seed, dtype=dtype, max_shard_size=max_shard_size)
