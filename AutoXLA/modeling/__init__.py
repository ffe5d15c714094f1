from .causal import AutoXLAModelForCausalLM

__all__ = ["AutoXLAModelForCausalLM"]
