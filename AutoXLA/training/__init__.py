"""Fine-tuning a model AutoXLA loaded (docs/finetuning.md): LoRA through peft, on AutoXLA's
quantized linears too (QLoRA, ``qlora``), and the loop (``finetune``: data by length bucket,
accumulation, warm-up and cosine, evaluation, metrics, commits and exact resumption)."""
from .data import Batches, read_records, tokenize
from .lora import QuantizedLoraLinear, qlora, save_adapter
from .loop import FinetuneConfig, Result, finetune

__all__ = ["Batches", "FinetuneConfig", "QuantizedLoraLinear", "Result", "finetune", "qlora",
           "read_records", "save_adapter", "tokenize"]
