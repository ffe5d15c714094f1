"""Finding a checkpoint's weight files and reading their safetensors headers.

Only the headers are read here (a few KiB per file); tensor data is read by the C core straight
from the file into shard buffers (streaming.py), so the model is never held in host memory.
"""
from __future__ import annotations

import json
import os
import re
import stat
import struct
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch

from ..saving.journal import SAFE_INDEX, SAFE_SINGLE  # noqa: F401 - the loader's names too
from .. import _native

# safetensors dtype strings -> torch dtypes.
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
PICKLE_INDEX, PICKLE_SINGLE = "pytorch_model.bin.index.json", "pytorch_model.bin"
# Header size limit, as the safetensors format itself sets it (100 MB): guards against garbage.
_MAX_HEADER = 100_000_000
# An index is a few MB even for the largest models; more is garbage, not a checkpoint.
_MAX_INDEX = 100_000_000
# SafetensorsHeaderError kinds of a header that is not valid JSON at all (or not an object).
_JSON_ERROR_KINDS = frozenset({"eof", "syntax", "utf8", "control_char", "escape", "surrogate",
                               "too_deep", "trailing_data", "not_object"})


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked; the message says what to do."""


class CheckpointWarning(UserWarning):
    """A checkpoint that loads, but not entirely as its files suggest."""


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
    """Records of every tensor in one .safetensors file (header only), in file order.

    The header is validated as a whole by the C core's strict parser
    (_native.parse_safetensors_header: JSON, schema, dtypes, sizes, duplicate names, and
    offsets that tile the data section up to the exact end of the file) before any byte of
    tensor data is read. Every problem is a CheckpointError naming the file, the tensor and
    the fix. Only a regular file is read: the path is opened without blocking and anything
    else (a FIFO would block, a device read forever) is refused by the descriptor's type.
    """
    path = os.fspath(path)
    redo = "download or save it again"
    try:
        # O_NONBLOCK: opening a FIFO cannot block; the type is then checked on the descriptor
        # itself, so no path swapped in between can slip through.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file (a dangling link?); a .safetensors weight "
                              f"file must be a regular file: {redo}") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open the weight file ({e.strerror}); check its "
                              f"permissions, or {redo}") from None
    try:
        st = os.fstat(fd)
        _require_regular_mode(path, st.st_mode, "a .safetensors weight file")
    except BaseException:
        os.close(fd)
        raise
    size = st.st_size
    with os.fdopen(fd, "rb") as f:
        try:
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError(
                    f"{path} is not a safetensors file (shorter than 8 bytes: {size}); "
                    f"{redo}, e.g. with save_pretrained(safe_serialization=True)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER:
                raise CheckpointError(
                    f"{path}: safetensors header of {n} bytes is not plausible (the format's "
                    f"limit is {_MAX_HEADER}); the file is corrupt or not safetensors: {redo}")
            if 8 + n > size:
                raise CheckpointError(
                    f"{path}: the safetensors header claims {n} bytes but the file has only "
                    f"{size - 8} after its 8-byte length; the file is truncated or not "
                    f"safetensors: {redo}")
            header = f.read(n)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read the weight file ({e.strerror}); "
                                  f"{redo}") from None
    if len(header) != n:  # the file shrank while being read
        raise CheckpointError(f"{path}: the file ended {n - len(header)} bytes into its "
                              f"{n}-byte safetensors header (truncated while being read?); {redo}")
    try:
        tensors = _native.parse_safetensors_header(header, size)
    except _native.SafetensorsHeaderError as e:
        if e.kind in _JSON_ERROR_KINDS:
            what, fix = "unreadable safetensors header", f"the file is corrupt: {redo}"
        elif e.kind == "truncated":
            what, fix = "truncated safetensors file", f"an interrupted download or copy? {redo}"
        elif e.kind == "trailing_bytes":
            what, fix = "safetensors file with trailing bytes", (
                f"bytes were appended or the file is corrupt: {redo}")
        else:
            what, fix = "invalid safetensors header", (
                f"the file is corrupt or was written by a broken tool: {redo}")
        raise CheckpointError(f"{path}: {what}: {e}; {fix}") from None
    base = 8 + n
    records = {}
    for t in tensors:
        dtype = SAFETENSORS_DTYPES.get(t.dtype)
        if dtype is None:
            raise CheckpointError(
                f"{path}: tensor {t.name!r} has dtype {t.dtype!r}, which AutoXLA does not load "
                f"(supported: {', '.join(SAFETENSORS_DTYPES)}); convert the checkpoint to one "
                "of them, e.g. load it with transformers and save it in bfloat16")
        records[t.name] = TensorRecord(t.name, path, dtype, t.shape, base + t.begin,
                                       t.end - t.begin)
    return records


@dataclass
class Checkpoint:
    """The weight files of one checkpoint directory."""

    directory: Path
    records: dict[str, TensorRecord]   # empty for pickle checkpoints
    pickle_files: list[Path]
    pickle_map: dict[str, Path] | None = None   # a sharded pickle index: name -> file

    @property
    def is_pickle(self) -> bool:
        return bool(self.pickle_files)


def locate(path_or_id: str | os.PathLike, *, use_safetensors: bool | None = None,
           subfolder: str = "", **hub_kwargs) -> Checkpoint:
    """The checkpoint at a local directory or a hub id (downloaded or from the hub cache).

    Every header and index is validated here, before any tensor byte is read. For a sharded
    checkpoint the index is the authority: each tensor comes from the shard the index names (it
    must be there), and a tensor a shard holds but the index assigns elsewhere, or not at all, is
    ignored with a warning (docs/security.md).

    Pickle weights (``pytorch_model*.bin``) are never unpickled unless the caller opts in with
    ``use_safetensors=False``; then they are read with ``torch.load(weights_only=True)``.
    """
    directory = Path(path_or_id)
    if not directory.is_dir():
        directory = _download(str(path_or_id), use_safetensors, **hub_kwargs)
    if subfolder:
        _check_inside(directory, "subfolder", subfolder, "the subfolder argument")
        directory = directory / subfolder
    if use_safetensors is not False:
        found = _safetensors_files(directory)
        if found is not None:
            return Checkpoint(directory, _indexed_records(directory, *found), [])
    found = _pickle_files(directory)
    if found is not None and use_safetensors is False:
        return Checkpoint(directory, {}, found[0], pickle_map=found[1])
    if found is not None:
        raise CheckpointError(
            f"{directory} holds only pickle weights ({found[0][0].name}); AutoXLA does not "
            "unpickle by default because pickle files can run code. Convert them to safetensors "
            "(model.save_pretrained(dir, safe_serialization=True)), or pass use_safetensors=False "
            "to load them with torch.load(weights_only=True) if you trust the source")
    raise CheckpointError(f"no weights in {directory}: expected {SAFE_SINGLE} or {SAFE_INDEX} "
                          "(from save_pretrained); check the path and the subfolder")


def _present(path: Path) -> bool:
    """Whether ``path`` exists at all (a FIFO or directory does: it is then refused, not skipped)."""
    return os.path.lexists(path)


def require_regular_file(path: Path, what: str) -> None:
    """Refuse anything but a regular file (after symlinks, as the hub cache uses) before opening:
    opening a FIFO blocks forever, a device reads forever."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file (a dangling link?); {what} must be a "
                              "regular file: download or save the checkpoint again") from None
    _require_regular_mode(path, mode, what)


