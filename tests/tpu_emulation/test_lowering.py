"""The TPU lowering check (AutoXLA/kernels/lowering.py): every attention call AutoXLA would make
for the shipped decoder configs at 2k and 8k tokens produces its Mosaic TPU program here (32k:
`./run emulated -m AutoXLA.kernels.lowering`, docs/attention.md), and a deliberately bad block
size is refused the way a TPU compile would refuse it."""
import pytest

from AutoXLA.kernels import lowering


def test_every_shipped_decoder_lowers_for_the_tpu(xla_devices):
    results = lowering.check_shipped(lowering.TEST_SEQ_LENS)
    names = {name for name, _, _ in results}
    # The configs this covers (DeepSeek-V3's latent attention aside): a new config shows here.
    assert {"meta-llama/Llama-2-7b-hf", "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B",
            "mistralai/Mistral-7B-v0.1", "Qwen/Qwen3-8B", "google/gemma-2-9b"} <= names
    failures = [f"{name}: {r}" for name, _, r in results if not isinstance(r, int)]
    assert not failures, "\n".join(failures)
    kernels = {(name, c.kernel) for name, c, _ in results}
    assert ("meta-llama/Llama-3.1-8B", "xla_flash_attention") in kernels
    assert ("google/gemma-2-9b", "xla_flash_attention") not in kernels   # soft-cap: splash only
    assert {c.seq_len for _, c, _ in results} == set(lowering.TEST_SEQ_LENS)


def test_a_bad_block_size_fails_the_check(xla_devices):
    call = lowering.AttentionCall("xla_flash_attention", 32, 32, 128, 2048)
    blocks = lowering.flash_blocks(2048, 1)
    blocks["block_q"] = 100     # TPU blocks must divide by 8 and 128 (or span the array)
    with pytest.raises(lowering.LoweringError, match="divisible by 8 and 128"):
        lowering.lower_attention(call, blocks=blocks)


def test_the_quantized_matmul_lowers_with_the_tiles_autoxla_passes(xla_devices):
    import torch

    from AutoXLA.quantization import QuantizationConfig, backends, pallas_tiles

    # A tuned v6 entry (Llama-3-8B's q_proj, W8A8, 1024 tokens), and the untuned minimum with
    # fp32 activations (weight-only) as the emulated tests run it.
    tiles = pallas_tiles.tiles(6, 1024, 4096, 4096, "bfloat16", True)
    lowering.lower_quantized_matmul(1024, 4096, 4096, tiles, True)
    lowering.lower_quantized_matmul(16, 4096, 4096, pallas_tiles.DEFAULT, False, "float32")
    # Weight-only int8 with bf16 activations does not compile for a TPU (the kernel's fp32
    # accumulator meets bf16): why the plan gives such layers the next backend.
    with pytest.raises(lowering.LoweringError, match="Invalid dtype"):
        lowering.lower_quantized_matmul(16, 4096, 4096, pallas_tiles.DEFAULT, False)
    cfg = QuantizationConfig(bits=8)
    name, passed = backends.choose(cfg.layer_format("o", 4096, 4096), cfg, True, "o",
                                   torch.bfloat16, False)
    assert name == "xla_op" and "unless they are quantized too" in passed[0]
