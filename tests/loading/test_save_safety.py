"""save_pretrained never deletes, moves or overwrites a file it did not write, and a failure at any
step (an exception or a kill) leaves the previous checkpoint or the new one, never debris.

Most tests save a small CPU module (fast; the save path is the same for XLA tensors, which only
add a gather in ``.cpu()``); one saves a model sharded on the XLA mesh and loads it back with
AutoXLA. "Loads" means what AutoXLA's loader reads: config.json, then the index if there is one,
else model.safetensors (``loading.checkpoint.locate``), every tensor compared exactly.
"""
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

from AutoXLA import saving
from AutoXLA.saving import journal
from AutoXLA.loading.checkpoint import locate

# A user's files, several with names that look like ours; each must survive byte for byte.
USER_FILES = {
    "model-final.safetensors": b"another tool's final weights",
    "model-00001-of-00003.safetensors": b"another tool's shard, named by no index",
    "model-00002-of-00002.safetensors": b"another tool's shard, named by no index either",
    ".model.safetensors.tmp-0123abcd": b"looks like an old temporary of ours",
    ".config.json.tmp-deadbeef": b"looks like an old temporary too",
    ".model.safetensors.autoxla-old-0123456789abcdef": b"looks like one of our backups",
    "notes.txt": b"my notes\n",
    "tokenizer.json": b'{"version": "1.0"}',
    "sub/model.safetensors": b"a subdirectory's file",
    "sub/config.json": b"{}",
}
CHECKPOINT_FILES = {"config.json", "model.safetensors", "model.safetensors.index.json",
                    "generation_config.json"}


class _Config:
    def __init__(self, **d):
        self.d = d

    def to_json_string(self, use_diff=False):
        return json.dumps(self.d, sort_keys=True)


class Net(nn.Module):
    """Six 32x32 linears (4224 bytes each) and a persistent buffer: 1, 3 or 6 shards by size."""

    def __init__(self, seed, generation=True):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        self.register_buffer("scale", torch.randn(3, generator=g))
        self.register_buffer("scratch", torch.zeros(5), persistent=False)
        self.config = _Config(model_type="net", seed=seed)
        if generation:
            self.generation_config = _Config(max_new_tokens=seed)


SIZES = {"single": "1MB", "three": "9KB", "six": "5KB"}   # -> 1, 3, 6 weight files


def expected_state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()
            if not k.endswith("scratch")}


def fill_user_files(d):
    for name, data in USER_FILES.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)


def assert_user_files_intact(d):
    for name, data in USER_FILES.items():
        assert (d / name).read_bytes() == data, f"{name} was changed"


def read_checkpoint(d):
    """(config dict, tensors) as the loader sees the directory, or None when it has no config."""
    if not (d / "config.json").exists():
        return None
    config = json.loads((d / "config.json").read_text())
    from safetensors import safe_open

    out = {}
    for f in sorted({r.path for r in locate(d).records.values()}):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                assert k not in out, f"{k} twice"
                out[k] = st.get_tensor(k)
    return config, out


def same(loaded, model):
    config, tensors = loaded
    want = expected_state(model)
    return (config == model.config.d and tensors.keys() == want.keys()
            and all(torch.equal(tensors[k], want[k]) for k in want))


def checkpoint_names(d):
    """The files the checkpoint in ``d`` consists of (config, generation config, index, shards)."""
    names = {n for n in ("config.json", "generation_config.json") if (d / n).exists()}
    index = d / "model.safetensors.index.json"
    if index.exists():
        names |= {index.name} | set(json.loads(index.read_text())["weight_map"].values())
    elif (d / "model.safetensors").exists():
        names.add("model.safetensors")
    return names


def assert_clean(d):
    """Nothing in ``d`` but the user's files and the files of the checkpoint it holds."""
    top = {n.split("/")[0] for n in USER_FILES}
    extra = set(os.listdir(d)) - top - checkpoint_names(d)
    assert not extra, f"left behind: {sorted(extra)}"


# --- max_shard_size ---------------------------------------------------------------------------

