"""Training checkpoints under contention and damage (issue 27): one writer per directory, steps
committed only when complete, any step number, a damaged step refused before it touches the
model, stray files ignored. Plain CPU tensors: the directory logic is the same for XLA ones, and
these run in seconds."""
import json
import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from AutoXLA.saving.training import LOCK, TrainingCheckpointError, TrainingCheckpoints


def _trained(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 16)).square().mean().backward()
    opt.step()
    return model, opt


def _state(model, opt):
    """Copies of everything a restore could change."""
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {i: {k: v.clone() for k, v in e.items()} for i, e in opt.state_dict()["state"].items()})


def _same(a, b) -> bool:
    (ma, oa), (mb, ob) = a, b
    return (all(torch.equal(ma[k], mb[k]) for k in ma)
            and all(torch.equal(oa[i][k], ob[i][k]) for i in oa for k in oa[i]))


# Each saver process says it is ready, waits for the "go" file, then tries to save steps 1..40
# into one directory.
_SAVER = textwrap.dedent("""
    import json, os, sys, time, torch
    from AutoXLA.saving.training import TrainingCheckpoints, TrainingCheckpointError
    root, go = sys.argv[1], sys.argv[2]
    torch.manual_seed(int(sys.argv[3]))
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 16)).sum().backward(); opt.step()
    saves = TrainingCheckpoints(root, keep=5)
    open(go + ".ready" + sys.argv[3], "w").close()
    while not os.path.exists(go):
        time.sleep(0.001)
    saved, refused = [], []
    for step in range(1, 41):
        try:
            saves.save(step, model, opt)
            saved.append(step)
        except TrainingCheckpointError as e:
            refused.append(str(e))
    print(json.dumps({"saved": saved, "refused": refused}))
""")


