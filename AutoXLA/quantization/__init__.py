"""Weight quantization: QuantizationConfig, ModelQuantizer (alias LanguageModelQuantizer),
QuantizedLinear and its three matmul backends (DESIGN.md section 5)."""
from .config import LayerFormat, QuantizationConfig
from .linear import QuantizedLinear
from .quantizer import LanguageModelQuantizer, ModelQuantizer, QuantizationReport

__all__ = ["LanguageModelQuantizer", "LayerFormat", "ModelQuantizer", "QuantizationConfig",
           "QuantizationReport", "QuantizedLinear"]