@pytest.mark.parametrize("size, expected", [
    (1, 1), (123, 123), ("123", 123), ("2GB", 2 * 10**9), ("500MB", 500 * 10**6),
    ("1.5GiB", 3 * 2**29), (" 20 kb ", 20_000), (".5KiB", 512), ("7B", 7),
    (2**70, 2**62), ("9" * 40 + "GB", 2**62), ("5" * 5000, 2**62),
])
def test_shard_sizes_are_parsed_exactly_and_capped(size, expected):
    assert saving.parse_size(size) == expected


@pytest.mark.parametrize("size, why", [
    ("1e400GB", "is not a size"), ("GB", "is not a size"), ("-5MB", "is negative"),
    ("nan", "is not a size"), ("inf", "is not a size"), ("", "is not a size"),
    ("5XB", "is not a size"), (-5, "is -5 bytes"), (0, "is 0 bytes"), ("0.0001KB", "is 0 bytes"),
    (True, "is a bool"), (False, "is a bool"), (1.5, r"\(float\) is not a size"),
    (float("nan"), r"\(float\) is not a size"), (float("inf"), r"\(float\) is not a size"),
    (None, r"\(NoneType\) is not a size"),
])
def test_bad_shard_sizes_are_refused_with_the_value_and_an_example(size, why, tmp_path):
    with pytest.raises(ValueError, match=rf"max_shard_size=.* {why}.*e\.g\. .*'2GB'"):
        saving.save_pretrained(Net(0), tmp_path / "out", max_shard_size=size)
    assert not (tmp_path / "out").exists()    # refused before anything is written


# --- successful saves -------------------------------------------------------------------------

def test_user_files_survive_every_change_of_layout(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    fill_user_files(d)
    for i, layout in enumerate(["three", "single", "six", "three", "three", "single", "single"]):
        model = Net(i, generation=i != 4)
        saving.save_pretrained(model, d, max_shard_size=SIZES[layout])
        assert same(read_checkpoint(d), model), layout
        assert_user_files_intact(d)
        assert_clean(d)
        shards = [n for n in checkpoint_names(d) if n.endswith(".safetensors")]
        assert len(shards) == {"single": 1, "three": 3, "six": 6}[layout]
        if layout == "three":   # model-00001-of-00003 is the user's: ours are named apart
            assert all(n.endswith(".safetensors") and len(n.split("-")) == 5 for n in shards)
        if layout == "six":
            assert sorted(shards) == [f"model-{k:05d}-of-00006.safetensors" for k in range(1, 7)]
        if layout == "single":
            assert not (d / "model.safetensors.index.json").exists()
    # A model without a generation config leaves the previous generation_config.json alone.
    assert json.loads((d / "generation_config.json").read_text()) == {"max_new_tokens": 6}


def test_another_tools_checkpoint_is_replaced_but_nothing_its_index_does_not_name(tmp_path):
    from safetensors.torch import save_file

    d = tmp_path / "ckpt"
    d.mkdir()
    fill_user_files(d)
    names = ["weights-a.safetensors", "weights-b.safetensors"]
    for n in names:
        save_file({"x": torch.ones(2)}, str(d / n))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": names[0], "y": names[1], "z": "missing.safetensors"}}))
    (d / "config.json").write_text('{"model_type": "other"}')
    model = Net(1)
    saving.save_pretrained(model, d, max_shard_size=SIZES["single"])
    assert same(read_checkpoint(d), model)
    assert not any((d / n).exists() for n in names), "the previous index's shards are stale"
    assert_user_files_intact(d)
    assert_clean(d)


def test_index_names_that_leave_the_directory_are_never_touched(tmp_path):
    d = tmp_path / "ckpt"
    (d / "sub").mkdir(parents=True)
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"outside")
    (d / "sub" / "x.safetensors").write_bytes(b"in a subdirectory")
    (d / "notes.txt").write_bytes(b"notes")
    (d / "dir.safetensors").mkdir()
    bad = ["../outside.safetensors", "sub/x.safetensors", str(outside), "notes.txt",
           "dir.safetensors", ".."]
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {f"t{i}": n for i, n in enumerate(bad)}}))
    model = Net(2)
    with pytest.warns(UserWarning, match=r"names .* which are not weight files .* they are kept"):
        saving.save_pretrained(model, d, max_shard_size=SIZES["six"])
    assert same(read_checkpoint(d), model)
    assert outside.read_bytes() == b"outside"
    assert (d / "sub" / "x.safetensors").read_bytes() == b"in a subdirectory"
    assert (d / "notes.txt").read_bytes() == b"notes" and (d / "dir.safetensors").is_dir()