def _require_regular_mode(path, mode: int, what: str) -> None:
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path} is {_native.file_kind(mode)}; {what} must be a regular "
                              "file: replace it with the file from the checkpoint")


def read_index(path: Path) -> dict[str, str]:
    """The validated ``weight_map`` of a sharded checkpoint's index: tensor name -> shard file,
    every file a relative path that stays inside the checkpoint directory."""
    require_regular_file(path, "the index")
    size = os.stat(path).st_size
    if size > _MAX_INDEX:
        raise CheckpointError(f"{path} is {size} bytes, not a plausible index (at most "
                              f"{_MAX_INDEX}); the file is corrupt: download or save it again")
    try:
        index = json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, RecursionError) as e:     # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{path}: unreadable JSON ({type(e).__name__}: {e}); the index is "
                              "corrupt or truncated: download or save it again") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        got = (type(index).__name__ if not isinstance(index, dict) else
               "no weight_map" if "weight_map" not in index else
               f"a weight_map of type {type(weight_map).__name__}")
        raise CheckpointError(f"{path}: expected a JSON object with a \"weight_map\" object "
                              f"(tensor name -> shard file), got {got}; the index is corrupt: "
                              "download or save it again")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file:
            raise CheckpointError(f"{path}: tensor {name!r} maps to {file!r}, not a file name; "
                                  "the index is corrupt: download or save it again")
        _check_inside(path, repr(name), file, "an index")
    return weight_map


