"""The architectures AutoXLA is tested on, each built from transformers' own config class.

Every entry is the config class with its real defaults (sliding windows, rope scaling, soft-caps,
fused projections, Conv1D, experts, latent attention) and only the sizes shrunk, plus the few
keywords the released checkpoints set that the class does not default to (Llama 3.1's rope
scaling, Falcon's new decoder architecture). The coverage test (tests/modeling/test_architectures.py)
loads each one sharded and checks it against plain transformers; ``python -m
AutoXLA.architectures`` prints the table in docs/models.md from the same list, so the table says
what the suite checks.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..modeling.pipeline import empty_model
from ..sharding.decoder_stack import plan_stack
from .tiny import save_random

# The sizes every architecture is shrunk to, by config field (only fields the class has are set).
# Hidden 64 with 4 heads of 16 and 2 kv heads: heads split over a model axis of 2 (2d on 8
# devices); 8 experts split over fsdp=4 (2d) or 8 (fsdp).
SHRUNK = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=512,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    # mixture-of-experts
    num_local_experts=8, num_experts=8, n_routed_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=64, n_shared_experts=1,
    n_group=2, topk_group=1,
    # multi-head latent attention (DeepSeek)
    q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    # GPT-2's and Falcon's own names
    n_embd=64, n_layer=2, n_head=4, n_inner=128, num_kv_heads=2,
)


@dataclass(frozen=True)
class Architecture:
    name: str                      # as users know it
    config_class: str              # transformers' config class
    keywords: dict = field(default_factory=dict)   # what released checkpoints set beyond defaults
    moe: bool = False
    subset: bool = False           # also checked under fsdp, 3d and int8
    note: str = ""                 # what users should know (shown in docs/models.md)

    def config(self, **overrides):
        import transformers

        cls = getattr(transformers, self.config_class)
        defaults = cls()
        sizes = {k: v for k, v in SHRUNK.items() if k in _own_fields(defaults)}
        # Special token ids beyond the shrunk vocabulary (Phi-3's pad id 32000) move inside it.
        vocab = sizes.get("vocab_size", getattr(defaults, "vocab_size", None))
        for k, top in (("pad_token_id", 1), ("bos_token_id", 2), ("eos_token_id", 3)):
            value = getattr(defaults, k, None)
            if vocab and isinstance(value, int) and value >= vocab:
                sizes[k] = vocab - top
            elif vocab and isinstance(value, list) and any(v >= vocab for v in value):
                sizes[k] = [v if v < vocab else vocab - top - i for i, v in enumerate(value)]
        return cls(**{**sizes, **self.keywords, **overrides})


def _own_fields(config) -> set[str]:
    """The fields ``config``'s class takes (its attribute_map's aliases are not fields)."""
    aliases = set(getattr(config, "attribute_map", {}))
    return {k for k in config.to_dict() if k not in aliases} | {
        k for k in vars(config) if not k.startswith("_") and k not in aliases}


_LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}

ARCHITECTURES = [
    Architecture("Llama", "LlamaConfig", dict(rope_parameters=_LLAMA31_ROPE,
                                              max_position_embeddings=131072), subset=True,
                 note="Llama 3.1's rope scaling"),
    Architecture("Mistral", "MistralConfig", subset=True,
                 note="4096-token sliding window, as Mistral-7B-v0.1 ships"),
    Architecture("Mixtral", "MixtralConfig", moe=True, subset=True),
    Architecture("Qwen2", "Qwen2Config"),
    Architecture("Qwen2-MoE", "Qwen2MoeConfig", moe=True, note="a shared expert beside the routed ones"),
    Architecture("Qwen3", "Qwen3Config"),
    Architecture("Qwen3-MoE", "Qwen3MoeConfig", moe=True),
    Architecture("Gemma", "GemmaConfig"),
    # Layered models get two periods of their layer pattern, so the scanned stack runs it.
    Architecture("Gemma 2", "Gemma2Config", dict(num_hidden_layers=4), subset=True,
                 note="logit soft-caps, sliding/global pairs"),
    # Gemma 3's pattern is 5 sliding layers and a global one.
    Architecture("Gemma 3", "Gemma3TextConfig", dict(num_hidden_layers=12)),
    Architecture("Phi", "PhiConfig", note="partial rotary, parallel attention and MLP"),
    Architecture("Phi-3", "Phi3Config", note="fused qkv and gate/up projections"),
    Architecture("OLMo 2", "Olmo2Config"),
    Architecture("OLMoE", "OlmoeConfig", moe=True),
    Architecture("Granite", "GraniteConfig"),
    Architecture("Cohere", "CohereConfig"),
    # Cohere 2's pattern is 3 sliding layers and a global one.
    Architecture("Cohere 2", "Cohere2Config", dict(num_hidden_layers=8)),
    Architecture("StableLM", "StableLmConfig"),
    Architecture("GPT-2", "GPT2Config", note="Conv1D layers (int8 and int4: quantized as transposed linears), learned positions"),
    Architecture("GPT-NeoX", "GPTNeoXConfig"),
    Architecture("Falcon", "FalconConfig", dict(new_decoder_architecture=True),
                 note="the new decoder architecture (Falcon-40B, 180B)"),
    Architecture("SmolLM3", "SmolLM3Config"),
    Architecture("gpt-oss", "GptOssConfig", dict(num_hidden_layers=4), moe=True,
                 note="expert biases, attention sinks, alternating 128-token windows"),
    # 3 layers: DeepSeek-V3's first layers are dense (first_k_dense_replace), the rest MoE.
    Architecture("DeepSeek-V3", "DeepseekV3Config", dict(num_hidden_layers=3, first_k_dense_replace=1,
                                                         # MLA: head_dim is the rope part; every
                                                         # head has its own keys (128 = 128 by default)
                                                         head_dim=8, num_key_value_heads=4),
                 moe=True, note="multi-head latent attention, shared experts, dense first layers"),
    Architecture("Mistral 3", "Ministral3Config", note="the Ministral 3 text model (yarn rope)"),
]
BY_NAME = {a.name: a for a in ARCHITECTURES}
# Quantized experts (quantization/experts.py) checked per expert layout: stacked from one tensor
# per expert (Mixtral; Qwen2-MoE with a shared expert; DeepSeek-V3), fused and transposed with
# biases (gpt-oss). Architecture name -> the bit widths.
QUANTIZED_EXPERTS = {"Mixtral": (4,), "Qwen2-MoE": (4,), "gpt-oss": (8, 4), "DeepSeek-V3": (8,)}


def save_checkpoint(arch: Architecture | str, directory: str | os.PathLike, *, seed: int = 0,
                    dtype: torch.dtype = torch.float32, max_shard_size: str | int = "256KB",
                    **overrides) -> Path:
    """The architecture's shrunk model with random weights, saved by ``save_pretrained`` in
    several shards (mixture-of-experts models in their hub layout: one tensor per expert)."""
    from transformers import AutoModelForCausalLM

    arch = BY_NAME[arch] if isinstance(arch, str) else arch
    return save_random(AutoModelForCausalLM, arch.config(**overrides), directory, seed=seed,
                       dtype=dtype, max_shard_size=max_shard_size)


def markdown_table() -> str:
    """docs/models.md's table of architectures (regenerate with ``python -m AutoXLA.architectures``).
    The decoder stack column is the plan's decision for the shrunk model (modeling/scan.py)."""
    rows = ["| architecture | config class | mixture of experts | checked under | decoder stack | notes |",
            "|---|---|---|---|---|---|"]
    for a in ARCHITECTURES:
        under = "2d, fsdp, 3d, int8" if a.subset else "2d"
        if a.name == "Mixtral":
            under = "every strategy, int8, a training step"
        if a.name in QUANTIZED_EXPERTS:
            under += ", " + " and ".join(f"int{b}" for b in QUANTIZED_EXPERTS[a.name]) + " experts"
        rows.append(f"| {a.name} | `{a.config_class}` | {'yes' if a.moe else ''} | {under} | "
                    f"{_stack(a)} | {a.note} |")
    return "\n".join(rows)


def _stack(arch: Architecture) -> str:
    from transformers import AutoModelForCausalLM

    plan = plan_stack(empty_model(arch.config(), AutoModelForCausalLM).model)
    if plan.scanned:
        note = "scanned" if plan.group == 1 else f"scanned by {plan.group} layers"
        if plan.start:
            note += f" after {plan.start} unrolled layer{'s' if plan.start > 1 else ''}"
        return note
    return "unrolled: " + plan.reason.split(" (")[0].split(":")[0]


if __name__ == "__main__":
    print(markdown_table())
