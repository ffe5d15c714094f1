"""Weight quantization: QuantizationConfig, ModelQuantizer (alias LanguageModelQuantizer),
QuantizedLinear and its three matmul backends, QuantizedEmbedding (DESIGN.md section 5), and the
original AutoXLA's helpers (quantize_llm, get_model_size, int4 pack/unpack), and calibration
(calibrate, CalibrationConfig: SmoothQuant, the sensitivity report, auto-exclusion)."""
from .calibration import Calibration, CalibrationConfig, calibrate
from .config import LayerFormat, QuantizationConfig
from .embedding import QuantizedEmbedding
from .helpers import (pack_int4_to_int8, quantize_llm, quantize_llm_blockwise, quantize_llm_int4,
                      quantize_llm_int8, unpack_int8_to_int4)
from .linear import QuantizedLinear
from .quantizer import LanguageModelQuantizer, ModelQuantizer, QuantizationReport, get_model_size
from .sensitivity import CalibrationReport
from .smoothing import Smoothing, apply_smoothing

__all__ = ["Calibration", "CalibrationConfig", "CalibrationReport", "Smoothing", "apply_smoothing",
           "calibrate", "LanguageModelQuantizer", "LayerFormat", "ModelQuantizer", "QuantizationConfig",
           "QuantizationReport", "QuantizedEmbedding", "QuantizedLinear", "get_model_size",
           "pack_int4_to_int8", "quantize_llm", "quantize_llm_blockwise", "quantize_llm_int4",
           "quantize_llm_int8", "unpack_int8_to_int4"]
