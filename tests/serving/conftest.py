import pytest


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
