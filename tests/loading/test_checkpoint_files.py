"""A checkpoint directory's files: the index, which files may be opened, pickle weights.

Every damaged or hostile layout must end in a CheckpointError that names the file (and the
tensor, where one is involved) before any tensor byte is read, and must never block.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from AutoXLA.loading import checkpoint as ckpt
from AutoXLA.loading.checkpoint import CheckpointError, CheckpointWarning

INDEX = "model.safetensors.index.json"


@pytest.fixture
def sharded(checkpoints, tmp_path):
    """A writable copy of the tiny sharded llama checkpoint and its index."""
    d = tmp_path / "ck"
    shutil.copytree(checkpoints["llama"], d)
    return d, json.loads((d / INDEX).read_text())


def _write_index(d, index):
    (d / INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize("text, words", [
    ("[1, 2]", "got list"),
    ('"weights"', "got str"),
    ("{}", "got no weight_map"),
    ('{"weight_map": ["a.safetensors"]}', "weight_map of type list"),
    ('{"weight_map": {"w": 3}}', "'w' maps to 3"),
    ('{"weight_map": {"w": ""}}', "'w' maps to ''"),
    ('{"weight_map": {"w": "x.safetensors"', "unreadable JSON"),
    ("[" * 100_000, "unreadable JSON"),              # nesting: RecursionError inside json
    (b"\xff\xfe{}", "unreadable JSON"),              # not UTF-8
])
def test_index_of_the_wrong_shape_names_the_file(sharded, text, words):
    d, _ = sharded
    (d / INDEX).write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(CheckpointError, match="corrupt|unreadable") as e:
        ckpt.locate(d)
    assert str(d / INDEX) in str(e.value) and words in str(e.value)


@pytest.mark.parametrize("target", ["../outside.safetensors", "/etc/passwd",
                                    "sub/../../outside.safetensors", "a\\..\\b.safetensors"])
def test_index_may_not_leave_the_directory(sharded, target):
    d, index = sharded
    (d.parent / "outside.safetensors").write_bytes(b"")
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = target
    _write_index(d, index)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory") as e:
        ckpt.locate(d)
    assert repr(name) in str(e.value) and str(d / INDEX) in str(e.value)


def test_subfolder_may_not_leave_the_directory(sharded):
    d, _ = sharded
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        ckpt.locate(d, subfolder="../ck")


def test_index_may_name_a_subdirectory_and_a_symlink(sharded):
    """Inside the directory is fine, symlinks included (the hub cache links every file)."""
    d, index = sharded
    first = sorted(set(index["weight_map"].values()))[0]
    (d / "sub").mkdir()
    (d / first).rename(d / "sub" / first)
    os.symlink(d / "sub" / first, d / ("link-" + first))
    index["weight_map"] = {n: ("link-" + f if f == first else f)
                           for n, f in index["weight_map"].items()}
    _write_index(d, index)
    records = ckpt.locate(d).records
    assert set(records) == set(index["weight_map"])


def _fifo_then_locate(path_to_replace, d, use_safetensors=None):
    os.unlink(path_to_replace)
    os.mkfifo(path_to_replace)
    with pytest.raises(CheckpointError, match="is a FIFO") as e:
        ckpt.locate(d, use_safetensors=use_safetensors)
    assert str(path_to_replace) in str(e.value)


def test_special_files_are_refused_without_opening(sharded, tmp_path):
    """A FIFO blocks the reader forever once opened: it must be refused by its type."""
    d, index = sharded
    shard = d / sorted(set(index["weight_map"].values()))[0]
    _fifo_then_locate(shard, d)
    _fifo_then_locate(d / INDEX, d)
    single = tmp_path / "single"
    single.mkdir()
    (single / "model.safetensors").mkdir()
    with pytest.raises(CheckpointError, match="is a directory"):
        ckpt.locate(single)
    (single / "model.safetensors").rmdir()
    os.symlink("/dev/zero", single / "model.safetensors")
    with pytest.raises(CheckpointError, match="is a device"):
        ckpt.locate(single)


def test_fifo_in_a_pickle_index_returns_quickly(tmp_path):
    """The hang of issue 12: a sharded pickle index naming a FIFO, in a fresh process."""
    (tmp_path / "pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": {"w": "pytorch_model-00001-of-00001.bin"}}))
    os.mkfifo(tmp_path / "pytorch_model-00001-of-00001.bin")
    fifo = str(tmp_path / "pytorch_model-00001-of-00001.bin")
    code = ("from pathlib import Path\n"
            "from AutoXLA.loading import checkpoint as c\n"
            "for step in (lambda: c.locate(%r, use_safetensors=False),\n"
            "             lambda: c.load_pickle_state([Path(%r)])):\n"
            "    try:\n        step()\n"
            "    except c.CheckpointError as e:\n        print('refused:', e)\n"
            % (str(tmp_path), fifo))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("is a FIFO") == 2 and fifo in r.stdout


def test_index_names_a_tensor_its_shard_lacks(sharded):
    d, index = sharded
    index["weight_map"]["model.layers.0.mlp.ghost.weight"] = sorted(
        set(index["weight_map"].values()))[0]
    _write_index(d, index)
    with pytest.raises(CheckpointError, match="holds no such tensor") as e:
        ckpt.locate(d)
    assert "'model.layers.0.mlp.ghost.weight'" in str(e.value)


def test_the_index_decides_which_copy_of_a_tensor_loads(sharded):
    """A tensor in two shards loads from the one the index names, whichever file is read last;
    the other copy (and a tensor no index entry names) is reported, not silently taken."""
    d, index = sharded
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2
    name = next(n for n, f in index["weight_map"].items() if f == files[0])
    for f in files[1:]:                       # a stale, different copy in every other shard
        t = load_file(d / f)
        t[name] = torch.full_like(load_file(d / files[0])[name], 7.0)
        t["stray.weight"] = torch.zeros(2)
        save_file(t, d / f, metadata={"format": "pt"})
    with pytest.warns(CheckpointWarning, match="not assigned to that shard") as w:
        records = ckpt.locate(d).records
    assert "stray.weight" in str(w[0].message)
    assert records[name].path == str(d / files[0])
    assert "stray.weight" not in records


def _legacy_and_zip(tmp_path, state):
    legacy, modern = tmp_path / "legacy", tmp_path / "zip"
    for d in (legacy, modern):
        d.mkdir()
    torch.save(state, legacy / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    torch.save(state, modern / "pytorch_model.bin")
    return legacy, modern


def test_legacy_non_zip_pickle_loads_when_opted_in(tmp_path):
    state = {"a": torch.randn(3, 4), "b": torch.arange(5)}
    for d in _legacy_and_zip(tmp_path, state):
        ck = ckpt.locate(d, use_safetensors=False)
        got = ckpt.load_pickle_state(ck.pickle_files, ck.pickle_map)
        assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state)


@pytest.mark.parametrize("payload, words", [
    (b"", "cannot be read"),
    (b"not a pickle at all", "cannot be read"),
    (None, "cannot be read"),                  # a pickle of an arbitrary object: refused
    ([1, 2], "not a state dict"),
])
def test_bad_pickle_files_name_the_file(tmp_path, payload, words):
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    f = tmp_path / "pytorch_model.bin"
    if payload is None:
        f.write_bytes(pickle.dumps(Evil()))
    elif isinstance(payload, bytes):
        f.write_bytes(payload)
    else:
        torch.save(payload, f)
    ck = ckpt.locate(tmp_path, use_safetensors=False)
    with pytest.raises(CheckpointError, match=words) as e:
        ckpt.load_pickle_state(ck.pickle_files, ck.pickle_map)
    assert str(f) in str(e.value)


def test_sharded_pickle_follows_its_index(tmp_path):
    torch.save({"a": torch.ones(2), "b": torch.zeros(2)}, tmp_path / "p-1.bin")
    torch.save({"a": torch.full((2,), 9.0), "c": torch.ones(1)}, tmp_path / "p-2.bin")
    (tmp_path / "pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": {"a": "p-1.bin", "b": "p-1.bin", "c": "p-2.bin"}}))
    ck = ckpt.locate(tmp_path, use_safetensors=False)
    got = ckpt.load_pickle_state(ck.pickle_files, ck.pickle_map)
    assert torch.equal(got["a"], torch.ones(2)) and set(got) == {"a", "b", "c"}
    (tmp_path / "pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": {"a": "p-1.bin", "d": "p-2.bin"}}))
    ck = ckpt.locate(tmp_path, use_safetensors=False)
    with pytest.raises(CheckpointError, match="'d' in p-2.bin"):
        ckpt.load_pickle_state(ck.pickle_files, ck.pickle_map)
