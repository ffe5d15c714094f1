"""Fine-tuning a model AutoXLA loaded (docs/finetuning.md): LoRA through peft, on AutoXLA's
quantized linears too (QLoRA, ``qlora``), and the loop (``finetune``: data by length bucket,
accumulation, warm-up and cosine, evaluation, metrics, commits and exact resumption), and a saved
adapter merged into its checkpoint on the host (``merge_checkpoint``)."""
from .data import Batches, read_records, tokenize
from .lora import (load_adapter, merge_and_save, qlora, quantized_lora_linear, save_adapter,
                   shard_adapters)
from .loop import FinetuneConfig, Result, finetune
from .merge import merge_checkpoint

__all__ = ["Batches", "FinetuneConfig", "Result", "finetune", "load_adapter", "merge_and_save",
           "merge_checkpoint", "qlora", "quantized_lora_linear", "read_records", "save_adapter",
           "shard_adapters", "tokenize"]