def test_two_saver_processes_one_writes_the_other_is_refused(tmp_path):
    root, go = tmp_path / "run", tmp_path / "go"
    savers = [subprocess.Popen([sys.executable, "-c", _SAVER, str(root), str(go), str(seed)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for seed in (0, 1)]
    # Both start together: under load one process can take seconds longer to import torch, and
    # one that finished its 40 saves (and exited, freeing the directory) before the other began
    # would leave nothing to refuse.
    deadline = time.time() + 300
    while not all(Path(f"{go}.ready{seed}").exists() for seed in (0, 1)):
        assert time.time() < deadline and all(p.poll() is None for p in savers), \
            [p.communicate()[1][-3000:] for p in savers if p.poll() is not None]
        time.sleep(0.01)
    go.write_text("")
    results = []
    for p in savers:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    winner, loser = sorted(results, key=lambda r: -len(r["saved"]))
    # The first to save owns the directory until it exits; the other is refused every time,
    # with a message naming the holder, and never removed or half-wrote a step of the winner's.
    assert winner["saved"] == list(range(1, 41)) and not winner["refused"]
    assert loser["saved"] == [] and len(loser["refused"]) == 40
    assert all("is being written by process" in m for m in loser["refused"]), loser["refused"][0]
    saves = TrainingCheckpoints(root)
    assert saves.steps() == [36, 37, 38, 39, 40]               # keep=5
    assert sorted(os.listdir(root)) == [LOCK] + [f"step-000000{s}" for s in range(36, 41)]
    for step in saves.steps():
        model, opt = torch.nn.Linear(16, 16), None
        assert saves.restore(model, step=step) == step
    # The winner exited, so its lock went with it: another writer may now save.
    saves.save(41, torch.nn.Linear(16, 16))
    assert saves.latest() == 41


def test_a_second_writer_in_the_same_process_is_refused_until_close(tmp_path):
    model, opt = _trained()
    first = TrainingCheckpoints(tmp_path)
    first.save(1, model, opt)
    second = TrainingCheckpoints(tmp_path)
    with pytest.raises(TrainingCheckpointError, match="one writer at a time"):
        second.save(2, model, opt)
    assert first.steps() == second.steps() == [1]             # reading needs no lock
    first.close()
    second.save(2, model, opt)
    assert second.steps() == [1, 2]


def test_any_step_number_round_trips(tmp_path):
    model, opt = _trained()
    saves = TrainingCheckpoints(tmp_path, keep=2)
    big = [99_999_999, 10**8, 10**12 + 7]                     # 8, 9 and 13 digits
    for step in big:
        assert saves.save(step, model, opt).name == f"step-{step:08d}"
    assert saves.steps() == big[1:] and saves.latest() == big[-1]    # keep=2 pruned the first
    assert saves.restore(*_trained(1)) == big[-1]


def test_a_step_is_committed_only_when_its_data_is_complete(tmp_path, monkeypatch):
    model, opt = _trained()
    saves = TrainingCheckpoints(tmp_path)
    saves.save(1, model, opt)
    real_save = dcp.save

    def loses_a_file(state, storage_writer, planner=None):     # a disk that dropped a write
        real_save(state, storage_writer=storage_writer, planner=planner)
        for f in os.listdir(storage_writer.path):
            if f.endswith(".distcp"):
                os.remove(os.path.join(storage_writer.path, f))

    monkeypatch.setattr(dcp, "save", loses_a_file)
    with pytest.raises(TrainingCheckpointError, match=r"step 2 was not committed: __0_0\.distcp "
                       r"is missing"):
        saves.save(2, model, opt)
    assert saves.steps() == [1]


def _damage_distcp(path, how):
    data = next(f for f in os.listdir(path) if f.endswith(".distcp"))
    if how == "truncated":
        with open(path / data, "r+b") as f:
            f.truncate(100)
    else:
        os.remove(path / data)
    return data


@pytest.mark.parametrize("damage, match", [
    ("truncated", r"step 3 is damaged: __0_0\.distcp is truncated \(100 bytes"),
    ("deleted", r"step 3 is damaged: __0_0\.distcp is missing"),
    ("metadata", r"step 3 is damaged: \.metadata is missing"),
])
def test_a_damaged_step_leaves_model_and_optimizer_as_they_were(tmp_path, damage, match):
    model, opt = _trained()
    saves = TrainingCheckpoints(tmp_path)
    saves.save(2, model, opt)
    saves.save(3, model, opt)
    if damage == "metadata":
        os.remove(saves.path(3) / ".metadata")
    else:
        _damage_distcp(saves.path(3), damage)
    other, other_opt = _trained(seed=5)
    before = _state(other, other_opt)
    with pytest.raises(TrainingCheckpointError, match=match) as e:
        saves.restore(other, other_opt)
    assert "step=N); committed: [2]" in str(e.value)
    assert _same(before, _state(other, other_opt))             # nothing was loaded
    with pytest.raises(TrainingCheckpointError, match="nothing was exported"):
        saves.export_safetensors(tmp_path / "export", step=3)
    assert saves.restore(other, other_opt, step=2) == 2       # the earlier step still works


def test_metadata_another_torch_cannot_read_names_both_versions(tmp_path):
    # What an older torch meets in a newer one's DCP files (the two runtimes' torch 2.9 and
    # 2.14.1 do read each other's: tests/dtensor/test_training.py): metadata it cannot unpickle,
    # said as the version gap with what to do, not as damage
    model, opt = _trained()
    saves = TrainingCheckpoints(tmp_path)
    saves.save(1, model, opt)
    path = saves.path(1)
    manifest = json.loads((path / "autoxla-train.json").read_text())
    assert manifest["saved_by"] == {"runtime": "cpu", "torch": torch.__version__.split("+")[0]}
    manifest["saved_by"] = {"runtime": "dtensor", "torch": "9.1.0"}
    (path / "autoxla-train.json").write_text(json.dumps(manifest))
    (path / ".metadata").write_bytes(b"\x80\x05 not a pickle this torch reads")
    before = _state(model, opt)
    with pytest.raises(TrainingCheckpointError, match=r"step 1 cannot be read here: \.metadata "
                       r"cannot be read .* saved by torch 9\.1\.0 on the dtensor runtime and "
                       r"this is torch .* export_safetensors\(\) there"):
        saves.restore(model, opt)
    assert _same(before, _state(model, opt))


@pytest.mark.parametrize("manifest, match", [
    ("[]", "a JSON list, not an object"),
    ("{", "cannot be read"),
    ('{"format": 1, "step": 4}', "its model entry is not a table"),
    ('{"format": 9, "step": 4, "model": {}}', "format 9, this AutoXLA reads 1"),
    ('{"format": 1, "step": 5, "model": {}, "stacked": {}}', "it says step 5"),
])
def test_a_bad_manifest_is_named_and_its_step_skipped(tmp_path, manifest, match):
    model, opt = _trained()
    saves = TrainingCheckpoints(tmp_path)
    saves.save(3, model, opt)
    saves.save(4, model, opt)
    (saves.path(4) / "autoxla-train.json").write_text(manifest)
    with pytest.warns(RuntimeWarning, match=f"step 4: .*autoxla-train.json .*{match}"):
        assert saves.latest() == 3
    with pytest.raises(TrainingCheckpointError, match=f"step 4: .*{match}"):
        saves.restore(model, opt, step=4)


def test_a_corrupt_optimizer_entry_is_refused_before_loading(tmp_path):
    model, opt = _trained()
    saves = TrainingCheckpoints(tmp_path)
    saves.save(1, model, opt)
    path = saves.path(1) / "autoxla-train.json"
    manifest = json.loads(path.read_text())
    manifest["optimizer"]["groups"] = [{"settings": {}}]       # "params" lost
    path.write_text(json.dumps(manifest))
    with pytest.warns(RuntimeWarning, match="its optimizer entry is malformed"):
        assert saves.steps() == []


def test_stray_files_are_ignored_with_a_warning(tmp_path):
    model, opt = _trained()
    saves = TrainingCheckpoints(tmp_path)
    saves.save(1, model, opt)
    (tmp_path / "step-00000001.replaced").write_text("not a directory")
    (tmp_path / "step-000000001").mkdir()                      # another spelling of step 1
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.warns(RuntimeWarning) as seen:
        assert saves.steps() == [1]
        saves.save(2, model, opt)
        assert saves.latest() == 2
    named = {str(w.message).split(" is not")[0].rsplit("/", 1)[-1] for w in seen}
    assert named == {"step-00000001.replaced", "step-000000001", "notes.txt"}
    assert (tmp_path / "notes.txt").read_text() == "mine"      # never touched
    with warnings.catch_warnings():
        warnings.simplefilter("error")                         # said once per name
        assert saves.steps() == [1, 2]


def test_an_io_error_inside_dcp_is_one_line_naming_the_step(tmp_path, monkeypatch):
    """DCP wraps a reader's failure in a CheckpointException (a BaseException, every rank's
    traceback in its text): it reaches the user as one TrainingCheckpointError line."""
    model, opt = _trained()
    saves = TrainingCheckpoints(tmp_path)
    saves.save(1, model, opt)

    def fails(self, *args, **kwargs):
        raise OSError("Input/output error: the disk went away")

    monkeypatch.setattr(dcp.FileSystemReader, "read_data", fails)
    with pytest.raises(TrainingCheckpointError) as e:
        saves.restore(model, opt)
    message = str(e.value)
    assert message.startswith(f"reading step 1 from {saves.path(1)} failed: ")
    assert "the disk went away" in message and "\n" not in message
    assert "restore again (another step)" in message
