"""The original AutoXLA's ``AutoXLA.models.auto_model``: AutoXLA.modeling's causal-LM class
(implemented in AutoXLA/modeling/causal.py)."""
from ..modeling.causal import AutoXLAModelForCausalLM

__all__ = ["AutoXLAModelForCausalLM"]
