"""``AutoXLA.models``: the original AutoXLA's package name for the model classes.

Only names: the classes are AutoXLA.modeling's own objects (``AutoXLA.models.AutoXLAModelForCausalLM
is AutoXLA.modeling.AutoXLAModelForCausalLM``), implemented in AutoXLA/modeling/causal.py and
AutoXLA/modeling/segmentation.py. The original's submodule paths work too:
``AutoXLA.models.auto_model`` and ``AutoXLA.models.segmentation``.
"""
from .auto_model import AutoXLAModelForCausalLM
from .segmentation import AutoXLAModelForImageSegmentation, AutoXLAModelForMaskGeneration

__all__ = ["AutoXLAModelForCausalLM", "AutoXLAModelForImageSegmentation",
           "AutoXLAModelForMaskGeneration"]
