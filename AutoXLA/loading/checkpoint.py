"""Finding a checkpoint's weight files and reading their safetensors headers.

Only the headers are read here (a few KiB per file); tensor data is read by the C core straight
from the file into shard buffers (streaming.py), so the model is never held in host memory.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

# safetensors dtype strings -> torch dtypes.
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
SAFE_INDEX, SAFE_SINGLE = "model.safetensors.index.json", "model.safetensors"
PICKLE_INDEX, PICKLE_SINGLE = "pytorch_model.bin.index.json", "pytorch_model.bin"
# Header size limit, as the safetensors format itself sets it (100 MB): guards against garbage.
_MAX_HEADER = 100_000_000


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked; the message says what to do."""


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor's bytes live in a safetensors file."""

    name: str
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int   # absolute byte offset of the first element in the file
    nbytes: int


def read_safetensors_header(path: str | os.PathLike) -> dict[str, TensorRecord]:
    """Records of every tensor in one .safetensors file (header only)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{path} is not a safetensors file (shorter than 8 bytes); "
                                  "re-save it with save_pretrained(safe_serialization=True)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            raise CheckpointError(f"{path}: safetensors header of {n} bytes is not plausible; "
                                  "the file is corrupt or not safetensors")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: unreadable safetensors header ({e}); the file is "
                                  "corrupt or truncated: download or save it again") from None
        size = os.fstat(f.fileno()).st_size
    base = 8 + n
    records = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {info.get('dtype')!r}, which "
                                  f"AutoXLA does not load (supported: {', '.join(SAFETENSORS_DTYPES)})")
        begin, end = info["data_offsets"]
        shape = tuple(int(s) for s in info["shape"])
        expected = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        if end - begin != expected or base + end > size:
            raise CheckpointError(f"{path}: tensor {name!r} claims bytes {begin}..{end} but needs "
                                  f"{expected} within a {size}-byte file; the file is truncated "
                                  "or corrupt: download or save it again")
        records[name] = TensorRecord(name, path, dtype, shape, base + begin, end - begin)
    return records


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass
class Checkpoint:
    """The weight files of one checkpoint directory."""

    directory: Path
    records: dict[str, TensorRecord]   # empty for pickle checkpoints
    pickle_files: list[Path]

    @property
    def is_pickle(self) -> bool:
        return bool(self.pickle_files)


def locate(path_or_id: str | os.PathLike, *, use_safetensors: bool | None = None,
           subfolder: str = "", **hub_kwargs) -> Checkpoint:
    """The checkpoint at a local directory or a hub id (downloaded or from the hub cache).

    Pickle weights (``pytorch_model*.bin``) are never unpickled unless the caller opts in with
    ``use_safetensors=False``; then they are read with ``torch.load(weights_only=True)``.
    """
    directory = Path(path_or_id)
    if not directory.is_dir():
        directory = _download(str(path_or_id), use_safetensors, **hub_kwargs)
    directory = directory / subfolder if subfolder else directory
    files = _safetensors_files(directory)
    if files and use_safetensors is not False:
        records: dict[str, TensorRecord] = {}
        for f in files:
            records.update(read_safetensors_header(f))
        return Checkpoint(directory, records, [])
    pickles = _pickle_files(directory)
    if pickles and use_safetensors is False:
        return Checkpoint(directory, {}, pickles)
    if pickles:
        raise CheckpointError(
            f"{directory} holds only pickle weights ({pickles[0].name}); AutoXLA does not unpickle "
            "by default because pickle files can run code. Convert them to safetensors "
            "(model.save_pretrained(dir, safe_serialization=True)), or pass use_safetensors=False "
            "to load them with torch.load(weights_only=True) if you trust the source")
    raise CheckpointError(f"no weights in {directory}: expected {SAFE_SINGLE} or {SAFE_INDEX} "
                          "(from save_pretrained); check the path and the subfolder")


def _safetensors_files(d: Path) -> list[Path]:
    if (d / SAFE_INDEX).is_file():
        index = json.loads((d / SAFE_INDEX).read_text())
        names = sorted(set(index.get("weight_map", {}).values()))
        missing = [n for n in names if not (d / n).is_file()]
        if missing:
            raise CheckpointError(f"{d / SAFE_INDEX} lists {missing[:3]} but they are not in {d}; "
                                  "the download is incomplete: fetch the missing shards")
        return [d / n for n in names]
    if (d / SAFE_SINGLE).is_file():
        return [d / SAFE_SINGLE]
    return []


def _pickle_files(d: Path) -> list[Path]:
    if (d / PICKLE_INDEX).is_file():
        index = json.loads((d / PICKLE_INDEX).read_text())
        return [d / n for n in sorted(set(index.get("weight_map", {}).values()))]
    if (d / PICKLE_SINGLE).is_file():
        return [d / PICKLE_SINGLE]
    return []


def _download(repo_id: str, use_safetensors, revision=None, cache_dir=None,
              local_files_only=False, token=None, **_ignored) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]
    if use_safetensors is False:
        patterns.append("*.bin")
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                      local_files_only=local_files_only, token=token,
                                      allow_patterns=patterns))
    except Exception as e:
        raise CheckpointError(f"{repo_id!r} is neither a local directory nor a model on the hub "
                              f"that could be fetched ({type(e).__name__}: {e}); pass the path of a "
                              "directory written by save_pretrained") from e


def load_pickle_state(files: list[Path]) -> dict[str, torch.Tensor]:
    """Opt-in only (use_safetensors=False): reads .bin weights without running pickled code."""
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
    return state


def renamed_keys(model, keys) -> tuple[dict[str, str], list[str]]:
    """(name the model uses -> checkpoint key, keys that need more than a rename).

    transformers 5 saves some models in their hub layout and renames keys as it loads them
    (SAM3, SegFormer, Mask2Former's Swin backbone, legacy LayerNorm gamma/beta). The same rules,
    taken from transformers, map the checkpoint's keys here. A key whose rule also transforms the
    tensor (a WeightConverter: fused or split experts, ...) is returned separately: the streaming
    loader cannot apply it.
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                     rename_source_key)
        from transformers.modeling_utils import PreTrainedModel
    except ImportError:          # pragma: no cover - older transformers: names are as saved
        return {k: k for k in keys}, []
    if not isinstance(model, PreTrainedModel):
        return {k: k for k in keys}, []
    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    names, converted = {}, []
    for key in sorted(keys):     # sorted: transformers' grouped renames decide on the first key
        new, matched = rename_source_key(key, renamings, converters)
        if matched is not None:
            converted.append(key)
        names[new] = key
    return names, converted