def _check_inside(where: Path, what: str, file: str, who: str) -> None:
    """A relative path that cannot leave the checkpoint directory (no absolute path, no ``..``)."""
    pure = PurePosixPath(file)
    if pure.is_absolute() or ".." in pure.parts or "\0" in file or "\\" in file:
        raise CheckpointError(f"{where}: {what} names {file!r}, which is outside the checkpoint "
                              f"directory; {who} may only name files inside it (a hostile or "
                              "broken checkpoint): fix it or download it again")


def _shard_files(d: Path, index_name: str, weight_map: dict[str, str]) -> list[Path]:
    names = sorted(set(weight_map.values()))
    missing = [n for n in names if not _present(d / n)]
    if missing:
        raise CheckpointError(f"{d / index_name} lists {missing[:3]} but they are not in {d}; "
                              "the download is incomplete: fetch the missing shards")
    return [d / n for n in names]


def _safetensors_files(d: Path):
    """(files, weight_map or None), or None when ``d`` has no safetensors weights."""
    if _present(d / SAFE_INDEX):
        weight_map = read_index(d / SAFE_INDEX)
        return _shard_files(d, SAFE_INDEX, weight_map), weight_map
    if _present(d / SAFE_SINGLE):   # its type is checked where it is opened
        return [d / SAFE_SINGLE], None
    return None


def _indexed_records(d: Path, files: list[Path], weight_map) -> dict[str, TensorRecord]:
    """Every tensor the checkpoint loads, each from the one file the index assigns it to."""
    headers = {f: read_safetensors_header(f) for f in files}
    if weight_map is None:
        return headers[files[0]]
    records, ignored = {}, []
    for name, file in weight_map.items():
        record = headers[d / file].get(name)
        if record is None:
            raise CheckpointError(
                f"{d / SAFE_INDEX} puts tensor {name!r} in {file}, but {file} holds no such "
                "tensor; the index and the shards come from different saves: download or save "
                "the checkpoint again")
        records[name] = record
    for f, header in headers.items():
        ignored += [f"{n} (in {f.name})" for n in header
                    if n not in weight_map or d / weight_map[n] != f]
    if ignored:
        warnings.warn(f"{d}: {len(ignored)} tensor(s) in the shards are not assigned to that shard "
                      f"by {SAFE_INDEX} and are ignored, e.g. {', '.join(ignored[:3])}; the index "
                      "decides which copy loads", CheckpointWarning, stacklevel=3)
    return records


def _pickle_files(d: Path):
    """(files, weight_map or None), or None when ``d`` has no pickle weights."""
    if _present(d / PICKLE_INDEX):
        weight_map = read_index(d / PICKLE_INDEX)
        files = _shard_files(d, PICKLE_INDEX, weight_map)
        pickle_map = {name: d / file for name, file in weight_map.items()}
    elif _present(d / PICKLE_SINGLE):
        files, pickle_map = [d / PICKLE_SINGLE], None
    else:
        return None
    # Checked here, with the index, though torch.load opens them only later (load_pickle_state
    # checks again there): a special file is refused before the model is even built.
    for f in files:
        require_regular_file(f, f"pickle weight file {f.name}")
    return files, pickle_map


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def require_path_or_hub_id(path) -> None:
    """A CheckpointError when ``path`` neither exists nor could be a hub id ("owner/name"):
    saying the path does not exist, instead of the hub client's "Repo id must be in the form"."""
    text = os.fspath(path)
    if os.path.exists(text) or (_HUB_ID.match(text) and ".." not in text):
        return
    raise CheckpointError(f"{text} does not exist: pass the directory of a checkpoint (config.json "
                          "and weights), or a hub id (owner/name)")


