"""Fine-tuning a model AutoXLA loaded (docs/finetuning.md): LoRA through peft, on AutoXLA's
quantized linears too (QLoRA, ``qlora``)."""
from .lora import QuantizedLoraLinear, qlora

__all__ = ["QuantizedLoraLinear", "qlora"]