def test_an_unreadable_index_is_replaced_and_warned_about(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "model.safetensors.index.json").write_text("{not json")
    (d / "model-00001-of-00002.safetensors").write_bytes(b"kept")
    with pytest.warns(UserWarning, match=r"not a readable index .* kept"):
        saving.save_pretrained(Net(3), d, max_shard_size=SIZES["single"])
    assert same(read_checkpoint(d), Net(3))
    assert (d / "model-00001-of-00002.safetensors").read_bytes() == b"kept"


def test_a_fifo_named_like_the_index_does_not_hang_the_save(tmp_path):
    """Reading the previous index must not block: a FIFO is reported and replaced like any
    unreadable index (in a thread, so that a regression fails instead of hanging the suite)."""
    import threading

    d = tmp_path / "ckpt"
    d.mkdir()
    os.mkfifo(d / "model.safetensors.index.json")
    outcome = []

    def save():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            saving.save_pretrained(Net(3), d, max_shard_size=SIZES["single"])
        outcome.append([str(w.message) for w in caught])

    t = threading.Thread(target=save, daemon=True)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "save_pretrained blocked on a FIFO named like the index"
    assert any("not a readable index" in m and "FIFO" in m for m in outcome[0]), outcome
    assert same(read_checkpoint(d), Net(3))


def test_a_directory_where_a_file_goes_is_refused_untouched(tmp_path):
    d = tmp_path / "ckpt"
    (d / "config.json").mkdir(parents=True)
    (d / "config.json" / "inside").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"config.json is a directory .* move it"):
        saving.save_pretrained(Net(0), d)
    assert sorted(os.listdir(d)) == ["config.json"]
    assert (d / "config.json" / "inside").read_bytes() == b"x"


# --- injected failures ------------------------------------------------------------------------

class Injector:
    """Makes one operation raise at its k-th call (``persistent``: at every call from the k-th)."""

    def __init__(self, monkeypatch, op, k, persistent=False):
        import safetensors.torch

        self.calls, self.fired = 0, False
        owner, attr = {"replace": (os, "replace"), "rename": (os, "rename"),
                       "unlink": (os, "unlink"), "fsync": (os, "fsync"),
                       "save_file": (safetensors.torch, "save_file"),
                       "write_text": (journal, "_write_text")}[op]
        real = getattr(owner, attr)

        def failing(*args, **kwargs):
            self.calls += 1
            if self.calls == k or (persistent and self.calls > k):
                self.fired = True
                raise OSError(errno.EIO, f"injected failure of {op} #{self.calls}")
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, attr, failing)


def _template(tmp_path, before):
    """A directory with the user's files and (unless ``before`` is None) a checkpoint."""
    d = tmp_path / "template"
    d.mkdir()
    fill_user_files(d)
    old = None
    if before is not None:
        old = Net(10)
        saving.save_pretrained(old, d, max_shard_size=SIZES[before])
    return d, old