def _download(repo_id: str, use_safetensors, revision=None, cache_dir=None,
              local_files_only=False, token=None, **_ignored) -> Path:
    from huggingface_hub import snapshot_download

    require_path_or_hub_id(repo_id)

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


def load_pickle_state(files: list[Path], weight_map: dict[str, Path] | None = None
                      ) -> dict[str, torch.Tensor]:
    """Opt-in only (use_safetensors=False): reads .bin weights without running pickled code.

    Zip files (torch >= 1.6) are memory-mapped; legacy (non-zip) files are read whole. With an
    index (``weight_map``: tensor name -> its file), each tensor is taken from the file the index
    names, as for safetensors.
    """
    state: dict[str, torch.Tensor] = {}
    for f in files:
        require_regular_file(f, "a pickle weight file")
        try:
            loaded = torch.load(f, map_location="cpu", weights_only=True,
                                mmap=zipfile.is_zipfile(f))
        except Exception as e:   # UnpicklingError (refused object), EOFError, RuntimeError...
            raise CheckpointError(
                f"{f}: cannot be read as PyTorch weights ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); only tensors are loaded "
                "(weights_only=True): convert the checkpoint to safetensors, or download it "
                "again") from None
        if not isinstance(loaded, dict) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()):
            raise CheckpointError(f"{f} holds a {type(loaded).__name__}, not a state dict of named "
                                  "tensors; save model.state_dict(), or convert to safetensors")
        if weight_map is not None:
            mine = {n for n, file in weight_map.items() if file == f}
            absent = sorted(mine - set(loaded))
            if absent:
                raise CheckpointError(f"the index puts tensor {absent[0]!r} in {f.name}, but "
                                      f"{f.name} holds no such tensor; the index and the files come "
                                      "from different saves: download or save again")
            loaded = {n: t for n, t in loaded.items() if n in mine}
        state.update(loaded)
    return state


def renamed_keys(model, keys) -> tuple[dict[str, str], list[str]]:
    """(name the model uses -> checkpoint key, keys that need more than a rename).

    transformers 5 saves some models in their hub layout and renames keys as it loads them
    (SAM3, SegFormer, Mask2Former's Swin backbone, legacy LayerNorm gamma/beta). The same rules,
    taken from transformers, map the checkpoint's keys here. A key whose rule also transforms the
    tensor (a WeightConverter: fused or split experts, ...) is returned separately
    (``loading/converted.py`` places those it can).
    """
    renamings, converters = weight_conversions(model)
    if renamings is None:
        return {k: k for k in keys}, []
    from transformers.core_model_loading import rename_source_key

    names, converted = {}, []
    for key in sorted(keys):     # sorted: transformers' grouped renames decide on the first key
        new, matched = rename_source_key(key, renamings, converters)
        if matched is not None:
            converted.append(key)
        names[new] = key
    return names, converted


def weight_conversions(model) -> tuple[list | None, list]:
    """transformers' (WeightRenaming list, WeightConverter list) for ``model``; (None, []) for a
    model that is not a transformers model (or an older transformers without them)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
        from transformers.modeling_utils import PreTrainedModel
    except ImportError:          # pragma: no cover - older transformers: names are as saved
        return None, []
    if not isinstance(model, PreTrainedModel):
        return None, []
    conversions = get_model_conversion_mapping(model)
    return ([c for c in conversions if isinstance(c, WeightRenaming)],
            [c for c in conversions if isinstance(c, WeightConverter)])
