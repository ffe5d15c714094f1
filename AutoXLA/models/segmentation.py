"""The original AutoXLA's ``AutoXLA.models.segmentation``: AutoXLA.modeling's segmentation classes
(implemented in AutoXLA/modeling/segmentation.py)."""
from ..modeling.segmentation import AutoXLAModelForImageSegmentation, AutoXLAModelForMaskGeneration

__all__ = ["AutoXLAModelForImageSegmentation", "AutoXLAModelForMaskGeneration"]