TRANSITIONS = [("three", "single"), ("single", "six"), ("six", "three"), (None, "three")]
OPS = ["replace", "rename", "unlink", "fsync", "save_file", "write_text"]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("before, after", TRANSITIONS)
def test_a_failure_at_any_step_leaves_the_old_or_the_new_checkpoint(op, before, after, tmp_path,
                                                                    monkeypatch):
    template, old = _template(tmp_path, before)
    new = Net(20)
    raised = 0
    for k in range(1, 200):
        d = tmp_path / f"k{k}"
        shutil.copytree(template, d, symlinks=True)
        with monkeypatch.context() as m, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            injector = Injector(m, op, k)
            try:
                saving.save_pretrained(new, d, max_shard_size=SIZES[after])
                failed = False
            except OSError as e:
                assert "injected failure" in str(e)
                failed = True
        assert not [w for w in caught if "save_pretrained" in str(w.message)], caught
        loaded = read_checkpoint(d)
        if failed:   # rolled back: the previous checkpoint exactly, or still no checkpoint
            raised += 1
            assert (loaded is None) if old is None else same(loaded, old), f"{op} #{k}"
        else:        # the failure was after the commit point, or retried in the cleanup
            assert same(loaded, new), f"{op} #{k}"
        assert_user_files_intact(d)
        assert_clean(d)
        shutil.rmtree(d)
        if not injector.fired:
            break
    else:
        pytest.fail("the save never finished without reaching the injected call")
    # Every operation but unlink (used only to clean up, where it is retried) is used before the
    # commit point: its failure must have been seen and rolled back.
    assert raised > 0 or op == "unlink"
    assert k > 1, "the operation was never called"


@pytest.mark.parametrize("op, k", [("save_file", 1), ("rename", 2), ("replace", 3)])
def test_an_interrupt_is_rolled_back_like_an_error(op, k, tmp_path, monkeypatch):
    d, old = _template(tmp_path, "three")
    import safetensors.torch

    owner, attr = {"save_file": (safetensors.torch, "save_file"), "rename": (os, "rename"),
                   "replace": (os, "replace")}[op]
    real, calls = getattr(owner, attr), [0]

    def interrupted(*args, **kwargs):
        calls[0] += 1
        if calls[0] == k:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(owner, attr, interrupted)
        with pytest.raises(KeyboardInterrupt):
            saving.save_pretrained(Net(20), d, max_shard_size=SIZES["single"])
    assert same(read_checkpoint(d), old)
    assert_user_files_intact(d)
    assert_clean(d)


