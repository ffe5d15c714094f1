"""Accuracy of quantization formats against the float model (`autoxla eval-quant`):
perplexity of causal LMs, output SQNR of segmentation models, AutoXLA's formats beside
llama.cpp's reference quantizers at equal bits (docs/quantization.md, 'Measuring accuracy')."""
from .formats import FORMATS, SETS, Format, autoxla, llama_cpp, parse_formats
from .run import Evaluation, Result, evaluate

__all__ = ["FORMATS", "SETS", "Format", "autoxla", "llama_cpp", "parse_formats", "Evaluation",
           "Result", "evaluate"]
