"""Tiny causal LM checkpoints built locally, for the demo, the tests and the benchmarks.

Random weights, real ``save_pretrained`` output (several safetensors shards and an index), so they
load through exactly the path a hub checkpoint takes. Head counts are chosen so that some divide
the model axis of an 8-device mesh and some do not, and one model has an odd intermediate size.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

_COMMON = dict(num_hidden_layers=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
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
                                                 "original_max_position_embeddings": 32,
                                                 "max_position_embeddings": 128,
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

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Random init in transformers is small (std 0.02); widen it so logits differ across tokens and
    # a wrong shard would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    directory = Path(directory)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    return directory