@pytest.mark.parametrize("op, expected", [
    ("replace", {"refused"}),        # the rollback cannot move config.json back
    ("rename", {"old"}),             # the rollback moves back with os.replace
    ("unlink", {"new"}),             # used only after the commit point
    ("fsync", {"old", "new"}),
])
def test_a_persistent_failure_is_settled_by_the_next_save(op, expected, tmp_path, monkeypatch):
    template, old = _template(tmp_path, "three")
    new, newer = Net(20), Net(30)
    with monkeypatch.context() as m:   # how many calls a save makes
        shutil.copytree(template, tmp_path / "count", symlinks=True)
        counter = Injector(m, op, 0)
        saving.save_pretrained(new, tmp_path / "count", max_shard_size=SIZES["six"])
    total = counter.calls
    outcomes = set()
    for k in sorted({1, 2, total // 2, total - 1, total} - {0}):
        d = tmp_path / f"k{k}"
        shutil.copytree(template, d, symlinks=True)
        with monkeypatch.context() as m, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Injector(m, op, k, persistent=True)
            try:
                saving.save_pretrained(new, d, max_shard_size=SIZES["six"])
                error = None
            except OSError as e:
                error = e
        loaded = read_checkpoint(d)
        journals = [n for n in os.listdir(d) if n.startswith(".autoxla-")]
        notes = "".join(getattr(error, "__notes__", []))
        if error is None:   # committed; leftovers (if any) are said, and journaled
            assert same(loaded, new)
            warned = [w for w in caught if "is saved, but removing" in str(w.message)]
            assert bool(warned) == bool(journals) and len(journals) <= 1
            assert all(j.startswith(".autoxla-commit-") for j in journals)
            if not journals:   # only the last fsync failed, after the journal was removed
                assert_clean(d)
            outcomes.add("new")
        elif loaded is None:   # the rollback could not put config.json back: refused
            assert "could not undo" in notes and "journal" in notes
            assert len(journals) == 1 and (d / "config.json.autoxla-previous").exists()
            outcomes.add("refused")
        else:
            assert same(loaded, old), f"{op} from #{k}: a mixture loads"
            assert len(journals) <= 1 and bool(journals) == ("could not undo" in notes)
            outcomes.add("old")
        assert_user_files_intact(d)
        # With the operation working again, the next save settles the leftovers and succeeds.
        saving.save_pretrained(newer, d, max_shard_size=SIZES["single"])
        assert same(read_checkpoint(d), newer)
        assert_user_files_intact(d)
        assert_clean(d)
    assert expected <= outcomes, outcomes


# --- killed saves -----------------------------------------------------------------------------

_CHILD = textwrap.dedent("""
    import json, os, signal, sys
    sys.path[:0] = json.loads(sys.argv[4])
    from tests.loading import test_save_safety as t
    import safetensors.torch
    from AutoXLA import saving
    from AutoXLA.saving import journal
    k, out, size = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    calls = [0]
    def counted(owner, attr):
        real = getattr(owner, attr)
        def op(*a, **kw):
            calls[0] += 1
            if calls[0] == k:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **kw)
        setattr(owner, attr, op)
    for owner, attr in [(os, "replace"), (os, "rename"), (os, "unlink"), (os, "fsync"),
                        (safetensors.torch, "save_file"), (journal, "_write_text")]:
        counted(owner, attr)
    saving.save_pretrained(t.Net(20), out, max_shard_size=size)
    print(calls[0])
""")


def _child(k, out, size):
    r = subprocess.run([sys.executable, "-c", _CHILD, str(k), str(out), size,
                        json.dumps(sys.path)], capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert r.returncode in (0, -signal.SIGKILL), r.stderr[-3000:]
    return r


def assert_refused_as_interrupted(d):
    """What AutoXLA's loader reads first refuses the directory, saying a save was interrupted."""
    from AutoXLA.modeling.empty import load_config

    with pytest.raises(ValueError, match="no config.json: a save_pretrained into it was "
                                         "interrupted.*save_pretrained into it again"):
        load_config(d)


@pytest.mark.parametrize("before, after", [("three", "single"), ("single", "six")])
def test_a_killed_save_leaves_old_new_or_refused_and_the_next_save_cleans_up(before, after,
                                                                             tmp_path):
    template, old = _template(tmp_path, before)
    new, newer = Net(20), Net(30)
    shutil.copytree(template, tmp_path / "count", symlinks=True)
    total = int(_child(0, tmp_path / "count", SIZES[after]).stdout.split()[-1])
    points = sorted({1, 2, 3} | {total * i // 5 for i in range(1, 5)} | {total - 1, total})
    outcomes = []
    for k in points:
        d = tmp_path / f"k{k}"
        shutil.copytree(template, d, symlinks=True)
        killed = _child(k, d, SIZES[after]).returncode != 0
        assert killed
        assert_user_files_intact(d)
        loaded = read_checkpoint(d)
        if loaded is None:
            assert_refused_as_interrupted(d)
            outcomes.append("refused")
        elif same(loaded, new):
            outcomes.append("new")
        else:
            assert same(loaded, old), f"killed at #{k} of {total}: a mixture loads"
            outcomes.append("old")
        # The next save settles the killed one (its journal) and leaves only the checkpoint.
        saving.save_pretrained(newer, d, max_shard_size=SIZES[before])
        assert same(read_checkpoint(d), newer)
        assert_user_files_intact(d)
        assert_clean(d)
        shutil.rmtree(d)
    assert {"old", "refused", "new"} <= set(outcomes), list(zip(points, outcomes))


def test_a_save_killed_while_settling_an_interrupted_one_is_settled_by_the_next(tmp_path,
                                                                               monkeypatch):
    template, old = _template(tmp_path, "three")
    # An interrupted commit: config.json moved aside, the rollback could not move it back.
    with monkeypatch.context() as m:
        Injector(m, "replace", 1, persistent=True)
        with pytest.raises(OSError, match="injected"):
            saving.save_pretrained(Net(20), template, max_shard_size=SIZES["six"])
    assert read_checkpoint(template) is None
    assert [n for n in os.listdir(template) if n.startswith(".autoxla-commit-")]
    newer = Net(30)
    outcomes = []
    shutil.copytree(template, tmp_path / "count", symlinks=True)
    total = int(_child(0, tmp_path / "count", SIZES["single"]).stdout.split()[-1])
    # Inside the settling of the interrupted save (its first ~20 calls), then in the new save.
    for k in [1, 10, 15, 18, 22, total // 2]:
        d = tmp_path / f"k{k}"
        shutil.copytree(template, d, symlinks=True)
        assert _child(k, d, SIZES["single"]).returncode != 0
        assert_user_files_intact(d)
        loaded = read_checkpoint(d)
        if loaded is None:
            assert_refused_as_interrupted(d)
            outcomes.append("refused")
        else:   # settled back to the previous checkpoint before the kill, never a mixture
            assert same(loaded, old), f"killed at #{k}: a mixture loads"
            outcomes.append("old")
        saving.save_pretrained(newer, d, max_shard_size=SIZES["six"])
        assert same(read_checkpoint(d), newer)
        assert_user_files_intact(d)
        assert_clean(d)
        shutil.rmtree(d)
    assert {"refused", "old"} <= set(outcomes), outcomes


# --- journals ---------------------------------------------------------------------------------

def test_journals_are_trusted_only_if_they_are_ours(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    fill_user_files(d)
    token = "0123456789abcdef"
    torn = d / f".autoxla-save-{token}.json"
    torn.write_text(journal._Journal.head(token)[:17])          # killed while writing it
    forged = d / ".autoxla-commit-fedcba9876543210.json"        # lists the user's files
    forged.write_text(json.dumps({journal._MAGIC: 1, "token": "0000000000000000", "files": [
        {"final": "config.json", "temp": ".config.json.tmp-deadbeef", "backup": None},
        {"final": "model-final.safetensors", "temp": None, "backup": "notes.txt"}]}))
    alien = d / ".autoxla-save-aaaaaaaaaaaaaaaa.json"
    alien.write_text("my own file with that name")
    with pytest.warns(UserWarning, match="not a journal AutoXLA wrote; it is kept"):
        saving.save_pretrained(Net(4), d, max_shard_size=SIZES["six"])
    assert same(read_checkpoint(d), Net(4))
    assert not torn.exists()
    assert forged.exists() and alien.read_text() == "my own file with that name"
    assert_user_files_intact(d)


def test_a_save_while_another_runs_is_refused(tmp_path):
    import fcntl

    d = tmp_path / "ckpt"
    saving.save_pretrained(Net(5), d)
    running = d / ".autoxla-save-00000000000000aa.json"
    running.write_text("{}")
    with open(running) as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        with pytest.raises(saving.SaveInProgressError, match=r"another save_pretrained .* wait"):
            saving.save_pretrained(Net(6), d)
    assert same(read_checkpoint(d), Net(5))


# --- the real loader --------------------------------------------------------------------------

def test_a_sharded_model_saved_among_look_alikes_loads_back_in_autoxla(checkpoints, tmp_path,
                                                                       xla_devices):
    from AutoXLA import backend
    from AutoXLA.modeling import AutoXLAModelForCausalLM

    def load(path):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoXLAModelForCausalLM.from_pretrained(path, sharding_strategy="2d")

    d = tmp_path / "ckpt"
    d.mkdir()
    fill_user_files(d)
    saving.save_pretrained(Net(7), d, max_shard_size=SIZES["single"])   # a previous checkpoint
    model = load(checkpoints["llama"])
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        before = model(input_ids=ids.to(backend.device())).logits.cpu()
    model.save_pretrained(d, max_shard_size="100KB")
    assert_user_files_intact(d)
    assert_clean(d)
    assert not (d / "model.safetensors").exists()
    with torch.no_grad():
        after = load(d)(input_ids=ids.to(backend.device())).logits.cpu()
    assert torch.equal(after, before)
