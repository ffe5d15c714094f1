from .causal import AutoXLAModelForCausalLM
from .segmentation import AutoXLAModelForImageSegmentation, AutoXLAModelForMaskGeneration

__all__ = ["AutoXLAModelForCausalLM", "AutoXLAModelForImageSegmentation",
           "AutoXLAModelForMaskGeneration"]
