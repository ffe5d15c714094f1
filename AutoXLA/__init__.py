"""AutoXLA: Hugging Face models sharded over XLA device meshes."""
from .attention import AttentionConfig
from .modeling import (AutoXLAModelForCausalLM, AutoXLAModelForImageSegmentation,
                       AutoXLAModelForMaskGeneration)
from .quantization import LanguageModelQuantizer, ModelQuantizer, QuantizationConfig
from .sharding.mesh import MeshShape, mesh_shape_for
from .sharding.multislice import MultiSlice
from .planning.plan import Plan, TensorPlan
from .saving import TrainingCheckpoints

__version__ = "0.1.0"
__all__ = ["AttentionConfig", "AutoXLAModelForCausalLM", "AutoXLAModelForImageSegmentation",
           "AutoXLAModelForMaskGeneration", "LanguageModelQuantizer", "MeshShape", "ModelQuantizer",
           "MultiSlice", "Plan", "QuantizationConfig", "TensorPlan", "TrainingCheckpoints",
           "mesh_shape_for"]
